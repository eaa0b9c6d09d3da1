"""CLI surfaces that need no model: plan and simulate (generate is covered in test_generate_smollm2.py)."""

import json

import pytest

from orbitflow.cli import main


def test_plan_prints_a_feasible_plan_as_json(capsys):
    argv = ["plan", "--json", "--device-kv-blocks", "20000", "--slo-ms", "300",
            "--request", "tokens=12000,left=500", "--request", "tokens=900,left=800"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and len(out["distances"]) == 2
    assert out["memory_blocks"] <= out["capacity_blocks"]


def test_plan_budget_flags(capsys):
    reqs = ["--request", "tokens=20000", "--request", "tokens=9000,left=500", "--request", "tokens=30000",
            "--request", "tokens=3000", "--request", "tokens=12000"]
    base = ["plan", "--json", "--device-kv-blocks", "140000", "--slo-ms", "400", *reqs]
    assert main([*base, "--plan-node-limit", "none"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert exact["feasible"] and exact["search"] == "complete" and exact["optimality_gap"] == 0
    assert main([*base, "--plan-node-limit", "3"]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["feasible"] and cut["predicted_step_s"] >= exact["predicted_step_s"]
    if cut["search"] == "budget reached":
        assert cut["optimality_gap"] > 0


def test_plan_budget_flags_reject_bad_values(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--request", "tokens=10", "--plan-node-limit", "many"])
    assert "--plan-node-limit" in capsys.readouterr().err
    assert main(["plan", "--request", "tokens=10", "--plan-time-limit-ms", "-1"]) == 2
    assert "--plan-time-limit-ms" in capsys.readouterr().err


def test_plan_rejects_a_malformed_request(capsys):
    assert main(["plan", "--request", "tokenz=3"]) == 2
    assert "--request" in capsys.readouterr().err


def test_simulate_writes_json_and_plots(tmp_path, capsys):
    out = tmp_path / "runs.json"
    argv = ["simulate", "--policies", "orbitflow,flexgen+", "--slo-scales", "1.5", "--rate-scales", "2",
            "--num-requests", "2", "--seeds", "2", "--seed", "5", "--workers", "1", "--json", str(out),
            "--plots", str(tmp_path / "plots")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "orbitflow" in printed and "flexgen+" in printed and "±" in printed
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert {r["policy"] for r in runs} == {"orbitflow", "flexgen+"} and {r["seed"] for r in runs} == {5, 6}
    assert all(0 <= r["tbt_attainment"] <= 1 for r in runs)
    config = data["config"]
    for key in ("device_kv_blocks", "largest_batch_blocks", "link_gbps", "prefetch_slots", "noise_cv", "solver_time",
                "seeds"):
        assert key in config
    assert config["device_kv_blocks"] == round(0.5 * config["largest_batch_blocks"]) and config["seeds"] == [5, 6]
    assert config["solver_time"] == "measured" and config["noise_cv"] > 0
    rows = data["summary"]
    assert len(rows) == 2  # one per policy
    for row in rows:
        assert {"policy", "slo_scale"} <= set(row)
        for metric in ("tbt_attainment", "tpot_attainment", "p95_tbt_s", "p99_tbt_s", "ttft_mean_s", "e2e_mean_s",
                       "throughput_rpm", "tokens_per_s", "device_mem_util", "num_pauses"):
            assert set(row[metric]) >= {"mean", "ci95"} and row[metric]["n"] == 2
    assert any((tmp_path / "plots").glob("*.png"))


def test_simulate_defaults_are_the_papers_setup():
    from orbitflow.cli import build_parser

    args = build_parser().parse_args(["simulate"])
    from orbitflow.sim.sweep import DEFAULT_DEVICE_KV_FRACTION

    assert args.device_kv_fraction is None and DEFAULT_DEVICE_KV_FRACTION == 0.5  # None: 0.5 or a trace's own
    assert args.noise_cv is None and args.solver_time == "measured"  # None: the profile's jitter, else 0.07
    assert args.seeds >= 5 and args.num_requests >= 64 and args.prefetch_slots == "policy"
    assert args.policies == "all"


def test_simulate_replays_an_artifact_trace(tmp_path, capsys):
    trace = {"requests": {"a": {"input_length": 300, "output_length": 20, "arrival_time": 0},
                          "b": {"input_length": 500, "output_length": 10, "arrival_time": 40}},
             "num_gpu_blocks": 200}
    path = tmp_path / "artifact.json"
    path.write_text(json.dumps(trace))
    out = tmp_path / "runs.json"
    argv = ["simulate", "--policies", "orbitflow", "--slo-scales", "1.5", "--rate-scales", "1", "--seeds", "1",
            "--trace", str(path), "--step-s", "0.05", "--workers", "1", "--json", str(out)]
    assert main(argv) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["num_finished"] == 2 and run["total_output_tokens"] == 30
    assert run["device_kv_blocks"] == 200 * 16 // 16 * 32  # the file's budget: 200 blocks of 16 tokens, 32 layers
    assert main(argv[:-6] + ["--trace", str(path), "--workers", "1"]) == 2  # no --step-s
    assert "--step-s" in capsys.readouterr().err


def test_simulate_names_a_bad_flag(capsys):
    assert main(["simulate", "--slo-scales", "fast"]) == 2
    assert "--slo-scales" in capsys.readouterr().err
    assert main(["simulate", "--policies", "warp-drive"]) == 2
    assert "--policies" in capsys.readouterr().err


def test_simulate_runs_on_a_measured_profile_file_and_charges_its_overheads(tmp_path, capsys):
    """`orbitflow profile --out FILE` writes a HardwareProfile; `simulate --profile FILE` must charge every
    measured engine overhead in it (the same cost model the engine's planner used)."""
    from orbitflow.plan.hardware import load_preset

    ideal = load_preset("a5000-llama3-8b")
    slow = ideal.with_overrides(name="measured", decode_per_request_s=0.02, transfer_latency_s=0.002,
                                move_latency_s=0.001)
    results = {}
    for p in (ideal, slow):
        path = p.save(tmp_path / f"{p.name}.json")
        out = tmp_path / f"{p.name}-runs.json"
        argv = ["simulate", "--profile", str(path), "--policies", "deepspeed", "--slo-scales", "1.5",
                "--rate-scales", "2", "--num-requests", "1", "--workers", "1", "--json", str(out)]
        assert main(argv) == 0
        capsys.readouterr()
        results[p.name] = json.loads(out.read_text())["runs"][0]
    assert results["measured"]["p95_tbt_s"] > results[ideal.name]["p95_tbt_s"]


def test_simulate_uses_a_measured_profiles_step_jitter_unless_told(tmp_path, capsys):
    """`orbitflow profile` measures the engine's step jitter; `simulate --profile FILE` adds it as noise by default
    (a preset, which measured none, gets the default); --noise-cv overrides both."""
    from orbitflow.plan.hardware import load_preset
    from orbitflow.sim.sweep import DEFAULT_NOISE_CV, noise_cv_for

    preset = load_preset("a5000-llama3-8b")
    measured = preset.with_overrides(name="measured", step_noise_cv=0.031)
    assert noise_cv_for(None, preset) == DEFAULT_NOISE_CV
    assert noise_cv_for(None, measured) == 0.031 and noise_cv_for(0.0, measured) == 0.0
    path = measured.save(tmp_path / "measured.json")
    out = tmp_path / "runs.json"
    argv = ["simulate", "--profile", str(path), "--policies", "deepspeed", "--slo-scales", "1.5", "--rate-scales",
            "2", "--num-requests", "1", "--seeds", "1", "--workers", "1", "--json", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["config"]["noise_cv"] == 0.031
