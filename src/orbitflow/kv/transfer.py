"""Moves KV blocks between the host and device pools over one (optionally throttled) link.

Within a decode step the schedule is the one the planner's `edf` cost model assumes:
- every request has `prefetch_slots` prefetch slots (the prefetch depth d, default ONE); its first d
  host-resident layers may start moving at step start, its k-th (k >= d) only after its (k-d)-th fetched
  layer has been consumed (`release`);
- the link serves one transfer at a time, non-preemptively, earliest-needed layer first
  (ties: lower batch index);
- a layer waits until all of its host-resident KV has arrived (`wait_layer`); that wait is its stall.

Staging slots are carved from the device pool, so fetched KV counts against the device budget. A slot is
one run of blocks sized for the cached tokens plus the step's new ones: the executor appends the new K/V to
it and attention reads it as a view, so the staged copy is the only copy. A slot's life has three marked
points: ACQUIRE (`_stage`, copy thread: allocate and fill), READ (`staged`, compute thread, after
`wait_layer`) and RELEASE (`release` once the layer has run, or `end_step`). The
capacity equation reserves one layer's worth of host KV for them (the paper's prefetch buffer); when
prefetching ahead needs more than the pool has free at that moment, the slot overflows into a scratch
tensor rather than waiting (waiting could deadlock against a slot that is only consumed later). The
overflow is counted (`overflow_blocks_peak`), so the budget is never exceeded silently.
On CUDA the copies run on a dedicated stream and completion is an event; on the CPU (every machine
here) a copy thread does them, sleeping so that each copy lasts bytes / link rate.
"""

from __future__ import annotations

import heapq
import sys
import threading
import time
from dataclasses import dataclass

import torch

from orbitflow.kv.pool import BlockPool, OutOfBlocks, is_run


@dataclass
class _Fetch:
    batch_index: int
    layer: int
    host_blocks: list[int]
    capacity: int  # blocks the slot holds: the cached ones plus room for this step's new tokens
    staging: list[int] | None = None  # device-pool block ids, or None when `scratch` holds the data
    scratch: torch.Tensor | None = None
    event: object | None = None  # torch.cuda.Event on CUDA


class TransferEngine:
    def __init__(self, device_pool: BlockPool, host_pool: BlockPool, link_bytes_per_s: float | None = None):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.link_bytes_per_s = link_bytes_per_s
        self.prefetch_slots = 1  # prefetch depth: fetches of one request that may be in flight at once
        self.materialized = device_pool.storage is not None
        self.is_cuda = self.materialized and device_pool.storage.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device_pool.storage.device) if self.is_cuda else None
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.layer_moves = 0  # placement changes (move_to_host / move_to_device calls), for the simulator's charge
        self.overflow_blocks = 0
        self.busy_s = 0.0  # time the link spent moving prefetches (for the controller's bandwidth estimate)
        self.overflow_blocks_peak = 0
        self._link = threading.Lock()  # one transfer on the link at a time
        self._cond = threading.Condition()
        self._ready: list[tuple[int, int, int]] = []  # heap of (layer, batch_index, seq)
        self._pending: dict[int, list[_Fetch]] = {}  # batch_index -> its remaining fetches, in layer order
        self._fetches: dict[tuple[int, int], _Fetch] = {}  # (batch_index, layer) -> fetch of this step
        self._done: set[tuple[int, int]] = set()
        self._in_flight = 0
        self._error: BaseException | None = None
        self._seq = 0
        self._closed = False
        # The copy thread must wake promptly when a slot frees; Python's default 5 ms GIL switch interval
        # would add up to that much latency to every transfer.
        if sys.getswitchinterval() > 0.001:
            sys.setswitchinterval(0.001)
        self._thread = threading.Thread(target=self._run, name="orbitflow-kv-copy", daemon=True)
        self._thread.start()

    # ---- link primitives -------------------------------------------------------------------------
    def _copy(self, src: BlockPool, src_ids: list[int], dst: BlockPool, dst_ids: list[int]) -> int:
        """Copy blocks between pools, holding the link for bytes / rate. Returns bytes moved."""
        nbytes = len(src_ids) * src.bytes_per_block
        if not self.materialized:  # accounting only: the simulator charges the time itself
            return nbytes
        with self._link:
            start = time.perf_counter()
            if is_run(src_ids) and is_run(dst_ids):  # the usual case: one slice copy, no temporary
                n, s0, d0 = len(src_ids), src_ids[0], dst_ids[0]
                src_view, dst_view = src.storage[:, s0:s0 + n], dst.storage[:, d0:d0 + n]
                if self.is_cuda:
                    with torch.cuda.stream(self.stream):
                        dst_view.copy_(src_view, non_blocking=True)
                    self.stream.synchronize()
                else:
                    dst_view.copy_(src_view)
            else:
                src_index = torch.tensor(src_ids, dtype=torch.long, device=src.storage.device)
                dst_index = torch.tensor(dst_ids, dtype=torch.long, device=dst.storage.device)
                if self.is_cuda:
                    with torch.cuda.stream(self.stream):
                        data = src.storage.index_select(1, src_index).to(dst.storage.device, non_blocking=True)
                        dst.storage.index_copy_(1, dst_index, data)
                    self.stream.synchronize()
                else:
                    dst.storage.index_copy_(1, dst_index, src.storage.index_select(1, src_index))
            self._throttle(nbytes, start)
            self.busy_s += time.perf_counter() - start
        return nbytes

    def move_to_host(self, device_ids: list[int], host_ids: list[int]) -> None:
        self.layer_moves += 1
        self.bytes_d2h += self._copy(self.device_pool, device_ids, self.host_pool, host_ids)

    def move_to_device(self, host_ids: list[int], device_ids: list[int]) -> None:
        self.layer_moves += 1
        self.bytes_h2d += self._copy(self.host_pool, host_ids, self.device_pool, device_ids)

    # ---- per-step prefetch schedule --------------------------------------------------------------
    def start_step(self, fetches: dict[int, list[tuple[int, list[int]]]]) -> None:
        """fetches[batch_index] = [(layer, host_block_ids) or (layer, host_block_ids, capacity_blocks), ...] in
        layer order; a slot holds `capacity_blocks` (default: as many as it fetches)."""
        with self._cond:
            assert not self._pending and not self._fetches, "previous step was not finished"
            self._error = None
            for b, items in fetches.items():
                queue = [_Fetch(b, item[0], item[1], max(len(item[1]), item[2] if len(item) > 2 else 0))
                         for item in items if item[1]]
                if not queue:
                    continue
                self._pending[b] = queue
                for f in queue:
                    self._fetches[(b, f.layer)] = f
                for f in queue[: self.prefetch_slots]:
                    self._push_ready(f)
            self._cond.notify_all()

    def _push_ready(self, fetch: _Fetch) -> None:
        self._seq += 1
        heapq.heappush(self._ready, (fetch.layer, fetch.batch_index, self._seq))

    def wait_layer(self, layer: int, batch_indices: list[int]) -> float:
        """Block until the fetches of `layer` for these requests have landed; returns the stall (s)."""
        keys = [(b, layer) for b in batch_indices if (b, layer) in self._fetches]
        if not keys:
            return 0.0
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or all(k in self._done for k in keys))
            if self._error is not None:
                raise RuntimeError("KV prefetch failed") from self._error
        if self.is_cuda:
            for k in keys:
                torch.cuda.current_stream().wait_event(self._fetches[k].event)
        return time.perf_counter() - start

    def staged(self, batch_index: int, layer: int) -> list[int] | torch.Tensor:
        """READ point: where a landed fetch lives (valid until its `release`): device-pool block ids (a run,
        read as a view), or a scratch tensor of blocks [2, capacity, block_size, heads, dim]."""
        fetch = self._fetches[(batch_index, layer)]
        return fetch.scratch if fetch.scratch is not None else fetch.staging

    def release(self, batch_index: int, layer: int) -> None:
        """RELEASE point: the fetched layer has been consumed: free its slot and let the request's next fetch
        start."""
        with self._cond:
            fetch = self._fetches.pop((batch_index, layer), None)
            if fetch is None:
                return
            self._done.discard((batch_index, layer))
            self._free_slot(fetch)
            queue = self._pending.get(batch_index)
            if queue and queue[0] is fetch:
                queue.pop(0)
                if len(queue) >= self.prefetch_slots:
                    self._push_ready(queue[self.prefetch_slots - 1])
                elif not queue:
                    del self._pending[batch_index]
            self._cond.notify_all()

    def end_step(self) -> None:
        """Finish the step: cancel what has not started, wait for what is in flight, free every slot."""
        with self._cond:
            self._ready.clear()
            self._pending.clear()
            self._cond.wait_for(lambda: self._in_flight == 0)
            for fetch in self._fetches.values():
                self._free_slot(fetch)
            self._fetches.clear()
            self._done.clear()

    def _free_slot(self, fetch: _Fetch) -> None:
        self.device_pool.free(fetch.staging or [])
        fetch.staging = None
        if fetch.scratch is not None:
            self.overflow_blocks -= fetch.capacity
            fetch.scratch = None

    def _stage(self, fetch: _Fetch) -> None:
        """ACQUIRE point: allocate the request's slot (the lowest free run, so its pages stay warm) and fill
        its first blocks from the host."""
        n = len(fetch.host_blocks)
        try:
            fetch.staging = self.device_pool.allocate(fetch.capacity, placement="first")
            self.bytes_h2d += self._copy(self.host_pool, fetch.host_blocks, self.device_pool, fetch.staging[:n])
            return
        except OutOfBlocks:
            pass
        index = torch.tensor(fetch.host_blocks, dtype=torch.long)
        with self._link:
            start = time.perf_counter()
            src = self.host_pool.storage
            fetch.scratch = src.new_empty((2, fetch.capacity, *src.shape[2:]), device=self.device_pool.storage.device)
            fetch.scratch[:, :n] = src.index_select(1, index)
            self._throttle(n * self.host_pool.bytes_per_block, start)
            self.busy_s += time.perf_counter() - start
        self.bytes_h2d += n * self.host_pool.bytes_per_block
        with self._cond:
            self.overflow_blocks += fetch.capacity
            self.overflow_blocks_peak = max(self.overflow_blocks_peak, self.overflow_blocks)

    def _throttle(self, nbytes: int, start: float) -> None:
        if self.link_bytes_per_s:
            remaining = nbytes / self.link_bytes_per_s - (time.perf_counter() - start)
            if remaining > 0:
                time.sleep(remaining)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # ---- copy thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or bool(self._ready))
                if self._closed:
                    return
                layer, b, _ = heapq.heappop(self._ready)
                fetch = self._fetches.get((b, layer))
                if fetch is None:
                    continue
                self._in_flight += 1
            try:
                self._stage(fetch)
                if self.is_cuda:
                    fetch.event = torch.cuda.Event()
                    fetch.event.record(self.stream)
                with self._cond:
                    self._done.add((b, layer))
            except BaseException as exc:  # surfaced to the waiting compute thread
                with self._cond:
                    self._error = exc
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()
