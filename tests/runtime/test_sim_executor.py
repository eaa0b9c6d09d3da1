"""One cost model: the engine's planner, the controller's mismatch check and the simulator all predict with
`HardwareProfile.cost_model()`, overheads included. These tests fail as soon as one of them stops doing so."""

import numpy as np
import pytest

from orbitflow.config import EngineConfig
from orbitflow.plan import Placement, PlanRequest
from orbitflow.plan.hardware import HardwareProfile
from orbitflow.policies import make_policy
from orbitflow.policies.base import PlanContext
from orbitflow.runtime.clock import VirtualClock
from orbitflow.runtime.controller import Controller
from orbitflow.runtime.outputs import ScheduleOutput, SeqInput
from orbitflow.runtime.sim_executor import SimExecutor, accounting_kv

LAYERS = 6


def calibrated(**kw) -> HardwareProfile:
    """A profile whose every overhead term is non-zero, so a path that ignores one of them disagrees."""
    base = dict(name="calibrated", num_layers=LAYERS, kv_bytes_per_token_per_layer=256, decode_a=2e-6,
                decode_b=0.012, link_bytes_per_s=2e6, device_kv_blocks=40, host_kv_blocks=4000, block_size=16,
                decode_per_request_s=0.003, transfer_latency_s=0.0007, move_latency_s=0.002,
                mixed_step_overhead_s=0.005, decode_tail_fraction=0.15, prefill_c=2e-7,
                host_layer_compute_s=[0.0004, 0.0009])
    return HardwareProfile(**(base | kw))


def execute(ex, seqs):
    """Grow the rows' KV (the scheduler's part), then run them through the executor interface."""
    for s in seqs:
        assert ex.kv.grow(s.req_id, s.start_pos + len(s.token_ids)) is None
    return ex.execute(ScheduleOutput(step=0, seqs=seqs))


def sim_step(profile, tokens, mask):
    """What the simulator charges for one decode step of requests holding `tokens` tokens under `mask`."""
    kv = accounting_kv(profile, device_blocks=10_000)
    ex = SimExecutor(profile, kv, VirtualClock())
    seqs = []
    for r, (n, row) in enumerate(zip(tokens, mask)):
        kv.allocate(r, n - 1, [bool(x) for x in row])
        seqs.append(SeqInput(r, [0], n - 1))
    kv.transfer.bytes_h2d = kv.transfer.bytes_d2h = 0  # allocation is not a placement change
    return execute(ex, seqs)


@pytest.mark.parametrize("seed", range(4))
def test_planner_and_simulator_predict_the_same_step(seed):
    rng = np.random.default_rng(seed)
    profile = calibrated()
    n_req = int(rng.integers(1, 5))
    # tokens = 16k + 5: the planner's ceil(tokens / 16) and the executor's blocks of the cached tokens agree
    tokens = [16 * int(rng.integers(1, 12)) + 5 for _ in range(n_req)]
    mask = rng.random((n_req, LAYERS)) < 0.6
    config = EngineConfig.build(model="calibrated", device_kv_blocks=profile.device_kv_blocks, block_size=16)
    planner_model = PlanContext.from_profile(config, profile).cost_model
    blocks = [-(-t // 16) for t in tokens]
    planned = planner_model.step(Placement.from_mask(mask), blocks, total_tokens=sum(tokens))
    charged = sim_step(profile, tokens, mask)
    assert charged.step_s == pytest.approx(planned.total_s, rel=1e-12)
    assert sum(charged.layer_stall_s) == pytest.approx(planned.stall_s, rel=1e-12, abs=1e-15)
    # and both carry the overheads: the same step on an overhead-free profile is cheaper
    ideal = calibrated(decode_per_request_s=0.0, transfer_latency_s=0.0, host_layer_compute_s=None)
    cheaper = ideal.cost_model().step(Placement.from_mask(mask), blocks, total_tokens=sum(tokens)).total_s
    if n_req > 1 or mask.sum() < mask.size:
        assert planned.total_s > cheaper


def test_planner_prediction_is_what_the_simulator_charges():
    profile = calibrated()
    config = EngineConfig.build(model="calibrated", device_kv_blocks=profile.device_kv_blocks, block_size=16,
                                alpha=10.0)
    ctx = PlanContext.from_profile(config, profile)
    tokens = [16 * 7 + 5, 16 * 5 + 5, 16 * 3 + 5]
    reqs = [PlanRequest(i, -(-t // 16), t, tokens_left=50, slo_s=1.0) for i, t in enumerate(tokens)]
    plan = make_policy("orbitflow").plan(reqs, ctx)
    assert plan.feasible and plan.placement.host.any()  # the budget forces offloading
    charged = sim_step(profile, tokens, plan.placement.mask)
    assert charged.step_s == pytest.approx(plan.predicted_step_s, rel=1e-9)


def test_controller_mismatch_check_uses_the_shared_model_with_its_overheads():
    profile = calibrated()
    config = EngineConfig.build(model="calibrated", device_kv_blocks=profile.device_kv_blocks, block_size=16)
    ctx = PlanContext.from_profile(config, profile)
    controller = Controller(make_policy("orbitflow"), ctx, mismatch_threshold=0.01, background=False)
    try:
        tokens, n_req = 400, 4
        per_layer = profile.cost_model().compute(tokens, n_req)  # the batch's compute, overhead included
        # A step measured exactly as the shared model says leaves the model alone ...
        controller.observe(float(per_layer.sum()), float(per_layer.sum()), per_layer.tolist(), tokens, None,
                           num_requests=n_req)
        assert not controller.mismatch
        # ... and a mismatch caused by the link alone does not bend the compute scale: the compute the model
        # expects for 4 requests (with their per-request overhead) is what was measured.
        controller.observe(float(per_layer.sum()), 2 * float(per_layer.sum()), per_layer.tolist(), tokens, None,
                           num_requests=n_req)
        assert controller.mismatch
        assert np.allclose(controller.ctx.cost_model.layer_compute_scale, 1.0)
    finally:
        controller.close()


def test_mismatch_check_does_not_learn_the_host_layers_extra_compute():
    """The layers that read prefetched KV compute ``host_layer_s`` longer by the model: a step measured so is
    no reason to scale their compute (which would charge the extra twice)."""
    profile = calibrated()
    config = EngineConfig.build(model="calibrated", device_kv_blocks=profile.device_kv_blocks, block_size=16)
    ctx = PlanContext.from_profile(config, profile)
    controller = Controller(make_policy("orbitflow"), ctx, mismatch_threshold=0.01, background=False)
    try:
        cm = ctx.cost_model
        assert cm.host_layer_s == profile.host_layer_compute_s[0] > 0
        tokens, n_req = 400, 2
        host_layers = [False, True, False, True, True, False]
        measured = cm.compute(tokens, n_req) + cm.host_layer_s * np.array(host_layers)
        # a mismatch from the link alone: the compute was what the model expects for these host layers
        controller.observe(float(measured.sum()), 2 * float(measured.sum()), measured.tolist(), tokens, None,
                           num_requests=n_req, host_layers=host_layers)
        assert controller.mismatch
        assert np.allclose(controller.ctx.cost_model.layer_compute_scale, 1.0)
    finally:
        controller.close()


def test_placement_changes_cost_bytes_plus_the_measured_host_work():
    profile = calibrated()
    kv = accounting_kv(profile, device_blocks=10_000)
    ex = SimExecutor(profile, kv, VirtualClock())
    kv.allocate("a", 16 * 4, [True] * LAYERS)
    kv.transfer.bytes_h2d = kv.transfer.bytes_d2h = kv.transfer.layer_moves = 0
    kv.apply_placement("a", [True, False] * (LAYERS // 2))
    result = execute(ex, [SeqInput("a", [0], 16 * 4)])
    moved = (LAYERS // 2) * 4 * kv.host_pool.bytes_per_block
    assert result.replacement_s == pytest.approx(moved / profile.link_bytes_per_s + (LAYERS // 2) * 0.002)


def test_a_prefill_beside_decodes_adds_the_measured_interference():
    profile = calibrated()
    kv = accounting_kv(profile, device_blocks=10_000)
    ex = SimExecutor(profile, kv, VirtualClock())
    kv.allocate("d", 40, [True] * LAYERS)
    decode = execute(ex, [SeqInput("d", [0], 40)]).step_s
    prefill = profile.prefill_s(32)
    kv.allocate("p", 0, [True] * LAYERS)
    mixed = execute(ex, [SeqInput("d", [0], 41), SeqInput("p", [0] * 32, 0)]).step_s
    assert mixed == pytest.approx(decode + prefill + 0.005, rel=1e-3)


def test_a_prefill_chunk_pays_attention_over_its_cached_prefix():
    """Causal attention's quadratic part: a 32-token chunk after 64 cached tokens scores 32 * 64 + 32 * 33 / 2
    (query, key) pairs, a fresh 32-token prompt only the second term."""
    profile = calibrated()
    kv = accounting_kv(profile, device_blocks=10_000)
    ex = SimExecutor(profile, kv, VirtualClock())
    kv.allocate("fresh", 0, [True] * LAYERS)
    kv.allocate("chunk", 64, [True] * LAYERS)
    fresh = execute(ex, [SeqInput("fresh", [0] * 32, 0)]).step_s
    chunk = execute(ex, [SeqInput("chunk", [0] * 32, 64)]).step_s
    assert fresh == pytest.approx(profile.prefill_s(32))
    assert chunk - fresh == pytest.approx(2e-7 * 32 * 64)


def test_on_the_simulator_the_mismatch_check_never_fires():
    """The controller checks each decode step against the model the simulator charges: with the same profile
    and no noise there is never a mismatch, even at a threshold of 1e-9 (a second model would drift)."""
    from orbitflow.bench.workload import Trace, TraceRequest
    from orbitflow.sim.runner import simulate_trace

    profile = calibrated(device_kv_blocks=60)
    trace = Trace([TraceRequest(f"r{i}", 0.05 * i, 40 + 30 * i, 40) for i in range(4)])
    for policy in ("orbitflow", "deepspeed", "dynamic"):
        config = EngineConfig.build(model="calibrated", device_kv_blocks=60, host_kv_blocks=4000, block_size=16,
                              mismatch_threshold=1e-9, policy=policy, background_planner="off")
        result = simulate_trace(profile, trace, config)
        assert result.metrics.num_finished == 4
        records = result.engine.controller.records
        assert records and not any(r.trigger == "mismatch" for r in records), policy


@pytest.mark.parametrize("cv", [0.05, 0.12])
@pytest.mark.parametrize("on_host", [0, 16, 32])
def test_noise_cv_is_the_cv_of_the_whole_step(cv, on_host):
    """`noise_cv` is calibrated as the real engine's whole-step jitter (`step_noise_cv`), so the simulated step
    must vary with that CV, stalls included: independent per-layer factors would average out to
    cv / sqrt(layers), and noise on the compute alone would be absorbed by the stalls it hides."""
    profile = calibrated(decode_per_request_s=0.0, num_layers=32)
    kv = accounting_kv(profile, device_blocks=10_000)
    ex = SimExecutor(profile, kv, VirtualClock(), noise_cv=cv, seed=3)
    kv.allocate(0, 63, [i >= on_host for i in range(32)])
    steps, stalls = [], []
    for i in range(600):
        result = execute(ex, [SeqInput(0, [0], 63 + i)])
        steps.append(result.step_s)
        stalls.append(result.stall_s)
    assert (sum(stalls) > 0) == (on_host > 0)
    steps = np.asarray(steps)
    trend = np.polyval(np.polyfit(np.arange(len(steps)), steps, 1), np.arange(len(steps)))
    measured = float(np.std(steps / trend))
    assert measured == pytest.approx(cv, rel=0.2)
