"""GPU smoke test of the accelerator path: token identity, overlap, host syncs and step latency on CUDA.

On a CUDA machine, for SmolLM2-135M (and every `--llama DIR`, a local 1B-8B Llama checkpoint, if given):
1. token identity: greedy outputs of the engine under several placements (`--placements`) against transformers
   `generate` on the same GPU, same dtype (TF32 off), same prompts (seeded random ids);
2. overlap: decode steps with host-resident layers (`--overlap-placement`) under a measured hardware profile:
   per step, GPU time the compute stream stalled on prefetches vs the link's busy time (both from CUDA events,
   kv/events.py), and the step latency vs the planner's prediction for that step, split into its compute and stall
   (`--json` keeps every step with what its prediction priced; `--profile-contexts` fits the profile's decode compute
   at other contexts than the profiler's);
   1 and 2 run on each link order of `--kv-links` (`--kv-link edf`, and `preemptive`: chunked copies that yield
   to an earlier layer's, at most two chunks queued on the copy stream), the preemptive one in chunks of
   `--kv-link-chunk-ms` (default a few blocks, so that fetches do yield); preemptions are counted, and a report
   whose preemptive runs never preempted says that the chunk path did not run;
3. host syncs: the protocol's own count per decode step (expected: 1, the sampled tokens) and, independently,
   PyTorch's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`): every synchronizing CUDA call in the
   step warns, so nothing outside the protocol can sync unseen.
Without CUDA it prints that it skips and exits 0 (`--require-cuda`: exit 2), so CI runs it everywhere.

Run: ``python benchmarks/gpu_smoke.py [--llama /path/to/Llama-3.2-1B] [--md docs/results/gpu_smoke.md]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

from orbitflow.runtime.profiler import CONTEXTS  # noqa: E402

DEFAULT_PLACEMENTS = "none,all,distance:2,random:7"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="built-in model name or HF directory (default %(default)s)")
    p.add_argument("--llama", action="append", default=[], metavar="DIR",
                   help="also test this local Llama checkpoint directory (repeatable; skipped if missing)")
    p.add_argument("--placements", default=DEFAULT_PLACEMENTS,
                   help="comma-separated fixed placements checked for token identity (default %(default)s)")
    p.add_argument("--overlap-placement", default="distance:2",
                   help="placement of the overlap / latency measurement (default %(default)s)")
    p.add_argument("--kv-links", default="edf,preemptive",
                   help="comma list of the link orders to run (--kv-link; default %(default)s)")
    p.add_argument("--kv-link-chunk-ms", type=float, default=0.002,
                   help="chunk of the preemptive link, ms of link time (default %(default)s: a few blocks, so the "
                        "chunk path runs)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch (default %(default)s)")
    p.add_argument("--context", type=int, default=512, help="prompt length in tokens (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default %(default)s)")
    p.add_argument("--profile-contexts", metavar="N,N,...",
                   help="context lengths the overlap run's hardware profile fits decode compute at (default: the "
                        f"profiler's, {','.join(map(str, CONTEXTS))}); e.g. up to --context, to price long contexts "
                        "without extrapolating")
    p.add_argument("--skip-identity", action="store_true",
                   help="measure the overlap only (a repeat of a configuration whose identity is already checked)")
    p.add_argument("--json", metavar="PATH", help="also write every decode step's measurement and prediction as JSON")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="model and KV dtype (default %(default)s: identity with transformers is exact in fp32)")
    p.add_argument("--note", default="", help="a sentence added to the --md fragment (e.g. where the weights "
                                               "came from)")
    p.add_argument("--require-cuda", action="store_true", help="exit 2 instead of skipping when CUDA is missing")
    p.add_argument("--md", metavar="PATH", help="write the results as a Markdown fragment (docs/results/gpu_smoke.md)")
    args = p.parse_args(argv)
    for name in ("prompts", "context", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    from orbitflow.config import LINK_CHOICES

    if args.profile_contexts is not None:
        try:
            args.profile_contexts = tuple(int(x) for x in args.profile_contexts.split(","))
        except ValueError:
            p.error(f"--profile-contexts takes a comma list of token counts, got {args.profile_contexts!r}")
        pc = args.profile_contexts
        if len(pc) < 2 or min(pc) < 1 or any(b <= a for a, b in zip(pc, pc[1:])):
            p.error(f"--profile-contexts needs 2 or more increasing context lengths >= 1, got {args.profile_contexts}")
    if not args.kv_link_chunk_ms > 0:
        p.error(f"--kv-link-chunk-ms must be > 0, got {args.kv_link_chunk_ms}")
    bad = [link for link in args.kv_links.split(",") if link not in LINK_CHOICES]
    if bad or not args.kv_links:
        p.error(f"--kv-links takes a comma list of {', '.join(LINK_CHOICES)}, got {args.kv_links!r}")
    return args


def prompts_for(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randint(3, min(vocab, 32000), (args.context,), generator=g).tolist() for _ in range(args.prompts)]


def hf_reference(model_dir, prompts, max_tokens, dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache()
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def make_llm(loaded, spec: str, args, profile, link: str = "edf"):
    from orbitflow.config import EngineConfig
    from orbitflow.llm import LLM
    from orbitflow.policies import FixedPlacementPolicy

    blocks = args.prompts * (-(-(args.context + args.max_tokens) // 16)) * loaded.config.num_layers
    config = EngineConfig.build(model=loaded.name, device_kv_blocks=blocks + 4 * loaded.config.num_layers,
                                host_kv_blocks=blocks + 64, max_num_seqs=args.prompts, kv_link=link,
                                kv_link_chunk_ms=args.kv_link_chunk_ms)
    return LLM(config, policy=FixedPlacementPolicy(spec), profile=profile, loaded=loaded)


def check_identity(loaded, model_dir, prompts, args, dtype) -> list[dict]:
    from orbitflow.runtime.sampling import SamplingParams

    reference = hf_reference(model_dir, prompts, args.max_tokens, dtype)
    rows = []
    for link, spec in ((link, spec) for link in args.kv_links.split(",") for spec in args.placements.split(",")):
        llm = make_llm(loaded, spec, args, "rough", link)
        try:
            reqs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens))  # both stop at EOS
            outs = [r.output_ids for r in reqs]
            leaked, preemptions = llm.kv.usage() != (0, 0), llm.kv.transfer.preemptions
        finally:
            llm.close()
        diverged = [first_divergence(o, r) for o, r in zip(outs, reference)]
        rows.append({"link": link, "placement": spec, "identical": sum(d is None for d in diverged), "of": len(prompts),
                     "first_divergence": min((d for d in diverged if d is not None), default=None),
                     "leaked": leaked, "preemptions": preemptions})
    return rows


def measured_profile(loaded, args, link: str):
    """The hardware profile of the overlap run: measured by the engine ("measure"), or, with --profile-contexts, by
    the profiler with decode compute fitted at those contexts (on an engine of the same configuration)."""
    if args.profile_contexts is None:
        return "measure"
    from orbitflow.runtime.profiler import profile_executor

    llm = make_llm(loaded, args.overlap_placement, args, "rough", link)
    try:
        return profile_executor(llm.executor, f"{loaded.name}@contexts", contexts=args.profile_contexts)
    finally:
        llm.close()


def measure_overlap(loaded, prompts, args, link: str = "edf") -> dict:
    """Decode steps under the overlap placement with a measured profile: stall, link busy, step vs prediction
    (and the prediction's compute and stall), host syncs (the protocol's count and PyTorch's sync debug mode)."""
    from orbitflow.runtime.sampling import SamplingParams

    llm = make_llm(loaded, args.overlap_placement, args, measured_profile(loaded, args, link), link)
    engine, transfer = llm.engine, llm.kv.transfer
    profile_json = llm.profile.to_json()
    steps = []
    executed = []  # per executed step: its ScheduleOutput, and the cost model's estimate for a decode step
    execute = engine.executor.execute

    def recording_execute(out):
        estimate = inputs = None
        if out.is_decode and out.predicted_step_s is not None:  # what the controller predicted, term by term
            controller = engine.scheduler.controller
            cm = controller.ctx.cost_model
            inputs = {"on_device": [[bool(x) for x in llm.kv.tables[s.req_id].on_device] for s in out.seqs],
                      "blocks": [llm.kv.blocks_for(s.start_pos) for s in out.seqs], "total_tokens": out.total_tokens,
                      "layer_compute_scale": cm.layer_compute_scale.tolist(), "link_blocks_per_s": cm.link_blocks_per_s}
            estimate = controller.estimate(inputs["on_device"], inputs["blocks"], out.total_tokens)
        executed.append((out, estimate, inputs))
        return execute(out)

    engine.executor.execute = recording_execute
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
        while engine.has_work():
            executed.clear()
            busy, syncs, preempted = transfer.busy_s, transfer.device.host_syncs, transfer.preemptions
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    result = engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            out, estimate, inputs = executed[-1] if executed else (None, None, None)
            if result is None or out is None or estimate is None:
                continue  # prefill or mixed steps: not decode
            steps.append({
                "step_s": result.step_s, "stall_s": result.stall_s, "compute_s": result.compute_s,
                "link_busy_s": transfer.busy_s - busy, "predicted_s": out.predicted_step_s,
                "predicted_compute_s": estimate.compute_s, "predicted_stall_s": estimate.stall_s,
                "priced": inputs,  # placement, blocks, tokens and the controller's refreshed model
                "protocol_syncs": transfer.device.host_syncs - syncs, "preemptions": transfer.preemptions - preempted,
                "cuda_sync_warnings": sum("synchroniz" in str(w.message) for w in caught),
            })
    finally:
        llm.close()
    return summarize(steps, link, json.loads(profile_json))


def summarize(steps: list[dict], link: str, profile: dict | None = None) -> dict:
    """Medians of the decode steps' numbers (the mean preemptions, the most syncs), the overlap and the errors; the
    steps themselves (with what each prediction priced, under ``priced``) and the profile ride along for --json."""
    if not steps:
        return {"link": link, "steps": 0}
    med = {k: statistics.median(s[k] for s in steps) for k, v in steps[0].items() if isinstance(v, (int, float))}
    med["steps"], med["link"], med["per_step"], med["profile"] = len(steps), link, steps, profile
    late = steps[len(steps) // 2:]  # the run's second half: has the controller's refresh closed the error?
    med["late_error"] = statistics.median((s["step_s"] - s["predicted_s"]) / s["predicted_s"] for s in late)
    med["preemptions"] = statistics.mean(s["preemptions"] for s in steps)
    med["max_protocol_syncs"] = max(s["protocol_syncs"] for s in steps)
    med["max_cuda_sync_warnings"] = max(s["cuda_sync_warnings"] for s in steps)
    med["overlap"] = 1 - med["stall_s"] / med["link_busy_s"] if med["link_busy_s"] > 0 else None
    predicted = med["predicted_s"]
    med["error_vs_prediction"] = (med["step_s"] - predicted) / predicted if predicted else None
    return med


def run_model(name_or_dir: str, args) -> dict:
    from orbitflow.model.loader import load_model

    dtype = getattr(torch, args.dtype)
    loaded = load_model(name_or_dir, dtype)
    loaded.model.to("cuda")
    prompts = prompts_for(args, loaded.config.vocab_size)
    identity = [] if args.skip_identity else check_identity(loaded, loaded.path, prompts, args, dtype)
    overlap = [measure_overlap(loaded, prompts, args, link) for link in args.kv_links.split(",")]
    return {"model": name_or_dir, "identity": identity, "overlap": overlap}


def render(results: list[dict], args, argv) -> str:
    def f(x, scale=1e3, digits=2):
        return "n/a" if x is None else f"{x * scale:.{digits}f}"

    lines = [
        f"Command: `{shlex.join(['python', 'benchmarks/gpu_smoke.py', *argv])}`",
        f"Machine: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{platform.node()}; date {datetime.date.today().isoformat()}; prompts seed {args.seed}, "
        f"{args.prompts} x {args.context} tokens, {args.max_tokens} new, {args.dtype}; overlap profile fitted at "
        f"contexts {','.join(map(str, args.profile_contexts or CONTEXTS))}." + (f" {args.note}" if args.note
                                                                                            else ""),
        "",
        "| model | link | placement | identical to transformers | first divergence | blocks leaked | preemptions |",
        "|---|---|---|---|---|---|---|",
    ]
    if args.skip_identity:
        lines.append("| (not checked: --skip-identity) | | | | | | |")
    for res in results:
        for row in res["identity"]:
            lines.append(f"| {res['model']} | {row['link']} | {row['placement']} | {row['identical']}/{row['of']} | "
                         f"{row['first_divergence'] if row['first_divergence'] is not None else '-'} | "
                         f"{'yes' if row['leaked'] else 'no'} | {row['preemptions']} |")
    lines += ["", f"Decode steps under `{args.overlap_placement}` (medians; times in ms, GPU time from CUDA events):",
              "", "| model | link | steps | step | predicted | error | error, 2nd half | compute | predicted compute "
              "| stall | predicted stall | link busy | overlap | preemptions/step (mean) "
              "| host syncs/step (protocol, max) | sync warnings/step (torch, max) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for o in res["overlap"]:
            if not o.get("steps"):
                lines.append(f"| {res['model']} | {o['link']} | 0 |" + " |" * 13)
                continue
            lines.append(f"| {res['model']} | {o['link']} | {o['steps']} | {f(o['step_s'])} | {f(o['predicted_s'])} | "
                         f"{f(o['error_vs_prediction'], 100, 1)}% | {f(o['late_error'], 100, 1)}% | "
                         f"{f(o['compute_s'])} | {f(o['predicted_compute_s'])} | {f(o['stall_s'])} | "
                         f"{f(o['predicted_stall_s'])} | "
                         f"{f(o['link_busy_s'])} | {f(o['overlap'], 100, 0)}% | {o['preemptions']:.2f} | "
                         f"{o['max_protocol_syncs']} | {o['max_cuda_sync_warnings']} |")
    preempted = [row["preemptions"] for res in results for row in res["identity"] if row["link"] == "preemptive"]
    if preempted and not any(preempted):
        lines += ["", "WARNING: no fetch of the preemptive runs yielded the link: the chunk path did not run (try a "
                      "smaller --kv-link-chunk-ms or longer --context)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_smoke: CUDA is not available on this machine: skipping (nothing measured).")
        return 2 if args.require_cuda else 0
    if os.environ.get("ORBITFLOW_STRICT_ASYNC", "") not in ("", "0"):
        print("gpu_smoke: ORBITFLOW_STRICT_ASYNC emulates a GPU on the CPU; unset it here.", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = []
    for name in [args.model, *args.llama]:
        if name != args.model and not os.path.isdir(name):
            print(f"gpu_smoke: --llama {name}: no such directory, skipped")
            continue
        print(f"gpu_smoke: {name} ...", flush=True)
        results.append(run_model(name, args))
    text = render(results, args, argv)
    print(text)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as fh:
            fh.write(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"argv": argv, "results": results}, fh, indent=1, default=str)
    ok = all(row["identical"] == row["of"] and not row["leaked"] for r in results for row in r["identity"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
