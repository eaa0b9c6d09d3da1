"""Every knob of the engine in one validated object.

`EngineConfig` is what the CLI, the server, the simulator and the tests build; each field's
error message names the CLI flag that sets it, so a bad value reads like a usage error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from orbitflow.parallel_config import ParallelConfig

DEFAULT_MODEL = "smollm2-135m"
SCHEDULING_CHOICES = ("fcfs", "srtf")
VICTIM_CHOICES = ("largest-kv+deposit", "longest", "shortest", "random")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    # KV cache: both pools count blocks of `block_size` tokens of ONE layer (K and V).
    block_size: int = 16
    device_kv_blocks: int = 4096
    host_kv_blocks: int = 65536
    link_gbps: float | None = None  # throttle host<->device copies to this many GB/s (None: unthrottled)
    # torch intra-op threads for the model's compute. None: torch's default, except on a CPU-only machine with
    # a throttled link, where one core is left to the KV copy thread (see `resolved_compute_threads`).
    compute_threads: int | None = None
    # Scheduling.
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 32768
    scheduling: str = "fcfs"
    chunked_prefill: int | None = None  # prefill long prompts in chunks of this many tokens
    max_model_len: int | None = None  # defaults to the model's context length
    max_queue_len: int | None = None  # requests allowed to wait for admission (None: unbounded); more get 503
    # SLO and control.
    policy: str = "orbitflow"
    slo_ms: float | None = None  # per-token (TBT) SLO; None: derived from slo_scale x base SLO
    slo_scale: float = 1.5
    token_deposit: bool = True
    # Tolerated SLO violations per step, averaged over the decode window. The paper uses 1; that lets one
    # request miss the SLO on every step indefinitely, while a pause costs a single long gap, so we
    # default to 0.5 (see docs/results.md for the comparison).
    alpha: float = 0.5
    window_min: int = 4
    window_max: int = 64
    mismatch_threshold: float = 0.25  # re-plan when measured step latency is off by more than this fraction
    ewma: float = 0.3  # weight of a new measurement when refreshing the profile
    victim: str = "largest-kv+deposit"
    plan_in_background: bool = True  # solve one step ahead on a planner thread
    # Planner budget per solve (like a MILP solver's): past it the best plan found so far is used.
    plan_node_limit: int | None = 2000
    plan_time_limit_ms: float | None = None
    # Prefetch depth: KV buffer slots per request, i.e. how many of its host layers may be in flight at once
    # (charged by the capacity equation). None: the policy's own (DeepSpeed 2, as it prefetches layer i+1
    # while layer i runs; every other policy 1).
    prefetch_slots: int | None = None
    seed: int = 0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # tensor parallelism (--tensor-parallel-size)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def positive(name: str, flag: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{flag} must be a positive number, got {value!r}")

        positive("block_size", "--block-size")
        positive("device_kv_blocks", "--device-kv-blocks")
        positive("host_kv_blocks", "--host-kv-blocks")
        positive("link_gbps", "--link-gbps", allow_none=True)
        positive("compute_threads", "--compute-threads", allow_none=True)
        positive("max_num_seqs", "--max-num-seqs")
        positive("max_num_batched_tokens", "--max-num-batched-tokens")
        positive("chunked_prefill", "--chunked-prefill", allow_none=True)
        positive("max_model_len", "--max-model-len", allow_none=True)
        positive("max_queue_len", "--max-queue-len", allow_none=True)
        positive("plan_node_limit", "--plan-node-limit", allow_none=True)
        positive("plan_time_limit_ms", "--plan-time-limit-ms", allow_none=True)
        positive("slo_ms", "--slo-ms", allow_none=True)
        if self.prefetch_slots is not None and (not isinstance(self.prefetch_slots, int)
                                                or isinstance(self.prefetch_slots, bool) or self.prefetch_slots < 1):
            raise ConfigError(f"--prefetch-slots must be an integer >= 1, got {self.prefetch_slots!r}")
        positive("slo_scale", "--slo-scale")
        positive("window_min", "--window-min")
        positive("window_max", "--window-max")
        positive("mismatch_threshold", "--mismatch-threshold")
        if self.alpha < 0:
            raise ConfigError(f"--alpha must be >= 0, got {self.alpha!r}")
        if self.window_min > self.window_max:
            raise ConfigError(f"--window-min ({self.window_min}) must not exceed --window-max ({self.window_max})")
        if not 0 < self.ewma <= 1:
            raise ConfigError(f"--ewma must be in (0, 1], got {self.ewma!r}")
        if self.scheduling not in SCHEDULING_CHOICES:
            raise ConfigError(f"--scheduling must be one of {', '.join(SCHEDULING_CHOICES)}, got {self.scheduling!r}")
        if self.victim not in VICTIM_CHOICES:
            raise ConfigError(f"--victim must be one of {', '.join(VICTIM_CHOICES)}, got {self.victim!r}")

    def resolved_compute_threads(self, cuda: bool) -> int | None:
        """Threads to give torch (None: leave torch's setting alone). On the CPU the copy thread's transfers
        run on the same cores as the compute: with torch on every core, the copy thread waits for a core on
        each wake-up and the step time varies with who wins (benchmarks/engine_variance.py)."""
        if self.compute_threads is not None:
            return self.compute_threads
        if cuda or self.link_gbps is None:
            return None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores - 1)

    @property
    def link_bytes_per_s(self) -> float | None:
        return None if self.link_gbps is None else self.link_gbps * 1e9

    def replace(self, **changes) -> EngineConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
        values.update(changes)
        return EngineConfig(**values)
