"""benchmarks/planner_workload.py: it records the engine's own planner calls, whole enough to solve again to the same
plan, samples the largest batches, and its exact re-solve is never beaten by the engine's where it proves."""

import math

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


def test_sample_takes_the_largest_batches_evenly_spaced_in_the_runs_order(bench):
    def call(size, tag):
        return bench.Call([PlanRequest(f"{tag}-{i}", 1, 16) for i in range(size)], ctx=None)

    calls = [call(s, k) for k, s in enumerate([2, 4, 3, 4, 1, 4, 4, 3, 4])]
    fours = [c for c in calls if len(c.requests) == 4]
    assert bench.sample(calls, 5) == fours  # exactly the 4s
    assert bench.sample(calls, 2) == [fours[0], fours[-1]]  # evenly spaced: both ends
    six = bench.sample(calls, 7)  # the 4s, then the 3s, in the run's order
    assert six == [c for c in calls if len(c.requests) >= 3]


def test_the_exact_re_solve_is_never_beaten_where_it_proves_and_the_summary_counts_it(bench, recorded):
    calls, metrics = recorded
    picked = bench.sample(calls, 6)
    rows = [bench.resolve(c, cap_s=5.0, engine_first=i % 2 == 0) for i, c in enumerate(picked)]
    for r in rows:
        if r["exact"].stats.exact and r["exact"].feasible:
            assert r["exact"].predicted_step_s <= r["engine"].predicted_step_s * (1 + 1e-9)
        if r["exact"].stats.exact:  # a proof of infeasibility too
            assert r["engine"].feasible <= r["exact"].feasible
        assert r["engine_s"] > 0 and r["exact_s"] > 0
    s = bench.summarize(bench.Run.parse(RUN), calls, rows, metrics, 5.0)
    assert s["n"] == len(picked) and s["layers"] == 32 and s["largest"] == 4
    assert s["exact_unproven"] == sum(not r["exact"].stats.exact for r in rows)
    assert s["both_feasible"] == sum(r["engine"].feasible and r["exact"].feasible for r in rows)
    assert math.isnan(s["excess_mean"]) or s["excess_mean"] >= -1e-9


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
