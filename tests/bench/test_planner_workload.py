"""benchmarks/planner_workload.py: it records the engine's own planner calls, whole enough to solve again to the same
plan, samples the largest batches, and its exact re-solve is never beaten by the engine's where it proves."""

import math
from types import SimpleNamespace

import pytest
from benchmark_scripts import load_benchmark, run_benchmark

from orbitflow.plan import PlanRequest
from orbitflow.policies import POLICIES, OrbitFlowPolicy

RUN = "a5000-llama3-8b:4:32768"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("planner_workload")


@pytest.fixture(scope="module")
def recorded(bench):
    return bench.record_run(bench.Run.parse(RUN), num_requests=6, rate_scale=5.0, slo_scale=1.5, seed=0)


def test_recording_takes_every_call_and_unregisters_its_policy(bench, recorded):
    calls, metrics = recorded
    assert bench.RECORDING not in POLICIES
    assert metrics["num_finished"] == 6
    # every solve the controller records is a policy call; Pause-Resume's trials and inline re-solves add more
    assert len(calls) >= metrics["solver_calls"] > 0
    assert max(len(c.requests) for c in calls) == 4
    assert not any(str(q.request_id).startswith("warm-up-") for c in calls for q in c.requests)


def test_a_recorded_call_solves_again_to_the_plan_the_run_got(recorded):
    calls, _ = recorded
    checked = 0
    for call in calls[::3]:
        again = OrbitFlowPolicy().plan(call.requests, call.ctx)
        assert again.feasible == call.plan.feasible
        assert again.distances == call.plan.distances
        assert again.predicted_step_s == call.plan.predicted_step_s
        checked += 1
    assert checked >= 3


def _calls(bench, sizes):
    return [bench.Call([PlanRequest(f"{k}-{i}", 1, 16) for i in range(size)], ctx=None) for k, size in enumerate(sizes)]


def test_sample_takes_the_largest_batches_whole_then_the_next_evenly_spaced(bench):
    calls = _calls(bench, [2, 4, 3, 4, 1, 4, 4, 3, 4])
    fours = [c for c in calls if len(c.requests) == 4]
    assert bench.sample(calls, 5) == fours  # exactly the 4s
    assert bench.sample(calls, 2) == [fours[0], fours[-1]]  # evenly spaced: both ends
    assert bench.sample(calls, 7) == [c for c in calls if len(c.requests) >= 3]  # the 4s, then the 3s, in order
    # three 16s among ten 15s: every 16 stays, the 15s are thinned to what is left, evenly spaced
    calls = _calls(bench, [15, 16, 15, 15, 15, 16, 15, 15, 15, 15, 16, 15, 15])
    picked = bench.sample(calls, 6)
    fifteens = [c for c in calls if len(c.requests) == 15]
    assert [c for c in picked if len(c.requests) == 16] == [c for c in calls if len(c.requests) == 16]
    assert [c for c in picked if len(c.requests) == 15] == [fifteens[0], fifteens[4], fifteens[9]]
    assert picked == [c for c in calls if c in picked]  # the run's order


def _row(engine, exact, engine_s=0.01, exact_s=0.5, size=4):
    def plan(feasible, step, proven, gap=None):
        return SimpleNamespace(feasible=feasible, predicted_step_s=step, stats=SimpleNamespace(exact=proven, gap=gap))

    return {"size": size, "engine": plan(*engine), "exact": plan(*exact), "engine_s": engine_s, "exact_s": exact_s}


def test_summary_tells_optima_from_proofs_that_no_plan_fits_and_counts_a_cut_solve_as_longest(bench):
    rows = [
        _row((True, 1.02, False, 0.05), (True, 1.00, True), exact_s=0.4),  # engine 2% over a proven optimum
        _row((False, math.inf, True), (False, math.inf, True), exact_s=0.1),  # both prove no plan fits
        _row((True, 1.00, True, 0.0), (True, 1.00, False), exact_s=2.0),  # the exact search cut at the cap
        _row((True, 0.50, False, 0.01), (True, 0.49, False), engine_s=0.9, exact_s=1.9),  # longer than its step
    ]
    s = bench.summarize(bench.Run.parse(RUN), [], rows, cap_s=2.0)
    assert (s["engine_optimal"], s["engine_none_fits"]) == (1, 1)
    assert (s["exact_optimal"], s["exact_none_fits"], s["exact_cut"]) == (1, 1, 2)
    assert s["feasible"] == 3 and s["both_feasible"] == 3 and s["longer_than_step"] == 1
    assert s["excess_mean"] == pytest.approx((0.02 + 0.0 + 0.5 / 0.49 - 1) / 3)
    assert s["proven_excess_max"] == pytest.approx(0.02) and s["proven_n"] == 1
    assert s["exact_p50_ms"] == math.inf and s["exact_p99_ms"] == math.inf  # two of four cut: the median is cut
    assert s["engine_p50_ms"] == pytest.approx(10.0)
    assert s["gap_max"] == pytest.approx(0.05)
    out: list[str] = []
    bench.table([s], out)
    assert "| > 2 s / > 2 s | 1 / 1 / 2 of 4 (cap 2 s) |" in out[-1]
    rows[3]["exact"].stats.exact = True  # now three of four proven: the median is a proven solve's time
    s = bench.summarize(bench.Run.parse(RUN), [], rows, cap_s=2.0)
    assert s["exact_p50_ms"] == pytest.approx(1900.0) and s["exact_p99_ms"] == math.inf


def test_the_exact_re_solve_is_exact_and_never_beaten_where_it_proves(bench, recorded):
    calls, _ = recorded
    picked = bench.sample(calls, 6)
    for i, call in enumerate(picked):
        r = bench.resolve(call, cap_s=5.0, engine_first=i % 2 == 0)
        assert r["exact"].stats.expiry_searches == 0  # check_better off: the optimisation alone
        if r["exact"].stats.exact and r["exact"].feasible:
            assert r["exact"].predicted_step_s <= r["engine"].predicted_step_s * (1 + 1e-9)
        if r["exact"].stats.exact:  # a proof that no plan fits too
            assert r["engine"].feasible <= r["exact"].feasible
        assert r["engine_s"] > 0 and r["exact_s"] > 0


def test_runs_are_checked_and_their_errors_name_the_flag(bench):
    for spec in ("a5000-llama3-8b:4", "a5000-llama3-8b:four:32768", "a5000-llama3-8b:0:32768"):
        with pytest.raises(ValueError, match="--runs"):
            bench.Run.parse(spec)
    with pytest.raises(ValueError, match="unknown hardware preset"):
        bench.Run.parse("no-such-preset:4:32768")


def test_main_writes_one_row_per_run(monkeypatch, tmp_path, capsys):
    md = tmp_path / "workload.md"
    run_benchmark("planner_workload", monkeypatch, "--runs", RUN, "--num-requests", "4", "--per-run", "3",
                  "--exact-cap-s", "1", "--md", str(md))
    text = md.read_text()
    assert text.startswith("## Planner: the engine's own batches")
    rows = [line for line in text.splitlines() if line.startswith("| a5000-llama3-8b |")]
    assert len(rows) == 1 and "(cap 1 s)" in rows[0]
