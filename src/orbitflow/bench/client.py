"""`orbitflow bench`: replay a trace against a live OpenAI-compatible server and measure it from the client.

Every request is sent at its arrival time (relative to the start of the replay) with the official `openai`
async client, streaming. The client's stopwatch (`time.perf_counter`) stamps every received token; the
metrics are `compute_metrics` over those receive times, i.e. the same definitions as the engine's own
accounting, taken on the delivered stream.

Token counting: a streamed chunk with text normally carries one token (the final chunk, with the finish
reason, carries none unless it has text). The server merges a token whose text is
still incomplete (a split UTF-8 character, a held-back stop-string prefix) into the next chunk, so a
chunk may carry several; those tokens are all delivered at that chunk's receive time. The total per
request is exact (the usage chunk's `completion_tokens`); which chunks carried the extra tokens is
estimated from their text length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from orbitflow.bench.metrics import RequestRecord, RunMetrics, compute_metrics, finite_or_none, format_summary
from orbitflow.bench.workload import (
    STEP_S_WITHOUT_TRACE,
    Trace,
    TraceError,
    TraceRequest,
    generate_trace,
    load_trace_file,
    scale_trace,
)
from orbitflow.config import ConfigError, HelpFormatter, ServerConfig, add_config_args, check_output_path

# Token ids for prompts given as lengths: inside every real vocabulary, clear of the special tokens.
_PROMPT_ID_RANGE = (100, 1000)


class BenchError(Exception):
    """A problem with the run (unreachable server, unusable trace, missing SLO), reported as one line."""


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    errors: dict[str, str] = field(default_factory=dict)  # request id -> error message
    model: str = ""
    wall_s: float = 0.0


def token_times(chunks: list[tuple[float, str]], num_tokens: int | None) -> list[float]:
    """Receive time of every token, given (receive time, text) of each content chunk in order.

    Each chunk carries at least one token; `num_tokens - len(chunks)` extra tokens go to the chunks with the
    most text per token assigned so far (a chunk that carried several tokens has more text).
    """
    if not chunks:
        return []
    counts = [1] * len(chunks)
    extra = (num_tokens or 0) - len(chunks)
    for _ in range(max(0, extra)):
        i = max(range(len(chunks)), key=lambda j: (len(chunks[j][1]) / counts[j], -j))
        counts[i] += 1
    return [t for (t, _), n in zip(chunks, counts) for _ in range(n)]


def prompt_token_ids(req: TraceRequest, seed: int = 0) -> list[int]:
    """A deterministic prompt of exactly `input_tokens` token ids for a request without prompt text."""
    rng = random.Random(f"{seed}:{req.request_id}")
    return [rng.randrange(*_PROMPT_ID_RANGE) for _ in range(req.input_tokens)]


async def _resolve_model(client, url: str, model: str | None) -> tuple[str, int | None, bool]:
    """The served model (checked against `model` if given), its context length if the server says, and whether the
    server is orbitflow (which takes a per-request `slo_ms`)."""
    import openai

    try:
        page = await client.models.list()
        served = [m for m in page.data if isinstance(m.id, str)]
    except openai.APIConnectionError as exc:
        raise BenchError(f"cannot reach the server at {url} ({exc.__cause__ or exc})") from None
    except openai.AuthenticationError:
        raise BenchError(f"the server at {url} rejected the API key (set --api-key or OPENAI_API_KEY)") from None
    except openai.APIStatusError as exc:
        raise BenchError(f"{url}/models answered HTTP {exc.status_code}: is this an OpenAI-compatible server?") \
            from None
    except (openai.OpenAIError, AttributeError, TypeError, ValueError) as exc:  # HTML, or JSON of another shape
        raise BenchError(f"{url}/models did not answer with an OpenAI model list ({type(exc).__name__}): is this an "
                         "OpenAI-compatible server?") from None
    if not served:
        raise BenchError(f"the server at {url} lists no models")
    by_id = {m.id: m for m in served}
    if model is not None and model not in by_id:
        raise BenchError(f"--model {model!r} is not served at {url}; it serves {', '.join(by_id)}")
    chosen = by_id[model] if model is not None else served[0]
    max_len = getattr(chosen, "max_model_len", None) or (chosen.model_extra or {}).get("max_model_len")
    return chosen.id, int(max_len) if max_len else None, getattr(chosen, "owned_by", None) == "orbitflow"


async def _send(client, model: str, req: TraceRequest, start: float, seed: int,
                slo_s: float | None = None) -> tuple[RequestRecord, str | None]:
    """Wait for the request's arrival time, stream it, and stamp every chunk on receipt. ``slo_s``: sent as the
    request's `slo_ms` (an orbitflow server plans for it)."""
    import openai

    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    prompt: str | list[int] = req.prompt if req.prompt is not None else prompt_token_ids(req, seed)
    sent = time.perf_counter()
    chunks: list[tuple[float, str]] = []
    usage_tokens: int | None = None
    last_empty: float | None = None
    finished: float | None = None
    error: str | None = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=req.output_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} | ({} if slo_s is None else {"slo_ms": 1000 * slo_s}),
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.text:
                    chunks.append((now, choice.text))
                elif choice.finish_reason is not None:
                    last_empty = now
        finished = time.perf_counter()
        if not chunks and usage_tokens and last_empty is not None:  # every token decoded to empty text
            chunks.append((last_empty, ""))
    except openai.APIStatusError as exc:
        error = f"HTTP {exc.status_code}: {_error_message(exc)}"
    except openai.APIError as exc:
        error = str(exc) or type(exc).__name__
    times = [t - start for t in token_times(chunks, usage_tokens)]
    record = RequestRecord(
        request_id=req.request_id, arrival_s=sent - start, input_tokens=req.input_tokens,
        output_tokens=len(times), generated_s=times, finished_s=None if finished is None else finished - start,
        slo_s=req.slo_s,
    )
    return record, error


def _error_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(exc)


async def replay(url: str, trace: Trace, model: str | None = None, api_key: str | None = None,
                 seed: int = 0, progress: bool = True, timeout_s: float = 3600.0,
                 slo_s: float | None = None) -> ReplayResult:
    """Send every request of `trace` at its arrival time to the server at `url` (.../v1) and time each token. An
    orbitflow server is sent each request's SLO (``slo_s`` overrides them all), as the metrics measure it."""
    import openai
    from tqdm import tqdm

    try:
        urlsplit(url).port  # noqa: B018  (raises on a port outside 0..65535, which httpx reports as an OverflowError)
    except ValueError as exc:
        raise BenchError(f"--url {url!r}: {exc}") from None
    base_url = url.rstrip("/")
    if not base_url.endswith("/v1"):
        base_url += "/v1"
    # No retries: a retried request would be timed from its first attempt.
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
                                max_retries=0, timeout=timeout_s)
    try:
        served, max_len, ours = await _resolve_model(client, url, model)
        too_long = [r for r in trace if max_len is not None and r.prompt is None
                    and r.input_tokens + r.output_tokens > max_len]
        if too_long:
            r = too_long[0]
            raise BenchError(f"request {r.request_id} needs {r.input_tokens + r.output_tokens} tokens but the server's "
                             f"context is {max_len}; {len(too_long)} request(s) too long (try a smaller --token-scale)")
        bar = tqdm(total=len(trace), desc=f"bench {served}", unit="req", disable=not progress, leave=False)
        start = time.perf_counter()

        async def one(req: TraceRequest) -> tuple[RequestRecord, str | None]:
            out = await _send(client, served, req, start, seed, (slo_s or req.slo_s) if ours else None)
            bar.update(1)
            return out

        try:
            results = await asyncio.gather(*(one(r) for r in trace))
        finally:
            bar.close()
        wall = time.perf_counter() - start
    finally:
        await client.close()
    errors = {rec.request_id: err for rec, err in results if err is not None}
    return ReplayResult([rec for rec, _ in results], errors, served, wall)


def run_metrics(result: ReplayResult, slo_s: float | None) -> RunMetrics:
    """Metrics of a replay; `slo_s` overrides every request's own SLO."""
    records = result.records
    if slo_s is not None:
        records = [RequestRecord(r.request_id, r.arrival_s, r.input_tokens, r.output_tokens, r.generated_s,
                                 finished_s=r.finished_s) for r in records]
    return compute_metrics(records, slo_s, errors=len(result.errors), wall_s=result.wall_s)


# ---- command line -----------------------------------------------------------------------------------------
DEFAULT_RATE = 0.5  # requests per second of --generate
DEFAULT_TOKEN_SCALE = 1.0


def build_trace(args: argparse.Namespace) -> Trace:
    if args.trace is not None:
        if args.generate is not None:
            raise BenchError("give either --trace or --generate, not both")
        given = [flag for flag, value in (("--rate", args.rate), ("--token-scale", args.token_scale))
                 if value is not None]
        if given:
            raise BenchError(f"{' and '.join(given)}: only for --generate's requests; a --trace is replayed as it is")
        try:
            trace = load_trace_file(args.trace, step_s=getattr(args, "step_s", None)).trace
        except TraceError as exc:
            raise BenchError(f"--trace: {exc}") from None
    elif getattr(args, "step_s", None) is not None:
        raise BenchError(STEP_S_WITHOUT_TRACE)
    elif args.generate is not None:
        if args.generate < 1:
            raise BenchError(f"--generate must be >= 1, got {args.generate}")
        rate = DEFAULT_RATE if args.rate is None else args.rate
        scale = DEFAULT_TOKEN_SCALE if args.token_scale is None else args.token_scale
        if not (rate > 0 and math.isfinite(rate)):
            raise BenchError(f"--rate must be a positive number of requests per second, got {rate}")
        if not (scale > 0 and math.isfinite(scale)):
            raise BenchError(f"--token-scale must be a positive number, got {scale}")
        trace = scale_trace(generate_trace(args.generate, rate, seed=args.seed), scale)
    else:
        raise BenchError("give a trace: --trace FILE, or --generate N (with --rate and --token-scale)")
    if len(trace) == 0:
        raise BenchError("the trace has no requests")
    if args.max_requests is not None:
        if args.max_requests < 1:
            raise BenchError(f"--max-requests must be >= 1, got {args.max_requests}")
        trace = Trace(trace.requests[: args.max_requests])
    return trace


def run_slo(args: argparse.Namespace, trace: Trace) -> float | None:
    if args.slo_ms is not None:
        if not (args.slo_ms > 0 and math.isfinite(args.slo_ms)):
            raise BenchError(f"--slo-ms must be a positive number, got {args.slo_ms}")
        return args.slo_ms / 1000.0
    missing = [r.request_id for r in trace if r.slo_s is None]
    if missing:
        raise BenchError(f"--slo-ms is required: {len(missing)} request(s) of the trace carry no slo_s "
                         f"(first: {missing[0]})")
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        if not (args.timeout > 0 and math.isfinite(args.timeout)):
            raise BenchError(f"--timeout must be a positive number of seconds, got {args.timeout}")
        if args.seed < 0:  # numpy's generators take no negative seed
            raise BenchError(f"--seed must be >= 0, got {args.seed}")
        check_output_path(args.json, "--json")
        check_output_path(args.save_trace, "--save-trace")
        trace = build_trace(args)
        slo_s = run_slo(args, trace)
        if args.save_trace:
            trace.save(args.save_trace)
        result = asyncio.run(replay(args.url, trace, model=args.model, api_key=args.api_key, seed=args.seed,
                                    progress=sys.stderr.isatty() and not args.quiet, timeout_s=args.timeout,
                                    slo_s=slo_s))
    except (BenchError, ConfigError) as exc:
        print(f"orbitflow bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    metrics = run_metrics(result, slo_s)
    print(format_summary(metrics, title=f"Serving Benchmark Result ({result.model})"))
    for rid, err in list(result.errors.items())[:5]:
        print(f"request {rid} failed: {err}", file=sys.stderr)
    if len(result.errors) > 5:
        print(f"... and {len(result.errors) - 5} more failed request(s)", file=sys.stderr)
    if args.json:
        payload = {
            "url": args.url, "model": result.model, "metrics": metrics.to_dict(), "errors": result.errors,
            "requests": [{"id": r.request_id, "arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
                          "output_tokens": r.output_tokens, "token_s": r.delivered, "finished_s": r.finished_s}
                         for r in result.records],
        }
        Path(args.json).write_text(json.dumps(finite_or_none(payload), indent=1, allow_nan=False) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if result.errors else 0


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="replay a trace against a live OpenAI-compatible server and report SLO metrics",
        description="Send every request of a trace at its arrival time to a running server (e.g. `orbitflow serve`), "
                    "stream the outputs, time every token with the client's stopwatch and print TBT/TPOT attainment, "
                    "latency percentiles and throughput. Prompts without text are sent as token ids, with "
                    "ignore_eos, so input and output lengths are exactly the trace's.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to request (default: the first the server lists)")
    add_config_args(p, ServerConfig, only=("api_key",), helps={"api_key": "bearer token (default: $OPENAI_API_KEY)"})
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help='trace JSON: {"requests": [{"id", "arrival_s", "input_tokens", "output_tokens", '
                        '"slo_s"?, "prompt"?}]}, or the paper artifact\'s {"requests": {ID: {"input_length", '
                        '"output_length", "arrival_time"}}} with arrivals in scheduler steps (see --step-s)')
    g.add_argument("--step-s", type=float, default=None, metavar="S",
                   help="seconds per scheduler step, to convert the arrival_time of an artifact-format --trace")
    g.add_argument("--generate", type=int, default=None, metavar="N",
                   help="instead of --trace, synthesise N requests from the long-context length mix")
    g.add_argument("--rate", type=float, default=None,
                   help=f"arrival rate of --generate, requests per second (Poisson) (default: {DEFAULT_RATE})")
    g.add_argument("--token-scale", "--input-scale", dest="token_scale", type=float, default=None, metavar="X",
                   help="multiply the generated input and output lengths by X (the mix averages ~4.7K input and "
                        f"~1.2K output tokens; e.g. 0.05 for a small model on a CPU) (default: {DEFAULT_TOKEN_SCALE})")
    g.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    g.add_argument("--seed", type=int, default=0, help="seed of --generate and of token-id prompts")
    g.add_argument("--save-trace", default=None, metavar="PATH", help="write the replayed trace as JSON")
    g = p.add_argument_group("metrics and output")
    g.add_argument("--slo-ms", type=float, default=None,
                   help="TBT/TPOT SLO in ms (required unless every trace request carries slo_s; overrides them)")
    g.add_argument("--json", default=None, metavar="PATH", help="write metrics and per-token receive times as JSON")
    g.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout in seconds")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)
    return p
