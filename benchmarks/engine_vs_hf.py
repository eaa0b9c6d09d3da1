"""Long-context throughput of the orbitflow engine vs transformers `generate`, SmolLM2-135M, greedy, same run.

Ours is what `orbitflow generate --placement none` runs: `orbitflow.llm.LLM` with every layer's KV on the
device (`FixedPlacementPolicy("none")`, profile "rough"), i.e. the whole engine loop, not just the model,
built afresh for every run so its block pool's pages are counted in that run's memory. Theirs is
`LlamaForCausalLM.from_pretrained(...).generate` with SDPA attention (every prompt of a batch has the same
length, so no padding mask), once with each KV cache of `--hf-cache`: its default `DynamicCache`, which
concatenates the whole cache onto itself every step, and `cache_implementation="static"`, preallocated for the
run's length. Each figure compares ours with the faster of them for that figure, named beside it: the best
configuration transformers offers, per point. Prompts are seeded random token ids of exactly `context` tokens;
every side gets the same ones.

Per (context, batch), runs alternate ours, theirs (each cache), ours, ... `--repeats` times; each figure is the
median; each ratio also gets a 95% confidence interval (Student t over the paired repeats' log ratios: the
geometric mean's interval, `ratio_ci`) and the range of the paired ratios:
- decode tok/s = batch * (N - 1) / (time of the last new token - time of the first): the first token comes
  out of the prefill, so the span is the decode of the other N - 1 tokens, for both sides alike. Ours stamps
  each token in the engine loop (`Request.generated_s`); theirs through a `streamer` that `generate` calls
  once per new token;
- prefill tok/s = batch * context / time to the first token;
- peak RSS = the process's high-water mark during the run (reset before it through /proc/self/clear_refs)
  minus its RSS just before, the heap earlier runs freed handed back to the OS first (else the second side
  reuses the first's freed pages for free); both models stay loaded, so this is what the run itself needed.
`--offload C:B` also compares ours with half the layers on the host (`distance:2`, link unthrottled) against
placement none at context C, batch B, interleaved the same way.

Run: ``python benchmarks/engine_vs_hf.py --contexts 512,2048,8192 --batches 1,4,8 [--md PATH]``
(prints tables only; no timed assertions).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from orbitflow.bench.metrics import format_table  # noqa: E402
from orbitflow.config import EngineConfig  # noqa: E402
from orbitflow.llm import LLM  # noqa: E402
from orbitflow.model.loader import LoadedModel, load_model  # noqa: E402
from orbitflow.policies import FixedPlacementPolicy  # noqa: E402
from orbitflow.runtime.sampling import SamplingParams  # noqa: E402

MODEL = "smollm2-135m"
_LOAD_SNIPPET = """
import time
t0 = time.perf_counter()
from orbitflow.model.loader import load_model
t1 = time.perf_counter()
load_model({model!r})
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""
Run = Callable[[], tuple[float, float, float]]  # -> (time to first token, decode span, peak RSS delta bytes)


class _TokenStamps(BaseStreamer):
    """`generate` calls put() with the prompt, then once per new token (the whole batch at once)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def release_free_heap() -> None:
    """Hand the heap that earlier runs freed back to the OS (glibc's ``malloc_trim``), so that a run's RSS growth
    counts what it allocates: otherwise whichever side runs second reuses the other's freed pages for free."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: growth is then only comparable between like runs
        pass


def measured(fn: Callable[[], tuple[float, float]]) -> tuple[float, float, float]:
    """Run fn with the freed heap returned and the RSS high-water mark reset first; adds the peak RSS growth
    (bytes) to its result."""
    release_free_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    ttft, span = fn()
    return ttft, span, 1024.0 * (_rss_kib("VmHWM") - before)


def pool_blocks(loaded: LoadedModel, batch: int, context: int, new_tokens: int) -> int:
    """Device blocks the engine preallocates for a point: every layer of every request, plus 64 spare."""
    return batch * loaded.config.num_layers * -(-(context + new_tokens) // 16) + 64


def pool_mib(loaded: LoadedModel, batch: int, context: int, new_tokens: int) -> float:
    mc = loaded.config
    bytes_per_block = 2 * 16 * mc.num_kv_heads * mc.head_dim * 4  # K and V, float32
    return pool_blocks(loaded, batch, context, new_tokens) * bytes_per_block / 2**20


def ours_runner(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int, spec: str) -> Run:
    blocks = pool_blocks(loaded, len(prompts), len(prompts[0]), new_tokens) - 64
    # The whole batch is admitted at once, as transformers runs it: the running-batch token cap (default
    # 32768) would otherwise hold back the fourth 8192-token prompt and run the batch in waves.
    config = EngineConfig.build(model=MODEL, max_num_seqs=len(prompts), device_kv_blocks=blocks + 64,
                                host_kv_blocks=blocks + 64, max_model_len=len(prompts[0]) + new_tokens,
                                max_num_batched_tokens=len(prompts) * (len(prompts[0]) + new_tokens))

    def run() -> tuple[float, float]:
        llm = LLM(config, policy=FixedPlacementPolicy(spec), profile="rough", loaded=loaded)
        try:
            start = llm.clock.now()
            reqs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        finally:
            llm.close()
        assert all(len(r.output_ids) == new_tokens for r in reqs)
        first = min(r.generated_s[0] for r in reqs)
        last = max(r.generated_s[-1] for r in reqs)
        # Decode tok/s is only the batch's decode rate if the batch prefilled together, as transformers does;
        # a batch admitted in waves would count later prefills as decode time.
        if max(r.generated_s[0] for r in reqs) != first:
            raise RuntimeError("the engine did not prefill the batch in one step; check its admission caps")
        return first - start, last - first

    return lambda: measured(run)


HF_CACHES = ("static", "dynamic")


def hf_runner(hf: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int, pad: int, cache: str = "dynamic") -> Run:
    """transformers' `generate` with its default DynamicCache, or with ``cache="static"`` a StaticCache."""
    input_ids = torch.tensor(prompts)
    mask = torch.ones_like(input_ids)
    extra = {"cache_implementation": "static"} if cache == "static" else {}

    def run() -> tuple[float, float]:
        # generate sizes a StaticCache for the longest run so far on this model (to spare torch.compile a
        # recompile): a short point after a long one would attend over, and allocate, the long one's length
        hf.__dict__.pop("_previous_max_cache_length", None)
        stamps = _TokenStamps()
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=pad, streamer=stamps, **extra)
        assert out.shape[1] == input_ids.shape[1] + new_tokens and len(stamps.times) == new_tokens + 1
        return stamps.times[1] - start, stamps.times[-1] - stamps.times[1]

    return lambda: measured(run)


def interleave(runs: dict[str, Run], repeats: int, bar: tqdm) -> dict[str, list[tuple[float, float, float]]]:
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
            bar.update()
    return samples


def ratio_ci(ratios: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Confidence interval of the geometric mean of paired ratios (Student t over their logs); None under 2."""
    from scipy import stats

    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    half = stats.t.ppf(0.5 + level / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    center = statistics.fmean(logs)
    return math.exp(center - half), math.exp(center + half)


def _ci_text(ci: tuple[float, float] | None) -> str:
    return "-" if ci is None else f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def summarize(samples, batch: int, context: int, new_tokens: int, a: str, b: str | list[str],
              pool_mib: float = 0.0) -> dict:
    """Side ``a`` against side ``b``; with several ``b`` sides (transformers' caches), against the best of them for
    each figure: the highest median decode and prefill rate, the least peak memory (named in ``*_by``)."""
    decode = {k: [batch * (new_tokens - 1) / span for _, span, _ in v] for k, v in samples.items()}
    prefill = {k: [batch * context / ttft for ttft, _, _ in v] for k, v in samples.items()}
    rss = {k: statistics.median(m for _, _, m in v) / 2**20 for k, v in samples.items()}
    sides = [b] if isinstance(b, str) else list(b)
    bd = max(sides, key=lambda k: statistics.median(decode[k]))
    bp = max(sides, key=lambda k: statistics.median(prefill[k]))
    bm = min(sides, key=lambda k: rss[k])
    ratios = [x / y for x, y in zip(decode[a], decode[bd])]
    pratios = [x / y for x, y in zip(prefill[a], prefill[bp])]
    ci, pci = ratio_ci(ratios), ratio_ci(pratios)
    return {
        "context": context, "batch": batch,
        "decode_a": statistics.median(decode[a]), "decode_b": statistics.median(decode[bd]), "decode_by": bd,
        "ratio": statistics.median(ratios), "range": f"{min(ratios):.2f}-{max(ratios):.2f}",
        "ci": ci, "ci_text": _ci_text(ci),
        "prefill_a": statistics.median(prefill[a]), "prefill_b": statistics.median(prefill[bp]), "prefill_by": bp,
        "pratio": statistics.median(pratios), "prange": f"{min(pratios):.2f}-{max(pratios):.2f}",
        "pci": pci, "pci_text": _ci_text(pci),
        "rss_a": rss[a], "rss_b": rss[bm], "rss_by": bm,
        "headroom": rss[bm] + pool_mib - rss[a], "pool": pool_mib,
        **{f"decode_{k}": statistics.median(decode[k]) for k in sides},
    }


COLUMNS = [("context", "Context"), ("batch", "Batch"), ("decode_a", "orbitflow decode tok/s"),
           ("decode_b", "HF decode tok/s"), ("decode_by", "HF cache"), ("ratio", "Decode ratio"),
           ("ci_text", "Decode ratio 95% CI"), ("range", "Decode ratio range"),
           ("prefill_a", "orbitflow prefill tok/s"), ("prefill_b", "HF prefill tok/s"), ("prefill_by", "HF cache"),
           ("pratio", "Prefill ratio"),
           ("pci_text", "Prefill ratio 95% CI"), ("prange", "Prefill ratio range"),
           ("rss_a", "orbitflow peak RSS MiB"), ("rss_b", "HF peak RSS MiB"), ("rss_by", "HF cache"),
           ("pool", "orbitflow device pool MiB"), ("headroom", "HF + pool - orbitflow MiB")]
OFFLOAD_COLUMNS = [("context", "Context"), ("batch", "Batch"), ("decode_a", "half on host decode tok/s"),
                   ("decode_b", "none decode tok/s"), ("ratio", "Ratio (host/none)"),
                   ("ci_text", "Ratio 95% CI"), ("range", "Ratio range")]


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


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    def cell(value) -> str:
        return f"{value:.2f}" if isinstance(value, float) and abs(value) < 10 else (
            f"{value:.0f}" if isinstance(value, float) else str(value))

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[k]) for k, _ in columns) + " |" for row in rows]
    return "\n".join(lines)


def where_we_lose(rows: list[dict]) -> str:
    """Every point where ours is behind transformers' best: a loss (a median ratio under 1 whose 95% CI is all under
    1, or that has no CI), a median under 1 whose CI holds 1 (behind at the median only: no significant difference,
    by the page's rule), a median of at least 1 whose CI or range dips under 1, memory over the bound."""
    def at(r):
        return f"{r['context']} x {r['batch']}"

    parts = []
    def ci_note(ci) -> str:
        return "" if ci is None else f", CI {_ci_text(ci)}" + (" all under 1" if ci[1] < 1 else "")

    for key, what in (("ratio", "decode"), ("pratio", "prefill")):
        rng, ci = ("range", "ci") if key == "ratio" else ("prange", "pci")
        under = [(f"{at(r)} ({r[key]:.2f} against {r[f'{what}_by']}{ci_note(r.get(ci))})", r.get(ci))
                 for r in rows if r[key] < 1]
        behind = [text for text, interval in under if interval is None or interval[1] < 1]
        level = [text for text, interval in under if interval is not None and interval[1] >= 1]
        dips = [f"{at(r)} (range {r[rng]}{ci_note(r.get(ci))})" for r in rows
                if r[key] >= 1 and (float(r[rng].split("-")[0]) < 1 or (r.get(ci) is not None and r[ci][0] < 1))]
        if behind:
            parts.append(f"{what} at {', '.join(behind)}")
        if level:
            parts.append(f"{what} behind at the median only, the CI holding 1 (no significant difference), at "
                         f"{', '.join(level)}")
        if dips:
            parts.append(f"{what} not shown ahead at {', '.join(dips)} (median at least 1)")
    over = [f"{at(r)} ({r['headroom']:.0f} MiB)" for r in rows if r["headroom"] < 0]
    if over:
        parts.append(f"memory over the bound at {', '.join(over)}")
    return ("Where we lose: " + "; ".join(parts) + ".") if parts else "Where we lose: nowhere in this grid."


def write_markdown(path: str, rows: list[dict], offload: list[dict], args, threads: int, elapsed_s: float) -> None:
    command = "python benchmarks/engine_vs_hf.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    load = os.getloadavg()
    text = [
        "## Engine vs transformers: long-context throughput",
        "",
        f"SmolLM2-135M, float32, greedy, {args.tokens} new tokens per prompt, seeded random prompts (seed "
        f"{args.seed}) of exactly `context` tokens, placement none, median of {args.repeats} interleaved "
        f"repeats (ours, then transformers with each cache, then ours again, ...); a ratio's 95% CI is Student t "
        f"over the paired repeats' log ratios (the geometric mean's interval), its range the least and largest "
        f"paired ratio. Transformers is "
        f"`LlamaForCausalLM.generate` with SDPA attention in the same process, with each KV cache of "
        f"{', '.join(args.hf_cache)}; each figure is compared with the better of them (the 'HF cache' beside it). "
        f"Peak RSS is the growth of the "
        f"process's high-water mark during one run, the heap earlier runs freed handed back first (`malloc_trim`; "
        f"both models stay loaded); ours includes its freshly built "
        f"block pool. The last column is the issue's memory bound: transformers' peak plus our device pool's "
        f"size, less our peak (positive: within it). Ours admits the whole batch at once "
        f"(`max_num_batched_tokens` = batch x (context + new tokens)), as transformers runs it.",
        "",
        *([args.note, ""] if args.note else []),
        markdown_table(rows, COLUMNS),
        "",
        where_we_lose(rows),
        "",
    ]
    if offload:
        text += ["Half of the layers on the host (`distance:2`, link unthrottled) against placement none, both "
                 "orbitflow, interleaved:", "", markdown_table(offload, OFFLOAD_COLUMNS), ""]
    text += [
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with {threads} threads, "
        f"load average at the end {load[0]:.1f}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
        f"took {elapsed_s / 60:.1f} min.",
        "",
    ]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(text))


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cache_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in HF_CACHES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(HF_CACHES)}, got {text!r}")
    return list(dict.fromkeys(values))


def context_batch(text: str) -> tuple[int, int] | None:
    if text.lower() == "none":
        return None
    try:
        context, batch = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CONTEXT:BATCH (e.g. 2048:4) or none, got {text!r}") from None
    return context, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int_list, default=[512, 2048, 8192], help="prompt lengths (tokens)")
    parser.add_argument("--batches", type=int_list, default=[1, 4, 8], help="batch sizes")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per point (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--offload", type=context_batch, default=(2048, 4),
                        help="CONTEXT:BATCH of the half-layers-on-host vs none comparison, or none (default 2048:4)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both sides (default: torch's own choice)")
    parser.add_argument("--hf-cache", type=cache_list, default=list(HF_CACHES),
                        help="transformers' KV caches to run, comma list of static, dynamic (default: both; each "
                             "figure is compared with the better)")
    parser.add_argument("--note", default="", help="a sentence added to the --md fragment (e.g. how busy the "
                                                        "machine was)")
    parser.add_argument("--md", default=None, help="write the results as a Markdown fragment to this path "
                                                   "(docs/results/engine_vs_hf.md)")
    args = parser.parse_args()
    if args.tokens < 2 or args.repeats < 1:
        parser.error("--tokens must be at least 2 and --repeats at least 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)

    began = time.perf_counter()
    loaded = load_model(MODEL)
    hf = LlamaForCausalLM.from_pretrained(loaded.path, dtype=torch.float32, attn_implementation="sdpa").eval()
    pad = loaded.tokenizer.eos_token_ids[0]
    gen = torch.Generator().manual_seed(args.seed)
    vocab = loaded.config.vocab_size
    threads = torch.get_num_threads()
    print(f"{MODEL}, greedy, {args.tokens} new tokens, median of {args.repeats} interleaved repeats, torch threads "
          f"{threads} (cores available {len(os.sched_getaffinity(0))})", flush=True)

    points = [(c, b) for c in args.contexts for b in args.batches]
    sides = 1 + len(args.hf_cache)
    total = args.repeats * (sides * len(points) + 2 * (args.offload is not None)) + sides
    rows, offload = [], []
    with tqdm(total=total, desc="runs", unit="run") as bar:
        warm = [[int(x) for x in torch.randint(3, vocab, (64,), generator=gen)]]
        ours_runner(loaded, warm, 4, "none")()  # warm-up, every side
        for cache in args.hf_cache:
            hf_runner(hf, warm, 4, pad, cache)()
        bar.update(sides)
        for context, batch in points:
            prompts = [[int(x) for x in torch.randint(3, vocab, (context,), generator=gen)] for _ in range(batch)]
            runs = {"ours": ours_runner(loaded, prompts, args.tokens, "none"),
                    **{cache: hf_runner(hf, prompts, args.tokens, pad, cache) for cache in args.hf_cache}}
            row = summarize(interleave(runs, args.repeats, bar), batch, context, args.tokens, "ours", args.hf_cache,
                            pool_mib(loaded, batch, context, args.tokens))
            rows.append(row)
            theirs = ", ".join(f"{c} {row[f'decode_{c}']:.1f}" for c in args.hf_cache)
            bar.write(f"context {context} batch {batch}: decode {row['decode_a']:.1f} vs {theirs} tok/s "
                      f"(ratio to {row['decode_by']} {row['ratio']:.2f}, 95% CI {row['ci_text']}), prefill ratio "
                      f"{row['pratio']:.2f} (to {row['prefill_by']})")
        if args.offload is not None:
            context, batch = args.offload
            prompts = [[int(x) for x in torch.randint(3, vocab, (context,), generator=gen)] for _ in range(batch)]
            runs = {"host": ours_runner(loaded, prompts, args.tokens, "distance:2"),
                    "none": ours_runner(loaded, prompts, args.tokens, "none")}
            offload.append(summarize(interleave(runs, args.repeats, bar), batch, context, args.tokens, "host", "none"))
    print(format_table(rows, COLUMNS, title=f"orbitflow vs transformers, {MODEL}, {threads} threads"))
    if offload:
        print(format_table(offload, OFFLOAD_COLUMNS, title="half of the layers on the host vs none (orbitflow)"))
    imp, load = second_load_s()
    print(f"second load of {MODEL} in a fresh process: import {imp:.2f} s + load_model {load:.2f} s "
          f"= {imp + load:.2f} s")
    if args.md:
        write_markdown(args.md, rows, offload, args, threads, time.perf_counter() - began)
        print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
