"""`orbitflow` command line: serve | bench | simulate | profile | plan | generate."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
from dataclasses import fields

from orbitflow.config import (
    LINK_CHOICES,
    PROFILE_FLAG_HELP,
    SERVING_ONLY,
    VICTIM_CHOICES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    HelpFormatter,
    ModelRunConfig,
    PlannerConfig,
    SchedulerConfig,
    add_config_args,
    add_engine_args,
    check_output_path,
    dest_of,
    engine_config,
    flag_of,
)


class CLIError(Exception):
    """A usage problem reported as one line, without a traceback."""


# ---- generate ------------------------------------------------------------------------------------------
# Planner flags a fixed --placement makes meaningless (it plans nothing and pauses no one); the SLO, Token-Deposit and
# the window (how often the placement is re-checked against the device budget) still apply.
NOT_WITH_PLACEMENT = ("policy", "alpha", "victim", "plan_node_limit", "plan_time_limit_ms", "plan_gap", "plan_threads",
                      "background_planner")


def _check_no_planner_flags(args: argparse.Namespace) -> None:
    """A planner flag beside --placement is a usage error, not silently ignored."""
    defaults = PlannerConfig()
    for f in fields(PlannerConfig):
        if f.name not in NOT_WITH_PLACEMENT:
            continue
        value = getattr(args, dest_of(f))
        if value != getattr(defaults, f.name):
            raise CLIError(f"--placement {args.placement} fixes every request's placement, so {flag_of(f)} "
                           f"{'none' if value is None else value} would change nothing: give one of them")


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from orbitflow.llm import LLM, machine_profile
    from orbitflow.policies import FixedPlacementPolicy
    from orbitflow.runtime.engine import RequestRejected
    from orbitflow.runtime.sampling import SamplingParams

    if args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):  # NaN fails the comparison too
        raise CLIError(f"--temperature must be a number >= 0 (0: greedy), got {args.temperature}")
    if args.placement:
        _check_no_planner_flags(args)
    policy = FixedPlacementPolicy(args.placement) if args.placement else None
    config = engine_config(args, max_num_seqs=len(args.prompt) if args.max_num_seqs is None else args.max_num_seqs)
    profile = machine_profile(args.profile)  # before the model loads: a bad file costs no minute
    llm = LLM(config, policy=policy, profile="rough" if policy and args.profile is None else profile)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                              ignore_eos=args.ignore_eos)
    bar = tqdm(desc="decode steps", unit="step", disable=args.json or not sys.stderr.isatty(), leave=False)
    try:
        reqs = llm.generate(args.prompt, sampling, chat=args.chat, progress=lambda: bar.update(1))
        stats = llm.stats()
    except RequestRejected as exc:  # an empty prompt, or prompt + --max-tokens past the context: no traceback
        raise CLIError(str(exc)) from None
    finally:
        bar.close()
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
                "link_preemptions": stats.link_preemptions,
            },
        }))
    else:
        for o in outputs:
            print(f"--- {o['prompt']!r}\n{o['text']}")
        decode = stats.step_s[1:] or stats.step_s
        print(
            f"\n[{len(stats.step_s)} steps, mean {1000 * sum(decode) / max(len(decode), 1):.1f} ms/step, "
            f"stall {stats.stall_s:.3f} s, {stats.bytes_h2d / 1e6:.1f} MB host->device, "
            f"device blocks peak {stats.device_blocks_peak}, host blocks peak {stats.host_blocks_peak}"
            + (f", {stats.link_preemptions} link preemptions" if stats.link_preemptions else "") + "]",
            file=sys.stderr,
        )
    return 0


# ---- profile -------------------------------------------------------------------------------------------
def cmd_profile(args: argparse.Namespace) -> int:
    from orbitflow.llm import LLM

    check_output_path(args.output, "--out")  # before the measuring, not after it
    llm = LLM(engine_config(args), profile="measure")
    profile = llm.profile
    llm.close()
    print(profile.to_json())
    if args.output:
        profile.save(args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


# ---- simulate ------------------------------------------------------------------------------------------
def _once(values: list, flag: str, text: str) -> list:
    """``values`` if none repeats: a repeated point would run again and count as more seeds in its interval."""
    twice = sorted({str(v) for i, v in enumerate(values) if v in values[:i]})
    if twice:
        raise CLIError(f"{flag} lists {', '.join(twice)} more than once ({text!r}); a point runs once per seed")
    return values


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{flag} must be a comma-separated list of numbers, got {text!r}") from None
    if not values or not all(v > 0 and math.isfinite(v) for v in values):
        raise CLIError(f"{flag} must list positive numbers, got {text!r}")
    return _once(values, flag, text)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise CLIError(f"{flag} must list integers >= 1, got {text!r}")
    return _once(values, flag, text)


def _names(text: str, flag: str, choices, also: str = "") -> list[str]:
    """A comma list of names, each one of ``choices`` (at least one); ``also``: what the flag takes besides a
    list, for the error messages (e.g. "or all")."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    tail = f"; {also}" if also else ""
    if not names:
        raise CLIError(f"{flag}: no name in {text!r} (a comma list of {', '.join(choices)}{tail})")
    unknown = [x for x in names if x not in choices]
    if unknown:
        raise CLIError(f"{flag}: unknown {', '.join(unknown)} (choose from {', '.join(choices)}{tail})")
    return _once(names, flag, text)


def fmt_ci(cell: dict | None, fmt: str = ".3f", scale: float = 1.0) -> str:
    """'mean ± ci95' of a summary cell; one value has no interval ('± -', not a certain '± 0')."""
    if not cell or cell.get("mean") is None:
        return "-"
    if cell.get("n", 2) < 2:
        return f"{format(cell['mean'] * scale, fmt)} ± -"
    return f"{format(cell['mean'] * scale, fmt)} ± {format((cell['ci95'] or 0.0) * scale, fmt)}"


def simulate_points(args: argparse.Namespace, profile) -> list:
    from orbitflow.policies import ABLATIONS, BASELINES, policy_names
    from orbitflow.sim.sweep import MAX_DEVICE_KV_FRACTION, grid

    if args.policies == "all":
        policies = ["orbitflow", *BASELINES]
    else:
        policies = _names(args.policies, "--policies", policy_names(), also="or all: orbitflow and every baseline")
    if args.ablations:
        policies += [p for p in ABLATIONS if p not in policies]
    if args.victims:  # the default rule is OrbitFlow itself: not run twice when it is in --policies
        default = PlannerConfig().victim
        policies += [f"orbitflow@{v}" for v in _names(args.victims, "--victims", VICTIM_CHOICES)
                     if not (v == default and "orbitflow" in policies)]
    slo_scales = _floats(args.slo_scales, "--slo-scales")
    rate_scales = _floats(args.rate_scales, "--rate-scales")
    fractions = [None]  # None: the setup's budget (0.5 of the largest batch, or a trace file's own)
    if args.device_kv_fraction is not None and not args.device_kv_blocks:
        fractions = _floats(args.device_kv_fraction, "--device-kv-fraction")
        if max(fractions) > MAX_DEVICE_KV_FRACTION:
            raise CLIError(f"--device-kv-fraction must list fractions in (0, {MAX_DEVICE_KV_FRACTION:g}], got "
                           f"{args.device_kv_fraction!r}")
    links = [None] if args.link_gbps is None else _floats(args.link_gbps, "--link-gbps")
    slots = [None] if args.prefetch_slots == "policy" else _ints(args.prefetch_slots, "--prefetch-slots")
    orders = _names(args.kv_link, "--kv-link", LINK_CHOICES)
    deposit = (True, False) if args.no_deposit_runs else (True,)
    return [point for f, link, d, order in itertools.product(fractions, links, slots, orders)
            for point in grid(policies, slo_scales, rate_scales, deposit, device_kv_fraction=f, link_gbps=link,
                              prefetch_slots=d, kv_link=order)]


SIMULATE_PLANNER_FLAGS = ("alpha", "window_min", "window_max", "plan_node_limit", "plan_time_limit_ms", "plan_gap")
SIMULATE_SCHEDULER_FLAGS = ("scheduling", "chunked_prefill")


def cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from orbitflow.bench.workload import STEP_S_WITHOUT_TRACE, TraceError, load_trace_file
    from orbitflow.plan.hardware import ProfileError, resolve_profile
    from orbitflow.sim.sweep import SimSetup, config_record, noise_cv_for, run_points, summarize

    try:
        profile = resolve_profile(args.profile or args.preset)
    except (ProfileError, OSError, KeyError, ValueError) as exc:
        raise CLIError(f"--preset/--profile: {exc}") from None
    check_output_path(args.json, "--json")  # before the sweep, not after it
    check_output_path(args.plots, "--plots", directory=True)
    if args.workers is not None and args.workers < 1:
        raise CLIError(f"--workers must be >= 1 (default: one per core), got {args.workers}")
    if args.step_s is not None and not args.trace:
        raise CLIError(STEP_S_WITHOUT_TRACE)
    if args.trace:
        try:
            loaded = load_trace_file(args.trace, step_s=args.step_s)
        except TraceError as exc:
            raise CLIError(f"--trace: {exc}") from None
        if not len(loaded.trace):
            raise CLIError(f"--trace: {args.trace}: the trace has no requests")
    points = simulate_points(args, profile)
    engine = {k: getattr(args, k) for k in SIMULATE_PLANNER_FLAGS + SIMULATE_SCHEDULER_FLAGS
              if hasattr(args, k)}  # the flags given
    EngineConfig.build(**engine)  # a bad value names its flag now, not inside a worker
    try:
        setup = SimSetup(
            device_kv_blocks=args.device_kv_blocks,
            noise_cv=noise_cv_for(args.noise_cv, profile), solver_time=args.solver_time, seeds=args.seeds,
            first_seed=args.seed,
            num_requests=args.num_requests, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, trace_path=args.trace, step_s=args.step_s,
            engine=engine,
        )
        setup.check(profile)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    total = len(points) * setup.seeds
    with tqdm(total=total, desc=f"simulate {profile.name}", unit="run", disable=not sys.stderr.isatty()) as bar:
        runs = run_points(profile, setup, points, workers=args.workers, progress=lambda *_: bar.update(1))
    summary = summarize(runs)
    config = config_record(profile, setup, points)
    print_simulate_tables(summary, config)
    _write_simulate_outputs(args, {"config": config, "summary": summary, "runs": runs})
    return 0


def _write_simulate_outputs(args: argparse.Namespace, result: dict) -> None:
    """--json and --plots of a finished sweep. Their paths were checked before it; a write can still fail (a full
    disk, a path the checks cannot see into): then say which flag, after the tables."""
    from orbitflow.bench.metrics import finite_or_none
    from orbitflow.sim.sweep import with_no_deposit

    if args.json:
        try:
            with open(args.json, "w") as fh:  # strict JSON: a statistic of nothing (NaN) is null
                json.dump(finite_or_none(result), fh, indent=1, allow_nan=False)
        except OSError as exc:
            raise CLIError(f"--json {args.json}: {exc.strerror or exc} (the tables above hold the summary)") from None
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plots:
        from orbitflow.bench.plots import write_plots

        try:
            paths = write_plots(with_no_deposit(result["runs"]), args.plots)
        except OSError as exc:
            raise CLIError(f"--plots {args.plots}: {exc.strerror or exc}") from None
        for path in paths:
            print(f"wrote {path}", file=sys.stderr)


def print_simulate_tables(summary: list[dict], config: dict) -> None:
    from orbitflow.bench.metrics import format_table

    columns = [("label", "Policy"), ("rate_scale", "Rate x"), ("dep", "Deposit"), ("blocks", "Budget"),
               ("link", "GB/s"), ("tbt", "TBT att"), ("tpot", "TPOT att"), ("p95", "P95 TBT s"),
               ("p99", "P99 TBT s"), ("ttft", "TTFT s"), ("e2e", "E2E s"), ("rpm", "req/min"), ("tps", "tok/s"),
               ("mem", "Dev mem"), ("pauses", "Pauses"), ("rejected", "Rejected")]
    for s in sorted({r["slo_scale"] for r in summary}):
        rows = [{"label": r["label"], "rate_scale": r["rate_scale"], "dep": "on" if r["token_deposit"] else "off",
                 "blocks": r["device_kv_blocks"], "link": round(r["link_gbps"], 2),
                 "tbt": fmt_ci(r["tbt_attainment"]), "tpot": fmt_ci(r["tpot_attainment"]),
                 "p95": fmt_ci(r["p95_tbt_s"]), "p99": fmt_ci(r["p99_tbt_s"]), "ttft": fmt_ci(r["ttft_mean_s"], ".1f"),
                 "e2e": fmt_ci(r["e2e_mean_s"], ".0f"), "rpm": fmt_ci(r["throughput_rpm"], ".2f"),
                 "tps": fmt_ci(r["tokens_per_s"], ".1f"), "mem": fmt_ci(r["device_mem_util"], ".2f"),
                 "pauses": fmt_ci(r["num_pauses"], ".1f"), "rejected": fmt_ci(r["rejected"], ".1f")}
                for r in summary if r["slo_scale"] == s]
        work = f"trace {config['trace']}" if config["trace"] else f"{config['num_requests']} requests"
        print(format_table(rows, columns, title=f"{config['preset']} | SLO scale {s} | mean ± 95% CI over "
                                                f"{len(config['seeds'])} seeds x {work} | "
                                                f"noise CV {config['noise_cv']} | solver time {config['solver_time']}"))
        print()


# ---- plan ----------------------------------------------------------------------------------------------
def _plan_request(text: str, index: int, block_size: int, slo_s: float):
    from orbitflow.plan import PlanRequest

    fields = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("tokens", "left", "deposit", "slo_ms"):
            raise CLIError(f"--request {text!r}: expected tokens=N[,left=N][,deposit=N][,slo_ms=X]")
        if key.strip() in fields:
            raise CLIError(f"--request {text!r}: {key.strip()} is given twice")
        try:
            fields[key.strip()] = float(value)
        except ValueError:
            raise CLIError(f"--request {text!r}: {key} must be a number") from None
        if not math.isfinite(fields[key.strip()]):
            raise CLIError(f"--request {text!r}: {key} must be a finite number")
    if "tokens" not in fields or fields["tokens"] < 1:
        raise CLIError(f"--request {text!r}: tokens=N (N >= 1) is required")
    if fields.get("deposit", 0.0) < 0:  # a Token-Deposit balance: the planner would read a negative one as 0
        raise CLIError(f"--request {text!r}: deposit must be >= 0 (the request's banked Token-Deposit balance)")
    for key in ("tokens", "left"):
        if key in fields and not fields[key].is_integer():
            raise CLIError(f"--request {text!r}: {key} must be a whole number of tokens")
    tokens = int(fields["tokens"])
    try:
        return PlanRequest(f"r{index}", -(-tokens // block_size), tokens,
                           int(fields["left"]) if "left" in fields else None, fields.get("deposit", 0.0),
                           fields["slo_ms"] / 1000 if "slo_ms" in fields else slo_s)
    except ValueError as exc:  # PlanRequest's own checks (left >= 0, slo > 0, ...)
        raise CLIError(f"--request {text!r}: {exc}") from None


def _paced(request, guard_ms: float | None):
    """``request`` as the engine plans it: for its SLO less --deposit-guard-ms (serve's default is 'auto')."""
    from dataclasses import replace

    from orbitflow.runtime.deposit import pace_s

    try:
        return replace(request, slo_s=pace_s(guard_ms, request.slo_s))
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _why_infeasible(planner, requests, cap_source: str = "--device-kv-blocks", slo_name: str = "the SLO",
                    cut: str | None = None) -> str:
    """One line on why no placement of ``requests`` is feasible, read from the two extreme placements.
    ``cap_source`` names where the device budget came from (the flag, or the profile when the flag is unset);
    ``slo_name`` what the requests' SLO is (the SLO less --deposit-guard-ms when there is a guard). ``cut``: what
    stopped a search that found no plan before it proved there is none; then, unless an extreme placement shows
    why, the line says so instead of ruling every placement out."""
    import numpy as np

    from orbitflow.plan import Placement

    shape = (len(requests), planner.num_layers)
    host = planner.evaluate(Placement.from_mask(np.zeros(shape, bool)), requests)
    cap = planner.capacity_blocks
    if host.memory_blocks > cap:
        return (f"the batch does not fit: with every layer on the host its prefetch buffers alone take "
                f"{host.memory_blocks:.0f} blocks, more than the {cap:.0f} of {cap_source}")
    if host.expiry_step is not None and host.expiry_step < planner.min_steps:
        return (f"the batch does not fit for --window-min {planner.min_steps} steps: with every layer on the host "
                f"its prefetch buffers outgrow the {cap:.0f} blocks of {cap_source} at step {host.expiry_step}")
    device = planner.evaluate(Placement.from_mask(np.ones(shape, bool)), requests)
    slo_ms = 1000 * min(q.slo_s for q in requests)
    if device.predicted_step_s * 1000 > slo_ms:
        return (f"the SLO cannot be met: with every layer on the device a step takes "
                f"{1000 * device.predicted_step_s:.1f} ms, over {slo_name} of {slo_ms:.1f} ms "
                f"(raise --slo-ms or --slo-scale)")
    if cut is not None:
        return (f"{cut} stopped the search before it found a placement that fits in {cap:.0f} device blocks and meets "
                f"{slo_name} ({slo_ms:.1f} ms): whether one exists is not decided")
    return (f"no placement that fits in {cap:.0f} device blocks meets {slo_name} ({slo_ms:.1f} ms) over "
            f"--window-min {planner.min_steps} steps: waiting for the offloaded KV makes the steps too slow "
            f"(every layer on the device would take {device.memory_blocks:.0f} blocks and step in "
            f"{1000 * device.predicted_step_s:.1f} ms)")


WATCH_AFTER_S = 1.0  # a solve running this long shows its progress (a live line on a terminal)
WATCH_EVERY_S = 30.0  # ... and, on a stream that is not a terminal, a line this often after the first


def _watched_plan(planner, requests) -> tuple:
    """``planner.plan(requests)`` on a worker thread, watched from this one: Ctrl-C stops the search there with the best
    plan found so far (a second one quits), and a solve that runs past ``WATCH_AFTER_S`` shows its progress on stderr:
    a live line on a terminal, else a line now and then. Returns ``(plan, stopped)``. A search runs in compiled code
    that Python's Ctrl-C cannot reach, so this thread waits for it and asks it to stop
    (:class:`orbitflow.plan.SearchControl`)."""
    import threading
    import time

    from tqdm import tqdm

    from orbitflow.plan import SearchControl

    control, result, done = SearchControl(), {}, threading.Event()

    def solve() -> None:
        try:
            result["plan"] = planner.plan(requests, control=control)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=solve, name="orbitflow-plan", daemon=True)
    start, say_at = time.perf_counter(), WATCH_AFTER_S
    live = tqdm(total=None, unit=" nodes", file=sys.stderr, delay=WATCH_AFTER_S, disable=not sys.stderr.isatty(),
                desc="searching (Ctrl-C: stop with the best plan found)", dynamic_ncols=True)
    worker.start()
    with live:
        while not done.is_set():
            try:  # an Event, not Thread.join: a join that Ctrl-C interrupts can leave the thread looking finished
                done.wait(0.2)
                best = f"best {1000 * control.best_s:.3f} ms" if math.isfinite(control.best_s) else "no plan yet"
                live.update(control.nodes - live.n)
                live.set_postfix_str(best, refresh=False)
                waited = time.perf_counter() - start
                if live.disable and waited >= say_at and not control.stopped:
                    say_at = waited + WATCH_EVERY_S
                    print(f"searching: {waited:.0f} s, {control.nodes} nodes, {best} (Ctrl-C: stop with the best "
                          "plan found)", file=sys.stderr, flush=True)
            except KeyboardInterrupt:
                if control.stopped:
                    raise  # a second Ctrl-C: quit (the worker is a daemon thread)
                control.stop()
                live.write("stopping the search: the best plan found so far follows (Ctrl-C again to quit)",
                           file=sys.stderr)
    if "error" in result:
        raise result["error"]
    return result["plan"], control.stopped


def _search_outcome(plan, stopped: bool, gap: float) -> str:
    """``orbitflow plan``'s "search": how far the search went."""
    if plan.stats.exact:
        if stopped and not plan.stats.expiry_exact:
            return "complete; Ctrl-C stopped its expiry checks (the plan's expiry_step is then the first they left)"
        return "complete"
    if stopped:
        return "stopped by Ctrl-C: the best plan found" if plan.feasible else "stopped by Ctrl-C before any plan"
    if plan.stats.proven(gap):
        return f"within --plan-gap {gap:g}"
    return "budget reached" if plan.feasible else "budget reached before any plan"


def cmd_plan(args: argparse.Namespace) -> int:
    from orbitflow.bench.metrics import finite_or_none
    from orbitflow.plan import warm_up
    from orbitflow.plan.hardware import ProfileError, resolve_profile
    from orbitflow.policies.base import PlanContext, default_slo_s

    try:
        profile = resolve_profile(args.profile or args.preset)
    except (ProfileError, OSError, KeyError, ValueError) as exc:
        raise CLIError(f"--preset/--profile: {exc}") from None
    budget = profile.device_kv_blocks if args.device_kv_blocks is None else args.device_kv_blocks
    cap_source = ("--device-kv-blocks" if args.device_kv_blocks is not None
                  else "the profile's device_kv_blocks (pass --device-kv-blocks to override it)")
    config = engine_config(args, block_size=profile.block_size, device_kv_blocks=budget)
    slo_s = default_slo_s(config, profile)  # the engine's: --slo-ms, else the scale x the base SLO at this budget
    requests = [_paced(_plan_request(t, i, profile.block_size, slo_s), config.planner.deposit_guard_ms)
                for i, t in enumerate(args.request)]
    guarded = config.planner.deposit_guard_ms != 0
    planner = PlanContext.from_profile(config, profile).planner(space=args.space)
    warm_up()  # load the compiled planner first: solve_s is the solve's, not numba's cache load (~1-3 s cold)
    plan, stopped = _watched_plan(planner, requests)
    cut = None if plan.stats.exact else "Ctrl-C" if stopped else "the node or time budget"
    out = {
        "feasible": plan.feasible, "why": None if plan.feasible else _why_infeasible(
            planner, requests, cap_source, "the pace (the SLO less --deposit-guard-ms)" if guarded else "the SLO",
            cut),
        "distances": list(plan.distances) if plan.distances else None,
        "host_layers": [plan.placement.host_layers(i) for i in range(len(requests))] if plan.placement else None,
        "predicted_step_s": plan.predicted_step_s, "window": plan.window, "expiry_step": plan.expiry_step,
        "memory_blocks": plan.memory_blocks, "capacity_blocks": config.cache.device_kv_blocks,
        "victims": list(plan.victims), "solve_s": plan.stats.solve_s, "slo_s": slo_s,
        "search": "local search, no proof" if args.space == "full" else _search_outcome(plan, stopped, planner.gap),
        "optimality_gap": plan.stats.gap,
    }
    if args.json:
        print(json.dumps(finite_or_none(out), allow_nan=False))
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
    _add_generate_parser(sub)

    from orbitflow.bench.client import add_bench_parser
    from orbitflow.serve.server import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    _add_simulate_parser(sub)
    _add_plan_parser(sub)
    _add_profile_parser(sub)
    return parser


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="greedy (or sampled) generation for a few prompts, offline",
                       formatter_class=HelpFormatter)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--placement", default=None, metavar="SPEC",
                   help="fixed placement: none | all | distance:D | random:SEED (default: the --policy plans)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--json", action="store_true", help="print one JSON object with outputs and stats")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help=PROFILE_FLAG_HELP + "; with --placement: a rough one, enough for a fixed placement")
    add_engine_args(p, defaults={"max_num_seqs": None}, skip=SERVING_ONLY,
                    helps={"max_num_seqs": "sequences decoded together (default: one per --prompt)"})
    p.set_defaults(func=cmd_generate)


def _add_simulate_parser(sub) -> None:
    from orbitflow.sim.sweep import (
        DEFAULT_DEVICE_KV_FRACTION,
        DEFAULT_NOISE_CV,
        DEFAULT_NUM_REQUESTS,
        DEFAULT_SEEDS,
        SOLVER_TIME_HELP,
    )

    p = sub.add_parser("simulate", help="paper-scale sweeps of policies on the simulator (tables, JSON, plots)",
                       description="With no flags: the paper's setup (device budget 0.5 of the largest batch, noise "
                                   "on, planner solve time charged, 5 seeds x 64 requests, every policy at SLO "
                                   "scales 1/1.5/2.5 and rate scales 1/3/5).",
                       formatter_class=HelpFormatter)
    hw = p.add_mutually_exclusive_group()
    hw.add_argument("--preset", default="a5000-llama3-8b", help="hardware preset (see orbitflow.plan presets)")
    hw.add_argument("--profile", default=None,
                    help="a profile JSON file (from `orbitflow profile`) instead of a preset")
    p.add_argument("--policies", default="all", help="'all' (OrbitFlow and every baseline) or a comma list")
    p.add_argument("--ablations", action="store_true", help="also run the ablation steps of paper Fig. 13a")
    p.add_argument("--victims", default=None, metavar="LIST",
                   help="also run OrbitFlow with each of these pause-victim rules (paper Fig. 13c), e.g. "
                        "longest,shortest,random (OrbitFlow's own rule, largest-kv+deposit, runs once, as "
                        "'orbitflow', when --policies has it)")
    p.add_argument("--slo-scales", default="1,1.5,2.5", help="comma list of SLO scales")
    p.add_argument("--rate-scales", default="1,3,5", help="comma list of arrival-rate scales (x the paper's 0.97/min)")
    p.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS, help="requests per run")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS,
                   help="runs per point, seeds --seed.. (each its own trace and noise); tables show mean ± 95%% CI")
    add_config_args(p, ModelRunConfig, only=("seed",), helps={"seed": "first seed"})
    add_config_args(p, SchedulerConfig, only=("max_num_seqs", "max_num_batched_tokens"))
    _add_simulate_engine_args(p)
    p.add_argument("--device-kv-fraction", default=None, metavar="F[,F...]",
                   help=f"device KV budget as a fraction of the largest batch's KV (max-num-batched-tokens, every "
                        f"layer); a comma list sweeps it (default: {DEFAULT_DEVICE_KV_FRACTION}, the paper's setup, "
                        f"about 16K of 32K tokens, or a --trace file's own GPU block budget)")
    add_config_args(p, CacheConfig, only=("device_kv_blocks",), defaults={"device_kv_blocks": None},
                    helps={"device_kv_blocks": "device KV budget in layer-blocks (overrides --device-kv-fraction "
                                               "and a trace's own)"})
    _add_simulate_link_args(p)
    p.add_argument("--noise-cv", type=float, default=None,
                   help="CV of the seeded lognormal noise, one factor per step on its compute and transfers, unseen by "
                        "the planner (0: the planner's model exactly) (default: the profile's measured step jitter, "
                        f"step_noise_cv, written by `orbitflow profile`; else {DEFAULT_NOISE_CV})")
    p.add_argument("--solver-time", default="measured", help=SOLVER_TIME_HELP)
    p.add_argument("--no-deposit-runs", action="store_true",
                   help="also run every point without Token-Deposit (paper Fig. 13b)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay this trace file (the project's format or the paper artifact's JSON) instead of "
                        "generating one per seed; --rate-scales then compress its arrivals")
    p.add_argument("--step-s", type=float, default=None, metavar="S",
                   help="seconds per scheduler step, to convert an artifact trace's arrival_time")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: one per core)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write {config, summary (mean and ci95 per metric), runs (one per seed)} as JSON")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots mirroring paper Figs. 9-13")
    p.set_defaults(func=cmd_simulate)


def _add_simulate_link_args(p) -> None:
    """The link flags of simulate: its rate, the prefetch depth and the link order, each a sweepable list."""
    p.add_argument("--link-gbps", default=None, metavar="X[,X...]",
                   help="host-to-device link rate in GB/s (default: the profile's); a comma list sweeps it")
    p.add_argument("--prefetch-slots", default="policy", metavar="policy|D[,D...]",
                   help="prefetch depth (KV buffer slots per request): 'policy' = each policy's real one "
                        "(DeepSpeed, FlexGen and FlexGen+ 2, others 1), or a comma list of depths for every policy")
    p.add_argument("--kv-link", default="edf", metavar="edf|preemptive[,...]",
                   help="link order of the KV prefetches, which the planner plans for (edf: a copy holds the link to "
                        "its end; preemptive: it yields to an earlier layer's; chunk switches free); a comma list "
                        "sweeps it (default %(default)s)")


def _add_simulate_engine_args(p) -> None:
    """The scheduler and planner flags of simulate: absent unless given (then the engine's defaults hold)."""
    add_config_args(p, SchedulerConfig, only=SIMULATE_SCHEDULER_FLAGS,
                    defaults=dict.fromkeys(SIMULATE_SCHEDULER_FLAGS, argparse.SUPPRESS),
                    helps={f.name: f"{f.metadata['help']} (engine default: {f.default or 'off'})"
                           for f in fields(SchedulerConfig) if f.name in SIMULATE_SCHEDULER_FLAGS})
    add_config_args(p, PlannerConfig, "planner (every policy that plans; default: the engine's, shown)",
                    only=SIMULATE_PLANNER_FLAGS, defaults=dict.fromkeys(SIMULATE_PLANNER_FLAGS, argparse.SUPPRESS),
                    helps={f.name: f.metadata["help"] + ("" if "(default:" in f.metadata["help"] else
                                                          f" (engine default: {f.default})")
                           for f in fields(PlannerConfig) if f.name in SIMULATE_PLANNER_FLAGS})


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="run the placement planner on a described batch",
                       formatter_class=HelpFormatter)
    p.add_argument("--request", action="append", required=True, metavar="tokens=N[,left=N][,deposit=N][,slo_ms=X]",
                   help="one request of the batch (repeat)")
    hw = p.add_mutually_exclusive_group()
    hw.add_argument("--preset", default="a5000-llama3-8b", help="hardware preset")
    hw.add_argument("--profile", default=None, help="a profile JSON file instead of a preset")
    add_config_args(p, CacheConfig, only=("device_kv_blocks",), defaults={"device_kv_blocks": None},
                    helps={"device_kv_blocks": "override the device KV budget (default: the profile's)"})
    add_config_args(p, PlannerConfig, "planner", helps={"slo_ms": "TBT SLO (default: --slo-scale x the base SLO)"},
                    only=("slo_ms", "slo_scale", "alpha", "window_min", "window_max", "victim", "plan_node_limit",
                          "plan_time_limit_ms", "plan_gap", "plan_threads", "deposit_guard_ms"))
    p.add_argument("--space", choices=("pruned", "uniform", "full"), default="pruned", help="search space")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)


def _add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine's engine and print a hardware profile (JSON)",
                       formatter_class=HelpFormatter)
    p.add_argument("--out", "--output", "-o", dest="output", default=None,
                   help="also write the profile to this file (then: orbitflow serve, generate, simulate or plan "
                        "--profile FILE)")
    # what the measurement depends on: the model, its device and threads, the KV pools and link, tensor parallelism,
    # and --max-num-seqs (the largest batch whose decode cost it measures); the other scheduler and planner flags, and
    # the seed (of sampling, the random victim rule and the simulator's noise), change nothing it measures
    unused = [dest_of(f) for cls in (SchedulerConfig, PlannerConfig) for f in fields(cls)
              if f.name != "max_num_seqs"] + ["seed"]
    helps = {"prefetch_slots": "prefetch depth: KV layers of one request in flight at once (default: 1, OrbitFlow's: "
                               "profile builds OrbitFlow's engine)",
             "max_num_seqs": "the largest batch the engine will run: each batch size up to it (at most 16) gets its "
                             "measured decode cost (default: 4)"}
    add_engine_args(p, skip=(*SERVING_ONLY, *unused), helps=helps)
    p.set_defaults(func=cmd_profile)


# Commands that load a model and measure the machine first (minutes on a small CPU box): they say so as they go.
_PROGRESS_LOGGED = ("generate", "profile", "bench")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in _PROGRESS_LOGGED:  # serve configures its own logging
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("orbitflow").setLevel(logging.INFO)
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
