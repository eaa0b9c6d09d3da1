"""CLI surfaces that need no model: plan and simulate (generate is covered in test_generate_smollm2.py)."""

import json
import os
import signal
import threading

import pytest

from orbitflow.cli import main
from orbitflow.plan import SearchControl


def test_plan_prints_a_feasible_plan_as_json(capsys):
    argv = ["plan", "--json", "--device-kv-blocks", "20000", "--slo-ms", "300",
            "--request", "tokens=12000,left=500", "--request", "tokens=900,left=800"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and len(out["distances"]) == 2 and out["why"] is None
    assert out["memory_blocks"] <= out["capacity_blocks"]


_BATCH = ["--request", "tokens=30000", "--request", "tokens=20000,left=100", "--request", "tokens=8000,deposit=5"]


@pytest.mark.parametrize("flags, why", [
    (["--device-kv-blocks", "2000"], "prefetch buffers alone take 3625 blocks, more than the 2000"),
    (["--device-kv-blocks", "3625", "--slo-ms", "20000"], "does not fit for --window-min 4 steps"),
    (["--device-kv-blocks", "120000", "--slo-ms", "100"],
     "with every layer on the device a step takes 105.4 ms, over the SLO of 100.0"),
    (["--device-kv-blocks", "40000", "--slo-ms", "200"], "no placement that fits in 40000 device blocks meets"),
])
def test_plan_says_why_no_placement_is_feasible(capsys, flags, why):
    assert main(["plan", "--json", *_BATCH, *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["feasible"] and why in out["why"]


def test_plan_plans_for_the_pace_under_a_deposit_guard(capsys):
    """serve plans for the SLO less --deposit-guard-ms (its default: auto); plan can be told the same."""
    tight = ["plan", "--json", *_BATCH, "--device-kv-blocks", "120000", "--slo-ms", "106"]
    assert main(tight) == 0  # every layer on the device steps in 105.4 ms
    assert json.loads(capsys.readouterr().out)["feasible"]
    assert main([*tight, "--deposit-guard-ms", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["feasible"] and "over the pace (the SLO less --deposit-guard-ms) of 104.0 ms" in out["why"]


def test_plan_plans_for_the_slo_the_engine_would_at_that_budget(capsys):
    """The base SLO is a no-offload step with the device budget full of KV: plan read the profile's budget, not
    --device-kv-blocks', so it planned for another SLO than serve and simulate at that budget."""
    from orbitflow.config import EngineConfig
    from orbitflow.plan.hardware import load_preset
    from orbitflow.policies.base import default_slo_s

    assert main(["plan", "--json", "--request", "tokens=1000", "--device-kv-blocks", "4096"]) == 0
    out = json.loads(capsys.readouterr().out)
    preset = load_preset("a5000-llama3-8b")
    config = EngineConfig.build(device_kv_blocks=4096, block_size=preset.block_size)
    want = default_slo_s(config, preset)
    assert out["slo_s"] == pytest.approx(want)
    assert want != pytest.approx(config.planner.slo_scale * preset.base_slo_s())  # the profile's budget's


def test_plan_json_is_standard_json_when_nothing_is_feasible(capsys):
    assert main(["plan", "--json", "--request", "tokens=100000000"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"not standard JSON: {c}"))
    assert not out["feasible"] and out["predicted_step_s"] is None


def test_plan_blames_the_profile_not_the_flag_for_a_budget_it_was_not_given(capsys):
    assert main(["plan", "--json", "--request", "tokens=100000000"]) == 0
    why = json.loads(capsys.readouterr().out)["why"]
    assert "of the profile's device_kv_blocks" in why and "of --device-kv-blocks" not in why


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
    assert cut["search"] == "budget reached" and cut["optimality_gap"] > 0  # 3 nodes do not prove this batch


def test_plan_budget_flags_reject_bad_values(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--request", "tokens=10", "--plan-node-limit", "many"])
    assert "--plan-node-limit" in capsys.readouterr().err
    assert main(["plan", "--request", "tokens=10", "--plan-time-limit-ms", "-1"]) == 2
    assert "--plan-time-limit-ms" in capsys.readouterr().err


@pytest.mark.parametrize("request_text, why", [
    ("tokenz=3", "expected tokens=N"),
    ("tokens=100,deposit=-5", "deposit must be >= 0"),
    ("tokens=100,tokens=200", "tokens is given twice"),
])
def test_plan_rejects_a_malformed_request(capsys, request_text, why):
    assert main(["plan", "--request", request_text]) == 2
    err = capsys.readouterr().err
    assert f"--request {request_text!r}" in err and why in err


def test_simulate_says_which_flag_a_failed_write_was_for_after_the_tables(tmp_path, capsys, monkeypatch):
    """The paths are checked before the sweep, but a write can still fail (a path the checks cannot see into, as
    /proc's): a one-line error naming the flag, not a traceback, and the tables already printed."""
    import orbitflow.bench.plots

    def unwritable(runs, out_dir):
        raise FileNotFoundError(2, "No such file or directory", str(out_dir))

    monkeypatch.setattr(orbitflow.bench.plots, "write_plots", unwritable)
    argv = ["simulate", "--policies", "orbitflow", "--slo-scales", "1.5", "--rate-scales", "2", "--num-requests", "2",
            "--seeds", "1", "--workers", "1", "--plots", str(tmp_path / "plots")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "orbitflow" in captured.out  # the table
    assert f"--plots {tmp_path / 'plots'}: No such file or directory" in captured.err
    assert "Traceback" not in captured.err


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


def test_simulate_sweeps_the_link_order(tmp_path):
    """--kv-link edf,preemptive: each point on both links, the engine and its planner on the same one."""
    out = tmp_path / "runs.json"
    assert main([*TINY_SWEEP, "--num-requests", "4", "--kv-link", "edf,preemptive", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert sorted(r["kv_link"] for r in data["runs"]) == ["edf", "preemptive"]
    assert sorted(row["label"] for row in data["summary"]) == ["orbitflow", "orbitflow (preemptive link)"]
    assert data["config"]["kv_link"] == ["edf", "preemptive"]


def test_simulate_defaults_are_the_papers_setup():
    from orbitflow.cli import build_parser

    args = build_parser().parse_args(["simulate"])
    from orbitflow.sim.sweep import DEFAULT_DEVICE_KV_FRACTION

    assert args.device_kv_fraction is None and DEFAULT_DEVICE_KV_FRACTION == 0.5  # None: 0.5 or a trace's own
    assert args.noise_cv is None and args.solver_time == "measured"  # None: the profile's jitter, else 0.07
    assert args.seeds >= 5 and args.num_requests >= 64 and args.prefetch_slots == "policy"
    assert args.policies == "all"


@pytest.mark.parametrize("policies, expected", [
    ("orbitflow", ["orbitflow", "orbitflow@longest"]),  # OrbitFlow's own rule runs once, as itself
    ("flexgen", ["flexgen", "orbitflow@largest-kv+deposit", "orbitflow@longest"]),
])
def test_simulate_victims_do_not_run_orbitflows_own_rule_twice(policies, expected):
    from orbitflow.cli import build_parser, simulate_points

    args = build_parser().parse_args(["simulate", "--policies", policies, "--victims", "largest-kv+deposit,longest",
                                      "--slo-scales", "1", "--rate-scales", "1"])
    assert [p.policy for p in simulate_points(args, None)] == expected


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


# one policy, one point, one seed, two requests, no solve time: a sweep that takes a second
TINY_SWEEP = ["simulate", "--policies", "orbitflow", "--slo-scales", "1", "--rate-scales", "1", "--seeds", "1",
              "--num-requests", "2", "--workers", "1", "--solver-time", "off"]


def _write(path, data: bytes):
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("argv, says", [
    (["plan", "--request", "tokens=100,left=-3"], "tokens_left must be >= 0"),
    (["plan", "--request", "tokens=100,slo_ms=0"], "slo_s must be > 0"),
    (["plan", "--request", "tokens=nan"], "tokens must be a finite number"),
    (["plan", "--request", "tokens=inf"], "tokens must be a finite number"),
    (["plan", "--request", "tokens=100.7"], "tokens must be a whole number"),
    (["plan", "--request", "tokens=1000", "--alpha", "nan"], "--alpha must be a finite number"),
    (["plan", "--request", "tokens=1000", "--slo-ms", "nan"], "--slo-ms must be a finite number"),
    (["plan", "--request", "tokens=1000", "--device-kv-blocks", "0"], "--device-kv-blocks must be a positive"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature must be a number >= 0"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature must be a number >= 0"),
    (["generate", "--prompt", "hi", "--max-num-seqs", "0"], "--max-num-seqs must be a positive"),
    (["generate", "--prompt", "hi", "--link-gbps", "nan"], "--link-gbps must be a finite number"),
    (["serve", "--watchdog-s", "nan"], "--watchdog-s must be a finite number"),
    (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout must be a finite number"),
    (["profile", "--out", "/nonexistent-dir/p.json"], "--out: /nonexistent-dir is not an existing directory"),
    (["simulate", "--policies", ","], "--policies: no name in ','"),
    (["simulate", "--policies", "orbitflow,vllm"], "--policies: unknown vllm (choose from "),
    (["simulate", "--policies", "vllm"], "; or all: orbitflow and every baseline)"),
    (["simulate", "--victims", "longest,oldest"], "--victims: unknown oldest (choose from "),
    (["simulate", "--device-kv-fraction", "20"], "--device-kv-fraction must list fractions in (0, 10]"),
    (["simulate", "--link-gbps", "nan"], "--link-gbps must list positive numbers"),
    (["simulate", "--kv-link", "edf,fair"], "--kv-link: unknown fair (choose from edf, preemptive)"),
    (["simulate", "--alpha", "nan"], "--alpha must be a finite number"),
    (["simulate", "--window-min", "9", "--window-max", "8"], "--window-min"),
    (["simulate", "--json", "/nonexistent-dir/x.json"], "--json: /nonexistent-dir is not an existing directory"),
    (["bench", "--url", "http://127.0.0.1:99999", "--generate", "2", "--slo-ms", "50"], "Port out of range"),
    (["bench", "--generate", "2", "--slo-ms", "50", "--timeout", "-1"], "--timeout must be a positive number"),
    (["bench", "--generate", "2", "--slo-ms", "nan"], "--slo-ms must be a positive number"),
    (["bench", "--generate", "3", "--slo-ms", "50", "--max-requests", "0"], "--max-requests must be >= 1"),
    (["bench", "--generate", "2", "--slo-ms", "50", "--save-trace", "/nonexistent-dir/t.json"],
     "--save-trace: /nonexistent-dir is not an existing directory"),
    (["simulate", "--plots", "/etc/hostname"], "--plots: /etc/hostname is not a directory"),
    (["simulate", "--workers", "0"], "--workers must be >= 1"),
    (["simulate", "--workers", "-1"], "--workers must be >= 1"),
    (["simulate", "--step-s", "0.05"], "--step-s converts the arrival_time of an artifact-format --trace; give"),
    (["bench", "--generate", "2", "--slo-ms", "50", "--step-s", "0.05"], "--step-s converts the arrival_time"),
    (["simulate", "--json", "/"], "--json: / is a directory"),
    # a second review (each was a traceback, a silently ignored flag, or a repeated point counted as more seeds)
    (["simulate", "--policies", "flexgen,flexgen"], "--policies lists flexgen more than once"),
    (["simulate", "--slo-scales", "1.5,1.50"], "--slo-scales lists 1.5 more than once"),
    (["simulate", "--prefetch-slots", "1,2,1"], "--prefetch-slots lists 1 more than once"),
    (["simulate", "--max-num-batched-tokens", "8"], "--max-num-batched-tokens must be at least the profile's block"),
    (["simulate", "--seed", "-1"], "--seed must be >= 0"),
    (["simulate", "--solver-time", "infms"], "--solver-time must be 'measured', 'off' or a fixed cost"),
    (["bench", "--generate", "2", "--slo-ms", "50", "--seed", "-1"], "--seed must be >= 0"),
    (["bench", "--generate", "2", "--slo-ms", "50", "--token-scale", "nan"], "--token-scale must be a positive"),
    (["bench", "--generate", "2", "--slo-ms", "50", "--token-scale", "inf"], "--token-scale must be a positive"),
    (["plan", "--request", "tokens=10", "--profile", "no-such-profile"],
     "'no-such-profile' is neither a profile JSON file nor a hardware preset (presets: "),
    (["generate", "--prompt", "hi", "--placement", "all", "--policy", "deepspeed"],
     "--placement all fixes every request's placement, so --policy deepspeed would change nothing"),
    # a third review: planner flags beside a fixed placement, rank flags without ranks
    (["generate", "--prompt", "hi", "--placement", "all", "--alpha", "0.2"], "so --alpha 0.2 would change nothing"),
    (["generate", "--prompt", "hi", "--placement", "none", "--plan-node-limit", "none"],
     "so --plan-node-limit none would change nothing"),
    (["generate", "--prompt", "hi", "--tp-link", "shared"], "--tp-link needs --tensor-parallel-size N with N > 1"),
    (["generate", "--prompt", "hi", "--collective-timeout", "5"], "--collective-timeout needs --tensor-parallel-size"),
])
def test_a_user_mistake_is_one_line_naming_the_flag_not_a_traceback(argv, says, capsys):
    """Found by a review of the CLI: each of these raised a traceback, ran on silently, or failed after the work."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["simulate", "bench"])
@pytest.mark.parametrize("kind", ["directory", "binary"])
def test_a_trace_that_is_not_a_text_file_is_named(command, kind, tmp_path, capsys):
    path = str(tmp_path) if kind == "directory" else _write(tmp_path / "t.json", bytes(range(256)))
    extra = ["--slo-ms", "50"] if command == "bench" else []
    assert main([command, "--trace", path, *extra]) == 2
    err = capsys.readouterr().err
    assert f"--trace: {path}: cannot read it as a text file" in err, err


@pytest.mark.parametrize("command", ["simulate", "bench"])
def test_step_s_with_a_trace_in_seconds_is_refused_not_ignored(command, tmp_path, capsys):
    trace = {"requests": [{"id": "a", "arrival_s": 0.0, "input_tokens": 8, "output_tokens": 2}]}
    path = _write(tmp_path / "t.json", json.dumps(trace).encode())
    extra = ["--slo-ms", "50"] if command == "bench" else []
    assert main([command, "--trace", path, "--step-s", "0.05", *extra]) == 2
    err = capsys.readouterr().err
    assert f"--trace: {path}: --step-s converts an artifact trace's arrival_time" in err, err


@pytest.mark.parametrize("flag", ["--rate", "--token-scale"])
def test_bench_refuses_generate_flags_with_a_trace(flag, tmp_path, capsys):
    """They shape --generate's requests; with a --trace they were dropped without a word."""
    trace = {"requests": [{"id": "a", "arrival_s": 0.0, "input_tokens": 8, "output_tokens": 2}]}
    path = _write(tmp_path / "t.json", json.dumps(trace).encode())
    assert main(["bench", "--trace", path, "--slo-ms", "50", flag, "0.5"]) == 2
    assert f"{flag}: only for --generate's requests" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["plan", "--request", "tokens=10", "--preset", "a5000-llama3-8b", "--profile", "p.json"], "not allowed with"),
    (["simulate", "--preset", "a5000-llama3-8b", "--profile", "p.json"], "not allowed with"),
    (["profile", "--policy", "deepspeed"], "unrecognized arguments: --policy"),  # it changes nothing measured
    (["profile", "--max-num-batched-tokens", "2048"], "unrecognized arguments: --max-num-batched-tokens"),
    (["profile", "--seed", "3"], "unrecognized arguments: --seed"),
])
def test_flags_that_would_be_ignored_are_usage_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_profile_takes_the_batch_it_measures_up_to(monkeypatch):
    """profile --max-num-seqs N: the engine it measures runs batches up to N, so the profile's batch table does."""
    from orbitflow import cli

    seen = {}
    monkeypatch.setattr(cli, "cmd_profile", lambda args: seen.setdefault("config", cli.engine_config(args)) and 0)
    parser = cli.build_parser()
    args = parser.parse_args(["profile", "--max-num-seqs", "8"])
    args.func(args)
    assert seen["config"].scheduler.max_num_seqs == 8
    assert "--max-num-seqs" in parser._subparsers._group_actions[0].choices["profile"].format_help()


def test_bench_names_a_server_that_is_not_openai_compatible(tmp_path, capsys):
    """A web server answering /v1/models with HTML (a wrong port): one line, not an AttributeError traceback."""
    import functools
    import http.server
    import threading

    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "models").write_text("<html>hello</html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{httpd.server_address[1]}"
            assert main(["bench", "--url", url, "--generate", "1", "--slo-ms", "50", "--quiet"]) == 2
        finally:
            httpd.shutdown()
    err = capsys.readouterr().err
    assert "did not answer with an OpenAI model list" in err and "Traceback" not in err, err


def test_simulate_names_a_profile_path_that_is_a_directory(tmp_path, capsys):
    assert main(["simulate", "--profile", str(tmp_path)]) == 2
    assert "--preset/--profile: " in capsys.readouterr().err


def test_simulate_shows_rejected_requests_and_writes_strict_json(tmp_path, capsys):
    """A budget no request fits: attainment over nothing reads 1.000, so the table must say that both were rejected,
    and the JSON must stay strict (percentiles of no samples were bare NaN)."""
    out = tmp_path / "sim.json"
    assert main([*TINY_SWEEP, "--device-kv-blocks", "100", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("orbitflow"))
    assert "Rejected" in table and row.endswith("2.0 ± -")  # one seed: no interval
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert data["summary"][0]["rejected"]["mean"] == 2.0


def test_simulate_takes_the_scheduler_flags(tmp_path, capsys):
    """A 1000-token prompt prefilled 64 tokens a step reaches its first token later than in one prefill."""
    trace = {"requests": [{"id": "a", "arrival_s": 0.0, "input_tokens": 1000, "output_tokens": 4}]}
    argv = [*TINY_SWEEP, "--trace", _write(tmp_path / "t.json", json.dumps(trace).encode())]
    ttft = {}
    for name, extra in {"whole": [], "chunked": ["--chunked-prefill", "64", "--scheduling", "srtf"]}.items():
        out = tmp_path / f"{name}.json"
        assert main([*argv, *extra, "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        ttft[name] = data["runs"][0]["ttft_mean_s"]
    assert data["config"]["engine_overrides"] == {"scheduling": "srtf", "chunked_prefill": 64}
    assert ttft["chunked"] > ttft["whole"]


def test_simulate_refuses_an_empty_trace(tmp_path, capsys):
    assert main(["simulate", "--trace", _write(tmp_path / "t.json", b'{"requests": []}')]) == 2
    assert "the trace has no requests" in capsys.readouterr().err


def test_simulate_takes_the_planner_flags_the_docs_name(tmp_path, capsys):
    """docs/architecture.md: '--alpha 1 restores the paper'; simulate, the paper's reproduction, did not take it."""
    out = tmp_path / "sim.json"
    assert main([*TINY_SWEEP, "--alpha", "1", "--plan-node-limit", "none", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["engine_overrides"] == {"alpha": 1.0, "plan_node_limit": None}
    assert main([*TINY_SWEEP, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["engine_overrides"] == {}  # not given: the engine's own


def test_output_paths_are_checked_on_the_target_when_it_exists(tmp_path, capsys):
    """An existing file that cannot be written is refused up front; one that can (in a folder that may not be
    writable, as /dev/null) is fine; '' means no output."""
    from orbitflow.config import ConfigError, check_output_path

    locked = tmp_path / "locked.json"
    locked.write_text("{}")
    locked.chmod(0o444)
    if not os.access(locked, os.W_OK):  # (root may write anyway)
        with pytest.raises(ConfigError, match="--json: cannot write"):
            check_output_path(str(locked), "--json")
    check_output_path(os.devnull, "--json")
    check_output_path("", "--json")
    check_output_path("relative.json", "--json")
    check_output_path(str(tmp_path / "new" / "nested"), "--plots", directory=True)


def test_one_seed_prints_no_interval():
    """A single seed has no confidence interval: '± -', not '± 0.000' (which read as certain)."""
    from orbitflow.cli import fmt_ci
    from orbitflow.sim.sweep import mean_ci95

    assert fmt_ci(mean_ci95([0.9])) == "0.900 ± -"
    assert fmt_ci(mean_ci95([0.9, 0.8, 0.85])).startswith("0.850 ± 0.1")


def test_commands_that_load_a_model_say_what_they_are_doing(caplog):
    """generate and profile load a model and measure the machine (minutes on a small CPU box) before any output:
    their 'loading' and 'measuring' lines were INFO records nobody configured to show."""
    import logging

    logger = logging.getLogger("orbitflow")
    level = logger.level
    try:
        with caplog.at_level(logging.DEBUG):
            assert main(["generate", "--model", "/nonexistent/model", "--prompt", "hi"]) == 2
        assert logger.getEffectiveLevel() == logging.INFO
        assert any(r.levelno == logging.INFO and "loading" in r.getMessage() for r in caplog.records)
    finally:
        logger.setLevel(level)


_LONG_BATCH = [f for t in range(1000, 9000, 500) for f in ("--request", f"tokens={t}")]  # 16 requests: minutes exact


class _CtrlCWhileSearching(SearchControl):
    """Presses Ctrl-C (SIGINT to this process) once the search has reported 1000 nodes: the interrupt lands while the
    command waits for the search, whatever the machine's speed."""

    _nodes = 0

    @property
    def nodes(self) -> int:
        return self._nodes

    @nodes.setter
    def nodes(self, value: int) -> None:
        if self._nodes < 1000 <= value:
            os.kill(os.getpid(), signal.SIGINT)
        self._nodes = value


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="Ctrl-C reaches the main thread")
def test_plan_ctrl_c_stops_the_search_with_the_best_plan_found(capsys, monkeypatch):
    """An exact solve of 16 requests x 80 layers runs for minutes in compiled code, where Python's Ctrl-C cannot reach
    it: the command waits for it on another thread, stops it at the first Ctrl-C and prints the best plan found, with
    the gap its search certifies."""
    monkeypatch.setattr("orbitflow.plan.SearchControl", _CtrlCWhileSearching)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main(["plan", "--json", "--preset", "a6000-llama3-70b-tp4", "--slo-scale", "2", "--plan-node-limit",
                     "none", *_LONG_BATCH])
    except KeyboardInterrupt:  # not main's to let through: it would stop the whole test session
        pytest.fail("Ctrl-C escaped orbitflow plan")
    finally:
        signal.signal(signal.SIGINT, previous)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert out["search"] == "stopped by Ctrl-C: the best plan found" and out["feasible"]
    assert 0 < out["optimality_gap"] < 1 and out["solve_s"] < 30
    assert "stopping the search" in captured.err


def test_plan_stops_within_the_plan_gap(capsys):
    """--plan-gap: the plan is proven within that relative gap of the best possible (what the search says)."""
    argv = ["plan", "--json", "--device-kv-blocks", "20000", "--slo-ms", "300", "--plan-node-limit", "none",
            "--request", "tokens=12000,left=500", "--request", "tokens=900,left=800"]
    assert main(argv) == 0
    exact = json.loads(capsys.readouterr().out)
    assert exact["feasible"] and exact["search"] == "complete" and exact["optimality_gap"] == 0
    assert main([*argv, "--plan-gap", "0.05"]) == 0
    near = json.loads(capsys.readouterr().out)
    assert near["feasible"] and near["search"] == "within --plan-gap 0.05"  # the gap cut it short
    assert 0 <= near["optimality_gap"] <= 0.05 + 1e-12
    assert exact["predicted_step_s"] <= near["predicted_step_s"] <= exact["predicted_step_s"] / (1 - 0.05)


def test_a_search_cut_before_any_plan_does_not_claim_there_is_none():
    """A plan search stopped (Ctrl-C, or its budget) before its first feasible plan proves nothing: plan says so, where
    it used to say that no placement meets the SLO."""
    from types import SimpleNamespace

    from orbitflow.cli import _search_outcome, _why_infeasible
    from orbitflow.config import EngineConfig
    from orbitflow.plan import PlanRequest
    from orbitflow.plan.hardware import load_preset
    from orbitflow.policies.base import PlanContext

    config = EngineConfig.build(device_kv_blocks=40000, slo_ms=200)
    planner = PlanContext.from_profile(config, load_preset("a5000-llama3-8b")).planner()
    requests = [PlanRequest(f"r{i}", -(-t // 16), t, None, 0.0, 0.2) for i, t in enumerate((30000, 20000, 8000))]
    assert _why_infeasible(planner, requests).startswith("no placement that fits in 40000 device blocks meets")
    assert _why_infeasible(planner, requests, cut="Ctrl-C") == (
        "Ctrl-C stopped the search before it found a placement that fits in 40000 device blocks and meets the SLO "
        "(200.0 ms): whether one exists is not decided")

    def plan(feasible, exact, expiry_exact=True, gap=None):
        return SimpleNamespace(feasible=feasible, stats=SimpleNamespace(
            exact=exact, expiry_exact=expiry_exact, proven=lambda g: exact or (g > 0 and gap is not None and gap <= g)))

    assert _search_outcome(plan(False, False), True, 0.0) == "stopped by Ctrl-C before any plan"
    assert _search_outcome(plan(False, False), False, 0.0) == "budget reached before any plan"
    assert _search_outcome(plan(True, False), True, 0.0) == "stopped by Ctrl-C: the best plan found"
    assert _search_outcome(plan(True, True, expiry_exact=False), True, 0.0).startswith(
        "complete; Ctrl-C stopped its expiry checks")
    assert _search_outcome(plan(True, True, expiry_exact=False), False, 0.0) == "complete"
    assert _search_outcome(plan(True, False, gap=0.01), False, 0.05) == "within --plan-gap 0.05"
