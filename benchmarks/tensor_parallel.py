"""Tensor parallelism on this machine: decode step time and stall at TP=1 and TP=N, each beside the planner's
prediction (the cost model of the profile that `orbitflow profile --tensor-parallel-size N` measures).

For every engine (TP=1, TP=N with per-rank links, optionally TP=N with one shared link) the script measures its
hardware profile the way `serve` does, then runs the same decode batches on it: `--batch` requests of
`--context` tokens, under each placement of `--placements`, `--steps` decode steps per repeat. The engines stay
up side by side and the repeats interleave them (the order alternates), so a busy machine slows all alike.
Reported: the median step time and stall over repeats x steps with the 25th-75th percentile, the cost model's
prediction for the same batch and placement, and each engine's step time over TP=1's.

Run: ``python benchmarks/tensor_parallel.py --tp 3 [--link-gbps 1] [--shared] [--md docs/results/tensor_parallel.md]``
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _engine(model: str, tp: int, tp_link: str, args):
    from orbitflow.config import EngineConfig
    from orbitflow.llm import LLM
    from orbitflow.policies import FixedPlacementPolicy

    config = EngineConfig.build(model=model, device_kv_blocks=args.device_kv_blocks,
                                host_kv_blocks=args.host_kv_blocks, link_gbps=args.link_gbps, max_num_seqs=args.batch,
                                tensor_parallel_size=tp, tp_link=tp_link)
    return LLM(config, policy=FixedPlacementPolicy("none"), profile="measure")


def _run_batch(llm, placement: str, args, seed: int) -> list[tuple[float, float, float, float]]:
    """(measured step, measured stall, predicted step, predicted stall) of each decode step of one batch."""
    from orbitflow.plan import Placement
    from orbitflow.policies.fixed import placement_row
    from orbitflow.runtime.executor import SeqInput

    kv, executor = llm.kv, llm.executor
    layers = executor.num_layers
    model = llm.profile.cost_model(prefetch_slots=1)
    rng = np.random.default_rng(seed)
    rids = [f"r{seed}-{i}" for i in range(args.batch)]
    rows = [list(map(bool, placement_row(placement, layers, rid))) for rid in rids]
    pos = {}
    out = []
    try:
        for rid, row in zip(rids, rows):
            kv.allocate(rid, 0, row)
            prompt = rng.integers(10, 1000, size=args.context).tolist()
            _grow(kv, rid, args.context)  # the engine's scheduler grows KV before a step; executors only compute
            executor.step([SeqInput(rid, prompt, 0)])
            pos[rid] = args.context
        mask = np.array(rows, dtype=bool)
        for _ in range(args.steps):
            seqs = [SeqInput(rid, [int(rng.integers(10, 1000))], pos[rid]) for rid in rids]
            for s in seqs:
                _grow(kv, s.req_id, s.start_pos + 1)
            est = model.step(Placement.from_mask(mask), [kv.blocks_for(pos[r]) for r in rids],
                             total_tokens=sum(pos[r] + 1 for r in rids))
            result = executor.step(seqs)
            for r in rids:
                pos[r] += 1
            out.append((result.step_s, result.stall_s, est.total_s, est.stall_s))
    finally:
        for rid in rids:
            kv.free(rid)
    return out[1:]  # the first decode step after the prefills is a warm-up


def _grow(kv, rid: str, tokens: int) -> None:
    short = kv.grow(rid, tokens)
    if short is not None:
        raise SystemExit(f"KV pools too small for the batch ({short}): raise --device-kv-blocks/--host-kv-blocks")


def _q(values: list[float]) -> tuple[float, float, float]:
    a = np.asarray(values) * 1000
    return float(np.median(a)), float(np.percentile(a, 25)), float(np.percentile(a, 75))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tp", type=int, default=3, help="the tensor-parallel size compared with TP=1")
    parser.add_argument("--shared", action="store_true", help="also run TP=N with one shared link (--tp-link shared)")
    parser.add_argument("--batch", type=int, default=2, help="requests per decode batch")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per batch (the first is discarded)")
    parser.add_argument("--repeats", type=int, default=3, help="batches per engine and placement, interleaved")
    parser.add_argument("--placements", default="none,distance:2,all",
                        help="comma-separated placement specs (none, all, distance:D, random:SEED)")
    parser.add_argument("--link-gbps", type=float, default=1.0, help="host link throttle per rank (GB/s)")
    parser.add_argument("--device-kv-blocks", type=int, default=4096)
    parser.add_argument("--host-kv-blocks", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="a sentence added to the --md fragment (how busy the machine was)")
    parser.add_argument("--md", default=None, help="write the results as a Markdown fragment to this path")
    args = parser.parse_args()
    from tqdm import tqdm

    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    variants = [(1, "per-rank"), (args.tp, "per-rank")] + ([(args.tp, "shared")] if args.shared else [])
    engines = {}
    started = time.time()
    for tp, link in tqdm(variants, desc="engines (profile measured)", unit="engine"):
        engines[(tp, link)] = _engine(args.model, tp, link, args)
    samples: dict[tuple, list] = {(v, p): [] for v in variants for p in placements}
    jobs = [(r, p) for r in range(args.repeats) for p in placements]
    with tqdm(total=len(jobs) * len(variants), desc="decode batches", unit="batch") as bar:
        for r, placement in jobs:
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                samples[(v, placement)] += _run_batch(engines[v], placement, args, seed=args.seed + r)
                bar.update(1)
    profiles = {v: engines[v].profile for v in variants}
    for llm in engines.values():
        llm.close()
    elapsed = time.time() - started

    header = ("| engine | placement | step ms, measured (p25-p75) | step ms, predicted | stall ms, measured | "
              "stall ms, predicted | step vs TP=1 |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    base = {p: _q([s[0] for s in samples[(variants[0], p)]])[0] for p in placements}
    for v in variants:
        for p in placements:
            rows = samples[(v, p)]
            step, stall = _q([s[0] for s in rows]), _q([s[1] for s in rows])
            pred_step, pred_stall = _q([s[2] for s in rows])[0], _q([s[3] for s in rows])[0]
            name = f"TP={v[0]}" + (f" ({v[1]} link)" if v[0] > 1 else "")
            lines.append(f"| {name} | {p} | {step[0]:.1f} ({step[1]:.1f}-{step[2]:.1f}) | {pred_step:.1f} | "
                         f"{stall[0]:.1f} ({stall[1]:.1f}-{stall[2]:.1f}) | {pred_stall:.1f} | "
                         f"{step[0] / base[p]:.2f}x |")
    prof_lines = ["| engine | decode_b ms | decode_a us/token | link GB/s per rank | "
                  "all-reduce ms (1 / 4 / 64 tokens) |",
                  "|---|---|---|---|---|"]
    for v, prof in profiles.items():
        tp_extra = prof.extra.get("tensor_parallel")
        if tp_extra:
            ar = np.median([[r[f"allreduce_{t}_tokens_s"] for t in (1, 4, 64)] for r in tp_extra["per_rank"]], axis=0)
            allreduce = " / ".join(f"{1000 * x:.2f}" for x in ar)
        else:
            allreduce = "-"
        name = f"TP={v[0]}" + (f" ({v[1]} link)" if v[0] > 1 else "")
        prof_lines.append(f"| {name} | {1000 * prof.decode_b:.2f} | {1e6 * prof.decode_a:.3f} | "
                          f"{prof.link_bytes_per_s / 1e9:.2f} | {allreduce} |")
    table = "\n".join(lines)
    print(table)
    print("\n".join(prof_lines))
    if args.md:
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        cmd = "python " + shlex.join(["benchmarks/tensor_parallel.py", *sys.argv[1:]])
        text = [
            "## Tensor parallelism", "",
            f"`{cmd}` on {platform.machine()} ({os.cpu_count()} CPUs, {platform.system()}), "
            f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {elapsed / 60:.1f} min; model {args.model}, "
            f"batch {args.batch} x {args.context} tokens, {args.steps - 1} measured decode steps x {args.repeats} "
            f"interleaved repeats per cell, link {args.link_gbps} GB/s per rank, seed {args.seed}"
            + (f"; load average at the end {load[0]:.1f}" if load else "") + ".",
            "",
            "Each engine's planner prediction comes from the hardware profile measured on that very engine "
            "(`orbitflow profile --tensor-parallel-size N`): per-rank compute, the rank's own link and its shard "
            "of the KV heads. On a CPU-only machine the ranks share the cores, so TP>1 is expected to be slower "
            "here (all-reduces over gloo, N processes on the same cores); the point is that the planner's "
            "per-rank accounting predicts the sharded engine as well as the single one.",
            "",
            table, "", "Profiles measured per engine:", "", "\n".join(prof_lines), "",
        ]
        if args.note:
            text += [args.note, ""]
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text("\n".join(text))
        print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
