"""Every knob of the engine, one validated dataclass per concern, each field mirrored as a CLI flag.

- `ModelRunConfig`: which model to run and how (torch threads, seed). (Not `orbitflow.model.config.ModelConfig`,
  which is the architecture read from a checkpoint.)
- `CacheConfig`: the KV cache (block size, device and host pools, link rate, prefetch depth).
- `SchedulerConfig`: admission and batching (batch caps, order, chunked prefill, context and queue length).
- `PlannerConfig`: SLO and placement control (policy, SLO, alpha, windows, re-planning, victims, budgets,
  Token-Deposit).
- `ParallelConfig`: tensor parallelism (ranks, how they share the host link, the collective timeout).
- `ServerConfig`: the HTTP front end of `orbitflow serve`.
- `ClusterConfig`: replicas of `orbitflow serve` on a Ray cluster.

`EngineConfig` composes the engine's concerns; `EngineConfig.build(**flat)` and `replace(**flat)` take flat
flag names (``device_kv_blocks=512``) for tests and scripts. A new concern (tensor parallelism, a cluster) is a
new dataclass here, a field of `EngineConfig` and an entry of `ENGINE_CONCERNS`; its flags follow from the
fields. Each field's metadata holds its flag, help and check, so a bad value reads like a usage error naming
the flag, and `add_config_args` builds the flags from the same place (one definition per flag).
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields
from dataclasses import replace as dc_replace
from typing import Any

DEFAULT_MODEL = "smollm2-135m"
SCHEDULING_CHOICES = ("fcfs", "srtf")
LINK_CHOICES = ("edf", "preemptive")  # kv.transfer.LINKS: the link orders the KV copy worker runs
VICTIM_CHOICES = ("largest-kv+deposit", "longest", "shortest", "random")
DEVICE_CHOICES = ("auto", "cuda", "cpu")
BACKGROUND_PLANNER_CHOICES = ("auto", "process", "thread", "off")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


def _int_unless(text: str, unlimited: tuple[str, ...]) -> int | None:
    """An integer, or None (no limit) for one of the words in ``unlimited``."""
    if text.lower() in unlimited:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def optional_int(text: str) -> int | None:
    """Flag parser for 'N' or 'none' (also '0' and 'inf': no limit)."""
    return _int_unless(text, ("none", "0", "inf"))


def int_or_none(text: str) -> int | None:
    """Flag parser for 'N' or 'none' (also 'inf'): no limit. Unlike :func:`optional_int`, '0' stays 0."""
    return _int_unless(text, ("none", "inf"))


def float_or_auto(text: str) -> float | None:
    """Flag parser for a number of ms or 'auto' (None: the engine picks it)."""
    if text.lower() == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


def option(default: Any, help: str = "", *, type: Callable | None = None, flag: str | None = None,
           check: str | None = None, choices: tuple | None = None, metavar: str | None = None,
           group: str | None = None, cli: bool = True) -> Any:
    """A config field with its CLI flag. ``check``: 'positive', 'positive?' (None allowed), 'positive|inf' (inf
    allowed: never), 'count?' (an int >= 1 or None), 'nonneg', 'nonneg?' (None allowed) or 'unit' (in (0, 1]);
    NaN fails every check, inf all but 'positive|inf'; ``choices`` are checked too. ``group``: flags of one group
    are mutually exclusive. ``cli=False``: a knob for the Python API only."""
    meta = {"help": help, "type": type, "flag": flag, "check": check, "choices": choices, "metavar": metavar,
            "exclusive": group, "cli": cli}
    return field(default=default, metadata=meta)


def flag_of(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def dest_of(f) -> str:
    """The argparse dest and the flat keyword of a field (its flag's name)."""
    return flag_of(f)[2:].replace("-", "_")


def _check_field(flag: str, check: str | None, choices: tuple | None, value: Any) -> None:
    if check in ("positive?", "count?", "nonneg?") and value is None:
        return
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if check == "positive|inf" and value == math.inf:
        return
    if check in ("positive", "positive?", "positive|inf", "nonneg", "nonneg?", "unit") and is_number and \
            not math.isfinite(value):
        raise ConfigError(f"{flag} must be a finite number, got {value!r}")  # NaN passes every comparison below
    if check in ("positive", "positive?", "positive|inf") and (not is_number or value <= 0):
        raise ConfigError(f"{flag} must be a positive number, got {value!r}")
    if check == "count?" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{flag} must be an integer >= 1, got {value!r}")
    if check in ("nonneg", "nonneg?") and (not is_number or value < 0):
        raise ConfigError(f"{flag} must be >= 0, got {value!r}")
    if check == "unit" and not 0 < value <= 1:
        raise ConfigError(f"{flag} must be in (0, 1], got {value!r}")
    if choices is not None and value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def _check_type(flag: str, kind: Callable | None, value: Any) -> None:
    """A field built from Python (not parsed from its flag) has its flag's type: before, ``port='8000'`` failed a
    comparison with a TypeError and ``block_size=16.5`` passed. Integers of any kind (NumPy's too) pass for numbers."""
    if value is None:
        return
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind in (int, optional_int, int_or_none) and not integral:
        raise ConfigError(f"{flag} must be an integer, got {value!r}")
    if kind in (float, float_or_auto) and not (isinstance(value, numbers.Real) and not isinstance(value, bool)):
        raise ConfigError(f"{flag} must be a number, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"{flag} must be true or false, got {value!r}")


def _refuse_set_fields(config, gate: str, why: str) -> None:
    """A ConfigError naming the first field of ``config`` but ``gate`` set away from its default: ``--flag why``
    (the flags that mean nothing unless ``gate`` is set)."""
    for f in fields(config):
        if f.name != gate and getattr(config, f.name) != f.default:
            raise ConfigError(f"{flag_of(f)} {why}")


def check_output_path(path: str | None, flag: str, directory: bool = False) -> None:
    """Raise ConfigError naming ``flag`` unless ``path`` (a file, or with ``directory`` a folder that may not exist
    yet) can be written: checked before a long run, not after it."""
    if not path:  # None, or '' (the flags' "do not write")
        return
    p = os.path.abspath(path)
    if os.path.exists(p):
        if os.path.isdir(p) != directory:
            raise ConfigError(f"{flag}: {path} is {'not ' if directory else ''}a directory")
        if not os.access(p, os.W_OK):
            raise ConfigError(f"{flag}: cannot write {path}")
        return
    parent = os.path.dirname(p)
    while directory and not os.path.exists(parent):  # write_plots makes the missing folders
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag}: {os.path.dirname(p)} is not an existing directory")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag}: cannot write in {parent}")


class _Validated:
    """Checks every field by its metadata after construction, then the dataclass's own `_cross_check`."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(flag_of(f), f.metadata.get("type"), getattr(self, f.name))
            _check_field(flag_of(f), f.metadata.get("check"), f.metadata.get("choices"), getattr(self, f.name))
        self._cross_check()

    def _cross_check(self) -> None:
        pass


@dataclass(frozen=True)
class ModelRunConfig(_Validated):
    name: str = option(DEFAULT_MODEL, "built-in name, HF model directory or GGUF file", flag="--model")
    device: str = option("auto", "where the weights, the device KV pool and the kernels live (auto: cuda when "
                                 "available, else cpu)", choices=DEVICE_CHOICES)
    # torch intra-op threads for the model's compute. None: torch's default, except on a CPU-only machine with
    # a throttled link, where one core is left to the KV copy thread (see `EngineConfig.resolved_compute_threads`).
    compute_threads: int | None = option(
        None, "torch intra-op threads (default: torch's, or all cores but one for the KV copy thread when "
              "--link-gbps throttles a CPU-only run)", type=int, check="positive?", metavar="N")
    seed: int = option(0, "seed of sampling, the random victim rule and the simulator's noise", type=int,
                       check="nonneg")  # numpy's generators take no negative seed


@dataclass(frozen=True)
class CacheConfig(_Validated):
    # Both pools count blocks of `block_size` tokens of ONE layer (K and V).
    block_size: int = option(16, "tokens per KV block", type=int, check="positive")
    device_kv_blocks: int = option(
        4096, "device KV budget in blocks (one block = K and V of --block-size tokens of one layer)", type=int,
        check="positive")
    host_kv_blocks: int = option(65536, "host KV pool size in blocks", type=int, check="positive")
    link_gbps: float | None = option(
        None, "throttle host<->device KV copies to this many GB/s (stands in for PCIe)", type=float,
        check="positive?")
    # Prefetch depth: KV buffer slots per request, i.e. how many of its host layers may be in flight at once
    # (charged by the capacity equation). None: the policy's own (DeepSpeed, FlexGen and FlexGen+ 2, as their code
    # prefetches layer i+1 while layer i runs; every other policy 1).
    prefetch_slots: int | None = option(
        None, "prefetch depth: KV layers of one request in flight at once (default: the policy's own: DeepSpeed, "
              "FlexGen and FlexGen+ 2, others 1); the capacity equation charges D layers of buffer per request",
        type=int, check="count?", metavar="D")

    # The link order of the KV copies, which the planner's cost model also assumes (its `transfer`).
    kv_link: str = option(
        "edf", "KV prefetch link order: edf (a copy holds the link to its end, earliest-needed layer first) or "
               "preemptive (copies move in chunks of --kv-link-chunk-ms of link time and yield between two to an "
               "earlier layer's); the planner plans for the link the engine runs", choices=LINK_CHOICES)
    # 0.5 ms: on the CPU engine (benchmarks/kv_link.py) 0.1 ms chunks cost the step loop up to ~3% in copy-worker
    # wake-ups; on CUDA the worker keeps at most two chunks queued, so an urgent copy waits for at most about 1 ms.
    kv_link_chunk_ms: float = option(
        0.5, "--kv-link preemptive: link time of one chunk, ms (at least one block); shorter chunks let an urgent "
             "copy in sooner, at one more copy call and worker wake-up each (a copy that no earlier layer's can "
             "overtake moves in one)", type=float, check="positive")

    @property
    def link_bytes_per_s(self) -> float | None:
        return None if self.link_gbps is None else self.link_gbps * 1e9


@dataclass(frozen=True)
class SchedulerConfig(_Validated):
    max_num_seqs: int = option(4, "running batch size cap", type=int, check="positive")
    max_num_batched_tokens: int = option(32768, "cap on prompt + output tokens of the running batch (a request "
                                                "longer than it still runs, alone)", type=int, check="positive")
    scheduling: str = option("fcfs", "admission order", choices=SCHEDULING_CHOICES)
    chunked_prefill: int | None = option(
        None, "prefill long prompts in chunks of N tokens interleaved with decode steps", type=int,
        check="positive?", metavar="N")
    max_model_len: int | None = option(None, "context length cap (default: the model's)", type=int,
                                       check="positive?")
    # More waiting requests than this get 503 (None: unbounded); `serve` defaults it to 256.
    max_queue_len: int | None = option(
        None, "requests that may wait for admission beyond the batch's free places (--max-num-seqs); more get 503 "
              "with Retry-After ('none': unbounded)", type=int_or_none, check="positive?", metavar="N|none")


# The longest decode window a solve may look ahead (--window-max): its time grows with it.
WINDOW_MAX_LIMIT = 4096


@dataclass(frozen=True)
class PlannerConfig(_Validated):
    policy: str = option("orbitflow", "placement policy (orbitflow or a baseline)")
    slo_ms: float | None = option(None, "per-token (TBT) SLO in milliseconds", type=float, check="positive?",
                                  group="slo")
    slo_scale: float = option(1.5, "SLO as a multiple of the no-offload decode step with a full device budget",
                              type=float, check="positive", group="slo")
    token_deposit: bool = option(True, "pace delivery with Token-Deposit", type=bool)
    # A stream paced exactly one SLO apart misses it at the client whenever a token leaves later than the one
    # before it (the event loop's timers, the GIL): benchmarks/deposit_guard.py measures how often.
    deposit_guard_ms: float | None = option(
        0.0, "pace delivery this many ms under the SLO, and plan for the SLO less it, so that the delivery's own "
             "jitter (event-loop timers, the GIL) stays inside the SLO as a client measures it (the planner plans for "
             "the pace with --no-token-deposit too); 'auto': the lesser of 5 ms and a tenth of the SLO (serve's "
             "default; elsewhere nothing is delivered live, and it is 0)",
        type=float_or_auto, check="nonneg?", metavar="MS|auto")
    # Tolerated SLO violations per step, averaged over the decode window. The paper uses 1; that lets one
    # request miss the SLO on every step indefinitely, while a pause costs a single long gap, so we
    # default to 0.5 (see docs/results.md for the comparison).
    alpha: float = option(0.5, "tolerated SLO violations per step (planner cap)", type=float, check="nonneg")
    window_min: int = option(4, "shortest decode window (steps)", type=int, check="positive")
    window_max: int = option(64, "longest decode window (steps, at most 4096)", type=int, check="positive")
    victim: str = option("largest-kv+deposit", "pause victim rule", choices=VICTIM_CHOICES)
    # Planner budget per solve (like a MILP solver's): past it the best plan found so far is used.
    plan_node_limit: int | None = option(
        2000, "branch-and-bound nodes per planner solve; past it the best plan found is used ('none', '0' or "
              "'inf': no limit, the optimum proven)", type=optional_int,
        check="positive?", metavar="N|none")
    plan_time_limit_ms: float | None = option(
        None, "wall-clock budget per planner solve (default: none; the node limit alone bounds it)", type=float,
        check="positive?", metavar="MS")
    plan_gap: float = option(
        0.0, "relative gap per planner solve, as a MIP solver's MIPGap (Gurobi's default: 1e-4): a solve stops once "
             "its plan is proven within it of the best possible, and a plan's expiry check looks only for plans "
             "faster by more than it (0: exact, within the node and time limits)",
        type=float, check="nonneg", metavar="GAP")
    plan_threads: int = option(
        1, "threads of a planner solve without a node limit (--plan-node-limit none): its search splits among them "
           "(the same optimum, sooner on a host with spare cores)", type=int, check="positive", metavar="N")
    mismatch_threshold: float = option(0.25, "re-plan when the measured step latency is off by more than this "
                                             "fraction", type=float, check="positive", cli=False)
    ewma: float = option(0.3, "weight of a new measurement when refreshing the profile", type=float, check="unit",
                         cli=False)
    background_planner: str = option(
        "auto", "where an expiry's plan is solved while the steps before it run: process (never holds the "
                "engine's GIL), thread or off; auto: process with 4 or more cores, else thread",
        choices=BACKGROUND_PLANNER_CHOICES)

    def _cross_check(self) -> None:
        if self.slo_ms is not None and self.deposit_guard_ms is not None and self.deposit_guard_ms >= self.slo_ms:
            raise ConfigError(f"--deposit-guard-ms ({self.deposit_guard_ms:g}) must be under --slo-ms "
                              f"({self.slo_ms:g})")
        if self.window_min > self.window_max:
            raise ConfigError(f"--window-min ({self.window_min}) must not exceed --window-max ({self.window_max})")
        if self.plan_gap >= 1:  # a gap of 1 accepts any plan: no bound is ever needed
            raise ConfigError(f"--plan-gap must be under 1 (a relative gap), got {self.plan_gap:g}")
        if self.window_max > WINDOW_MAX_LIMIT:  # a solve looks that many steps ahead: 30,000 took 30 s
            raise ConfigError(f"--window-max must be at most {WINDOW_MAX_LIMIT} steps, got {self.window_max}")
        default_scale = PlannerConfig.__dataclass_fields__["slo_scale"].default
        if self.slo_ms is not None and self.slo_scale != default_scale:  # the flags are exclusive; the API too
            raise ConfigError(f"--slo-ms and --slo-scale are exclusive (got {self.slo_ms:g} ms and a scale of "
                              f"{self.slo_scale:g}); give one")

    @property
    def plan_time_limit_s(self) -> float | None:
        return None if self.plan_time_limit_ms is None else self.plan_time_limit_ms / 1000


@dataclass(frozen=True)
class ServerConfig(_Validated):
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on", type=int)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on every route but /health and /metrics")
    served_model_name: str | None = option(None, "model name clients send (default: --model)")
    shutdown_timeout: float = option(10.0, "on SIGTERM, let requests in flight finish for S seconds, then abort "
                                           "them", type=float, check="positive", metavar="S")
    max_body_bytes: int = option(8 * 1024 * 1024, "larger request bodies get 413", type=int, check="positive")
    watchdog_s: float = option(60.0, "/health answers 503 when the engine loop has not advanced for S seconds "
                                     "with work pending (inf: never)", type=float, check="positive|inf", metavar="S")

    def _cross_check(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            # what --api-key "$UNSET" gives: serving without authentication is then a surprise, not a choice
            raise ConfigError("--api-key is empty; give a key, or omit the flag to serve without one")


ROUTER_CHOICES = ("slo-aware", "least-loaded", "round-robin")


@dataclass(frozen=True)
class ClusterConfig(_Validated):
    """`orbitflow serve --replicas N`: engine replicas behind one API on Ray Serve (serve/cluster.py)."""

    replicas: int | None = option(
        None, "serve N engine replicas behind this API on Ray Serve (default: one engine in this process)",
        type=int, check="count?", metavar="N")
    ray_address: str | None = option(
        None, "join this Ray cluster (e.g. 'auto' or 'ray://head:10001') (default: start Ray on this machine)")
    router: str = option(
        "slo-aware", "how requests pick a replica: slo-aware (power of two choices by the replicas' planned SLO "
                     "headroom, else least loaded), least-loaded, or round-robin", choices=ROUTER_CHOICES)
    replica_cpus: float = option(1.0, "CPUs Ray reserves for each engine replica", type=float, check="positive")
    replica_gpus: float | None = option(
        None, "GPUs Ray reserves for each engine replica (default: --tensor-parallel-size with --device cuda, or with "
              "--device auto on a Ray cluster that has GPUs; else 0)", type=float, check="nonneg?", metavar="N")

    def _cross_check(self) -> None:
        if self.replicas is None:  # one engine in this process: a replica flag would be ignored without a word
            _refuse_set_fields(self, "replicas", "needs --replicas N")


TP_LINK_CHOICES = ("shared", "per-rank")


@dataclass(frozen=True)
class ParallelConfig(_Validated):
    """How the engine spreads one model over several processes (tensor parallelism)."""

    # Ranks the model is split over (Megatron-style: heads and MLP units). 1: no parallelism, no extra processes.
    tensor_parallel_size: int = option(
        1, "split the model over N processes launched by orbitflow (gloo on the CPU, NCCL on CUDA); N must divide "
           "the model's KV heads and intermediate size (with `profile`: every rank's compute, link and all-reduce "
           "times are measured into the profile)", type=int, check="count?", metavar="N")
    # How the ranks reach host memory: one link each (a PCIe slot per GPU) or one shared link (a PCIe switch).
    tp_link: str = option(
        "per-rank", "per-rank: every rank has its own host link of --link-gbps; shared: the ranks share one (each "
                    "gets 1/N of it); the planner's cost model charges each rank the rate it gets",
        choices=TP_LINK_CHOICES)
    # A collective that waits longer than this (a rank died or hangs) fails the step, the requests in flight and
    # /health, instead of hanging the server.
    collective_timeout_s: float = option(
        60.0, "a rank that dies or hangs for S seconds fails the requests in flight and /health", type=float,
        check="positive", flag="--collective-timeout", metavar="S")

    def _cross_check(self) -> None:
        if self.tensor_parallel_size is None:
            raise ConfigError("--tensor-parallel-size must be an integer >= 1, got None")
        if self.tensor_parallel_size == 1:  # no ranks: a rank flag would be ignored without a word
            _refuse_set_fields(self, "tensor_parallel_size", "needs --tensor-parallel-size N with N > 1")

    def rank_link_bytes_per_s(self, link_bytes_per_s: float | None) -> float | None:
        """The throttle of one rank's link: the whole link per rank, or an equal share of one shared link."""
        if link_bytes_per_s is None or self.tp_link == "per-rank":
            return link_bytes_per_s
        return link_bytes_per_s / self.tensor_parallel_size


# EngineConfig's fields, in order: (field name, concern class, --help group title).
ENGINE_CONCERNS = (
    ("model", ModelRunConfig, "model"),
    ("cache", CacheConfig, "KV cache"),
    ("scheduler", SchedulerConfig, "scheduling"),
    ("planner", PlannerConfig, "SLO and placement control"),
    ("parallel", ParallelConfig, "tensor parallelism"),
)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs: `EngineConfig(model=..., cache=..., scheduler=..., planner=...)`, or
    `EngineConfig.build(model="tiny", device_kv_blocks=512, alpha=1.0)` by flat flag names."""

    model: ModelRunConfig = field(default_factory=ModelRunConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def build(cls, **flat) -> EngineConfig:
        return cls().replace(**flat)

    def replace(self, **flat) -> EngineConfig:
        """A copy with fields changed by flat name (``policy="deepspeed"``, ``model="tiny"``)."""
        changes: dict[str, dict] = {name: {} for name, _, _ in ENGINE_CONCERNS}
        for key, value in flat.items():
            concern, field_name = _FLAT_FIELDS.get(key, (None, None))
            if concern is None:
                raise ConfigError(f"unknown config field(s): {key}")
            changes[concern][field_name] = value
        return dc_replace(self, **{name: dc_replace(getattr(self, name), **c) for name, c in changes.items() if c})

    def resolved_compute_threads(self, cuda: bool) -> int | None:
        """Threads to give torch (None: leave torch's setting alone). On the CPU the copy thread's transfers
        run on the same cores as the compute: with torch on every core, the copy thread waits for a core on
        each wake-up and the step time varies with who wins (benchmarks/engine_variance.py). Measured again
        after the copy thread stopped using torch (2026-11-27, 2 cores, link 0.3 GB/s): every core is faster
        (OrbitFlow's decode step median 30-31 ms against 51-52 ms) but no longer what the cost model predicts
        (`benchmarks/sim_vs_engine.py --quick`: per-step error p95 27.7% against 9.5-13.3%, stall error 22-26%
        against 5-13%, the transfer model stalling 49-56% less than measured for FlexGen+ and DeepSpeed), and
        the planner plans with that model."""
        if self.model.compute_threads is not None:
            return self.model.compute_threads
        if cuda or self.cache.link_gbps is None:
            return None
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores - 1)


# flat name (the flag's dest) -> (EngineConfig field, the concern's field)
_FLAT_FIELDS = {dest_of(f): (name, f.name) for name, cls, _ in ENGINE_CONCERNS for f in fields(cls)}


# ---- CLI flags from the dataclasses ---------------------------------------------------------------------
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says what the default is."""

    def _get_help_string(self, action) -> str:
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _default(f) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()


def add_config_args(parser, cls, title: str | None = None, only: Iterable[str] | None = None,
                    defaults: dict[str, Any] | None = None, helps: dict[str, str] | None = None):
    """Add a flag per CLI field of the config dataclass ``cls`` (in an argument group ``title``), with the
    field's default, type, choices and help. ``only`` picks fields by flat name; ``defaults``/``helps`` override
    a subcommand's own. Returns the group."""
    defaults, helps = defaults or {}, helps or {}
    wanted = None if only is None else set(only)
    group = parser.add_argument_group(title) if title else parser
    exclusive: dict[str, Any] = {}
    for f in fields(cls):
        dest, meta = dest_of(f), f.metadata
        if not meta.get("cli", True) or (wanted is not None and dest not in wanted):
            continue
        kwargs: dict[str, Any] = {"dest": dest, "default": defaults.get(dest, _default(f)),
                                  "help": helps.get(dest, meta.get("help", ""))}
        if meta.get("type") is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update({k: meta[k] for k in ("type", "choices", "metavar") if meta.get(k) is not None})
        target = group
        if meta.get("exclusive"):
            if meta["exclusive"] not in exclusive:
                exclusive[meta["exclusive"]] = group.add_mutually_exclusive_group()
            target = exclusive[meta["exclusive"]]
        target.add_argument(flag_of(f), **kwargs)
    return group


# serve's and generate's --profile (plan's and simulate's take a preset too: they plan for other machines)
PROFILE_FLAG_HELP = ("a hardware profile JSON from `orbitflow profile --out FILE` on this machine, for this model "
                     "(default: measure this machine at start, a minute or more)")
SERVING_ONLY = ("max_queue_len",)  # engine flags that only mean something behind the HTTP API


def add_engine_args(parser, defaults: dict[str, Any] | None = None, helps: dict[str, str] | None = None,
                    skip: Iterable[str] = ()) -> None:
    """Every engine flag but ``skip`` (flat names), grouped by concern."""
    for _, cls, title in ENGINE_CONCERNS:
        only = [dest_of(f) for f in fields(cls) if dest_of(f) not in skip]
        add_config_args(parser, cls, title, only=only, defaults=defaults, helps=helps)


def config_from_args(cls, args: argparse.Namespace, **overrides):
    """An instance of the config dataclass ``cls`` from parsed flags (fields without a flag keep defaults)."""
    values = {f.name: getattr(args, dest_of(f)) for f in fields(cls) if hasattr(args, dest_of(f))}
    values.update(overrides)
    return cls(**values)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of parsed engine flags; ``overrides`` by flat name."""
    flat = {key: getattr(args, key) for key in _FLAT_FIELDS if hasattr(args, key)}
    flat.update(overrides)
    return EngineConfig.build(**flat)
