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
            "--num-requests", "4", "--workers", "1", "--json", str(out), "--plots", str(tmp_path / "plots")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "orbitflow" in printed and "flexgen+" in printed
    runs = json.loads(out.read_text())["runs"]
    assert {r["policy"] for r in runs} == {"orbitflow", "flexgen+"}
    assert all(0 <= r["tbt_attainment"] <= 1 and 0 <= r["tbt_attainment_no_deposit"] <= 1 for r in runs)
    assert any((tmp_path / "plots").glob("*.png"))


def test_simulate_names_a_bad_flag(capsys):
    assert main(["simulate", "--slo-scales", "fast"]) == 2
    assert "--slo-scales" in capsys.readouterr().err
    assert main(["simulate", "--policies", "warp-drive"]) == 2
    assert "--policies" in capsys.readouterr().err


def test_simulate_runs_on_a_measured_profile_file_and_charges_its_overheads(tmp_path, capsys):
    """`orbitflow profile --out FILE` writes a HardwareProfile; `simulate --profile FILE` must charge every
    measured engine overhead in it (the same cost model the engine's planner used)."""
    from orbitflow.sim.profiles import load_preset

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
