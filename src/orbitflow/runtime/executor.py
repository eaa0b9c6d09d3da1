"""Executors run one engine step for a batch; the engine above them does not know which one it has.

`ModelExecutor` runs the real model over the two-tier paged KV cache. A step processes, for every
sequence in the batch, its new tokens (a prompt chunk or the last generated token) on top of the
KV already cached, under the placement that the KV manager holds. Host-resident layers are
prefetched by the transfer engine in the planner's `edf` order and consumed from the device pool.
"""

from __future__ import annotations

import gc
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from orbitflow.kv.manager import KVManager
from orbitflow.runtime.outputs import ScheduleOutput, SeqInput, StepResult
from orbitflow.runtime.sampling import Sample, sample

__all__ = ["Executor", "ModelExecutor", "SeqInput", "StepResult"]


class Executor(ABC):
    """Runs one engine step. The engine calls `execute` exactly once per step with the scheduler's output.

    Contract: the KV manager already holds the placement and every block the step needs (the scheduler
    installed them), so an executor only computes; it returns a `StepResult` whose `tokens[i]` answers
    `out.seqs[i]`. An exception fails that step's requests, not the engine. Implemented by `ModelExecutor`
    (the model, in this process), `SimExecutor` (the cost model on a virtual clock) and, later, a
    tensor-parallel driver that sends `out` to its workers in one collective call.
    """

    num_layers: int

    @abstractmethod
    def execute(self, out: ScheduleOutput) -> StepResult: ...


class ModelExecutor(Executor):
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
        self.progress_at = 0.0  # time.monotonic() when the last layer started (read by the server's watchdog)
        self.progress_cell = None  # a tensor-parallel rank also writes it here (shared with its driver)

    def _decode_writes(self, seqs: list[SeqInput], tables) -> list[tuple | None]:
        """Per layer, for a decode step: the rows whose KV of that layer is on the device and the (block,
        offset) slots their new tokens go to, so each layer writes them in one indexed op. Every layer's index
        tensors are slices of one tensor built once per step (on CUDA one pinned copy, not three a layer)."""
        bs, everyone = self.block_size, len(seqs)
        block_of = [s.start_pos // bs for s in seqs]
        offset_of = [s.start_pos % bs for s in seqs]
        flat: list[int] = []
        spans: list[tuple[int, int, bool] | None] = []
        for layer in range(self.num_layers):
            rows = [b for b, t in enumerate(tables) if t.on_device[layer]]
            if not rows:
                spans.append(None)
                continue
            spans.append((len(flat), len(rows), len(rows) < everyone))
            if len(rows) < everyone:
                flat += rows
            flat += [tables[b].blocks[layer][block_of[b]] for b in rows]
            flat += [offset_of[b] for b in rows]
        index = self.kv.transfer.device.h2d(flat)
        writes: list[tuple | None] = []
        for span in spans:
            if span is None:
                writes.append(None)
                continue
            at, n, subset = span
            row_index = index[at:at + n] if subset else None
            at += n if subset else 0
            writes.append((row_index, index[at:at + n], index[at + n:at + 2 * n]))
        return writes

    def execute(self, out: ScheduleOutput) -> StepResult:
        return self.step(out.seqs)

    def step(self, seqs: list[SeqInput]) -> StepResult:
        """Run one batch over the placement and blocks the KV manager holds (the scheduler installed them;
        standalone callers such as the profiler grow KV first). Attention reads every request's KV where it
        lives: a device-resident layer is a view of its run of blocks in the device pool, a host-resident one a
        view of its staging slot, to which the new tokens are appended (no gather, no concatenation). On CUDA
        the same contract would be served by a paged decode kernel over the block table (FlashInfer's batch
        decode or vLLM's paged_attention) for the runs that are not contiguous; here a fragmented run is
        gathered."""
        st = self._bind_placement(seqs)
        transfer = self.kv.transfer
        before = transfer.bytes_h2d, transfer.bytes_d2h, transfer.busy_s, transfer.preemptions
        gc_was_enabled = gc.isenabled()
        if self.hold_gc:
            gc.disable()
        self._start_prefetches(st)  # starts the step's clock
        try:
            with torch.inference_mode():
                hidden = self._run_layers(st)
                samples = self._sample(st, hidden)
        finally:
            transfer.end_step()
            if gc_was_enabled:
                gc.enable()
        return self._result(st, samples, before)

    def _bind_placement(self, seqs: list[SeqInput]) -> _StepState:
        """The step's view of the placement in force: each row's block table, the host-resident layers to
        prefetch, and (for a pure decode step) the slots the device-resident rows write."""
        kv = self.kv
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
        # A pure decode step writes the device-resident rows of a layer in one op.
        decode_writes = self._decode_writes(seqs, tables) if all(s.is_decode for s in seqs) else None
        # Split-K (`decode_splits`) only with no copy beside the step: on the CPU the copy thread takes a core, and
        # the extra calls cost more than the even share gains (2048 x 4, distance:2: 26 vs 30 tok/s without it).
        split_k = not any(fetches.values())
        return _StepState(seqs, tables, fetches, host_users, bounds, [s.start_pos + len(s.token_ids) for s in seqs],
                          decode_writes, split_k)

    def _start_prefetches(self, st: _StepState) -> None:
        """Hand the step's prefetch list to the transfer engine (fetches run while the layers compute)."""
        self.kv.transfer.start_step(st.fetches)

    def _run_layers(self, st: _StepState) -> torch.Tensor:
        """The forward pass; `attention` runs once per layer: release, wait for the layer's fetches, write
        the new K/V, attend over each row's KV where it lives."""
        transfer = self.kv.transfer
        consumed: list[tuple[int, int]] = []  # fetched layers whose slot frees when the next layer starts

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.progress_at = now = time.monotonic()  # the server's watchdog: a long step is busy, not stalled
            if self.progress_cell is not None:
                self.progress_cell.value = now
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
            transfer.wait_layer(layer, st.host_users[layer])
            if st.decode_writes is not None:
                return self._decode_layer(st, layer, q, k, v, consumed)
            return self._mixed_layer(st, layer, q, k, v, consumed)

        seqs = st.seqs
        input_ids = transfer.device.h2d([t for s in seqs for t in s.token_ids])
        positions = transfer.device.h2d([p for s in seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))])
        return self.model(input_ids, positions, attention)

    def _decode_layer(self, st: _StepState, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      consumed: list[tuple[int, int]]) -> torch.Tensor:
        """One layer of a pure decode step (one new token a row): the device-resident rows' K/V written in one
        indexed op, every row's KV read as a view in SDPA's layout (`decode_attention`: one call a row, or one
        for rows of one length at evenly spaced runs)."""
        from orbitflow.model.attention import decode_attention

        kv, pool, transfer, tables, totals = self.kv, self.kv.device_pool, self.kv.transfer, st.tables, st.totals
        written = st.decode_writes[layer]
        if written is not None:
            row_index, slot_blocks, slot_offsets = written
            pool.storage[0, slot_blocks, slot_offsets] = k if row_index is None else k.index_select(0, row_index)
            pool.storage[1, slot_blocks, slot_offsets] = v if row_index is None else v.index_select(0, row_index)
        views = []
        for b, t in enumerate(tables):
            if t.on_device[layer]:  # a view of the request's run (a gather only if it is fragmented)
                views.append(pool.heads_view(t.blocks[layer], totals[b]))
                continue
            s = st.seqs[b]  # its tier gets the new token; READ the staged copy and append the token to it
            kv.write(s.req_id, layer, s.start_pos, k[b:b + 1], v[b:b + 1])
            keys, values = kv.append_staged(transfer.staged(b, layer), s.start_pos, k[b:b + 1], v[b:b + 1])
            consumed.append((b, layer))
            views.append((keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)))
        return decode_attention(q, views, self.scale, split_k=st.split_k)

    def _mixed_layer(self, st: _StepState, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     consumed: list[tuple[int, int]]) -> torch.Tensor:
        """One layer of a step with prompt chunks: rows of any length, each written and attended on its own."""
        from orbitflow.model.attention import causal_attention

        kv, pool, transfer, bounds = self.kv, self.kv.device_pool, self.kv.transfer, st.bounds
        outputs: list[torch.Tensor] = []
        for b, (s, t) in enumerate(zip(st.seqs, st.tables)):
            lo, hi = bounds[b], bounds[b + 1]
            k_new, v_new = k[lo:hi], v[lo:hi]
            kv.write(s.req_id, layer, s.start_pos, k_new, v_new)
            if s.start_pos == 0:
                keys, values = k_new, v_new
            elif t.on_device[layer]:  # a view of the request's run (a gather only if it is fragmented)
                keys, values = pool.kv_view(t.blocks[layer], st.totals[b])
            else:  # READ the staged copy (the cached tokens) and append the new ones to it
                keys, values = kv.append_staged(transfer.staged(b, layer), s.start_pos, k_new, v_new)
                consumed.append((b, layer))
            outputs.append(causal_attention(q[lo:hi], keys, values, self.scale, split_k=st.split_k))
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _sample(self, st: _StepState, hidden: torch.Tensor) -> list[Sample | None]:
        """One Sample per row that asked for a token (None elsewhere); never raises for one request's
        sampling failure (it comes back as Sample.error)."""
        seqs, bounds, transfer = st.seqs, st.bounds, self.kv.transfer
        last = [bounds[b + 1] - 1 for b, s in enumerate(seqs) if s.sample]
        samples: list[Sample | None] = [None] * len(seqs)
        if last:
            # The step's one host sync: the logits come to the host once, sampling runs there.
            logits = transfer.to_host(self.model.compute_logits(hidden[transfer.device.h2d(last)]))
            sampled = iter(range(len(last)))
            for b, s in enumerate(seqs):
                if s.sample:
                    samples[b] = sample(logits[next(sampled)], s.sampling, s.prompt_ids, s.output_ids, s.generated)
        else:  # nothing sampled (a non-final prefill chunk): the step still ends in its one sync, so the clock's
            # CUDA events have completed when `_result` resolves them (and step_s is the GPU's time)
            transfer.clock.mark_gpu_end()
            transfer.device.host_sync("step timing")
        return samples

    def _result(self, st: _StepState, samples: list[Sample | None], before: tuple[int, int, float, int]) -> StepResult:
        kv, transfer = self.kv, self.kv.transfer
        compute, stalls, step_s = transfer.clock.resolve(self.num_layers)  # CUDA: event times, after the sync
        device_used, host_used = kv.usage()
        moved, busy = transfer.bytes_h2d - before[0], transfer.busy_s - before[2]
        return StepResult(
            tokens=[None if x is None else x.token for x in samples],
            step_s=step_s,
            layer_compute_s=compute,
            layer_stall_s=stalls,
            bytes_h2d=moved,
            bytes_d2h=transfer.bytes_d2h - before[1],
            device_blocks_used=device_used,
            host_blocks_used=host_used,
            prefill_tokens=sum(len(s.token_ids) for s in st.seqs if not s.is_decode),
            link_blocks_per_s=moved / busy / kv.host_pool.bytes_per_block if moved and busy > 0 else None,
            link_preemptions=transfer.preemptions - before[3],
            overflow_blocks=transfer.overflow_blocks_peak,
            samples=samples,
        )


@dataclass
class _StepState:
    """One ModelExecutor step's working set (built by `_bind_placement`, filled in by the layers)."""

    seqs: list[SeqInput]
    tables: list  # RequestBlocks per row
    fetches: dict  # row -> [(layer, cached block ids, slot blocks)] for its host-resident layers
    host_users: list[list[int]]  # per layer: rows that read it from a prefetch slot
    bounds: list[int]  # row b's new tokens are hidden[bounds[b]:bounds[b + 1]]
    totals: list[int]  # per row: tokens in its KV after this step
    decode_writes: list | None  # per layer, for a pure decode step (see `_decode_writes`)
    split_k: bool  # one-token rows may split their keys (`decode_splits`): no copy runs beside this step
