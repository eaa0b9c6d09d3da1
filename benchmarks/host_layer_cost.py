"""What reading prefetched KV adds to a decode step's compute: per host layer, or per request and host layer?

The cost model charges the profile's ``host_layer_compute_s`` once per layer that some request reads from the host
(`CostModel.host_layer_compute`), and the profiler measures it with one request whose every layer is on the host.
This script measures, interleaved on one executor (default SmolLM2-135M on this machine, `--batch` 4 requests of each
of `--contexts` tokens, link unthrottled), the decode compute (`StepResult.compute_s`: stalls excluded) of three
placements of the batch, each against every layer on the device in the same round:

- one: request 0 offloads every 4th layer (L/4 host layers, L/4 requests' layers): one request, as the profiler's;
- shared: every request offloads those layers (L/4 host layers, L requests' layers);
- disjoint: request i offloads the layers l with l % 4 == i (every layer read from the host, L requests' layers);

and prints what the cost model's rule (``one``'s extra per host layer, times the host layers) and a per-request
rule (``one``'s extra per request's host layer, times those) predict for each, and the ratio of shared's extra to
disjoint's against each rule's (``one``'s extra is a few ms, within a step's noise; that ratio does not use it).
Which rule holds decides how much the planner charges plans that share host layers across requests against plans
that spread them.

Run: ``python benchmarks/host_layer_cost.py [--contexts 256,1024 --repeats 30] [--md docs/results/host_layer_cost.md]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys

import torch

from orbitflow.kv.manager import KVManager
from orbitflow.model.loader import load_model
from orbitflow.runtime.executor import ModelExecutor, SeqInput

MODEL = "smollm2-135m"


def placements(layers: int, batch: int) -> dict[str, list[list[bool]]]:
    """Per case, each request's row (True = on the device)."""
    every4 = [layer % 4 != 0 for layer in range(layers)]
    return {
        "device": [[True] * layers for _ in range(batch)],
        "one": [every4] + [[True] * layers for _ in range(batch - 1)],
        "shared": [list(every4) for _ in range(batch)],
        "disjoint": [[layer % 4 != i % 4 for layer in range(layers)] for i in range(batch)],
    }


def counts(rows: list[list[bool]]) -> tuple[int, int]:
    """(layers some request reads from the host, requests' host layers)."""
    return sum(not all(col) for col in zip(*rows)), sum(not x for row in rows for x in row)


def report(extras: dict[str, list[float]], cases: dict[str, list[list[bool]]]) -> list[str]:
    """One line per case: its extra compute (median and range over the rounds) and the two rules' predictions."""
    one = statistics.median(extras["one"])
    one_layers, one_pairs = counts(cases["one"])
    lines = ["case      host layers  requests' host layers  extra ms (median, [min, max])  per-layer rule  "
             "per-request rule"]
    for name in ("one", "shared", "disjoint"):
        layers, pairs = counts(cases[name])
        ex = extras[name]
        lines.append(f"{name:9s} {layers:11d}  {pairs:21d}  {1e3 * statistics.median(ex):8.2f} "
                     f"[{1e3 * min(ex):.2f}, {1e3 * max(ex):.2f}]      {1e3 * one / one_layers * layers:8.2f}  "
                     f"{1e3 * one / one_pairs * pairs:16.2f}")
    # one's extra is a few ms beside a step's noise; the ratio of the two batch-wide cases does not lean on it
    (sl, sp), (dl, dp) = counts(cases["shared"]), counts(cases["disjoint"])
    disjoint = statistics.median(extras["disjoint"])
    measured = f"{statistics.median(extras['shared']) / disjoint:.2f}" if disjoint > 0 else "-"
    lines.append(f"shared / disjoint: measured {measured}, per-layer rule {sl / dl:.2f}, "
                 f"per-request rule {sp / dp:.2f}")
    return lines


def measure(loaded, context: int, batch: int, repeats: int) -> tuple[dict, dict]:
    """Per case but ``device``, its decode compute less ``device``'s in the same round, one entry per round."""
    mc = loaded.config
    layers = mc.num_layers
    steps = 2 * repeats * 4 + 8  # decode steps each request takes
    blocks = batch * layers * (-(-(context + steps) // 16)) + 64
    kv = KVManager(layers, mc.num_kv_heads, mc.head_dim, blocks, blocks, block_size=16)
    executor = ModelExecutor(loaded.model, mc, kv)
    ids = [f"r{i}" for i in range(batch)]
    pos = dict.fromkeys(ids, context)

    def run(seqs):
        for s in seqs:
            if kv.grow(s.req_id, s.start_pos + len(s.token_ids)) is not None:
                raise RuntimeError("KV pools too small")
        return executor.step(seqs)

    def decode() -> float:
        result = run([SeqInput(r, [1], pos[r]) for r in ids])
        for r in ids:
            pos[r] += 1
        return result.compute_s

    cases = placements(layers, batch)
    extras: dict[str, list[float]] = {name: [] for name in cases if name != "device"}
    try:
        with torch.inference_mode():
            for r in ids:
                kv.allocate(r, 0, [True] * layers)
                run([SeqInput(r, [1 + (j % 100) for j in range(context)], 0)])
            names = list(cases)
            for i in range(repeats):
                measured = {}
                for name in names[i % len(names):] + names[:i % len(names)]:  # each case first in turn (drift)
                    rows = cases[name]
                    for r, row in zip(ids, rows):
                        kv.apply_placement(r, row)
                    decode()  # the first step after a move is not measured
                    measured[name] = decode()
                for name in extras:
                    extras[name].append(measured[name] - measured["device"])
    finally:
        kv.close()
    return extras, cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL, help="built-in model name or HF directory (default %(default)s)")
    ap.add_argument("--contexts", default="256,1024", help="prompt tokens per request, a comma list (default "
                                                           "%(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="requests, at least 4 (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=30, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--md", default=None, help="also write the result as a Markdown fragment to this path")
    args = ap.parse_args(argv)
    try:
        contexts = [int(x) for x in args.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts takes a comma list of token counts, got {args.contexts!r}")
    if min(contexts) < 16:
        ap.error(f"--contexts: every context must be >= 16 tokens, got {args.contexts}")
    if args.batch < 4:
        ap.error(f"--batch must be >= 4 (the disjoint case spreads every layer over 4 requests), got {args.batch}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    loaded = load_model(args.model)
    lines = []
    for context in contexts:
        extras, cases = measure(loaded, context, args.batch, args.repeats)
        lines += [f"{args.model}, {loaded.config.num_layers} layers, batch {args.batch} x {context} tokens, torch "
                  f"threads {torch.get_num_threads()}, {args.repeats} interleaved rounds", *report(extras, cases), ""]
    print("\n".join(lines))
    if args.md:
        command = "python benchmarks/host_layer_cost.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        intro = ("The cost model charges the profile's `host_layer_compute_s` once per layer that some request reads "
                 "from the host; the profiler measures it with one request. Interleaved on one executor, link "
                 "unthrottled: the decode compute (stalls excluded) of a batch where one request offloads every 4th "
                 "layer (one), where every request offloads those layers (shared), and where request i offloads the "
                 "layers l % 4 == i (disjoint), each less the all-device step of the same round; beside it what the "
                 "model's per-layer rule and a per-request rule predict from `one`.")
        with open(args.md, "w", encoding="utf-8") as fh:
            fh.write("\n".join([intro, "", "```", *lines, "```", "", f"Command: `{command}`  ",
                                f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
                                f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC."]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
