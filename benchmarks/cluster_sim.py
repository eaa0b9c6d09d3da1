"""Cluster simulation: SLO-aware routing vs round-robin vs least-loaded at equal load, 16 and 64 replicas.

Every replica is the engine `orbitflow simulate` runs (SimExecutor, real scheduler/planner/Token-Deposit/
Pause-Resume); the routers are `orbitflow.runtime.routing.Router`, the rule `orbitflow serve --replicas N` uses
on Ray Serve. For each replica count and seed one trace is drawn (Poisson arrivals at `--rate-scale` x the
paper's per-engine rate x N, the long-context length mix scaled by `--token-scale`, with the device KV budget
scaled alike) and replayed under every router, so the routers see the same requests at the same load.

    python benchmarks/cluster_sim.py                      # 16 and 64 replicas, 5 seeds, table + plot
    python benchmarks/cluster_sim.py --md docs/results/cluster.md --plot docs/results/cluster.png
    python benchmarks/cluster_sim.py --quick              # 4 replicas, 2 seeds: a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from orbitflow.bench.workload import scale_trace
from orbitflow.plan.hardware import resolve_profile
from orbitflow.runtime.routing import ROUTERS
from orbitflow.sim.cluster import simulate_cluster
from orbitflow.sim.runner import sim_config
from orbitflow.sim.sweep import DEFAULT_NOISE_CV, better, largest_batch_blocks, mean_ci95, paper_trace

METRICS = ("tbt_attainment", "tpot_attainment", "p95_ttft_s", "e2e_mean_s", "throughput_rpm", "tokens_per_s")
HEADERS = {"tbt_attainment": "TBT attainment", "tpot_attainment": "TPOT attainment", "p95_ttft_s": "p95 TTFT (s)",
           "e2e_mean_s": "mean E2E (s)", "throughput_rpm": "throughput (req/min)", "tokens_per_s": "tokens/s"}


def run_one(args: argparse.Namespace, replicas: int, router: str, seed: int) -> dict:
    profile = resolve_profile(args.preset)
    n = args.requests_per_replica * replicas
    trace = paper_trace(n, args.rate_scale * replicas, seed=seed)
    if args.token_scale != 1:
        trace = scale_trace(trace, args.token_scale)
    batch_tokens = max(profile.block_size, int(args.max_num_batched_tokens * args.token_scale))
    blocks = max(1, round(args.device_kv_fraction * largest_batch_blocks(profile, batch_tokens)))
    config = sim_config(profile, policy=args.policy, slo_scale=args.slo_scale, seed=seed, device_kv_blocks=blocks,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batch_tokens)
    result = simulate_cluster(profile, trace, config, replicas, router, noise_cv=args.noise_cv,
                              solver_time=args.solver_time, seed=seed)
    out = {k: getattr(result.metrics, k) for k in METRICS}
    out.update(replicas=replicas, router=router, seed=seed, requests=n, fallbacks=result.fallbacks,
               rejected=result.rejected, pauses=result.metrics.num_pauses, wall_s=result.wall_s,
               max_routed=max(result.per_replica_requests), min_routed=min(result.per_replica_requests),
               device_kv_blocks=blocks)
    return out


SETUP_FLAGS = ("seeds", "first_seed", "requests_per_replica", "rate_scale", "token_scale", "slo_scale", "policy",
               "preset", "device_kv_fraction", "max_num_seqs", "max_num_batched_tokens", "noise_cv", "solver_time")


def _job(payload):
    return run_one(*payload)


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for replicas in sorted({r["replicas"] for r in runs}):
        for router in ROUTERS:
            group = [r for r in runs if r["replicas"] == replicas and r["router"] == router]
            if not group:
                continue
            row = {"replicas": replicas, "router": router, "seeds": sorted(r["seed"] for r in group),
                   "requests": group[0]["requests"]}
            for m in (*METRICS, "fallbacks", "pauses"):
                row[m] = mean_ci95(r[m] for r in group)
                row[m]["per_seed"] = {r["seed"]: r[m] for r in group}
            rows.append(row)
    return rows


def _cell(c: dict, fmt: str) -> str:
    if c["mean"] is None:
        return "-"
    return f"{format(c['mean'], fmt)} ± {format(c['ci95'], fmt)}"


def table(rows: list[dict]) -> list[str]:
    fmts = {"tbt_attainment": ".3f", "tpot_attainment": ".3f", "p95_ttft_s": ".1f", "e2e_mean_s": ".1f",
            "throughput_rpm": ".1f", "tokens_per_s": ".0f"}
    out = ["| replicas | router | " + " | ".join(HEADERS[m] for m in METRICS) + " | pauses | no feasible replica |",
           "|---" * (len(METRICS) + 4) + "|"]
    for r in rows:
        cells = [_cell(r[m], fmts[m]) for m in METRICS]
        fb = _cell(r["fallbacks"], ".0f") if r["router"] == "slo-aware" else "-"
        pauses = _cell(r["pauses"], ".0f")
        out.append(f"| {r['replicas']} | {r['router']} | " + " | ".join(cells) + f" | {pauses} | {fb} |")
    return out


def paired_difference(a: dict, b: dict) -> dict:
    """Mean and 95% CI of a - b over the seeds both ran: every router replays each seed's trace, so the seeds pair."""
    return mean_ci95(a["per_seed"][s] - b["per_seed"][s] for s in a["per_seed"]
                     if s in b["per_seed"] and a["per_seed"][s] is not None and b["per_seed"][s] is not None)


def reading(rows: list[dict]) -> list[str]:
    """Per replica count: where SLO-aware routing wins or loses on every metric of the table, by DESIGN's rule (the
    two routers' 95% intervals do not overlap, `sim.sweep.better`); the paired per-seed differences whose interval
    excludes 0 while the routers' intervals overlap, said as such and not claimed; and how often it fell back to
    least-loaded because neither sampled replica had a feasible plan."""
    out = []
    for n in sorted({r["replicas"] for r in rows}):
        slo = next((r for r in rows if r["replicas"] == n and r["router"] == "slo-aware"), None)
        if slo is None:
            continue
        verdicts, paired = [], []
        for metric in METRICS:
            for other in (r for r in rows if r["replicas"] == n and r["router"] != "slo-aware"):
                a, b = slo[metric], other[metric]
                if better(a, b, metric) or better(b, a, metric):
                    verdicts.append(f"{'wins' if better(a, b, metric) else 'loses'} on {HEADERS[metric]} vs "
                                    f"{other['router']} ({_cell(a, '.3g')} vs {_cell(b, '.3g')})")
                    continue
                d = paired_difference(a, b)
                if d["mean"] is not None and d["n"] >= 2 and abs(d["mean"]) > d["ci95"]:
                    paired.append(f"{HEADERS[metric]} vs {other['router']} {d['mean']:+.3g} ± {d['ci95']:.2g}")
        text = "; ".join(verdicts) if verdicts else "neither wins nor loses (intervals overlap) on any metric"
        line = f"- {n} replicas: SLO-aware {text}."
        if paired:
            line += (" Paired per seed, these differences exclude 0 though the routers' intervals overlap (not "
                     "claimed; one test each, no correction for their number): " + "; ".join(paired) + ".")
        share = slo["fallbacks"]["mean"] / slo["requests"] if slo["requests"] else 0.0
        out.append(line + f" In {share:.0%} of its decisions neither sampled replica had a feasible plan (a full "
                   "batch, memory, or the SLO), so it routed as least-loaded.")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["replicas"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, metric in zip(axes, ("tbt_attainment", "throughput_rpm", "p95_ttft_s")):
        width = 0.8 / len(ROUTERS)
        for i, router in enumerate(ROUTERS):
            got = [next((r for r in rows if r["replicas"] == n and r["router"] == router), None) for n in sizes]
            means = [g[metric]["mean"] if g else 0 for g in got]
            errs = [g[metric]["ci95"] if g else 0 for g in got]
            ax.bar([k + (i - 1) * width for k in range(len(sizes))], means, width, yerr=errs, capsize=3, label=router)
        ax.set_xticks(range(len(sizes)), [f"{n} replicas" for n in sizes])
        ax.set_title(HEADERS[metric] + (" (higher is better)" if metric != "p95_ttft_s" else " (lower is better)"),
                     fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle("Cluster simulation: routers at equal load (mean ± 95% CI over seeds)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="16,64", help="comma-separated replica counts")
    ap.add_argument("--routers", default=",".join(ROUTERS), help="comma-separated routers")
    ap.add_argument("--seeds", type=int, default=5, help="seeds (each its own trace and noise; every router replays "
                                                         "it, so the seeds pair)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--requests-per-replica", type=int, default=8)
    ap.add_argument("--rate-scale", type=float, default=48.0,
                    help="per-replica arrival rate as a multiple of the paper's per-engine rate")
    ap.add_argument("--token-scale", type=float, default=0.125,
                    help="scale of prompt and output lengths (and of the device KV budget), to keep runs short")
    ap.add_argument("--slo-scale", type=float, default=1.0)
    ap.add_argument("--policy", default="orbitflow")
    ap.add_argument("--preset", default="a100-llama3-8b")
    ap.add_argument("--device-kv-fraction", type=float, default=0.5)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=32768)
    ap.add_argument("--noise-cv", type=float, default=DEFAULT_NOISE_CV)
    ap.add_argument("--solver-time", default="measured",
                    help="planner solve time on the virtual clock (see simulate; DESIGN: charged)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true", help="4 replicas, 2 seeds")
    ap.add_argument("--md", type=Path, default=None, help="write the Markdown fragment here")
    ap.add_argument("--plot", type=Path, default=None, help="write the plot here")
    ap.add_argument("--json", type=Path, default=None, help="write every run's metrics here")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="re-render the table, plot and fragment from a previous run's --json (no simulation)")
    args = ap.parse_args(argv)
    if args.quick:
        args.replicas, args.seeds = "4", 2
    sizes = [int(x) for x in args.replicas.split(",") if x.strip()]
    routers = [x.strip() for x in args.routers.split(",") if x.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not sizes or min(sizes) < 1:
        ap.error(f"--routers must be from {', '.join(ROUTERS)} and --replicas positive integers")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, load {load:.1f}"
    jobs = [(args, n, router, args.first_seed + s) for n in sizes for s in range(args.seeds) for router in routers]
    jobs.sort(key=lambda j: -j[1])  # the big clusters first
    start = time.perf_counter()
    runs = []
    commit_of_runs = None
    cmd = "python benchmarks/cluster_sim.py " + " ".join(argv if argv is not None else sys.argv[1:])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    saved: dict = {}
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        # the page describes the runs' setup from these flags: they must be the runs' own
        differ = [f"--{k.replace('_', '-')} {saved['args'][k]}" for k in SETUP_FLAGS
                  if k in saved.get("args", {}) and saved["args"][k] != str(getattr(args, k))]
        if differ:
            ap.error(f"--from-json: the runs were made with {', '.join(differ)}; give the same to re-render them")
        runs, elapsed = saved["runs"], float(saved.get("elapsed_s", 0.0))
        machine = saved.get("machine", machine)
        commit_of_runs = saved.get("commit")
    else:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            futures = [pool.submit(_job, j) for j in jobs]
            for fut in tqdm(as_completed(futures), total=len(futures), desc="cluster runs", unit="run"):
                runs.append(fut.result())
        elapsed = time.perf_counter() - start
    rows = summarize(runs)
    lines = table(rows)
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        # a re-render keeps the runs' own command and commit
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                         "elapsed_s": elapsed, "machine": machine,
                                         "command": saved.get("command", cmd), "commit": commit_of_runs or commit},
                                        indent=1))
    if args.plot:
        plot(rows, args.plot)
    if args.md:
        produced = (f"Runs by `{saved.get('command', '?')}` at commit {commit_of_runs}, re-rendered by `{cmd}`"
                    if args.from_json else f"Command: `{cmd}`")
        md = [
            "Routers compared on the cluster simulator (`orbitflow.sim.cluster`): N replicas of the simulated "
            "engine (the one `orbitflow simulate` runs: real scheduler, planner, Token-Deposit and Pause-Resume "
            "over the SimExecutor) behind the routing rule that `orbitflow serve --replicas N` applies on Ray "
            "Serve (`orbitflow.runtime.routing`). SLO-aware: power of two choices, each sampled replica's own "
            "planner asked `what_if` the request joined now, most SLO headroom among feasible ones, else least "
            "loaded. Each seed draws one trace that every router replays (equal load).",
            "",
            f"Setup: preset `{args.preset}`, policy `{args.policy}`, SLO scale {args.slo_scale}, "
            f"{args.requests_per_replica} requests per replica at {args.rate_scale:g}x the paper's per-engine "
            f"rate (Poisson), lengths of the long-context mix x {args.token_scale:g} with the device KV budget "
            f"scaled alike ({args.device_kv_fraction:g} of the largest batch), max {args.max_num_seqs} sequences "
            f"per replica, noise CV {args.noise_cv:g}, solver time `{args.solver_time}`; seeds "
            f"{args.first_seed}..{args.first_seed + args.seeds - 1}; mean ± 95% CI (Student t) over seeds; a win or "
            f"loss below is called only where the two routers' intervals do not overlap (DESIGN's rule); paired "
            f"per-seed differences whose CI excludes 0 are listed apart and not claimed. The routers' own what-if "
            f"solves are not charged (on Ray Serve the replicas compute their what-if tables in the background). "
            f"In the simulator the router asks each replica exactly; on Ray Serve it reads the replicas' routing "
            f"stats (every 0.5 s: state and a what-if table over a grid of request sizes, rounded up).",
            "",
            *lines,
            "",
            *reading(rows),
            "",
            f"![cluster routers](results/{args.plot.name if args.plot else 'cluster.png'})",
            "",
            f"{produced} ({len(runs)} runs, {elapsed / 60:.1f} min, commit {commit}, "
            f"{datetime.date.today().isoformat()}; machine: {machine}).",
        ]
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
