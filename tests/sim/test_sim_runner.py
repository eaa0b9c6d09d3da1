"""The simulator runs the real engine loop on a virtual clock: a small paper-scale sweep."""

import json

import pytest

from orbitflow.bench.workload import Trace, TraceRequest
from orbitflow.sim.profiles import load_preset
from orbitflow.sim.runner import sim_config, simulate_trace
from orbitflow.sim.sweep import RUN_KEYS, run_sweep


@pytest.fixture(scope="module")
def a5000():
    return load_preset("a5000-llama3-8b")


def small_trace():
    lengths = [(12000, 300), (600, 900), (4000, 700), (500, 400), (9000, 500), (800, 1200)]
    return Trace([TraceRequest(f"r{i}", 2.0 * i, inp, out) for i, (inp, out) in enumerate(lengths)])


@pytest.mark.parametrize("policy", ["orbitflow", "deepspeed", "flexgen", "flexgen+", "slo-aware", "dynamic"])
def test_every_request_finishes_and_no_block_leaks(a5000, policy):
    result = simulate_trace(a5000, small_trace(), sim_config(a5000, policy=policy, slo_scale=1.5))
    assert result.metrics.num_finished == 6
    assert [len(r.generated_s) for r in sorted(result.records, key=lambda r: r.request_id)] == [
        300, 900, 700, 400, 500, 1200]
    assert result.engine.kv.usage() == (0, 0)


def test_orbitflow_beats_deepspeed_and_pauses_under_pressure(a5000):
    orbit = simulate_trace(a5000, small_trace(), sim_config(a5000, policy="orbitflow", slo_scale=1.0)).metrics
    deep = simulate_trace(a5000, small_trace(), sim_config(a5000, policy="deepspeed", slo_scale=1.0)).metrics
    assert orbit.tbt_attainment > deep.tbt_attainment
    assert orbit.throughput_rpm > deep.throughput_rpm


def test_contention_triggers_profile_mismatch_replans(a5000):
    config = sim_config(a5000, policy="orbitflow", slo_scale=1.5)
    result = simulate_trace(a5000, small_trace(), config, contention=[(0.0, 1e9, 3.0)])
    triggers = {r.trigger for r in result.engine.controller.records}
    assert "mismatch" in triggers
    # the EWMA refresh moved the planner's link rate towards the slower truth
    assert result.engine.controller.ctx.cost_model.link_blocks_per_s < a5000.link_blocks_per_s


def test_small_sweep_json_shape(a5000, tmp_path):
    runs = run_sweep(a5000, ["orbitflow", "deepspeed"], [1.5], [2.0], num_requests=5, workers=1)
    assert len(runs) == 2
    for run in runs:
        assert set(RUN_KEYS) <= set(run)
    json.dumps({"runs": runs})
    by = {r["policy"]: r for r in runs}
    assert by["orbitflow"]["tbt_attainment"] >= by["deepspeed"]["tbt_attainment"]


@pytest.mark.parametrize("deposit", [True, False])
def test_deposit_hides_a_prefill_stall_after_fast_early_steps(a5000, deposit):
    """A short request decodes alone (fast steps bank a deposit), then a 12K-token prompt's prefill
    stalls it for seconds: the generated stream misses the SLO, the delivered one does not."""
    trace = Trace([TraceRequest("short", 0.0, 500, 400), TraceRequest("long", 10.0, 12000, 10)])
    result = simulate_trace(a5000, trace, sim_config(a5000, policy="orbitflow", slo_scale=1.5, token_deposit=deposit))
    stats = result.engine.stats
    assert stats.generated_violations >= 1
    if deposit:
        assert stats.delivered_violations < stats.generated_violations
        assert result.metrics.tbt_attainment > result.metrics.tbt_attainment_generated
    else:
        assert stats.delivered_violations == stats.generated_violations
