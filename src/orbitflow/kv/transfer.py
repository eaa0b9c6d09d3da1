"""Moves KV blocks between the host and device pools over one (optionally throttled) link.

Within a decode step the schedule is the one the planner's cost model assumes (`edf`, or `preemptive`):
- every request has `prefetch_slots` prefetch slots (the prefetch depth d, default ONE); its first d
  host-resident layers may start moving at step start, its k-th (k >= d) only after its (k-d)-th fetched
  layer has been consumed (`release`);
- the link serves one transfer at a time, non-preemptively, earliest-needed layer first
  (ties: lower batch index);
- or, with `link = "preemptive"` (the cost model's `preemptive` transfer), the same order, except that a
  fetch moves in chunks (about `chunk_s` of link time each) and yields the link between two chunks to a
  fetch of an earlier layer released meanwhile, keeping its slot and resuming where it stopped (once no
  fetch of an earlier layer is left to copy, the rest moves in one chunk: nothing can preempt it);
- a layer waits until all of its host-resident KV has arrived (`wait_layer`); that wait is its stall.

Staging slots are carved from the device pool, so fetched KV counts against the device budget. A slot is
one run of blocks sized for the cached tokens plus the step's new ones: the executor appends the new K/V to
it and attention reads it as a view, so the staged copy is the only copy. The capacity equation reserves one
layer's worth of host KV for them (the paper's prefetch buffer); when prefetching ahead needs more than the
pool has free at that moment, the slot overflows into a scratch tensor rather than waiting (waiting could
deadlock against a slot that is only consumed later). The overflow is counted (`overflow_blocks_peak`; the
engine's stats and `orbitflow:kv_prefetch_overflow_blocks_peak`), so the budget is never exceeded silently.

Every access follows the event-ordered protocol of kv/events.py, the same code on CUDA and the CPU:
- ACQUIRE (copy worker, `_stage`): take a slot, wait on its *fence* (the compute-stream event recorded after
  the kernels that last read those blocks) and on the fences of the host blocks it reads (their pending
  device-to-host writes), copy, record the copy event;
- READ (`wait_layer`, then `staged`): the compute stream waits on the copy event, then reads the slot;
- RELEASE (`release(b, layer, after=event)`): the slot returns to the pool fenced by `after`, a compute-stream
  event recorded after the last kernel that read it; the next ACQUIRE of those blocks waits on it.
- Device-to-host writes of host-resident layers (`write_host`) run on their own stream after a compute event
  and fence the host blocks they write; placement moves (`move_to_host`/`move_to_device`) order themselves
  after the compute stream and make it wait on them, so nothing in the step loop syncs the host.
On CUDA the copies run on dedicated streams (host memory is pinned; gathers go into pinned buffers; index
tensors live on the device they index). On the CPU a copy worker thread does the prefetches, sleeping so that
each copy lasts bytes / link rate; device-to-host writes are synchronous. In strict emulation both land late,
each through a worker of its own that lands its copies in issue order (a stream), after their events were handed on,
and a prefetch no sooner than the throttled link has moved it.
"""

from __future__ import annotations

import collections
import functools
import heapq
import queue
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from orbitflow.kv.events import AsyncDevice, AsyncRaceError, Event, LayerClock, StrictAsync
from orbitflow.kv.pool import BlockPool, OutOfBlocks, block_tensor, head_planes, is_run

LINKS = ("edf", "preemptive")  # the link orders the copy worker can run (the cost model's `transfer` names them)
CHUNK_S = 5e-4  # preemptive link: link seconds of one chunk (a fetch yields the link only between two)
UNTHROTTLED_BYTES_PER_S = 25e9  # the rate chunks are sized for without a throttle: pinned copies on PCIe 4.0 x16


@dataclass
class _Fetch:
    batch_index: int
    layer: int
    host_blocks: list[int]
    capacity: int  # blocks the slot holds: the cached ones plus room for this step's new tokens
    staging: list[int] | None = None  # device-pool block ids, or None when `scratch` holds the data
    scratch: torch.Tensor | None = None
    event: Event | None = None  # the copy event (set when the copy has been issued)
    read_serial: int = 0  # the device's event serial at the last READ: a release fence must be newer
    done: int = 0  # host blocks copied so far (the preemptive link moves a fetch in chunks)
    partial: Event | None = None  # the copy event of its last chunk so far (CUDA, strict emulation): a fetch set
    # aside when the step ends frees its slot after it


class TransferEngine:
    def __init__(self, device_pool: BlockPool, host_pool: BlockPool, link_bytes_per_s: float | None = None,
                 strict: StrictAsync | None = None):
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.link_bytes_per_s = link_bytes_per_s
        self.prefetch_slots = 1  # prefetch depth: fetches of one request that may be in flight at once
        self._link_order = "edf"
        self.chunk_s = CHUNK_S  # preemptive link: link seconds of one chunk (at least one block)
        self.preemptions = 0  # times a fetch yielded the link to a more urgent one
        self.materialized = device_pool.storage is not None
        self.device = AsyncDevice(device_pool.storage.device if self.materialized else "cpu", strict)
        self.is_cuda = self.device.is_cuda
        self.stream = self.device.copy_stream
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.layer_moves = 0  # placement changes (move_to_host / move_to_device calls), for the simulator's charge
        self.overflow_blocks = 0
        self._busy_s = 0.0  # time the link spent moving prefetches (for the controller's bandwidth estimate)
        self._busy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: resolved lazily
        self._busy_lock = threading.Lock()
        self.overflow_blocks_peak = 0
        self.clock = LayerClock(self.device)
        # Fences: per tier, the serial of the last event each block must wait for before reuse.
        self._fence_serial = {pool.tier: np.zeros(pool.address_blocks, dtype=np.int64)
                              for pool in (device_pool, host_pool)}
        self._fence_events: dict[int, Event] = {}
        self._fence_lock = threading.Lock()
        self._link = threading.Lock()  # one transfer on the link at a time
        self._cond = threading.Condition()
        self._ready: list[tuple[int, int, int]] = []  # heap of (layer, batch_index, seq)
        self._pending: dict[int, list[_Fetch]] = {}  # batch_index -> its remaining fetches, in layer order
        self._fetches: dict[tuple[int, int], _Fetch] = {}  # (batch_index, layer) -> fetch of this step
        self._issued: set[tuple[int, int]] = set()  # fetches whose copy event exists
        self._in_flight = 0
        self._error: BaseException | None = None
        self._seq = 0
        self._closed = False
        # The copy thread must wake promptly when a slot frees; Python's default 5 ms GIL switch interval
        # would add up to that much latency to every transfer.
        if sys.getswitchinterval() > 0.001:
            sys.setswitchinterval(0.001)
        self._queued: collections.deque[Event] = collections.deque()  # CUDA, preemptive: chunks on the copy stream
        self._thread = threading.Thread(target=self._run, name="orbitflow-kv-copy", daemon=True)
        self._thread.start()
        # strict emulation: device-to-host writes and prefetches land late, each stream through a worker of its own
        self._late: dict[str, tuple[queue.SimpleQueue, threading.Thread]] = {}
        if self.materialized and self.device.strict.enabled:
            for stream in ("copy", "d2h"):
                lane: queue.SimpleQueue = queue.SimpleQueue()
                worker = threading.Thread(target=self._run_late, args=(lane, stream), name=f"orbitflow-kv-{stream}",
                                          daemon=True)
                worker.start()
                self._late[stream] = (lane, worker)

    @property
    def link(self) -> str:
        """The link order (`LINKS`): "edf", a fetch holds the link to its end; "preemptive", it moves in chunks of
        `chunk_s` seconds of link time and yields between two to a fetch of an earlier layer."""
        return self._link_order

    @link.setter
    def link(self, value: str) -> None:
        if value not in LINKS:
            raise ValueError(f"link must be one of {', '.join(LINKS)}, got {value!r}")
        self._link_order = value

    @property
    def busy_s(self) -> float:
        """Seconds the link has spent on prefetches (CUDA: copy-stream event time, counted once complete)."""
        if self._busy_events:
            with self._busy_lock:
                done = [pair for pair in self._busy_events if pair[1].query()]
                self._busy_events = [pair for pair in self._busy_events if pair not in done]
            self._busy_s += sum(a.elapsed_time(b) for a, b in done) / 1000.0
        return self._busy_s

    @busy_s.setter
    def busy_s(self, value: float) -> None:
        self._busy_s = value

    # ---- fences ----------------------------------------------------------------------------------
    def _fence(self, pool: BlockPool, ids: list[int], event: Event) -> None:
        """Blocks `ids` of `pool` may be reused (or read, for a write) only after `event`."""
        if not ids or (event.cuda is None and event.query()):
            return
        with self._fence_lock:
            arr = self._fence_serial[pool.tier]
            if is_run(ids):
                arr[ids[0]:ids[0] + len(ids)] = event.serial
            else:
                arr[ids] = event.serial
            self._fence_events[event.serial] = event

    def _fences(self, pool: BlockPool, ids: list[int]) -> list[Event]:
        """The pending events that order access to `ids` (completed ones are dropped)."""
        if not ids or not self._fence_events:
            return []
        with self._fence_lock:
            arr = self._fence_serial[pool.tier]
            serials = arr[ids[0]:ids[0] + len(ids)] if is_run(ids) else arr[ids]
            events = []
            for serial in np.unique(serials).tolist():
                event = self._fence_events.get(serial)
                if event is None:
                    continue
                if event.query():
                    del self._fence_events[serial]
                else:
                    events.append(event)
            return events

    def _wait_fences(self, pool: BlockPool, ids: list[int], stream: str) -> None:
        """Protocol step: `stream` waits on the fences of `ids` (CUDA: stream-side; CPU: its thread blocks)."""
        for event in self._fences(pool, ids):
            if stream == "compute":
                self.device.compute_wait(event)
            else:
                self.device.copy_wait(event, stream)

    def _check_fences(self, pool: BlockPool, ids: list[int], stream: str, what: str) -> None:
        """Strict mode: every fence of `ids` has completed before `stream` touches them."""
        if self.device.strict.enabled:
            for event in self._fences(pool, ids):
                self.device.check_ready(event, stream, f"{what} ({pool.tier} blocks {ids[:4]}...)")

    def _wait_and_check(self, pool: BlockPool, ids: list[int], stream: str, what: str) -> None:
        self._wait_fences(pool, ids, stream)
        self._check_fences(pool, ids, stream, what)

    # ---- data movement ----------------------------------------------------------------------------
    def _issue(self, src: BlockPool, src_ids: list[int], dst: BlockPool, dst_ids: list[int]) -> None:
        """Issue one copy on the current stream (CUDA: asynchronous): per maximal run that is consecutive on
        both sides, one slice copy per plane (K, V) and head. Each slice is contiguous (pools are head-major,
        `head_planes`), so a pinned host side is copied by DMA directly: no gather (which would read host memory
        on the host, and land in pageable memory that makes the copy synchronous), no index tensor, no
        host-side read of memory a copy may still write."""
        src_planes, dst_planes = _planes(src), _planes(dst)
        if not self.is_cuda:  # one strided copy per run (each call re-takes the GIL the step loop needs)
            for s0, d0, m in _runs(src_ids, dst_ids):
                host_copy(dst_planes[:, :, d0:d0 + m], src_planes[:, :, s0:s0 + m])
            return
        for s0, d0, m in _runs(src_ids, dst_ids):
            for plane in (0, 1):
                for head in range(src_planes.shape[1]):
                    dst_planes[plane, head, d0:d0 + m].copy_(src_planes[plane, head, s0:s0 + m], non_blocking=True)

    def _move(self, src: BlockPool, src_ids: list[int], dst: BlockPool, dst_ids: list[int]) -> int:
        """A placement move, called from the step loop's thread. It runs on the copy stream after every
        kernel queued so far (they wrote the source, or read the destination's old contents), and the compute
        stream waits on it, so freeing the source and using the destination are ordered without a host sync.
        Returns bytes moved."""
        nbytes = len(src_ids) * src.bytes_per_block
        if not self.materialized:  # accounting only: the simulator charges the time itself
            return nbytes
        after_compute = self.device.record_compute()
        with self._link:
            start = time.perf_counter()
            if self.is_cuda:
                with torch.cuda.stream(self.stream):
                    self.device.copy_wait(after_compute)
                    self._wait_and_check(src, src_ids, "copy", "move reads")
                    self._wait_and_check(dst, dst_ids, "copy", "move writes")
                    self._issue(src, src_ids, dst, dst_ids)
                event = self.device.record_copy()
                self.device.compute_wait(event)
                if self.link_bytes_per_s:  # an emulated slow link must know when the copy ended
                    self.device.host_sync("throttled link emulation")
            else:  # the step loop's thread is the copy stream here: the copy is done when it returns
                self.device.copy_wait(after_compute)
                self._wait_and_check(src, src_ids, "copy", "move reads")
                self._wait_and_check(dst, dst_ids, "copy", "move writes")
                self._issue(src, src_ids, dst, dst_ids)
                event = self.device.done_event()
            self._fence(src, src_ids, event)
            self._fence(dst, dst_ids, event)
            self._throttle(nbytes, start)
        return nbytes

    def free_after_compute(self, pool: BlockPool, ids: list[int]) -> None:
        """Free blocks that kernels queued on the compute stream may still read (e.g. the source of a
        relocation): fenced by a compute event, so a copy that reuses them waits for those kernels."""
        if self.materialized and ids:
            self._fence(pool, ids, self.device.record_compute())
        pool.free(ids)

    def move_to_host(self, device_ids: list[int], host_ids: list[int]) -> None:
        self.layer_moves += 1
        self.bytes_d2h += self._move(self.device_pool, device_ids, self.host_pool, host_ids)

    def move_to_device(self, host_ids: list[int], device_ids: list[int]) -> None:
        self.layer_moves += 1
        self.bytes_h2d += self._move(self.host_pool, host_ids, self.device_pool, device_ids)

    def write_host(self, ids: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V [n, kv_heads, head_dim] (on the device) of tokens start..start+n-1 into host blocks
        `ids`: a device-to-host copy on its own stream after the compute event that produced them, fencing the
        host blocks it writes (a prefetch that reads them waits on it). No host sync (the old `.to('cpu')`)."""
        pool = self.host_pool
        k, v = k.to(dtype=pool.storage.dtype), v.to(dtype=pool.storage.dtype)
        n, bs = k.shape[0], pool.block_size
        span = ids[start // bs:(start + n - 1) // bs + 1]
        if not self.is_cuda and not self._late:  # CPU: the copy is a synchronous memcpy
            pool.write(ids, start, k.to("cpu"), v.to("cpu"))
            return
        produced = self.device.record_compute()
        if self.is_cuda:
            stream = self.device.d2h_stream
            with torch.cuda.stream(stream):
                self.device.copy_wait(produced, "d2h")
                self._host_write_async(ids, start, k, v)
            k.record_stream(stream)  # the caching allocator must not reuse them before the copy read them
            v.record_stream(stream)
            event = self.device.record_copy("d2h")
        else:  # strict emulation: the d2h worker writes them late
            event = self.device.record_copy("d2h")
            self._land_late("d2h", event, functools.partial(pool.write, ids, start, k.clone(), v.clone()), produced)
        self._fence(pool, span, event)

    def _host_write_async(self, ids: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Non-blocking copies of tokens start.. into (pinned) host blocks, one per block they fall in and head
        (each destination contiguous, so none goes through a pageable temporary)."""
        planes, bs, n = head_planes(self.host_pool.storage), self.host_pool.block_size, k.shape[0]
        i = 0
        while i < n:
            pos = start + i
            block, offset = ids[pos // bs], pos % bs
            m = min(bs - offset, n - i)
            for head in range(planes.shape[1]):
                planes[0, head, block, offset:offset + m].copy_(k[i:i + m, head], non_blocking=True)
                planes[1, head, block, offset:offset + m].copy_(v[i:i + m, head], non_blocking=True)
            i += m

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """The step's one host sync: `tensor` (the logits) read on the host. On CUDA the step's GPU timeline
        ends here (`clock`), so every timing event has completed when the step resolves it."""
        self.clock.mark_gpu_end()
        return self.device.to_host(tensor)

    def synchronize(self) -> None:
        """Wait until every issued copy has landed (tests and inspection; never in the step loop)."""
        with self._fence_lock:
            events = list(self._fence_events.values())
        for event in events:
            if event.cuda is not None:
                event.cuda.synchronize()
            else:
                event._block()
        if self.is_cuda:
            self.device.host_sync("synchronize")

    # ---- per-step prefetch schedule --------------------------------------------------------------
    def start_step(self, fetches: dict[int, list[tuple[int, list[int]]]]) -> None:
        """fetches[batch_index] = [(layer, host_block_ids) or (layer, host_block_ids, capacity_blocks), ...] in
        layer order; a slot holds `capacity_blocks` (default: as many as it fetches). Starts the step's clock."""
        with self._cond:
            if self._closed:  # its copy thread is gone: the step's fetches would never land
                raise RuntimeError("the KV transfer engine is closed")
            assert not self._pending and not self._fetches, "previous step was not finished"
            self._error = None
            self.clock = LayerClock(self.device)
            for b, items in fetches.items():
                queue_ = [_Fetch(b, item[0], item[1], max(len(item[1]), item[2] if len(item) > 2 else 0))
                          for item in items if item[1]]
                if not queue_:
                    continue
                self._pending[b] = queue_
                for f in queue_:
                    self._fetches[(b, f.layer)] = f
                for f in queue_[: self.prefetch_slots]:
                    self._push_ready(f)
            self._cond.notify_all()

    def _push_ready(self, fetch: _Fetch) -> None:
        self._seq += 1
        heapq.heappush(self._ready, (fetch.layer, fetch.batch_index, self._seq))

    def wait_layer(self, layer: int, batch_indices: list[int]) -> float:
        """Make the compute stream wait until the fetches of `layer` for these requests have landed; returns
        the stall in seconds where the host knows it (CPU; on CUDA it is GPU time, in `clock`)."""
        keys = [(b, layer) for b in batch_indices if (b, layer) in self._fetches]
        if not keys:
            return 0.0
        begin = self.clock.wait_begin()
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._closed
                                or all(k in self._issued for k in keys))
            if self._error is not None:
                raise RuntimeError("KV prefetch failed") from self._error
            if not all(k in self._issued for k in keys):  # closed under a running step (shutdown): fail, not hang
                raise RuntimeError("the KV transfer engine was closed while a step waited for its prefetch")
        for k in keys:
            self.device.compute_wait(self._fetches[k].event)  # protocol: wait on the copy event
        return self.clock.wait_end(layer, begin)

    def staged(self, batch_index: int, layer: int) -> list[int] | torch.Tensor:
        """READ point: where a landed fetch lives (valid until its `release`): device-pool block ids (a run,
        read as a view), or a scratch tensor of blocks [2, capacity, block_size, heads, dim]."""
        fetch = self._fetches[(batch_index, layer)]
        self.device.check_ready(fetch.event, "compute", f"read of staged KV (request {batch_index}, layer {layer})")
        fetch.read_serial = self.device._serial
        if fetch.scratch is not None:
            if self.is_cuda:  # allocated on the copy stream, read on the compute stream
                fetch.scratch.record_stream(torch.cuda.current_stream(self.device.device))
            return fetch.scratch
        return fetch.staging

    def release(self, batch_index: int, layer: int, after: Event | None) -> None:
        """RELEASE point: the fetched layer has been consumed: its slot returns to the pool fenced by `after`,
        a compute-stream event recorded after the last kernel that read it (`device.record_compute()`), and the
        request's next fetch may start."""
        with self._cond:
            fetch = self._fetches.get((batch_index, layer))
            if fetch is None:
                return
            if self.device.strict.enabled and (
                    after is None or after.stream != "compute" or after.serial <= fetch.read_serial):
                raise AsyncRaceError(
                    f"staging slot of request {batch_index}, layer {layer} released without a compute-stream "
                    f"event recorded after its last read (got {after!r}): the copy stream could refill it "
                    "while a kernel that reads it is still queued")
            del self._fetches[(batch_index, layer)]
            self._issued.discard((batch_index, layer))
            self._free_slot(fetch, after)
            pending = self._pending.get(batch_index)
            if pending and pending[0] is fetch:
                pending.pop(0)
                if len(pending) >= self.prefetch_slots:
                    self._push_ready(pending[self.prefetch_slots - 1])
                elif not pending:
                    del self._pending[batch_index]
            self._cond.notify_all()

    def end_step(self) -> None:
        """Finish the step: cancel what has not started, wait for what is in flight, free every slot, fenced by
        a compute event after everything queued (also on the exception path)."""
        with self._cond:
            self._ready.clear()
            self._pending.clear()
            self._cond.wait_for(lambda: self._in_flight == 0)
            for key, fetch in self._fetches.items():
                copied = fetch.event if key in self._issued else fetch.partial  # a preempted fetch's chunks
                if copied is not None and "compute" not in copied.waited:
                    self.device.compute_wait(copied)  # never consumed: compute reuse waits for the copy
            after = self.device.record_compute() if self._fetches and self.materialized else None
            for fetch in self._fetches.values():
                self._free_slot(fetch, after)
            self._fetches.clear()
            self._issued.clear()
        self.clock.end()
        if len(self._fence_events) > 256:  # drop completed fences now and then
            with self._fence_lock:
                self._fence_events = {s: e for s, e in self._fence_events.items() if not e.query()}

    def _free_slot(self, fetch: _Fetch, after: Event | None) -> None:
        if fetch.staging:
            if after is not None:
                self._fence(self.device_pool, fetch.staging, after)
            if self.device.strict.enabled and self.materialized:  # a freed slot is garbage at once
                self.device.poison(self._slot_view(fetch.staging))
        self.device_pool.free(fetch.staging or [])
        fetch.staging = None
        if fetch.scratch is not None:
            self.device.poison(fetch.scratch)
            self.overflow_blocks -= fetch.capacity
            fetch.scratch = None

    def _slot_view(self, ids: list[int]) -> torch.Tensor:
        storage = self.device_pool.storage
        return storage[:, ids[0]:ids[0] + len(ids)] if is_run(ids) else storage[:, ids[0]:ids[0] + 0]

    def _stage(self, fetch: _Fetch) -> None:
        """ACQUIRE point (copy worker): take the request's slot (the lowest free run, so its pages stay warm),
        wait on its fence and on the host blocks' pending writes, fill it, record the copy event and hand it to
        the compute stream (`_issued`). On the preemptive link (`link`) the fill goes a chunk (`chunk_s`) at a time,
        and between two chunks the fetch yields the link to a more urgent one (an earlier layer's) released
        meanwhile: it goes back to the ready heap with its slot and its progress (`done`), and resumes there."""
        n = len(fetch.host_blocks)
        step = n if self.link == "edf" else self._chunk()
        staging = None
        if fetch.staging is None and fetch.scratch is None:  # first visit (a resumed fetch has its slot)
            try:
                staging = self.device_pool.allocate(fetch.capacity, placement="first")
            except OutOfBlocks:
                staging = None
        if not self.materialized:
            fetch.staging = staging
            self.bytes_h2d += n * self.host_pool.bytes_per_block
            self._hand_over(fetch, self.device.done_event())
            return
        first = fetch.done
        with self._link:
            start = time.perf_counter()
            if self.is_cuda:
                self._stage_cuda(fetch, staging, n, step, start)
            else:
                strict = self.device.strict.enabled
                self._prepare(fetch, staging)
                while fetch.done < n:
                    a, b = fetch.done, self._chunk_end(fetch, n, step)
                    visit_bytes = (b - first) * self.host_pool.bytes_per_block
                    if strict:  # the chunk lands late, as on a stream: its event is handed on before it does
                        event = self.device.record_copy()
                        if b == n:
                            self._hand_over(fetch, event)
                        else:
                            fetch.partial = event
                        self._land_chunk_late(event, fetch, a, b, self._link_end(visit_bytes, start))
                    else:
                        self._copy(fetch, a, b)
                    fetch.done = b
                    self._throttle(visit_bytes, start)
                    if b < n and self._yield_to_urgent(fetch):
                        break
                self._busy_s += time.perf_counter() - start
                if fetch.done == n and not strict:
                    self._hand_over(fetch, self.device.done_event())
        self.bytes_h2d += (fetch.done - first) * self.host_pool.bytes_per_block

    def _stage_cuda(self, fetch: _Fetch, staging: list[int] | None, n: int, step: int, start: float) -> None:
        """`_stage` on CUDA: the chunks are queued on the copy stream, each followed by its copy event. On the
        preemptive link the worker keeps at most two chunks queued (`_make_room`, here and before it picks the next
        fetch), so whatever it queues next, an urgent fetch released meanwhile waits for at most two chunks. On an
        emulated slow link (`link_bytes_per_s`) the worker waits for each chunk and sleeps until the link would have
        moved it, and hands the fetch on only then (a step must not read a layer the emulated link is still moving);
        the link's busy time is then the emulated link's, as on the CPU."""
        first, preemptive, throttled = fetch.done, self.link == "preemptive", bool(self.link_bytes_per_s)
        with torch.cuda.stream(self.stream):
            self._prepare(fetch, staging)  # the stream waits on the fences
            if throttled:  # link busy: from here, not from the waits (the emulated link's clock)
                self.device.worker_host_wait(self.device.record_copy())
                start = time.perf_counter()
            else:  # ... (the copy stream's events)
                begin = torch.cuda.Event(enable_timing=True)
                begin.record(self.stream)
            while True:
                a, b = fetch.done, self._chunk_end(fetch, n, step)
                self._copy(fetch, a, b)
                fetch.done = b
                copied = self.device.record_copy()
                if throttled:  # an emulated slow link must know when each chunk ended
                    self.device.worker_host_wait(copied)
                    self._throttle((b - first) * self.host_pool.bytes_per_block, start)
                if b == n:
                    break
                fetch.partial = copied  # what end_step must wait for if the fetch is set aside for good
                if preemptive:  # (throttled, its chunks are done already: the waits cost nothing)
                    self._queued.append(copied)
                    self._make_room()
                if self._yield_to_urgent(fetch):
                    break
            if throttled:
                self._busy_s += time.perf_counter() - start
            else:
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.stream)
                with self._busy_lock:
                    self._busy_events.append((begin, end))
        if fetch.done < n:
            return
        if preemptive:
            self._queued.append(copied)
        self._hand_over(fetch, copied)

    def _make_room(self) -> None:
        """Preemptive link on CUDA: wait until at most one chunk is left queued on the copy stream (the worker then
        queues one more, so the link does not idle while it chooses)."""
        while len(self._queued) > 1:
            self.device.worker_host_wait(self._queued.popleft())

    def _land_chunk_late(self, event: Event, fetch: _Fetch, a: int, b: int, not_before: float) -> None:
        """Strict emulation: the copy of the fetch's blocks ``a..b-1`` lands late on the copy stream, and not before
        ``not_before`` (perf_counter), when the throttled link has moved it."""
        self._land_late("copy", event, functools.partial(self._issue, self.host_pool, fetch.host_blocks[a:b],
                                                         *self._places(fetch, a, b)), not_before=not_before)

    def _land_late(self, stream: str, event: Event, land, after: Event | None = None, not_before: float = 0.0) -> None:
        """Strict emulation: ``land()`` (a copy) runs on ``stream``'s worker after ``after``, ``not_before`` (when the
        link has moved it) and a random delay after the copy before it or after ``not_before``, whichever is later (a
        stream runs one copy at a time), then completes ``event``."""
        self._late[stream][0].put((after, self.device.delay(), not_before, land, event))

    def _run_late(self, lane: queue.SimpleQueue, stream: str) -> None:
        """Strict emulation's worker of one stream: its copies in issue order, each after the event it waits for
        and its delay; a copy that fails is surfaced to the step loop by wait_layer, not a hang on its event."""
        while True:
            item = lane.get()
            if item is None:
                return
            after, delay, not_before, land, event = item
            if after is not None:
                self.device.copy_wait(after, stream)
            time.sleep(delay + max(0.0, not_before - time.perf_counter()))  # landing lags its link time too
            try:
                land()
            except BaseException as exc:
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
            finally:
                event.complete()

    def _chunk(self) -> int:
        """Blocks per chunk of the preemptive link: as many as take `chunk_s` on the link, at least one."""
        rate = self.link_bytes_per_s or UNTHROTTLED_BYTES_PER_S
        return max(1, int(self.chunk_s * rate / self.host_pool.bytes_per_block))

    def _chunk_end(self, fetch: _Fetch, n: int, step: int) -> int:
        """Where the fetch's next chunk ends: `step` blocks on, or at its end once no fetch of an earlier layer is
        left to copy (released or not), since only such a fetch can make it yield. A chunk costs the worker a
        host round trip (on CUDA, a wait on the copy stream and the GIL back); a fetch that cannot be preempted
        pays it once, as on the EDF link, and the schedule is the same."""
        if n - fetch.done <= step:
            return n
        with self._cond:
            for queue_ in self._pending.values():  # each in layer order, those copied (or on the link) first
                for other in queue_:
                    if other.layer >= fetch.layer:
                        break
                    if (other.batch_index, other.layer) not in self._issued:
                        return fetch.done + step
        return n

    def _yield_to_urgent(self, fetch: _Fetch) -> bool:
        """Preemptive link, between two chunks: whether a fetch of an earlier layer is ready; then this one goes
        back to the ready heap (it keeps its slot and `done`) and the copy worker takes that one next."""
        with self._cond:
            if self._ready and self._ready[0][0] < fetch.layer:
                self._push_ready(fetch)
                self.preemptions += 1
                return True
        return False

    def _prepare(self, fetch: _Fetch, staging: list[int] | None) -> None:
        """First visit of a fetch: take the slot (or a scratch tensor when the pool is full) and wait on its
        fences and on the host blocks' pending writes."""
        if fetch.staging is not None or fetch.scratch is not None:
            return
        if staging is not None:
            fetch.staging = staging  # owned by the fetch from here on (freed by release or end_step)
            self._wait_and_check(self.device_pool, staging, "copy", "slot refill")
            if self.device.strict.enabled:  # strict: the slot holds garbage until the copy lands
                self.device.poison(self._slot_view(staging))
        else:
            src = self.host_pool.storage
            fetch.scratch = block_tensor(fetch.capacity, *src.shape[2:], src.dtype, self.device_pool.storage.device)
            self.device.poison(fetch.scratch)
            with self._cond:
                self.overflow_blocks += fetch.capacity
                self.overflow_blocks_peak = max(self.overflow_blocks_peak, self.overflow_blocks)
        self._wait_and_check(self.host_pool, fetch.host_blocks, "copy", "prefetch reads")

    def _places(self, fetch: _Fetch, a: int, b: int) -> tuple[BlockPool | _ScratchPool, list[int]]:
        """Where the fetch's host blocks ``a..b-1`` go: the same places of its slot, or of its scratch tensor."""
        if fetch.staging is not None:
            return self.device_pool, fetch.staging[a:b]
        return _ScratchPool(fetch.scratch, self.host_pool), list(range(a, b))

    def _copy(self, fetch: _Fetch, a: int, b: int) -> None:
        """Copy the fetch's host blocks ``a..b-1`` into the same places of its slot (or scratch tensor)."""
        self._issue(self.host_pool, fetch.host_blocks[a:b], *self._places(fetch, a, b))

    def _hand_over(self, fetch: _Fetch, event: Event) -> None:
        with self._cond:
            fetch.event = event
            self._issued.add((fetch.batch_index, fetch.layer))
            self._cond.notify_all()

    def _link_end(self, nbytes: int, start: float) -> float:
        """When the throttled link, busy since ``start``, has moved ``nbytes`` (perf_counter; 0 unthrottled)."""
        return start + nbytes / self.link_bytes_per_s if self.link_bytes_per_s else 0.0

    def _throttle(self, nbytes: int, start: float) -> None:
        """Sleep until the throttled link, busy since ``start``, has moved ``nbytes`` (the visit's bytes so far)."""
        if self.link_bytes_per_s:
            remaining = self._link_end(nbytes, start) - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        for lane, worker in self._late.values():
            lane.put(None)
            worker.join(timeout=5)

    # ---- copy thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._queued:  # CUDA, preemptive: choose the next fetch only once the stream has room for it
                try:
                    self._make_room()
                except BaseException as exc:  # surfaced to the waiting compute thread; the worker lives on
                    with self._cond:
                        self._error = exc
                        self._queued.clear()
                        self._cond.notify_all()
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
            except BaseException as exc:  # surfaced to the waiting compute thread
                with self._cond:
                    self._error = exc
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for CPU tensors of one shape and dtype (any strides), by the calling thread alone: NumPy's
    copy (it releases the GIL), not torch's ``copy_``. A torch copy that large runs ``parallel_for``, which gives a
    thread other than the step loop's an OpenMP team of its own; with more OpenMP threads than cores libgomp stops
    spinning between parallel regions, and the step loop's threads then sleep and wake around every kernel of every
    later step. Measured (SmolLM2, 2048 x 4, 2 threads): decode steps all on the device ran 87-92 ms before any step
    with copies and 127-135 ms after, for good; with this copy, the same after as before."""
    as_int = _SAME_SIZE_INT[src.element_size()]  # bfloat16 has no NumPy dtype; the bytes are what is copied
    np.copyto(dst.view(as_int).numpy(), src.view(as_int).numpy())


def _planes(pool) -> torch.Tensor:
    """`head_planes` of a pool's storage, made once per pool (the copy worker needs it for every transfer)."""
    cached = getattr(pool, "_head_planes", None)
    if cached is None or cached[0] is not pool.storage:
        cached = pool._head_planes = (pool.storage, head_planes(pool.storage))
    return cached[1]


class _ScratchPool:
    """A scratch tensor of blocks seen as a pool, so `_issue` fills it like a slot."""

    def __init__(self, storage: torch.Tensor, like: BlockPool):
        self.storage = storage
        self.bytes_per_block = like.bytes_per_block


def _runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal stretches where both id lists go up by one."""
    if is_run(src_ids) and is_run(dst_ids):  # the usual case
        return [(src_ids[0], dst_ids[0], len(src_ids))] if src_ids else []
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(src_ids, dst_ids):
        if runs and a == runs[-1][0] + runs[-1][2] and b == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs
