"""Paper-scale sweeps (`orbitflow simulate`): policies x SLO scales x arrival-rate scales, every point
a run of its own, each run twice (with and without Token-Deposit), in parallel worker processes."""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from orbitflow.bench.workload import Trace, generate_trace, paper_default_rate_per_s
from orbitflow.sim.profiles import HardwareProfile

RUN_KEYS = ("policy", "slo_scale", "rate_scale", "tbt_attainment", "tpot_attainment", "tbt_attainment_no_deposit",
            "p95_tbt_s", "p99_tbt_s", "p95_tpot_s", "throughput_rpm", "tokens_per_s", "e2e_mean_s",
            "device_mem_util", "solver_calls", "solver_time_s")


@dataclass(frozen=True)
class Point:
    policy: str
    slo_scale: float
    rate_scale: float
    token_deposit: bool


def paper_trace(num_requests: int, rate_scale: float, seed: int, base_rate_per_s: float | None = None) -> Trace:
    """The evaluation workload: Poisson arrivals at the paper's rate times `rate_scale`, lengths from
    the long-context mix, at most 32K tokens per request."""
    rate = base_rate_per_s or paper_default_rate_per_s()
    return generate_trace(num_requests, rate, seed=seed, rate_scale=rate_scale, context_cap=32768)


def _run_point(args) -> tuple[Point, dict]:
    from orbitflow.sim.runner import sim_config, simulate_trace

    profile, point, num_requests, seed, extra = args
    trace = paper_trace(num_requests, point.rate_scale, seed)
    policy, _, victim = point.policy.partition("@")  # "orbitflow@longest": another pause-victim rule
    if victim:
        extra = {**extra, "victim": victim}
    config = sim_config(profile, policy=policy, slo_scale=point.slo_scale,
                        token_deposit=point.token_deposit, seed=seed, **extra)
    result = simulate_trace(profile, trace, config)
    return point, result.metrics.to_dict()


def run_sweep(
    profile: HardwareProfile,
    policies: list[str],
    slo_scales: list[float],
    rate_scales: list[float],
    num_requests: int = 16,
    seed: int = 0,
    workers: int | None = None,
    progress=None,
    **config_overrides,
) -> list[dict]:
    points = [Point(p, s, r, dep) for p in policies for s in slo_scales for r in rate_scales for dep in (True, False)]
    jobs = [(profile, pt, num_requests, seed, config_overrides) for pt in points]
    results: dict[Point, dict] = {}
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            point, metrics = _run_point(job)
            results[point] = metrics
            if progress:
                progress(point)
    else:
        with ProcessPoolExecutor(workers) as pool:
            for point, metrics in pool.map(_run_point, jobs):
                results[point] = metrics
                if progress:
                    progress(point)
    runs = []
    for p in policies:
        for s in slo_scales:
            for r in rate_scales:
                on, off = results[Point(p, s, r, True)], results[Point(p, s, r, False)]
                row = {"policy": p, "slo_scale": s, "rate_scale": r, **on,
                       "tbt_attainment_no_deposit": off["tbt_attainment"],
                       "tpot_attainment_no_deposit": off["tpot_attainment"],
                       "p95_tbt_s_no_deposit": off["p95_tbt_s"]}
                runs.append(row)
    return runs


def summary_rows(runs: list[dict]) -> list[dict]:
    """The columns of the printed tables, one row per run."""
    return [{k: r.get(k) for k in RUN_KEYS} | {"pauses": r.get("num_pauses")} for r in runs]
