"""Token-Deposit's guard band: how often the stream a client receives misses the SLO, per --deposit-guard-ms.

Token-Deposit holds tokens back while the engine generates faster than the SLO and releases them one pace apart. The
server's streams sleep until each token is due (`serve/async_engine.py`), so a token leaves a little late whenever the
event loop wakes late (its timers, the GIL held by the engine thread). Paced exactly one SLO apart, every token that
leaves later than the one before it misses the SLO by that much at the client, although the deposit's schedule meets
it. The guard paces under the SLO (and the planner plans for that pace) so the jitter stays inside it.

Each arm serves the same streams (SmolLM2-135M, greedy, `--streams` concurrent requests of `--tokens` tokens, the
SLO `--slo-scale` times the decode step measured first) through the server's own AsyncEngine, in rounds that run every
arm once in a shuffled order, and times each token as the consumer receives it. Per arm: the share of gaps between
consecutive received tokens over the SLO (mean and 95% CI over rounds), the mean paced gap (what the guard costs: the
pace is faster, so the deposit runs dry sooner), and the ratio of the miss share to that of guard 0 in the same run.

Run: ``python benchmarks/deposit_guard.py [--guards 0,auto,5,10] [--rounds 3] [--md docs/results/deposit_guard.md]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import numpy as np  # noqa: E402

from orbitflow.config import EngineConfig, float_or_auto  # noqa: E402
from orbitflow.llm import LLM  # noqa: E402
from orbitflow.model.loader import load_model  # noqa: E402
from orbitflow.runtime.deposit import SLO_TOLERANCE_S, guard_s  # noqa: E402
from orbitflow.runtime.sampling import SamplingParams  # noqa: E402
from orbitflow.serve.async_engine import AsyncEngine  # noqa: E402
from orbitflow.sim.sweep import mean_ci95  # noqa: E402

PROMPT = "Tell me a long story about a cat who sails around the world."


def parse_guard(text: str) -> float | None:
    return float_or_auto(text.strip())


async def _stream(engine: AsyncEngine, rid: str, prompt_ids: list[int], tokens: int) -> list[float]:
    """Receive times of one request's tokens, as a client of the server's bridge sees them."""
    stamps = []
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    async for out in engine.generate(rid, prompt_ids, params):
        if out.token_id is not None:
            stamps.append(time.perf_counter())
    return stamps


def run_arm(loaded, guard_ms: float | None, slo_ms: float, streams: int, tokens: int, tag: str) -> dict:
    """Serve `streams` requests at once under one guard; the gaps each consumer saw."""
    llm = LLM(EngineConfig.build(model="smollm2-135m", slo_ms=slo_ms, deposit_guard_ms=guard_ms,
                                 max_num_seqs=streams), profile="rough", loaded=loaded)
    engine = AsyncEngine(llm.engine, llm.tokenizer)
    engine.start()
    try:
        prompt_ids = llm.tokenizer.encode(PROMPT)

        async def serve() -> list[list[float]]:
            return await asyncio.gather(*(_stream(engine, f"{tag}-{i}", prompt_ids, tokens) for i in range(streams)))

        received = asyncio.run(serve())
        ended = {r.request_id: r for r in llm.engine.finished}
        reqs = [ended[f"{tag}-{i}"] for i in range(streams)]
    finally:
        engine.shutdown()
        llm.close()
    slo = slo_ms / 1000
    gaps, every = [], []
    for stamps, req in zip(received, reqs):
        g = np.diff(stamps)
        # the gaps the deposit paced (it held the token), before the finish flushes the rest at once
        due, gen = np.array(req.delivered_s), np.array(req.generated_s)
        was_held = (due > gen + 1e-9)[1:len(g) + 1]
        flushed = (due >= req.finished_s - 1e-9)[1:len(g) + 1] if req.finished_s is not None else False
        keep = was_held & ~flushed
        gaps.extend(g[keep].tolist())
        every.extend(g.tolist())
    gaps_arr = np.array(gaps)
    return {"guard_ms": "auto" if guard_ms is None else guard_ms, "guard_s": guard_s(guard_ms, slo),
            "paced_gaps": len(gaps), "all_gaps": len(every),
            "miss_share": float(np.mean(gaps_arr > slo + SLO_TOLERANCE_S)) if len(gaps) else float("nan"),
            "miss_excess_ms_p50": float(np.median(gaps_arr[gaps_arr > slo] - slo) * 1000) if (gaps_arr > slo).any()
            else 0.0,
            "paced_gap_ms": float(np.mean(gaps_arr) * 1000) if len(gaps) else float("nan")}


def measure_step_ms(loaded, streams: int) -> float:
    """The decode step of `streams` requests on this machine (no pacing: the deposit off)."""
    llm = LLM(EngineConfig.build(model="smollm2-135m", token_deposit=False, max_num_seqs=streams),
              profile="rough", loaded=loaded)
    try:
        prompt_ids = llm.tokenizer.encode(PROMPT)
        reqs = llm.generate([prompt_ids] * streams, SamplingParams(max_tokens=24, ignore_eos=True))
        gaps = [b - a for r in reqs for a, b in zip(r.generated_s[4:], r.generated_s[5:])]
        return 1000 * float(np.median(gaps))
    finally:
        llm.close()


def markdown(rows: list[dict], meta: dict) -> str:
    base = next((r for r in rows if r["guard"] == "0"), None)
    lines = [
        "## Token-Deposit's guard band: SLO misses of the stream a client receives",
        "",
        f"Produced by `{meta['command']}` on {meta['when']} ({meta['machine']}; load average at the start "
        f"{meta['load']:.1f}), seed {meta['seed']}. SmolLM2-135M greedy on the CPU engine behind the server's "
        f"AsyncEngine, {meta['streams']} concurrent streams of {meta['tokens']} tokens, decode step measured at "
        f"{meta['step_ms']:.1f} ms, SLO {meta['slo_ms']:.1f} ms ({meta['slo_scale']:g}x); {meta['rounds']} rounds, "
        "each arm once per round in a shuffled order; mean ± 95% CI over rounds.",
        "",
        "'missed': share of the gaps the deposit paced (the token was held, and not flushed at the finish) that "
        "exceed the SLO at the receiving end; 'paced gap': their mean (the guard's cost: a faster pace runs the "
        "deposit dry sooner); ratio: missed share over guard 0's, same run.",
        "",
        "| --deposit-guard-ms | guard ms | paced gaps | missed | missed by (p50 ms) | paced gap ms "
        "| missed vs guard 0 |",
        "|---|---|---|---|---|---|---|",
    ]
    def pct(stat: dict) -> str:  # an arm with no paced gap (a slow machine kept every deposit empty) has no share
        if stat["mean"] is None:
            return "-"
        return f"{100 * stat['mean']:.1f} ± " + ("-" if stat["ci95"] is None else f"{100 * stat['ci95']:.1f}") + "%"

    def num(value, fmt: str) -> str:
        return "-" if value is None or value != value else format(value, fmt)

    for r in rows:
        has_share = r["miss"]["mean"] is not None and base and base["miss"]["mean"]  # both arms paced a gap
        ratio = r["miss"]["mean"] / base["miss"]["mean"] if has_share else None
        lines.append(f"| {r['guard']} | {1000 * r['guard_s']:.2f} | {r['paced_gaps']} | {pct(r['miss'])} | "
                     f"{num(r['excess_ms'], '.2f')} | {num(r['paced_gap']['mean'], '.1f')} | {num(ratio, '.2f')} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guards", default="0,auto,5,10", help="comma list of --deposit-guard-ms values (0 first: the "
                                                             "baseline)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every arm once")
    ap.add_argument("--streams", type=int, default=2, help="concurrent requests per arm")
    ap.add_argument("--tokens", type=int, default=96, help="tokens per request")
    ap.add_argument("--slo-scale", type=float, default=1.5, help="SLO as a multiple of the measured decode step")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arms' order")
    ap.add_argument("--md", default=None, help="write the table here (markdown)")
    ap.add_argument("--json", default=None, help="write every arm's run here")
    args = ap.parse_args()
    guards = [g.strip() for g in args.guards.split(",") if g.strip()]
    try:
        values = {g: parse_guard(g) for g in guards}
    except argparse.ArgumentTypeError as exc:
        ap.error(f"--guards: {exc}")
    if args.rounds < 2:
        ap.error("--rounds must be >= 2 (a confidence interval needs two)")
    load = os.getloadavg()[0]
    loaded = load_model("smollm2-135m")
    step_ms = measure_step_ms(loaded, args.streams)
    slo_ms = args.slo_scale * step_ms
    print(f"decode step {step_ms:.1f} ms at batch {args.streams}: SLO {slo_ms:.1f} ms", file=sys.stderr)
    rng = random.Random(args.seed)
    runs: dict[str, list[dict]]
    too_wide = [g for g in guards if guard_s(values[g], slo_ms / 1000) >= slo_ms / 1000]
    for g in too_wide:  # a fast machine's SLO can be under a fixed guard: the engine refuses it
        print(f"--guards: skipping {g}: not under the SLO of {slo_ms:.1f} ms", file=sys.stderr)
    guards = [g for g in guards if g not in too_wide]
    runs = {g: [] for g in guards}
    for rnd in range(args.rounds):
        order = guards[:]
        rng.shuffle(order)
        for g in order:
            r = run_arm(loaded, values[g], slo_ms, args.streams, args.tokens, f"r{rnd}-{g}")
            runs[g].append(r)
            print(f"round {rnd} guard {g}: missed {100 * r['miss_share']:.1f}% of {r['paced_gaps']} paced gaps, "
                  f"paced gap {r['paced_gap_ms']:.1f} ms", file=sys.stderr)
    rows = []
    for g in guards:
        rs = runs[g]
        rows.append({"guard": g, "guard_s": rs[0]["guard_s"], "paced_gaps": sum(r["paced_gaps"] for r in rs),
                     "miss": mean_ci95(r["miss_share"] for r in rs),
                     "excess_ms": float(np.median([r["miss_excess_ms_p50"] for r in rs])),
                     "paced_gap": mean_ci95(r["paced_gap_ms"] for r in rs)})
    meta = {"command": "python benchmarks/deposit_guard.py " + " ".join(sys.argv[1:]),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "load": load, "seed": args.seed, "streams": args.streams, "tokens": args.tokens, "step_ms": step_ms,
            "slo_ms": slo_ms, "slo_scale": args.slo_scale, "rounds": args.rounds}
    md = markdown(rows, meta)
    print(md)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(md)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
