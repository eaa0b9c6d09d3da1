"""Decode throughput of the orbitflow engine vs transformers `generate`, SmolLM2-135M, greedy, same run.

Ours is what `orbitflow generate --placement none` runs: `orbitflow.llm.LLM` with every layer's KV on
the device (`FixedPlacementPolicy("none")`, profile "rough"), i.e. the whole engine loop, not just the
model. Theirs is `LlamaForCausalLM.from_pretrained(...).generate` (sdpa attention, left padding).

Decode tokens/s = batch * (N - 1) / (time of the last new token - time of the first): the first token
comes out of the prefill, so the span is the decode of the other N - 1 tokens, for both sides alike.
Ours stamps each token in the engine loop (`Request.generated_s`); theirs through a `streamer` that
`generate` calls once per new token. Runs are interleaved (ours, theirs, ours, ...) and each figure is
the median of the repeats; the time to the first token (prefill) is printed beside it.
Also prints the load time of SmolLM2 in a fresh process once the files are in the page cache.

Run: ``python benchmarks/engine_vs_hf.py [--quick]`` (prints tables only; no timed assertions).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from orbitflow.bench.metrics import format_table  # noqa: E402
from orbitflow.config import EngineConfig  # noqa: E402
from orbitflow.llm import LLM  # noqa: E402
from orbitflow.model.loader import LoadedModel, load_model  # noqa: E402
from orbitflow.policies import FixedPlacementPolicy  # noqa: E402
from orbitflow.runtime.sampling import SamplingParams  # noqa: E402

MODEL = "smollm2-135m"
PROMPTS = [
    "The history of the Roman empire",
    "Write a short poem about the sea and the wind that blows over it",
    "def fibonacci(n):",
    "Explain why the sky is blue in simple words, for a child of five years old.",
]

_LOAD_SNIPPET = """
import time
t0 = time.perf_counter()
from orbitflow.model.loader import load_model
t1 = time.perf_counter()
load_model({model!r})
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""


class _TokenStamps(BaseStreamer):
    """`generate` calls put() with the prompt, then once per new token (the whole batch at once)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


Runner = Callable[[int], tuple[float, float]]  # new tokens -> (time to first token, decode span of the rest)


def ours_runner(llm: LLM, prompts: list[list[int]]) -> Runner:
    def run(new_tokens: int) -> tuple[float, float]:
        start = llm.clock.now()
        reqs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        assert all(len(r.output_ids) == new_tokens for r in reqs)
        first = min(r.generated_s[0] for r in reqs)
        last = max(r.generated_s[-1] for r in reqs)
        return first - start, last - first

    return run


def hf_runner(hf: LlamaForCausalLM, loaded: LoadedModel, prompts: list[list[int]]) -> Runner:
    width = max(len(p) for p in prompts)
    pad = loaded.tokenizer.eos_token_ids[0]
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(new_tokens: int) -> tuple[float, float]:
        stamps = _TokenStamps()
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=pad, streamer=stamps)
        assert out.shape[1] == width + new_tokens and len(stamps.times) == new_tokens + 1
        return stamps.times[1] - start, stamps.times[-1] - stamps.times[1]

    return run


def second_load_s() -> tuple[float, float]:
    """(import, load_model) seconds of a fresh interpreter, the second of two (files cached by the first)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "..", "src"), os.environ.get("PYTHONPATH")) if p))
    out = ""
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _LOAD_SNIPPET.format(model=MODEL)], env=env, check=True,
                             capture_output=True, text=True).stdout
    imp, load = (float(x) for x in out.split()[-2:])
    return imp, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (~1 minute)")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per prompt (default 64, quick 24)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5, quick 3)")
    args = parser.parse_args()
    new_tokens = args.tokens or (24 if args.quick else 64)
    repeats = args.repeats or (3 if args.quick else 5)

    loaded = load_model(MODEL)
    hf = LlamaForCausalLM.from_pretrained(loaded.path, dtype=torch.float32, attn_implementation="sdpa").eval()
    llm = LLM(EngineConfig(model=MODEL, max_num_seqs=len(PROMPTS)), policy=FixedPlacementPolicy("none"),
              profile="rough", loaded=loaded)
    encoded = [loaded.tokenizer.encode(p) for p in PROMPTS]
    threads = torch.get_num_threads()
    print(f"{MODEL}, greedy, {new_tokens} new tokens per prompt, median of {repeats} interleaved repeats, "
          f"torch threads {threads} (cores available {len(os.sched_getaffinity(0))})", flush=True)

    rows = []
    for batch in (1, 4):
        prompts = encoded[:batch]
        ours, theirs = ours_runner(llm, prompts), hf_runner(hf, loaded, prompts)
        ours(4), theirs(4)  # warm-up
        samples: dict[str, list[tuple[float, float]]] = {"ours": [], "hf": []}
        for _ in range(repeats):
            samples["ours"].append(ours(new_tokens))
            samples["hf"].append(theirs(new_tokens))
        tps = {k: [batch * (new_tokens - 1) / span for _, span in v] for k, v in samples.items()}
        ttft = {k: statistics.median(t for t, _ in v) for k, v in samples.items()}
        o, h = statistics.median(tps["ours"]), statistics.median(tps["hf"])
        ratios = [a / b for a, b in zip(tps["ours"], tps["hf"])]
        rows.append({"batch": batch, "ours": o, "hf": h, "ratio": o / h,
                     "spread": f"{min(ratios):.2f}-{max(ratios):.2f}",
                     "ttft_ours": 1000 * ttft["ours"], "ttft_hf": 1000 * ttft["hf"]})
        print(f"batch {batch}: orbitflow {o:.1f} tok/s, transformers {h:.1f} tok/s, ratio {o / h:.2f}", flush=True)
    llm.close()
    print(format_table(rows, [("batch", "Batch"), ("ours", "orbitflow decode tok/s"),
                              ("hf", "transformers decode tok/s"), ("ratio", "Ratio (ours/HF)"),
                              ("spread", "Ratio range"),
                              ("ttft_ours", "orbitflow prefill ms"), ("ttft_hf", "HF prefill ms")],
                       title=f"Decode throughput, {MODEL}, {threads} threads"))

    imp, load = second_load_s()
    print(f"second load of {MODEL} in a fresh process: import {imp:.2f} s + load_model {load:.2f} s "
          f"= {imp + load:.2f} s")


if __name__ == "__main__":
    main()
