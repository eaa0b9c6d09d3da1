"""Where does the real engine's step-to-step variance come from? Step-time CV with each fix on and off.

The engine's decode step on a 2-core CPU runs the compute thread, torch's intra-op threads and the KV copy
thread on the same cores under one GIL, and Python's cyclic GC may pause any step. This script runs the
same decode steps (SmolLM2-135M, a batch of 4, every other layer on the host behind a throttled link, so
the copy thread works) under each setting, interleaved in rounds so that a busy machine slows every
setting alike, and prints per setting the mean step time, its coefficient of variation (CV) and
p95 / median, each against the engine's old defaults measured in the same rounds.

Settings: torch intra-op threads (torch's default = the core count, or 1 = leave a core to the copy
thread), and GC (default, or `gc.freeze()` after loading + no collection inside a step).

Run: ``python benchmarks/engine_variance.py [--rounds 12] [--steps 8] [--json PATH]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from orbitflow.kv.manager import KVManager  # noqa: E402
from orbitflow.model.loader import load_model  # noqa: E402
from orbitflow.runtime.executor import ModelExecutor, SeqInput  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds (each runs every setting once)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per setting per round")
    parser.add_argument("--context", type=int, default=200, help="prompt tokens per request")
    parser.add_argument("--link-gbps", type=float, default=0.3)
    parser.add_argument("--json", default=None, help="write the raw step times and the summary here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    default_threads = torch.get_num_threads()
    loaded = load_model("smollm2-135m")
    mc = loaded.config
    batch, layers = 4, mc.num_layers
    blocks = layers * batch * (args.context + args.rounds * 4 * args.steps + 32) // 16
    kv = KVManager(layers, mc.num_kv_heads, mc.head_dim, blocks, blocks, dtype=next(loaded.model.parameters()).dtype,
                   link_bytes_per_s=args.link_gbps * 1e9)
    ex = ModelExecutor(loaded.model, mc, kv)
    placement = [layer % 2 == 0 for layer in range(layers)]  # every other layer on the host
    pos = {}
    for r in range(batch):
        kv.allocate(r, 0, [True] * layers)
        kv.grow(r, args.context)
        ex.step([SeqInput(r, [1 + (j * 7 + r) % 200 for j in range(args.context)], 0)])
        kv.apply_placement(r, placement)
        pos[r] = args.context

    settings = {  # name: (torch threads, hold GC in steps and freeze)
        "before (torch threads, GC on)": (default_threads, False),
        "1 compute thread": (1, False),
        "GC held + frozen": (default_threads, True),
        "1 thread + GC held (engine now)": (1, True),
    }
    times = {name: [] for name in settings}
    rng = random.Random(args.seed)
    for _ in range(args.rounds):
        order = list(settings)
        rng.shuffle(order)
        for name in order:
            threads, hold = settings[name]
            torch.set_num_threads(threads)
            ex.hold_gc = hold
            if hold:
                gc.collect()
                gc.freeze()
            else:
                gc.unfreeze()
            for _ in range(args.steps):
                for r in range(batch):
                    kv.grow(r, pos[r] + 1)
                res = ex.step([SeqInput(r, [1], pos[r]) for r in range(batch)])
                for r in range(batch):
                    pos[r] += 1
                times[name].append(res.step_s)
    kv.close()

    base = list(settings)[0]
    summary = {}
    print(f"SmolLM2-135M, batch {batch}, ~{args.context}-token contexts, every other layer on the host, link "
          f"{args.link_gbps} GB/s; {args.rounds} interleaved rounds x {args.steps} steps; torch default threads "
          f"{default_threads}, os.cpu_count() {os.cpu_count()}")
    print(f"{'setting':34s} {'mean ms':>8s} {'CV':>7s} {'p95/p50':>8s} {'CV vs before':>13s} {'mean vs before':>15s}")
    for name, ts in times.items():
        a = np.asarray(ts)
        cv = float(a.std() / a.mean())
        p95 = float(np.percentile(a, 95) / np.median(a))
        summary[name] = {"mean_ms": 1000 * float(a.mean()), "cv": cv, "p95_over_p50": p95, "n": len(ts)}
        b = summary[base]
        print(f"{name:34s} {1000 * a.mean():8.1f} {100 * cv:6.1f}% {p95:8.2f} {cv / b['cv']:12.2f}x "
              f"{a.mean() / (b['mean_ms'] / 1000):14.2f}x")
    # Per-round CVs give a spread for the CV itself (rounds are independent samples of each setting).
    for name, ts in times.items():
        per_round = [float(np.std(ts[i:i + args.steps]) / np.mean(ts[i:i + args.steps]))
                     for i in range(0, len(ts), args.steps)]
        summary[name]["cv_per_round_median"] = statistics.median(per_round)
    print("median within-round CV: " + ", ".join(f"{n}: {100 * s['cv_per_round_median']:.1f}%"
                                                  for n, s in summary.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": summary, "times_s": times, "args": vars(args)}, fh, indent=1)


if __name__ == "__main__":
    main()
