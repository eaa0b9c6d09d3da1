"""Plots mirroring the paper's evaluation figures, from a list of run dicts.

A run dict carries ``policy``, ``slo_scale``, ``rate_scale`` and metric keys (``tbt_attainment``,
``tpot_attainment``, ``tbt_attainment_no_deposit``, ``p95_tbt_s``, ``p99_tbt_s``, ``p95_tpot_s``,
``p99_tpot_s``, ``throughput_rpm``, ``tokens_per_s``, ``e2e_mean_s``, ``device_mem_util``, ``solver_calls``,
``solver_time_s``) and ``seed``. Every bar and point is the mean over seeds with its 95% Student-t interval
(`orbitflow.bench.metrics.mean_ci95`), as DESIGN asks of every figure; where several runs of one seed share a bar
(the rate scales of a (policy, slo_scale) bar), that seed's value is their mean. Runs without a ``seed`` count one
sample each. The headline figures leave the ablation's steps out (they run without Token-Deposit); the Token-Deposit
figure compares only runs that have a paired no-deposit run (same point and seed), both bars over the same runs.
Figures whose metrics are absent are skipped. Figures are built without pyplot (no global state, no GUI backend), so
plotting is safe inside a server process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from orbitflow.bench.metrics import mean_ci95

Run = dict[str, Any]

# Ablation steps in the paper's order (Fig. 14a); names compared after normalisation.
ABLATION_ORDER = ("batch-uniform", "request-wise", "pause-resume", "token-deposit", "orbitflow")
DEFAULT_SLO_SCALE = 1.5  # the paper's mid-level SLO for single-setting figures


def normalise_policy(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-").lstrip("+")


def _value(run: Run, key: str) -> float:
    v = run.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan


def _has(runs: Sequence[Run], key: str) -> bool:
    return any(not math.isnan(_value(r, key)) for r in runs)


def _policies(runs: Sequence[Run]) -> list[str]:
    return list(dict.fromkeys(str(r["policy"]) for r in runs))


def _sorted_values(runs: Sequence[Run], key: str) -> list[float]:
    return sorted({float(r[key]) for r in runs if r.get(key) is not None})


Cell = tuple[float, float]  # (mean, 95% CI half-width); (nan, 0) where no run has the metric


def mean_over_seeds(runs: Sequence[Run], key: str) -> Cell:
    """``key``'s mean over seeds and its 95% interval; a seed's value is the mean of its runs (over rate scales)."""
    by_seed: dict[Any, list[float]] = {}
    for i, r in enumerate(runs):
        v = _value(r, key)
        if not math.isnan(v):
            by_seed.setdefault(r.get("seed", ("run", i)), []).append(v)
    cell = mean_ci95(float(np.mean(v)) for v in by_seed.values())
    return (math.nan, 0.0) if cell["mean"] is None else (cell["mean"], cell["ci95"])


def headline_runs(runs: Sequence[Run]) -> list[Run]:
    """The runs of the policies as served: the ablation's steps (``batch-uniform`` .. ``+token-deposit``) left out."""
    return [r for r in runs if normalise_policy(str(r["policy"])) not in ABLATION_ORDER[:-1]]


def _pick_slo(runs: Sequence[Run]) -> float | None:
    scales = _sorted_values(runs, "slo_scale")
    if not scales:
        return None
    return min(scales, key=lambda s: abs(s - DEFAULT_SLO_SCALE))


def _at_slo(runs: Sequence[Run], slo: float | None) -> list[Run]:
    return [r for r in runs if slo is None or r.get("slo_scale") == slo]


def _grouped_bars(ax: Any, groups: Sequence[str], series: dict[str, list[Cell]], ylabel: str,
                  scale: float = 1.0) -> None:
    n = max(len(series), 1)
    width = 0.8 / n
    x = np.arange(len(groups))
    for i, (label, cells) in enumerate(series.items()):
        ax.bar(x + (i - (n - 1) / 2) * width, [c[0] * scale for c in cells], width,
               yerr=[c[1] * scale for c in cells], capsize=2, label=label)
    ax.set_xticks(x, groups)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


# ----------------------------------------------------------------------------- figures
def plot_attainment_grid(runs: Sequence[Run]) -> Figure:
    """Fig. 9a: rows TBT / TPOT attainment, columns SLO scales, x = rate scale, a line per policy (mean over seeds,
    95% interval as error bars)."""
    runs = headline_runs(runs)
    slos = _sorted_values(runs, "slo_scale") or [math.nan]
    rows = [("tbt_attainment", "TBT attainment"), ("tpot_attainment", "TPOT attainment")]
    fig = Figure(figsize=(3.6 * len(slos), 6))
    axes = fig.subplots(2, len(slos), squeeze=False, sharey=True)
    for col, slo in enumerate(slos):
        for row, (key, label) in enumerate(rows):
            ax = axes[row][col]
            for policy in _policies(runs):
                mine = [r for r in runs if r["policy"] == policy and (math.isnan(slo) or r.get("slo_scale") == slo)]
                rates = sorted({float(r.get("rate_scale", 1.0)) for r in mine})
                cells = [mean_over_seeds([r for r in mine if float(r.get("rate_scale", 1.0)) == x], key) for x in rates]
                if rates:
                    ax.errorbar(rates, [100 * c[0] for c in cells], yerr=[100 * c[1] for c in cells], marker="o",
                                capsize=2, label=policy)
            ax.set_ylim(0, 105)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"SLO scale {slo:g}")
            if row == 1:
                ax.set_xlabel("arrival rate scale")
            if col == 0:
                ax.set_ylabel(f"{label} (%)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 4) or 1, fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


def _bars_by_slo(runs: Sequence[Run], key: str, ylabel: str, title: str, scale: float = 1.0) -> Figure:
    runs = headline_runs(runs)
    slos = _sorted_values(runs, "slo_scale")
    series = {p: [mean_over_seeds([r for r in runs if r["policy"] == p and r.get("slo_scale") == s], key)
                  for s in slos]
              for p in _policies(runs)}
    fig = Figure(figsize=(max(5.0, 2.0 + 0.3 * len(slos) * max(len(series), 1)), 3.6))
    ax = fig.subplots()
    _grouped_bars(ax, [f"{s:g}" for s in slos], series, ylabel, scale)
    ax.set_xlabel("SLO scale")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_p95_tbt(runs: Sequence[Run]) -> Figure:
    """Fig. 9b: P95 TBT per policy across SLO scales."""
    return _bars_by_slo(runs, "p95_tbt_s", "P95 TBT (ms)", "P95 TBT latency", scale=1000.0)


def plot_e2e(runs: Sequence[Run]) -> Figure:
    """Fig. 9c: mean end-to-end latency per policy across SLO scales."""
    return _bars_by_slo(runs, "e2e_mean_s", "mean E2E latency (s)", "End-to-end latency")


def plot_tail_throughput_memory(runs: Sequence[Run]) -> Figure:
    """Fig. 10: P99 TBT, P99 TPOT, throughput and device memory utilisation at one SLO scale."""
    slo = _pick_slo(runs)
    sel = _at_slo(headline_runs(runs), slo)
    panels = [("p99_tbt_s", "P99 TBT (ms)", 1000.0), ("p99_tpot_s", "P99 TPOT (ms)", 1000.0),
              ("throughput_rpm", "throughput (req/min)", 1.0), ("device_mem_util", "device memory util (%)", 100.0)]
    panels = [p for p in panels if _has(sel, p[0])]
    policies = _policies(sel)
    fig = Figure(figsize=(3.4 * max(len(panels), 1), 3.6))
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)
    for ax, (key, label, scale) in zip(axes[0], panels):
        cells = [mean_over_seeds([r for r in sel if r["policy"] == p], key) for p in policies]
        ax.bar(range(len(policies)), [c[0] * scale for c in cells], yerr=[c[1] * scale for c in cells], capsize=2,
               color=[f"C{i}" for i in range(len(policies))])
        ax.set_xticks(range(len(policies)), policies, rotation=35, ha="right", fontsize="small")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    if slo is not None:
        fig.suptitle(f"SLO scale {slo:g}")
    fig.tight_layout()
    return fig


def deposit_pairs(runs: Sequence[Run]) -> list[Run]:
    """The runs with Token-Deposit that have their paired no-deposit run's attainment (``tbt_attainment_no_deposit``,
    `orbitflow.sim.sweep.with_no_deposit`): the only runs the with/without comparison may average, so both bars
    stand on the same points and seeds (the no-deposit runs may cover fewer rates than the headline grid)."""
    return [r for r in headline_runs(runs) if not math.isnan(_value(r, "tbt_attainment_no_deposit"))]


def plot_token_deposit(runs: Sequence[Run]) -> Figure:
    """Fig. 14b: TBT attainment with and without Token-Deposit, per policy and SLO scale, over paired runs."""
    runs = deposit_pairs(runs)
    slos = _sorted_values(runs, "slo_scale")
    policies = _policies(runs)
    fig = Figure(figsize=(3.8 * max(len(slos), 1), 3.6))
    axes = fig.subplots(1, max(len(slos), 1), squeeze=False, sharey=True)
    for ax, slo in zip(axes[0], slos):
        sub = [r for r in runs if r.get("slo_scale") == slo]
        series = {
            "without deposit": [mean_over_seeds([r for r in sub if r["policy"] == p], "tbt_attainment_no_deposit")
                                for p in policies],
            "with deposit": [mean_over_seeds([r for r in sub if r["policy"] == p], "tbt_attainment")
                             for p in policies],
        }
        _grouped_bars(ax, policies, series, "TBT attainment (%)", 100.0)
        ax.set_xticks(ax.get_xticks(), policies, rotation=30, ha="right", fontsize="small")
        ax.set_title(f"SLO scale {slo:g}")
        ax.set_ylim(0, 105)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    return fig


def ablation_runs(runs: Sequence[Run]) -> list[Run]:
    """Runs whose policy is a step of the ablation (``batch-uniform``, ``+request-wise``, ...)."""
    names = {normalise_policy(str(r["policy"])) for r in runs}
    if not names & set(ABLATION_ORDER[:-1]):
        return []
    return [r for r in runs if normalise_policy(str(r["policy"])) in ABLATION_ORDER]


def plot_ablation(runs: Sequence[Run]) -> Figure:
    """Fig. 14a: TBT attainment as components are added, per SLO scale."""
    sel = ablation_runs(runs)
    # OrbitFlow at the steps' points only: they may run at fewer rates and SLO scales than the headline grid
    steps_at = {(r.get("slo_scale"), r.get("rate_scale")) for r in sel
                if normalise_policy(str(r["policy"])) != ABLATION_ORDER[-1]}
    sel = [r for r in sel if (r.get("slo_scale"), r.get("rate_scale")) in steps_at]
    present = {normalise_policy(str(r["policy"])): str(r["policy"]) for r in sel}
    steps = [present[n] for n in ABLATION_ORDER if n in present]
    slos = _sorted_values(sel, "slo_scale")
    # The steps before "+token-deposit" are OrbitFlow without it: use their no-deposit runs when present.
    def key(policy: str) -> str:
        before = normalise_policy(policy) in ABLATION_ORDER[:3]
        return "tbt_attainment_no_deposit" if before and _has(sel, "tbt_attainment_no_deposit") else "tbt_attainment"

    series = {s: [mean_over_seeds([r for r in sel if r["policy"] == p and r.get("slo_scale") == s], key(p))
                  for p in steps] for s in slos}
    fig = Figure(figsize=(6.0, 3.6))
    ax = fig.subplots()
    _grouped_bars(ax, steps, {f"SLO scale {s:g}": v for s, v in series.items()}, "TBT attainment (%)", 100.0)
    ax.set_ylim(0, 105)
    ax.set_title("Impact of components")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


FIGURES: tuple[tuple[str, Callable[[Sequence[Run]], Figure], tuple[str, ...]], ...] = (
    ("attainment_grid", plot_attainment_grid, ("tbt_attainment", "tpot_attainment")),
    ("p95_tbt", plot_p95_tbt, ("p95_tbt_s",)),
    ("e2e_latency", plot_e2e, ("e2e_mean_s",)),
    ("tail_throughput_memory", plot_tail_throughput_memory,
     ("p99_tbt_s", "p99_tpot_s", "throughput_rpm", "device_mem_util")),
    ("token_deposit", plot_token_deposit, ("tbt_attainment_no_deposit",)),
    ("ablation", plot_ablation, ()),
)


def write_plots(runs: Sequence[Run], out_dir: str | Path, fmt: str = "png", dpi: int = 130) -> list[Path]:
    """Write every figure the runs have data for; returns the paths written."""
    if not runs:
        return []
    for i, r in enumerate(runs):
        if "policy" not in r:
            raise ValueError(f"runs[{i}]: missing 'policy'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, make, needs in FIGURES:
        if needs and not any(_has(runs, k) for k in needs):
            continue
        if (name == "ablation" and not ablation_runs(runs)) or (name == "token_deposit" and not deposit_pairs(runs)):
            continue
        fig = make(runs)
        path = out / f"{name}.{fmt}"
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths


def plot_ci_bars(panels: Sequence[tuple[str, Sequence[str], dict[str, Sequence[tuple[float, float]]]]],
                 ylabel: str, scale: float = 1.0) -> Figure:
    """Side-by-side panels of grouped bars with 95% CI error bars: each panel is (title, x labels,
    {series: [(mean, ci95) per x label]}); for sweeps over one knob (budget, link rate, prefetch depth)."""
    fig = Figure(figsize=(4.2 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, xs, series) in zip(axes, panels):
        width = 0.8 / max(len(series), 1)
        x = np.arange(len(xs))
        for i, (name, cells) in enumerate(series.items()):
            means = [c[0] * scale if c[0] is not None else math.nan for c in cells]
            errs = [(c[1] or 0.0) * scale for c in cells]
            ax.bar(x + (i - (len(series) - 1) / 2) * width, means, width, yerr=errs, capsize=2, label=name)
        ax.set_xticks(x)
        ax.set_xticklabels(xs, fontsize="small")
        ax.set_title(title, fontsize="medium")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    return fig
