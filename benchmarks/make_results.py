"""Regenerate docs/results.md: every table, JSON file and plot of the simulator evaluation, plus the fragments
other benchmarks write (docs/results/<name>.md), in one command.

Run:  python benchmarks/make_results.py                 # simulator stage + the fragments already on disk
      python benchmarks/make_results.py --stages all    # also re-run the planner / engine / fidelity benchmarks
      python benchmarks/make_results.py --reduced       # a smaller configuration, labelled as such in the page
      python benchmarks/make_results.py --stages none   # re-assemble the page from the fragments on disk

Stages: sim (the paper's evaluation on the simulator, always 5+ seeds with 95% CIs), planner
(benchmarks/planner.py), planner_proof (its proof section), planner_link (its link section: the same batches planned
for a preemptive link), planner_lp (benchmarks/planner_lp.py: the path relaxation), planner_gap (its gap section: the
same batches solved within Gurobi-like relative gaps), planner_replan (its replan section: what a re-plan could reuse
of the last search), planner_gil (its gil section: where a solve holds the GIL), kv_link (benchmarks/kv_link.py: the
preemptive link on the engine), engine_vs_hf (benchmarks/engine_vs_hf.py), host_copy_bound
(benchmarks/host_copy_bound.py), host_layer_cost (benchmarks/host_layer_cost.py), deposit_guard
(benchmarks/deposit_guard.py), sim_fidelity and sim_fidelity_tight
(benchmarks/sim_vs_engine.py), tensor_parallel (benchmarks/tensor_parallel.py), cluster (benchmarks/cluster_sim.py); all
of them with --stages all (OTHER_STAGES has each one's command). The GPU and planner-beside-the-engine fragments
come from the runs they name.
The page always includes whichever fragments exist. Every simulator run is appended to a cache
(docs/results/sim_runs.jsonl) with a hash of the code that made it; --resume reuses the cached runs of the same setup
and the same code, so an interrupted regeneration picks up where it stopped (--resume-any-code also reuses runs of
other code, and the page names their commits).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from orbitflow.bench.plots import plot_ci_bars, write_plots  # noqa: E402
from orbitflow.plan.hardware import load_preset  # noqa: E402
from orbitflow.policies import BASELINES  # noqa: E402
from orbitflow.sim.sweep import (  # noqa: E402
    PAPER_SETUP,
    Point,
    SimSetup,
    better,
    config_record,
    grid,
    largest_batch_blocks,
    mean_ci95,
    run_points,
    summarize,
    with_no_deposit,
)

PRESET = "a5000-llama3-8b"
POLICIES = ["orbitflow", *BASELINES]
ADAPTIVE = ["flexgen+", "slo-aware", "dynamic"]
SLO_SCALES = (1.0, 1.5, 2.5)
RATE_SCALES = (1.0, 3.0, 5.0)
SENS_SLO, SENS_RATE = 1.0, 3.0  # sensitivity studies: the tightest SLO scale, a middle arrival rate
BUDGETS = (0.23, 0.5, 0.75)
# Link rates spanning the paper's hardware, each with its source.
LINKS = (
    (None, "3.85 GB/s: fitted to the paper's 1.9x / 6.1x transfer-to-compute ratios (plan/hardware.py, the preset)"),
    (12.0, "12 GB/s: pinned-memory host-to-device copies on PCIe 3.0 x16 (15.75 GB/s raw, 128b/130b; CUDA "
           "bandwidthTest typically reports 11-13 GB/s), the paper's stated link"),
    (24.0, "24 GB/s: pinned copies on PCIe 4.0 x16 (31.5 GB/s raw), the RTX A5000's own interface per NVIDIA's "
           "datasheet, and the paper's A6000 node"),
)
ABLATION_STEPS = ("batch-uniform", "+request-wise", "+pause-resume")
VICTIM_RULES = ("orbitflow@longest", "orbitflow@shortest", "orbitflow@random")  # OrbitFlow with another victim rule
FRAGMENTS = (("sim_fidelity", "Simulator vs the real engine"),
             ("sim_fidelity_tight", "Simulator vs the real engine at a tighter SLO"), ("planner", "Planner speed"),
             ("planner_proof", "Planner: what an exact proof at (16, 80) takes"),
             ("planner_link", "Planner: the executor's link vs a preemptive one"),
             ("planner_lp", "Planner: how tight a linear relaxation gets at (16, 80)"),
             ("planner_gap", "Planner: exact, or within a gap"),
             ("planner_replan", "Planner: what a re-plan could reuse"),
             ("planner_gil", "Planner: where a solve holds the GIL"),
             ("planner_gil_share", "Planner: how much of a solve may hold the GIL"),
             ("planner_gil_switch", "Planner: a planner thread by GIL switch interval"),
             ("planner_gil_grain", "Planner: a planner thread beside a step of fewer torch calls"),
             ("planner_workload", "Planner: the engine's own batches"),
             ("kv_link", "The preemptive KV link on the real engine"),
             ("planner_engine_gpu", "The planner beside the engine (CUDA, 16 cores)"),
             ("planner_engine_cpu", "The planner beside the engine (CPU, 16 cores)"),
             ("planner_engine_cpu2", "The planner beside the engine (CPU, 2 cores)"),
             ("engine_vs_hf", "Engine vs Hugging Face transformers"),
             ("host_copy_bound", "Half on host: the copy's own cost"),
             ("host_layer_cost", "What reading prefetched KV adds to the compute"), ("serving", "Serving"),
             ("deposit_guard", "Token-Deposit's guard band"),
             ("victims", "Pause victims"), ("tensor_parallel", "Tensor parallelism"),
             ("gpu_smoke", "GPU smoke test (benchmarks/gpu_smoke.py)"),
             ("cluster", "Scale-out: routers on a simulated cluster"))
OTHER_STAGES = {
    "planner": ["benchmarks/planner.py", "--sections", "speed,budget_seeds", "--md", "docs/results/planner.md"],
    "planner_proof": ["benchmarks/planner.py", "--sections", "proof", "--md", "docs/results/planner_proof.md"],
    "planner_link": ["benchmarks/planner.py", "--sections", "link", "--md", "docs/results/planner_link.md"],
    "planner_lp": ["benchmarks/planner_lp.py", "--lp-cap-s", "30", "--md", "docs/results/planner_lp.md"],
    "planner_gap": ["benchmarks/planner.py", "--sections", "gap", "--md", "docs/results/planner_gap.md"],
    "planner_replan": ["benchmarks/planner.py", "--sections", "replan", "--md", "docs/results/planner_replan.md"],
    "planner_gil": ["benchmarks/planner.py", "--sections", "gil", "--md", "docs/results/planner_gil.md"],
    "planner_gil_share": ["benchmarks/planner.py", "--sections", "gil_share", "--md",
                          "docs/results/planner_gil_share.md"],
    "planner_gil_switch": ["benchmarks/planner.py", "--sections", "gil_switch", "--md",
                           "docs/results/planner_gil_switch.md"],
    "planner_gil_grain": ["benchmarks/planner.py", "--sections", "gil_grain", "--md",
                          "docs/results/planner_gil_grain.md"],
    "planner_workload": ["benchmarks/planner_workload.py", "--md", "docs/results/planner_workload.md"],
    "kv_link": ["benchmarks/kv_link.py", "--rounds", "4", "--repeat", "3", "--sim-seeds", "5", "--md",
                "docs/results/kv_link.md"],
    "engine_vs_hf": ["benchmarks/engine_vs_hf.py", "--contexts", "512,2048,8192", "--batches", "1,4", "--tokens", "16",
                     "--repeats", "3", "--offload", "2048:4", "--md", "docs/results/engine_vs_hf.md",
                     "--note", "Batch 8 is not in this run: 8192 x 8 alone takes about 35 minutes with three sides "
                     "on a 2-core machine."],
    "host_copy_bound": ["benchmarks/host_copy_bound.py", "--md", "docs/results/host_copy_bound.md"],
    "host_layer_cost": ["benchmarks/host_layer_cost.py", "--md", "docs/results/host_layer_cost.md"],
    "deposit_guard": ["benchmarks/deposit_guard.py", "--rounds", "5", "--md", "docs/results/deposit_guard.md"],
    "sim_fidelity": ["benchmarks/sim_vs_engine.py", "--quick", "--repeat", "3",
                     "--json", "docs/results/sim_fidelity.json", "--md", "docs/results/sim_fidelity.md"],
    # the same check at a tighter SLO, where other pairs of policies sit near the SLO (sim_vs_engine.py --help)
    "sim_fidelity_tight": ["benchmarks/sim_vs_engine.py", "--quick", "--repeat", "3", "--slo-scale", "1.5",
                           "--json", "docs/results/sim_fidelity_tight.json",
                           "--md", "docs/results/sim_fidelity_tight.md",
                           "--title", "How far to trust the simulator at a tighter SLO (scale 1.5)"],
    "tensor_parallel": ["benchmarks/tensor_parallel.py", "--tp", "3", "--shared",
                        "--md", "docs/results/tensor_parallel.md"],
    "cluster": ["benchmarks/cluster_sim.py", "--md", "docs/results/cluster.md", "--plot", "docs/results/cluster.png",
                "--json", "docs/results/cluster_runs.json"],
}
LABEL = {"orbitflow": "OrbitFlow", "deepspeed": "DeepSpeed", "flexgen": "FlexGen", "flexgen+": "FlexGen+",
         "slo-aware": "SLO-aware", "dynamic": "Dynamic", "batch-uniform": "Batch-Uniform",
         "+request-wise": "+Request-Wise", "+pause-resume": "+Pause-Resume",
         "orbitflow@longest": "OrbitFlow, pause the longest", "orbitflow@shortest": "OrbitFlow, pause the shortest",
         "orbitflow@random": "OrbitFlow, pause at random"}


# ----------------------------------------------------------------------------- the points
def sim_points(rates=RATE_SCALES) -> dict[str, list[Point]]:
    """Every simulator point, by study. Points shared between studies are run once."""
    sens = {"slo_scales": [SENS_SLO], "rate_scales": [SENS_RATE]}
    studies = {"headline": grid(POLICIES, SLO_SCALES, rates)}
    studies["budget"] = [p for f in BUDGETS if f != 0.5
                         for p in grid(POLICIES, token_deposit=(True,), device_kv_fraction=f, **sens)]
    studies["link"] = [p for link, _ in LINKS if link is not None
                       for p in grid(POLICIES, token_deposit=(True,), link_gbps=link, **sens)]
    studies["depth"] = (grid([p for p in POLICIES if p != "deepspeed"], prefetch_slots=2, **sens)
                        + grid(["deepspeed"], prefetch_slots=1, **sens))
    studies["deposit"] = grid(POLICIES, [1.0, 2.5], [SENS_RATE], (False,))  # DESIGN: every policy with and without
    studies["ablation"] = grid(list(ABLATION_STEPS), token_deposit=(False,), **sens)
    studies["victims"] = grid(list(VICTIM_RULES), **sens)
    # the reference points of the studies above (in the headline grid unless --reduced drops their rate)
    studies["reference"] = grid(POLICIES, **sens) + grid(POLICIES, [2.5], [SENS_RATE])
    return studies


def code_version(src: Path = ROOT / "src" / "orbitflow") -> str:
    """A hash of the code a simulator run executes (every file under src/orbitflow), so a cached run made by other
    code, another commit or uncommitted edits, is told from this checkout's (a commit hash misses the edits)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(src).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cached_runs(path: Path, code: str) -> tuple[dict[str, dict], dict[str, dict]]:
    """The runs of ``path`` (sim_runs.jsonl) by key, the last of each key kept: those ``code`` made, and those other
    code made (runs cached before the hash was kept count as other code)."""
    mine, other = {}, {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        (mine if rec.get("code") == code else other)[rec["key"]] = rec
    return mine, other


def _key(point: Point, seed: int, setup: SimSetup) -> str:
    fields = asdict(point)
    if fields["kv_link"] == "edf":  # the default: keys cached before the field existed stay valid
        del fields["kv_link"]
    return json.dumps({"point": fields, "seed": seed, "setup": asdict(setup)}, sort_keys=True)


# ----------------------------------------------------------------------------- statistics helpers
class Results:
    def __init__(self, runs: list[dict], setup: SimSetup):
        self.runs = runs
        self.setup = setup

    def select(self, policy, slo=None, rate=None, deposit=True, fraction=None, link=None, slots="policy"):
        out = []
        for r in self.runs:
            if r["policy"] != policy or bool(r["token_deposit"]) != deposit:
                continue
            if slo is not None and r["slo_scale"] != slo or rate is not None and r["rate_scale"] != rate:
                continue
            if r["_point"]["device_kv_fraction"] != fraction or r["_point"]["link_gbps"] != link:
                continue
            if slots == "policy" and r["_point"]["prefetch_slots"] is not None:
                continue
            if slots != "policy" and r["_point"]["prefetch_slots"] != slots:
                continue
            out.append(r)
        return out

    def cell(self, metric, policy, slo, rates=None, **kw) -> dict:
        """Mean and 95% CI over seeds of ``metric`` averaged per seed over ``rates`` (default: all)."""
        return mean_ci95(self.per_seed(metric, policy, slo, rates, **kw).values())

    def per_seed(self, metric, policy, slo, rates=None, **kw) -> dict[int, float]:
        """Per seed, ``metric`` averaged over ``rates`` (default: all); runs that lack it (None, NaN) are skipped,
        never counted as 0."""
        by_seed: dict[int, list[float]] = {}
        for r in self.select(policy, slo=slo, **kw):
            if rates is None or r["rate_scale"] in rates:
                v = r.get(metric)
                if v is not None and not (isinstance(v, float) and np.isnan(v)):
                    by_seed.setdefault(r["seed"], []).append(float(v))
        return {s: float(np.mean(v)) for s, v in by_seed.items()}


def fmt(cell: dict, spec: str = ".3f", scale: float = 1.0) -> str:
    if not cell or cell.get("mean") is None:
        return "-"
    return f"{format(cell['mean'] * scale, spec)} ± {format(cell['ci95'] * scale, spec)}"


def ratio_of_means(a: dict[int, float], b: dict[int, float], less: float = 0.0) -> dict:
    """mean(a) / mean(b) - ``less`` over the seeds both have, with a 95% interval by the delta method (the Student-t
    interval of the paired residuals a - R b, over mean(b)). A mean of per-seed ratios lets one seed where b is near
    0 carry the row (a baseline at 0.04 attainment on one seed made a +127% gain read +186%)."""
    seeds = [s for s in a if s in b and a[s] is not None and b[s] is not None]
    x, y = np.array([a[s] for s in seeds], dtype=float), np.array([b[s] for s in seeds], dtype=float)
    if not seeds or not y.mean():
        return {"mean": None, "ci95": None, "n": 0}
    r = float(x.mean() / y.mean())
    return {"mean": r - less, "ci95": mean_ci95(x - r * y)["ci95"] / abs(float(y.mean())), "n": len(seeds)}


def verdict(ours: dict, theirs: dict, metric: str) -> str:
    if better(ours, theirs, metric):
        return "win"
    if better(theirs, ours, metric):
        return "LOSS"
    return "tie"


METRICS = (("tbt_attainment", "TBT att", ".3f", 1.0), ("tpot_attainment", "TPOT att", ".3f", 1.0),
           ("p95_tbt_s", "P95 TBT (ms)", ".0f", 1000.0), ("p99_tbt_s", "P99 TBT (ms)", ".0f", 1000.0),
           ("ttft_mean_s", "TTFT (s)", ".0f", 1.0), ("e2e_mean_s", "E2E (s)", ".0f", 1.0),
           ("throughput_rpm", "req/min", ".2f", 1.0), ("tokens_per_s", "tok/s", ".1f", 1.0),
           ("device_mem_util", "dev mem", ".2f", 1.0), ("num_pauses", "pauses", ".1f", 1.0))


def policy_table(res: Results, slo, rates=None, policies=POLICIES, **kw) -> list[str]:
    head = "| policy | " + " | ".join(m[1] for m in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 1)]
    for p in policies:
        cells = [fmt(res.cell(m, p, slo, rates, **kw), spec, scale) for m, _, spec, scale in METRICS]
        lines.append(f"| {LABEL.get(p, p)} | " + " | ".join(cells) + " |")
    return lines


# ----------------------------------------------------------------------------- the page
def sim_section(res: Results, profile, setup: SimSetup, rates, reduced: bool, out_dir: Path) -> tuple[list[str], dict]:
    md: list[str] = []
    largest = largest_batch_blocks(profile, setup.max_num_batched_tokens)
    budget = round(0.5 * largest)
    md += ["## Setup", "",
           f"The paper's setup (section 5.1 and its setup footnote) on the simulator: LLaMA3-8B on an RTX A5000 "
           f"(`{PRESET}`: decode step = {profile.decode_a:.3g} s x tokens + {1000 * profile.decode_b:.1f} ms, "
           f"{profile.num_layers} layers, {profile.kv_bytes_per_token_per_layer // 1024} KiB of KV per token and "
           f"layer); "
           f"batch size {setup.max_num_seqs}, at most {setup.max_num_batched_tokens} tokens per batch; "
           f"**device KV budget 0.5 x the largest batch** ({budget} layer-blocks, about "
           f"{budget * profile.block_size // profile.num_layers} tokens: the paper's 'about 16K of 32K tokens'); "
           f"link {profile.link_bytes_per_s / 1e9:.2f} GB/s unless a table says otherwise; base SLO = the no-offload "
           f"decode step with the budget full; Poisson arrivals at the paper's 0.97 req/min times the rate scale; "
           f"long-context length mix (inputs around 0.5K/4K/12K, outputs around 0.25K/1K/3K tokens).", "",
           f"Fairness: **{setup.seeds} seeds x {setup.num_requests} requests** per "
           f"point (each seed its own trace and noise); every number is the mean over seeds with its **95% "
           f"confidence interval** (Student t); a policy is called better only where the intervals do not overlap. "
           f"Every step (its compute and transfers alike) carries a seeded lognormal factor (CV {setup.noise_cv}; "
           f"the default 0.07 is the spread `benchmarks/step_jitter.py` measured on the engine: a fixed batch of 4, "
           f"every layer on the device; `orbitflow profile` measures a smaller one, which the fidelity sections below "
           f"use) the planner does not see; the planner's measured solve time is charged on the virtual clock "
           f"({setup.solver_time}) as the engine runs its solves: an expiry is solved ahead while the steps before it "
           f"run, every other solve holds its step; DeepSpeed, FlexGen and FlexGen+ run at prefetch depth 2 (their "
           f"code fetches layer i+1 while layer i runs), every other policy at depth 1 unless a table says depth 2. "
           f"Every policy runs with Token-Deposit unless noted.", ""]
    if reduced:
        md += [f"> **Reduced configuration.** This page was generated with `--reduced` "
               f"(rate scales {', '.join(f'{r:g}' for r in rates)}; {setup.num_requests} requests per run). "
               f"The full configuration is `python benchmarks/make_results.py`.", ""]
    # headline
    md += ["## Headline: the paper's setup", "",
           f"Mean ± 95% CI over {setup.seeds} seeds; each seed's value is its average over the rate scales "
           f"{', '.join(f'{r:g}' for r in rates)} (per-rate points are in `docs/results/a5000.json`). "
           f"Budget 0.5, link {profile.link_bytes_per_s / 1e9:.2f} GB/s.", ""]
    for slo in SLO_SCALES:
        md += [f"**SLO scale {slo:g}**", ""] + policy_table(res, slo, rates) + [""]
    md += ["OrbitFlow against each baseline (win / LOSS = the intervals do not overlap; tie = they do), "
           "averaged over rate scales:", "",
           "| SLO | baseline | TBT att | TPOT att | P95 TBT | P99 TBT | E2E | req/min |",
           "|---|---|---|---|---|---|---|---|"]
    for slo in SLO_SCALES:
        for b in BASELINES:
            vs = [verdict(res.cell(m, "orbitflow", slo, rates), res.cell(m, b, slo, rates), m)
                  for m in ("tbt_attainment", "tpot_attainment", "p95_tbt_s", "p99_tbt_s", "e2e_mean_s",
                            "throughput_rpm")]
            md.append(f"| {slo:g} | {LABEL[b]} | " + " | ".join(vs) + " |")
    md += ["", "![TBT and TPOT attainment](results/attainment_grid.png)", "",
           "![P95 TBT](results/p95_tbt.png) ![E2E latency](results/e2e_latency.png)", "",
           "![P99, throughput, memory](results/tail_throughput_memory.png)", ""]
    # sensitivity
    md += ["## Device budget, link rate and prefetch depth", "",
           f"SLO scale {SENS_SLO:g}, rate scale {SENS_RATE:g}; TBT attainment (mean ± 95% CI over seeds). "
           f"The base SLO follows the budget (the no-offload step with that budget full).", "",
           "| policy | budget 0.23 | budget 0.5 | budget 0.75 | " + " | ".join(
               f"link {link or profile.link_bytes_per_s / 1e9:g} GB/s" for link, _ in LINKS)
           + " | depth 1 | depth 2 |", "|" + "---|" * 9]
    panels_budget, panels_link, panels_depth = {}, {}, {}
    for p in POLICIES:
        bud = [res.cell("tbt_attainment", p, SENS_SLO, [SENS_RATE], fraction=None if f == 0.5 else f) for f in BUDGETS]
        lnk = [res.cell("tbt_attainment", p, SENS_SLO, [SENS_RATE], link=link) for link, _ in LINKS]
        own = 2 if p == "deepspeed" else 1
        d1 = res.cell("tbt_attainment", p, SENS_SLO, [SENS_RATE], slots="policy" if own == 1 else 1)
        d2 = res.cell("tbt_attainment", p, SENS_SLO, [SENS_RATE], slots="policy" if own == 2 else 2)
        md.append(f"| {LABEL[p]} | " + " | ".join(fmt(c) for c in (*bud, *lnk, d1, d2)) + " |")
        panels_budget[LABEL[p]] = [(c["mean"], c["ci95"]) for c in bud]
        panels_link[LABEL[p]] = [(c["mean"], c["ci95"]) for c in lnk]
        panels_depth[LABEL[p]] = [(c["mean"], c["ci95"]) for c in (d1, d2)]
    md += ["", "Link rates and their sources:", ""] + [f"- {src}" for _, src in LINKS] + [""]
    md += ["Full metrics at the other budgets and link rates:", ""]
    for f in (0.23, 0.75):
        md += [f"**Budget {f:g}** ({round(f * largest)} layer-blocks), SLO {SENS_SLO:g}, rate {SENS_RATE:g}", ""]
        md += policy_table(res, SENS_SLO, [SENS_RATE], fraction=f) + [""]
    for link, _ in LINKS[1:]:
        md += [f"**Link {link:g} GB/s**, budget 0.5, SLO {SENS_SLO:g}, rate {SENS_RATE:g}", ""]
        md += policy_table(res, SENS_SLO, [SENS_RATE], link=link) + [""]
    fig = plot_ci_bars([("device budget (x largest batch)", [f"{f:g}" for f in BUDGETS], panels_budget),
                        ("link rate (GB/s)", [f"{link or profile.link_bytes_per_s / 1e9:g}" for link, _ in LINKS],
                         panels_link),
                        ("prefetch depth", ["1", "2"], panels_depth)], "TBT attainment (%)", 100.0)
    fig.savefig(out_dir / "sensitivity.png", dpi=120)
    md += ["![budget, link, depth](results/sensitivity.png)", ""]
    # ablation and deposit
    md += ["## Ablation (paper Fig. 13a) and Token-Deposit (Fig. 13b)", "",
           f"TBT attainment at SLO scale {SENS_SLO:g}, rate {SENS_RATE:g}; the first three steps run without "
           f"Token-Deposit, the last is OrbitFlow with it.", "", "| step | TBT att | TPOT att | paper (SLO 1) |",
           "|---|---|---|---|"]
    paper_abl = {"batch-uniform": "45.1%", "+request-wise": "54.5%", "+pause-resume": "71.0%", "orbitflow": "85.6%"}
    for step in (*ABLATION_STEPS, "orbitflow"):
        dep = step == "orbitflow"
        md.append(f"| {'+Token-Deposit (= OrbitFlow)' if dep else LABEL.get(step, step)} | "
                  f"{fmt(res.cell('tbt_attainment', step, SENS_SLO, [SENS_RATE], deposit=dep))} | "
                  f"{fmt(res.cell('tpot_attainment', step, SENS_SLO, [SENS_RATE], deposit=dep))} | {paper_abl[step]} |")
    md += ["", "Token-Deposit on every policy (rate scale 3; TBT attainment with / without it):", "",
           "| policy | SLO 1 with | SLO 1 without | SLO 2.5 with | SLO 2.5 without |", "|---|---|---|---|---|"]
    for p in POLICIES:
        cells = [fmt(res.cell("tbt_attainment", p, s, [SENS_RATE], deposit=d))
                 for s in (1.0, 2.5) for d in (True, False)]
        md.append(f"| {LABEL[p]} | " + " | ".join(cells) + " |")
    md += ["", "![ablation](results/ablation.png) ![Token-Deposit with and without, paired runs]"
           "(results/token_deposit.png)", ""]
    md += victims_md(res)
    claims = reproduction(res, rates)
    return md, claims


def victims_md(res: Results) -> list[str]:
    """Paper Fig. 13c: OrbitFlow with each pause-victim rule; a rule is called better or worse only where the intervals
    do not overlap."""
    rules = ["orbitflow", *VICTIM_RULES]
    md = ["## Pause victims (paper Fig. 13c)", "",
          f"OrbitFlow with each pause-victim rule, SLO scale {SENS_SLO:g}, rate scale {SENS_RATE:g}, with "
          f"Token-Deposit (OrbitFlow's own rule is the paper's: the most KV blocks plus deposited tokens; of equals, "
          f"the one admitted or resumed last).", ""]
    md += policy_table(res, SENS_SLO, [SENS_RATE], policies=rules) + [""]
    calls = []
    for rule in VICTIM_RULES:
        for metric, name in (("tbt_attainment", "TBT attainment"), ("tpot_attainment", "TPOT attainment"),
                             ("e2e_mean_s", "mean E2E"), ("num_pauses", "pauses")):
            ours, theirs = (res.cell(metric, p, SENS_SLO, [SENS_RATE]) for p in ("orbitflow", rule))
            key = "e2e_mean_s" if metric == "num_pauses" else metric  # fewer pauses is better, as a shorter E2E
            call = verdict(ours, theirs, key)
            if call != "tie":
                words = ("fewer", "more") if metric == "num_pauses" else ("better", "worse")
                calls.append(f"{name}: OrbitFlow's rule {words[call != 'win']} than the rule that would "
                             f"{LABEL[rule].split(', ', 1)[1]}")
    md += [("Where the intervals do not overlap: " + "; ".join(calls) + ".") if calls else
           "The intervals overlap on TBT and TPOT attainment, mean E2E and pauses for every rule: no rule is called "
           "better here.", ""]
    return md


def _order_of_baselines(res: Results, rates) -> str:
    """Which baseline the data call best at SLO scale 1 (TBT attainment), by the page's own rule."""
    cells = {b: res.cell("tbt_attainment", b, 1.0, rates) for b in BASELINES}
    best = [b for b in BASELINES if all(b == o or better(cells[b], cells[o], "tbt_attainment") for o in BASELINES)]
    # Why Dynamic need not lead here: its greedy (policies/dynamic.py) takes layers from the largest request first
    why_not_dynamic = ("; Dynamic's greedy offloads the largest request's layers first (the fewest layers moved), so "
                       "one request carries the batch's whole offload and every transfer lands on its layers, where a "
                       "uniform count spreads the same blocks over the batch")
    if best:
        return (f"{LABEL[best[0]]} is the best baseline here with intervals clear of the others'"
                + ("; the paper's is Dynamic Heuristic (section 5.2)" + why_not_dynamic if best[0] != "dynamic"
                   else ", as in the paper"))
    top = max(BASELINES, key=lambda b: cells[b]["mean"] if cells[b]["mean"] is not None else -1)
    tied = [LABEL[b] for b in BASELINES if b != top and not better(cells[top], cells[b], "tbt_attainment")]
    return (f"the best baseline by its mean is {LABEL[top]}, but its interval overlaps {', '.join(tied)}'s, so the "
            f"data do not order the best baselines (the paper's best is Dynamic Heuristic, section 5.2)"
            + (why_not_dynamic if top != "dynamic" else ""))


def _request_wise_vs_uniform(res: Results) -> str:
    a, b = (res.cell("tbt_attainment", s, SENS_SLO, [SENS_RATE], deposit=False)
            for s in ("+request-wise", "batch-uniform"))
    if better(a, b, "tbt_attainment"):
        return ("request-wise placement beats Batch-Uniform with intervals clear of each other, but by less than "
                "Pause-Resume")
    return "request-wise placement adds nothing over Batch-Uniform that the intervals can tell: they overlap"


def reproduction(res: Results, rates) -> dict:
    """Every number the paper's evaluation states that this simulator can produce: (paper, ours, note)."""
    rows = []

    def add(what, paper, ours: dict, unit=""):
        rows.append((what, paper, ours, unit))

    def best_baseline(metric, slo, higher=True):
        cells = {b: res.cell(metric, b, slo, rates) for b in BASELINES}
        pick = max if higher else min
        missing = -1e9 if higher else 1e9
        return pick(cells, key=lambda b: cells[b]["mean"] if cells[b]["mean"] is not None else missing)

    for metric, paper in (("tbt_attainment", 0.66), ("tpot_attainment", 0.62)):
        b = best_baseline(metric, 1.0)
        ours = ratio_of_means(res.per_seed(metric, "orbitflow", 1.0, rates), res.per_seed(metric, b, 1.0, rates), 1)
        name = metric.split("_")[0].upper()
        add(f"{name} attainment gain over the best baseline ({LABEL[b]}), SLO 1", paper, ours, "%")
    for b, paper in (("flexgen", -0.217), ("deepspeed", -0.686)):  # the paper: "at an SLO scale of 1"
        o, t = res.per_seed("p95_tbt_s", "orbitflow", 1.0, rates), res.per_seed("p95_tbt_s", b, 1.0, rates)
        add(f"P95 TBT vs {LABEL[b]}, SLO 1", paper, ratio_of_means(o, t, 1), "%")
    for metric, paper in (("p99_tbt_s", -0.65), ("p99_tpot_s", -0.64)):
        o, t = res.per_seed(metric, "orbitflow", 1.5, rates), res.per_seed(metric, "deepspeed", 1.5, rates)
        add(f"{metric[:3].upper()} {metric[4:-2].upper()} vs DeepSpeed, SLO 1.5", paper, ratio_of_means(o, t, 1), "%")
    for b in ("flexgen", "flexgen+", "slo-aware", "dynamic"):
        o, t = res.per_seed("p99_tbt_s", "orbitflow", 1.5, rates), res.per_seed("p99_tbt_s", b, 1.5, rates)
        add(f"P99 TBT vs {LABEL[b]}, SLO 1.5 (paper: 3-9% lower)", -0.06, ratio_of_means(o, t, 1), "%")
    for b in ADAPTIVE:
        o, t = res.per_seed("e2e_mean_s", "orbitflow", 1.5, rates), res.per_seed("e2e_mean_s", b, 1.5, rates)
        add(f"E2E latency vs {LABEL[b]}, SLO 1.5 (paper: 12-21% higher)", 0.165, ratio_of_means(o, t, 1), "%")
    o = res.per_seed("throughput_rpm", "orbitflow", 1.5, rates)
    t = res.per_seed("throughput_rpm", "deepspeed", 1.5, rates)
    add("Throughput vs DeepSpeed, SLO 1.5", 3.3, ratio_of_means(o, t), "x")
    for b in ("flexgen", "flexgen+", "slo-aware", "dynamic"):
        t = res.per_seed("throughput_rpm", b, 1.5, rates)
        add(f"Throughput vs {LABEL[b]}, SLO 1.5 (paper: 4-52% higher)", 0.28, ratio_of_means(o, t, 1), "%")
    add("OrbitFlow TBT attainment, SLO 1, highest rate (paper: over 75%)", 0.75,
        res.cell("tbt_attainment", "orbitflow", 1.0, [max(rates)]))
    # the paper's sentence is about "most baselines except DeepSpeed": each is a row of its own (their mean hid a
    # FlexGen near 0 behind three adaptive baselines above 50%)
    for b in ("flexgen", "flexgen+", "slo-aware", "dynamic"):
        add(f"{LABEL[b]} TBT attainment, SLO 2.5, highest rate (paper: baselines but DeepSpeed around 50%)", 0.5,
            res.cell("tbt_attainment", b, 2.5, [max(rates)]))
    for step, paper in (("batch-uniform", 0.451), ("+request-wise", 0.545), ("+pause-resume", 0.71)):
        add(f"Ablation {LABEL[step]}, SLO 1 (rate {SENS_RATE:g})", paper,
            res.cell("tbt_attainment", step, SENS_SLO, [SENS_RATE], deposit=False))
    add(f"Ablation +Token-Deposit (= OrbitFlow), SLO 1 (rate {SENS_RATE:g})", 0.856,
        res.cell("tbt_attainment", "orbitflow", SENS_SLO, [SENS_RATE]))
    for p, paper in (("flexgen+", 0.18), ("dynamic", 0.11), ("orbitflow", 0.05)):
        on = res.per_seed("tbt_attainment", p, 2.5, [SENS_RATE])
        off = res.per_seed("tbt_attainment", p, 2.5, [SENS_RATE], deposit=False)
        add(f"Token-Deposit gain for {LABEL[p]}, SLO 2.5 (rate {SENS_RATE:g})", paper, ratio_of_means(on, off, 1), "%")
    share = {}
    for r in res.select("orbitflow", slo=1.5):
        if r["rate_scale"] in rates and r.get("makespan_s"):
            share.setdefault(r["seed"], []).append((r.get("solver_charged_s") or r.get("solver_time_s") or 0)
                                                   / r["makespan_s"])
    add("Planner share of serving time, SLO 1.5 (paper: 0.02%)", 0.0002, mean_ci95(np.mean(v) for v in share.values()),
        "%")
    # the sentences of explain() that depend on the results
    facts = {"order": _order_of_baselines(res, rates), "request_wise": _request_wise_vs_uniform(res)}
    return {"rows": rows, "facts": facts}


NOTES = {
    # one line per claim whose ratio is off by more than 25% (see docs/results.md; written against the full run)
}


def reproduction_md(claims: dict) -> list[str]:
    md = ["## Reproduction of the paper's numbers", "",
          "Every number the paper's evaluation states (section 5.2-5.4) that the simulator can produce, under the "
          "paper's setup above (mean ± 95% CI over seeds, averaged over rate scales unless noted). Ratio = ours / "
          "paper's; a ratio of two policies is the ratio of their means over the seeds, its interval by the delta "
          "method. Differences above 25% whose interval excludes the paper's number are explained below the table; "
          "a row whose interval holds it is consistent with the paper, however far its mean.", "",
          "| claim | paper | ours | ratio |", "|---|---|---|---|"]
    off: list[tuple[str, float]] = []  # (claim, ours over the paper's)
    for what, paper, ours, unit in claims["rows"]:
        if ours.get("mean") is None:
            md.append(f"| {what} | {paper} | - | - |")
            continue
        scale, spec = (100.0, ".1f") if unit == "%" or (unit == "" and abs(paper) <= 1) else (1.0, ".2f")
        suffix = "%" if scale == 100.0 else ("x" if unit == "x" else "")
        if scale == 100.0 and abs(ours["mean"] * scale) < 1:  # else 0.056% reads as 0.1%, a ratio of 5 to the eye
            spec = ".2f"
        if unit == "%":
            p_txt = f"{paper * scale:+.3g}%"
        else:
            p_txt = f"{paper * scale:.1f}%" if scale == 100 else f"{paper:g}x"
        o_txt = f"{format(ours['mean'] * scale, spec)} ± {format(ours['ci95'] * scale, spec)}{suffix}"
        ratio = ours["mean"] / paper if paper else float("nan")
        md.append(f"| {what} | {p_txt} | {o_txt} | {ratio:.2f} |")
        held = abs(ours["mean"] - paper) <= (ours["ci95"] or 0.0)
        if not 0.75 <= ratio <= 1.25 and not held:
            off.append((what, ratio))
    md += [""]
    if off:
        md += ["Differences above 25%, grouped by reason:", ""]
        reasons: dict[str, list[str]] = {}
        for what, ratio in off:
            reasons.setdefault(explain(what, claims["facts"], ratio), []).append(what)
        for why, whats in reasons.items():
            md.append(f"- {'; '.join(whats)}: {why}")
        md += [""]
    return md


def explain(what: str, facts: dict[str, str], ratio: float = float("nan")) -> str:
    """The reason behind a difference, by claim family; ``facts``: the sentences that depend on the results;
    ``ratio``: ours over the paper's (a family whose reason depends on the direction reads it)."""
    w = what.lower()
    if "gain over the best baseline" in w:
        return ("at SLO scale 1 the SLO is the step of a batch whose KV just fills the device budget, so any batch "
                "that must offload misses it on compute alone, whatever the link or the placement: attainment there "
                "comes from keeping the batch within the budget, which only Pause-Resume does, and the baselines "
                f"lose more than the paper's; {facts['order']}.")
    if "over 75%" in w:
        return "the paper states a lower bound ('over 75%'), which ours meets."
    if "p95" in w or "p99" in w:
        return ("the baselines never pause, so whenever two long requests share the batch they stream KV over the "
                "link on every step (steps of 0.4-1 s against a 65-163 ms SLO), while OrbitFlow sets a long request "
                "aside and Token-Deposit paces the others at the SLO; a paused request's own gaps are long but few, "
                "beyond the P95 and P99 of all gaps (TPOT attainment shows them). The paper's baselines stall far less "
                "often, so its tail gaps are smaller than ours: 3-9% to the adaptive baselines at P99, 21.7% to "
                "FlexGen and 68.6% to DeepSpeed at P95.")
    if "e2e" in w:
        return ("Pause-Resume defers long requests, which costs E2E, but the baselines' steps are so slow under "
                "this budget and link that their requests take longer overall, so the sign can flip against "
                "the paper's.")
    if "throughput" in w:
        return ("throughput over the makespan follows from how much slower the baselines' steps are here "
                "(see the P95 rows); the direction matches the paper's.")
    if "ablation" in w:
        return (f"in this simulator Pause-Resume carries most of the gain ({facts['request_wise']}): at SLO "
                "scale 1 a batch that must offload misses the SLO on compute alone, so no placement rescues it, and "
                "only setting a request aside does.")
    if "token-deposit" in w and ratio > 1:
        return ("a policy without Pause-Resume whose steps straddle the SLO (compare its TBT attainment with and "
                "without Token-Deposit above: the tokens generated late are many, the gaps short) banks on its fast "
                "steps what its slow ones spend, so the gain is larger than the paper's.")
    if "token-deposit" in w:
        return ("Token-Deposit only hides gaps shorter than the deposit; with Pause-Resume OrbitFlow's generated "
                "stream already meets the SLO on most tokens, and the misses left are long single gaps (a 12K-token "
                "prefill), so the gain is smaller than the paper's.")
    if "planner share" in w:
        return ("the planner's measured wall time on a 2-core machine (compiled branch and bound, one thread) is "
                "charged in full, where the paper's Gurobi runs on a server CPU; it scales with that machine's speed "
                "(runs reused from the cache may come from machines of different speeds: see the line on which code "
                "made this section), and stays well under one percent of serving time.")
    if w.startswith("flexgen tbt") and "around 50%" in w:
        return ("FlexGen's fixed placement streams the same share of every request's KV on every step, whatever the "
                "load: under this budget and link its steps miss even the relaxed SLO at every rate (see the headline "
                "tables), so it never shows the paper's 'stable at lower rates, then about 50%'; the adaptive "
                "baselines do. Absolute attainments also depend on the length mix, which stands in for the paper's "
                "ShareGPT-derived one.")
    if "highest rate" in w or "around 50%" in w:
        return "absolute attainments depend on the length mix, which stands in for the paper's ShareGPT-derived one."
    return "see the sections above."


def losses_md(res: Results, rates) -> list[str]:
    """Every setting where OrbitFlow is not better than some baseline with non-overlapping intervals."""
    metrics = (("tbt_attainment", "TBT attainment"), ("tpot_attainment", "TPOT attainment"), ("p95_tbt_s", "P95 TBT"),
               ("p99_tbt_s", "P99 TBT"), ("e2e_mean_s", "E2E latency"), ("ttft_mean_s", "TTFT"),
               ("throughput_rpm", "throughput"), ("tokens_per_s", "tokens/s"))
    settings = [(f"SLO {s:g}, rate {r:g}", dict(slo=s, rates=[r]), {}) for s in SLO_SCALES for r in rates]
    settings += [(f"budget {f:g}, SLO {SENS_SLO:g}, rate {SENS_RATE:g}", dict(slo=SENS_SLO, rates=[SENS_RATE]),
                  {"fraction": f}) for f in (0.23, 0.75)]
    settings += [(f"link {link:g} GB/s, SLO {SENS_SLO:g}, rate {SENS_RATE:g}", dict(slo=SENS_SLO, rates=[SENS_RATE]),
                  {"link": link}) for link, _ in LINKS[1:]]
    loss, tie = [], {}
    for name, where, kw in settings:
        for m, label in metrics:
            ours = res.cell(m, "orbitflow", where["slo"], where["rates"], **kw)
            for b in BASELINES:
                theirs = res.cell(m, b, where["slo"], where["rates"], **kw)
                v = verdict(ours, theirs, m)
                if v == "LOSS":
                    loss.append(f"- {name}: **{label}** — {LABEL[b]} {fmt(theirs, '.3g')} vs OrbitFlow "
                                f"{fmt(ours, '.3g')}")
                elif v == "tie":
                    tie.setdefault(label, []).append(f"{LABEL[b]} ({name})")
    md = ["## Where OrbitFlow does not win", "",
          "Every setting and metric above where some baseline is better than OrbitFlow with non-overlapping 95% "
          "intervals (a loss), then where the intervals overlap (no claim either way).", ""]
    md += loss or ["- No loss with non-overlapping intervals."]
    md += ["", "No significant difference (intervals overlap):", ""]
    md += [f"- {label}: " + ", ".join(items) for label, items in tie.items()] or ["- none"]
    return md + [""]


# ----------------------------------------------------------------------------- driver
def run_sim(args, profile, out_dir: Path) -> tuple[list[str], dict]:
    from tqdm import tqdm

    setup = PAPER_SETUP
    rates = RATE_SCALES
    if args.reduced:
        setup = replace(setup, num_requests=args.reduced_requests)
        rates = tuple(float(x) for x in args.reduced_rates.split(","))
    if args.seeds is not None:  # smoke tests only: the page is then labelled reduced
        setup = replace(setup, seeds=args.seeds)
    studies = sim_points(rates)
    points = list(dict.fromkeys(p for pts in studies.values() for p in pts))
    cache_path = out_dir / "sim_runs.jsonl"
    done: dict = {}
    made_by: dict[str, set[str]] = {}  # commit -> the runs it made that were reused (each cached run records its own)
    code = code_version()
    other_code = 0  # cached runs of this setup made by other code: re-run, or reused under --resume-any-code
    if args.resume and cache_path.exists():
        mine, other = cached_runs(cache_path, code)
        by_key = {**other, **mine} if args.resume_any_code else mine
        for p in points:
            for s in range(setup.first_seed, setup.first_seed + setup.seeds):
                k = _key(p, s, setup)
                other_code += k in other and k not in mine
                if k in by_key:
                    done[(p, s)] = by_key[k]["metrics"]
                    what = p.policy if p.token_deposit else f"{p.policy} without Token-Deposit"
                    made_by.setdefault(by_key[k].get("commit", "unknown"), set()).add(what)
        if other_code and not args.resume_any_code:
            print(f"[make_results] --resume: {other_code} cached run(s) were made by other code than this checkout's "
                  f"(another commit or uncommitted edits under src/orbitflow); running them again "
                  f"(--resume-any-code reuses them)", file=sys.stderr)
    elif cache_path.exists():
        cache_path.unlink()
    reused = len(done)
    total = len(points) * setup.seeds
    seeds = range(setup.first_seed, setup.first_seed + setup.seeds)
    bar = tqdm(total=total, initial=len(done), desc="simulate", unit="run")
    commit, dirty = _commit(), _src_edited()  # at the start: the code the runs ran
    with cache_path.open("a") as cache:
        def on_result(p, s, metrics):
            cache.write(json.dumps({"key": _key(p, s, setup), "metrics": metrics, "commit": commit, "code": code})
                        + "\n")
            cache.flush()

        # the points a --reduced page needs first, so that an interrupted run can still be assembled from the cache
        first = [p for p in points if p.rate_scale != 3.0 or p not in studies["headline"] or p.slo_scale == SENS_SLO]
        runs = run_points(profile, setup, points, workers=args.workers, done=done, on_result=on_result,
                          progress=lambda *_: bar.update(1), first=first)
    bar.close()
    # One pool runs every point, forked with the simulator loaded, so edits made while the sweep runs should not reach
    # it; a module imported later from disk still could, and a page from two versions of the code must say so.
    changed = code_version() != code
    if changed:
        print("[make_results] WARNING: src/orbitflow changed while the runs ran; a module the workers imported late "
              "may have been the edited one (run again without editing src/orbitflow; --resume keeps the runs of this "
              "code)", file=sys.stderr)
    keyed = [(p, s) for p in points for s in seeds]
    for (p, _), r in zip(keyed, runs):
        r["_point"] = asdict(p)
    res = Results(runs, setup)
    md, claims = sim_section(res, profile, setup, rates, args.reduced, out_dir)
    headline = [r for r in runs if r["_point"]["device_kv_fraction"] is None and r["_point"]["link_gbps"] is None
                and r["_point"]["prefetch_slots"] is None and r["policy"] not in VICTIM_RULES]
    plot_runs = with_no_deposit(headline)
    # the ablation steps run without Token-Deposit: plot them under that key (Fig. 13a)
    plot_runs += [r | {"tbt_attainment_no_deposit": r["tbt_attainment"]} for r in runs
                  if r["policy"] in ABLATION_STEPS]
    write_plots(plot_runs, out_dir)
    summary = summarize(runs)
    for row in summary:
        row["study"] = [name for name, pts in studies.items()
                        if any(p.label() == row["label"] for p in pts)]
    cfg = config_record(profile, setup, points)
    cfg["rate_scales"] = list(rates)
    cfg["reduced"] = bool(args.reduced)
    with (out_dir / "a5000.json").open("w") as fh:
        json.dump({"config": cfg, "summary": summary,
                   "runs": [{k: v for k, v in r.items() if k != "_point"} | {"point": r["_point"]} for r in runs]},
                  fh, indent=None)
    info = {"runs": len(runs), "points": len(points), "reused": reused,
            "reused_other_code": other_code if args.resume_any_code else 0, "dirty": dirty,
            "changed_while_running": changed,
            "made_by": {c: sorted(w) for c, w in sorted(made_by.items())},
            "run_s": sum(r.get("wall_s") or 0.0 for r in runs), "commit": commit}
    return md + reproduction_md(claims) + losses_md(res, rates), info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="sim",
                    help=f"comma list of sim, {', '.join(OTHER_STAGES)}, or 'all'; "
                         "'none' re-assembles the page from the fragments already in docs/results/ (the simulator "
                         "section included, with the line saying which commit made it)")
    ap.add_argument("--reduced", action="store_true",
                    help="rate scales 1 and 5 only and fewer requests per run (still 5 seeds); labelled in the page")
    ap.add_argument("--reduced-requests", type=int, default=64, help="requests per run under --reduced")
    ap.add_argument("--reduced-rates", default="1,5", help="rate scales of the headline grid under --reduced")
    ap.add_argument("--seeds", type=int, default=None, help=argparse.SUPPRESS)  # smoke tests of this script
    ap.add_argument("--resume", action="store_true",
                    help="reuse cached runs of an interrupted regeneration (docs/results/sim_runs.jsonl), those made "
                         "by this checkout's code only")
    ap.add_argument("--resume-any-code", action="store_true",
                    help="with --resume: also reuse cached runs made by other code (another commit, other edits); the "
                         "page names the commits that made them")
    ap.add_argument("--workers", type=int, default=None, help="simulator worker processes (default: one per core)")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help="docs directory")
    ap.add_argument("--shared", action="store_true", help="say in the page that the machine was shared (timing)")
    args = ap.parse_args()
    args.reduced = args.reduced or args.seeds is not None
    if args.resume_any_code and not args.resume:
        ap.error("--resume-any-code goes with --resume (it says which cached runs --resume may reuse)")
    stages = (["sim", *OTHER_STAGES] if args.stages == "all" else [] if args.stages == "none"
              else [s.strip() for s in args.stages.split(",") if s])
    bad = [s for s in stages if s != "sim" and s not in OTHER_STAGES]
    if bad:
        ap.error(f"--stages: unknown {', '.join(bad)} (choose from sim, {', '.join(OTHER_STAGES)}, all)")
    docs = Path(args.docs)
    out_dir = docs / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for stage in stages:
        if stage in OTHER_STAGES:
            print(f"[make_results] stage {stage}: {' '.join(OTHER_STAGES[stage])}", file=sys.stderr)
            subprocess.run([sys.executable, *OTHER_STAGES[stage]], cwd=ROOT, check=True)
    profile = load_preset(PRESET)
    sim_md: list[str] = []
    info = {}
    if "sim" in stages:
        sim_md, info = run_sim(args, profile, out_dir)
        sim_md = [_provenance(info, time.perf_counter() - start), ""] + sim_md
        (out_dir / "simulator.md").write_text("\n".join(sim_md) + "\n")
    elif (out_dir / "simulator.md").exists():
        sim_md = (out_dir / "simulator.md").read_text().splitlines()
    elapsed = time.perf_counter() - start
    cmd = "python benchmarks/make_results.py" + ("" if args.stages == "sim" else f" --stages {args.stages}")
    if args.resume and "sim" in stages:  # without it the runs are all made again, at this commit
        cmd += " --resume" + (" --resume-any-code" if args.resume_any_code else "")
    if args.reduced:
        cmd += f" --reduced --reduced-requests {args.reduced_requests} --reduced-rates {args.reduced_rates}"
    if set(stages) >= {"sim", *OTHER_STAGES}:
        made = "Everything on this page, tables, `docs/results/a5000.json` and the plots, comes from one command:"
    elif "sim" in stages:
        made = ("The command below re-ran the simulator section (its tables, `docs/results/a5000.json` and the plots) "
                "and re-assembled this page; the other sections come from the runs they name (`--stages all` "
                "re-runs them too):")
    elif stages:
        made = (f"The command below re-ran the {', '.join(stages)} benchmark{'s' if len(stages) > 1 else ''} and "
                "re-assembled this page; the other sections come from the runs they name, and "
                "`python benchmarks/make_results.py` re-runs the simulator section:")
    else:
        made = ("This page was re-assembled from the fragments in `docs/results/` by the command below (nothing "
                "re-run; each section says which run made it); `python benchmarks/make_results.py` re-runs the "
                "simulator section:")
    page = ["# Results: the paper's evaluation on the simulator, and the project's benchmarks", "",
            made, "", "```bash", cmd, "```", "",
            f"Last regenerated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in "
            f"{elapsed / 60:.1f} min on {platform.machine()} ({_cpus()} cores"
            f"{', shared with other jobs' if args.shared else ''})"
            + (f": {info['runs']} simulator runs ({info['points']} points x seeds)" if info else "")
            + (f", {info['reused']} of them reused from the cache of an earlier invocation (`--resume`), so the "
               f"time above is this invocation's only" if info.get("reused") else "") + ". "
            f"`--stages all` also re-runs the benchmarks whose fragments (`docs/results/<name>.md`) are included below "
            f"({', '.join(OTHER_STAGES)}); the other sections (GPU, the planner beside the engine) come from "
            f"the runs they name; `--resume` continues an interrupted run from "
            "`docs/results/sim_runs.jsonl`. `orbitflow simulate` with no flags runs the headline grid alone.", ""]
    page += sim_md
    for name, title in FRAGMENTS:
        path = out_dir / f"{name}.md"
        if name == "victims" and "## Pause victims" in "\n".join(sim_md):
            path.unlink(missing_ok=True)  # the simulator section has its own now; the older fragment is gone for good
            continue
        if path.exists():
            text = path.read_text().strip()
            if not text.startswith("## "):  # a fragment that opens with a subsection still gets its title
                text = f"## {title}\n\n{text}"
            page += [text, ""]
    (docs / "results.md").write_text("\n".join(page).rstrip() + "\n")
    print(f"wrote {docs / 'results.md'} in {elapsed / 60:.1f} min", file=sys.stderr)


def _provenance(info: dict, elapsed_s: float) -> str:
    """The simulator section's first line: which code made it, so a page re-assembled later (`--stages none`)
    still says so."""
    reused = info.get("reused", 0)
    # the commit the runs started at (a commit made while they ran is not the code that ran)
    other = info.get("reused_other_code", 0)
    return (f"> **Which code made the simulator section.** `python benchmarks/make_results.py` at commit "
            f"{info.get('commit') or _commit()}"
            + (" with uncommitted edits under src/orbitflow" if info.get("dirty") else "")
            + f", {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {info.get('runs', '?')} runs in "
            f"{elapsed_s / 60:.1f} min"
            + (f"; {reused} of them reused from `docs/results/sim_runs.jsonl` (`--resume`) as the code at these "
               f"commits ran them: {_made_by(info.get('made_by'))}" if reused else "")
            + (f" ({other} of them by code other than this checkout's, `--resume-any-code`)" if other else "")
            + ("; **src/orbitflow was edited while the runs ran**, so some may have run the edited code"
               if info.get("changed_while_running") else "")
            + ".")


def _made_by(made_by: dict[str, list[str]] | None) -> str:
    """Which commit made which policies' reused runs, e.g. ``3318b2c (orbitflow, dynamic); 4200a1f (flexgen)``."""
    if not made_by:
        return "unknown"
    return "; ".join(f"{commit} ({', '.join(what)})" for commit, what in made_by.items())


def _commit() -> str:
    """This checkout's short commit hash ("unknown" outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _src_edited() -> bool:
    """Whether src/orbitflow differs from the commit checked out (then the commit alone does not name the code)."""
    try:
        return bool(subprocess.run(["git", "status", "--porcelain", "--", "src/orbitflow"], cwd=ROOT,
                                   capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return False


def _cpus() -> int:
    import os

    return os.cpu_count() or 1


if __name__ == "__main__":
    main()
