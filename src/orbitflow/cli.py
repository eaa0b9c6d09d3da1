"""`orbitflow` command line: serve | bench | simulate | profile | plan | generate."""

from __future__ import annotations

import argparse
import json
import sys

from orbitflow.config import DEFAULT_MODEL, SCHEDULING_CHOICES, VICTIM_CHOICES, ConfigError, EngineConfig


class CLIError(Exception):
    """A usage problem reported as one line, without a traceback."""


def add_engine_args(p: argparse.ArgumentParser, max_num_seqs_default: int | None = 4) -> None:
    d = EngineConfig()
    g = p.add_argument_group("model and KV cache")
    g.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, HF model directory or GGUF file")
    g.add_argument("--device-kv-blocks", type=int, default=d.device_kv_blocks,
                   help="device KV budget in blocks (one block = K and V of --block-size tokens of one layer)")
    g.add_argument("--host-kv-blocks", type=int, default=d.host_kv_blocks, help="host KV pool size in blocks")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--link-gbps", type=float, default=None,
                   help="throttle host<->device KV copies to this many GB/s (stands in for PCIe)")
    g.add_argument("--compute-threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads (default: torch's, or all cores but one for the KV copy thread "
                        "when --link-gbps throttles a CPU-only run)")
    g = p.add_argument_group("scheduling")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs_default, help="running batch size cap")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="cap on prompt + output tokens of the running batch")
    g.add_argument("--scheduling", choices=SCHEDULING_CHOICES, default=d.scheduling, help="admission order")
    g.add_argument("--chunked-prefill", type=int, default=None, metavar="N",
                   help="prefill long prompts in chunks of N tokens interleaved with decode steps")
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap (default: the model's)")
    g = p.add_argument_group("SLO and placement control")
    g.add_argument("--policy", default=d.policy, help="placement policy (orbitflow or a baseline)")
    slo = g.add_mutually_exclusive_group()
    slo.add_argument("--slo-ms", type=float, default=None, help="per-token (TBT) SLO in milliseconds")
    slo.add_argument("--slo-scale", type=float, default=d.slo_scale,
                     help="SLO as a multiple of the no-offload decode step with a full device budget")
    g.add_argument("--token-deposit", action=argparse.BooleanOptionalAction, default=True,
                   help="pace delivery with Token-Deposit")
    g.add_argument("--alpha", type=float, default=d.alpha, help="tolerated SLO violations per step (planner cap)")
    g.add_argument("--window-min", type=int, default=d.window_min, help="shortest decode window (steps)")
    g.add_argument("--window-max", type=int, default=d.window_max, help="longest decode window (steps)")
    g.add_argument("--victim", choices=VICTIM_CHOICES, default=d.victim, help="pause victim rule")
    add_planner_budget_args(g)
    g.add_argument("--seed", type=int, default=0)


def add_planner_budget_args(g) -> None:
    d = EngineConfig()
    g.add_argument("--plan-node-limit", type=_optional_int, default=d.plan_node_limit, metavar="N|none",
                   help="branch-and-bound nodes per planner solve; past it the best plan found is used")
    g.add_argument("--plan-time-limit-ms", type=float, default=None, metavar="MS",
                   help="wall-clock budget per planner solve (default: none; the node limit alone bounds it)")


def _optional_int(text: str) -> int | None:
    if text.lower() in ("none", "0", "inf"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    values = dict(
        model=args.model, block_size=args.block_size, device_kv_blocks=args.device_kv_blocks,
        host_kv_blocks=args.host_kv_blocks, link_gbps=args.link_gbps, compute_threads=args.compute_threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, scheduling=args.scheduling,
        chunked_prefill=args.chunked_prefill, max_model_len=args.max_model_len, policy=args.policy,
        slo_ms=args.slo_ms, slo_scale=args.slo_scale, token_deposit=args.token_deposit, alpha=args.alpha,
        window_min=args.window_min, window_max=args.window_max, victim=args.victim, seed=args.seed,
        plan_node_limit=args.plan_node_limit, plan_time_limit_ms=args.plan_time_limit_ms,
    )
    values.update(overrides)
    return EngineConfig(**values)


# ---- generate ------------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from orbitflow.llm import LLM
    from orbitflow.policies import FixedPlacementPolicy
    from orbitflow.runtime.sampling import SamplingParams

    if args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    policy = FixedPlacementPolicy(args.placement) if args.placement else None
    config = engine_config(args, max_num_seqs=args.max_num_seqs or len(args.prompt))
    llm = LLM(config, policy=policy, profile="rough" if policy else "measure")
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                              ignore_eos=args.ignore_eos)
    bar = tqdm(desc="decode steps", unit="step", disable=args.json or not sys.stderr.isatty(), leave=False)
    try:
        reqs = llm.generate(args.prompt, sampling, chat=args.chat, progress=lambda: bar.update(1))
    finally:
        bar.close()
    stats = llm.stats()
    llm.close()
    outputs = [
        {"prompt": p, "token_ids": r.output_ids, "text": llm.tokenizer.decode(r.output_ids)}
        for p, r in zip(args.prompt, reqs)
    ]
    if args.json:
        print(json.dumps({
            "outputs": outputs,
            "stats": {
                "device_blocks_peak": stats.device_blocks_peak, "host_blocks_peak": stats.host_blocks_peak,
                "bytes_h2d": stats.bytes_h2d, "stall_s": stats.stall_s, "step_s": stats.step_s,
            },
        }))
    else:
        for o in outputs:
            print(f"--- {o['prompt']!r}\n{o['text']}")
        decode = stats.step_s[1:] or stats.step_s
        print(
            f"\n[{len(stats.step_s)} steps, mean {1000 * sum(decode) / max(len(decode), 1):.1f} ms/step, "
            f"stall {stats.stall_s:.3f} s, {stats.bytes_h2d / 1e6:.1f} MB host->device, "
            f"device blocks peak {stats.device_blocks_peak}, host blocks peak {stats.host_blocks_peak}]",
            file=sys.stderr,
        )
    return 0


# ---- profile -------------------------------------------------------------------------------------------
def cmd_profile(args: argparse.Namespace) -> int:
    from orbitflow.llm import LLM

    llm = LLM(engine_config(args), profile="measure")
    profile = llm.profile
    llm.close()
    text = profile.to_json()
    if args.output:
        profile.save(args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    print(text)
    return 0


# ---- simulate ------------------------------------------------------------------------------------------
def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{flag} must be a comma-separated list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise CLIError(f"{flag} must list positive numbers, got {text!r}")
    return values


def cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from orbitflow.bench.metrics import format_table
    from orbitflow.policies import ABLATIONS, BASELINES, policy_names
    from orbitflow.sim.profiles import ProfileError, resolve_profile
    from orbitflow.sim.sweep import run_sweep, summary_rows

    try:
        profile = resolve_profile(args.profile or args.preset)
    except (ProfileError, FileNotFoundError, KeyError, ValueError) as exc:
        raise CLIError(f"--preset/--profile: {exc}") from None
    if args.policies == "all":
        policies = ["orbitflow", *BASELINES]
    else:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        unknown = [p for p in policies if p not in policy_names()]
        if unknown:
            raise CLIError(f"--policies: unknown {', '.join(unknown)} (choose from {', '.join(policy_names())})")
    if args.ablations:
        policies += [p for p in ABLATIONS if p not in policies]
    if args.victims:
        victims = [v.strip() for v in args.victims.split(",") if v.strip()]
        bad = [v for v in victims if v not in VICTIM_CHOICES]
        if bad:
            raise CLIError(f"--victims: unknown {', '.join(bad)} (choose from {', '.join(VICTIM_CHOICES)})")
        policies += [f"orbitflow@{v}" for v in victims]
    slo_scales = _floats(args.slo_scales, "--slo-scales")
    rate_scales = _floats(args.rate_scales, "--rate-scales")
    # The paper's setup: the device budget is about 0.23 x the KV blocks of the largest batch allowed.
    largest_batch_blocks = args.max_num_batched_tokens // profile.block_size * profile.num_layers
    device_blocks = args.device_kv_blocks or round(0.23 * largest_batch_blocks)
    overrides = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                 "device_kv_blocks": device_blocks}
    total = len(policies) * len(slo_scales) * len(rate_scales) * 2
    with tqdm(total=total, desc=f"simulate {profile.name}", unit="run", disable=not sys.stderr.isatty()) as bar:
        runs = run_sweep(profile, policies, slo_scales, rate_scales, num_requests=args.num_requests, seed=args.seed,
                         workers=args.workers, progress=lambda _: bar.update(1), **overrides)
    columns = [("policy", "Policy"), ("rate_scale", "Rate x"), ("tbt_attainment", "TBT att"),
               ("tbt_attainment_no_deposit", "TBT att (no dep)"), ("tpot_attainment", "TPOT att"),
               ("p95_tbt_s", "P95 TBT s"), ("p99_tbt_s", "P99 TBT s"), ("throughput_rpm", "req/min"),
               ("e2e_mean_s", "E2E s"), ("device_mem_util", "Dev mem"), ("pauses", "Pauses"),
               ("solver_calls", "Solves")]
    rows = summary_rows(runs)
    for s in slo_scales:
        print(format_table([r for r in rows if r["slo_scale"] == s], columns,
                           title=f"{profile.name} | SLO scale {s} | {args.num_requests} requests per run | "
                                 f"device budget {device_blocks} blocks"))
        print()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"preset": profile.name, "device_kv_blocks": device_blocks, "runs": runs}, fh, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plots:
        from orbitflow.bench.plots import write_plots

        for path in write_plots(runs, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


# ---- plan ----------------------------------------------------------------------------------------------
def _plan_request(text: str, index: int, block_size: int, slo_s: float):
    from orbitflow.plan import PlanRequest

    fields = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("tokens", "left", "deposit", "slo_ms"):
            raise CLIError(f"--request {text!r}: expected tokens=N[,left=N][,deposit=N][,slo_ms=X]")
        try:
            fields[key.strip()] = float(value)
        except ValueError:
            raise CLIError(f"--request {text!r}: {key} must be a number") from None
    if "tokens" not in fields or fields["tokens"] < 1:
        raise CLIError(f"--request {text!r}: tokens=N (N >= 1) is required")
    tokens = int(fields["tokens"])
    return PlanRequest(f"r{index}", -(-tokens // block_size), tokens,
                       int(fields["left"]) if "left" in fields else None, fields.get("deposit", 0.0),
                       fields["slo_ms"] / 1000 if "slo_ms" in fields else slo_s)


def cmd_plan(args: argparse.Namespace) -> int:
    from orbitflow.policies.base import PlanContext
    from orbitflow.sim.profiles import ProfileError, resolve_profile

    try:
        profile = resolve_profile(args.profile or args.preset)
    except (ProfileError, FileNotFoundError, KeyError, ValueError) as exc:
        raise CLIError(f"--preset/--profile: {exc}") from None
    config = EngineConfig(block_size=profile.block_size, device_kv_blocks=args.device_kv_blocks or
                          profile.device_kv_blocks, alpha=args.alpha, window_min=args.window_min,
                          window_max=args.window_max, plan_node_limit=args.plan_node_limit,
                          plan_time_limit_ms=args.plan_time_limit_ms)
    slo_s = args.slo_ms / 1000 if args.slo_ms else config.slo_scale * profile.base_slo_s()
    requests = [_plan_request(t, i, profile.block_size, slo_s) for i, t in enumerate(args.request)]
    plan = PlanContext.from_profile(config, profile).planner(space=args.space).plan(requests)
    out = {
        "feasible": plan.feasible, "distances": list(plan.distances) if plan.distances else None,
        "host_layers": [plan.placement.host_layers(i) for i in range(len(requests))] if plan.placement else None,
        "predicted_step_s": plan.predicted_step_s, "window": plan.window, "expiry_step": plan.expiry_step,
        "memory_blocks": plan.memory_blocks, "capacity_blocks": config.device_kv_blocks,
        "victims": list(plan.victims), "solve_s": plan.stats.get("solve_s"), "slo_s": slo_s,
        "search": "local search, no proof" if args.space == "full" else (
            "complete" if plan.stats.get("exact", 1) else "budget reached"),
        "optimality_gap": plan.stats.get("gap"),
    }
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>17}: {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orbitflow",
        description="SLO-aware long-context LLM serving with per-request, per-layer KV placement.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="greedy (or sampled) generation for a few prompts, offline",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--placement", default=None, metavar="SPEC",
                   help="fixed placement: none | all | distance:D | random:SEED (default: the --policy plans)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--json", action="store_true", help="print one JSON object with outputs and stats")
    add_engine_args(p, max_num_seqs_default=None)
    p.set_defaults(func=cmd_generate)

    from orbitflow.bench.client import add_bench_parser
    from orbitflow.serve.server import add_serve_parser

    add_serve_parser(sub, add_engine_args, engine_config)
    add_bench_parser(sub)

    p = sub.add_parser("simulate", help="paper-scale sweeps of policies on the simulator (tables, JSON, plots)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", default="a5000-llama3-8b", help="hardware preset (see orbitflow.sim presets)")
    p.add_argument("--profile", default=None, help="a profile JSON file (from `orbitflow profile`) instead of a preset")
    p.add_argument("--policies", default="all", help="'all' (OrbitFlow and every baseline) or a comma list")
    p.add_argument("--ablations", action="store_true", help="also run the ablation steps of paper Fig. 13a")
    p.add_argument("--victims", default=None, metavar="LIST",
                   help="also run OrbitFlow with each of these pause-victim rules (paper Fig. 13c), e.g. "
                        "largest-kv+deposit,longest,shortest,random")
    p.add_argument("--slo-scales", default="1,1.5,2.5", help="comma list of SLO scales")
    p.add_argument("--rate-scales", default="1,2,3,4,5", help="comma list of arrival-rate scales")
    p.add_argument("--num-requests", type=int, default=16, help="requests per run")
    p.add_argument("--max-num-seqs", type=int, default=4, help="batch size cap")
    p.add_argument("--max-num-batched-tokens", type=int, default=32768, help="tokens per batch cap")
    p.add_argument("--device-kv-blocks", type=int, default=None,
                   help="device KV budget (default: 0.23 x the blocks of the largest batch, as in the paper)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: one per core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write every run's metrics as JSON")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots mirroring paper Figs. 9-13")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("plan", help="run the placement planner on a described batch",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--request", action="append", required=True, metavar="tokens=N[,left=N][,deposit=N][,slo_ms=X]",
                   help="one request of the batch (repeat)")
    p.add_argument("--preset", default="a5000-llama3-8b", help="hardware preset")
    p.add_argument("--profile", default=None, help="a profile JSON file instead of a preset")
    p.add_argument("--device-kv-blocks", type=int, default=None, help="override the device KV budget")
    p.add_argument("--slo-ms", type=float, default=None, help="TBT SLO (default: 1.5 x the base SLO)")
    p.add_argument("--alpha", type=float, default=EngineConfig().alpha, help="tolerated violations per step")
    p.add_argument("--window-min", type=int, default=EngineConfig().window_min)
    p.add_argument("--window-max", type=int, default=EngineConfig().window_max)
    p.add_argument("--space", choices=("pruned", "uniform", "full"), default="pruned", help="search space")
    add_planner_budget_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("profile", help="measure this machine's engine and print a hardware profile (JSON)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", "--output", "-o", dest="output", default=None,
                   help="also write the profile to this file (then: orbitflow simulate --profile FILE)")
    add_engine_args(p)
    p.set_defaults(func=cmd_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from orbitflow.model.errors import ModelLoadError
    from orbitflow.policies import PlacementError

    try:
        return args.func(args)
    except (CLIError, ConfigError, ModelLoadError, PlacementError) as exc:
        print(f"orbitflow {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
