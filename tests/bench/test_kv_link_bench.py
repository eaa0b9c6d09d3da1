"""benchmarks/kv_link.py: the tables it reports, on hand-made runs."""

from types import SimpleNamespace

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def kvl():
    return load_benchmark("kv_link")


def run(kvl, measured, model, preemptions=0, attainment=0.9):
    S = load_benchmark("sim_vs_engine").StepSample
    steps = [S(measured_s=m, sim_model_s=p, plan_s=None, measured_stall_s=0.01, sim_stall_s=0.01) for m, p in
             zip(measured, model, strict=True)]
    metrics = SimpleNamespace(tbt_attainment=attainment, p95_tbt_s=max(measured), solver_calls=2, solver_time_s=0.004)
    return SimpleNamespace(steps=steps, preemptions=preemptions, metrics=metrics)


def test_the_ratio_is_per_round_with_a_t_interval(kvl):
    runs = {"fixed:random:7": {
        "edf": [run(kvl, [0.10, 0.10], [0.10, 0.10]), run(kvl, [0.20, 0.20], [0.10, 0.10])],
        "preemptive": [run(kvl, [0.09, 0.09], [0.095, 0.095], 3), run(kvl, [0.19, 0.19], [0.095, 0.095], 1)]}}
    lines = kvl.tables([runs])
    row = next(line for line in lines if line.startswith("| fixed:random:7 | 1/1 | 0."))
    assert "| 0.925 |" in row  # mean of 0.90 and 0.95: round k against round k, not pooled means
    assert "0.900, 0.950" in row and "| 0.950 |" in row  # the models' ratio: 0.095 / 0.10 both rounds
    m, lo, hi = kvl.interval([0.90, 0.95])
    assert m == pytest.approx(0.925) and lo < 0.90 and hi > 0.95  # t with 1 degree of freedom: wide
    per_link = next(line for line in lines if line.startswith("| fixed:random:7 | preemptive |"))
    assert "| 4 |" in per_link and "| 1.00 |" in per_link  # 4 steps, 4 preemptions: one per step
    assert per_link.endswith("| 4 | 2.00 |")  # two solves of 2 ms a run
    assert lines[-1] == ("Verdict: fixed:random:7: 0.925 measured against 0.950 predicted over 2 round(s), the "
                         "interval holds 1 (no difference the rounds can tell).")


def test_runs_that_disagree_beyond_their_intervals_are_flagged(kvl):
    def runs(ratio):
        return {"orbitflow": {"edf": [run(kvl, [0.10], [0.10]) for _ in range(3)],
                              "preemptive": [run(kvl, [0.10 * ratio + d], [0.10]) for d in (-1e-4, 0, 1e-4)]}}

    lines = kvl.tables([runs(0.95), runs(1.05)])
    assert any(line.startswith("| orbitflow | all | 1.000 |") for line in lines)  # six rounds pooled
    assert lines[-1].endswith("(but the runs' own intervals do not overlap: the profile moves the ratio more than the "
                              "rounds show).")


def test_one_round_has_no_interval(kvl):
    m, lo, hi = kvl.interval([0.97])
    assert m == 0.97 and lo != lo and hi != hi  # nan


def test_the_simulator_section_pairs_the_links_by_seed(kvl):
    lines = kvl.sim_section(2, [1.5], 3.0, num_requests=3, solver_time="off", noise_cv=0.0)
    rows = [line for line in lines if line.startswith("| 1.5 |")]
    assert [row.split(" | ")[1] for row in rows] == ["edf", "preemptive"]
    assert rows[0].endswith("|  |") and rows[1].count("[") == 2 * len(kvl.SIM_METRICS)  # 3 means + 3 differences
