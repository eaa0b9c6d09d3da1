"""The simulated executor: the same step interface as ModelExecutor, on a virtual clock.

A step costs what the planner's own step-latency model (over a hardware profile) predicts for the placement the
KV manager holds, at the run's prefetch depth (``prefetch_slots``) and link order (``link``: `edf`, or `preemptive`
for ``--kv-link preemptive``), optionally perturbed
by link-contention episodes and by seeded multiplicative noise the planner does not see: with ``noise_cv``
each step (its prefill, decode compute, transfers and interference alike) takes one lognormal factor of mean 1
and that coefficient of variation, the step-to-step jitter `orbitflow profile` measures (``step_noise_cv``) (the
older ``noise`` is one log-normal factor, sigma ``noise``, on the step's compute).
The cost model is the profile's own (`HardwareProfile.cost_model()`), the one the engine's planner uses.
Placement changes between steps cost their bytes over the link plus the profile's host-side cost per moved
layer; a prefill chunk beside decodes adds the measured interference. KV is only counted, never stored.
"""

from __future__ import annotations

import numpy as np

from orbitflow.kv.manager import KVManager
from orbitflow.plan import Placement
from orbitflow.plan.hardware import HardwareProfile, attention_pairs
from orbitflow.runtime.executor import Executor
from orbitflow.runtime.outputs import ScheduleOutput, SeqInput, StepResult


def accounting_kv(profile: HardwareProfile, device_blocks: int | None = None,
                  host_blocks: int | None = None) -> KVManager:
    """A KV manager that counts blocks of the profile's size without allocating them (pools: the given
    sizes, else the profile's)."""
    import torch

    # One "head" of kv_bytes/4 fp16 values per token makes a block weigh exactly block_size * kv_bytes.
    heads = max(1, profile.kv_bytes_per_token_per_layer // 4)
    return KVManager(
        profile.num_layers, heads, 1, device_blocks or profile.device_kv_blocks, host_blocks or profile.host_kv_blocks,
        block_size=profile.block_size, dtype=torch.float16, materialize=False,
    )


class SimExecutor(Executor):
    def __init__(
        self,
        profile: HardwareProfile,
        kv: KVManager,
        clock,
        noise: float = 0.0,
        contention: list[tuple[float, float, float]] | None = None,
        seed: int = 0,
        noise_cv: float = 0.0,
        prefetch_slots: int = 1,
        link: str = "edf",
    ):
        if not (noise_cv >= 0 and np.isfinite(noise_cv)):
            raise ValueError(f"noise_cv must be a finite number >= 0, got {noise_cv!r}")
        self.profile = profile
        self.kv = kv
        self.clock = clock
        self.num_layers = profile.num_layers
        self.block_size = profile.block_size
        self.cost_model = profile.cost_model(link, prefetch_slots)  # the engine planner's very model
        self.noise = noise
        self.noise_cv = noise_cv
        self._ln_sigma = float(np.sqrt(np.log1p(noise_cv**2)))  # lognormal with mean 1 and CV noise_cv
        self.contention = contention or []  # (start_s, end_s, link slowdown factor)
        # A stream of its own: the trace generator is seeded with the same number, and the noise must not be
        # correlated with the arrivals and lengths it perturbs.
        self.rng = np.random.default_rng((seed, 1))
        self._moved_bytes = 0
        self._moves = 0

    def _factors(self, n: int) -> np.ndarray:
        """``n`` seeded lognormal factors of mean 1 and CV ``noise_cv`` (ones when it is 0)."""
        if self._ln_sigma == 0.0:
            return np.ones(n)
        return self.rng.lognormal(-0.5 * self._ln_sigma**2, self._ln_sigma, size=n)

    def link_slowdown(self, t: float) -> float:
        return max([f for start, end, f in self.contention if start <= t < end], default=1.0)

    def execute(self, out: ScheduleOutput) -> StepResult:
        return self.step(out.seqs)

    def step(self, seqs: list[SeqInput]) -> StepResult:
        """Charge one batch over the placement and blocks the KV manager holds (the scheduler installed them)."""
        kv, transfer = self.kv, self.kv.transfer
        slowdown = self.link_slowdown(self.clock.now())
        moved = transfer.bytes_h2d + transfer.bytes_d2h
        moves = transfer.layer_moves
        # Placement changes since the last step: their bytes over the (possibly slowed) link, plus the
        # engine's host-side cost per moved layer.
        move_s = self.profile.placement_change_s(int((moved - self._moved_bytes) * slowdown), moves - self._moves)
        self._moved_bytes, self._moves = moved, moves
        prefill = [s for s in seqs if not s.is_decode]
        decode = [s for s in seqs if s.is_decode]
        noise = float(np.exp(self.rng.normal(0.0, self.noise))) if self.noise > 0 else 1.0
        # noise_cv: one factor for the whole step, prefill, decode compute, transfers and interference alike
        factor = float(self._factors(1)[0]) if self.noise_cv else 1.0
        prefill_tokens = sum(len(s.token_ids) for s in prefill)
        pairs = sum(attention_pairs(s.start_pos, len(s.token_ids)) for s in prefill)
        prefill_s = self.profile.prefill_s(prefill_tokens, pairs) * noise * factor
        compute, stall, h2d = self._decode_cost(decode, slowdown, noise, factor)
        compute[0] += prefill_s  # a prefill in the batch delays the whole step
        if prefill and decode:  # a prefill chunk beside decodes: the measured interference
            compute[0] += self.profile.mixed_step_overhead_s * noise * factor
        device_used, host_used = kv.usage()
        return StepResult(
            tokens=[0 if s.sample else None for s in seqs],
            step_s=float(compute.sum() + stall.sum()),
            layer_compute_s=compute.tolist(),
            layer_stall_s=stall.tolist(),
            bytes_h2d=h2d,
            device_blocks_used=device_used,
            host_blocks_used=host_used,
            prefill_tokens=prefill_tokens,
            link_blocks_per_s=self.profile.link_blocks_per_s / slowdown if h2d else None,
            replacement_s=move_s,
        )

    def _decode_cost(self, decode: list[SeqInput], slowdown: float, noise: float,
                     factor: float = 1.0) -> tuple[np.ndarray, np.ndarray, int]:
        """Per-layer compute and stall seconds of the decode rows under the placement in force (``factor``: the
        step's noise, on its compute and transfers alike; the EDF schedule scales with them), and the bytes
        their host-resident layers bring over the link."""
        kv = self.kv
        if not decode:
            return np.zeros(self.num_layers), np.zeros(self.num_layers), 0
        mask = np.array([kv.tables[s.req_id].on_device for s in decode], dtype=bool)  # True = on device
        blocks = [kv.blocks_for(s.start_pos) for s in decode]
        total_tokens = sum(s.start_pos + 1 for s in decode)
        model = self.cost_model
        if slowdown != 1.0:
            model = model.with_updates(link_blocks_per_s=model.link_blocks_per_s / slowdown)
        est = model.step(Placement.from_mask(mask), blocks, total_tokens=total_tokens)
        # one factor for the whole step, so its time has the CV measured on the real engine (`step_noise_cv`: the
        # machine is slow for a whole step; per-layer factors would average out to noise_cv / sqrt(layers))
        compute = np.asarray(est.compute_per_layer_s) * (noise * factor)
        stall = np.asarray(est.stall_per_layer_s) * factor
        h2d = int(sum(b * int((~row).sum()) for b, row in zip(blocks, mask)) * kv.host_pool.bytes_per_block)
        return compute, stall, h2d
