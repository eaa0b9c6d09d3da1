"""Paper-scale sweeps (`orbitflow simulate`): every point a run of its own, repeated over seeds, in parallel
worker processes, summarised as mean and 95% confidence interval per metric.

A point fixes the policy, the SLO scale, the arrival-rate scale, Token-Deposit on/off, the device KV
budget (a fraction of the largest batch's KV), the link rate and the prefetch depth; each seed draws its
own trace (arrivals and lengths) and its own noise. The defaults are the paper's setup
(:data:`PAPER_SETUP`): 0.5 of the largest batch's KV on the device (the paper's footnote: about 16K of
32K tokens), lognormal noise the planner does not see, the planner's solve time charged on the virtual
clock, 5 seeds of 64 requests.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

from orbitflow.bench.metrics import mean_ci95
from orbitflow.bench.workload import Trace, generate_trace, paper_default_rate_per_s
from orbitflow.plan.hardware import HardwareProfile

# Lognormal CV of the simulator's per-step noise (one factor per step on its compute and transfers): the real
# engine's decode-step jitter around its trend at a fixed batch, measured by `python benchmarks/step_jitter.py` on a
# quiet 2-core machine (SmolLM2-135M, batch 4, 200 steps, 3 repeats: CV 0.071 / 0.065 / 0.069, median 0.069;
# 2026-11-23). `--noise-cv` sets it; a measured profile's own `step_noise_cv` replaces it in `orbitflow simulate`.
DEFAULT_NOISE_CV = 0.07
DEFAULT_SEEDS = 5
DEFAULT_NUM_REQUESTS = 64
DEFAULT_DEVICE_KV_FRACTION = 0.5
MAX_DEVICE_KV_FRACTION = 10  # of the largest batch's KV: past it the budget holds every batch many times over

RUN_KEYS = ("policy", "slo_scale", "rate_scale", "tbt_attainment", "tpot_attainment", "tbt_attainment_no_deposit",
            "p95_tbt_s", "p99_tbt_s", "p95_tpot_s", "throughput_rpm", "tokens_per_s", "e2e_mean_s",
            "device_mem_util", "solver_calls", "solver_time_s")

# Metrics summarised per point (mean and 95% CI over seeds): the paper's figures' metrics.
SUMMARY_METRICS = ("tbt_attainment", "tpot_attainment", "p95_tbt_s", "p99_tbt_s", "p95_tpot_s", "p99_tpot_s",
                   "ttft_mean_s", "p95_ttft_s", "e2e_mean_s", "p95_e2e_s", "throughput_rpm", "tokens_per_s",
                   "device_mem_util", "num_pauses", "solver_calls", "solver_time_s", "solver_charged_s",
                   "num_finished", "rejected")
HIGHER_IS_BETTER = {"tbt_attainment": True, "tpot_attainment": True, "throughput_rpm": True, "tokens_per_s": True,
                    "p95_tbt_s": False, "p99_tbt_s": False, "p95_tpot_s": False, "p99_tpot_s": False,
                    "ttft_mean_s": False, "e2e_mean_s": False, "p95_e2e_s": False, "p95_ttft_s": False}


def _check_device_fraction(fraction: float, name: str) -> None:
    """A device budget as a fraction of the largest batch's KV: in (0, MAX_DEVICE_KV_FRACTION] (NaN fails too)."""
    if not 0 < fraction <= MAX_DEVICE_KV_FRACTION:
        raise ValueError(f"{name} must be in (0, {MAX_DEVICE_KV_FRACTION:g}], got {fraction}")


@dataclass(frozen=True)
class SimSetup:
    """The simulator-side knobs of a sweep (`orbitflow simulate` flags), everything but the policy grid."""

    device_kv_fraction: float = DEFAULT_DEVICE_KV_FRACTION
    device_kv_blocks: int | None = None  # overrides the fraction
    link_gbps: float | None = None  # None: the profile's link rate
    noise_cv: float = DEFAULT_NOISE_CV
    solver_time: str = "measured"
    seeds: int = DEFAULT_SEEDS
    first_seed: int = 0
    num_requests: int = DEFAULT_NUM_REQUESTS
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 32768
    trace_path: str | None = None  # replay this file instead of generating (then seeds only vary the noise)
    step_s: float | None = None  # seconds per scheduler step of an artifact-format trace
    engine: dict = field(default_factory=dict)  # further EngineConfig overrides (alpha, victim, ...)

    def __post_init__(self) -> None:
        _check_device_fraction(self.device_kv_fraction, "--device-kv-fraction")
        if self.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {self.seeds}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.noise_cv < 0 or not math.isfinite(self.noise_cv):
            raise ValueError(f"--noise-cv must be a finite number >= 0, got {self.noise_cv}")
        if self.link_gbps is not None and not self.link_gbps > 0:
            raise ValueError(f"--link-gbps must be > 0, got {self.link_gbps}")
        if self.first_seed < 0:  # numpy's generators take no negative seed
            raise ValueError(f"--seed must be >= 0, got {self.first_seed}")
        solver_time_model(self.solver_time)  # validates

    def check(self, profile: HardwareProfile) -> None:
        """What the flags must satisfy on ``profile``: the batch token cap holds a block (it sizes the device budget
        as a fraction of the largest batch)."""
        if self.max_num_batched_tokens < profile.block_size:
            raise ValueError(f"--max-num-batched-tokens must be at least the profile's block size "
                             f"({profile.block_size} tokens), got {self.max_num_batched_tokens}")


SOLVER_TIME_HELP = ("planner solve time on the virtual clock: 'measured' (each solve's wall time), 'off', or a "
                    "fixed cost per call in ms, e.g. '5ms'. Charged as the engine runs the solves: an expiry is "
                    "solved ahead while the steps before it run; every other solve holds its step")


def noise_cv_for(flag: float | None, profile: HardwareProfile) -> float:
    """The noise CV to simulate with: ``flag`` as given, else the profile's measured step jitter
    (`step_noise_cv`), else the default."""
    if flag is not None:
        return flag
    return profile.step_noise_cv if profile.step_noise_cv is not None else DEFAULT_NOISE_CV


def solver_time_model(spec: str) -> Callable[[float], float] | None:
    """Parse ``--solver-time``: 'measured' charges each solve's measured wall time, 'off' nothing (None),
    'Xms' a fixed X milliseconds per call."""
    text = str(spec).strip().lower()
    if text == "off":
        return None
    if text == "measured":
        return lambda wall_s: wall_s
    if text.endswith("ms"):
        try:
            fixed = float(text[:-2]) / 1000.0
        except ValueError:
            fixed = -1.0
        if 0 <= fixed < math.inf:
            return lambda wall_s: fixed
    raise ValueError(f"--solver-time must be 'measured', 'off' or a fixed cost like '5ms', got {spec!r}")



PAPER_SETUP = SimSetup()


def largest_batch_blocks(profile: HardwareProfile, max_num_batched_tokens: int) -> int:
    """Layer-blocks of the largest batch the scheduler admits (its token cap, every layer)."""
    return max_num_batched_tokens // profile.block_size * profile.num_layers


@dataclass(frozen=True)
class Point:
    policy: str
    slo_scale: float
    rate_scale: float
    token_deposit: bool = True
    device_kv_fraction: float | None = None  # None: the setup's
    link_gbps: float | None = None  # None: the setup's (or the profile's)
    prefetch_slots: int | None = None  # None: the policy's own
    kv_link: str = "edf"  # the link order the engine runs and the planner plans for (--kv-link)

    def __post_init__(self) -> None:
        if self.device_kv_fraction is not None:  # None: the setup's
            _check_device_fraction(self.device_kv_fraction, "device_kv_fraction")

    def label(self) -> str:
        return (self.policy + ("" if self.prefetch_slots is None else f" (depth {self.prefetch_slots})")
                + ("" if self.kv_link == "edf" else f" ({self.kv_link} link)"))


def paper_trace(num_requests: int, rate_scale: float, seed: int, base_rate_per_s: float | None = None) -> Trace:
    """The evaluation workload: Poisson arrivals at the paper's rate times `rate_scale`, lengths from
    the long-context mix, at most 32K tokens per request."""
    rate = base_rate_per_s or paper_default_rate_per_s()
    return generate_trace(num_requests, rate, seed=seed, rate_scale=rate_scale, context_cap=32768)


def point_profile(profile: HardwareProfile, setup: SimSetup, point: Point) -> HardwareProfile:
    link = point.link_gbps if point.link_gbps is not None else setup.link_gbps
    return profile if link is None else profile.with_overrides(link_bytes_per_s=link * 1e9)


def point_device_blocks(profile: HardwareProfile, setup: SimSetup, point: Point) -> int:
    if point.device_kv_fraction is None and setup.device_kv_blocks is not None:
        return setup.device_kv_blocks
    frac = point.device_kv_fraction if point.device_kv_fraction is not None else setup.device_kv_fraction
    return max(1, round(frac * largest_batch_blocks(profile, setup.max_num_batched_tokens)))


def load_point_trace(profile: HardwareProfile, setup: SimSetup, point: Point, seed: int) -> tuple[Trace, int | None]:
    """The trace of one run and the device budget the file asks for (None: none given)."""
    if setup.trace_path is not None:
        from orbitflow.bench.workload import load_trace_file, scale_arrivals

        loaded = load_trace_file(setup.trace_path, step_s=setup.step_s)
        trace = loaded.trace if point.rate_scale == 1 else scale_arrivals(loaded.trace, point.rate_scale)
        return trace, loaded.device_kv_blocks(profile.block_size, profile.num_layers)
    return paper_trace(setup.num_requests, point.rate_scale, seed), None


def run_one(profile: HardwareProfile, setup: SimSetup, point: Point, seed: int) -> dict:
    """One run: the point's metrics (a flat dict) under ``seed``."""
    from orbitflow.sim.runner import sim_config, simulate_trace

    prof = point_profile(profile, setup, point)
    trace, file_blocks = load_point_trace(profile, setup, point, seed)
    blocks = point_device_blocks(profile, setup, point)
    if file_blocks is not None and point.device_kv_fraction is None and setup.device_kv_blocks is None:
        blocks = file_blocks  # the trace file's own GPU block budget
    extra = dict(setup.engine)
    policy, _, victim = point.policy.partition("@")  # "orbitflow@longest": another pause-victim rule
    if victim:
        extra["victim"] = victim
    config = sim_config(prof, policy=policy, slo_scale=point.slo_scale, token_deposit=point.token_deposit, seed=seed,
                        device_kv_blocks=blocks, max_num_seqs=setup.max_num_seqs,
                        max_num_batched_tokens=setup.max_num_batched_tokens, prefetch_slots=point.prefetch_slots,
                        kv_link=point.kv_link, **extra)
    start = time.perf_counter()
    result = simulate_trace(prof, trace, config, noise_cv=setup.noise_cv, solver_time=setup.solver_time)
    metrics = result.metrics.to_dict()
    metrics["wall_s"] = time.perf_counter() - start  # the run's own wall time (for timing the sweep)
    metrics.update(policy=point.policy, slo_scale=point.slo_scale, rate_scale=point.rate_scale,
                   token_deposit=point.token_deposit, seed=seed, device_kv_blocks=blocks,
                   link_gbps=prof.link_bytes_per_s / 1e9, kv_link=point.kv_link, label=point.label(),
                   device_kv_fraction=blocks / largest_batch_blocks(profile, setup.max_num_batched_tokens))
    return metrics


def _run_job(args) -> tuple[Point, int, dict]:
    profile, setup, point, seed = args
    return point, seed, run_one(profile, setup, point, seed)


def run_points(
    profile: HardwareProfile,
    setup: SimSetup,
    points: Sequence[Point],
    workers: int | None = None,
    progress: Callable[[Point, int], None] | None = None,
    done: dict | None = None,
    on_result: Callable[[Point, int, dict], None] | None = None,
    first: Sequence[Point] = (),
) -> list[dict]:
    """Every point under every seed of ``setup``; one flat dict per run, in point then seed order.

    ``done``: results already known, keyed by (point, seed) (they are not re-run); ``on_result`` sees each new
    one as it lands (for a cache). The runs of ``first`` are started before the others (so an interrupted sweep
    has them); within each group slow points (OrbitFlow, Dynamic) are started first so the pool drains evenly.
    One pool runs them all, its workers forked once the simulator's modules are loaded here: a sweep whose source
    is edited while it runs keeps the modules loaded by then (a pool started later imported the edits; a module
    first imported later still comes from disk).
    """
    from orbitflow.sim import runner  # noqa: F401  (loaded before the workers fork: see above)

    seeds = range(setup.first_seed, setup.first_seed + setup.seeds)
    results: dict[tuple[Point, int], dict] = dict(done or {})
    jobs = [(profile, setup, pt, s) for pt in points for s in seeds if (pt, s) not in results]
    early = set(first)
    slow = {"orbitflow": 0, "dynamic": 1, "slo-aware": 2}
    jobs.sort(key=lambda j: (j[2] not in early, slow.get(j[2].policy.partition("@")[0], 3)))
    workers = workers or min(len(jobs), os.cpu_count() or 1) or 1

    def land(point: Point, seed: int, metrics: dict) -> None:
        results[(point, seed)] = metrics
        if on_result:
            on_result(point, seed, metrics)
        if progress:
            progress(point, seed)

    if workers <= 1:
        for job in jobs:
            land(*_run_job(job))
    else:
        with ProcessPoolExecutor(workers) as pool:
            for out in pool.map(_run_job, jobs, chunksize=1):
                land(*out)
    return [results[(pt, s)] for pt in points for s in seeds]


# ----------------------------------------------------------------------------- statistics
GROUP_KEYS = ("label", "policy", "slo_scale", "rate_scale", "token_deposit", "device_kv_blocks", "device_kv_fraction",
              "link_gbps", "prefetch_slots", "kv_link")


def summarize(runs: Sequence[dict], metrics: Sequence[str] = SUMMARY_METRICS) -> list[dict]:
    """One row per point (runs grouped over seeds): the point's keys, ``seeds`` and for each metric
    ``{"mean", "ci95", "n", "missing"}``: ``missing`` seeds had no value (nothing to measure, e.g. no request
    served), and the mean is over the others, so :func:`better` claims nothing from such a cell."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(tuple(r.get(k) for k in GROUP_KEYS), []).append(r)
    rows = []
    for key, members in groups.items():
        row = dict(zip(GROUP_KEYS, key))
        row["seeds"] = sorted(m.get("seed") for m in members)
        for m in metrics:
            cell = row[m] = mean_ci95(x.get(m) for x in members)
            cell["missing"] = len(members) - cell["n"]
        rows.append(row)
    return rows


def better(a: dict, b: dict, metric: str) -> bool:
    """Whether summary cell ``a`` beats ``b`` on ``metric`` with non-overlapping 95% intervals. A cell of fewer than two
    values has no interval (its half-width reads 0), and one whose mean leaves out seeds without a value (a seed that
    served nothing) is not the point's: no win is claimed from or against either."""
    if a.get("mean") is None or b.get("mean") is None or min(a.get("n", 0), b.get("n", 0)) < 2:
        return False
    if a.get("missing") or b.get("missing"):
        return False
    hi = HIGHER_IS_BETTER.get(metric, True)
    lo_a, hi_a = a["mean"] - a["ci95"], a["mean"] + a["ci95"]
    lo_b, hi_b = b["mean"] - b["ci95"], b["mean"] + b["ci95"]
    return lo_a > hi_b if hi else hi_a < lo_b


def config_record(profile: HardwareProfile, setup: SimSetup, points: Sequence[Point]) -> dict:
    """The `config` object of `orbitflow simulate --json`."""
    blocks = sorted({point_device_blocks(profile, setup, p) for p in points})
    links = sorted({point_profile(profile, setup, p).link_bytes_per_s / 1e9 for p in points})
    slots = sorted({p.prefetch_slots for p in points}, key=lambda s: (s is not None, s or 0))
    d = asdict(setup)
    d.pop("engine")
    return {
        "preset": profile.name,
        "device_kv_blocks": blocks[0] if len(blocks) == 1 else blocks,
        "largest_batch_blocks": largest_batch_blocks(profile, setup.max_num_batched_tokens),
        "device_kv_fraction": setup.device_kv_fraction,
        "link_gbps": links[0] if len(links) == 1 else links,
        "prefetch_slots": [("policy default" if s is None else s) for s in slots],
        "kv_link": sorted({p.kv_link for p in points}),
        "noise_cv": setup.noise_cv,
        "solver_time": setup.solver_time,
        "seeds": list(range(setup.first_seed, setup.first_seed + setup.seeds)),
        "num_requests": setup.num_requests,
        "max_num_seqs": setup.max_num_seqs,
        "max_num_batched_tokens": setup.max_num_batched_tokens,
        "trace": setup.trace_path,
        "step_s": setup.step_s,
        "engine_overrides": dict(setup.engine),
        "policies": sorted({p.policy for p in points}),
        "slo_scales": sorted({p.slo_scale for p in points}),
        "rate_scales": sorted({p.rate_scale for p in points}),
        "setup": d,
    }


def grid(policies: Sequence[str], slo_scales: Sequence[float], rate_scales: Sequence[float],
         token_deposit: Sequence[bool] = (True,), **common) -> list[Point]:
    return [Point(p, s, r, dep, **common) for p in policies for s in slo_scales for r in rate_scales
            for dep in token_deposit]


def with_no_deposit(runs: Sequence[dict]) -> list[dict]:
    """Per-seed runs with the matching no-deposit run's attainment attached (keys ``*_no_deposit``), for
    the plots of Fig. 13b; runs without Token-Deposit are dropped."""
    key = ("label", "slo_scale", "rate_scale", "seed", "device_kv_blocks", "link_gbps")
    off = {tuple(r.get(k) for k in key): r for r in runs if not r.get("token_deposit", True)}
    out = []
    for r in runs:
        if not r.get("token_deposit", True):
            continue
        o = off.get(tuple(r.get(k) for k in key))
        if o is not None:
            r = {**r, "tbt_attainment_no_deposit": o["tbt_attainment"],
                 "tpot_attainment_no_deposit": o["tpot_attainment"], "p95_tbt_s_no_deposit": o["p95_tbt_s"]}
        out.append(r)
    return out


def run_sweep(
    profile: HardwareProfile,
    policies: list[str],
    slo_scales: list[float],
    rate_scales: list[float],
    num_requests: int = 16,
    seed: int = 0,
    workers: int | None = None,
    progress=None,
    seeds: int = 1,
    noise_cv: float = 0.0,
    solver_time: str = "off",
    no_deposit: bool = True,
    **config_overrides,
) -> list[dict]:
    """The former one-seed sweep interface (tests, quick looks): every point with and without
    Token-Deposit, per-seed rows with the no-deposit attainment attached."""
    engine = dict(config_overrides)
    setup_kwargs = {k: engine.pop(k) for k in ("device_kv_blocks", "max_num_seqs", "max_num_batched_tokens")
                    if k in engine}
    setup = SimSetup(num_requests=num_requests, first_seed=seed, seeds=seeds, noise_cv=noise_cv,
                     solver_time=solver_time, engine=engine, **setup_kwargs)
    points = grid(policies, slo_scales, rate_scales, (True, False) if no_deposit else (True,))
    tick = (lambda p, s: progress(p)) if progress else None
    runs = run_points(profile, setup, points, workers=workers, progress=tick)
    return with_no_deposit(runs)


def summary_rows(runs: list[dict]) -> list[dict]:
    """The columns of the printed per-run tables."""
    return [{k: r.get(k) for k in RUN_KEYS} | {"pauses": r.get("num_pauses")} for r in runs]


__all__ = ["DEFAULT_NOISE_CV", "PAPER_SETUP", "Point", "SimSetup", "better", "config_record", "grid", "mean_ci95",
           "noise_cv_for", "run_points", "run_sweep", "summarize"]
