"""benchmarks/planner_lp.py: its path relaxation bounds every plan from below and is the exact step at an integral
choice, and its branch and bound finds the exact search's optimum."""

import itertools
import math

import numpy as np
import pytest
from benchmark_scripts import load_benchmark

from orbitflow.plan import Planner
from orbitflow.plan.search import BranchAndBound
from orbitflow.plan.types import PlanStats

pytest.importorskip("scipy")


def _cases(bench):
    """The speed table's batches of 5 requests over 16 layers (seed 3), each with its exact planner on the preemptive
    link and a search tree and path relaxation of it: (cost model, capacity, requests, planner, tree, relaxation)."""
    for cm, cap, reqs in load_benchmark("planner").speed_cases(3, 5, 16, 6):
        pl = Planner(cm.with_updates(transfer="preemptive"), cap, alpha=1.0, window=(4, 16), node_limit=None,
                     check_better=False)
        tree = BranchAndBound(pl.constraints, pl.constraints.horizon(reqs), PlanStats())
        yield cm, cap, reqs, pl, tree, bench.PathLP(tree)


def test_path_relaxation_is_below_both_links_optima_and_exact_at_a_plan():
    bench = load_benchmark("planner_lp")
    checked = 0
    for cm, cap, reqs, pl, tree, lp in _cases(bench):
        pre = pl.plan(reqs)
        edf = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False).plan(reqs)
        if not pre.feasible:
            continue
        root, y = lp.solve([0] * tree.n_req, [len(tree.counts) - 1] * tree.n_req)
        assert root <= pre.predicted_step_s * (1 + 1e-9)
        assert not edf.feasible or root <= edf.predicted_step_s * (1 + 1e-9)
        assert np.allclose(y.sum(axis=1), 1.0)
        ks = [tree.tables.distances.index(d) for d in pre.distances]
        at_plan, _ = lp.solve(ks, ks)  # one candidate per request: the relaxation is the plan's own step
        assert at_plan == pytest.approx(pre.predicted_step_s, rel=1e-9)
        checked += 1
    assert checked >= 3


def test_lp_branch_and_bound_finds_the_exact_optimum_and_cuts_within_its_gap():
    bench = load_benchmark("planner_lp")
    proven = 0
    for _, _, reqs, pl, tree, lp in _cases(bench):
        opt = pl.plan(reqs)
        dists = tree.tables.distances
        plan_of = bench.plan_pricer(pl, reqs, dists, 16)
        got = bench.lp_branch_and_bound(lp, plan_of, math.inf, 0.0, 60.0)
        assert got["done"]
        assert got["best"] == (pytest.approx(opt.predicted_step_s, rel=1e-12) if opt.feasible else math.inf)
        if opt.feasible:  # the optimum known from the start and a 5% gap: a root bound within it ends the search
            lp = bench.PathLP(tree)
            root, _ = lp.solve([0] * tree.n_req, [len(dists) - 1] * tree.n_req)
            cut = bench.lp_branch_and_bound(lp, plan_of, opt.predicted_step_s, 0.05, 60.0)
            assert cut["done"] and cut["best"] == opt.predicted_step_s
            assert (cut["nodes"] == 1) == (root >= opt.predicted_step_s * 0.95)
            proven += root >= opt.predicted_step_s * 0.95
    assert proven >= 2  # batches whose root bound is within 5% of the optimum (3.3% and 4.1% here)


def _fits(lp, ks) -> bool:
    """Whether one candidate per request meets the relaxation's capacity rows (written out here, not the script's)."""
    used = sum(lp.cap_rows[:, r * lp.n_cand + k] for r, k in enumerate(ks))
    return bool(np.all(used <= lp.cap * (1 + 1e-12)))


def _priced(bench):
    """The batches of :func:`_cases` whose root relaxation is feasible, solved there: (cost model, capacity,
    requests, planner, tree, relaxation, root bound, reduced costs, every plan that fits capacity as one candidate
    index per request)."""

    for cm, cap, reqs, pl, tree, lp in _cases(bench):
        root, _ = lp.solve([0] * tree.n_req, [len(tree.counts) - 1] * tree.n_req)
        if math.isfinite(root):
            fitting = [ks for ks in itertools.product(range(lp.n_cand), repeat=lp.n_req) if _fits(lp, ks)]
            yield cm, cap, reqs, pl, tree, lp, root, bench.reduced_costs(lp), fitting


def _least_under(steps: dict, partial) -> float:
    """The least step among the plans of ``steps`` (candidate indices -> step) under ``partial`` (-1: unassigned);
    inf where none is."""
    return min((step for ks, step in steps.items() if all(p < 0 or k == p for k, p in zip(ks, partial))),
               default=math.inf)


def _step(pl, reqs, tree, ks) -> float:
    """The predicted step of one candidate index per request."""
    from orbitflow.plan import Placement

    dists = tree.tables.distances
    return pl.evaluate(Placement.from_distances(16, [dists[k] for k in ks]), reqs).predicted_step_s


def test_reduced_costs_bound_every_plan_and_plans_within_counts_them():
    bench = load_benchmark("planner_lp")
    rng = np.random.default_rng(0)
    checked = tight = 0
    for _, _, reqs, pl, tree, lp, root, pen, fitting in _priced(bench):
        assert pen.shape == (tree.n_req, len(tree.counts)) and np.all(pen >= 0)
        for j in rng.choice(len(fitting), size=min(150, len(fitting)), replace=False):
            ks = fitting[j]
            step = _step(pl, reqs, tree, ks)
            added = float(sum(pen[r, k] for r, k in enumerate(ks)))
            assert root + added <= step * (1 + 1e-7), (ks, root, added, step)
            tight += added > 0
        # the count against the enumeration, for budgets from none to every plan
        sums = np.array([sum(pen[r, k] for r, k in enumerate(ks)) for ks in fitting])
        for budget in (0.0, *np.quantile(sums, [0.01, 0.3, 1.0]) * 1.0000001):
            assert bench.plans_within(lp, pen, float(budget), 10**9) == int((sums < budget).sum())
        capped = bench.plans_within(lp, pen, math.inf, 7)
        assert capped == min(7, len(fitting))
        lp.solve([0] * tree.n_req, [0] + [len(tree.counts) - 1] * (tree.n_req - 1))  # a node: its prices differ
        with pytest.raises(ValueError, match="every candidate"):
            bench.reduced_costs(lp)
        checked += 1
    assert checked >= 3 and tight > 0  # some plans' reduced costs raise the bound (the check is not vacuous)


def test_fixing_bound_bounds_every_plan_under_a_partial_plan_and_only_rises_down_the_tree():
    bench = load_benchmark("planner_lp")
    rng = np.random.default_rng(1)
    checked = raised = 0
    for _, _, reqs, pl, tree, lp, root, pen, fitting in _priced(bench):
        steps = {ks: _step(pl, reqs, tree, ks) for ks in fitting}
        for _ in range(40):  # a random plan, and its partial plans from the root down in a random order
            ks = list(steps)[rng.integers(len(steps))]
            partial = np.full(lp.n_req, -1, dtype=np.int16)
            last = bench.fixing_bound(root, pen, partial)
            assert last == pytest.approx(root + pen.min(axis=1).sum())
            for r in rng.permutation(lp.n_req):
                partial[r] = ks[r]
                now = bench.fixing_bound(root, pen, partial)
                assert now >= last - 1e-12
                raised += now > last + 1e-12
                last = now
                assert now <= _least_under(steps, partial) * (1 + 1e-7)
            assert last == pytest.approx(root + sum(pen[r, k] for r, k in enumerate(ks)))
        checked += 1
    assert checked >= 3 and raised > 0


def test_the_summary_says_the_lp_nodes_of_proofs_and_open_searches_apart():
    bench = load_benchmark("planner_lp")
    assert bench._lp_nodes([(1, True), (13, True), (416, False), (1673, False)]) == (
        " (proofs: 1-13 LP nodes; open after 416-1673)")
    assert bench._lp_nodes([(5, False)]) == " (open after 5)"
    assert bench._lp_nodes([]) == ""


def test_fixing_bound_holds_for_the_edf_link_at_the_nodes_a_traced_search_expands():
    """What the page counts: the bound at the partial plans `traced_children` returns (EDF rules, the EDF optimum
    known), against the least EDF step of the plans under each."""
    bench, planner_bench = load_benchmark("planner_lp"), load_benchmark("planner")
    checked = 0
    for cm, cap, reqs, _, tree, _lp, root, pen, fitting in _priced(bench):
        edf = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False)
        best = edf.plan(reqs)
        if not best.feasible:
            continue
        steps = {ks: _step(edf, reqs, tree, ks) for ks in fitting}
        search, _, nodes = planner_bench.traced_children(edf.constraints, reqs, best.predicted_step_s * (1 + 1e-9),
                                                         30.0)
        assert not search.timed_out and nodes
        for a in nodes:
            least = _least_under(steps, a)
            if math.isfinite(least):  # (a node with no plan that fits under it has nothing to bound)
                assert bench.fixing_bound(root, pen, a) <= least * (1 + 1e-7)
                checked += 1
    assert checked >= 20
