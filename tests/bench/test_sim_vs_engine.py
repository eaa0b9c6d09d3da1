"""benchmarks/sim_vs_engine.py: the error figures it reports, on hand-made steps."""

import math

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def sve():
    return load_benchmark("sim_vs_engine")


def test_step_errors_split_the_stall_error(sve):
    S = sve.StepSample
    steps = [S(measured_s=0.10, sim_model_s=0.11, plan_s=0.10, measured_stall_s=0.02, sim_stall_s=0.04,
               transfer_stall_s=0.01),
             S(measured_s=0.20, sim_model_s=0.18, plan_s=None, measured_stall_s=0.02, sim_stall_s=0.04,
               transfer_stall_s=0.03)]
    e = sve.step_errors(steps)
    assert e["steps"] == 2
    assert e["step_err_median"] == pytest.approx(0.10)  # |+10%| and |-10%|
    assert e["stall_err"] == pytest.approx(1.0)  # 0.08 predicted against 0.04 measured
    assert e["stall_err_transfer"] == pytest.approx(0.0)  # the transfer model alone is right here
    assert math.isnan(sve.step_errors([])["stall_err_transfer"])


def rows(*order, se=0.0):
    """Policy rows ranked in ``order`` by attainment (0.9, 0.8, ...), all with the same P95 TBT."""
    return {p: {"tbt_attainment": 0.9 - 0.1 * i, "tbt_attainment_se": se, "p95_tbt_s": 0.1}
            for i, p in enumerate(order)}


def test_kendall_tau_allows_no_swap_at_0_9(sve):
    order = ["a", "b", "c", "d", "e"]
    assert sve.kendall_tau(rows(*order), rows(*order)) == pytest.approx(1.0)
    assert sve.kendall_tau(rows(*order), rows("b", "a", "c", "d", "e")) == pytest.approx(0.8)  # one swap: below 0.9
    assert sve.kendall_tau(rows(*order), rows(*reversed(order))) == pytest.approx(-1.0)


def test_a_tie_is_neither_agreement_nor_disagreement(sve):
    """tau-b: the simulator predicting a and b equal (same attainment, same P95 TBT) costs less than predicting
    them in the wrong order, and more than predicting them in the right one."""
    engine = rows("a", "b", "c", "d", "e")
    tied = rows("a", "b", "c", "d", "e")
    tied["b"] = dict(tied["a"])  # a and b tied
    tau = sve.kendall_tau(engine, tied)
    assert tau == pytest.approx(9 / math.sqrt(10 * 9))  # 0.949
    assert sve.kendall_tau(engine, rows("b", "a", "c", "d", "e")) < tau < 1.0
    table = {"a": {"tbt_attainment": 0.98, "p95_tbt_s": 0.1}, "b": {"tbt_attainment": 0.98, "p95_tbt_s": 0.1},
             "c": {"tbt_attainment": 0.5, "p95_tbt_s": 0.2}}
    assert sve.ranking_text(table) == "a = b > c"


def test_attainments_within_their_standard_errors_tie_and_p95_orders_them(sve):
    """The issue's rule: a tie in attainment is broken by P95 TBT. Measured means tie when their difference is
    within 1.96 standard errors; outside that, attainment orders them whatever the P95."""
    near_slo = {"tbt_attainment": 0.25, "tbt_attainment_se": 0.02, "p95_tbt_s": 0.60}
    steady = {"tbt_attainment": 0.24, "tbt_attainment_se": 0.005, "p95_tbt_s": 0.24}
    assert sve.compare(steady, near_slo) == -1  # tied attainment (0.01 < 1.96 * 0.021): the lower P95 wins
    assert sve.compare(steady, near_slo, strict=True) == 1  # strict: 0.25 > 0.24
    clear = dict(near_slo, tbt_attainment=0.40)
    assert sve.compare(steady, clear) == 1  # 0.16 apart: attainment decides, the P95 does not matter
    exact = {"tbt_attainment": 0.25, "p95_tbt_s": 0.60}  # no standard error: only equal attainments tie
    assert sve.compare(dict(exact, tbt_attainment=0.24, p95_tbt_s=0.1), exact) == 1
    assert sve.ranking_text({"near": near_slo, "steady": steady, "clear": clear}) == "clear > steady >~ near"
    # the engine's replays of one policy are noisy: the same pair measured again with a swapped mean still agrees
    swapped = {"near": dict(near_slo, tbt_attainment=0.23), "steady": steady}
    assert sve.kendall_tau({"near": near_slo, "steady": steady}, swapped) == pytest.approx(1.0)
    assert sve.kendall_tau({"near": near_slo, "steady": steady}, swapped, strict=True) == pytest.approx(-1.0)


def test_mean_row_carries_the_standard_error_of_the_attainment(sve):
    keys = {k: 0.0 for k in sve.ROW_KEYS}
    row = sve.mean_row([dict(keys, tbt_attainment=a) for a in (0.2, 0.3, 0.4)])
    assert row["tbt_attainment"] == pytest.approx(0.3)
    assert row["tbt_attainment_se"] == pytest.approx(0.1 / math.sqrt(3))
    assert sve.mean_row([dict(keys, tbt_attainment=0.5)])["tbt_attainment_se"] == 0.0


@pytest.mark.parametrize("policy", ["deepspeed", "orbitflow"])
def test_engine_steps_are_charged_with_the_planners_model_at_its_depth(sve, tiny_llama, policy):
    """The per-step error compares each engine step with the model the planner plans with (DeepSpeed's depth 2
    included): measured against a depth-1 model, DeepSpeed's steps looked 56% off when the simulator was not."""
    from tiny_models import make_llm

    from orbitflow.plan import Placement
    from orbitflow.policies import make_policy

    llm = make_llm(tiny_llama, policy=make_policy(policy), link_gbps=0.01)
    try:
        mine, planner = sve.step_model(llm.profile, llm), llm.engine.controller.ctx.cost_model
        assert mine.prefetch_slots == planner.prefetch_slots == make_policy(policy).prefetch_slots
        placement = Placement.from_distances(mine.num_layers, [1, 1])
        assert mine.step(placement, [4, 6], 150).total_s == pytest.approx(planner.step(placement, [4, 6], 150).total_s)
    finally:
        llm.close()


def test_rerun_taus_compare_consecutive_engine_rankings(sve):
    def run(*order):
        return {"policies": {p: {"engine": row} for p, row in rows(*order).items()}}

    runs = [run("a", "b", "c"), run("a", "b", "c"), run("c", "b", "a")]
    assert sve.rerun_taus(runs) == [pytest.approx(1.0), pytest.approx(-1.0)]
    assert sve.rerun_taus(runs[:1]) == []
