import math

import numpy as np
import pytest

from orbitflow.plan import CostModel, Placement
from orbitflow.plan.cost_model import edf_stalls, preemptive_stalls

# Paper section 2.3: 9 layers, 1.0 compute per layer, 3 blocks per layer-time, b = (3, 6) then (4, 6).
CM = CostModel([1.0] * 9, 3.0)
STEP1, STEP16 = [3, 6], [4, 6]


@pytest.mark.parametrize(
    "dists, stall1, stall16",
    [([3, 3], 3.0, 4.0), ([None, 3], 0.0, 0.0), ([4, 3], 0.0, 2.0 / 3.0)],
    ids=["A", "B", "C"],
)
def test_paper_example_edf(dists, stall1, stall16):
    p = Placement.from_distances(9, dists)
    e1, e16 = CM.step(p, STEP1), CM.step(p, STEP16)
    assert e1.stall_s == pytest.approx(stall1, abs=1e-12)
    assert e16.stall_s == pytest.approx(stall16, abs=1e-12)
    assert e1.compute_s == 9.0
    assert e1.total_s == pytest.approx(9.0 + stall1)
    assert e16.stall_per_layer_s.shape == (9,)
    assert e16.stall_per_layer_s.sum() == pytest.approx(stall16)


def test_paper_example_placement_a_per_layer():
    e = CM.step(Placement.from_distances(9, [3, 3]), STEP1)
    assert np.allclose(e.stall_per_layer_s, [0, 0, 1, 0, 0, 1, 0, 0, 1])


def test_fair_is_algorithm_1_as_printed():
    cm = CostModel([1.0] * 9, 3.0, transfer="fair")
    # the paper's text: placement A moves 9 blocks per offloaded layer and stalls 9 units
    assert cm.step(Placement.from_distances(9, [3, 3]), STEP1).stall_s == pytest.approx(9.0)
    assert cm.step(Placement.from_distances(9, [None, None]), STEP1).stall_s == 0.0


def _reference_edf(comp, host, xfer):
    """Independent event-by-event simulation of the executor's schedule (slow, for checking)."""
    n_req, n_layers = host.shape
    hosts = [list(np.flatnonzero(host[r])) for r in range(n_req)]
    nxt = [0] * n_req
    release = [0.0 if hosts[r] else None for r in range(n_req)]
    arrived = {}
    link_free = 0.0
    t = 0.0
    stalls = []
    for layer in range(n_layers):
        needed = [r for r in range(n_req) if host[r, layer]]
        while any((r, layer) not in arrived for r in needed):
            ready = [r for r in range(n_req) if nxt[r] < len(hosts[r]) and release[r] is not None
                     and release[r] <= link_free + 1e-12]
            if not ready:
                link_free = min(release[r] for r in range(n_req)
                                if nxt[r] < len(hosts[r]) and release[r] is not None)
                continue
            r = min(ready, key=lambda q: (hosts[q][nxt[q]], q))
            link_free += xfer[r]
            arrived[(r, hosts[r][nxt[r]])] = link_free
            nxt[r] += 1
            release[r] = None  # released when the fetched layer finishes
        start = max([t] + [arrived[(r, layer)] for r in needed])
        stalls.append(start - t)
        t = start + comp[layer]
        for r in needed:
            if nxt[r] < len(hosts[r]):
                release[r] = t
    return stalls


def _random_case(rng: np.random.Generator):
    """A random batch: per-layer compute, a host mask [R, L], blocks per layer, and a cost model."""
    n_req, n_layers = int(rng.integers(1, 6)), int(rng.integers(1, 14))
    comp = rng.uniform(0.5, 2.0, n_layers)
    host = rng.random((n_req, n_layers)) < rng.uniform(0.1, 0.9)
    b = rng.integers(1, 30, n_req).astype(float)
    return comp, host, b, CostModel(comp, float(rng.uniform(2, 40)))


def test_edf_abort_above_only_stops_steps_that_are_slower():
    rng = np.random.default_rng(11)
    stopped = 0
    for _ in range(300):
        comp, host, b, cm = _random_case(rng)
        hosts = [np.flatnonzero(row).tolist() for row in host]
        xfer = (b / cm.link_blocks_per_s).tolist()
        full = edf_stalls(comp, hosts, xfer)
        total = comp.sum() + sum(full)
        for limit in (total * 0.9, total * (1 - 1e-9), total * (1 + 1e-9), math.inf):
            got = edf_stalls(comp, hosts, xfer, abort_above=limit)
            if got is None:
                assert total > limit
                stopped += 1
            else:
                assert got == full
    assert stopped > 100


def test_edf_matches_reference_simulation_random():
    rng = np.random.default_rng(3)
    for _ in range(200):
        comp, host, b, cm = _random_case(rng)
        got = cm.step(Placement.from_mask(~host), b).stall_per_layer_s
        ref = _reference_edf(comp, host, b / cm.link_blocks_per_s)
        assert np.allclose(got, ref, atol=1e-9)


def test_no_offload_has_no_stall_and_all_offload_single_request_serialises():
    cm = CostModel([1.0] * 4, 2.0)
    assert cm.step(Placement.from_distances(4, [None, None]), [5, 7]).stall_s == 0.0
    # one request, all layers on host, 2 blocks per layer at 2 blocks/s: 1 s transfer, 1 s compute each,
    # and the next fetch waits for the previous layer: 1 + (1 + 1) * 3 + 1 = 8 s.
    assert cm.step(Placement.from_distances(4, [1]), [2]).total_s == pytest.approx(8.0)


def test_token_dependent_compute_and_updates():
    cm = CostModel(lambda tok: np.full(3, 1e-3 * (1 + tok / 1000)), 100.0)
    assert cm.depends_on_tokens
    p = Placement.from_distances(3, [None])
    with pytest.raises(ValueError):
        cm.step(p, [4])
    assert cm.step(p, [4], total_tokens=1000).compute_s == pytest.approx(6e-3)
    cm2 = cm.with_updates(layer_compute_scale=2.0, link_blocks_per_s=50.0)
    assert cm2.step(p, [4], total_tokens=1000).compute_s == pytest.approx(12e-3)
    assert cm2.link_blocks_per_s == 50.0 and cm.link_blocks_per_s == 100.0  # original untouched
    fixed = CostModel([1.0, 2.0], 1.0).with_updates(layer_compute_scale=[1.0, 0.5])
    assert np.allclose(fixed.compute(), [1.0, 1.0])


def test_cost_model_bad_inputs():
    with pytest.raises(ValueError, match="link_blocks_per_s must be > 0"):
        CostModel([1.0], 0.0)
    with pytest.raises(ValueError, match="transfer must be one of"):
        CostModel([1.0], 1.0, transfer="magic")
    with pytest.raises(ValueError, match="placement has 3 layers, cost model 2"):
        CostModel([1.0, 1.0], 1.0).step(Placement.from_distances(3, [None]), [1])


def _edf_stalls_reference(comp, hosts, xfer):
    """The former ``edf_stalls``: a linear scan over requests at every link decision (O(transfers x R))."""
    inf = float("inf")
    n_layers = len(comp)
    n_req = len(hosts)
    big = (n_layers + 1) * (n_req + 1)
    need_at = [[] for _ in range(n_layers)]
    release_at = [[] for _ in range(n_layers)]
    for r, hl in enumerate(hosts):
        for layer in hl:
            need_at[layer].append(r)
    lens = [len(h) for h in hosts]
    ptr = [0] * n_req
    rel = [0.0 if lens[r] else inf for r in range(n_req)]
    key = [hosts[r][0] * n_req + r if lens[r] else big for r in range(n_req)]
    last_done = [0.0] * n_req
    stall = [0.0] * n_layers
    t_link = 0.0
    t_prev = 0.0
    reqs = [r for r in range(n_req) if lens[r]]
    for layer in range(n_layers):
        rs = need_at[layer]
        if rs:
            ready = 0.0
            for r in rs:
                target = layer * n_req + r
                while key[r] == target:
                    thr = t_link + 1e-12 + 1e-9 * t_link
                    best = big
                    q_best = -1
                    for q in reqs:
                        if rel[q] <= thr and key[q] < best:
                            best = key[q]
                            q_best = q
                    if q_best < 0:
                        t_link = min(rel[q] for q in reqs)
                        thr = t_link + 1e-12 + 1e-9 * t_link
                        for q in reqs:
                            if rel[q] <= thr and key[q] < best:
                                best = key[q]
                                q_best = q
                    t_link += xfer[q_best]
                    last_done[q_best] = t_link
                    release_at[best // n_req].append(q_best)
                    p = ptr[q_best] + 1
                    ptr[q_best] = p
                    rel[q_best] = inf
                    key[q_best] = hosts[q_best][p] * n_req + q_best if p < lens[q_best] else big
                if last_done[r] > ready:
                    ready = last_done[r]
            if ready > t_prev:
                stall[layer] = ready - t_prev
                t_prev = ready
        t_prev += comp[layer]
        for q in release_at[layer]:
            if key[q] != big:
                rel[q] = t_prev
    return stall


def _fuzz_edf_instance(rng: np.random.Generator):
    """Random (comp, hosts, xfer) with empty / full / periodic / random host rows, zeros, ties and values
    whose sums land within the 1e-12 release tolerance of each other."""
    n_req, n_layers = int(rng.integers(1, 9)), int(rng.integers(1, 41))
    mode = int(rng.integers(5))
    if mode == 0:  # a few decimal values: sums differ by rounding only (0.1 + 0.2 vs 0.3)
        pool = np.array([0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0])
        comp, xfer = rng.choice(pool, n_layers), rng.choice(pool, n_req)
    elif mode == 1:  # small integers: exact ties between link and compute times
        comp, xfer = rng.integers(0, 4, n_layers).astype(float), rng.integers(0, 4, n_req).astype(float)
    elif mode == 2:  # integer multiples nudged around the release tolerance
        base = float(rng.choice([1e-3, 0.1, 1.0, 7.0]))
        eps = float(rng.choice([0.0, 1e-13, 5e-13, 1e-12, 2e-12, 1e-10, 1e-9]))
        comp = np.maximum(base * rng.integers(0, 4, n_layers) + eps * rng.integers(-3, 4, n_layers), 0.0)
        xfer = np.maximum(base * rng.integers(0, 4, n_req) + eps * rng.integers(-3, 4, n_req), 0.0)
    else:  # continuous, with some zeros and repeated values
        comp, xfer = rng.uniform(0.0, 2.0, n_layers), rng.uniform(0.0, 2.0, n_req)
        comp[rng.random(n_layers) < 0.1] = 0.0
        xfer[rng.random(n_req) < 0.1] = 0.0
        if mode == 4:
            comp[rng.random(n_layers) < 0.3] = comp[0]
            xfer[rng.random(n_req) < 0.3] = xfer[0]
    hosts = []
    for _ in range(n_req):
        u = rng.random()
        if u < 0.15:
            hosts.append([])
        elif u < 0.3:
            hosts.append(list(range(n_layers)))
        elif u < 0.5:
            d = int(rng.integers(1, 9))
            hosts.append(list(range(d - 1, n_layers, d)))
        else:
            hosts.append(np.flatnonzero(rng.random(n_layers) < rng.random()).tolist())
    return comp.tolist(), hosts, xfer.tolist()


def test_edf_stalls_matches_reference_fuzz():
    rng = np.random.default_rng(2024)
    for _ in range(5000):
        comp, hosts, xfer = _fuzz_edf_instance(rng)
        got = edf_stalls(comp, hosts, xfer)
        ref = _edf_stalls_reference(comp, hosts, xfer)
        assert len(got) == len(ref)
        for g, e in zip(got, ref):
            assert abs(g - e) <= 1e-12 * abs(e) + 1e-15, (comp, hosts, xfer, got, ref)


def test_edf_stalls_edge_cases_and_array_inputs():
    assert edf_stalls([], [], []) == []
    assert edf_stalls([1.0, 2.0], [], []) == [0.0, 0.0]
    assert edf_stalls([1.0, 2.0], [[], []], [1.0, 2.0]) == [0.0, 0.0]
    assert edf_stalls([1.0], [[0]], [3.0]) == [3.0]
    rng = np.random.default_rng(7)
    for _ in range(50):
        comp, hosts, xfer = _fuzz_edf_instance(rng)
        ref = _edf_stalls_reference(comp, hosts, xfer)
        assert edf_stalls(np.array(comp), hosts, np.array(xfer)) == ref
        assert edf_stalls(tuple(comp), [tuple(h) for h in hosts], tuple(xfer)) == ref


def test_edf_stalls_release_tolerance_boundary():
    # request 0 moves layer 0 (the link is busy until t), its layer-1 transfer is released when layer 0
    # ends; request 1's layer-2 transfer (5 s) is ready from t=0. At t the link takes request 0's transfer
    # iff it is released by the threshold t + 1e-12 + 1e-9 * t (inclusive), else request 1's first, and
    # layer 1 then waits for it too (stall t vs t + 5).
    for t in (0.0, 1.0, 3.7):
        thr = t + 1e-12 + 1e-9 * t
        for c0, waits in ((thr - t, False), (math.nextafter(thr, math.inf) - t, True)):
            assert t + c0 > t
            comp, hosts, xfer = [c0, 1.0, 1.0], [[0, 1], [2]], [t, 5.0]
            got = edf_stalls(comp, hosts, xfer)
            assert got == _edf_stalls_reference(comp, hosts, xfer)
            assert (got[1] > t + 4.0) is waits


def test_edf_stalls_matches_reference_with_negative_compute():
    # not physical, but the function is defined for it (release times then go backwards)
    rng = np.random.default_rng(11)
    for _ in range(2000):
        comp, hosts, xfer = _fuzz_edf_instance(rng)
        comp = (np.asarray(comp) - rng.uniform(0.0, 1.0, len(comp))).tolist()
        assert edf_stalls(comp, hosts, xfer) == _edf_stalls_reference(comp, hosts, xfer)


# -- prefetch depth -------------------------------------------------------------------------------------
def _reference_edf_slots(comp, host, xfer, slots):
    """Independent event-by-event simulation of the executor's schedule with ``slots`` prefetch slots per
    request: transfer ``k`` of request ``r`` (its k-th host layer) is released at 0 when ``k < slots``, else
    when its ``(k - slots)``-th host layer has finished; the link moves the released transfer needed earliest."""
    n_req, n_layers = host.shape
    hosts = [list(np.flatnonzero(host[r])) for r in range(n_req)]
    release = {(r, k): 0.0 for r in range(n_req) for k in range(min(slots, len(hosts[r])))}
    moved = set()
    arrived = {}
    link_free = 0.0
    t = 0.0
    stalls = []
    for layer in range(n_layers):
        needed = [r for r in range(n_req) if host[r, layer]]
        while any((r, layer) not in arrived for r in needed):
            waiting = [(rk, rel) for rk, rel in release.items() if rk not in moved]
            ready = [rk for rk, rel in waiting if rel <= link_free + 1e-12]
            if not ready:
                link_free = min(rel for _, rel in waiting)
                continue
            r, k = min(ready, key=lambda rk: (hosts[rk[0]][rk[1]], rk[0]))
            moved.add((r, k))
            link_free += xfer[r]
            arrived[(r, hosts[r][k])] = link_free
        start = max([t] + [arrived[(r, layer)] for r in needed])
        stalls.append(start - t)
        t = start + comp[layer]
        for r in needed:
            k = hosts[r].index(layer) + slots
            if k < len(hosts[r]):
                release[(r, k)] = t
    return stalls


def test_reference_with_one_slot_is_the_single_slot_reference():
    rng = np.random.default_rng(5)
    for _ in range(100):
        comp, host, b, cm = _random_case(rng)
        x = b / cm.link_blocks_per_s
        assert np.allclose(_reference_edf_slots(comp, host, x, 1), _reference_edf(comp, host, x), atol=1e-9)


@pytest.mark.parametrize("slots", [2, 3])
def test_edf_with_deeper_prefetch_matches_reference(slots):
    rng = np.random.default_rng(20 + slots)
    for _ in range(200):
        comp, host, b, cm = _random_case(rng)
        deep = CostModel(comp, cm.link_blocks_per_s, prefetch_slots=slots)
        got = deep.step(Placement.from_mask(~host), b).stall_per_layer_s
        ref = _reference_edf_slots(comp, host, b / cm.link_blocks_per_s, slots)
        assert np.allclose(got, ref, atol=1e-9)
        # a deeper prefetch never makes the step slower here: one more slot only releases transfers earlier
        one = cm.step(Placement.from_mask(~host), b).total_s
        assert deep.step(Placement.from_mask(~host), b).total_s <= one + 1e-9


def test_paper_example_unchanged_at_depth_one():
    """Section 2.3 at an explicit depth of 1: the same stalls as the default model (test_paper_example_edf)."""
    cm = CostModel([1.0] * 9, 3.0, prefetch_slots=1)
    for dists, stall1, stall16 in (([3, 3], 3.0, 4.0), ([None, 3], 0.0, 0.0), ([4, 3], 0.0, 2.0 / 3.0)):
        assert cm.step(Placement.from_distances(9, dists), STEP1).stall_s == pytest.approx(stall1, abs=1e-12)
        assert cm.step(Placement.from_distances(9, dists), STEP16).stall_s == pytest.approx(stall16, abs=1e-12)


def test_depth_two_overlaps_the_next_layer_with_this_layers_compute():
    """DeepSpeed's pipelining (paper 5.1, Baselines 1): layer i+1 moves while layer i runs. One request, every
    layer on the host, 1 s per transfer and per layer: depth 1 serialises (1 + 2 * 3 + 1 = 8 s), depth 2 pays
    only the first transfer (1 + 4 = 5 s) and stalls only at layer 0."""
    p = Placement.from_distances(4, [1])
    assert CostModel([1.0] * 4, 2.0).step(p, [2]).total_s == pytest.approx(8.0)
    deep = CostModel([1.0] * 4, 2.0, prefetch_slots=2).step(p, [2])
    assert deep.total_s == pytest.approx(5.0)
    assert np.allclose(deep.stall_per_layer_s, [1.0, 0.0, 0.0, 0.0])
    # with transfers longer than compute the link is the bottleneck: 4 transfers of 2 s back to back + 1 s
    assert CostModel([1.0] * 4, 1.0, prefetch_slots=2).step(p, [2]).total_s == pytest.approx(9.0)


def test_host_layer_compute_is_compute_that_a_busy_link_hides():
    """A layer that reads prefetched KV computes ``host_layer_s`` longer (the copy thread's work beside it): a
    compute-bound step pays it on every such layer, a link-bound one hides it under the link like any compute."""
    p = Placement.from_distances(4, [1])  # every layer on the host, depth 2
    # compute-bound: 0.5 s transfers, 1 s layers: only layer 0 stalls (0.5 s); 4 * (1 + 0.25) + 0.5
    fast = CostModel([1.0] * 4, 4.0, prefetch_slots=2, host_layer_s=0.25).step(p, [2])
    assert fast.total_s == pytest.approx(5.5) and fast.stall_s == pytest.approx(0.5)
    assert np.allclose(fast.compute_per_layer_s, 1.25)
    # link-bound: 2 s transfers back to back (8 s), then the last layer: the extra only shows there
    slow = CostModel([1.0] * 4, 1.0, prefetch_slots=2, host_layer_s=0.25).step(p, [2])
    assert slow.total_s == pytest.approx(9.25)
    assert CostModel([1.0] * 4, 1.0, prefetch_slots=2).step(p, [2]).total_s == pytest.approx(9.0)
    # a layer whose KV is on the device for every request pays nothing
    half = Placement.from_mask(np.array([[True, False, True, False], [True, True, True, False]]))
    cm = CostModel([1.0] * 4, 1e9, host_layer_s=0.25)
    assert cm.step(half, [2, 2]).compute_s == pytest.approx(4.5)
    assert cm.added_s(half.host, [2, 2], cm.compute()) == pytest.approx(0.5, abs=1e-6)
    assert cm.with_updates(link_blocks_per_s=2.0).host_layer_s == 0.25
    with pytest.raises(ValueError, match="host_layer_s"):
        CostModel([1.0], 1.0, host_layer_s=-1.0)

def test_base_layer_compute_takes_off_the_extra_that_host_layer_compute_adds():
    """Measured compute fed back into the model (the controller's EWMA, the fidelity benchmark's transfer split)
    holds the host layers' extra; taking it off gives the model's own compute back, never below zero."""
    half = Placement.from_mask(np.array([[True, False, True, False], [True, True, True, False]]))
    cm = CostModel([1.0, 2.0, 3.0, 4.0], 1e9, host_layer_s=0.25)
    measured = cm.step(half, [2, 2]).compute_per_layer_s
    assert np.allclose(measured, [1.0, 2.25, 3.0, 4.25])
    assert np.allclose(cm.base_layer_compute(measured, half.host.any(axis=0)), [1.0, 2.0, 3.0, 4.0])
    assert np.allclose(cm.base_layer_compute([0.1, 0.1], [True, False]), [0.0, 0.1])
    assert np.allclose(CostModel([1.0, 1.0], 1.0).base_layer_compute([1.5, 1.5], [True, True]), [1.5, 1.5])



def test_prefetch_slots_validated_and_carried_by_updates():
    with pytest.raises(ValueError, match="prefetch_slots"):
        CostModel([1.0], 1.0, prefetch_slots=0)
    with pytest.raises(ValueError, match="prefetch_slots"):
        CostModel([1.0], 1.0, transfer="fair", prefetch_slots=2)
    cm = CostModel([1.0, 1.0], 1.0, prefetch_slots=2)
    assert cm.with_updates(link_blocks_per_s=2.0).prefetch_slots == 2
    assert cm.with_updates(prefetch_slots=1).prefetch_slots == 1
    with pytest.raises(ValueError, match="slots"):
        edf_stalls([1.0, 1.0], [[0, 1]], [1.0], slots=0)


def test_batch_overhead_prices_each_batch_size_and_is_carried_by_updates():
    """Measured extra compute of batches of 2, 3, 4 requests (not a line: the 4th costs far more), then
    request_overhead_s a request past the table; spread evenly over the layers like the per-request line."""
    cm = CostModel([0.01, 0.01], 1.0, request_overhead_s=0.005, batch_overhead_s=[0.004, 0.008, 0.04])
    assert [cm.batch_extra_s(r) for r in (1, 2, 3, 4, 5, 7)] == pytest.approx([0, 0.004, 0.008, 0.04, 0.045, 0.055])
    assert cm.compute(num_requests=4).tolist() == pytest.approx([0.03, 0.03])
    assert cm.compute(num_requests=1).tolist() == [0.01, 0.01]
    line = CostModel([0.01, 0.01], 1.0, request_overhead_s=0.005)
    assert line.compute(num_requests=4).tolist() == pytest.approx([0.0175, 0.0175])
    assert cm.with_updates(link_blocks_per_s=2.0).batch_overhead_s == (0.004, 0.008, 0.04)
    assert CostModel([0.01], 1.0, batch_overhead_s=[0.002]).compute(num_requests=3).tolist() == pytest.approx([0.012])
    for bad in ([-0.001], [math.nan]):
        with pytest.raises(ValueError, match="batch_overhead_s"):
            CostModel([1.0], 1.0, batch_overhead_s=bad)


def test_edf_is_not_monotone_in_added_copies():
    """Adding a request's copies can shorten the executor's step (a scheduling anomaly), which is why every bound of
    the branch and bound holds for any order of the link, not EDF's alone. Request 0's 5 s copy for layer 2 would
    hold the link when request 1's copy for layer 1 is released at t=2; request 2's copy for layer 1 keeps the link
    busy until then, so request 0's copy goes last and nothing urgent waits behind it."""
    comp, hosts, xfer = [1.0, 3.0, 3.0], [[2], [0, 1]], [5.0, 1.0]
    before = sum(comp) + sum(edf_stalls(comp, hosts, xfer))
    after = sum(comp) + sum(edf_stalls(comp, [*hosts, [1]], [*xfer, 2.0]))
    assert (before, after) == (13.0, 12.0)


def test_edf_is_not_monotone_in_copy_sizes():
    """A longer copy can shorten the executor's step too, so a plan's step can fall as a request's blocks grow, and
    a bound a search proved for a batch does not carry over to the same batch a few tokens later by itself
    (benchmarks/planner.py --sections replan). Request 2's copy for layer 0 runs until t=3 and layer 0 until t=6,
    when request 2's copy for layer 1 is released. Request 1's 2 s copy ends at t=5, so the link takes request 0's
    3 s copy for layer 2 and request 2's urgent one waits behind it until t=8; a 3 s copy ends at t=6, just as the
    urgent one is released, and EDF takes it first."""
    comp, hosts = [3.0, 2.0, 1.0], [[2], [1], [0, 1]]
    short = sum(comp) + sum(edf_stalls(comp, hosts, [3.0, 2.0, 3.0]))
    longer = sum(comp) + sum(edf_stalls(comp, hosts, [3.0, 3.0, 3.0]))
    assert (short, longer) == (14.0, 13.0)


def preemptive_latency(comp, hosts, xfer, slots=1, host_layer_s=0.0):
    """Continuous-time simulation of a PREEMPTIVE earliest-need-first link under the executor's other rules (a
    request's first ``slots`` transfers are released at t=0, its next one when the host layer ``slots`` before it
    has run; a layer that reads prefetched KV computes ``host_layer_s`` longer): the step's latency. Transfers
    take > 0 seconds."""
    n_req, n_layers = len(hosts), len(comp)
    following = {(r, a): b for r, hl in enumerate(hosts) for a, b in zip(hl, hl[slots:])}
    left = {(layer, r): xfer[r] for r, hl in enumerate(hosts) for layer in hl[:slots]}  # released -> work left
    done, t, layer, layer_end = set(), 0.0, 0, None
    while layer < n_layers:
        reads = [r for r in range(n_req) if layer in hosts[r]]
        if layer_end is None and all((layer, r) in done for r in reads):
            layer_end = t + comp[layer] + (host_layer_s if reads else 0.0)
        pending = sorted(k for k, w in left.items() if w > 0)
        until = layer_end if layer_end is not None else math.inf
        if pending:
            k = pending[0]
            if t + left[k] <= until:
                t += left.pop(k)
                done.add(k)
                continue
            left[k] -= until - t
        t, layer_end = until, None
        for r in range(n_req):
            if (r, layer) in following:
                left[(following[(r, layer)], r)] = xfer[r]
        layer += 1
    return t


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_preemptive_link_is_its_event_simulation_and_never_slower_than_edf(slots):
    """The "preemptive" link's stalls give the latency of a continuous-time simulation of that link, at any prefetch
    depth and extra compute per host layer, and no step is slower than on the executor's EDF link (the release/need
    recursion bounds every link order); with one slot it is faster on many; its abort stops only slower steps."""
    rng = np.random.default_rng(40 + slots)
    faster = stopped = 0
    for _ in range(300):
        comp, host, b, cm = _random_case(rng)
        hosts = [np.flatnonzero(row).tolist() for row in host]
        xfer = ((b + 1) / cm.link_blocks_per_s).tolist()
        h = float(rng.choice([0.0, rng.uniform(0, 1.0)]))
        got = preemptive_stalls(comp, hosts, xfer, slots=slots, host_layer_s=h)
        extra = h * int(host.any(axis=0).sum())
        total = comp.sum() + sum(got) + extra
        assert total == pytest.approx(preemptive_latency(comp.tolist(), hosts, xfer, slots, h), rel=1e-12, abs=1e-12)
        edf = comp.sum() + sum(edf_stalls(comp, hosts, xfer, slots=slots, host_layer_s=h)) + extra
        assert total <= edf * (1 + 1e-12)
        faster += total < edf * (1 - 1e-9)
        for limit in (total * 0.9, total * (1 + 1e-9)):
            cut = preemptive_stalls(comp, hosts, xfer, abort_above=limit, slots=slots, host_layer_s=h)
            if cut is None:
                assert total > limit
                stopped += 1
            else:
                assert cut == got
    assert stopped > 20 and (slots > 1 or faster > 20)  # deeper prefetch leaves the EDF link less to lose


def test_preemptive_link_in_the_cost_model():
    """``CostModel(transfer="preemptive")`` prices a step on that link, takes a prefetch depth (Algorithm 1 does
    not) and names the models it knows when given another. The step of test_edf_is_not_monotone_in_added_copies:
    on the EDF link request 0's 5 s copy for layer 2 takes the link at t=1 and holds request 1's copy for layer 1
    (released at t=2) until t=6, 13 s in all; on the preemptive link that copy goes at once, done at t=3, and
    request 0's resumes, done at t=7: layer 1 runs 3-6 and layer 2 7-10."""
    host = np.array([[False, False, True], [True, True, False]])  # request 0 reads layer 2, request 1 layers 0, 1
    edf = CostModel([1.0, 3.0, 3.0], 1.0).step(Placement.from_mask(~host), [5, 1])
    pre = CostModel([1.0, 3.0, 3.0], 1.0, transfer="preemptive").step(Placement.from_mask(~host), [5, 1])
    assert (edf.total_s, pre.total_s) == (13.0, 10.0)
    assert pre.stall_per_layer_s.tolist() == [1.0, 1.0, 1.0]
    cm = CostModel([1.0] * 9, 3.0, transfer="preemptive")
    assert cm.with_updates(prefetch_slots=2).prefetch_slots == 2
    assert cm.with_updates(link_blocks_per_s=6.0).transfer == "preemptive"
    with pytest.raises(ValueError, match="'edf', 'preemptive', 'fair'"):
        CostModel([1.0], 1.0, transfer="chunked")
    with pytest.raises(ValueError, match="prefetch_slots > 1"):
        CostModel([1.0], 1.0, transfer="fair", prefetch_slots=2)
