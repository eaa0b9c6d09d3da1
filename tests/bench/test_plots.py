import itertools

import numpy as np
import pytest

from orbitflow.bench.plots import (
    ablation_runs,
    deposit_pairs,
    headline_runs,
    mean_over_seeds,
    normalise_policy,
    write_plots,
)

POLICIES = ["orbitflow", "deepspeed", "flexgen+", "dynamic-heuristic"]


def fake_runs(policies=POLICIES, slos=(1.0, 1.5, 2.5), rates=(0.5, 1.0, 2.0)):
    rng = np.random.default_rng(0)
    runs = []
    for (i, p), s, r in itertools.product(enumerate(policies), slos, rates):
        att = float(np.clip(1.0 - 0.1 * i - 0.15 * r / s + 0.05 * rng.standard_normal(), 0, 1))
        runs.append({
            "policy": p, "slo_scale": s, "rate_scale": r, "tbt_attainment": att,
            "tpot_attainment": att * 0.9, "tbt_attainment_no_deposit": att * 0.8,
            "p95_tbt_s": 0.08 + 0.02 * i, "p99_tbt_s": 0.1 + 0.02 * i, "p95_tpot_s": 0.07 + 0.01 * i,
            "p99_tpot_s": 0.09 + 0.01 * i, "throughput_rpm": 1.0 - 0.1 * i, "tokens_per_s": 20.0 - i,
            "e2e_mean_s": 100.0 + 5 * i, "device_mem_util": 0.9 - 0.1 * i, "solver_calls": 10,
            "solver_time_s": 0.01,
        })
    return runs


def test_write_plots_produces_files(tmp_path):
    paths = write_plots(fake_runs(), tmp_path)
    names = {p.name for p in paths}
    assert names == {"attainment_grid.png", "p95_tbt.png", "e2e_latency.png", "tail_throughput_memory.png",
                     "token_deposit.png"}
    for p in paths:
        assert p.stat().st_size > 5000
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablation_plot_when_ablation_policies_present(tmp_path):
    runs = fake_runs(policies=["Batch-Uniform", "+Request-Wise", "+Pause-Resume", "orbitflow"], slos=(1.0, 2.5),
                     rates=(1.0,))
    assert len(ablation_runs(runs)) == 8
    assert not ablation_runs(fake_runs())
    paths = write_plots(runs, tmp_path, fmt="svg")
    assert tmp_path / "ablation.svg" in paths
    assert normalise_policy("+Pause_Resume") == "pause-resume"


def test_missing_metrics_skip_figures(tmp_path):
    runs = [{"policy": "a", "slo_scale": 1.5, "rate_scale": 1.0, "tbt_attainment": 0.9}]
    paths = write_plots(runs, tmp_path)
    assert [p.name for p in paths] == ["attainment_grid.png"]
    assert write_plots([], tmp_path) == []


def test_a_bar_is_the_mean_over_seeds_with_its_interval():
    """Each seed's runs (its rate scales) are averaged first; the interval is over the seeds, as DESIGN asks."""
    runs = [{"policy": "a", "seed": s, "rate_scale": r, "x": v}
            for s, (lo, hi) in enumerate([(0.2, 0.4), (0.4, 0.6), (0.6, 0.8)]) for r, v in ((1, lo), (5, hi))]
    mean, ci = mean_over_seeds(runs, "x")
    assert mean == pytest.approx(0.5)
    assert ci == pytest.approx(4.303 * 0.2 / 3 ** 0.5)  # seeds 0.3, 0.5, 0.7: sd 0.2, t(2) = 4.303
    assert mean_over_seeds([{"policy": "a", "seed": 0}], "x")[0] != mean_over_seeds([], "x")[0]  # both nan


def test_the_deposit_figure_compares_paired_runs_only_and_the_headline_leaves_the_ablation_out():
    """The no-deposit runs exist at one rate: a 'with deposit' bar averaged over every rate compared unlike runs."""
    paired = {"policy": "flexgen+", "seed": 0, "slo_scale": 1.0, "rate_scale": 3.0, "tbt_attainment": 0.35,
              "tbt_attainment_no_deposit": 0.25}
    other_rate = {"policy": "flexgen+", "seed": 0, "slo_scale": 1.0, "rate_scale": 1.0, "tbt_attainment": 0.6}
    step = {"policy": "+pause-resume", "seed": 0, "slo_scale": 1.0, "rate_scale": 3.0, "tbt_attainment": 0.5,
            "tbt_attainment_no_deposit": 0.5}
    runs = [paired, other_rate, step]
    assert deposit_pairs(runs) == [paired]
    assert headline_runs(runs) == [paired, other_rate]
    assert mean_over_seeds(deposit_pairs(runs), "tbt_attainment")[0] == 0.35  # not (0.35 + 0.6) / 2
