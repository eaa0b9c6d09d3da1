"""benchmarks/planner.py's proof section: its leaf recorder sees what the search schedules; its table reads right."""

import numpy as np
from benchmark_scripts import load_benchmark

from orbitflow.plan import Planner
from orbitflow.plan.types import PlanStats


def _batches(bench, n):
    """The speed table's batches of 5 requests over 16 layers (seed 3): small enough for every proof to finish."""
    return bench.speed_cases(3, 5, 16, n)


def test_leaf_recorder_changes_no_plan_and_every_leaf_bound_holds():
    """LeafGaps is the reference search with a recorder: the same optimum as the planner's exact solve, and the
    release/need bound it records never exceeds the exact latency of the same plan (the bound is valid)."""
    bench = load_benchmark("planner")
    leaves = 0
    for cm, cap, reqs in _batches(bench, 6):
        planner = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False)
        plan = planner.plan(reqs)
        rules = planner.constraints
        gaps = bench.LeafGaps(rules, rules.horizon(reqs), PlanStats())
        host = gaps.run()
        assert (host is None) == (not plan.feasible)
        if host is not None:
            assert np.isclose(gaps.best_key[0], plan.predicted_step_s, rtol=1e-9)
        for bound, lat in gaps.seen:
            assert bound <= lat * (1 + 1e-9)
        leaves += len(gaps.seen)
    assert leaves > 0


def test_proof_table_has_a_row_per_feasible_batch_and_no_leaf_beats_a_proven_optimum():
    bench = load_benchmark("planner")
    out: list[str] = []
    bench.bench_proof(4, 3, 5.0, 5.0, 2.0, out, n_req=5, n_layers=16)
    rows = [line for line in out if line.startswith("| ") and not line.startswith("| batch")]
    feasible = sum(Planner(cm, cap, alpha=1.0, window=(4, 16)).plan(reqs).feasible
                   for cm, cap, reqs in _batches(bench, 4))
    assert len(rows) == feasible > 0
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "True"  # every batch this small is proven within the cap
        if cells[9] != "-":
            least = float(cells[9].split("/")[1].rstrip("% "))
            assert least >= 0.0  # a proven optimum: no leaf is faster
    assert any(line.startswith("Proofs done within") for line in out)
