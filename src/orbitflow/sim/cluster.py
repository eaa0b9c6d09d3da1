"""Cluster simulation: N replicas of the simulated engine behind one router, on one trace.

Each replica is the engine `orbitflow simulate` runs (`build_sim_engine`: the real scheduler, controller,
planner, Token-Deposit and Pause-Resume over the SimExecutor) on a virtual clock of its own. Arrivals are
replayed in time order: before a request is routed every replica is stepped up to its arrival time, so the
router sees each replica as it is then; the router (`orbitflow.runtime.routing.Router`, the very rule the
Ray Serve deployment uses) picks a replica, asking the replicas' own planners `what_if` when it is SLO-aware.
The replicas then run on to the end of the trace. Metrics are computed over every request of every replica
(attainment, throughput over the cluster's makespan).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from orbitflow.bench.metrics import RunMetrics, compute_metrics
from orbitflow.bench.workload import Trace
from orbitflow.config import EngineConfig
from orbitflow.plan.hardware import HardwareProfile
from orbitflow.runtime.engine import Engine, RequestRejected
from orbitflow.runtime.replica_state import replica_state, what_if
from orbitflow.runtime.routing import Router
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.sim.runner import build_sim_engine, request_records

_MAX_IDLE_STEPS = 1000  # steps in a row that advance nothing before a replica is left to wait


@dataclass
class ClusterResult:
    router: str
    num_replicas: int
    metrics: RunMetrics
    per_replica_requests: list[int]  # requests routed to each replica
    fallbacks: int  # slo-aware decisions where no sampled replica had a feasible plan
    rejected: int
    wall_s: float
    blocks_in_use: int = 0  # device + host KV blocks still held once every replica ran dry (0: no leak)


def _advance(engine: Engine, until_s: float) -> None:
    """Step `engine` until its clock reaches `until_s` or it runs out of work; an idle replica waits."""
    clock = engine.clock
    stuck = 0
    while engine.has_work() and clock.now() < until_s and stuck < _MAX_IDLE_STEPS:
        before = clock.now()
        engine.step()
        stuck = stuck + 1 if clock.now() == before else 0
    if clock.now() < until_s != float("inf"):
        clock.sleep_until(until_s)


def simulate_cluster(
    profile: HardwareProfile,
    trace: Trace,
    config: EngineConfig,
    num_replicas: int,
    router: str,
    noise_cv: float = 0.0,
    solver_time: str = "off",
    seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> ClusterResult:
    """Replay ``trace`` over ``num_replicas`` simulated engines routed by ``router`` (seeded by ``seed``;
    replica ``i`` draws its noise from seed ``config.model.seed * 1000 + i``)."""
    if num_replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
    start = time.perf_counter()
    engines = [build_sim_engine(profile, config.replace(seed=config.model.seed * 1000 + i), noise_cv=noise_cv,
                                solver_time=solver_time) for i in range(num_replicas)]
    rule = Router(router, seed=seed)
    routed = [0] * num_replicas
    rejected = 0
    for r in sorted(trace.requests, key=lambda r: r.arrival_s):
        for engine in engines:
            _advance(engine, r.arrival_s)
        states = [(i, replica_state(e)) for i, e in enumerate(engines)]
        i = rule.choose(states, lambda i, r=r: what_if(engines[i], r.input_tokens, r.output_tokens, r.slo_s))
        try:
            engines[i].add_request(r.request_id, [0] * r.input_tokens, SamplingParams(max_tokens=r.output_tokens),
                                   slo_s=r.slo_s, arrival_s=r.arrival_s, target_output_tokens=r.output_tokens)
            routed[i] += 1
        except RequestRejected:
            rejected += 1
        if progress is not None:
            progress()
    for engine in engines:
        _advance(engine, float("inf"))
        if engine.has_work():
            raise RuntimeError("a simulated replica stopped advancing with work pending")
    records = [rec for e in engines for rec in request_records(e)]
    slo = engines[0].default_slo_s
    metrics = compute_metrics(
        records, slo, device_mem_util=sum(e.stats.device_mem_util for e in engines) / num_replicas,
        solver_calls=sum(e.controller.solver_calls for e in engines),
        solver_time_s=sum(e.controller.solver_time_s for e in engines), rejected=rejected,
        pauses=sum(e.stats.pauses for e in engines), prefetch_slots=engines[0].controller.ctx.cost_model.prefetch_slots,
    )
    blocks_in_use = sum(sum(e.kv.usage()) for e in engines)
    for engine in engines:
        engine.close()
    return ClusterResult(router, num_replicas, metrics, routed, rule.fallbacks, rejected,
                         time.perf_counter() - start, blocks_in_use)
