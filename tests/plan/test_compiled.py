import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from orbitflow.plan import CostModel, Placement, Planner, PlanRequest, search
from orbitflow.plan import compiled as cc
from orbitflow.plan.cost_model import edf_stalls, preemptive_stalls
from orbitflow.plan.search import BranchAndBound
from orbitflow.plan.types import PlanStats

needs_numba = pytest.mark.skipif(not cc.HAVE_NUMBA, reason="numba is not installed")


def _edf_case(rng):
    n_req, n_layers = int(rng.integers(1, 7)), int(rng.integers(1, 24))
    comp = rng.uniform(0.5, 2.0, n_layers)
    host = rng.random((n_req, n_layers)) < rng.uniform(0.05, 0.95)
    xfer = rng.integers(0, 30, n_req) / float(rng.uniform(2, 40))
    return comp, [np.flatnonzero(h).tolist() for h in host], xfer


def _step_added(comp, host, xfer, slots, host_layer_s, preemptive=False) -> float:
    """What ``host`` adds to one step's compute by the compiled schedule (compiled.segments_added, one segment)."""
    out = np.empty(1)
    cc.segments_added(host.view(np.uint8), comp[None], cc.tail(comp)[None], np.asarray(xfer, dtype=float)[None],
                      np.zeros(1, np.int64), np.int64(slots), float(host_layer_s), preemptive, out)
    return float(out[0])


def _reference_slots(comp, hosts, xfer, slots, host_layer_s=0.0):
    """Event-by-event simulation with ``slots`` buffer slots per request: a request's first ``slots`` host
    layers are released at t=0, its k-th (k >= slots) when its (k-slots)-th host layer has finished computing;
    the link moves one released transfer at a time, the one needed earliest (ties: lower request); a layer some
    request reads from the host computes ``host_layer_s`` longer."""
    n_req = len(hosts)
    moved = [0] * n_req  # transfers moved per request
    done_at: dict[int, float] = {}  # layer -> end time
    arrival: dict[tuple[int, int], float] = {}
    link = t = 0.0
    stalls = []

    def release(r):
        k = moved[r]
        if k < slots:
            return 0.0
        return done_at.get(hosts[r][k - slots])  # None: not released yet

    for layer, c in enumerate(comp):
        need = [r for r in range(n_req) if layer in hosts[r]]
        while any((r, layer) not in arrival for r in need):
            pend = [r for r in range(n_req) if moved[r] < len(hosts[r]) and release(r) is not None]
            ready = [r for r in pend if release(r) <= link + 1e-12 + 1e-9 * link]
            if not ready:
                link = min(release(r) for r in pend)
                continue
            r = min(ready, key=lambda q: (hosts[q][moved[q]], q))
            link += xfer[r]
            arrival[(r, hosts[r][moved[r]])] = link
            moved[r] += 1
        start = max([t] + [arrival[(r, layer)] for r in need])
        stalls.append(start - t)
        t = start + c + (host_layer_s if need else 0.0)
        done_at[layer] = t
    return stalls


@needs_numba
def test_compiled_edf_is_the_reference_bit_for_bit():
    rng = np.random.default_rng(0)
    aborted = 0
    for _ in range(400):
        comp, hosts, xfer = _edf_case(rng)
        ref = edf_stalls(comp, hosts, xfer)
        got = cc.edf_stalls(comp, hosts, xfer)
        assert got.tolist() == ref  # identical floats, not just close
        total = float(np.sum(comp)) + sum(ref)
        for limit in (total * 0.9, total * (1 + 1e-9)):
            a, b = edf_stalls(comp, hosts, xfer, abort_above=limit), cc.edf_stalls(comp, hosts, xfer, abort_above=limit)
            assert (a is None) == (b is None)
            aborted += a is None
    assert aborted > 50


@needs_numba
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_compiled_edf_with_prefetch_slots_matches_event_simulation(slots):
    rng = np.random.default_rng(10 + slots)
    for _ in range(300):
        comp, hosts, xfer = _edf_case(rng)
        got = cc.edf_stalls(comp, hosts, xfer, slots=slots)
        assert np.allclose(got, _reference_slots(comp.tolist(), hosts, xfer.tolist(), slots), rtol=0, atol=1e-9)


@needs_numba
@pytest.mark.parametrize("slots", [1, 2])
def test_host_layer_compute_matches_event_simulation_and_the_reference(slots):
    rng = np.random.default_rng(20 + slots)
    for _ in range(300):
        comp, hosts, xfer = _edf_case(rng)
        h = float(rng.uniform(0, 1.5))
        ref = edf_stalls(comp, hosts, xfer, slots=slots, host_layer_s=h)
        got = cc.edf_stalls(comp, hosts, xfer, slots=slots, host_layer_s=h)
        assert got.tolist() == ref  # the compiled twin, bit for bit
        assert np.allclose(ref, _reference_slots(comp.tolist(), hosts, xfer.tolist(), slots, h), rtol=0, atol=1e-9)
        host = np.zeros((len(hosts), comp.size), dtype=bool)
        for r, hl in enumerate(hosts):
            host[r, hl] = True
        cm = CostModel(comp, 1.0, prefetch_slots=slots, host_layer_s=h)
        added = _step_added(comp, host, xfer, slots, h)
        assert added == sum(ref) + sum([h] * int(host.any(axis=0).sum()))
        assert added == cm.added_s(host, np.asarray(xfer, dtype=float), comp)  # the reference path's floats


@needs_numba
@pytest.mark.parametrize("slots", [1, 2])
def test_compiled_preemptive_link_is_the_reference_bit_for_bit(slots):
    """The jitted preemptive link (``compiled._preemptive``, through the same entry points as the EDF one) gives
    the reference's stalls, what a mask adds to a step and its abort, float for float."""
    rng = np.random.default_rng(30 + slots)
    aborted = 0
    for _ in range(300):
        comp, hosts, xfer = _edf_case(rng)
        h = float(rng.choice([0.0, rng.uniform(0, 1.5)]))
        ref = preemptive_stalls(comp, hosts, xfer, slots=slots, host_layer_s=h)
        got = cc.edf_stalls(comp, hosts, xfer, slots=slots, host_layer_s=h, preemptive=True)
        assert got.tolist() == ref
        host = np.zeros((len(hosts), comp.size), dtype=bool)
        for r, hl in enumerate(hosts):
            host[r, hl] = True
        cm = CostModel(comp, 1.0, transfer="preemptive", prefetch_slots=slots, host_layer_s=h)
        added = _step_added(comp, host, xfer, slots, h, preemptive=True)
        assert added == cm.added_s(host, np.asarray(xfer, dtype=float), comp)
        total = float(np.sum(comp)) + sum(ref)
        for limit in (total * 0.8, total * (1 + 1e-9)):
            a = preemptive_stalls(comp, hosts, xfer, abort_above=limit, slots=slots, host_layer_s=h)
            b = cc.edf_stalls(comp, hosts, xfer, slots=slots, abort_above=limit, host_layer_s=h, preemptive=True)
            assert (a is None) == (b is None)
            aborted += a is None
    assert aborted > 50


@needs_numba
def test_more_slots_never_stall_more_on_the_paper_example():
    # paper section 2.3, placement A (distance 3 for both requests): one slot stalls 1 per offloaded layer;
    # with two slots the second request's next layer moves while the first's is being read
    hosts = [[2, 5, 8], [2, 5, 8]]
    one = cc.edf_stalls([1.0] * 9, hosts, [1.0, 2.0], slots=1).sum()
    two = cc.edf_stalls([1.0] * 9, hosts, [1.0, 2.0], slots=2).sum()
    assert one == pytest.approx(3.0) and two < one
    with pytest.raises(ValueError, match="slots"):
        cc.edf_stalls([1.0], [[0]], [1.0], slots=0)


def _planner_case(rng, transfer="edf"):
    n_req = int(rng.integers(1, 7))
    n_layers = int(rng.choice([4, 9, 16, 32]))
    comp = rng.uniform(1e-3, 2e-3, n_layers)
    b = np.exp(rng.uniform(np.log(2), np.log(300), n_req)).astype(int)
    link = float(b.sum() / (comp.mean() * rng.uniform(1.5, 6.0)))
    cap = float(b.sum() * n_layers * rng.uniform(0.25, 0.9))
    reqs = [PlanRequest(i, int(b[i]), int(b[i] * 16 - rng.integers(0, 16)),
                        int(rng.integers(1, 60)) if rng.random() < 0.7 else None, float(rng.uniform(0, 8)),
                        float(rng.uniform(1.0, 2.5) * comp.sum()) if rng.random() < 0.8 else math.inf)
            for i in range(n_req)]
    if rng.random() < 0.3:
        slope = float(rng.uniform(0, 1e-4))
        cm = CostModel(lambda tokens: comp * (1 + slope * tokens), link, transfer=transfer)
    else:
        cm = CostModel(comp, link, transfer=transfer)
    return cm, cap, reqs


@needs_numba
@pytest.mark.parametrize("transfer", ["edf", "preemptive"])
@pytest.mark.parametrize("dp_everywhere", [False, True])
def test_compiled_and_reference_planners_give_identical_plans(dp_everywhere, transfer, monkeypatch):
    """Same plan, window, expiry and node counts: the compiled search is the reference search (also with the
    propagated bound, the least offload of the unassigned requests and the tail bound at every depth: there the
    reference's tail bound runs and raises bounds, so the twins agree on it too), on the executor's link and on
    the preemptive one."""
    raised = []
    if dp_everywhere:
        monkeypatch.setattr(search, "DP_REST_SHARE", 1.0)
        real = search.tail_cover
        monkeypatch.setattr(search, "tail_cover", lambda *args: raised.append(real(*args)) or raised[-1])
    rng = np.random.default_rng(1)
    cut = 0
    for i in range(60):
        cm, cap, reqs = _planner_case(rng, transfer)
        kwargs = dict(alpha=float(rng.choice([0.0, 0.5, 1.0])), window=(int(rng.integers(1, 5)), 16),
                      node_limit=[None, 2000, 5][i % 3], gap=0.02 if i % 7 == 0 else 0.0,
                      token_deposit=i % 4 != 3)  # without Token-Deposit, nothing banks (the kernels' cap too)
        ref = Planner(cm, cap, compiled=False, **kwargs).plan(reqs)
        got = Planner(cm, cap, compiled=True, **kwargs).plan(reqs)
        assert got.distances == ref.distances and got.feasible == ref.feasible
        assert got.predicted_step_s == ref.predicted_step_s  # bit for bit
        assert (got.window, got.expiry_step, got.violations) == (ref.window, ref.expiry_step, ref.violations)
        assert got.step_latencies_s == ref.step_latencies_s
        for key in ("nodes", "leaves", "improve_evals", "exact", "gap", "lower_bound_s"):
            assert getattr(got.stats, key) == getattr(ref.stats, key), key
        cut += not ref.stats.exact
    assert cut > 0  # some searches ran out of nodes, and stopped at the same node
    assert not dp_everywhere or sum(v > 0 for v in raised) > 50


@needs_numba
@pytest.mark.parametrize("kernel_clock", [True, False])
def test_compiled_search_honours_a_deadline(kernel_clock, monkeypatch):
    """The kernels read the clock themselves (or, without one, are paused by the caller to check it): either way a
    search past its deadline stops right after its first dive."""
    if kernel_clock and not cc.HAVE_CLOCK:
        pytest.skip("no clock_gettime for the kernels on this platform")
    monkeypatch.setattr(cc, "HAVE_CLOCK", kernel_clock)
    rng = np.random.default_rng(2)
    hurried = 0
    for _ in range(10):
        cm, cap, reqs = _planner_case(rng)
        p = Planner(cm, cap, window=(2, 8), node_limit=None, time_limit_s=1e-9, compiled=True).plan(reqs)
        hurried += not p.stats.exact
        assert p.stats.nodes <= len(reqs) + 2 + 1  # the first dive, then the first deadline check
    assert hurried > 0


@pytest.mark.skipif(not cc.HAVE_CLOCK or sys.platform != "linux",
                    reason="the kernels' clock is perf_counter's on Linux only")
def test_the_kernels_clock_is_perf_counters():
    clock = cc.clock_scratch()
    cc._now(clock)  # load it
    for _ in range(100):
        before = time.perf_counter()
        now = cc._now(clock)
        assert before <= now <= time.perf_counter()
    deadline = time.perf_counter() + 5.0
    assert abs(cc.kernel_deadline(deadline, clock) - deadline) < 1e-3
    assert cc.kernel_deadline(None, clock) == math.inf


def test_planner_without_numba_uses_the_reference():
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import orbitflow.plan as p\n"
        "from orbitflow.plan import compiled as cc\n"
        "assert not cc.HAVE_NUMBA and 'torch' not in sys.modules\n"
        "pl = p.Planner(p.CostModel([1.0] * 4, 2.0), 6)\n"
        "assert not pl.compiled\n"
        "print(pl.plan([p.PlanRequest('a', 2, 30), p.PlanRequest('b', 1, 10)]).distances)\n"
        "try:\n"
        "    p.Planner(p.CostModel([1.0] * 4, 2.0), 6, compiled=True)\n"
        "except ValueError as e:\n"
        "    assert 'numba' in str(e)\n"
        "else:\n"
        "    raise AssertionError('compiled=True without numba must fail')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().startswith("(")


def test_environment_variable_selects_the_reference(monkeypatch):
    monkeypatch.setenv(cc.ENV, "0")
    assert not Planner(CostModel([1.0] * 2, 1.0), 4).compiled
    monkeypatch.setenv(cc.ENV, "1")
    assert Planner(CostModel([1.0] * 2, 1.0), 4).compiled == cc.HAVE_NUMBA


@needs_numba
def test_jitted_twins_of_the_fluid_deposit_model_and_the_plan_order_agree():
    """numba keeps its own copies of the fluid Token-Deposit model (violations, the constant-latency prefilter)
    and of the order on plans; they must give exactly what plan/deposit.py and plan/types.py give."""
    from orbitflow.plan import deposit
    from orbitflow.plan.types import better

    rng = np.random.default_rng(11)
    for _ in range(300):
        n_req, horizon = int(rng.integers(1, 6)), int(rng.integers(1, 30))
        cuts = np.sort(rng.choice(np.arange(1, horizon), size=min(horizon - 1, int(rng.integers(0, 4))),
                                  replace=False)) if horizon > 1 else np.zeros(0, int)
        starts = np.concatenate(([0], cuts)).astype(np.int64)
        ends = np.concatenate((cuts, [horizon])).astype(np.int64)
        seg_lat = rng.uniform(0.5, 2.0, starts.size)
        slo = np.where(rng.random(n_req) < 0.2, math.inf, rng.uniform(0.6, 2.0, n_req))
        dep = np.where(rng.random(n_req) < 0.3, 0.0, rng.uniform(0, 8, n_req))
        bank_max = float(rng.choice([math.inf, 0.0, rng.uniform(0, 4)]))  # with and without Token-Deposit
        ref = deposit.violations(seg_lat.tolist(), starts.tolist(), ends.tolist(), slo, dep, horizon, bank_max)
        assert np.array_equal(cc.violations(seg_lat, starts, ends, slo, dep, horizon, bank_max), ref)
        lo = int(rng.integers(1, horizon + 1))
        alpha = float(rng.choice([0.0, 0.5, 1.0]))
        steps = np.arange(lo, horizon + 1)
        for lb in rng.uniform(0.3, 3.0, 5):
            fst = np.zeros(cc.N_FST)
            fst[cc.KNOWN_PASS], fst[cc.KNOWN_FAIL] = -math.inf, math.inf  # no memo: a fresh answer
            want = bool(np.any(deposit.constant_latency_violations(lb, slo, dep, steps) <= alpha * steps + 1e-9))
            assert cc._lat_ok(lb, fst, True, dep, slo, alpha, lo, horizon) == want
        for _ in range(5):
            key = (float(rng.choice([1.0, 1.0 + 1e-13, 2.0])), float(rng.integers(0, 3)))
            best = (float(rng.choice([1.0, math.inf])), float(rng.integers(0, 3)))
            assert cc._better(*key, *best) == better(key, best)


def _search_of(cm, cap, reqs, compiled, **kwargs):
    pl = Planner(cm, cap, compiled=compiled, **kwargs)
    win = pl.constraints.horizon(reqs)
    return pl, win, BranchAndBound(pl.constraints, win, PlanStats())


def _some_window_passes(rules, win, host, lat0, cap_max=None):
    """The window rule by its definition: every segment the horizon fits scheduled, then some window of ``d``
    steps (``min_steps <= d <= cap_max``, by default ``steps_that_fit``) with at most ``alpha * d`` violations."""
    cap_max = rules.steps_that_fit(win, host) if cap_max is None else cap_max
    n_seg = sum(1 for s in win.seg_starts if s < cap_max)
    cum = rules.violations(win, [lat0] + rules.seg_latencies(win, host, upto=n_seg, first=1))
    return any(cum[d] <= rules.alpha * d + 1e-9 for d in range(rules.min_steps, cap_max + 1))


@needs_numba
def test_jitted_window_rule_is_constraints_feasible():
    """compiled.leaf_feasible / steps_that_fit (the leaves' and the local improvement's check) answer as
    Constraints.feasible / steps_that_fit for random assignments, latencies and later-step bounds; both schedule
    the later segments only until a window passes, and answer as the rule's definition over the whole horizon."""
    rng = np.random.default_rng(5)
    answers, lazy = set(), 0
    for case in range(60):
        cm, cap, reqs = _planner_case(rng)
        kwargs = dict(alpha=float(rng.choice([0.0, 0.5, 1.0])), window=(int(rng.integers(1, 5)), 16),
                      token_deposit=case % 3 != 2)
        pl, win, bb = _search_of(cm, cap, reqs, True, **kwargs)
        rules = pl.constraints
        for _ in range(10):
            k_of = rng.integers(0, len(bb.counts), len(reqs))
            host = bb.hosts[k_of]
            assert cc.steps_that_fit(k_of, bb._feas()) == rules.steps_that_fit(win, host)
            lat0 = rules.seg_latencies(win, host, upto=1)[0] * float(rng.choice([1.0, 0.7, 1.3]))
            lb = float(rng.choice([0.0, lat0 * rng.uniform(0.5, 1.0)]))
            win.seg_cache.clear()
            want = rules.feasible(win, host, lat0, later_lb=lb)
            assert cc.leaf_feasible(k_of, lat0, lb, bb._feas()) == want
            if lb == 0.0:
                scheduled = len(win.seg_cache)  # the later segments the lazy rule needed
                assert want == _some_window_passes(rules, win, host, lat0)
                lazy += scheduled < len(win.seg_cache)
                cap_max = int(rng.integers(rules.min_steps, win.horizon + 1))  # as if memory ran out there
                assert cc._window_rule(k_of, lat0, 0.0, cap_max, bb._feas()) == _some_window_passes(
                    rules, win, host, lat0, cap_max)
            answers.add(want)
    assert answers == {True, False}
    assert lazy > 0  # some plans passed before the last segment the horizon fits


@needs_numba
def test_jitted_greedy_is_the_reference():
    rng = np.random.default_rng(6)
    for _ in range(40):
        cm, cap, reqs = _planner_case(rng)
        got = _search_of(cm, cap, reqs, True)[2]._greedy()
        assert got == _search_of(cm, cap, reqs, False)[2]._greedy()


def test_root_probes_are_the_reference_and_price_the_incumbent():
    """The first request's visiting order: the compiled probes are the reference's floats, the incumbent's own
    candidate is priced at the incumbent's step-0 latency, and a probe is finite exactly where the repaired
    assignment fits the capacity equation (compiled.move)."""
    rng = np.random.default_rng(9)
    probed = 0
    for _ in range(40):
        cm, cap, reqs = _planner_case(rng)
        probes = []
        for compiled in (False, True):
            bb = _search_of(cm, cap, reqs, compiled, node_limit=None)[2]
            if bb._try_no_offload():
                break
            bb._seed_incumbents()
            bb._probe_root()
            probes.append(bb.root_probe.copy())
            if bb.best_k is not None and bb.n_req > 1:
                r, n_cand = bb.order[0], len(bb.counts)
                assert bb.root_probe[bb.best_k[r]] == bb.best_key[0]
                out, buf = np.empty(bb.n_req, dtype=np.int64), np.empty(bb.n_layers)
                for k in range(n_cand):
                    fits = k == bb.best_k[r] or cc.move(bb.best_k, r * n_cand + k, out, bb.ratio_order, bb.counts,
                                                        bb.hosts_f, bb.bcap, bb.cap, buf)
                    assert math.isfinite(bb.root_probe[k]) == fits
                probed += compiled
        if len(probes) == 2:
            assert np.array_equal(probes[0], probes[1])
    assert probed > 10


def test_root_probes_only_where_the_time_left_pays_for_them():
    """Under a deadline the probes run only when their expected cost is a small share of the time left."""
    import time

    rng = np.random.default_rng(10)
    for _ in range(40):
        cm, cap, reqs = _planner_case(rng)
        pl = Planner(cm, cap)
        win = pl.constraints.horizon(reqs)
        runs = {}
        for name, left in (("none", None), ("tight", 1e-6), ("roomy", 60.0)):
            deadline = None if left is None else time.perf_counter() + left
            bb = BranchAndBound(pl.constraints, win, PlanStats(), deadline=deadline)
            if bb._try_no_offload():
                break
            bb._seed_incumbents()
            bb._probe_root()
            runs[name] = bb.root_probe.copy()
        if len(runs) == 3 and bb.best_k is not None and bb.n_req > 1:
            break
    else:
        pytest.fail("no batch with an incumbent to probe")
    assert np.any(runs["none"] != 0) and np.array_equal(runs["none"], runs["roomy"])
    assert not np.any(runs["tight"])  # not probed: every candidate ties, the bounds order them


@needs_numba
def test_compiled_suffix_tables_are_the_references():
    """compiled.suffix_tables against BranchAndBound's NumPy set-up (compiled=False) and bounds.cover_tables, bit for
    bit, with ties in cost per block and requests without blocks."""
    rng = np.random.default_rng(4)
    for _ in range(300):
        n_req, n_layers = int(rng.integers(1, 17)), int(rng.choice([4, 32, 80]))
        bcap = rng.integers(0, 60, n_req).astype(float)
        if rng.random() < 0.5:
            bcap = np.round(bcap / 10) * 10  # equal sizes: ties
        b0 = np.minimum(bcap, rng.integers(0, 60, n_req)).astype(float)
        x0 = b0 / 1000 + np.where(b0 > 0, 1e-5, 0.0) * (rng.random() < 0.5)
        order = rng.permutation(n_req)
        ref = BranchAndBound.__new__(BranchAndBound)
        ref.order, ref.bcap, ref.b0, ref.x0, ref.n_layers = list(order), bcap, b0, x0, n_layers
        ref.rules = type("Rules", (), {"compiled": False})()
        ref.tables, ref.compute = search.candidate_tables(n_layers), search.compute_tables(np.ones(n_layers), n_layers)
        ref._init_bound_tables()
        got = cc.suffix_tables(order.astype(np.int64), bcap, b0, x0, n_layers, search.DP_REST_SHARE)
        for a, b in zip(got, (ref.rest_b, ref.rest_b0, ref.ratio_suffix, ref.rest_grow, ref.dp_depth, *ref.cover)):
            assert a.dtype == b.dtype and np.array_equal(a, b)


@needs_numba
def test_compiled_chain_bounds_are_numpys_floats():
    """compiled.chain_bounds sums as NumPy does (pairwise: the same floats as search.chain_bounds), on the compute
    tables of 4 to 128 layers and on rows of up to 300 gaps (NumPy's halving above 128), infinite gaps included. A
    NumPy that summed otherwise fails here, not in a plan that differs by a rounding."""
    rng = np.random.default_rng(6)
    for n_layers in (4, 9, 16, 32, 80, 128):
        ct = search.compute_tables(rng.uniform(1e-3, 2e-3, n_layers), n_layers)
        x0 = rng.uniform(0, 8e-3, 16)
        assert np.array_equal(cc.chain_bounds(x0, ct.gaps), search.chain_bounds(x0, ct))
    for _ in range(300):
        x0 = rng.uniform(0, 1, int(rng.integers(1, 9))) * rng.choice([1e-3, 1.0, 1e3])
        gaps = rng.uniform(0, 2 * x0.mean(), (int(rng.integers(1, 20)), int(rng.integers(1, 300))))
        gaps[rng.random(gaps.shape) < 0.2] = np.inf
        assert np.array_equal(cc.chain_bounds(x0, gaps), np.maximum(x0[:, None, None] - gaps[None], 0.0).sum(axis=2))


@needs_numba
@pytest.mark.parametrize("transfer", ["edf", "preemptive", "fair"])
def test_compiled_search_order_is_the_references(transfer):
    """compiled.search_order against BranchAndBound._init_order: the same order and symmetry rule, on batches with
    ties in size now and at the capacity step, identical requests and ones that differ only in balance or SLO."""
    rng = np.random.default_rng(5)
    kind = {"edf": cc.EDF_LINK, "preemptive": cc.PREEMPTIVE_LINK, "fair": cc.OTHER_LINK}[transfer]
    swaps = 0
    for _ in range(200):
        n_req = int(rng.integers(1, 9))
        pick = rng.integers(0, 3, n_req)  # few distinct values: many ties
        reqs = [PlanRequest(i, int(4 + pick[i]), int(16 * (4 + pick[i]) - rng.integers(0, 2) * 8),
                            int(rng.choice([3, 40])), float(rng.choice([0.0, 1.0])), float(rng.choice([0.5, math.inf])))
                for i in range(n_req)]
        pl = Planner(CostModel([1e-3] * 8, 1e4, transfer=transfer), 1e9, window=(2, 10), compiled=True)
        win = pl.constraints.horizon(reqs)
        ref = BranchAndBound(pl.constraints, win, PlanStats())
        order, same = cc.search_order(ref.bcap, ref.b0, win.blocks, win.deposit, win.slo, kind)
        assert order.tolist() == ref.order and same.tolist() == ref.same_as_prev
        swaps += sum(ref.same_as_prev)
    assert swaps > 0 or transfer == "fair"  # the symmetry rule was exercised


def _counted(monkeypatch, kernel: str) -> list:
    """The calls of the compiled kernel ``kernel`` from now on (a list that grows by one per call)."""
    calls, compiled_kernel = [], getattr(cc, kernel)
    monkeypatch.setattr(cc, kernel, lambda *args: calls.append(1) or compiled_kernel(*args))
    return calls


@needs_numba
@pytest.mark.parametrize("transfer", ["edf", "preemptive"])
def test_first_better_is_the_first_only_branch_and_bound(transfer, monkeypatch):
    """The expiry check's search in one call (search.first_better, its set-up in compiled.first_better) answers as
    BranchAndBound(first_only=True).run() does, with the same nodes, leaves and exactness: on horizons an expiry check
    searches (Constraints.horizon_after), with uppers around the optimum, node limits that stop it, a deadline already
    past, a gap, and identical requests (the symmetry rule)."""
    calls = _counted(monkeypatch, "first_better")
    rng = np.random.default_rng(11)
    outcomes = set()
    for _ in range(25):
        cm, cap, reqs = _planner_case(rng, transfer)
        if rng.random() < 0.3:  # a copy of the first request: two identical ones
            q = reqs[0]
            reqs = [*reqs, PlanRequest("copy", q.blocks_per_layer, q.tokens, q.tokens_left, q.deposit, q.slo_s)]
        rules = Planner(cm, cap, window=(2, 10), compiled=True).constraints
        win = rules.horizon(reqs)
        seg = rules.seg_latencies(win, np.zeros((len(reqs), rules.num_layers), dtype=bool))
        for w in [win, *(rules.horizon_after(win, seg, t) for t in win.boundaries[:2])]:
            tree = BranchAndBound(rules, w, PlanStats(), node_limit=None)
            best = tree.best_key[0] if tree.run() is not None else math.inf
            for upper in {math.inf, best * (1 + 1e-6), best * (1 - 1e-9), best * 0.97} - {math.nan}:
                for node_limit, deadline, gap in [(None, None, 0.0), (1, None, 0.0), (4, None, 0.01),
                                                  (None, time.perf_counter() - 1.0, 0.0)]:
                    want, got = PlanStats(), PlanStats()
                    found = BranchAndBound(rules, w, want, upper, first_only=True, node_limit=node_limit,
                                           deadline=deadline, gap=gap).run() is not None
                    n = len(calls)
                    assert search.first_better(rules, w, got, upper, gap=gap, node_limit=node_limit,
                                               deadline=deadline) == found
                    assert len(calls) == n + 1  # in one compiled call
                    assert (got.nodes, got.leaves, got.exact) == (want.nodes, want.leaves, want.exact)
                    outcomes.add((found, want.exact))
    assert outcomes >= {(True, True), (False, True), (False, False)}  # found, none exists, the budget stopped it


@needs_numba
@pytest.mark.parametrize("transfer", ["edf", "preemptive"])
def test_best_plan_is_the_branch_and_bound(transfer, monkeypatch):
    """A search without a deadline in one call (search.best_plan, compiled.best_found: order, tables, no-offload try,
    seeds, improvements, probes and the search) gives what BranchAndBound(...).run() gives: the same mask and the same
    statistics (nodes, leaves, improvement evaluations, exactness, lower bound, gap), under node limits that cut it,
    a gap, hints (whole, partial, with distances the tables do not have), no improvement, and threads with a node
    limit (serial)."""
    calls = _counted(monkeypatch, "best_found")
    rng = np.random.default_rng(17)
    seen = set()
    for _ in range(25):
        cm, cap, reqs = _planner_case(rng, transfer)
        rules = Planner(cm, cap, window=(2, 10), compiled=True).constraints
        win = rules.horizon(reqs)
        dists = search.candidate_tables(rules.num_layers).distances
        hints = [None, [dists[int(rng.integers(len(dists)))] for _ in reqs], [-1, None, 10**6, *dists][: len(reqs)]]
        best = BranchAndBound(rules, win, PlanStats(), node_limit=None).run()
        if best is not None:  # the optimum's own distances: the engine's hint, the previous plan
            hints.append(list(Placement(~best).distances()))
        for node_limit, gap, improve_evals, threads in [(None, 0.0, 256, 1), (1, 0.0, 256, 1), (3, 0.02, 256, 2),
                                                        (2000, 0.0, 0, 1), (None, 0.05, 16, 1)]:
            for hint in hints:
                kw = dict(gap=gap, node_limit=node_limit, hint=hint, improve_evals=improve_evals, threads=threads)
                want, got = PlanStats(), PlanStats()
                mask = BranchAndBound(rules, win, want, **kw).run()
                n = len(calls)
                host = search.best_plan(rules, win, got, **kw)
                assert len(calls) == n + 1  # in one compiled call
                assert (host is None) == (mask is None) and (mask is None or np.array_equal(host, mask))
                assert got == want
                seen.add((mask is not None, want.exact, want.improve_evals > 0))
    assert {(True, True, False), (True, False, True), (False, True, False)} <= seen


@needs_numba
@pytest.mark.parametrize("variant", ["edf", "preemptive", "latency", "tokens"])
def test_plans_are_the_same_with_the_expiry_checks_in_one_call(variant, monkeypatch):
    """Whole plans (placement, window, expiry, latencies, nodes) of batches of 6-8 requests at 16-32 layers, whose
    expiry checks search deep enough to reach the tail bound's on/off rule, are the same with the checks run by
    compiled.first_better as through BranchAndBound(first_only=True)."""
    import orbitflow.plan.planner as planner_module

    def through_branch_and_bound(rules, win, stats, upper, *, gap=0.0, node_limit=None, deadline=None, control=None):
        return BranchAndBound(rules, win, stats, upper, first_only=True, gap=gap, node_limit=node_limit,
                              deadline=deadline, control=control).run() is not None

    rng = np.random.default_rng(13)
    searched = 0
    for _ in range(6):
        n_req, n_layers = int(rng.integers(6, 9)), int(rng.choice([16, 32]))
        comp = rng.uniform(1e-3, 2e-3, n_layers)
        b = np.exp(rng.uniform(np.log(8), np.log(1024), n_req)).astype(int)
        link = float(b.sum() / (rng.uniform(1.9, 6.0) * comp.mean()))
        slo = float(rng.uniform(1.5, 2.5) * comp.sum())
        reqs = [PlanRequest(i, int(b[i]), int(b[i] * 16 - rng.integers(0, 16)), int(rng.integers(1, 4000)),
                            float(rng.uniform(0, 20)), slo) for i in range(n_req)]
        kw = {"transfer_latency_s": 2e-4} if variant == "latency" else {}
        spec = (lambda t, c=comp: c * (1 + t / 2e5)) if variant == "tokens" else comp
        cm = CostModel(spec, link, "preemptive" if variant == "preemptive" else "edf", num_layers=n_layers, **kw)
        pl = Planner(cm, float(b.sum() * n_layers * rng.uniform(0.3, 0.6)), window=(4, 16), compiled=True)
        got = pl.plan(reqs)
        with monkeypatch.context() as m:
            m.setattr(planner_module, "first_better", through_branch_and_bound)
            want = pl.plan(reqs)
        for plan in (got, want):
            plan.stats.solve_s = 0.0
        assert got == want
        searched += want.stats.expiry_searches
    assert searched > 0


@pytest.mark.parametrize("compiled", [True, False])
def test_a_search_still_gaining_runs_to_the_plans_deadline(compiled):
    """Past the search's own deadline (the local improvement's share begins) but before the plan's: the search stops
    unless a leaf after its first dive became the incumbent; past both it stops either way; never in the first
    dive. The kernel (_budget_spent) and the reference (BranchAndBound._out_of_budget) alike."""
    if compiled and not cc.HAVE_CLOCK:
        pytest.skip("no clock_gettime for the kernels on this platform")
    cm, cap, reqs = _planner_case(np.random.default_rng(3))
    rules = Planner(cm, cap, window=(2, 8)).constraints
    clock = cc.clock_scratch()
    for gained, late_in, nodes, spent in ((0, 5.0, 10, True), (1, 5.0, 10, False), (1, -1.0, 10, True),
                                          (0, 5.0, 2, False)):
        now = time.perf_counter()
        if compiled:
            ist, fst = np.zeros(cc.N_IST, dtype=np.int64), np.zeros(cc.N_FST)
            ist[cc.NODES], ist[cc.NODE_LIMIT], ist[cc.GAINED] = nodes, -1, gained
            fst[cc.DEADLINE] = cc.kernel_deadline(now - 1.0, clock)
            fst[cc.LATE_DEADLINE] = cc.kernel_deadline(now + late_in, clock)
            assert cc._budget_spent(ist, fst, clock, 1) == spent
        else:
            bb = BranchAndBound(rules, rules.horizon(reqs[:1]), PlanStats(), deadline=now + late_in)
            bb.deadline, bb.gained, bb.nodes = now - 1.0, bool(gained), nodes
            assert bb._out_of_budget() == spent


@needs_numba
def test_hinted_propagated_bound_is_below_the_full_one_and_equal_at_its_own_argmax():
    """The compiled search's cheap first try at the propagated bound (one release layer per layer, the hint) is a
    lower bound on the full one (``bounds.dp_bound`` of the same matrix, which the search would compute), so pruning
    on it cuts nothing the full bound keeps; at the full bound's own maximising layers it is the full bound, bit for
    bit (its transfer counts, taken from running host counts, are the matrices' entries)."""
    from orbitflow.plan.bounds import dp_bound
    from orbitflow.plan.search import candidate_tables

    rng = np.random.default_rng(7)
    below = 0
    for _ in range(150):
        n_layers = int(rng.integers(2, 30))
        t = candidate_tables(n_layers)
        n_cand = len(t.counts)
        comp = rng.uniform(0.2, 2.0, n_layers)
        v = np.zeros((1, n_layers, n_layers + 1))  # a node's matrix: a few assigned requests (transposed layout)
        for _r in range(int(rng.integers(0, 4))):
            v[0] = v[0] + float(rng.uniform(0.1, 3.0)) * t.mats_t[int(rng.integers(0, n_cand))]
        k, x = int(rng.integers(0, n_cand)), float(rng.uniform(0.1, 3.0))
        n_terms = int(rng.integers(0, 3))
        terms_k = np.sort(rng.choice(np.arange(1, n_cand), n_terms, replace=False)).astype(np.int64)
        terms_c = rng.uniform(0.1, 2.0, n_terms)
        w = v[0] + x * t.mats_t[k]  # as compiled._least_into builds it
        for kk, c in zip(terms_k, terms_c):
            w = w + c * t.least_t[kk]
        full = float(dp_bound(np.ascontiguousarray(w.T)[None], comp)[0])
        f = _full_f(w, comp)
        argmax = np.array([-1] + [int(np.argmax(f[:layer] + w[layer, 1:layer + 1])) for layer in range(1, n_layers)],
                          dtype=np.int64)
        guess = np.array([int(rng.integers(-1, layer)) if layer else -1 for layer in range(n_layers)], dtype=np.int64)
        for hint in (guess, argmax):
            gv = np.zeros((2, n_layers))
            gv[0] = v[0, :, 0]
            ok = hint >= 0
            gv[1, ok] = v[0, np.flatnonzero(ok), hint[ok] + 1]
            got = cc._dp_hinted(k, x, gv, t.cumh, t.least_cum, terms_k, terms_c, n_terms, hint, comp,
                                np.empty(n_layers))
            if hint is argmax:
                assert got == full
            else:
                assert got <= full
                below += got < full
    assert below > 20  # a random hint often misses the max: the check has teeth


@needs_numba
def test_tail_bound_on_and_off_rule_is_the_references():
    """Where the tail bound is tried (BranchAndBound._tail_at and its jitted twin, which must agree to the float as
    the bound changes the search): never with fewer than TAIL_MIN requests left; at a depth whose share of prunes fell
    under TAIL_MIN_RATE, one node in TAIL_PROBE; at any share above it, every node."""
    from orbitflow.plan.bounds import TAIL_MIN, TAIL_MIN_RATE, TAIL_PROBE

    rng = np.random.default_rng(3)
    cm, cap, reqs = _planner_case(rng)
    while len(reqs) < 5:
        cm, cap, reqs = _planner_case(rng)
    pl = Planner(cm, cap, compiled=False, window=(2, 16))
    bb = BranchAndBound(pl.constraints, pl.constraints.horizon(reqs), PlanStats())
    n_req = bb.n_req
    rates = np.column_stack((np.ones(n_req), np.zeros(n_req), bb.tail_rate))
    for depth, share, calls in ((0, 1.0, 40), (1, TAIL_MIN_RATE / 2, 40), (n_req - 1 - TAIL_MIN, 0.0, 20)):
        bb.tail_rate[depth, 0] = rates[depth, 2] = share
        ref = [bb._tail_at(depth) for _ in range(calls)]
        got = [bool(cc._tail_at(depth, n_req, rates)) for _ in range(calls)]
        assert got == ref and bb.tail_rate[depth].tolist() == rates[depth, 2:].tolist()
        if share >= TAIL_MIN_RATE:
            assert all(ref)
        else:
            assert sum(ref) == calls // (int(TAIL_PROBE) + 1) and not ref[0] and ref[int(TAIL_PROBE)]
    assert not any(bb._tail_at(d) for d in range(n_req - TAIL_MIN, n_req))


def _full_f(w, comp):
    """``F[l]`` of the propagated bound over a transposed matrix ``w`` (``[layer, row]``), as ``bounds.dp_bound``."""
    n_layers = comp.size
    f = np.empty(n_layers)
    f[0] = w[0, 0] + comp[0]
    for layer in range(1, n_layers):
        f[layer] = max(f[layer - 1], w[layer, 0], float((f[:layer] + w[layer, 1:layer + 1]).max())) + comp[layer]
    return f


@needs_numba
def test_a_kernel_compiles_afresh_when_a_module_compiled_into_it_changes(tmp_path):
    """numba's disk cache checks only the file defining a kernel; a constant the kernel compiled in from another module
    (as the search compiles in bounds.py's code) must not survive an edit of that module."""
    (tmp_path / "dep.py").write_text("K = 1\n")
    (tmp_path / "kern.py").write_text(
        "import dep\nfrom orbitflow.plan import compiled\n\n\ndef f(x):\n    return x + dep.K\n\n\n"
        "f = compiled._jit(f, depends_on=(dep,))\nprint(f(1), sum(f.stats.cache_hits.values()))\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path),
           "PYTHONDONTWRITEBYTECODE": "1"}  # Python's own .pyc of dep.py might miss an edit within the same second

    def run():  # the kernel's result, and how many times numba loaded it from its cache
        return subprocess.run([sys.executable, str(tmp_path / "kern.py")], env=env, capture_output=True, text=True,
                              check=True).stdout.split()

    assert run() == ["2", "0"]
    assert run() == ["2", "1"]  # nothing changed: the cached kernel is loaded
    (tmp_path / "dep.py").write_text("K = 50\n")
    assert run() == ["51", "0"]  # numba's own stamp (kern.py's) alone would load the kernel that adds 1


@needs_numba
def test_warm_up_loads_every_kernel_a_solve_calls_from_python():
    """plan.warm_up (the controller, the planner process and `orbitflow plan` call it) must load the kernels a first
    solve reaches from Python: try_assignment is called so only when nothing need be offloaded, which no warm-up batch
    was, and the first real solve paid its load (25-65 ms, charged on the simulator's clock). A fresh process."""
    code = ("from orbitflow.plan import warm_up, compiled as cc; warm_up(); "
            "print(len(cc.try_assignment.signatures), len(cc.first_better.signatures), len(cc.best_found.signatures))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert min(int(n) for n in out.stdout.split()) >= 1  # first_better, best_found: searches in one call
