"""The simulator runs the real engine loop on a virtual clock: a small paper-scale sweep."""

import json

import pytest

from orbitflow.bench.workload import Trace, TraceRequest
from orbitflow.plan.hardware import load_preset
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


def test_the_host_pool_is_the_configured_one(a5000):
    """--host-kv-blocks sizes the simulated host pool (it used to be the profile's whatever the flag said)."""
    from orbitflow.sim.runner import build_sim_engine

    engine = build_sim_engine(a5000, sim_config(a5000, host_kv_blocks=1234))
    assert engine.kv.host_pool.num_blocks == 1234
    assert build_sim_engine(a5000, sim_config(a5000)).kv.host_pool.num_blocks == a5000.host_kv_blocks


def test_the_simulator_charges_the_link_the_planner_plans_for(a5000):
    """--kv-link preemptive: the simulated executor prices steps on the preemptive link and the planner plans for
    it (a batch that must offload: 2 x 32 layers of 560-750 blocks against 9000)."""
    trace = Trace([TraceRequest("a", 0.0, 12000, 20), TraceRequest("b", 0.0, 9000, 20)])
    for link in ("edf", "preemptive"):
        result = simulate_trace(a5000, trace, sim_config(a5000, policy="orbitflow", slo_scale=1.5,
                                                         device_kv_blocks=9000, kv_link=link))
        assert result.engine.executor.cost_model.transfer == link
        assert result.engine.controller.ctx.cost_model.transfer == link
        assert result.engine.kv.usage() == (0, 0) and result.metrics.num_finished == 2
        assert result.engine.kv.host_pool.peak_used > 0


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


def _step_times(result):
    return [t for r in sorted(result.records, key=lambda r: r.request_id) for t in r.generated_s]


def test_noise_is_reproducible_under_a_seed_and_differs_across_seeds(a5000):
    trace = Trace([TraceRequest("a", 0.0, 4000, 60), TraceRequest("b", 0.5, 9000, 40)])

    def run(seed, cv=0.05):
        config = sim_config(a5000, policy="flexgen+", slo_scale=1.5, seed=seed, device_kv_blocks=6000)
        return simulate_trace(a5000, trace, config, noise_cv=cv)

    same1, same2, other = run(1), run(1), run(2)
    assert _step_times(same1) == _step_times(same2)
    assert _step_times(same1) != _step_times(other)
    clean = _step_times(run(1, cv=0.0))
    assert _step_times(same1) != clean
    # mean-one noise: the run takes about as long as without it
    assert abs(same1.metrics.makespan_s / run(1, cv=0.0).metrics.makespan_s - 1) < 0.1
    assert _step_times(run(2, cv=0.0)) == clean  # without noise the seed changes nothing here


def test_planner_does_not_see_the_noise(a5000):
    """The controller predicts with the noise-free profile: its predictions are the clean run's."""
    trace = Trace([TraceRequest("a", 0.0, 4000, 30), TraceRequest("b", 0.0, 9000, 30)])
    config = sim_config(a5000, policy="orbitflow", slo_scale=1.5, device_kv_blocks=6000)
    noisy = simulate_trace(a5000, trace, config, noise_cv=0.05)
    clean = simulate_trace(a5000, trace, config)
    first = [noisy.engine.controller.records[0].predicted_step_s]
    assert first == [clean.engine.controller.records[0].predicted_step_s]


def test_solver_time_is_charged_on_the_virtual_clock(a5000):
    trace = Trace([TraceRequest("a", 0.0, 4000, 30), TraceRequest("b", 1.0, 9000, 30)])
    config = sim_config(a5000, policy="orbitflow", slo_scale=1.5, device_kv_blocks=6000)
    free = simulate_trace(a5000, trace, config).metrics
    slow = simulate_trace(a5000, trace, config, solver_time="2000ms")
    charged = [r.charged_s for r in slow.engine.controller.records]
    assert charged and all(c == 2.0 for c in charged)
    # the first token of each request waits for (at least) the solve that admits it
    assert slow.metrics.ttft_mean_s >= free.ttft_mean_s + 2.0 - 1e-9
    assert slow.metrics.extra["solver_charged_s"] == pytest.approx(2.0 * len(charged))


def test_a_reused_decision_is_not_charged_as_a_solve(a5000):
    """Dynamic decides every step and reuses its decision until a block count changes: a fixed --solver-time
    charged every reuse as a solve (3,560 x 5 ms in a review's run), OrbitFlow's solves ahead stayed hidden."""
    run = simulate_trace(a5000, small_trace(), sim_config(a5000, policy="dynamic", slo_scale=1.5), solver_time="5ms")
    c = run.engine.controller
    charged = [r for r in c.records if r.charged_s]
    assert 0 < len(charged) < c.solver_calls / 4  # most steps reuse the decision
    assert all(r.charged_s == pytest.approx(0.005) for r in charged)
    assert run.metrics.extra["solver_charged_s"] == pytest.approx(0.005 * len(charged))


def test_a_solve_hidden_behind_the_steps_changes_no_plan(a5000):
    """An expiry is solved ahead on the virtual clock as the engine solves it ahead in time (with --solver-time off
    too: solved ahead at no cost): a solve much shorter than a step is done by its expiry, so the plans are those of
    free solves, step for step. (The simulator used to start a charged solve at the expiry and run the old plan one
    step past it: each plan was adopted a step late.)"""
    config = sim_config(a5000, policy="orbitflow", slo_scale=1.5)
    free = simulate_trace(a5000, small_trace(), config).engine.controller
    timed = simulate_trace(a5000, small_trace(), config, solver_time="1ms").engine.controller
    assert [(r.step, r.trigger, r.distances) for r in timed.records] == [
        (r.step, r.trigger, r.distances) for r in free.records]
    expiries = [r for r in timed.records if r.trigger == "expiry"]
    assert expiries and all(r.background and r.charged_s == 0.001 for r in expiries)
    assert all(r.background for r in free.records if r.trigger == "expiry")
    assert timed.adopted_late == 0 and timed.ran_on == 0


def test_solver_time_flag_values():
    from orbitflow.sim.sweep import solver_time_model

    assert solver_time_model("off") is None
    assert solver_time_model("measured")(0.25) == 0.25
    assert solver_time_model("5ms")(0.25) == pytest.approx(0.005)
    for bad in ("fast", "-1ms", "ms"):
        with pytest.raises(ValueError, match="--solver-time"):
            solver_time_model(bad)


def test_aborted_requests_do_not_count_as_served(a5000):
    """request_records gave every request the engine ended a finish time, aborts included: num_finished and the
    throughput counted them as served (3 finished, only 1 completed)."""
    from orbitflow.bench.metrics import compute_metrics
    from orbitflow.runtime.sampling import SamplingParams
    from orbitflow.sim.runner import build_sim_engine, request_records

    engine = build_sim_engine(a5000, sim_config(a5000, policy="orbitflow", slo_scale=1.0))
    try:
        for rid in ("done", "cut", "never"):
            engine.add_request(rid, [0] * 500, SamplingParams(max_tokens=50), arrival_s=0.0, target_output_tokens=50)
        engine.abort("never")
        for _ in range(3):
            engine.step()
        engine.abort("cut")
        engine.run_until_done()
        reasons = {r.request_id: r.finish_reason for r in engine.finished}
        assert reasons == {"done": "length", "cut": "abort", "never": "abort"}
        records = {r.request_id: r for r in request_records(engine)}
        assert records["done"].finished_s is not None
        assert records["cut"].finished_s is None and records["never"].finished_s is None
        metrics = compute_metrics(list(records.values()), engine.default_slo_s)
        assert (metrics.num_requests, metrics.num_finished) == (3, 1)
    finally:
        engine.close()


def test_a_measured_solve_time_does_not_charge_the_first_run_for_warming_up(a5000, monkeypatch):
    """The first solve in a process loads the compiled planner (~75 ms against ~2 ms warm); with the solve time
    measured, it was charged to whichever run came first. A policy whose first solve ever sleeps 1 s: the
    simulator's warm-up solve takes it before the clock starts."""
    import time

    from orbitflow.policies import POLICIES
    from orbitflow.policies.orbitflow import OrbitFlowPolicy

    class ColdStart(OrbitFlowPolicy):
        name = "cold-start"
        cold = True

        def plan(self, requests, ctx):
            if ColdStart.cold:
                ColdStart.cold = False
                time.sleep(1.0)
            return super().plan(requests, ctx)

    monkeypatch.setitem(POLICIES, "cold-start", ColdStart)
    res = simulate_trace(a5000, small_trace(), sim_config(a5000, policy="cold-start"), solver_time="measured")
    assert not ColdStart.cold and res.metrics.solver_calls > 0
    assert max(r.charged_s or 0.0 for r in res.engine.controller.records) < 1.0  # each solve ~2 ms, not the sleep
