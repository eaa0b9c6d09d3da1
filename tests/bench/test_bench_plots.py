import itertools

import numpy as np

from orbitflow.bench.plots import ablation_runs, normalise_policy, write_plots

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
