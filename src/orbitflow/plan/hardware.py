"""Hardware profiles: the latency and capacity facts the cost model and the simulator run on.

A profile is plain data (JSON on disk). Units: seconds, bytes, tokens, and *layer-blocks*: one
layer-block is ``block_size`` tokens of one layer's KV (all KV heads of the model), the unit the
planner counts in. Under tensor parallelism a layer-block is spread over the TP group; each GPU moves
its ``1 / tensor_parallel`` share over its own link.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from orbitflow.plan.cost_model import CostModel, batch_extra_s

# Default prefill model: prefill_b = decode_b (one pass over the weights) and prefill_a = decode_b / RIDGE.
# A batch of prompt tokens turns the weight GEMMs compute-bound around the GPU's roofline ridge
# (FLOP/s over bytes/s, ~150-300 for fp16 on A5000/A6000/A100), so every further ~RIDGE prompt tokens
# cost about one more weight pass. Quadratic attention cost is ignored.
PREFILL_RIDGE_TOKENS = 256

VALID_TP = (1, 2, 4)


class ProfileError(ValueError):
    """A profile (or a profile file) is malformed; the message names the field."""


def attention_pairs(cached: int, new: int) -> int:
    """(query, key) pairs that causal attention scores for ``new`` tokens after ``cached`` ones."""
    return new * cached + new * (new + 1) // 2


MAX_TABLE_REQUESTS = 1024  # the largest batch a decode_batch_table row may name (the cost model densifies it)
MAX_LAYERS = 1024  # the deepest model a profile may describe (the largest LLMs have about 128 layers)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    num_layers: int
    kv_bytes_per_token_per_layer: int  # whole model (all KV heads), not per GPU
    decode_a: float  # decode step seconds per token in the batch
    decode_b: float  # decode step seconds per step
    link_bytes_per_s: float  # host-to-device copy rate of one GPU, without contention
    device_kv_blocks: int  # device KV budget in layer-blocks (whole TP group)
    host_kv_blocks: int  # host KV capacity in layer-blocks
    block_size: int = 16
    # Optional measured per-layer compute: rows [total_tokens, seconds per layer], interpolated linearly
    # (extrapolated from the end segments). Overrides decode_a/decode_b for layer compute.
    layer_compute_table: list[list[float]] | None = None
    prefill_a: float | None = None  # seconds per prompt token; None: decode_b / PREFILL_RIDGE_TOKENS
    prefill_b: float | None = None  # seconds per prefill call; None: decode_b
    # seconds per (query, key) pair a prefill's causal attention scores (its quadratic part): a chunk of n new
    # tokens after p cached ones scores n * p + n * (n + 1) / 2 pairs (`attention_pairs`); 0 in the presets
    prefill_c: float = 0.0
    tensor_parallel: int = 1
    # Divides the link rate: TP all-reduces ride the same PCIe links and the GPUs share the host's root
    # complex. None: 1 + 0.5 * log2(tensor_parallel), i.e. 1.0 / 1.5 / 2.0 for TP 1 / 2 / 4 (assumed).
    link_contention: float | None = None
    # Engine overheads (measured by `orbitflow profile`; 0 in presets and older profiles, i.e. an ideal engine):
    # seconds per decode step for every request in the batch beyond the first (per-request work in each layer),
    decode_per_request_s: float = 0.0
    # ... or, where measured, rows [requests, seconds]: a decode step of that many requests over one request holding
    # as many tokens, interpolated linearly between rows (from [1, 0]) and past the last row growing by
    # decode_per_request_s a request. On the CPU it is not linear: torch's float32 matmul takes a slower kernel path
    # from 4 rows up, so a 4th request can cost several times what a 2nd or 3rd does (`decode_batch_extra_s`).
    decode_batch_table: list[list[float]] | None = None  # requests up to MAX_TABLE_REQUESTS
    # fixed seconds per prefetch transfer on top of bytes / link rate (the copy thread's wake-up and dispatch),
    transfer_latency_s: float = 0.0
    # host-side seconds per layer moved by a placement change (eviction or move) on top of bytes / link rate,
    move_latency_s: float = 0.0
    # extra seconds of a step that runs a prefill chunk beside decodes, over prefill and decode run apart.
    mixed_step_overhead_s: float = 0.0
    # share of decode compute that runs after the last layer's attention (final norm, LM head, sampling), so
    # no transfer can hide behind it; the other layers share the rest evenly.
    decode_tail_fraction: float = 0.0
    # extra compute seconds of a decode layer that reads prefetched KV, per prefetch depth (entry d-1 for depth
    # d, the last entry for deeper ones; None: 0): on the CPU the copy thread's work beside the compute (its
    # wake-ups and GIL handoffs) slows every layer that waits on a transfer, hidden under the link when the
    # link is the bottleneck, like any compute.
    host_layer_compute_s: list[float] | None = None
    # coefficient of variation of a decode step's time around its median when the very same step repeats: the
    # machine's step-to-step jitter, which no cost model predicts. The simulator's default noise for this
    # profile (`orbitflow simulate --noise-cv`); None: not measured (presets).
    step_noise_cv: float | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance, carried through JSON

    def __post_init__(self) -> None:
        self._validate()

    # ----------------------------------------------------------------- validation
    def _validate(self) -> None:
        def need(ok: bool, fname: str, why: str) -> None:
            if not ok:
                raise ProfileError(f"profile {self.name!r}: field '{fname}' {why}")

        need(isinstance(self.name, str) and bool(self.name), "name", "must be a non-empty string")
        for fname in ("num_layers", "kv_bytes_per_token_per_layer", "block_size", "device_kv_blocks",
                      "host_kv_blocks", "tensor_parallel"):
            value = getattr(self, fname)
            need(isinstance(value, int) and not isinstance(value, bool), fname,
                 f"must be an integer, got {value!r}")
        for fname in ("num_layers", "kv_bytes_per_token_per_layer", "block_size"):
            need(getattr(self, fname) > 0, fname, f"must be > 0, got {getattr(self, fname)}")
        # every plan is an [R, num_layers] mask: a typo'd count would die allocating it, not here
        need(self.num_layers <= MAX_LAYERS, "num_layers", f"must be at most {MAX_LAYERS}, got {self.num_layers}")
        for fname in ("device_kv_blocks", "host_kv_blocks"):
            need(getattr(self, fname) >= 0, fname, f"must be >= 0, got {getattr(self, fname)}")
        need(self.tensor_parallel in VALID_TP, "tensor_parallel",
             f"must be one of {VALID_TP}, got {self.tensor_parallel}")
        need(self.kv_bytes_per_token_per_layer % self.tensor_parallel == 0, "kv_bytes_per_token_per_layer",
             f"must divide evenly over tensor_parallel={self.tensor_parallel}")
        for fname, positive in (("decode_a", False), ("decode_b", False), ("link_bytes_per_s", True),
                                ("prefill_a", False), ("prefill_b", False), ("link_contention", True)):
            value = getattr(self, fname)
            if value is None and fname in ("prefill_a", "prefill_b", "link_contention"):
                continue
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            need(ok, fname, f"must be a finite number, got {value!r}")
            need(value > 0 if positive else value >= 0, fname, f"must be {'>' if positive else '>='} 0")
        if self.layer_compute_table is None:  # the step time, hence the base SLO, must not be 0
            need(self.decode_a > 0 or self.decode_b > 0, "decode_b",
                 "must be > 0 where decode_a is 0 (a decode step that takes no time gives an SLO of 0)")
        for fname in ("decode_per_request_s", "transfer_latency_s", "move_latency_s", "mixed_step_overhead_s",
                      "prefill_c"):
            value = getattr(self, fname)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            need(ok and value >= 0, fname, f"must be a finite number >= 0, got {value!r}")
        tail = self.decode_tail_fraction
        need(isinstance(tail, int | float) and not isinstance(tail, bool) and math.isfinite(tail) and 0 <= tail < 1,
             "decode_tail_fraction", f"must be a number in [0, 1), got {tail!r}")
        host = self.host_layer_compute_s
        if host is not None:
            ok = (isinstance(host, list | tuple) and len(host) >= 1
                  and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                          for v in host))
            need(ok, "host_layer_compute_s", f"must be a non-empty list of numbers >= 0 (one per prefetch depth), "
                                             f"got {host!r}")
        if self.decode_batch_table is not None:
            self._validate_batch_table(need)
        cv = self.step_noise_cv
        if cv is not None:
            need(isinstance(cv, int | float) and not isinstance(cv, bool) and math.isfinite(cv) and 0 <= cv < 1,
                 "step_noise_cv", f"must be a number in [0, 1) or null, got {cv!r}")
        if self.link_contention is not None:
            need(self.link_contention >= 1.0, "link_contention", "must be >= 1 (it divides the link rate)")
        need(isinstance(self.notes, str), "notes", "must be a string")
        need(isinstance(self.extra, dict), "extra", "must be a JSON object")
        if self.layer_compute_table is not None:
            self._validate_table(need)

    def _validate_table(self, need: Any) -> None:
        table = self.layer_compute_table
        need(isinstance(table, list) and len(table) >= 1, "layer_compute_table", "must be a non-empty list")
        prev = -math.inf
        for i, row in enumerate(table):
            ok = (isinstance(row, list | tuple) and len(row) == 2
                  and all(isinstance(v, int | float) and math.isfinite(v) for v in row))
            need(ok, f"layer_compute_table[{i}]", f"must be [tokens, seconds], got {row!r}")
            need(row[0] >= 0 and row[1] >= 0, f"layer_compute_table[{i}]", "must be non-negative")
            need(row[0] > prev, f"layer_compute_table[{i}]", "tokens must be strictly increasing")
            prev = row[0]

    def _validate_batch_table(self, need: Any) -> None:
        table = self.decode_batch_table
        need(isinstance(table, list) and len(table) >= 1, "decode_batch_table", "must be a non-empty list or null")
        prev = 1
        for i, row in enumerate(table):
            ok = (isinstance(row, list | tuple) and len(row) == 2
                  and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in row))
            need(ok, f"decode_batch_table[{i}]", f"must be [requests, seconds], got {row!r}")
            need(float(row[0]).is_integer() and prev < row[0] <= MAX_TABLE_REQUESTS, f"decode_batch_table[{i}]",
                 f"requests must be whole numbers from 2 to {MAX_TABLE_REQUESTS}, strictly increasing, got {row[0]!r}")
            need(row[1] >= 0, f"decode_batch_table[{i}]", f"seconds must be >= 0, got {row[1]!r}")
            prev = row[0]

    # ----------------------------------------------------------------- derived quantities
    def decode_batch_extra_s(self, num_requests: int) -> float:
        """Extra seconds of a decode step of ``num_requests`` requests over one request holding as many tokens
        (``decode_batch_table``, else ``decode_per_request_s`` per request beyond the first): what the cost model
        charges."""
        return batch_extra_s(self._batch_overhead_s(), self.decode_per_request_s, num_requests)

    def _batch_overhead_s(self) -> tuple[float, ...]:
        """``decode_batch_table`` at every batch size from 2 to its last row (linear from [1, 0] between rows)."""
        table = self.decode_batch_table
        if not table:
            return ()
        rows = [(1.0, 0.0), *((float(r), float(s)) for r, s in table)]
        sizes, seconds = [r for r, _ in rows], [s for _, s in rows]
        return tuple(float(np.interp(float(r), sizes, seconds)) for r in range(2, int(table[-1][0]) + 1))

    @property
    def effective_link_contention(self) -> float:
        if self.link_contention is not None:
            return self.link_contention
        return 1.0 + 0.5 * math.log2(self.tensor_parallel)

    @property
    def effective_link_bytes_per_s(self) -> float:
        """Per-GPU host-to-device rate left for KV after TP traffic."""
        return self.link_bytes_per_s / self.effective_link_contention

    @property
    def block_bytes(self) -> int:
        """Bytes of one layer-block (whole model; each TP rank holds 1 / tensor_parallel of it)."""
        return self.block_size * self.kv_bytes_per_token_per_layer

    @property
    def link_blocks_per_s(self) -> float:
        """Layer-blocks per second over the link. Under TP all ranks move their shards in parallel."""
        shard_bytes = self.block_bytes / self.tensor_parallel
        return self.effective_link_bytes_per_s / shard_bytes

    @property
    def device_kv_tokens(self) -> int:
        """Tokens whose KV (all layers) fits in the device budget."""
        return self.device_kv_blocks * self.block_size // self.num_layers

    def layer_compute_s(self, total_tokens: float) -> np.ndarray:
        """Per-layer decode compute seconds for a batch holding ``total_tokens`` tokens, shape [L]."""
        if total_tokens < 0:
            raise ValueError(f"total_tokens must be >= 0, got {total_tokens}")
        if self.layer_compute_table is None:
            per_layer = (self.decode_a * total_tokens + self.decode_b) / self.num_layers
        else:
            per_layer = _interp_extrapolate(self.layer_compute_table, float(total_tokens))
        per_layer = max(per_layer, 0.0)
        out = np.full(self.num_layers, per_layer, dtype=np.float64)
        if self.decode_tail_fraction > 0 and self.num_layers > 1:
            total = per_layer * self.num_layers
            out[:] = total * (1 - self.decode_tail_fraction) / self.num_layers
            out[-1] += total * self.decode_tail_fraction
        return out

    def decode_step_no_offload_s(self, total_tokens: float) -> float:
        """Decode step seconds of one request when every layer's KV is on the device."""
        return float(self.layer_compute_s(total_tokens).sum())

    def cost_model(self, transfer: str = "edf", prefetch_slots: int = 1) -> CostModel:
        """THE step-latency model of this hardware: the engine's planner (`PlanContext.from_profile`), the
        controller's mismatch check and the simulator (`SimExecutor`) all predict with this one, so a
        calibrated profile calibrates all of them at once."""
        return CostModel(self.layer_compute_s, self.link_blocks_per_s, transfer, num_layers=self.num_layers,
                         request_overhead_s=self.decode_per_request_s, batch_overhead_s=self._batch_overhead_s(),
                         transfer_latency_s=self.transfer_latency_s, prefetch_slots=prefetch_slots,
                         host_layer_s=self.host_layer_s(prefetch_slots))

    def host_layer_s(self, prefetch_slots: int = 1) -> float:
        """Extra compute seconds of a layer that reads prefetched KV at this prefetch depth."""
        table = self.host_layer_compute_s
        if not table:
            return 0.0
        return float(table[min(max(prefetch_slots, 1), len(table)) - 1])

    def placement_change_s(self, nbytes: int, layers_moved: int) -> float:
        """Seconds the engine spends on a placement change of ``nbytes`` (whole-model bytes, as `block_bytes`
        counts them): its bytes over the link plus a host-side cost per moved layer. Under TP every rank moves its
        own shard at once, as a prefetch does (`link_blocks_per_s`)."""
        if nbytes <= 0 and layers_moved <= 0:
            return 0.0
        return nbytes / self.tensor_parallel / self.effective_link_bytes_per_s + layers_moved * self.move_latency_s

    def prefill_s(self, num_tokens: int, pairs: int | None = None) -> float:
        """Seconds of a prefill step over ``num_tokens`` prompt tokens whose attention scores ``pairs`` (query,
        key) pairs (default: one fresh prompt, `attention_pairs(0, num_tokens)`)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens == 0:
            return 0.0
        a = self.prefill_a if self.prefill_a is not None else self.decode_b / PREFILL_RIDGE_TOKENS
        b = self.prefill_b if self.prefill_b is not None else self.decode_b
        pairs = attention_pairs(0, num_tokens) if pairs is None else pairs
        return a * num_tokens + b + self.prefill_c * pairs

    def layer_transfer_s(self, tokens: float) -> float:
        """Seconds to move ``tokens`` tokens of one layer's KV from host to device."""
        return tokens / self.block_size / self.link_blocks_per_s

    def transfer_to_compute_ratio(self, tokens: float) -> float:
        """Moving one layer's KV of ``tokens`` tokens over computing that layer (paper section 2.2)."""
        return self.layer_transfer_s(tokens) / float(self.layer_compute_s(tokens)[0])

    def base_slo_s(self) -> float:
        """Base TBT SLO: decode step without offloading when the KV in use fills the device budget."""
        return self.decode_step_no_offload_s(self.device_kv_tokens)

    # ----------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> HardwareProfile:
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ProfileError(f"{source}: unknown field(s) {unknown}; known fields: {sorted(known)}")
        required = [f.name for f in known.values()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ProfileError(f"{source}: missing required field(s) {missing}")
        kwargs = dict(data)
        if isinstance(kwargs.get("layer_compute_table"), list):
            kwargs["layer_compute_table"] = [list(r) if isinstance(r, list | tuple) else r
                                             for r in kwargs["layer_compute_table"]]
        # JSON has one number type: accept 4096.0 for an integer field, not 4096.5.
        for name in ("num_layers", "kv_bytes_per_token_per_layer", "block_size", "device_kv_blocks",
                     "host_kv_blocks", "tensor_parallel"):
            value = kwargs.get(name)
            if isinstance(value, float) and value.is_integer():
                kwargs[name] = int(value)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str, source: str = "profile") -> HardwareProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{source}: invalid JSON: {exc}") from exc
        return cls.from_dict(data, source=source)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        path = Path(path)
        return cls.from_json(path.read_text(), source=str(path))

    def with_overrides(self, **overrides: Any) -> HardwareProfile:
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ProfileError(f"profile {self.name!r}: cannot override unknown field(s) {unknown}")
        return dataclasses.replace(self, **overrides)


def _interp_extrapolate(table: list[list[float]], x: float) -> float:
    xs = [row[0] for row in table]
    ys = [row[1] for row in table]
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(x, xs, ys))
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return ys[i] + slope * (x - xs[i])


# ----------------------------------------------------------------------------- calibration
def fit_link_rate(profile: HardwareProfile, targets: dict[int, float]) -> float:
    """Link bytes/s whose transfer-to-compute ratios best match ``targets`` ({tokens: ratio}).

    With a pure bandwidth model the ratio at ``tokens`` is inversely proportional to the rate, so the
    least-squares fit in log space is the geometric mean of the rates each target implies alone.
    The result is the raw link rate (before TP contention).
    """
    if not targets:
        raise ValueError("targets must not be empty")
    logs = []
    for tokens, ratio in targets.items():
        kv_bytes = tokens * profile.kv_bytes_per_token_per_layer / profile.tensor_parallel
        implied = kv_bytes / (ratio * float(profile.layer_compute_s(tokens)[0]))
        logs.append(math.log(implied * profile.effective_link_contention))
    return math.exp(sum(logs) / len(logs))


# ----------------------------------------------------------------------------- presets
_PRESET_PACKAGE = "orbitflow.plan"
_PRESET_DIR = "presets"


def list_presets() -> list[str]:
    root = resources.files(_PRESET_PACKAGE).joinpath(_PRESET_DIR)
    return sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> HardwareProfile:
    names = list_presets()
    if name not in names:
        raise ProfileError(f"unknown hardware preset {name!r}; available: {', '.join(names)}")
    text = resources.files(_PRESET_PACKAGE).joinpath(_PRESET_DIR).joinpath(f"{name}.json").read_text()
    return HardwareProfile.from_json(text, source=f"preset {name}")


def resolve_profile(name_or_path: str | Path) -> HardwareProfile:
    """A preset name, or a path to a profile JSON file."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return HardwareProfile.load(path)
    if str(name_or_path) not in list_presets():
        raise ProfileError(f"{str(name_or_path)!r} is neither a profile JSON file nor a hardware preset (presets: "
                           f"{', '.join(list_presets())})")
    return load_preset(str(name_or_path))
