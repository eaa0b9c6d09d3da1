"""Request traces: the JSON trace format and a synthetic long-context trace generator.

Trace JSON: ``{"requests": [{"id", "arrival_s", "input_tokens", "output_tokens", "slo_s"?, "prompt"?}]}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ARRIVALS = ("poisson", "gamma", "lognormal")

# The paper fixes 0.97 req/min for its sensitivity studies (LLaMA3-8B on one RTX A5000).
PAPER_SENSITIVITY_RATE_PER_MIN = 0.97


class TraceError(ValueError):
    """A trace is malformed; the message names the request index and field."""


@dataclass
class TraceRequest:
    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    slo_s: float | None = None  # per-request TBT SLO; None: the run's SLO
    prompt: str | None = None  # text for real-engine runs

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.request_id, "arrival_s": self.arrival_s,
                               "input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        if self.slo_s is not None:
            out["slo_s"] = self.slo_s
        if self.prompt is not None:
            out["prompt"] = self.prompt
        return out


_FIELDS = ("id", "arrival_s", "input_tokens", "output_tokens", "slo_s", "prompt")


def _request_from_dict(data: Any, index: int) -> TraceRequest:
    where = f"requests[{index}]"
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {unknown}; allowed: {list(_FIELDS)}")
    for name in ("id", "arrival_s", "input_tokens", "output_tokens"):
        if name not in data:
            raise TraceError(f"{where}.{name}: missing")
    ints = {}
    for name in ("input_tokens", "output_tokens"):
        value = data[name]
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        ints[name] = value
    return TraceRequest(request_id=data["id"], arrival_s=data["arrival_s"], input_tokens=ints["input_tokens"],
                        output_tokens=ints["output_tokens"], slo_s=data.get("slo_s"), prompt=data.get("prompt"))


def _validate_request(req: TraceRequest, index: int) -> None:
    where = f"requests[{index}]"

    def number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

    if not isinstance(req.request_id, str) or not req.request_id:
        raise TraceError(f"{where}.id: must be a non-empty string, got {req.request_id!r}")
    if not number(req.arrival_s) or req.arrival_s < 0:
        raise TraceError(f"{where}.arrival_s: must be a finite number >= 0, got {req.arrival_s!r}")
    for name in ("input_tokens", "output_tokens"):
        value = getattr(req, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TraceError(f"{where}.{name}: must be an integer >= 1, got {value!r}")
    if req.slo_s is not None and (not number(req.slo_s) or req.slo_s <= 0):
        raise TraceError(f"{where}.slo_s: must be a number > 0, got {req.slo_s!r}")
    if req.prompt is not None and not isinstance(req.prompt, str):
        raise TraceError(f"{where}.prompt: must be a string, got {type(req.prompt).__name__}")


@dataclass
class Trace:
    """Requests in arrival order (stable-sorted on construction); ids are unique."""

    requests: list[TraceRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, req in enumerate(self.requests):
            _validate_request(req, i)
            if req.request_id in seen:
                raise TraceError(f"requests[{i}].id: duplicate id {req.request_id!r}")
            seen.add(req.request_id)
        self.requests = sorted(self.requests, key=lambda r: r.arrival_s)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"requests": [r.to_dict() for r in self.requests]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
            raise TraceError("trace: expected an object with a 'requests' list")
        return cls([_request_from_dict(item, i) for i, item in enumerate(data["requests"])])

    @classmethod
    def from_json(cls, text: str) -> Trace:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"trace: invalid JSON: {exc}") from exc
        return cls.from_dict(data)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json(indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        path = Path(path)
        try:
            return cls.from_json(path.read_text())
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from exc


@dataclass(frozen=True)
class LengthBins:
    """Short/medium/long centres for input and output lengths and the mixture weights.

    Input and output bins are drawn independently (a long prompt may get a short answer), each length
    uniform within ``spread`` (relative) of its bin centre. The defaults stand in for the paper's
    ShareGPT-derived long-context mix (its Fig. 8: short to long inputs and outputs): inputs around
    512 / 4K / 12K tokens, outputs around 256 / 1K / 3K, weighted 0.4 / 0.35 / 0.25, i.e. a mean of
    ~4.7K input and ~1.2K output tokens, so a batch of 4 often exceeds a 16K-token device budget.
    """

    input_centres: tuple[int, ...] = (512, 4096, 12288)
    output_centres: tuple[int, ...] = (256, 1024, 3072)
    weights: tuple[float, ...] = (0.4, 0.35, 0.25)
    spread: float = 0.2

    def __post_init__(self) -> None:
        n = len(self.weights)
        if n == 0 or len(self.input_centres) != n or len(self.output_centres) != n:
            raise ValueError("length_bins: input_centres, output_centres and weights need the same length > 0")
        if any(c < 1 for c in (*self.input_centres, *self.output_centres)):
            raise ValueError("length_bins: centres must be >= 1")
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError("length_bins: weights must be >= 0 and not all zero")
        if not 0 <= self.spread < 1:
            raise ValueError(f"length_bins.spread must be in [0, 1), got {self.spread}")


def interarrival_times(n: int, rate_per_s: float, arrival: str = "poisson", cv: float = 1.0,
                       rng: np.random.Generator | None = None) -> np.ndarray:
    """``n`` gaps with mean 1/rate and coefficient of variation ``cv`` (1 for poisson)."""
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        raise ValueError(f"rate_per_s must be a finite number > 0, got {rate_per_s}")
    if cv <= 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    rng = rng if rng is not None else np.random.default_rng()
    mean = 1.0 / rate_per_s
    if arrival == "poisson":
        if cv != 1.0:
            raise ValueError("cv applies to arrival='gamma' or 'lognormal'; poisson arrivals have cv=1")
        return rng.exponential(mean, size=n)
    if arrival == "gamma":
        shape = 1.0 / cv**2
        return rng.gamma(shape, mean / shape, size=n)
    if arrival == "lognormal":
        sigma2 = math.log1p(cv**2)
        return rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), size=n)
    raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")


def _clip_to_cap(inp: int, out: int, cap: int) -> tuple[int, int]:
    # Shrink both proportionally so the request keeps its input/output shape.
    if inp + out <= cap:
        return inp, out
    factor = cap / (inp + out)
    out = max(1, int(out * factor))
    inp = max(1, min(int(inp * factor), cap - out))
    return inp, out


def generate_trace(num_requests: int, rate_per_s: float, arrival: str = "poisson", cv: float = 1.0,
                   length_bins: LengthBins | None = None, context_cap: int = 32768, seed: int = 0,
                   rate_scale: float = 1.0, slo_s: float | None = None) -> Trace:
    """Synthetic trace: first request at t=0, then gaps of mean 1 / (rate_per_s * rate_scale)."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if context_cap < 2:
        raise ValueError(f"context_cap must be >= 2, got {context_cap}")
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    bins = length_bins or LengthBins()
    rng = np.random.default_rng(seed)
    gaps = interarrival_times(num_requests, rate_per_s * rate_scale, arrival, cv, rng)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if num_requests else np.zeros(0)

    p = np.asarray(bins.weights, dtype=np.float64)
    p = p / p.sum()
    in_bin = rng.choice(len(p), size=num_requests, p=p)
    out_bin = rng.choice(len(p), size=num_requests, p=p)
    in_jitter = rng.uniform(1 - bins.spread, 1 + bins.spread, size=num_requests)
    out_jitter = rng.uniform(1 - bins.spread, 1 + bins.spread, size=num_requests)

    requests = []
    for i in range(num_requests):
        inp = max(1, round(bins.input_centres[in_bin[i]] * in_jitter[i]))
        out = max(1, round(bins.output_centres[out_bin[i]] * out_jitter[i]))
        inp, out = _clip_to_cap(inp, out, context_cap)
        requests.append(TraceRequest(request_id=f"req-{i:05d}", arrival_s=float(arrivals[i]),
                                     input_tokens=inp, output_tokens=out, slo_s=slo_s))
    return Trace(requests)


def scale_trace(trace: Trace, token_scale: float, min_tokens: int = 1) -> Trace:
    """Multiply every input and output length by ``token_scale`` (arrivals, prompts and SLOs kept).

    For small real-engine runs; a prompt text is kept as is, so the engine's tokenizer decides its length.
    """
    if token_scale <= 0:
        raise ValueError(f"token_scale must be > 0, got {token_scale}")
    scaled = [TraceRequest(r.request_id, r.arrival_s, max(min_tokens, round(r.input_tokens * token_scale)),
                           max(min_tokens, round(r.output_tokens * token_scale)), r.slo_s, r.prompt)
              for r in trace.requests]
    return Trace(scaled)


def scale_arrivals(trace: Trace, rate_scale: float) -> Trace:
    """Compress (rate_scale > 1) or stretch the arrival times of a trace."""
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    return Trace([TraceRequest(r.request_id, r.arrival_s / rate_scale, r.input_tokens, r.output_tokens,
                               r.slo_s, r.prompt) for r in trace.requests])


def paper_default_rate_per_s() -> float:
    """The paper's fixed arrival rate for sensitivity studies (0.97 req/min) in requests per second."""
    return PAPER_SENSITIVITY_RATE_PER_MIN / 60.0


def trace_stats(trace: Trace | Sequence[TraceRequest]) -> dict[str, float]:
    """Counts, mean lengths, offered rate and interarrival CV; handy for a CLI summary."""
    reqs = list(trace)
    if not reqs:
        return {"num_requests": 0}
    arr = np.array([r.arrival_s for r in reqs])
    gaps = np.diff(arr)
    stats = {
        "num_requests": len(reqs),
        "mean_input_tokens": float(np.mean([r.input_tokens for r in reqs])),
        "mean_output_tokens": float(np.mean([r.output_tokens for r in reqs])),
        "max_total_tokens": float(max(r.input_tokens + r.output_tokens for r in reqs)),
    }
    if len(gaps) and gaps.mean() > 0:
        stats["rate_per_s"] = float(1.0 / gaps.mean())
        stats["interarrival_cv"] = float(gaps.std() / gaps.mean())
    return stats


# ----------------------------------------------------------------------------- trace files from outside
ARTIFACT_BLOCK_KEYS = ("num_gpu_blocks", "gpu_blocks", "num_gpu_blocks_override")


@dataclass
class LoadedTrace:
    """A trace file as read: the trace, the file's format and its own device KV budget, if it gives one."""

    trace: Trace
    source_format: str  # "orbitflow" or "artifact"
    device_kv_tokens: int | None = None  # GPU KV budget of the file, in tokens (every layer)

    def device_kv_blocks(self, block_size: int, num_layers: int) -> int | None:
        """The file's budget in the planner's layer-blocks of ``block_size`` tokens."""
        if self.device_kv_tokens is None:
            return None
        return self.device_kv_tokens // block_size * num_layers


def _artifact_int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: must be an integer >= {minimum}, got {value!r}")
    return value


def trace_from_artifact(data: dict, step_s: float | None) -> LoadedTrace:
    """The paper artifact's JSON: ``{"requests": {id: {"input_length", "output_length", "arrival_time"}},
    "num_gpu_blocks"?, "block_size"?}`` with ``arrival_time`` in scheduler steps (times ``step_s`` seconds).

    The GPU block budget (``num_gpu_blocks``, or the same key under ``"config"``) counts vLLM-style blocks of
    ``block_size`` tokens (default 16) of every layer; it is returned in tokens.
    """
    if step_s is None:
        raise TraceError("trace: arrival_time is counted in scheduler steps in this format; give --step-s "
                         "(seconds per step) to convert it")
    if not (isinstance(step_s, int | float) and math.isfinite(step_s) and step_s > 0):
        raise TraceError(f"--step-s must be a number > 0, got {step_s!r}")
    requests = data["requests"]
    if not requests:
        raise TraceError("requests: the trace has no requests")
    out = []
    for rid, item in requests.items():
        where = f"requests[{rid!r}]"
        if not isinstance(item, dict):
            raise TraceError(f"{where}: expected an object, got {type(item).__name__}")
        for name in ("input_length", "output_length", "arrival_time"):
            if name not in item:
                raise TraceError(f"{where}.{name}: missing")
        inp = _artifact_int(item["input_length"], f"{where}.input_length", 1)
        outl = _artifact_int(item["output_length"], f"{where}.output_length", 1)
        arrival = item["arrival_time"]
        if not (isinstance(arrival, int | float) and not isinstance(arrival, bool) and math.isfinite(arrival)
                and arrival >= 0):
            raise TraceError(f"{where}.arrival_time: must be a number of steps >= 0, got {arrival!r}")
        out.append(TraceRequest(str(rid), float(arrival) * float(step_s), inp, outl))
    config = data.get("config") if isinstance(data.get("config"), dict) else {}
    blocks = next(((k, src[k]) for src in (data, config) for k in ARTIFACT_BLOCK_KEYS if k in src), None)
    tokens = None
    if blocks is not None:
        n = _artifact_int(blocks[1], blocks[0], 1)
        bs_src = data if "block_size" in data else config
        bs = _artifact_int(bs_src.get("block_size", 16), "block_size", 1)
        tokens = n * bs
    return LoadedTrace(Trace(out), "artifact", tokens)


STEP_S_WITHOUT_TRACE = "--step-s converts the arrival_time of an artifact-format --trace; give --trace"


def load_trace_file(path: str | Path, step_s: float | None = None) -> LoadedTrace:
    """Read a trace file in the project's format (``requests`` a list) or the paper artifact's (``requests``
    a map of id to lengths and a step-counted arrival). Errors name the file and the field."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not text
        raise TraceError(f"{path}: cannot read it as a text file ({type(exc).__name__}: {exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: invalid JSON: {exc}") from exc
    try:
        if isinstance(data, dict) and isinstance(data.get("requests"), dict):
            return trace_from_artifact(data, step_s)
        if step_s is not None:  # it would be ignored: arrival_s is in seconds already
            raise TraceError("--step-s converts an artifact trace's arrival_time (scheduler steps); this trace is in "
                             "the project's format, whose arrival_s is in seconds: leave --step-s out")
        return LoadedTrace(Trace.from_dict(data), "orbitflow")
    except TraceError as exc:
        raise TraceError(f"{path}: {exc}") from exc
