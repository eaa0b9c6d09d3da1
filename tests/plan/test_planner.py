import itertools
import math
import re

import numpy as np
import pytest

from orbitflow.plan import CostModel, Placement, Planner, PlanRequest, pruned_distances
from orbitflow.plan import compiled as cc

# Paper section 2.3: tokens 34 -> 3 blocks at step 1, 49 -> 4 blocks 15 steps later; request 2: 6 blocks.
CM = CostModel([1.0] * 9, 3.0)


def paper_requests(offset=0, slo=math.inf):
    return [PlanRequest("r1", 3 if offset < 15 else 4, 34 + offset, None, 0.0, slo),
            PlanRequest("r2", 6, 81 + offset, None, 0.0, slo)]



def plan_matches_brute_force(pl, reqs, n_layers):
    """Plan ``reqs`` and check feasibility and step latency against brute force; returns (plan, best latency)."""
    got = pl.plan(reqs)
    best = brute_force(pl, reqs, n_layers)
    assert got.feasible == (best is not None)
    if best is not None:
        assert got.predicted_step_s == pytest.approx(best, rel=1e-9)
    return got, best

def test_paper_example_plans():
    pl = Planner(CM, 70, alpha=1, window=(1, 16))
    b_ok = pl.evaluate(Placement.from_distances(9, [None, 3]), paper_requests())
    # B fits at step 1 (69 blocks) but the window shrinks to the 15 steps before request 1 grows to 78
    assert b_ok.feasible and b_ok.window == 15 and b_ok.memory_blocks == 69 and b_ok.expiry_step == 15
    b_late = pl.evaluate(Placement.from_distances(9, [None, 3]), paper_requests(15))
    assert not b_late.feasible and b_late.memory_blocks == 78
    a = pl.evaluate(Placement.from_distances(9, [3, 3]), paper_requests(15))
    c = pl.evaluate(Placement.from_distances(9, [4, 3]), paper_requests(15))
    assert a.feasible and a.predicted_step_s == pytest.approx(13.0) and a.memory_blocks == 70
    assert c.feasible and c.predicted_step_s == pytest.approx(9 + 2 / 3) and c.memory_blocks == 70
    # at step 16 the planner finds a stall-no-worse-than-C plan within 70 blocks
    p16 = pl.plan(paper_requests(15))
    assert p16.feasible and p16.predicted_step_s <= c.predicted_step_s + 1e-12
    assert p16.placement.memory_blocks([4, 6]) <= 70


def test_paper_example_window_forces_growth_aware_choice():
    # a window that must cover the growth at step 16 rules out B already at step 1
    pl = Planner(CM, 70, alpha=1, window=(16, 16))
    b = pl.evaluate(Placement.from_distances(9, [None, 3]), paper_requests())
    assert not b.feasible
    p = pl.plan(paper_requests())
    assert p.feasible and p.window == 16
    assert p.placement.memory_blocks([4, 6]) <= 70
    assert p.predicted_step_s == pytest.approx(9.0)  # stall-free (e.g. C) is still possible


@pytest.fixture(params=["compiled", "reference"])
def impl(request, monkeypatch):
    """Run a brute-force check with the compiled search and with the pure Python / NumPy reference."""
    if request.param == "compiled" and not cc.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    monkeypatch.setenv(cc.ENV, "1" if request.param == "compiled" else "0")
    return request.param


def random_case(rng, n_req, n_layers):
    comp = rng.uniform(1e-3, 2e-3, n_layers)
    b = rng.integers(1, 60, n_req)
    link = float(b.sum() / (comp.mean() * rng.uniform(1.5, 6.0)))
    cap = float(b.sum() * n_layers * rng.uniform(0.25, 0.9))
    reqs = [PlanRequest(i, int(b[i]), int(b[i] * 16 - rng.integers(0, 16)),
                        int(rng.integers(1, 40)) if rng.random() < 0.7 else None,
                        float(rng.uniform(0, 6)), float(rng.uniform(1.0, 2.5) * comp.sum()))
            for i in range(n_req)]
    return CostModel(comp, link), cap, reqs


_BRUTE: dict = {}  # brute force answers, shared by the compiled and the reference runs of a test


def _case_key(pl, reqs, *extra):
    cm = pl.cost_model
    comp = tuple(cm.compute(0).tolist()) if cm.depends_on_tokens else tuple(cm.compute().tolist())
    return (comp, cm.depends_on_tokens, cm.link_blocks_per_s, cm.transfer, cm.prefetch_slots, cm.request_overhead_s,
            cm.batch_overhead_s, cm.transfer_latency_s, cm.host_layer_s, pl.capacity_blocks, pl.alpha, pl.min_steps,
            pl.max_steps, tuple(reqs), *extra)


def brute_force(pl, reqs, n_layers):
    key = _case_key(pl, reqs, "best")
    if key not in _BRUTE:
        _BRUTE[key] = _brute_force(pl, reqs, n_layers)
    return _BRUTE[key]


def _brute_force(pl, reqs, n_layers):
    best = None
    for ds in itertools.product(pruned_distances(n_layers), repeat=len(reqs)):
        e = pl.evaluate(Placement.from_distances(n_layers, ds), reqs)
        if e.feasible and (best is None or e.predicted_step_s < best):
            best = e.predicted_step_s
    return best


def brute_force_case(rng, min_req=1, min_layers=2, **planner):
    """A batch small enough for brute force (up to 5 requests; 16 layers up to 3 requests, else 8) and its Planner
    (``planner``: extra arguments); returns (planner, requests, layers)."""
    n_req = int(rng.integers(min_req, 6))
    n_layers = int(rng.integers(min_layers, 17)) if n_req <= 3 else int(rng.integers(min_layers, 9))
    cm, cap, reqs = random_case(rng, n_req, n_layers)
    pl = Planner(cm, cap, alpha=float(rng.choice([0.0, 0.5, 1.0])), window=(2, 10), check_better=False, **planner)
    return pl, reqs, n_layers


@pytest.mark.parametrize("seed", range(6))
def test_pruned_search_is_exact_vs_brute_force(seed, impl):
    rng = np.random.default_rng(100 + seed)
    for _ in range(5):
        pl, reqs, n_layers = brute_force_case(rng)
        n_req = len(reqs)
        got, best = plan_matches_brute_force(pl, reqs, n_layers)
        if best is not None:
            again = pl.evaluate(got.placement, reqs)
            assert again.feasible and again.predicted_step_s == pytest.approx(got.predicted_step_s)
        else:
            assert got.placement is None and len(got.victims) == n_req


@pytest.mark.parametrize("transfer", ["edf", "preemptive"])
@pytest.mark.parametrize("seed", range(3))
def test_search_is_exact_with_engine_overheads_in_the_cost_model(seed, impl, transfer):
    """A calibrated profile adds a fixed latency per transfer, a per-request compute overhead and extra compute
    on every layer that reads prefetched KV: the bounds must stay valid lower bounds and the search exact, in
    both implementations, on both links."""
    rng = np.random.default_rng(200 + seed)
    for _ in range(4):
        n_req = int(rng.integers(1, 5))
        n_layers = int(rng.integers(2, 11)) if n_req <= 3 else int(rng.integers(2, 7))
        base, cap, reqs = random_case(rng, n_req, n_layers)
        comp = base.compute()
        cm = CostModel(comp, base.link_blocks_per_s, request_overhead_s=float(rng.uniform(0, 2) * comp.mean()),
                       transfer_latency_s=float(rng.uniform(0, 1.5) * comp.mean()),
                       host_layer_s=float(rng.uniform(0, 1.0) * comp.mean()), transfer=transfer)
        pl = Planner(cm, cap, alpha=float(rng.choice([0.0, 0.5, 1.0])), window=(2, 10), check_better=False)
        got, best = plan_matches_brute_force(pl, reqs, n_layers)
        if best is not None:
            est = cm.step(got.placement, [r.blocks_per_layer for r in reqs], total_tokens=sum(r.tokens for r in reqs))
            assert got.predicted_step_s == pytest.approx(est.total_s, rel=1e-9)


def test_window_is_largest_feasible_and_capacity_holds():
    rng = np.random.default_rng(7)
    for _ in range(20):
        cm, cap, reqs = random_case(rng, 3, 8)
        pl = Planner(cm, cap, window=(1, 12), check_better=False)
        p = pl.plan(reqs)
        if not p.feasible:
            continue
        assert 1 <= p.window <= 12
        for t in range(p.window):  # capacity holds at every step of the window
            b = [max(q.blocks_per_layer, -(-(q.tokens + min(t, q.tokens_left if q.tokens_left is not None
                                                          else t)) // 16)) for q in reqs]
            assert p.placement.memory_blocks(b) <= cap + 1e-6
        assert p.violations <= pl.alpha * p.window + 1e-9


def test_alpha_zero_rejects_violations_and_deposit_helps():
    cm = CostModel([1.0] * 4, 1.0)
    reqs = [PlanRequest("a", 4, 60, None, 0.0, 4.5)]
    # capacity 0 blocks: impossible. capacity 13: must offload >= 1 layer (4 resident-blocks per layer)
    pl = Planner(cm, 13, alpha=0.0, window=(4, 4))
    p = pl.plan(reqs)
    # one host layer at 4 blocks takes 4 s to move: the step exceeds the 4.5 s SLO with no deposit
    assert p.predicted_step_s > 4.5 and not p.feasible
    rich = [PlanRequest("a", 4, 60, None, 100.0, 4.5)]
    q = pl.plan(rich)
    assert q.feasible and q.violations == 0
    assert Planner(cm, 13, alpha=1.0, window=(4, 4)).plan(reqs).feasible


def test_without_token_deposit_no_step_banks_for_a_later_one():
    """--no-token-deposit delivers each token as it is generated, so a fast step early in the window cannot pay for a
    slow one later: the planner counts every step over the SLO (the fluid balance capped at 0), on both paths."""
    from orbitflow.plan import deposit

    # 15 tokens: 1 block for two steps, then 2 blocks; offloading a layer makes the later steps slower than the SLO
    reqs = [PlanRequest("a", 1, 15, None, 0.0, 5.0)]
    for compiled in (False, True):
        on = Planner(CostModel([1.0] * 4, 1.0), 7, alpha=0.0, window=(4, 4), compiled=compiled).plan(reqs)
        off = Planner(CostModel([1.0] * 4, 1.0), 7, alpha=0.0, window=(4, 4), compiled=compiled,
                      token_deposit=False).plan(reqs)
        assert on.feasible and on.violations == 0  # the two fast steps bank what the slow ones spend
        assert not off.feasible
    # the model itself: steps of 4 s then 6 s under a 5 s SLO
    banked = deposit.violations([4.0, 6.0], [0, 3], [3, 5], np.array([5.0]), np.zeros(1), 5)
    capped = deposit.violations([4.0, 6.0], [0, 3], [3, 5], np.array([5.0]), np.zeros(1), 5, bank_max=0.0)
    assert banked[-1] == 0 and capped.tolist() == [0, 0, 0, 0, 1, 2]
    assert deposit.balance_after(0.0, 5.0, [4.0], [0], [3], 3) == pytest.approx(0.6)
    assert deposit.balance_after(2.0, 5.0, [4.0], [0], [3], 3, bank_max=0.0) == 0.0


def test_victim_orders():
    cm = CostModel([1.0] * 4, 1.0)
    reqs = [PlanRequest("small", 2, 20, None, 5.0), PlanRequest("big", 9, 140, None, 0.0),
            PlanRequest("mid", 4, 60, None, 100.0)]
    assert Planner(cm, 0).plan(reqs).victims == ("mid", "big", "small")  # 4*4+100 > 9*4 > 2*4+5
    assert Planner(cm, 0, victim_order="longest").plan(reqs).victims == ("big", "mid", "small")
    assert Planner(cm, 0, victim_order="shortest").plan(reqs).victims == ("small", "mid", "big")
    rnd = Planner(cm, 0, victim_order="random", seed=1).plan(reqs).victims
    assert sorted(rnd) == sorted(["small", "big", "mid"])
    custom = Planner(cm, 0, victim_order=lambda rs: [r.request_id for r in rs][::-1]).plan(reqs)
    assert custom.victims == ("mid", "big", "small")
    with pytest.raises(ValueError, match="victim_order must be one of"):
        Planner(cm, 0, victim_order="nope")


def test_random_victims_are_drawn_afresh_per_batch_state_and_reproducibly():
    """A planner is built per solve: the random rule must not deal every solve the same permutation (that is a fixed
    rule by batch position), yet the same batch and seed give the same order."""
    cm = CostModel([1.0] * 4, 1.0)

    def victims(seed, grown):
        batch = [PlanRequest(f"r{i}", 4, 60 + grown + i, None, 0.0) for i in range(4)]
        return Planner(cm, 0, victim_order="random", seed=seed).plan(batch).victims

    assert victims(3, 0) == victims(3, 0)
    firsts = {victims(3, grown)[0] for grown in range(40)}  # the contexts grow by a token a step
    assert firsts == {"r0", "r1", "r2", "r3"}
    assert [victims(3, g) for g in range(10)] != [victims(4, g) for g in range(10)]


def test_uniform_space_is_one_distance_and_never_beats_pruned():
    rng = np.random.default_rng(11)
    for _ in range(15):
        cm, cap, reqs = random_case(rng, 3, 10)
        u = Planner(cm, cap, window=(2, 8), space="uniform", check_better=False).plan(reqs)
        p = Planner(cm, cap, window=(2, 8), check_better=False).plan(reqs)
        if u.feasible:
            assert len(set(u.distances)) == 1
            assert p.feasible and p.predicted_step_s <= u.predicted_step_s + 1e-12


def test_full_space_never_worse_than_pruned():
    rng = np.random.default_rng(12)
    stopped = 0
    for _ in range(6):
        cm, cap, reqs = random_case(rng, 3, 10)
        p = Planner(cm, cap, window=(2, 8), check_better=False).plan(reqs)
        f = Planner(cm, cap, window=(2, 8), space="full", check_better=False, full_max_evals=200).plan(reqs)
        assert f.feasible == p.feasible
        if p.feasible:
            assert f.predicted_step_s <= p.predicted_step_s + 1e-12
            assert Planner(cm, cap, window=(2, 8)).evaluate(f.placement, reqs).feasible
            # a local search proves nothing, and the pruned search's bound does not bound the full space
            assert f.stats.exact == 0 and f.stats.lower_bound_s is None and f.stats.gap is None
            hurried = Planner(cm, cap, window=(2, 8), space="full", time_limit_s=1e-9).plan(reqs)
            if hurried.feasible:  # the local search also stops at the deadline
                stopped += 1
                assert hurried.stats.full_evals == 0
    assert stopped > 0


def test_a_faster_plan_does_not_expire_a_plan_before_the_least_window():
    """The paper's Delta_min: the solver is never invoked more often than every min_steps steps. Here a faster plan
    exists from step 1 (a block boundary); the plan ran out at step 1 although the window's least length is 4."""
    cm = CostModel([1e-3] * 8, link_blocks_per_s=1e4)
    reqs = [PlanRequest("r0", 10, 160, 68, 0.0, 0.009), PlanRequest("r1", 10, 159, 70, 0.0, 0.02),
            PlanRequest("r2", 1, 16, 186, 0.0, 0.02)]
    unbounded = Planner(cm, 148.0, alpha=0.5, window=(1, 64)).plan(reqs)
    assert unbounded.feasible and unbounded.replan_step == 1  # what the search finds without a least window
    p = Planner(cm, 148.0, alpha=0.5, window=(4, 64)).plan(reqs)
    assert p.feasible and p.stats.expiry_searches >= 1 and p.replan_step >= 4


def test_victim_rules_pause_the_newest_of_equals():
    """Requests the rule cannot tell apart keep their order of arrival: the last in the batch is paused first (the
    oldest was, so a stream of equal newcomers each paused the one before it and the first waited for them all)."""
    cm = CostModel([1.0] * 4, 1.0)
    reqs = [PlanRequest(i, 4, 60, None, 0.0) for i in ("old", "mid", "new")]
    for rule in ("largest-kv+deposit", "longest", "shortest"):
        assert Planner(cm, 0, victim_order=rule).plan(reqs).victims == ("new", "mid", "old"), rule


def test_expiry_detects_better_plan_after_growth():
    # B is optimal at step 1 only while request 1 has 3 blocks; the plan must expire at the boundary
    pl = Planner(CM, 70, alpha=1, window=(1, 20))
    p = pl.plan(paper_requests())
    assert p.feasible and p.predicted_step_s == pytest.approx(9.0)
    assert p.expiry_step is not None and 1 <= p.expiry_step <= 15
    assert p.replan_step <= p.window


def test_expiry_better_plan_check():
    # capacity is ample now, then growth makes offloading necessary -> expiry at the block boundary
    cm = CostModel([1.0] * 4, 100.0)
    reqs = [PlanRequest("a", 2, 32, None, 0.0)]  # 2 blocks, grows to 3 at step 1
    p = Planner(cm, 8, window=(1, 4)).plan(reqs)
    assert p.feasible and p.expiry_step == 1 and p.window == 1


def small_growing_case(rng, token_compute):
    """1-3 small requests that cross block boundaries within a few steps, some of them finishing early."""
    n_req, n_layers = int(rng.integers(1, 4)), int(rng.integers(2, 7))
    comp = rng.uniform(1e-3, 2e-3, n_layers)
    b = rng.integers(1, 8, n_req)
    link = float(b.sum() / (comp.mean() * rng.uniform(1.0, 8.0)))
    cap = float(b.sum() * n_layers * rng.uniform(0.5, 1.1))
    reqs = [PlanRequest(i, int(b[i]), int(b[i] * 16 - rng.integers(0, 3)),
                        int(rng.integers(0, 6)) if rng.random() < 0.6 else None, float(rng.uniform(0, 3)),
                        float(rng.uniform(0.9, 2.5) * comp.sum()) if rng.random() < 0.5 else math.inf)
            for i in range(n_req)]
    if token_compute:  # compute grows with the batch's tokens
        slope = rng.uniform(0, 0.05)
        cm = CostModel(lambda tokens: comp * (1 + slope * tokens), link)
    else:
        cm = CostModel(comp, link)
    return cm, cap, reqs, n_layers


def brute_force_replan_step(pl, reqs, plan, n_layers):
    key = _case_key(pl, reqs, plan.distances, plan.window)
    if pl.cost_model.depends_on_tokens:  # the compute function is not comparable: never share
        key = (id(pl), *key)
    if key not in _BRUTE:
        _BRUTE[key] = _brute_force_replan_step(pl, reqs, plan, n_layers)
    return _BRUTE[key]


def _brute_force_replan_step(pl, reqs, plan, n_layers):
    """min(window, capacity overflow, first block boundary inside the window where some feasible plan of the
    pruned space is strictly faster than ``plan`` for the batch as it will be then); a boundary before the window's
    least length (the paper's Delta_min) counts as that length."""
    from orbitflow.plan import deposit

    host = plan.placement.host
    win = pl.constraints.horizon(reqs)
    over = pl.constraints.first_over(host, win.blocks)
    stop = plan.window if not over.size or over[0] < 1 else min(plan.window, int(over[0]))
    seg_lat = pl.constraints.seg_latencies(win, host)
    for t in sorted({max(t, pl.constraints.min_steps) for t in win.boundaries}):
        if t >= stop:
            break
        later = [PlanRequest(q.request_id, q.blocks_per_layer,
                             q.tokens + (t if q.tokens_left is None else min(t, q.tokens_left)),
                             None if q.tokens_left is None else q.tokens_left - min(t, q.tokens_left),
                             deposit.balance_after(q.deposit, q.slo_s, seg_lat, win.seg_starts, win.seg_ends, t,
                                                   win.bank_max), q.slo_s) for q in reqs]
        now = pl.evaluate(plan.placement, later).predicted_step_s
        for ds in itertools.product(pruned_distances(n_layers), repeat=len(reqs)):
            other = pl.evaluate(Placement.from_distances(n_layers, ds), later)
            if other.feasible and other.predicted_step_s < now * (1 - 1e-9):
                return t
    return stop


@pytest.mark.parametrize("token_compute", [False, True])
def test_replan_step_matches_brute_force(token_compute, impl):
    # finished requests stop growing, the executor's schedule is not monotone in transfer sizes and
    # token-dependent compute can hide other plans' transfers: none of it may delay the re-plan
    rng = np.random.default_rng(21 + token_compute)
    checked = 0
    for _ in range(60):
        cm, cap, reqs, n_layers = small_growing_case(rng, token_compute)
        lo = int(rng.integers(1, 4))
        pl = Planner(cm, cap, alpha=float(rng.choice([0.0, 0.5, 1.0])), window=(lo, lo + int(rng.integers(4, 12))),
                     node_limit=None, expiry_node_limit=None)
        plan = pl.plan(reqs)
        if not plan.feasible:
            continue
        checked += 1
        truth = brute_force_replan_step(pl, reqs, plan, n_layers)
        assert plan.replan_step == truth
    assert checked >= 30


def test_expiry_when_growth_speeds_up_another_plan():
    # non-preemptive EDF is not monotone: once request 0 grows (step 1), (5, 5, 2) gets faster than the step-0 optimum
    # although that plan's own latency did not change; the plan expires at the least window (2), not before
    pl = Planner(CostModel([3.0, 2.0, 1.0, 3.0, 4.0], 1.0), 39.0, window=(2, 3), node_limit=None,
                 expiry_node_limit=None)
    reqs = [PlanRequest(0, 1, 16), PlanRequest(1, 4, 49), PlanRequest(2, 3, 33)]
    plan = pl.plan(reqs)
    later = [PlanRequest(q.request_id, q.blocks_per_layer, q.tokens + 2) for q in reqs]
    assert pl.evaluate(plan.placement, later).predicted_step_s == plan.predicted_step_s
    assert pl.evaluate(Placement.from_distances(5, [5, 5, 2]), later).predicted_step_s < plan.predicted_step_s
    assert plan.window == 3 and plan.expiry_step == 2


def test_expiry_when_more_compute_hides_another_plans_transfers():
    n_layers, tokens_now = 4, 17 + 81 + 48
    cm = CostModel(lambda tokens: np.full(n_layers, 1.0 if tokens <= tokens_now else 4.0), 1.0)
    reqs = [PlanRequest("a", 2, 17), PlanRequest("b", 6, 81), PlanRequest("c", 3, 48)]  # c grows at step 1
    plan = Planner(cm, n_layers * 12 - 6, window=(2, 4), node_limit=None, expiry_node_limit=None).plan(reqs)
    assert plan.feasible and plan.window > 2 and plan.expiry_step == 2  # not before the least window


@pytest.mark.parametrize("seed", range(3))
def test_budgeted_search_certifies_its_gap(seed, impl):
    """Out of nodes, the planner returns a feasible plan no better than the optimum and a lower bound no
    worse than it (brute force), and says the search was cut."""
    rng = np.random.default_rng(300 + seed)
    cut = 0
    for _ in range(12):
        n_req = int(rng.integers(3, 6))
        n_layers = int(rng.integers(4, 13)) if n_req <= 3 else int(rng.integers(4, 8))
        cm, cap, reqs = random_case(rng, n_req, n_layers)
        pl = Planner(cm, cap, window=(2, 10), check_better=False, node_limit=2)
        got = pl.plan(reqs)
        best = brute_force(pl, reqs, n_layers)
        near = Planner(cm, cap, window=(2, 10), check_better=False, gap=0.05).plan(reqs)
        assert near.feasible == (best is not None)
        if best is not None:
            assert best <= near.predicted_step_s <= best / (1 - 0.05) * (1 + 1e-9)
            assert near.stats.lower_bound_s <= best * (1 + 1e-9) and near.stats.gap <= 0.05 + 1e-12
        assert near.stats.proven(0.05)  # the search ended, within its gap
        if not got.feasible:
            assert best is None or not got.stats.exact  # proven infeasible, or out of budget
            continue
        assert best is not None and got.predicted_step_s >= best * (1 - 1e-9)
        assert pl.evaluate(got.placement, reqs).feasible
        if got.stats.exact:
            assert got.predicted_step_s == pytest.approx(best, rel=1e-9) and got.stats.gap == 0
        else:
            cut += 1
            assert got.stats.lower_bound_s <= best * (1 + 1e-9)
            lower = got.predicted_step_s * (1 - got.stats.gap)
            assert lower == pytest.approx(got.stats.lower_bound_s)
    assert cut > 0


def test_time_limit_and_expiry_budget_are_conservative():
    rng = np.random.default_rng(8)
    for _ in range(20):
        cm, cap, reqs = random_case(rng, 4, 8)
        exact = Planner(cm, cap, window=(1, 12), node_limit=None, expiry_node_limit=None).plan(reqs)
        tight = Planner(cm, cap, window=(1, 12), node_limit=None, expiry_node_limit=1).plan(reqs)
        assert tight.feasible == exact.feasible
        if exact.feasible:  # same plan; an undecided expiry search ends the plan earlier, never later
            assert tight.predicted_step_s == exact.predicted_step_s
            if exact.expiry_step is not None:
                assert tight.expiry_step is not None and tight.expiry_step <= exact.expiry_step
    hurried = Planner(cm, cap, window=(1, 12), time_limit_s=1e-9).plan(reqs)
    assert hurried.stats.exact == 0 or hurried.stats.nodes <= 1
    with pytest.raises(ValueError, match="time_limit_s"):
        Planner(cm, cap, time_limit_s=0)


def test_expiry_node_limit_none_is_unlimited_whatever_the_main_budget():
    rng = np.random.default_rng(8)
    cut_short = 0
    for _ in range(20):
        cm, cap, reqs = random_case(rng, 4, 8)
        plans = [Planner(cm, cap, window=(1, 12), node_limit=3, expiry_node_limit=limit).plan(reqs)
                 for limit in (None, 10**9, 2)]
        assert plans[0].expiry_step == plans[1].expiry_step and plans[0].distances == plans[1].distances
        cut_short += plans[2].expiry_step != plans[1].expiry_step
    assert cut_short > 0  # a small expiry budget does end plans earlier in these cases


def test_latency_prefilter_memo_matches_fresh_answers():
    # the prefilter remembers the largest bound that passed and the smallest that failed (violations only
    # grow with the bound); in any query order it must answer as a fresh one does

    rng = np.random.default_rng(5)
    mixed = 0
    for _ in range(30):
        cm, cap, reqs = random_case(rng, 4, 8)
        pl = Planner(cm, cap, alpha=float(rng.choice([0.0, 0.5, 1.0])), window=(2, 12))
        win = pl.constraints.horizon(reqs)
        memo = pl.constraints.lat_prefilter(win)
        answers = []
        for lb in rng.uniform(0.5, 3.0, 40) * float(win.slo.min()):
            fresh = pl.constraints.lat_prefilter(win)(lb)
            assert memo(lb) == fresh
            answers.append((lb, fresh))
        answers.sort()
        assert [a for _, a in answers] == sorted((a for _, a in answers), reverse=True)  # monotone
        mixed += any(a for _, a in answers) and not all(a for _, a in answers)
    assert mixed >= 10  # the cases exercise both answers


def test_empty_batch_and_bad_args():
    cm = CostModel([1.0] * 3, 1.0)
    p = Planner(cm, 10).plan([])
    assert p.feasible and p.predicted_step_s == 3.0
    with pytest.raises(ValueError, match="window must satisfy 1 <= min_steps <= max_steps"):
        Planner(cm, 10, window=(3, 2))
    with pytest.raises(ValueError, match="space must be 'pruned', 'uniform' or 'full'"):
        Planner(cm, 10, space="nope")
    with pytest.raises(ValueError, match="'x' appears twice"):
        Planner(cm, 10).plan([PlanRequest("x", 1, 1), PlanRequest("x", 1, 1)])
    with pytest.raises(ValueError, match="slo_s"):
        PlanRequest("x", 1, 1, slo_s=0.0)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        PlanRequest("x", 1, -1)
    for kwargs, name in (({"node_limit": 0}, "node_limit"), ({"expiry_node_limit": 0}, "expiry_node_limit"),
                         ({"gap": -0.1}, "gap"), ({"alpha": float("nan")}, "alpha"),
                         ({"full_max_evals": 0}, "full_max_evals")):
        with pytest.raises(ValueError, match=name):
            Planner(cm, 10, **kwargs)
    with pytest.raises(ValueError, match="capacity_blocks"):
        Planner(cm, -1)
    with pytest.raises(ValueError, match=r"distances\[1\]"):
        Placement.from_distances(3, [None, 0])
    with pytest.raises(ValueError, match="layer_compute_scale must be a scalar or 3 floats"):
        CostModel([1.0] * 3, 1.0, layer_compute_scale=[1.0, 2.0])


@pytest.mark.parametrize("deposit", [5e3, 1e30, math.inf])
def test_huge_deposit_absorbs_every_miss(deposit):
    # the balance / miss ratio used to be cast to int64 before it was clamped, and overflowed
    pl = Planner(CostModel([1.0] * 4, 1.0), 100, alpha=0.0, window=(8, 8))
    plan = pl.plan([PlanRequest("a", 1, 16, None, deposit, slo_s=3.0)])  # every step misses by a third
    assert plan.feasible and plan.violations == 0 and plan.distances == (None,)


@pytest.mark.parametrize("seed", range(4))
def test_pruned_search_exact_with_identical_requests_and_tight_link(seed, impl):
    # duplicated requests exercise the symmetry breaking; a slow link makes the search link-bound
    rng = np.random.default_rng(300 + seed)
    for _ in range(4):
        n_layers = int(rng.integers(2, 13))
        cm, cap, reqs = random_case(rng, int(rng.integers(2, 4)), n_layers)
        reqs = reqs + [PlanRequest(f"dup{i}", q.blocks_per_layer, q.tokens, q.tokens_left, q.deposit, q.slo_s)
                       for i, q in enumerate(reqs[:2])]
        cm = cm.with_updates(link_blocks_per_s=cm.link_blocks_per_s * float(rng.uniform(0.3, 1.0)))
        pl = Planner(cm, cap, alpha=float(rng.choice([0.0, 1.0])), window=(2, 8), check_better=False,
                     node_limit=None)
        got = pl.plan(reqs)
        best = brute_force(pl, reqs, n_layers)
        assert got.stats.exact == 1
        assert got.feasible == (best is not None)
        if best is not None:
            assert got.predicted_step_s == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("transfer, comp, link, cap, reqs, best", [
    # EDF moves a layer's copies in request order: b (4 blocks) between the identical a and c changes when the link
    # next chooses, so (3, 3, 1) steps in 40 and its mirror (1, 3, 3) in 41
    ("edf", [3.0, 2.0, 1.0, 3.0, 4.0, 2.0, 2.0], 1.0, 45.0,
     [PlanRequest("a", 3, 48), PlanRequest("b", 4, 64), PlanRequest("c", 3, 48)], 40.0),
    # the fair link breaks ties by request index even between neighbours: (2, 1) in 12.67, (1, 2) in 15.67
    ("fair", [1.0, 3.0, 1.0, 2.0], 3.0, 19.0, [PlanRequest("a", 4, 64), PlanRequest("b", 4, 64)], 38 / 3),
])
def test_identical_requests_the_link_tells_apart_are_both_searched(impl, transfer, comp, link, cap, reqs, best):
    """The symmetry rule (identical requests' offload counts non-increasing) dropped these optima and still claimed
    the slower plan exact, with a lower bound above the optimum."""
    pl = Planner(CostModel(comp, link, transfer=transfer), cap, window=(1, 1), check_better=False, node_limit=None)
    got = pl.plan(reqs)
    assert got.stats.exact and got.predicted_step_s == pytest.approx(best, rel=1e-12)
    assert got.stats.lower_bound_s <= best * (1 + 1e-12)
    assert brute_force(pl, reqs, len(comp)) == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("transfer", ["edf", "preemptive", "fair"])
@pytest.mark.parametrize("seed", range(3))
def test_search_is_exact_with_identical_requests_apart_and_adjacent(seed, impl, transfer):
    """Identical requests next to each other, and apart with another request between them, on every link."""
    rng = np.random.default_rng(700 + seed)
    for _ in range(5):
        n_layers = int(rng.integers(2, 9))
        cm, cap, reqs = random_case(rng, 2, n_layers)
        a, b = reqs
        twin = PlanRequest("twin", a.blocks_per_layer, a.tokens, a.tokens_left, a.deposit, a.slo_s)
        reqs = [a, b, twin] if rng.random() < 0.5 else [a, twin, b]
        cm = CostModel(cm.compute(), cm.link_blocks_per_s * float(rng.uniform(0.3, 1.0)), transfer=transfer)
        pl = Planner(cm, cap, alpha=float(rng.choice([0.0, 1.0])), window=(2, 6), check_better=False,
                     node_limit=None)
        got = pl.plan(reqs)
        best = brute_force(pl, reqs, n_layers)
        assert got.stats.exact and got.feasible == (best is not None)
        if best is not None:
            assert got.predicted_step_s == pytest.approx(best, rel=1e-9)


def test_hint_keeps_the_optimum_and_rescues_a_small_budget():
    rng = np.random.default_rng(31)
    checked = 0
    for _ in range(12):
        cm, cap, reqs = random_case(rng, 5, 16)
        kwargs = dict(window=(2, 8), check_better=False)
        exact = Planner(cm, cap, node_limit=None, **kwargs).plan(reqs)
        if not exact.feasible:
            continue
        checked += 1
        hint = dict(zip([q.request_id for q in reqs], exact.distances))
        again = Planner(cm, cap, node_limit=None, **kwargs).plan(reqs, hint=hint)
        assert again.predicted_step_s == pytest.approx(exact.predicted_step_s, rel=1e-12)
        tiny = Planner(cm, cap, node_limit=1, **kwargs).plan(reqs, hint=hint)  # the hint is tried first
        assert tiny.feasible and tiny.predicted_step_s <= exact.predicted_step_s * (1 + 1e-12)
        odd = Planner(cm, cap, node_limit=None, **kwargs).plan(reqs, hint={"nope": 3, reqs[0].request_id: 999})
        assert odd.predicted_step_s == pytest.approx(exact.predicted_step_s, rel=1e-12)  # a stale hint is harmless
    assert checked >= 5


@pytest.mark.parametrize("seed", range(3))
def test_search_is_exact_vs_brute_force_on_the_preemptive_link(seed, impl):
    """On the "preemptive" link the search keeps its latency bounds (the release/need bound is that link's latency,
    and the others are below it) and stays exact, in both implementations; its optimum is never slower than the
    EDF link's, as no step is, and the SLO then rules out no plan that EDF allows."""
    rng = np.random.default_rng(400 + seed)
    for _ in range(5):
        pl, reqs, n_layers = brute_force_case(rng)
        pre = Planner(pl.cost_model.with_updates(transfer="preemptive"), pl.capacity_blocks, alpha=pl.alpha,
                      window=(pl.min_steps, pl.max_steps), check_better=False)
        got, best = plan_matches_brute_force(pre, reqs, n_layers)
        edf = brute_force(pl, reqs, n_layers)
        if edf is not None:
            assert best is not None and best <= edf * (1 + 1e-12)
        assert got.placement is None or pre.evaluate(got.placement, reqs).predicted_step_s == got.predicted_step_s


@pytest.mark.parametrize("seed", range(3))
def test_search_is_exact_vs_brute_force_at_prefetch_depth_two(seed):
    """At depth 2 the single-slot latency bounds do not hold; the search keeps only valid cuts and stays exact,
    and capacity charges the deeper buffer."""
    rng = np.random.default_rng(300 + seed)
    for _ in range(4):
        n_req = int(rng.integers(1, 4))
        n_layers = int(rng.integers(2, 9))
        cm1, cap, reqs = random_case(rng, n_req, n_layers)
        cm = CostModel(cm1.compute(), cm1.link_blocks_per_s, prefetch_slots=2)
        pl = Planner(cm, cap, alpha=float(rng.choice([0.5, 1.0])), window=(2, 10), check_better=False)
        got, best = plan_matches_brute_force(pl, reqs, n_layers)
        if best is not None:
            b = [r.blocks_per_layer for r in reqs]
            assert got.memory_blocks == pytest.approx(got.placement.memory_blocks(b, slots=2))
            assert got.memory_blocks <= cap + 1e-6


@pytest.mark.parametrize("seed", range(3))
def test_local_improvement_never_returns_an_infeasible_or_worse_plan(seed, impl):
    """A search cut short polishes its incumbent: the plan is feasible (checked again from scratch), never slower
    than without the polish, never faster than the optimum (brute force); an exact search over a small space
    skips it. 24 batches: the tightened first incumbents leave the polish little to find in most."""
    rng = np.random.default_rng(700 + seed)
    polished = 0
    for _ in range(24):
        n_req = int(rng.integers(2, 5))
        n_layers = int(rng.integers(4, 13)) if n_req <= 3 else int(rng.integers(4, 9))
        cm, cap, reqs = random_case(rng, n_req, n_layers)
        kwargs = dict(window=(2, 10), check_better=False, node_limit=int(rng.integers(1, 4)))
        pl = Planner(cm, cap, **kwargs)
        got = pl.plan(reqs)
        plain = Planner(cm, cap, improve_evals=0, **kwargs).plan(reqs)
        best = brute_force(pl, reqs, n_layers)
        assert got.feasible or not plain.feasible
        if not got.feasible:
            continue
        again = pl.evaluate(got.placement, reqs)
        assert again.feasible and again.predicted_step_s == got.predicted_step_s
        assert best is not None and got.predicted_step_s >= best * (1 - 1e-9)
        assert got.predicted_step_s <= plain.predicted_step_s * (1 + 1e-12)
        if got.stats.exact:
            assert got.stats.improve_evals == 0
        polished += got.stats.improve_evals > 0 and got.predicted_step_s < plain.predicted_step_s
    assert polished > 0  # the polish found something in some case


# (4, 32) batches of the speed benchmark (benchmarks/planner.py, seed 0: batches 270, 53 and 16, rounded, with flat
# compute): (compute per layer, link blocks/s, capacity, SLO over the step's compute, requests (blocks per layer,
# tokens, tokens left, deposit)). A search cut after its first dive returned plans 7-12% above the optimum there:
# the greedy and uniform seeds left capacity unused, and the local improvement could not hand it back.
CUT_SHORT_CASES = [
    (1.06e-3, 141712.0, 15852.0, 1.507,
     [(277, 4418, None, 13.9), (371, 5926, None, 14.6), (123, 1966, 13, 7.7), (72, 1151, 605, 3.5)]),
    (1.35e-3, 43960.0, 5238.0, 1.97,
     [(198, 3158, 2001, 11.6), (15, 231, 2396, 12.7), (16, 245, None, 2.8), (44, 696, 49, 10.8)]),
    (1.58e-3, 37305.0, 3757.0, 1.76,
     [(66, 1051, 1307, 5.9), (135, 2154, 3594, 18.4), (69, 1101, 3529, 10.8), (16, 242, 3490, 3.7)]),
]


@pytest.mark.parametrize("case", range(len(CUT_SHORT_CASES)))
def test_a_search_cut_after_its_first_dive_lands_within_5_percent_of_the_optimum(case, impl):
    comp, link, cap, slo, rows = CUT_SHORT_CASES[case]
    cm = CostModel([comp] * 32, link)
    reqs = [PlanRequest(i, b, t, left, dep, slo * 32 * comp) for i, (b, t, left, dep) in enumerate(rows)]
    exact = Planner(cm, cap, window=(4, 16), node_limit=None, check_better=False).plan(reqs)
    cut = Planner(cm, cap, window=(4, 16), node_limit=1, check_better=False).plan(reqs)
    assert exact.stats.exact and not cut.stats.exact and cut.feasible
    assert cut.predicted_step_s <= exact.predicted_step_s * 1.05


@pytest.mark.parametrize("make, says", [
    (lambda: CostModel([1e-3, math.inf], 1e3), "layer_compute_s must be finite seconds >= 0"),
    (lambda: CostModel([1e-3, math.nan], 1e3), "layer_compute_s must be finite seconds >= 0"),
    (lambda: CostModel([1e-3] * 2, 1e3, layer_compute_scale=math.inf), "layer_compute_scale must be finite and > 0"),
    (lambda: CostModel([1e-3] * 4, 1e3, num_layers=32), "num_layers is 32 but layer_compute_s has 4 entries"),
    (lambda: CostModel(lambda n: [1e-3] * 2, 1e3, num_layers=0), "num_layers must be an integer >= 1"),
    (lambda: CostModel(lambda n: [math.nan] * 2, 1e3, num_layers=2).compute(5), "layer_compute_s(5) must be finite"),
    (lambda: PlanRequest("a", 8.5, 120), "blocks_per_layer must be >= 0 and a whole number"),
    (lambda: PlanRequest("a", 8, 120, tokens_left=2.5), "tokens_left must be >= 0 and a whole number"),
    (lambda: PlanRequest("a", math.nan, 120), "blocks_per_layer must be >= 0"),
    (lambda: PlanRequest("a", 8, math.inf), "tokens must be >= 0"),
    (lambda: PlanRequest("a", 8, 2**70), "tokens must be >= 0 and a whole number below 2**62"),
    (lambda: PlanRequest("a", True, 120), "blocks_per_layer must be >= 0"),
    (lambda: Planner(CostModel([1e-3] * 4, 1e3), 30, host_capacity_blocks=math.nan), "host_capacity_blocks must be"),
    (lambda: Planner(CostModel([1e-3] * 4, 1e3), 30, host_capacity_blocks=-1), "host_capacity_blocks must be"),
    (lambda: Planner(CostModel([1e-3] * 4, 1e3), 30, node_limit=math.inf), "node_limit must be a whole number"),
    (lambda: Planner(CostModel([1e-3] * 4, 1e3), 30, block_size=2.5), "block_size must be a whole number"),
    (lambda: Planner(CostModel([1e-3] * 4, 1e3), 30, window=(1, 2, 3)), "window must be two whole numbers"),
    (lambda: Planner(CostModel([1e-3] * 4, 1e3), 30, window=(1.5, 4)), "window must be two whole numbers"),
])
def test_library_inputs_that_planned_wrong_or_failed_deep_are_named(make, says):
    """Found by a review of the library API: each was accepted and then planned on wrong numbers (an infinite step
    called feasible, 8.5 blocks counted as 8), or failed deep in NumPy without naming the argument."""
    with pytest.raises(ValueError, match=re.escape(says)):
        make()


def test_library_values_that_stay_accepted():
    assert PlanRequest("a", np.int64(8), 120.0, np.int32(3)).blocks_per_layer == 8  # whole numbers of any type
    cm = CostModel([1e-3] * 4, 1e3).with_updates(layer_compute_s=[2e-3] * 8)  # a uniform scale follows the layers
    assert cm.num_layers == 8 and np.all(cm.layer_compute_scale == 1.0)
    pl = Planner(CostModel([1e-3] * 4, 1e3), 48, window=(4, 8), host_capacity_blocks=math.inf)
    reqs = [PlanRequest("a", 8, 127, 40), PlanRequest("b", 4, 63, 40)]  # they outgrow the 48 blocks at step 2
    bad = pl.evaluate(Placement.from_distances(4, [None, None]), reqs)
    assert not bad.feasible and bad.replan_step == 0  # as plan() gives (it was 1: the capacity expiry's)
