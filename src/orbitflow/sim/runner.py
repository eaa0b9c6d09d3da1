"""Replay a trace through the real engine loop on the simulated executor and a virtual clock.

Everything above the executor is the code that serves real requests: scheduler, controller, policy,
planner, Token-Deposit, Pause-Resume and metrics. Only the step latencies come from the profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orbitflow.bench.metrics import RequestRecord, RunMetrics, compute_metrics
from orbitflow.bench.workload import Trace
from orbitflow.config import EngineConfig
from orbitflow.plan import PlanRequest
from orbitflow.plan.hardware import HardwareProfile
from orbitflow.policies import make_policy
from orbitflow.policies.base import PlanContext, default_slo_s, prefetch_slots_for
from orbitflow.runtime.clock import VirtualClock
from orbitflow.runtime.engine import Engine, RequestRejected
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.runtime.sim_executor import SimExecutor, accounting_kv
from orbitflow.sim.sweep import solver_time_model


def sim_config(profile: HardwareProfile, **overrides) -> EngineConfig:
    values = dict(model=profile.name, block_size=profile.block_size, device_kv_blocks=profile.device_kv_blocks,
                  host_kv_blocks=profile.host_kv_blocks, background_planner="off")
    values.update(overrides)
    return EngineConfig.build(**values)


@dataclass
class SimResult:
    policy: str
    metrics: RunMetrics
    records: list[RequestRecord]
    engine: Engine


def build_sim_engine(profile: HardwareProfile, config: EngineConfig, noise: float = 0.0,
                     contention: list[tuple[float, float, float]] | None = None, noise_cv: float = 0.0,
                     solver_time: str = "off") -> Engine:
    """The real engine on the simulated executor and a virtual clock of its own (``engine.clock``)."""
    clock = VirtualClock()
    charge = solver_time_model(solver_time)
    kv = accounting_kv(profile, config.cache.device_kv_blocks, config.cache.host_kv_blocks)
    policy = make_policy(config.planner.policy)
    executor = SimExecutor(profile, kv, clock, noise=noise, contention=contention, seed=config.model.seed,
                           noise_cv=noise_cv, prefetch_slots=prefetch_slots_for(config, policy),
                           link=config.cache.kv_link)
    ctx = PlanContext.from_profile(config, profile, policy)
    if solver_time == "measured":
        warm_up(config.planner.policy, ctx)
    engine = Engine(config, executor, policy, ctx, clock, default_slo_s(config, profile))
    # Expiries are solved ahead as the engine solves them (its planner process or thread; the config's "off" only
    # keeps the engine from starting one), on the virtual clock: --solver-time off charges nothing there.
    engine.controller.charge_solve_time(clock, charge or _free_solve)
    return engine


def warm_up(policy_name: str, ctx: PlanContext) -> None:
    """One solve, thrown away, by a fresh policy of this name on a full batch that must offload, before the clock
    starts: with the solve time measured, whatever a policy's first solve in a process costs beyond its later ones
    would be charged to the first run only (the compiled kernels are `orbitflow.plan.warm_up`'s, which the controller
    calls; this takes the rest, a few ms of first calls). A fresh policy keeps the run's own state untouched."""
    n = max(1, ctx.max_num_seqs)
    per_layer = max(1, math.ceil(1.5 * ctx.capacity_blocks / ctx.num_layers / n))
    batch = [PlanRequest(f"warm-up-{i}", per_layer, per_layer * ctx.block_size, 8) for i in range(n)]
    make_policy(policy_name).plan(batch, ctx)


def _free_solve(wall_s: float) -> float:
    """``--solver-time off``: a solve costs no virtual time."""
    return 0.0


def request_records(engine: Engine) -> list[RequestRecord]:
    """The finished requests of a simulated engine, as the metrics take them. An aborted or failed request did not
    finish (``finished_s`` None): it does not count as served in ``num_finished`` or the throughput."""
    return [
        RequestRecord(
            request_id=r.request_id, arrival_s=r.arrival_s, input_tokens=r.num_prompt,
            output_tokens=len(r.output_ids), generated_s=r.generated_s, delivered_s=r.delivered_s,
            finished_s=r.finished_s if r.finish_reason in ("stop", "length") else None, slo_s=r.slo_s,
            num_pauses=r.num_pauses,
        )
        for r in engine.finished
    ]


def simulate_trace(
    profile: HardwareProfile,
    trace: Trace,
    config: EngineConfig,
    noise: float = 0.0,
    contention: list[tuple[float, float, float]] | None = None,
    max_steps: int = 2_000_000,
    noise_cv: float = 0.0,
    solver_time: str = "off",
) -> SimResult:
    """Replay ``trace``. ``noise_cv``: seeded (``config.model.seed``) lognormal noise, one factor per step on its
    compute and transfers, that the planner does not see; ``solver_time``: see :func:`solver_time_model`. The
    prefetch depth is the config's, or the policy's own."""
    engine = build_sim_engine(profile, config, noise=noise, contention=contention, noise_cv=noise_cv,
                              solver_time=solver_time)
    rejected = replay(engine, engine.clock, trace, max_steps)
    records = request_records(engine)
    c = engine.controller
    metrics = compute_metrics(
        records, engine.default_slo_s, device_mem_util=engine.stats.device_mem_util,
        solver_calls=c.solver_calls, solver_time_s=c.solver_time_s, rejected=len(rejected),
        pauses=engine.stats.pauses, prefetch_slots=c.ctx.cost_model.prefetch_slots,
        solver_charged_s=c.solver_charged_s, plans_adopted_late=c.adopted_late,
    )
    engine.close()
    return SimResult(engine.policy.name, metrics, records, engine)


def replay(engine: Engine, clock: VirtualClock, trace: Trace, max_steps: int) -> list[str]:
    """Feed the trace's requests to the engine at their arrival times and step it until all are done;
    returns the ids of the requests it rejected."""
    pending = sorted(trace.requests, key=lambda r: r.arrival_s)
    rejected: list[str] = []
    i = 0
    for _ in range(max_steps):
        while i < len(pending) and pending[i].arrival_s <= clock.now():
            r = pending[i]
            i += 1
            try:
                engine.add_request(r.request_id, [0] * r.input_tokens, SamplingParams(max_tokens=r.output_tokens),
                                   slo_s=r.slo_s, arrival_s=r.arrival_s, target_output_tokens=r.output_tokens)
            except RequestRejected:
                rejected.append(r.request_id)
        if not engine.has_work():
            if i == len(pending):
                break
            clock.sleep_until(pending[i].arrival_s)
            continue
        if engine.step() is None and i < len(pending) and not engine.running:
            clock.sleep_until(pending[i].arrival_s)  # blocked until something arrives
    else:
        raise RuntimeError(f"simulation did not finish within {max_steps} steps")
    return rejected
