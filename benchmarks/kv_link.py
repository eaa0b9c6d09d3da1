"""The preemptive KV link against the EDF one, on the real engine (SmolLM2-135M on the CPU, throttled link).

`--kv-link edf`: a fetch holds the link to its end (earliest-needed layer first). `--kv-link preemptive`: fetches
move in chunks of --kv-link-chunk-ms of link time and yield between two to a fetch of an earlier layer released
meanwhile; the planner then plans with `CostModel(transfer="preemptive")`.

A run measures the hardware profile (with the EDF link: it is the same for both, as the profiler's one request
at a time contends with no one), then plays rounds. A round: the trace of `benchmarks/sim_vs_engine.py --quick`
replayed on the real engine (wall clock, requests fed at their arrival times) under each policy, once per link,
the links' order alternating between rounds. Every decode step is recorded with what its link's cost model
predicted for it. Reported per policy and link: decode steps, median and mean step, stall per step, preemptions
per step, the model's error (per step: median, p95; total stall), TBT attainment, P95 TBT and the planner's
solves; and per policy, the ratio of the mean decode step (preemptive / EDF) per round: mean and 95% t-interval
over each run's rounds and over all of them, beside the ratio the models predict for the same steps (the runs
tell whether the profile, measured afresh, moves the ratio more than the rounds show). A fixed placement
(`fixed:random:7`, each layer of each request on the host with probability 1/2) runs the very same placements on
both links; OrbitFlow plans for the link it runs.

Then the same comparison at the paper's scale on the simulator (`orbitflow simulate --policies orbitflow --kv-link
edf,preemptive`: the A5000 / Llama-3-8B preset, 64 requests of the long-context mix per seed, noise and solve time
charged), where many more requests share the link: attainment, P95 TBT, mean generated TBT and the planner's time
per solve, mean with 95% CI over the seeds, and the preemptive-minus-EDF difference per seed (paired: same trace).

Run:  python benchmarks/kv_link.py [--rounds 3] [--repeat 2] [--policies fixed:random:7,orbitflow]
          [--md docs/results/kv_link.md]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from sim_vs_engine import MODEL, loadavg, make_trace, run_engine, step_errors  # noqa: E402

from orbitflow.config import LINK_CHOICES, EngineConfig  # noqa: E402
from orbitflow.llm import LLM  # noqa: E402
from orbitflow.model.loader import load_model  # noqa: E402
from orbitflow.plan.hardware import load_preset  # noqa: E402
from orbitflow.sim.sweep import PAPER_SETUP, grid, mean_ci95, run_points  # noqa: E402

SIM_PRESET = "a5000-llama3-8b"
SIM_METRICS = (("tbt_attainment", "TBT attainment", 1.0, "{:.4f}"), ("p95_tbt_s", "P95 TBT ms", 1e3, "{:.2f}"),
               ("tbt_mean_s", "mean TBT ms", 1e3, "{:.3f}"))


def interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and the bounds of its 95% t-interval (``sim.sweep.mean_ci95``; nan bounds for one value)."""
    ci = mean_ci95(values)
    if ci["n"] < 2:
        return ci["mean"], math.nan, math.nan
    return ci["mean"], ci["mean"] - ci["ci95"], ci["mean"] + ci["ci95"]


def run_rounds(config: EngineConfig, loaded, profile, trace, policies: list[str], rounds: int,
               fixed_blocks: int) -> dict:
    """runs[policy][link] = one EngineRun per round (a fixed placement with a device budget of ``fixed_blocks``)."""
    runs = {p: {link: [] for link in LINK_CHOICES} for p in policies}
    for k in range(rounds):
        for policy in policies:
            for link in LINK_CHOICES if k % 2 == 0 else LINK_CHOICES[::-1]:
                t0 = time.perf_counter()
                budget = fixed_blocks if policy.startswith("fixed:") else config.cache.device_kv_blocks
                run = run_engine(config.replace(policy=policy, kv_link=link, device_kv_blocks=budget), loaded, profile,
                                 trace,
                                 deadline_s=trace.duration_s + 60)
                runs[policy][link].append(run)
                m = run.metrics
                print(f"  round {k + 1}/{rounds} {policy:16s} {link:10s}: {time.perf_counter() - t0:5.1f} s, "
                      f"{len(run.steps)} decode steps, mean {1e3 * np.mean([s.measured_s for s in run.steps]):.2f} "
                      f"ms, {run.preemptions} preemptions, TBT att {m.tbt_attainment:.1%}", flush=True)
    return runs


def _ratios(pairs, key) -> list[float]:
    """Per round: the preemptive run's mean decode step (``key``: measured_s or sim_model_s) over the EDF run's."""
    return [np.mean([getattr(s, key) for s in p.steps]) / np.mean([getattr(s, key) for s in e.steps])
            for e, p in pairs]


def tables(repeats: list[dict]) -> list[str]:
    """The fragment's tables from ``repeats`` (one :func:`run_rounds` result per fresh profile)."""
    policies = list(repeats[0])
    out = ["| policy | link | decode steps | step p50 ms | step mean ms | stall ms/step | preemptions/step | "
           "model error p50 | p95 | stall error | TBT attainment | P95 TBT ms | solves | ms per solve |",
           "|---" * 14 + "|"]
    for policy in policies:
        for link in LINK_CHOICES:
            rs = [r for runs in repeats for r in runs[policy][link]]
            steps = [s for r in rs for s in r.steps]
            err = step_errors(steps)
            n, solves = max(len(steps), 1), sum(r.metrics.solver_calls or 0 for r in rs)
            out.append(
                f"| {policy} | {link} | {len(steps)} | {1e3 * np.median([s.measured_s for s in steps]):.2f} | "
                f"{1e3 * np.mean([s.measured_s for s in steps]):.2f} | "
                f"{1e3 * sum(s.measured_stall_s for s in steps) / n:.2f} | "
                f"{sum(r.preemptions for r in rs) / n:.2f} | {err['step_err_median']:.1%} | "
                f"{err['step_err_p95']:.1%} | "
                f"{err['stall_err']:.1%} | {statistics.mean(r.metrics.tbt_attainment for r in rs):.1%} | "
                f"{1e3 * statistics.mean(r.metrics.p95_tbt_s for r in rs):.1f} | {solves} | "
                f"{1e3 * sum(r.metrics.solver_time_s or 0.0 for r in rs) / max(solves, 1):.2f} |")
    out += ["", "Mean decode step, preemptive / EDF, per round (round k of both links, the same profile): mean and "
                "95% t-interval over the rounds of each run (a fresh profile each), then over every round; 'model' "
                "is the same ratio of what each link's cost model predicted for the steps that ran. Below 1: the "
                "preemptive link is faster.", "",
            "| policy | run | measured ratio | 95% CI | per round | model ratio | 95% CI |", "|---" * 7 + "|"]
    verdicts = []
    for policy in policies:
        per_run = [list(zip(runs[policy]["edf"], runs[policy]["preemptive"], strict=True)) for runs in repeats]
        intervals = []
        for label, pairs in [*((f"{k + 1}/{len(per_run)}", p) for k, p in enumerate(per_run)),
                             *((("all", [x for p in per_run for x in p]),) if len(per_run) > 1 else ())]:
            measured, model = _ratios(pairs, "measured_s"), _ratios(pairs, "sim_model_s")
            (m, lo, hi), (mm, mlo, mhi) = interval(measured), interval(model)
            out.append(f"| {policy} | {label} | {m:.3f} | [{lo:.3f}, {hi:.3f}] | "
                       f"{', '.join(f'{x:.3f}' for x in measured)} | {mm:.3f} | [{mlo:.3f}, {mhi:.3f}] |")
            intervals.append((lo, hi))
        lo, hi = intervals[-1]
        verdict = (f"{policy}: {m:.3f} measured against {mm:.3f} predicted over {len(measured)} round(s), "
                   + ("the interval holds 1 (no difference the rounds can tell)" if lo <= 1.0 <= hi else
                      "faster on the preemptive link" if hi < 1.0 else
                      "slower on the preemptive link" if lo > 1.0 else "one round: no interval"))
        runs_only = intervals[:-1] if len(per_run) > 1 else []
        if any(a[1] < b[0] for a in runs_only for b in runs_only):
            verdict += (" (but the runs' own intervals do not overlap: the profile moves the ratio more than the "
                        "rounds show)")
        verdicts.append(verdict)
    return [*out, "", "Verdict: " + "; ".join(verdicts) + "."]


def _cell(values: list[float], fmt: str) -> str:
    """Mean [95% t-interval] of ``values`` (the mean alone for one value)."""
    m, lo, hi = interval(values)
    return fmt.format(m) if len(values) < 2 else f"{fmt.format(m)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def sim_section(seeds: int, slo_scales: list[float], rate: float, **setup_changes) -> list[str]:
    """OrbitFlow on both links on the simulator at the paper's setup (module docstring; ``setup_changes``: fields
    of the setup changed, e.g. fewer requests for a test)."""
    setup = replace(PAPER_SETUP, seeds=seeds, **setup_changes)
    points = [pt for link in LINK_CHOICES for pt in grid(["orbitflow"], slo_scales, [rate], kv_link=link)]
    runs = run_points(load_preset(SIM_PRESET), setup, points)
    by = {(r["slo_scale"], r["kv_link"], r["seed"]): r for r in runs}
    out = ["", f"### At the paper's scale (simulator, preset `{SIM_PRESET}`, OrbitFlow, rate x{rate:g}, {seeds} "
               f"seeds x {setup.num_requests} requests)", "",
           "| SLO scale | link | " + " | ".join(name for _, name, _, _ in SIM_METRICS) + " | ms per solve | pauses | "
           "preemptive - EDF per seed: " + ", ".join(name for _, name, _, _ in SIM_METRICS) + " |",
           "|---" * (5 + len(SIM_METRICS)) + "|"]
    for slo in slo_scales:
        for link in LINK_CHOICES:
            rs = [by[(slo, link, s)] for s in range(seeds)]
            cells = [_cell([scale * r[key] for r in rs], fmt) for key, _, scale, fmt in SIM_METRICS]
            solve = 1e3 * sum(r["solver_time_s"] for r in rs) / max(sum(r["solver_calls"] for r in rs), 1)
            diffs = ""
            if link == "preemptive":
                diffs = "; ".join(_cell([scale * (by[(slo, link, s)][key] - by[(slo, "edf", s)][key])
                                         for s in range(seeds)], fmt) for key, _, scale, fmt in SIM_METRICS)
            out.append(f"| {slo:g} | {link} | " + " | ".join(cells) + f" | {solve:.2f} | "
                       f"{statistics.mean(r['num_pauses'] for r in rs):.1f} | {diffs} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per run (each runs every policy on both links)")
    ap.add_argument("--repeat", type=int, default=2, help="runs, each with a freshly measured profile")
    ap.add_argument("--policies", default="fixed:random:7,orbitflow", help="comma list of policies")
    ap.add_argument("--link-gbps", type=float, default=0.3, help="host<->device link throttle, GB/s")
    ap.add_argument("--budget", type=float, default=0.3, help="device KV budget as a fraction of a full batch's KV")
    ap.add_argument("--fixed-budget", type=float, default=0.7,
                    help="device KV budget of the fixed placements (about half their KV is on the device)")
    ap.add_argument("--chunk-ms", type=float, default=None,
                    help="--kv-link-chunk-ms of the preemptive link (default: the engine's)")
    ap.add_argument("--seed", type=int, default=0, help="trace seed")
    ap.add_argument("--sim-seeds", type=int, default=5, help="seeds of the simulator section (0: skip it)")
    ap.add_argument("--sim-slo-scales", default="1.0,1.5", help="SLO scales of the simulator section")
    ap.add_argument("--sim-rate", type=float, default=3.0, help="arrival-rate scale of the simulator section")
    ap.add_argument("--md", metavar="PATH", help="write the tables as a Markdown fragment (docs/results/kv_link.md)")
    args = ap.parse_args()
    for name in ("rounds", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.sim_seeds < 0:
        ap.error(f"--sim-seeds must be >= 0, got {args.sim_seeds}")
    try:
        sim_slos = [float(x) for x in args.sim_slo_scales.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sim-slo-scales takes a comma list of numbers, got {args.sim_slo_scales!r}")
    if args.chunk_ms is not None and not args.chunk_ms > 0:
        ap.error(f"--chunk-ms must be > 0, got {args.chunk_ms}")
    policies = [p for p in args.policies.split(",") if p]
    started, before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), loadavg()
    wall0 = time.perf_counter()
    trace = make_trace(5, 5.0, (64, 300), (12, 32), args.seed)  # sim_vs_engine.py --quick's
    loaded = load_model(MODEL)
    layers, block, max_num_seqs = loaded.config.num_layers, 16, 4
    per_request = [math.ceil((r.input_tokens + r.output_tokens) / block) * layers for r in trace]
    config = EngineConfig.build(
        model=MODEL, block_size=block, device_kv_blocks=max(int(args.budget * statistics.mean(per_request)
                                                                 * max_num_seqs), max(per_request) // 2),
        host_kv_blocks=sum(per_request) + 1024, link_gbps=args.link_gbps, max_num_seqs=max_num_seqs, seed=args.seed,
        **({} if args.chunk_ms is None else {"kv_link_chunk_ms": args.chunk_ms}))
    fixed_blocks = int(args.fixed_budget * statistics.mean(per_request) * max_num_seqs)
    repeats = []
    for k in range(args.repeat):
        probe = LLM(config, profile="measure", loaded=loaded)
        profile = probe.profile
        probe.close()
        print(f"run {k + 1}/{args.repeat}: profile measured", flush=True)
        repeats.append(run_rounds(config, loaded, profile, trace, policies, args.rounds, fixed_blocks))
    out = [f"Setup: {MODEL} on the CPU, the quick trace of `benchmarks/sim_vs_engine.py` ({len(trace)} requests, "
           f"seed {args.seed}), device budget {config.cache.device_kv_blocks} blocks (~{args.budget:.0%} of a "
           f"batch of {max_num_seqs}; the fixed placements {fixed_blocks}, ~{args.fixed_budget:.0%}), link "
           f"{args.link_gbps} GB/s, preemptive chunks of {config.cache.kv_link_chunk_ms:g} ms, {args.repeat} run(s) of "
           f"{args.rounds} rounds (a fresh profile per run), links alternating; load average before / after: "
           f"{before} / {loadavg()}; {(time.perf_counter() - wall0) / 60:.1f} min.", "", *tables(repeats)]
    if args.sim_seeds:
        out += sim_section(args.sim_seeds, sim_slos, args.sim_rate)
    print("\n".join(out))
    if args.md:
        from planner import _machine, write_fragment

        write_fragment(args.md, "The preemptive KV link on the real engine", "python benchmarks/kv_link.py "
                       + " ".join(sys.argv[1:]), started, _machine(), f"seed {args.seed}", out)


if __name__ == "__main__":
    main()
