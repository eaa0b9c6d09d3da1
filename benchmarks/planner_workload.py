"""The planner on the engine's own batches: the plan() calls of a simulated paper-scale run, re-solved.

Run: ``python benchmarks/planner_workload.py [--md docs/results/planner_workload.md]`` (from the repo root; about
13 minutes on 2 cores, 11 of them the 70B run's simulation).

``benchmarks/planner.py``'s speed table draws random batches (``random_instance``). This script takes instead the
batches the engine's own planner is handed: it runs ``orbitflow simulate``'s engine (the real scheduler, controller,
Pause-Resume and Token-Deposit on the simulated executor) on the paper's workload for each ``--runs`` entry, records
every call of the OrbitFlow policy (its requests and its planning context, warm-up solves left out), and re-solves an
evenly spaced sample of the largest batches twice, back to back, alternating which goes first:

* as the engine solves them: the policy on the run's own context (``--plan-node-limit``'s default budget, the plan in
  place as the hint), the expiry checks included;
* exactly: the same call with ``node_limit=None, check_better=False`` (what the speed table's 'exact' is), stopped at
  ``--exact-cap-s``.

It reports what the issue's exact goal asks on these batches (exact p50 / p99, how many proved an optimum, how many
proved that no plan fits and how many were cut at the cap), what the engine pays per call against the step it plans
(the plan's predicted step: a solve hidden behind the steps before its expiry must take less), and how far the
engine's plan can be from the optimum: its excess over the best plan the exact search found (a lower bound on its
distance from the optimum where that search was cut) and the gap ``g`` the engine's own search certified (which
bounds that distance by ``g / (1 - g)``).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from planner import _machine, pct, require_positive, write_fragment  # noqa: E402

from orbitflow.plan import Plan, PlanRequest, warm_up  # noqa: E402
from orbitflow.plan.hardware import load_preset  # noqa: E402
from orbitflow.policies import POLICIES, OrbitFlowPolicy, PlanContext  # noqa: E402
from orbitflow.sim.sweep import Point, SimSetup, run_one  # noqa: E402

RECORDING = "orbitflow-recorded"  # the policy name a recorded run is configured with (registered only meanwhile)
DEFAULT_RUNS = "a5000-llama3-8b:4:32768,a6000-llama3-70b-tp4:16:131072"


@dataclass
class Call:
    """One plan() call of the engine's policy: what it was handed."""

    requests: list[PlanRequest]
    ctx: PlanContext
    plan: Plan | None = None  # what the run's solve returned


class RecordingPolicy(OrbitFlowPolicy):
    """OrbitFlow, recording every call into ``sink`` (the engine's calls and the controller's solves ahead alike)."""

    def __init__(self, sink: list[Call]):
        super().__init__()
        self.sink = sink

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        call = Call(list(requests), ctx)
        self.sink.append(call)
        call.plan = super().plan(requests, ctx)
        return call.plan


@contextmanager
def recording(sink: list[Call]):
    """Register :class:`RecordingPolicy` as ``RECORDING`` while the block runs."""
    POLICIES[RECORDING] = lambda: RecordingPolicy(sink)
    try:
        yield RECORDING
    finally:
        del POLICIES[RECORDING]


@dataclass(frozen=True)
class Run:
    preset: str
    max_num_seqs: int
    max_num_batched_tokens: int

    @classmethod
    def parse(cls, spec: str) -> Run:
        """``preset:max_num_seqs:max_num_batched_tokens``."""
        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(f"--runs: each entry is preset:max-num-seqs:max-num-batched-tokens, got {spec!r}")
        try:
            seqs, tokens = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"--runs: max-num-seqs and max-num-batched-tokens are integers, got {spec!r}") from None
        if seqs < 1 or tokens < 1:
            raise ValueError(f"--runs: max-num-seqs and max-num-batched-tokens must be >= 1, got {spec!r}")
        load_preset(parts[0])  # names the preset in its error when it is unknown
        return cls(parts[0], seqs, tokens)


def record_run(run: Run, num_requests: int, rate_scale: float, slo_scale: float, seed: int) -> tuple[list[Call], dict]:
    """The engine's planner calls over one simulated run of the paper's workload, and the run's metrics."""
    sink: list[Call] = []
    setup = SimSetup(num_requests=num_requests, max_num_seqs=run.max_num_seqs,
                     max_num_batched_tokens=run.max_num_batched_tokens, seeds=1, first_seed=seed)
    with recording(sink) as name:
        metrics = run_one(load_preset(run.preset), setup, Point(policy=name, slo_scale=slo_scale,
                                                                 rate_scale=rate_scale), seed)
    calls = [c for c in sink if not any(str(q.request_id).startswith("warm-up-") for q in c.requests)]
    return calls, metrics


def sample(calls: list[Call], n: int) -> list[Call]:
    """Up to ``n`` calls of the largest batches, in the run's order: every call of the largest batch size, then of
    the next, until ``n`` are taken; the last size taken, where it has more calls than are left to take, evenly
    spaced over the run."""
    keep: set[int] = set()
    for size in sorted({len(c.requests) for c in calls}, reverse=True):
        room = n - len(keep)
        if room <= 0:
            break
        group = [c for c in calls if len(c.requests) == size]
        if len(group) > room:
            group = [group[i] for i in np.linspace(0, len(group) - 1, room).round().astype(int)]
        keep.update(id(c) for c in group)
    return [c for c in calls if id(c) in keep]


def exact_ctx(ctx: PlanContext, cap_s: float) -> PlanContext:
    return replace(ctx, node_limit=None, time_limit_s=cap_s, gap=0.0)


def resolve(call: Call, cap_s: float, engine_first: bool) -> dict:
    """One call solved as the engine solves it and exactly (capped), in the order given."""
    out: dict = {"size": len(call.requests)}

    def engine() -> None:
        t = time.perf_counter()
        out["engine"] = OrbitFlowPolicy().plan(call.requests, call.ctx)
        out["engine_s"] = time.perf_counter() - t

    def exact() -> None:
        # the exact search proves the optimum of the step it searches; the expiry checks are extra searches
        planner = exact_ctx(call.ctx, cap_s).planner()
        planner.check_better = False
        t = time.perf_counter()
        out["exact"] = planner.plan(call.requests, hint=call.ctx.previous)
        out["exact_s"] = time.perf_counter() - t

    for solve in ((engine, exact) if engine_first else (exact, engine)):
        solve()
    return out


def _ms(xs: list[float], q: float) -> float:
    """The ``q``-th percentile in ms, a data value (``inf`` stands for a solve cut at its cap: it is longer)."""
    return 1e3 * float(np.percentile(np.asarray(xs), q, method="higher")) if xs else math.nan


def summarize(run: Run, calls: list[Call], rows: list[dict], cap_s: float) -> dict:
    """One table row: the run's calls and what their re-solves took. A proof is of the optimum (the plan is feasible)
    or that no plan fits (it is not); an exact solve that is neither was cut at the cap."""
    eng = [r["engine"] for r in rows]
    both = [r for r in rows if r["engine"].feasible and r["exact"].feasible]
    excess = [r["engine"].predicted_step_s / r["exact"].predicted_step_s - 1 for r in both]
    proven_excess = [e for e, r in zip(excess, both) if r["exact"].stats.exact]
    gaps = [p.stats.gap for p in eng if p.feasible and p.stats.gap is not None]
    steps = [p.predicted_step_s for p in eng if p.feasible]
    longer = sum(1 for r in rows if r["engine"].feasible and r["engine_s"] > r["engine"].predicted_step_s)
    exact_s = [r["exact_s"] if r["exact"].stats.exact else math.inf for r in rows]
    engine_s = [r["engine_s"] for r in rows]
    layers = calls[0].ctx.num_layers if calls else 0
    return {
        "run": run, "layers": layers, "calls": len(calls), "sizes": sorted({len(c.requests) for c in calls}),
        "largest": max((len(c.requests) for c in calls), default=0), "n": len(rows),
        "sampled_sizes": sorted({r["size"] for r in rows}),
        "engine_p50_ms": _ms(engine_s, 50), "engine_p99_ms": _ms(engine_s, 99),
        "step_p50_ms": 1e3 * pct(steps, 50), "longer_than_step": longer, "feasible": len(steps),
        "engine_optimal": sum(1 for p in eng if p.feasible and p.stats.exact),
        "engine_none_fits": sum(1 for p in eng if not p.feasible and p.stats.exact),
        "gap_p50": pct(gaps, 50), "gap_max": max(gaps, default=math.nan),
        "exact_p50_ms": _ms(exact_s, 50), "exact_p99_ms": _ms(exact_s, 99),
        "exact_optimal": sum(1 for r in rows if r["exact"].feasible and r["exact"].stats.exact),
        "exact_none_fits": sum(1 for r in rows if not r["exact"].feasible and r["exact"].stats.exact),
        "exact_cut": sum(1 for r in rows if not r["exact"].stats.exact), "cap_s": cap_s,
        "excess_mean": float(np.mean(excess)) if excess else math.nan, "excess_max": max(excess, default=math.nan),
        "proven_excess_max": max(proven_excess, default=math.nan), "proven_n": len(proven_excess),
        "both_feasible": len(both),
    }


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.2f}%"


def _ms_cell(x: float, cap_s: float) -> str:
    return f"> {cap_s:g} s" if math.isinf(x) else f"{x:.1f}"


def table(summaries: list[dict], out: list[str]) -> None:
    out += [
        "| preset | batch cap | layers | calls (batch sizes) | re-solved (sizes) | engine's solve p50 / p99 ms | "
        "its plan's step p50 ms | solves longer than the step | engine proven: optimal / no plan fits | "
        "engine's certified gap p50 / max | exact p50 / p99 ms | exact proven: optimal / no plan fits / cut at the cap "
        "| engine over the best found: mean / max | same, where that is proven optimal: max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        sizes = f"{s['sizes'][0]}-{s['sizes'][-1]}" if s["sizes"] else "-"
        sampled = ",".join(map(str, s["sampled_sizes"])) or "-"
        out.append(
            f"| {s['run'].preset} | {s['run'].max_num_seqs} | {s['layers']} | {s['calls']} ({sizes}) | {s['n']} "
            f"({sampled}) | {s['engine_p50_ms']:.2f} / {s['engine_p99_ms']:.2f} | {s['step_p50_ms']:.1f} | "
            f"{s['longer_than_step']} of {s['feasible']} | {s['engine_optimal']} / {s['engine_none_fits']} of "
            f"{s['n']} | {_pct(s['gap_p50'])} / {_pct(s['gap_max'])} | {_ms_cell(s['exact_p50_ms'], s['cap_s'])} / "
            f"{_ms_cell(s['exact_p99_ms'], s['cap_s'])} | {s['exact_optimal']} / {s['exact_none_fits']} / "
            f"{s['exact_cut']} of {s['n']} (cap {s['cap_s']:g} s) | {_pct(s['excess_mean'])} / "
            f"{_pct(s['excess_max'])} | {_pct(s['proven_excess_max'])} (n={s['proven_n']}) |")


def bench_workload(runs: list[Run], num_requests: int, rate_scale: float, slo_scale: float, seed: int,
                   per_run: int, cap_s: float, out: list[str]) -> list[dict]:
    summaries = []
    for run in runs:
        print(f"{run.preset}: simulating {num_requests} requests at batch {run.max_num_seqs} ...", flush=True)
        t = time.perf_counter()
        calls, _ = record_run(run, num_requests, rate_scale, slo_scale, seed)
        print(f"{run.preset}: {len(calls)} planner calls recorded in {time.perf_counter() - t:.0f} s", flush=True)
        picked = sample(calls, per_run)
        rows = [resolve(c, cap_s, engine_first=i % 2 == 0)
                for i, c in enumerate(tqdm(picked, desc=f"re-solve {run.preset}", unit="call"))]
        summaries.append(summarize(run, calls, rows, cap_s))
    table(summaries, out)
    return summaries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=DEFAULT_RUNS,
                    help="comma list of preset:max-num-seqs:max-num-batched-tokens, one simulated run each "
                         "(default %(default)s: the paper's 8B setup and the 70B one at batch 16, 128K tokens)")
    ap.add_argument("--num-requests", type=int, default=64, help="requests per run (default %(default)s)")
    ap.add_argument("--rate-scale", type=float, default=5.0,
                    help="arrival rate x the paper's 0.97/min (default %(default)s: the paper's heaviest)")
    ap.add_argument("--slo-scale", type=float, default=1.5, help="SLO scale (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-run", type=int, default=40,
                    help="calls re-solved per run, from its largest batches (default %(default)s)")
    ap.add_argument("--exact-cap-s", type=float, default=2.0,
                    help="cap of each exact solve, s (default %(default)s, the speed table's)")
    ap.add_argument("--md", metavar="PATH", help="write the table as a Markdown fragment")
    args = ap.parse_args()
    require_positive(ap, args, ("num_requests", "rate_scale", "slo_scale", "per_run", "exact_cap_s"))
    if args.seed < 0:
        ap.error("--seed must be >= 0")
    try:
        runs = [Run.parse(s) for s in args.runs.split(",")]
    except (ValueError, KeyError, FileNotFoundError) as e:
        ap.error(str(e))
    warm_up()
    started, machine = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), _machine()
    out: list[str] = [
        "",
        "### The exact goal on the engine's own batches",
        "",
        f"Each run: `orbitflow simulate`'s engine on the paper's workload ({args.num_requests} requests, rate scale "
        f"{args.rate_scale:g}, SLO scale {args.slo_scale:g}, seed {args.seed}, the device budget half the largest "
        "batch's KV, step noise and solve time charged as in the paper setup: the charge is the measured wall time, "
        "so two runs record slightly different calls), every call of the OrbitFlow policy "
        f"recorded; then up to {args.per_run} calls of its largest batches, evenly spaced, re-solved as the engine "
        f"solves them (its budget and hint, expiry checks included) and exactly (capped at {args.exact_cap_s:g} s), "
        "back to back, alternating which goes first. A proof is of the optimum, or that no plan fits capacity and "
        "the SLO (then Pause-Resume sets a request aside); 'exact p50 / p99' count a solve cut at the cap as longer "
        "than any ('> cap'). 'engine over the best found': its plan's predicted step over the exact search's plan, "
        "where both have one (where the exact search was cut, its plan is the best found, so this is a lower bound "
        "on the engine's distance from the optimum). The engine's certified gap g is its plan over the least bound "
        "its search left, relative to its plan: the distance from the optimum is at most g / (1 - g).",
        "",
    ]
    bench_workload(runs, args.num_requests, args.rate_scale, args.slo_scale, args.seed, args.per_run,
                   args.exact_cap_s, out)
    print("\n".join(out))
    if args.md:
        write_fragment(args.md, "Planner: the engine's own batches", "python benchmarks/planner_workload.py "
                       + shlex.join(sys.argv[1:]), started, machine, f"seed {args.seed}", out)


if __name__ == "__main__":
    main()
