"""Executors run one engine step for a batch; the engine above them does not know which one it has.

`ModelExecutor` runs the real model over the two-tier paged KV cache. A step processes, for every
sequence in the batch, its new tokens (a prompt chunk or the last generated token) on top of the
KV already cached, under the placement that the KV manager holds. Host-resident layers are
prefetched by the transfer engine in the planner's `edf` order and consumed from the device pool.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from orbitflow.kv.manager import KVManager
from orbitflow.runtime.sampling import Sample, SamplingParams, sample


@dataclass
class SeqInput:
    req_id: object
    token_ids: list[int]  # tokens to process this step
    start_pos: int  # tokens of this sequence already in the KV cache
    sample: bool = True  # produce a next token (False for a non-final prefill chunk)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generated: int = 0  # tokens generated so far (seeds per-request sampling)
    prompt_ids: Sequence[int] = ()  # the request's prompt and output so far (penalties read them)
    output_ids: Sequence[int] = ()

    @property
    def is_decode(self) -> bool:
        """One new token on top of a cached context (anything else is a prefill or a prefill chunk)."""
        return self.start_pos > 0 and len(self.token_ids) == 1


@dataclass
class StepResult:
    tokens: list[int | None]  # per sequence, None where sample=False
    step_s: float
    layer_compute_s: list[float]
    layer_stall_s: list[float]
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    device_blocks_used: int = 0
    host_blocks_used: int = 0
    prefill_tokens: int = 0
    link_blocks_per_s: float | None = None  # measured effective link rate of this step's prefetches
    replacement_s: float = 0.0  # simulated time of the placement changes installed before the step
    samples: list[Sample | None] = field(default_factory=list)  # per sequence (empty: tokens only)

    @property
    def compute_s(self) -> float:
        return sum(self.layer_compute_s)

    @property
    def stall_s(self) -> float:
        return sum(self.layer_stall_s)


class Executor(Protocol):
    num_layers: int
    block_size: int
    kv: object

    def step(self, seqs: list[SeqInput]) -> StepResult: ...


class ModelExecutor:
    def __init__(self, model, model_config, kv: KVManager):
        self.model = model
        self.config = model_config
        self.kv = kv
        self.num_layers = model_config.num_layers
        self.block_size = kv.block_size
        self.scale = model_config.head_dim**-0.5
        self.device = kv.device_pool.storage.device
        # No cyclic-GC pass inside a step: a collection there is a pause of its own that the cost model
        # cannot know about (refcounting still frees nearly everything; cycles wait for the next step).
        self.hold_gc = True

    def _decode_writes(self, seqs: list[SeqInput], tables) -> list[tuple | None]:
        """Per layer, for a decode step: the rows whose KV of that layer is on the device and the (block,
        offset) slots their new tokens go to, so each layer writes them in one indexed op."""
        bs, h2d = self.block_size, self.kv.transfer.device.h2d  # index tensors built without a host sync
        writes: list[tuple | None] = []
        for layer in range(self.num_layers):
            rows = [b for b, t in enumerate(tables) if t.on_device[layer]]
            if not rows:
                writes.append(None)
                continue
            writes.append((
                None if len(rows) == len(seqs) else h2d(rows),
                h2d([tables[b].blocks[layer][seqs[b].start_pos // bs] for b in rows]),
                h2d([seqs[b].start_pos % bs for b in rows]),
            ))
        return writes

    def step(self, seqs: list[SeqInput]) -> StepResult:
        """One engine step. Attention reads every request's KV where it lives: a device-resident layer is a
        view of its run of blocks in the device pool, a host-resident one a view of its staging slot, to
        which the new tokens are appended (no gather, no concatenation). On CUDA the same contract would be
        served by a paged decode kernel over the block table (FlashInfer's batch decode or vLLM's
        paged_attention) for the runs that are not contiguous; here a fragmented run is gathered."""
        from orbitflow.model.attention import causal_attention

        kv, transfer = self.kv, self.kv.transfer
        for s in seqs:
            kv.ensure_capacity(s.req_id, s.start_pos + len(s.token_ids))
        tables = [kv.tables[s.req_id] for s in seqs]
        # Prefetch list: every host-resident layer's already-cached blocks, per request, in layer order, into
        # a slot with room for the step's new tokens.
        fetches = {
            b: [(layer, t.blocks[layer][: kv.blocks_for(s.start_pos)], kv.blocks_for(s.start_pos + len(s.token_ids)))
                for layer in range(self.num_layers) if not t.on_device[layer]]
            for b, (s, t) in enumerate(zip(seqs, tables)) if s.start_pos > 0
        }
        host_users = [[b for b in fetches if not tables[b].on_device[layer]] for layer in range(self.num_layers)]
        bounds = [0]
        for s in seqs:
            bounds.append(bounds[-1] + len(s.token_ids))
        totals = [s.start_pos + len(s.token_ids) for s in seqs]
        bytes_h2d, bytes_d2h, busy = transfer.bytes_h2d, transfer.bytes_d2h, transfer.busy_s

        consumed: list[tuple[int, int]] = []  # fetched layers whose slot frees when the next layer starts
        # A pure decode step writes the device-resident rows of a layer in one op.
        decode_writes = self._decode_writes(seqs, tables) if all(s.is_decode for s in seqs) else None
        pool = kv.device_pool

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            transfer.clock.enter(layer)
            # The previous layer has run: its prefetch slots free up (RELEASE) and those requests' next
            # fetches may start. (Releasing right after attention would overlap more, but the planner's
            # `edf` model, and the paper's example, free a slot when its layer has finished.) The slots are
            # fenced by a compute-stream event after the kernels that read them: the copy stream waits on it.
            if consumed:
                fence = transfer.device.record_compute()
                for b, fetched_layer in consumed:
                    transfer.release(b, fetched_layer, after=fence)
                consumed.clear()
            transfer.wait_layer(layer, host_users[layer])
            written = decode_writes[layer] if decode_writes is not None else None
            if written is not None:
                row_index, slot_blocks, slot_offsets = written
                k_dev = k if row_index is None else k.index_select(0, row_index)
                v_dev = v if row_index is None else v.index_select(0, row_index)
                pool.storage[0, slot_blocks, slot_offsets] = k_dev
                pool.storage[1, slot_blocks, slot_offsets] = v_dev
            outputs: list[torch.Tensor] = []
            for b, (s, t) in enumerate(zip(seqs, tables)):
                lo, hi = bounds[b], bounds[b + 1]
                k_new, v_new = k[lo:hi], v[lo:hi]
                if not (written is not None and t.on_device[layer]):
                    kv.write(s.req_id, layer, s.start_pos, k_new, v_new)
                if s.start_pos == 0:
                    keys, values = k_new, v_new
                elif t.on_device[layer]:  # a view of the request's run (a gather only if it is fragmented)
                    keys, values = pool.kv_view(t.blocks[layer], totals[b])
                else:  # READ the staged copy (the cached tokens) and append the new ones to it
                    keys, values = kv.append_staged(transfer.staged(b, layer), s.start_pos, k_new, v_new)
                    consumed.append((b, layer))
                outputs.append(causal_attention(q[lo:hi], keys, values, self.scale))
            return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

        input_ids = transfer.device.h2d([t for s in seqs for t in s.token_ids])
        positions = transfer.device.h2d([p for s in seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))])
        gc_was_enabled = gc.isenabled()
        if self.hold_gc:
            gc.disable()
        transfer.start_step(fetches)  # starts the step's clock
        try:
            with torch.inference_mode():
                hidden = self.model(input_ids, positions, attention)
                last = [bounds[b + 1] - 1 for b, s in enumerate(seqs) if s.sample]
                samples: list[Sample | None] = [None] * len(seqs)
                if last:
                    # The step's one host sync: the logits come to the host once, sampling runs there.
                    logits = transfer.to_host(self.model.compute_logits(hidden[transfer.device.h2d(last)]))
                    sampled = iter(range(len(last)))
                    for b, s in enumerate(seqs):
                        if s.sample:  # never raises: a request whose sampling fails gets Sample.error
                            samples[b] = sample(logits[next(sampled)], s.sampling, s.prompt_ids, s.output_ids)
                tokens = [None if x is None else x.token for x in samples]
        finally:
            transfer.end_step()
            if gc_was_enabled:
                gc.enable()
        compute, stalls, step_s = transfer.clock.resolve(self.num_layers)  # CUDA: event times, after the sync
        device_used, host_used = kv.usage()
        moved, busy = transfer.bytes_h2d - bytes_h2d, transfer.busy_s - busy
        return StepResult(
            tokens=tokens,
            step_s=step_s,
            layer_compute_s=compute,
            layer_stall_s=stalls,
            bytes_h2d=moved,
            bytes_d2h=transfer.bytes_d2h - bytes_d2h,
            device_blocks_used=device_used,
            host_blocks_used=host_used,
            prefill_tokens=sum(len(s.token_ids) for s in seqs if not s.is_decode),
            link_blocks_per_s=moved / busy / kv.host_pool.bytes_per_block if moved and busy > 0 else None,
            samples=samples,
        )
