"""Decode-step jitter of the real engine: the default CV of the simulator's noise (`--noise-cv`).

Runs SmolLM2-135M with a fixed batch (every prompt decodes to the end, no placement changes after the first
step), fits step time against the step index (the context grows by one token per step) and reports the
coefficient of variation of the steps around that fit, i.e. the step-to-step noise the planner cannot
predict. Wall-clock timings on a shared machine include other processes' interference; run it on a quiet
machine for the number the simulator should use.

Run: python benchmarks/step_jitter.py [--steps 200] [--batch 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np


def measure(steps: int, batch: int, prompt_words: int) -> np.ndarray:
    from orbitflow.config import EngineConfig
    from orbitflow.llm import LLM
    from orbitflow.policies import FixedPlacementPolicy
    from orbitflow.runtime.sampling import SamplingParams

    config = EngineConfig.build(max_num_seqs=batch, device_kv_blocks=8192, host_kv_blocks=8192)
    llm = LLM(config, policy=FixedPlacementPolicy("none"), profile="rough")
    prompts = [" ".join(["word"] * (prompt_words + 7 * i)) for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
    times = np.asarray(llm.stats().step_s[1:], dtype=float)  # drop the prefill step
    llm.close()
    return times


def jitter_cv(times: np.ndarray) -> float:
    """CV of the step times around their linear trend over the step index."""
    idx = np.arange(times.size)
    slope, icept = np.polyfit(idx, times, 1)
    trend = slope * idx + icept
    return float(np.std(times - trend, ddof=2) / np.mean(trend))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    cvs, medians = [], []
    for _ in range(args.repeats):
        t = measure(args.steps, args.batch, args.prompt_words)
        cvs.append(jitter_cv(t))
        medians.append(float(np.median(t)))
    # the median over repeats: a repeat hit by another process's burst says more about the machine
    out = {"cv_per_repeat": cvs, "cv_median": float(np.median(cvs)), "median_step_s": medians,
           "steps": args.steps, "batch": args.batch, "machine": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"decode-step jitter (CV around the trend): median {out['cv_median']:.3f} over {args.repeats} repeats "
          f"({', '.join(f'{c:.3f}' for c in cvs)}); median step {1000 * np.median(medians):.1f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
