"""The primitives of the event-ordered transfer protocol, one implementation for CUDA and the CPU.

The protocol (kv/transfer.py follows it; the executor calls it through a small surface):
- every copy records an `Event` on its stream; a consumer makes its own stream wait on that event before it
  reads what the copy wrote (`compute_wait`, `copy_wait`);
- memory that a stream has read or written goes back to a free list with a *fence*: an event recorded on that
  stream after its last use; whoever reuses the memory waits on the fence first;
- the host waits on the device only in `host_sync` (and `to_host`, which calls it), which counts every call, so a
  test can check that a decode step syncs once (to read its sampled tokens).

On CUDA an `Event` wraps `torch.cuda.Event` and the waits are stream-side (`Stream.wait_event`): no host sync.
On the CPU the compute "stream" is the host thread and the copies run on worker threads; the events are real
objects with the same semantics, completed by the thread that did the work, and a wait blocks until then.

Strict emulation (`StrictAsync`, on with `ORBITFLOW_STRICT_ASYNC=1`) makes the CPU behave like the worst legal
GPU schedule: copies land late by a random delay (the event completes only then), compute-stream events complete
late by a random delay (kernels still queued), freed staging memory is poisoned with NaN at once, and reading or
reusing memory whose event has not completed (or was never waited on) raises `AsyncRaceError`.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch


class AsyncRaceError(RuntimeError):
    """Memory was read, reused or released before the event that orders the access had completed."""


@dataclass(frozen=True)
class StrictAsync:
    """Strict asynchronous emulation for tests (CPU backend). A copy or a queued kernel completes a random
    delay in [max_delay_s / 2, max_delay_s] after it was issued; `seed` fixes the delay sequence."""

    enabled: bool = False
    max_delay_s: float = 0.002
    seed: int = 0

    @classmethod
    def from_env(cls) -> StrictAsync:
        """`ORBITFLOW_STRICT_ASYNC=1` turns it on (any value but '' and '0');
        `ORBITFLOW_STRICT_ASYNC_DELAY_S` sets the largest delay."""
        flag = os.environ.get("ORBITFLOW_STRICT_ASYNC", "")
        if flag in ("", "0"):
            return cls()
        raw = os.environ.get("ORBITFLOW_STRICT_ASYNC_DELAY_S", "0.002")
        try:
            delay = float(raw)
        except ValueError:
            raise ValueError(f"ORBITFLOW_STRICT_ASYNC_DELAY_S must be a number of seconds, got {raw!r}") from None
        return cls(enabled=True, max_delay_s=delay)


class Event:
    """A point on one stream ("compute", "copy" or "d2h"). `serial` orders events of the whole device."""

    __slots__ = ("stream", "serial", "cuda", "waited", "_flag", "_due")

    def __init__(self, stream: str, serial: int, cuda: torch.cuda.Event | None = None, due: float = 0.0,
                 done: bool = True):
        self.stream, self.serial, self.cuda = stream, serial, cuda
        self.waited: set[str] = set()  # streams that have waited on this event
        self._flag = threading.Event()
        self._due = due
        if done:
            self._flag.set()

    def complete(self) -> None:
        """CPU: the work this event marks has finished (called by the thread that did it)."""
        self._flag.set()

    def query(self) -> bool:
        """Has the work before this event finished? Never blocks."""
        if self.cuda is not None:
            return self.cuda.query()
        return self._flag.is_set() and time.perf_counter() >= self._due

    def _block(self) -> None:
        """CPU: block the calling thread until the event completes."""
        self._flag.wait()
        remaining = self._due - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def __repr__(self) -> str:
        return f"Event({self.stream}#{self.serial}, {'done' if self.query() else 'pending'})"


class AsyncDevice:
    """The streams of one device and the protocol's operations on them; counts every host sync."""

    def __init__(self, device: torch.device | str, strict: StrictAsync | None = None):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.strict = strict if strict is not None else StrictAsync.from_env()
        if self.is_cuda and self.strict.enabled:
            raise ValueError("ORBITFLOW_STRICT_ASYNC emulates a GPU on the CPU; unset it or run with --device cpu")
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None  # host -> device
        self.d2h_stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None  # device -> host
        self._rng = random.Random(self.strict.seed)
        self._lock = threading.Lock()
        self._serial = 0
        self._lagging: list[Event] = []  # strict: compute events whose kernels are still "queued"
        self.host_syncs = 0  # host waits on the device from the step loop's thread
        self.sync_reasons: Counter[str] = Counter()
        self.worker_syncs = 0  # host waits on the device from the copy workers (not the step loop)

    # ---- events ----------------------------------------------------------------------------------
    def _next_serial(self) -> int:
        with self._lock:
            self._serial += 1
            return self._serial

    def delay(self) -> float:
        """Strict mode: how late the next copy or kernel completes; 0 otherwise."""
        if not self.strict.enabled:
            return 0.0
        with self._lock:
            return self._rng.uniform(0.5 * self.strict.max_delay_s, self.strict.max_delay_s)

    def record_compute(self) -> Event:
        """An event on the compute stream after every kernel queued so far (the fence of what they read)."""
        serial = self._next_serial()
        if self.is_cuda:
            cuda = torch.cuda.Event()
            cuda.record(torch.cuda.current_stream(self.device))
            return Event("compute", serial, cuda)
        if not self.strict.enabled:
            return Event("compute", serial)
        event = Event("compute", serial, due=time.perf_counter() + self.delay())
        with self._lock:
            self._lagging.append(event)
        return event

    def record_copy(self, stream: str = "copy") -> Event:
        """CUDA: an event on the copy (or d2h) stream after the copies issued so far. CPU: a pending event the
        worker that does the copy completes with `Event.complete`."""
        serial = self._next_serial()
        if self.is_cuda:
            cuda = torch.cuda.Event()
            cuda.record(self.copy_stream if stream == "copy" else self.d2h_stream)
            return Event(stream, serial, cuda)
        return Event(stream, serial, done=False)

    def done_event(self, stream: str = "copy") -> Event:
        """An already completed event (CPU work done synchronously)."""
        return Event(stream, self._next_serial())

    # ---- waits -----------------------------------------------------------------------------------
    def compute_wait(self, event: Event) -> None:
        """The compute stream waits for `event` (CUDA: stream-side, the host goes on; CPU: the host thread,
        which is the compute stream, blocks)."""
        event.waited.add("compute")
        if event.cuda is not None:
            torch.cuda.current_stream(self.device).wait_event(event.cuda)
        else:
            event._block()

    def copy_wait(self, event: Event, stream: str = "copy") -> None:
        """A copy stream waits for `event` before its next copy (CPU: the copy worker blocks)."""
        event.waited.add(stream)
        if event.cuda is not None:
            (self.copy_stream if stream == "copy" else self.d2h_stream).wait_event(event.cuda)
        else:
            event._block()

    def worker_host_wait(self, event: Event, stream: str = "copy") -> None:
        """A copy worker thread reads host memory that a device-to-host copy writes: the host itself must wait
        (CUDA: `Event.synchronize`, counted in `worker_syncs`, never in the step loop's `host_syncs`)."""
        event.waited.add(stream)
        if event.cuda is not None:
            if not event.cuda.query():
                with self._lock:
                    self.worker_syncs += 1
                event.cuda.synchronize()
        else:
            event._block()

    def check_ready(self, event: Event, reader: str, what: str) -> None:
        """Strict mode: raise unless `event` has completed (the `reader` stream must have waited on it)."""
        if not self.strict.enabled or event is None:
            return
        if not event.query():
            raise AsyncRaceError(f"{what}: the {reader} stream touches memory before {event!r} has completed "
                                 f"({'waited on' if reader in event.waited else 'never waited on'})")

    def host_sync(self, reason: str) -> None:
        """The host waits until the compute stream has finished all queued work. Counted."""
        self.host_syncs += 1
        self.sync_reasons[reason] += 1
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        else:
            self.host_sync_cpu()

    def host_sync_cpu(self) -> None:
        """CPU: the queued kernels have run (strict mode's lagging compute events complete)."""
        with self._lock:
            lagging, self._lagging = self._lagging, []
        for event in lagging:  # the queued kernels have run: their events complete now
            event._due = 0.0

    def to_host(self, tensor: torch.Tensor, reason: str = "sampled tokens") -> torch.Tensor:
        """The one sync a decode step makes: `tensor` read on the host once the compute stream reaches it (CUDA:
        the blocking copy is the sync itself)."""
        self.host_syncs += 1
        self.sync_reasons[reason] += 1
        if self.is_cuda:
            return tensor.to("cpu")
        self.host_sync_cpu()
        return tensor

    # ---- host-to-device data without a sync --------------------------------------------------------
    def h2d(self, data, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A small tensor (token ids, positions, block indices) on the device it indexes. CUDA: built in pinned
        memory and copied non-blocking on the current stream (a pageable copy would sync the stream)."""
        return device_index(data, self.device, dtype)

    def poison(self, tensor: torch.Tensor) -> None:
        """Strict mode: fill memory that was just freed (or not yet written) with garbage."""
        if self.strict.enabled and tensor.numel() and tensor.is_floating_point():
            tensor.fill_(float("nan"))


def device_index(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`torch.tensor(data)` on `device` without a host sync: on CUDA built in pinned memory and copied
    non-blocking on the current stream (a copy from pageable memory synchronizes the stream)."""
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)


class LayerClock:
    """Per-layer compute and stall time of one step. CPU: `perf_counter` stamps (the compute is synchronous).
    CUDA: events on the compute stream, resolved after the step's one sync, so the figures are GPU time: a
    layer's stall is the time its stream sat waiting for its prefetch, its compute the rest of its span."""

    def __init__(self, device: AsyncDevice):
        self.device = device
        self._wall_start = time.perf_counter()
        self._wall_end: float | None = None
        self._start = self._stamp()
        self._enter: dict[int, object] = {}
        self._stall: dict[int, tuple[object, object] | float] = {}
        self._end: object | None = None

    def _stamp(self):
        if self.device.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device.device))
            return event
        return time.perf_counter()

    def enter(self, layer: int) -> None:
        self._enter[layer] = self._stamp()

    def wait_begin(self):
        return self._stamp()

    def wait_end(self, layer: int, begin) -> float:
        """Record layer `layer`'s stall; returns it in seconds where it is known now (CPU), else 0.0."""
        end = self._stamp()
        self._stall[layer] = (begin, end)
        return 0.0 if self.device.is_cuda else end - begin

    def mark_gpu_end(self) -> None:
        """CUDA: the step's GPU timeline ends here (just before its one sync, so its events have completed
        when `resolve` reads them). CPU: the step ends at `end` as before."""
        if self.device.is_cuda and self._end is None:
            self._end = self._stamp()

    def end(self) -> None:
        """The step is over (host time): its wall-clock span ends; on the CPU its last layer's too."""
        self._wall_end = time.perf_counter()
        if self._end is None:
            self._end = self._stamp()

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.device.is_cuda else b - a

    def resolve(self, num_layers: int) -> tuple[list[float], list[float], float]:
        """(compute per layer, stall per layer, step wall time); call after the step's sync and `end`."""
        if self._wall_end is None:
            self.end()
        stalls = [self._elapsed(*self._stall[l]) if l in self._stall else 0.0 for l in range(num_layers)]
        entered = [self._enter.get(l) for l in range(num_layers)]
        compute = [0.0] * num_layers
        for l in range(num_layers):
            if entered[l] is None:
                continue
            nxt = next((entered[m] for m in range(l + 1, num_layers) if entered[m] is not None), self._end)
            compute[l] = self._elapsed(entered[l], nxt) - stalls[l]
        if entered and entered[0] is not None:
            compute[0] += self._elapsed(self._start, entered[0])  # embedding and the first projections
        return compute, stalls, self._wall_end - self._wall_start
