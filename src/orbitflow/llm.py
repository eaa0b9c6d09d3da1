"""Build an engine from one EngineConfig: the entry point of `generate`, `serve` and the Python API.

    llm = LLM(EngineConfig.build(model="smollm2-135m", device_kv_blocks=2048))
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import time
from dataclasses import dataclass

import torch

from orbitflow.config import ConfigError, EngineConfig
from orbitflow.kv.manager import KVManager
from orbitflow.kv.pool import block_bytes
from orbitflow.plan.hardware import HardwareProfile
from orbitflow.plan.placement import most_blocks
from orbitflow.policies import Policy, make_policy
from orbitflow.policies.base import PlanContext, default_slo_s, prefetch_slots_for
from orbitflow.runtime.clock import WallClock
from orbitflow.runtime.engine import Engine
from orbitflow.runtime.executor import ModelExecutor
from orbitflow.runtime.request import Request
from orbitflow.runtime.sampling import SamplingParams

log = logging.getLogger("orbitflow")


@dataclass
class GenerateStats:
    device_blocks_peak: int
    host_blocks_peak: int
    bytes_h2d: int
    bytes_d2h: int
    stall_s: float
    step_s: list[float]
    pauses: int
    solver_calls: int
    link_preemptions: int = 0  # prefetches that yielded the link to an earlier layer's (--kv-link preemptive)
    overflow_blocks_peak: int = 0  # most prefetch staging blocks held outside the device budget at once


def machine_profile(path: str | None) -> HardwareProfile | str:
    """What ``--profile FILE`` gives LLM: the profile in the file, or "measure" without one (ConfigError naming the
    flag for a file that is missing or not a profile)."""
    if path is None:
        return "measure"
    try:
        return HardwareProfile.load(path)
    except (OSError, ValueError) as exc:  # ValueError: a ProfileError, or a file that is not text
        raise ConfigError(f"--profile {path}: {getattr(exc, 'strerror', None) or exc}") from None


def _check_profile_fits(profile: HardwareProfile, num_layers: int, block_size: int, kv_bytes: int,
                        link_bytes_per_s: float | None) -> None:
    """A profile measured for another model shape, dtype or block size would plan with the wrong layers or KV sizes
    (``kv_bytes``: this engine's KV bytes per token and layer), and one of another link throttle with the wrong link
    (``link_bytes_per_s``: this engine's throttle of one rank's link, None: none; the profile holds the throttle it was
    measured under, or the rate it measured)."""
    if (profile.num_layers, profile.block_size) != (num_layers, block_size):
        raise ConfigError(f"hardware profile {profile.name!r} is of {profile.num_layers} layers and "
                          f"{profile.block_size}-token blocks, this engine runs {num_layers} layers and {block_size}-"
                          "token blocks: measure this model with `orbitflow profile --out FILE` (same --model and "
                          "--block-size)")
    if profile.kv_bytes_per_token_per_layer != kv_bytes:
        raise ConfigError(f"hardware profile {profile.name!r} moves {profile.kv_bytes_per_token_per_layer} KV bytes "
                          f"per token and layer, this engine {kv_bytes} (another model, dtype or "
                          "--tensor-parallel-size): measure it with `orbitflow profile --out FILE` and the same flags")
    if link_bytes_per_s is not None and not math.isclose(profile.link_bytes_per_s, link_bytes_per_s, rel_tol=1e-6):
        raise ConfigError(f"hardware profile {profile.name!r} plans for a link of {profile.link_bytes_per_s / 1e9:g} "
                          f"GB/s, this engine's is throttled to {link_bytes_per_s / 1e9:g} GB/s (--link-gbps): "
                          "measure it with `orbitflow profile --out FILE` and the same flags")


def _check_config_for_model(cfg: EngineConfig, policy: Policy, mc) -> None:
    """What the model's config alone decides, before minutes of measuring: the policy runs on it (e.g. --placement
    distance:D past the last layer), the pools hold a request of it; and a --max-model-len past its context is said."""
    policy.check_model(mc.num_layers)
    _check_pools_hold_a_request(cfg, policy, mc.num_layers)
    # Past the model's context: allowed, as transformers allows it (benchmarks/engine_vs_hf.py decodes past 8192
    # tokens beside it), but said, since vLLM refuses it by default.
    if (cfg.scheduler.max_model_len or 0) > mc.max_position_embeddings:
        log.warning("--max-model-len %d exceeds %s's context of %d tokens: positions past it were never trained, "
                    "and the output may degrade", cfg.scheduler.max_model_len, cfg.model.name,
                    mc.max_position_embeddings)


def _check_pools_hold_a_request(cfg: EngineConfig, policy: Policy, num_layers: int) -> None:
    """Raise ConfigError naming the pool flags when together they cannot hold even the shortest request (one block a
    layer and its prefetch buffer), before minutes of measuring; the server checks the exact longest request the
    policy can serve once the engine is up (``OpenAIServer.local``)."""
    cache = cfg.cache
    least = most_blocks(1, num_layers, prefetch_slots_for(cfg, policy))
    if cache.device_kv_blocks + cache.host_kv_blocks < least:
        raise ConfigError(f"--device-kv-blocks {cache.device_kv_blocks} and --host-kv-blocks {cache.host_kv_blocks} "
                          f"hold no request: the shortest one takes {least:g} blocks (one a layer, {num_layers} "
                          "layers, and its prefetch buffer); raise them")


class LLM:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        policy: Policy | None = None,
        profile: HardwareProfile | str = "measure",
        loaded=None,
    ):
        from orbitflow.model.loader import load_model

        self.config = config or EngineConfig()
        cfg = self.config
        tp = cfg.parallel.tensor_parallel_size
        self.policy = policy or make_policy(cfg.planner.policy)  # a mistyped --policy fails before the loading
        # With tensor parallelism the ranks load their own shards; this process needs config and tokenizer.
        started = time.perf_counter()
        if loaded is None:
            log.info("loading %s%s", cfg.model.name, f" on {tp} tensor-parallel ranks" if tp > 1 else "")
        self.loaded = loaded or load_model(cfg.model.name, weights=tp == 1)
        mc = self.loaded.config
        _check_config_for_model(cfg, self.policy, mc)
        self.executor = self._build_executor(mc)
        self.kv = self.executor.kv
        # the link order the engine runs, set before the profile is measured (its per-transfer latency then includes
        # the chunks' own cost)
        self.kv.transfer.link, self.kv.transfer.chunk_s = cfg.cache.kv_link, cfg.cache.kv_link_chunk_ms / 1e3
        if profile == "measure":
            log.info("loaded in %.1f s; measuring this machine's decode step and link (the SLO and the planner's "
                     "cost model come from it)", time.perf_counter() - started)
        try:
            self.profile = self._profile(profile, mc)
        except Exception:  # a profile refused, or a measurement that failed: no copy thread or rank left behind
            self.kv.close()
            raise
        for pool in (self.kv.device_pool, self.kv.host_pool):
            pool.reset_peak()
        # Everything loaded so far lives as long as the engine: move it out of the cyclic GC's sight, so a
        # collection (which the executor also keeps out of its steps) never walks the model's objects.
        gc.collect()
        gc.freeze()
        self.clock = WallClock()
        max_len = cfg.scheduler.max_model_len or mc.max_position_embeddings
        ctx = PlanContext.from_profile(cfg, self.profile, self.policy)
        self.kv.transfer.prefetch_slots = ctx.cost_model.prefetch_slots  # the engine runs the depth it plans for
        try:
            self.engine = Engine(
                cfg, self.executor, self.policy, ctx, self.clock,
                default_slo_s(cfg, self.profile), self.loaded.tokenizer.eos_token_ids, max_len,
                vocab_size=mc.vocab_size,
            )
        except Exception:  # a config the measured SLO refuses (--deposit-guard-ms): no copy thread or rank left behind
            self.kv.close()
            raise
        self._ids = itertools.count()

    def _profile(self, profile: HardwareProfile | str, mc) -> HardwareProfile:
        """The hardware profile the engine plans with: the one given, this machine's measured ("measure"), or a
        rough one that is enough to evaluate a fixed placement ("rough")."""
        from orbitflow.runtime.profiler import PROFILE_MAX_BATCH, profile_executor

        cfg, cache = self.config, self.config.cache
        if isinstance(profile, HardwareProfile):
            _check_profile_fits(profile, mc.num_layers, cache.block_size,
                                self.kv.device_pool.bytes_per_block // cache.block_size,
                                cfg.parallel.rank_link_bytes_per_s(cache.link_bytes_per_s))
            return profile
        if profile == "measure":
            started = time.perf_counter()
            name = f"{cfg.model.name}@this-machine"
            tp = cfg.parallel.tensor_parallel_size
            batch = min(max(cfg.scheduler.max_num_seqs, 2), PROFILE_MAX_BATCH)  # the batch sizes it will run
            measured = (self.executor.measure_profile(name=name, batch=batch) if tp > 1
                        else profile_executor(self.executor, name, batch=batch))
            log.info("measured in %.1f s: decode step %.1f ms + %.3f ms per 1K tokens, link %.2f GB/s",
                     time.perf_counter() - started, 1e3 * measured.decode_b, 1e6 * measured.decode_a,
                     measured.link_bytes_per_s / 1e9)
            return measured
        return HardwareProfile(
            name="rough", num_layers=mc.num_layers,
            kv_bytes_per_token_per_layer=self.kv.device_pool.bytes_per_block // cache.block_size,
            decode_a=0.0, decode_b=1e-3 * mc.num_layers,
            link_bytes_per_s=cfg.parallel.rank_link_bytes_per_s(cache.link_bytes_per_s) or 10e9,
            device_kv_blocks=cache.device_kv_blocks, host_kv_blocks=cache.host_kv_blocks,
            block_size=cache.block_size,
        )

    def _build_executor(self, mc):
        """One ModelExecutor over this process's KV pools, or (--tensor-parallel-size N > 1) the driver of N
        rank processes, each with its shard of the model and of both KV pools."""
        cfg, cache = self.config, self.config.cache
        device = resolve_device(cfg.model.device)
        model = self.loaded.model
        dtype = next(model.parameters()).dtype if model is not None else torch.float32
        if cfg.parallel.tensor_parallel_size > 1:  # the ranks load their own shards; this process keeps no weights
            from orbitflow.runtime.tp_executor import TensorParallelExecutor

            return TensorParallelExecutor(
                self.loaded.path, mc, cfg.parallel, device_kv_blocks=cache.device_kv_blocks,
                host_kv_blocks=cache.host_kv_blocks, block_size=cache.block_size,
                link_bytes_per_s=cache.link_bytes_per_s, dtype=dtype, compute_threads=cfg.model.compute_threads,
                cuda=None if cfg.model.device == "auto" else device == "cuda",
            )
        model.to(device)  # the weights live where the KV and the kernels are (no-op on the CPU)
        threads = cfg.resolved_compute_threads(cuda=device == "cuda")
        if threads is not None and threads != torch.get_num_threads():
            torch.set_num_threads(threads)  # process-wide: torch has one intra-op pool
        try:
            kv = KVManager(
                mc.num_layers, mc.num_kv_heads, mc.head_dim, cache.device_kv_blocks, cache.host_kv_blocks,
                block_size=cache.block_size, device=device, link_bytes_per_s=cache.link_bytes_per_s, dtype=dtype,
            )
        except RuntimeError as exc:  # the allocator's "can't allocate memory" (torch.OutOfMemoryError on CUDA)
            per_block = block_bytes(cache.block_size, mc.num_kv_heads, mc.head_dim, dtype)
            raise ConfigError(
                f"cannot allocate the KV pools of --device-kv-blocks {cache.device_kv_blocks} and --host-kv-blocks "
                f"{cache.host_kv_blocks} ({per_block} bytes a block at --block-size {cache.block_size}): "
                f"{str(exc).splitlines()[0]}; lower them") from None
        return ModelExecutor(model, mc, kv)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def generate(
        self, prompts: list[str] | list[list[int]], sampling: SamplingParams, chat: bool = False, progress=None
    ) -> list[Request]:
        """Run prompts to completion; returns the finished requests in prompt order. A prompt the engine refuses
        (too long, a full queue) or a failure while they run aborts every one of them: none stays queued."""
        engine = self.engine
        encoded = [self.encode(prompt, chat) if isinstance(prompt, str) else list(prompt) for prompt in prompts]
        reqs = []
        try:
            for ids in encoded:
                reqs.append(engine.add_request(f"gen-{next(self._ids)}", ids, sampling))
            engine.run_until_done(on_step=progress)
        except BaseException:
            for req in reqs:
                engine.abort(req.request_id)
            engine.step()  # drains the aborts: every block goes back to its pool
            raise
        failed = [r for r in reqs if r.finish_reason == "error"]
        if failed:
            raise RuntimeError(failed[0].error)
        return reqs

    def stats(self) -> GenerateStats:
        s = self.engine.stats
        return GenerateStats(
            device_blocks_peak=self.kv.device_pool.peak_used, host_blocks_peak=self.kv.host_pool.peak_used,
            bytes_h2d=s.bytes_h2d, bytes_d2h=s.bytes_d2h, stall_s=s.stall_s, step_s=list(s.step_s), pauses=s.pauses,
            solver_calls=self.engine.controller.solver_calls, link_preemptions=s.link_preemptions,
            overflow_blocks_peak=s.overflow_blocks_peak,
        )

    def close(self) -> None:
        self.engine.close()


def resolve_device(requested: str) -> str:
    """``--device``: auto is cuda when torch sees a GPU, else cpu; cuda without one is an error."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device cuda: torch {torch.__version__} sees no CUDA device on this machine")
    return requested
