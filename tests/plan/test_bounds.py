import itertools
import math

import numpy as np
import pytest
from plan.test_cost_model import preemptive_latency

from orbitflow.plan import CostModel, Placement, Planner, PlanRequest, PlanStats, search
from orbitflow.plan import compiled as cc
from orbitflow.plan.bounds import (
    CONTINUE,
    FROM_START,
    _lower_hull,
    count_matrix,
    cover_cost,
    cover_tables,
    critical_windows,
    dp_bound,
    tail_cover,
    window_tilings,
)
from orbitflow.plan.search import BranchAndBound, candidate_tables


def harsh_case(rng, n_req, n_layers):
    """The paper's regime: moving one layer of the batch takes 1.5-6x a layer's compute."""
    comp = rng.uniform(1e-3, 2e-3, n_layers)
    b = np.exp(rng.uniform(np.log(2), np.log(200), n_req)).astype(int)
    link = float(b.sum() / (comp.mean() * rng.uniform(1.5, 6.0)))
    cap = float(b.sum() * n_layers * rng.uniform(0.25, 0.9))
    reqs = [PlanRequest(i, int(b[i]), int(b[i] * 16 - rng.integers(0, 16)), int(rng.integers(1, 40)),
                        float(rng.uniform(0, 6)), float(rng.uniform(1.0, 3.0) * comp.sum()))
            for i in range(n_req)]
    return CostModel(comp, link), cap, reqs


@pytest.mark.parametrize("n_layers", [1, 2, 5, 12, 32, 80])
def test_tilings_cover_every_layer_once(n_layers):
    for tiling in window_tilings(n_layers):
        covered = []
        for row, last in tiling:  # window (row-1, last]: layers row..last (row 0: from t=0)
            assert row <= last
            covered += list(range(row, last + 1))
        assert covered == list(range(n_layers))


def test_lower_hull_is_convex_and_below_points():
    rng = np.random.default_rng(0)
    for _ in range(200):
        xs = np.unique(rng.integers(0, 40, rng.integers(1, 10))).astype(float)
        ys = rng.uniform(0, 10, xs.size)
        pieces = _lower_hull(xs, ys)

        def phi(u, pieces=pieces):
            return max(a * u + c for a, c in pieces)

        assert all(phi(x) <= y + 1e-9 for x, y in zip(xs, ys))
        assert min(abs(phi(x) - y) for x, y in zip(xs, ys)) < 1e-9  # touches the points
        grid = np.linspace(xs[0], xs[-1], 50)
        vals = [phi(u) for u in grid]
        assert all(vals[i - 1] + vals[i + 1] >= 2 * vals[i] - 1e-9 for i in range(1, len(vals) - 1))


def test_separable_bounds_are_lower_bounds_of_complete_assignments():
    rng = np.random.default_rng(1)
    for _ in range(150):
        n_req, n_layers = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        cm, _, reqs = harsh_case(rng, n_req, n_layers)
        tables = candidate_tables(n_layers)
        comp = cm.compute()
        cum = np.concatenate(([0.0], np.cumsum(comp)))
        offset = comp.sum() - tables.sep.between @ cum
        ks = rng.integers(0, len(tables.counts), n_req)
        b = np.array([q.blocks_per_layer for q in reqs], dtype=float)
        exact = cm.step(Placement(~tables.hosts[ks]), b).total_s
        bound = offset + (b / cm.link_blocks_per_s) @ tables.sep.n[:, ks].T
        assert bound.max() <= exact * (1 + 1e-9)


def tight_case(rng, n_req, n_layers):
    """Capacity that forces most of the KV off the device, a fixed cost per transfer, and requests about to grow
    a block (blocks at the capacity step above those at step 0): where the forced cover bound bites."""
    comp = rng.uniform(1e-3, 2e-3, n_layers)
    b = np.exp(rng.uniform(np.log(1), np.log(300), n_req)).astype(int)
    link = float(b.sum() / (comp.mean() * rng.uniform(1.0, 8.0)))
    cm = CostModel(comp, link, transfer_latency_s=float(rng.choice([0.0, rng.uniform(0, 3e-4)])))
    cap = float(b.sum() * n_layers * rng.uniform(0.05, 0.5))
    reqs = [PlanRequest(i, int(b[i]), int(b[i] * 16 - rng.integers(0, 4)), int(rng.integers(1, 40)),
                        float(rng.uniform(0, 6)), float(rng.uniform(1.0, 3.0) * comp.sum()))
            for i in range(n_req)]
    return cm, cap, reqs


def _node_bound_misses(make_case, seed, trials=120, n_reqs=(1, 5)):
    """Every alive child's bound in the search's trace (reference search) against the exact latency of each
    completion that fits the capacity (brute force): (bounds checked, bounds above the best such completion).
    Good first incumbents prune most children, hence this many batches for a few hundred checks. ``n_reqs``: the
    range the batch sizes are drawn from (past 4 requests, at most 8 layers: 5 candidates each)."""
    rng = np.random.default_rng(seed)
    checked = misses = 0
    for _ in range(trials):
        n_req = int(rng.integers(*n_reqs))
        n_layers = int(rng.integers(2, 17 if n_req < 4 else 9))
        cm, cap, reqs = make_case(rng, n_req, n_layers)
        pl = Planner(cm, cap, window=(3, 8), check_better=False, node_limit=None)
        win = pl.constraints.horizon(reqs)
        bb = BranchAndBound(pl.constraints, win, PlanStats())
        bb.trace = []
        bb.run()
        tables = candidate_tables(n_layers)
        b0 = win.blocks[0]
        exact = {}
        for ks in itertools.product(range(len(tables.counts)), repeat=n_req):
            host = tables.hosts[list(ks)]
            if pl.constraints.memory(host, bb.bcap[None])[0] <= bb.cap:
                exact[ks] = cm.step(Placement(~host), b0).total_s
        for prefix, lat_lb, alive in bb.trace:
            for k in range(lat_lb.size):
                fixed = {bb.order[d]: c for d, c in enumerate(prefix + [k])}
                fits = [lat for ks, lat in exact.items() if all(ks[r] == c for r, c in fixed.items())]
                if not alive[k]:
                    assert not fits, "a child with a fitting completion was cut for capacity"
                    continue
                if fits:
                    checked += 1
                    misses += lat_lb[k] > min(fits) * (1 + 1e-9)
    return checked, misses


@pytest.mark.parametrize("make_case", [harsh_case, tight_case])
def test_node_bounds_hold_for_every_capacity_feasible_completion(make_case):
    """Every child's bound in the search is <= the exact latency of each completion that fits (brute force)."""
    checked, misses = _node_bound_misses(make_case, 2)
    assert misses == 0
    assert checked > (500 if make_case is harsh_case else 150)


def _preemptive(make_case):
    def case(rng, n_req, n_layers):
        cm, cap, reqs = make_case(rng, n_req, n_layers)
        return cm.with_updates(transfer="preemptive"), cap, reqs
    return case


@pytest.mark.parametrize("make_case", [harsh_case, tight_case])
def test_node_bounds_hold_on_the_preemptive_link_at_every_depth(make_case, monkeypatch):
    """On the "preemptive" link (CostModel transfer="preemptive") every bound of the search, the propagated and tail
    bounds at every depth included, is <= the latency of each completion that fits: the search prunes with the same
    bounds there."""
    monkeypatch.setattr(search, "DP_REST_SHARE", 1.0)
    checked, misses = _node_bound_misses(_preemptive(make_case), 7, trials=80)
    assert misses == 0
    assert checked > (300 if make_case is harsh_case else 80)


@pytest.mark.parametrize("make_case", [harsh_case, tight_case])
def test_propagated_bound_with_least_offload_holds_at_every_depth(make_case, monkeypatch):
    """The propagated bound above the leaves, each unassigned request at the host layers common to the candidates
    it can still fit with (BranchAndBound._least_offload), at every depth: below every fitting completion."""
    monkeypatch.setattr(search, "DP_REST_SHARE", 1.0)
    checked, misses = _node_bound_misses(make_case, 5)
    assert misses == 0
    assert checked > (400 if make_case is harsh_case else 100)


def test_brute_force_check_catches_an_inflated_least_offload(monkeypatch):
    """The check above has teeth: the least offload's transfers counted 1.1 times make some bound exceed a fitting
    completion's latency."""
    monkeypatch.setattr(search, "DP_REST_SHARE", 1.0)
    real = BranchAndBound._least_offload

    def inflated(self, depth, w, kmins):
        return w + 1.1 * (real(self, depth, w, kmins) - w)

    monkeypatch.setattr(BranchAndBound, "_least_offload", inflated)
    assert _node_bound_misses(harsh_case, 5)[1] + _node_bound_misses(tight_case, 5)[1] > 0


def test_node_bounds_count_the_tail_bound_and_the_check_catches_it_inflated(monkeypatch):
    """The tail bound (BranchAndBound._tail_bound: the unassigned requests' forced offload on the propagated bound's
    critical path) raises bounds in the brute-force check above, which still finds none above a fitting completion;
    the same bound with the tail's part tripled makes some bound exceed one."""
    monkeypatch.setattr(search, "DP_REST_SHARE", 1.0)
    real, added = search.tail_cover, []

    def counted(*args):
        added.append(real(*args))
        return added[-1]

    monkeypatch.setattr(search, "tail_cover", counted)
    checked = 0
    for make_case in (harsh_case, tight_case):
        n, misses = _node_bound_misses(make_case, 6, trials=100, n_reqs=(5, 6))
        checked += n
        assert misses == 0
    assert checked > 100 and sum(v > 0 for v in added) > 50
    monkeypatch.setattr(search, "tail_cover", lambda *args: 3.0 * real(*args))
    misses = [_node_bound_misses(make_case, 6, trials=100, n_reqs=(5, 6))[1] for make_case in (harsh_case, tight_case)]
    assert sum(misses) > 0


def test_critical_windows_give_the_value_of_dp_bound_and_bound_what_more_host_layers_add():
    """bounds.critical_windows: the entries on the path that gave dp_bound its value, with the compute of the layers
    on it, sum to the bound; a matrix grown by more host layers has a bound at least this one plus the growth on
    that path (what the tail bound rests on); the compiled search's propagated bound writes the same codes."""
    rng = np.random.default_rng(7)
    grew = 0
    for _ in range(300):
        n_req, n_layers = int(rng.integers(1, 5)), int(rng.integers(1, 14))
        comp = rng.uniform(0.2, 2.0, n_layers)
        host = rng.random((n_req, n_layers)) < rng.uniform(0.1, 0.9)
        x = rng.uniform(0.05, 3.0, n_req)
        v = sum(x[r] * count_matrix(host[r]) for r in range(n_req))
        codes = np.empty((1, n_layers), dtype=np.int64)
        bound = dp_bound(v[None], comp, codes)[0]
        assert bound == dp_bound(v[None], comp)[0]
        value, layer, path = 0.0, n_layers - 1, []
        while layer >= 0:
            value += comp[layer]
            code = int(codes[0, layer])
            if code == CONTINUE:
                layer -= 1
                continue
            path.append((code, layer))
            value += v[code + 1, layer]
            layer = -1 if code == FROM_START else code
        assert value == pytest.approx(bound, rel=1e-12)
        ms, ls = np.empty(n_layers, np.int64), np.empty(n_layers, np.int64)
        n = critical_windows(codes[0], ms, ls)
        assert list(zip(ms[:n].tolist(), ls[:n].tolist())) == path
        r = int(rng.integers(n_req))
        more = host[r] | (rng.random(n_layers) < 0.3)
        grown = x[r] * (count_matrix(more) - count_matrix(host[r]))
        on_path = sum(grown[m + 1, layer] for m, layer in path)
        grew += on_path > 0
        assert dp_bound((v + grown)[None], comp)[0] >= (bound + on_path) * (1 - 1e-12)
        if cc.HAVE_NUMBA:
            w = np.ascontiguousarray(v.T)  # the compiled search's layout: [layer, row]
            got = np.empty((2, n_layers), np.int64)
            lat = cc._dp_full(0, 0, 0.0, w[None], w[None], w, True, comp, np.empty(n_layers),
                              np.empty(n_layers, np.int64), np.empty((2, n_layers)), False, got, 1, True)
            assert lat == bound and got[1].tolist() == codes[0].tolist()
    assert grew > 100


def test_tail_cover_is_the_linear_relaxation_below_every_integer_choice_and_the_twin_agrees():
    """bounds.tail_cover: at most the cost of every choice (one candidate per row, from its first) that reaches
    ``y``, and equal to the linear relaxation's optimum, checked by duality: the largest of
    ``lam * y + sum_i min_k (c[i, k] - lam * a[i, k])`` over the slopes between a row's points (and 0); the jitted twin
    gives the same float."""
    rng = np.random.default_rng(8)
    relaxed = 0
    for _ in range(400):
        n_rows, n_cand = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        a = np.cumsum(rng.integers(1, 20, (n_rows, n_cand)), axis=1) * rng.uniform(0.5, 3.0, (n_rows, 1))
        c = rng.uniform(0.0, 5.0, (n_rows, n_cand)) * (rng.random((n_rows, n_cand)) < 0.9)
        lo = rng.integers(0, n_cand, n_rows)
        most = float(a[:, -1].sum())
        y = float(rng.uniform(-5.0, 1.1 * most))
        got = tail_cover(a, c, lo, y, np.empty(a.size), np.empty(a.size))
        best = math.inf
        for ks in itertools.product(*(range(int(first), n_cand) for first in lo)):
            if sum(a[i, k] for i, k in enumerate(ks)) >= min(y, most):
                best = min(best, sum(c[i, k] for i, k in enumerate(ks)))
        assert got <= best + 1e-9
        relaxed += got < best - 1e-9
        lams = {0.0} | {float((c[i, k] - c[i, j]) / (a[i, k] - a[i, j])) for i in range(n_rows)
                        for j in range(lo[i], n_cand) for k in range(j + 1, n_cand)}
        dual = max(lam * min(y, most) + sum(float((c[i, lo[i]:] - lam * a[i, lo[i]:]).min()) for i in range(n_rows))
                   for lam in lams if lam >= 0)
        assert got == pytest.approx(dual, rel=1e-9, abs=1e-12)
        if cc.HAVE_NUMBA:
            assert cc._tail_cover(a, c, lo, y, np.empty(a.size), np.empty(a.size)) == got
    assert relaxed > 20


def test_dp_bound_is_a_monotone_lower_bound_and_the_latency_of_a_preemptive_link():
    rng = np.random.default_rng(3)
    for _ in range(400):
        n_req, n_layers = int(rng.integers(1, 5)), int(rng.integers(1, 12))
        comp = rng.uniform(0.2, 2.0, n_layers)
        host = rng.random((n_req, n_layers)) < rng.uniform(0.1, 0.9)
        b = rng.integers(1, 30, n_req).astype(float)
        cm = CostModel(comp, float(rng.uniform(2, 40)))
        x = b / cm.link_blocks_per_s
        v = sum(x[r] * count_matrix(host[r]) for r in range(n_req))
        bound = dp_bound(v[None], comp)[0]
        assert bound <= cm.step(Placement.from_mask(~host), b).total_s * (1 + 1e-12)
        hosts = [np.flatnonzero(h).tolist() for h in host]
        assert bound == pytest.approx(preemptive_latency(comp.tolist(), hosts, x.tolist()), rel=1e-12)
        free = np.argwhere(~host)
        if free.size:  # one more host layer never lowers it
            r, layer = free[rng.integers(len(free))]
            more = host[r].copy()
            more[layer] = True
            grown = v + x[r] * (count_matrix(more) - count_matrix(host[r]))
            assert dp_bound(grown[None], comp)[0] >= bound * (1 - 1e-12)


def test_cover_cost_is_below_every_integer_cover_and_the_twin_agrees():
    """The forced cover (bounds.cover_cost): for any offload counts n_r <= L of the requests not assigned yet, the
    link time sum xfer_r n_r is at least the cover cost of the blocks they free, sum b_r n_r (and of any fewer);
    it never falls below the old bound y * min(b0 / b) / link where they can free y; the jitted twin gives the
    same floats."""
    rng = np.random.default_rng(4)
    for _ in range(300):
        n_req, n_layers = int(rng.integers(1, 7)), int(rng.integers(1, 40))
        blocks = rng.integers(0, 300, n_req).astype(float)
        b0 = np.minimum(blocks, np.maximum(blocks - rng.integers(0, 2, n_req), 0))
        link, latency = float(rng.uniform(10, 1e4)), float(rng.choice([0.0, rng.uniform(0, 1e-2)]))
        xfer = b0 / link + np.where(b0 > 0, latency, 0.0)
        order = rng.permutation(n_req).tolist()
        tables = cover_tables(order, blocks, xfer, n_layers)
        for e in range(n_req + 1):
            rest = order[e:]
            n = rng.integers(0, n_layers + 1, (20, len(rest)))
            freed = n @ blocks[rest] if rest else np.zeros(20)
            cost = n @ xfer[rest] if rest else np.zeros(20)
            for y in (freed, freed * rng.uniform(0, 1, 20)):
                assert np.all(cover_cost(y, tables, e) <= cost * (1 + 1e-12) + 1e-15)
            y = rng.uniform(-10, 1.2 * blocks.sum() * n_layers + 1, 30)
            got = cover_cost(y, tables, e)
            ratio = min([b0[r] / blocks[r] for r in rest if blocks[r] > 0], default=1.0)
            can = y <= blocks[rest].sum() * n_layers  # beyond it no assignment fits: any bound holds
            assert np.all((got >= np.maximum(y, 0) * ratio / link * (1 - 1e-12) - 1e-15)[can])
            if cc.HAVE_NUMBA:
                assert [cc._cover_cost(float(v), tuple(tables), e) for v in y] == got.tolist()


def _root_children_bounds(cm, cap, reqs, rest_grow=None):
    """The reference search's bounds of the first request's children (the root expanded by hand)."""
    pl = Planner(cm, cap, window=(4, 16), check_better=False, node_limit=None, compiled=False)
    bb = BranchAndBound(pl.constraints, pl.constraints.horizon(reqs), PlanStats())
    if rest_grow is not None:
        bb.rest_grow = np.full_like(bb.rest_grow, rest_grow)
    zero = np.zeros(bb.n_layers)
    n_kids = len(bb.counts)
    cut = bb._capacity_cut(0, bb.order[0], n_kids, 0.0, zero)
    kids = bb._bound_children(0, bb.order[0], n_kids, cut, zero, zero, bb.comp_total, 0.0,
                              np.zeros(bb.sep_off.size), np.zeros(bb.mats.shape[1:]))
    return kids.lat_lb, kids.alive


def test_a_small_request_that_grows_a_block_no_longer_loosens_the_separable_bound():
    """The separable bound prices the unassigned requests' offload at their blocks now (``b0``) while capacity counts
    their blocks at the capacity step (``bcap``). Scaled by the least ``b0 / bcap`` among them, one small request
    about to grow a block (8 -> 9 blocks) cut every child's bound by about a ninth of the rest's transfer time. The
    bound weighted by ``bcap`` less the blocks that grow (at most every transfer of the densest candidate each) is
    never looser, and here raises the children's bounds by several percent; both stay below every completion
    (test_node_bounds_hold_for_every_capacity_feasible_completion, whose tight case has requests that grow)."""
    rng = np.random.default_rng(3)
    n_layers = 32
    comp = 1.5e-3 * rng.uniform(0.95, 1.05, n_layers)
    b = np.array([600, 420, 300, 200, 120, 60, 30, 8])
    cm = CostModel(comp, float(b.sum() / (4.0 * comp.mean())))
    cap = float(b.sum() * n_layers * 0.4)
    # 8 blocks of 16 tokens, full: the 4th step adds a 9th block (capacity step min_steps - 1 = 3)
    reqs = [PlanRequest(i, int(b[i]), int(b[i] * 16 - (0 if i == len(b) - 1 else 8)), None, 5.0, 10.0)
            for i in range(len(b))]
    new, alive = _root_children_bounds(cm, cap, reqs)
    old, _ = _root_children_bounds(cm, cap, reqs, rest_grow=1e12)  # the weighted term priced out: the old bound
    assert alive.any()
    assert (new[alive] >= old[alive]).all()
    assert (new[alive] / old[alive]).max() > 1.03


@pytest.mark.parametrize("n_layers", [1, 2, 3, 8, 32, 80, 128])
def test_the_densest_candidate_counts_the_most_transfers_of_every_tiling(n_layers):
    """The separable bound's correction for blocks that grow prices each grown block at the densest candidate's
    transfers per tiling (its last column), taken as the most any candidate counts."""
    n = candidate_tables(n_layers).sep.n
    assert np.array_equal(n[:, -1], n.max(axis=1))
