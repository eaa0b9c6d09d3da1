"""Step-latency model of one decode iteration under a KV placement.

Three transfer models:

* ``"edf"`` (default) is exactly the schedule the executor runs. Layers run in order, layer ``l`` taking
  ``comp[l]``. Each request owns ``slots`` prefetch buffer slots (the prefetch depth ``d``, default 1),
  free at step start, so each request's first ``d`` host-resident layers may start moving at t=0; its
  ``k``-th host layer (``k >= d``, 0-based) may start moving once its ``(k-d)``-th host layer has finished
  running. With ``d = 1`` a request fetches its next host layer only after the previous one has run.
  The link moves one transfer at a time, non-preemptively; whenever it
  is free it picks, among the ready transfers, the one whose layer is needed earliest (ties: lower request
  index), and idles only when nothing is ready. A layer starts when the previous layer has finished and all
  of its host-resident KV has arrived; the wait is that layer's stall.
* ``"preemptive"`` is the same link, earliest-needed layer first, but preemptive: a copy gives the link up the
  moment a transfer needed by an earlier layer is released, and resumes where it stopped (as a copy thread that
  moves a layer in chunks and re-picks between them would, chunk switches free). Then the transfers needed by
  layers ``<= l`` never wait for later ones: they are all done at ``max over release times rho of rho + their
  work released at or after rho``. With one slot and no ``host_layer_s`` that is the release/need recursion of
  :func:`orbitflow.plan.bounds.dp_bound`, which bounds every link order from below. The executor runs it with
  ``--kv-link preemptive`` (kv/transfer.py: chunks of ``--kv-link-chunk-ms``, so a switch waits for at most a chunk,
  which this model takes as free); ``benchmarks/planner.py --sections link`` measures what it gives the plans and
  the planner, ``benchmarks/kv_link.py`` the engine.
* ``"fair"`` is the paper's Algorithm 1 as printed (active streams share the bandwidth equally, the share
  is redistributed as the smallest finishes; transfers only advance at the boundary of a layer that needs
  them and overlap only with the previous layer's compute). Kept for comparison.

A transfer of request ``r`` takes ``b_r / link_blocks_per_s + transfer_latency_s`` seconds (the latency is the
engine's fixed cost per transfer: waking the copy thread and dispatching the copy; 0 for an ideal link).
Every layer's compute also carries ``request_overhead_s / L`` per request beyond the first (the engine's
per-request work in each layer: attention calls, KV writes), so a batch of R requests over T tokens costs
``compute(T) + (R - 1) * request_overhead_s`` before stalls; or, where ``batch_overhead_s`` gives the measured
extra of batches of 2, 3, ... requests (entry ``R - 2``), that entry instead (past its end, the last entry plus
``request_overhead_s`` per further request). All default to 0 (none); measured values come from the
hardware profile (``HardwareProfile.cost_model()``, the one cost model that planner and simulator share).
A layer that reads prefetched KV (some request has it on the host) also computes ``host_layer_s`` longer: on
the CPU the copy thread's work beside the compute (its wake-ups, GIL handoffs) slows exactly those layers. It is
compute, so a link-bound step hides it under the link; :func:`edf_stalls` adds it to such layers, the stalls it
returns stay the link's, and a step's latency is its compute, ``host_layer_s`` per such layer and the stalls.

``CostModel``'s parameters are immutable (it only memoises per-layer compute per token count): the runtime
controller refreshes it (EWMA of measured compute / bandwidth) with :meth:`CostModel.with_updates`, which
returns a new model, so a plan never changes under a solver that is running on another thread.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter

import numpy as np

from orbitflow.plan.placement import Placement

__all__ = ["CostModel", "StepEstimate", "batch_extra_s", "edf_stalls", "fair_stalls", "host_layers_s",
           "preemptive_stalls"]

ComputeSpec = Sequence[float] | np.ndarray | Callable[[int], Sequence[float] | np.ndarray]
_TRANSFERS = ("edf", "preemptive", "fair")


@dataclass(frozen=True)
class StepEstimate:
    """Predicted latency of one decode step."""

    total_s: float
    compute_s: float
    stall_s: float
    stall_per_layer_s: np.ndarray
    compute_per_layer_s: np.ndarray


@lru_cache(maxsize=32)
def _key_rows(n_layers: int, n_req: int) -> tuple[tuple[int, ...], ...]:
    """``rows[r][layer] == layer * n_req + r``; shared between calls, so keys cost no int arithmetic."""
    keys = list(range(n_layers * n_req))
    return tuple(tuple(keys[r::n_req]) for r in range(n_req))


# How edf_stalls simulates the link (the executor's schedule, module docstring). The link is simulated
# lazily: decisions are taken when a layer needs its KV. A decision at time ``t`` only depends on transfers
# released by ``t``, and every transfer released after an unfinished layer is released later than any
# decision taken before that layer starts, so the lazy order is exact. "Released by ``t``" means released at
# or before ``t + 1e-12 + 1e-9 * t``.
#
# A transfer is identified by its EDF key ``layer * R + r`` (unique: a request fetches each layer once).
# Releases happen at layer ends, in time order (kept sorted should a negative compute send time back), so
# released transfers wait in a FIFO of events (release time, keys) until a decision admits them into a
# sorted list of available keys. The decisions while layer ``l`` waits are taken in two phases:
#
# 1. While one of layer ``l``'s transfers is still in the FIFO, one decision at a time: admit every event
#    released by the threshold; if nothing is available, idle until the FIFO head's release and admit what
#    is released by then; else move the smallest available key.
# 2. Then layer ``l``'s pending transfers are all available and hold the smallest keys, so they go next, in
#    key order, whatever is admitted meanwhile (keys of later layers only): move them in one run, and leave
#    the admissions to the next decision, which admits the same events because the link time (hence the
#    threshold) never decreases.
#
# This is the same schedule, with the same float operations in the same order, as scanning every request at
# every decision (``_reference_edf`` in ``tests/plan/test_cost_model.py``, which the tests fuzz it against),
# at O(1) interpreted steps per transfer and per layer instead of O(R) per transfer.


def _check_seconds(values: np.ndarray, name: str) -> None:
    """Per-layer compute seconds must be finite and >= 0 (NaN and inf pass a ``< 0`` check)."""
    if not np.all(np.isfinite(values) & (values >= 0)):
        raise ValueError(f"{name} must be finite seconds >= 0, got {values.tolist()}")


def _release_lists(n_layers: int, hosts: Sequence[Sequence[int]], slots: int) -> tuple[list[int], list[list[int]]]:
    """The keys available at t=0 (each request's first ``slots`` host layers) and, per layer ``l``, the keys
    released when layer ``l`` ends (a request's next host layer once the one ``slots`` before it has run)."""
    n_req = len(hosts)
    rel: list[list[int]] = [[] for _ in range(n_layers)]
    avail: list[int] = []
    if slots == 1:
        for kr, hl in zip(_key_rows(n_layers, n_req), hosts):
            p = avail
            for layer in hl:
                p.append(kr[layer])
                p = rel[layer]
    else:
        if not (isinstance(slots, int) and slots >= 1):
            raise ValueError(f"slots (prefetch depth) must be an integer >= 1, got {slots!r}")
        for kr, hl in zip(_key_rows(n_layers, n_req), hosts):
            for k, layer in enumerate(hl):
                (avail if k < slots else rel[hl[k - slots]]).append(kr[layer])
    avail.sort()
    return avail, rel


def _move_run(avail: list[int], lim: int, t_link: float, xk: list[float]) -> float:
    """Phase 2: move the available keys below ``lim`` (the current layer's) back to back, in key order;
    returns the link time when the last one arrives."""
    c = bisect_left(avail, lim)
    for j in avail[:c]:
        t_link += xk[j]
    del avail[:c]
    return t_link


def _admit(avail: list[int], t_link: float, head_k: list[int], q_t: list[float], q_k: list[list[int]], qh: int,
           big: int):
    """Phase 1's admission at link time ``t_link``: the FIFO's head event and every queued one released by the
    threshold join ``avail`` (kept sorted). Returns the new head ``(nrel, head_k, fmin, qh)``."""
    thr = t_link + 1e-12 + 1e-9 * t_link
    avail += head_k
    nrel, head_k, fmin = math.inf, None, big
    if qh < len(q_t):
        while qh < len(q_t) and q_t[qh] <= thr:
            avail += q_k[qh]
            qh += 1
        if qh < len(q_t):
            nrel, head_k, fmin = q_t[qh], q_k[qh], min(map(min, q_k[qh:]))
            qh += 1
    avail.sort()
    return nrel, head_k, fmin, qh


def _queue_release(t: float, keys: list[int], nrel: float, head_k: list[int], q_t: list[float],
                   q_k: list[list[int]], qh: int):
    """Queue a release event behind the FIFO's head, in time order (an event earlier than the last one only
    comes with negative compute); returns the FIFO as ``(nrel, head_k, q_t, q_k, qh)``."""
    if t >= (q_t[-1] if qh < len(q_t) else nrel):
        q_t.append(t)
        q_k.append(keys)
        return nrel, head_k, q_t, q_k, qh
    ts = [nrel, *q_t[qh:]]
    ks = [head_k, *q_k[qh:]]
    i = bisect_right(ts, t)
    ts.insert(i, t)
    ks.insert(i, keys)
    nrel, *q_t = ts
    head_k, *q_k = ks
    return nrel, head_k, q_t, q_k, 0


def _host_layers(hosts: Sequence[Sequence[int]]) -> set[int]:
    """The layers that some request reads from the host."""
    return {layer for hl in hosts for layer in hl}


def _with_host_layers(comp: Sequence[float], hosts: Sequence[Sequence[int]], host_layer_s: float) -> Sequence[float]:
    """``comp`` with ``host_layer_s`` added to every layer that some request reads from the host."""
    if not host_layer_s:
        return comp
    out = list(comp)
    for layer in _host_layers(hosts):
        out[layer] += host_layer_s
    return out


def host_layers_s(hosts: Sequence[Sequence[int]], host_layer_s: float) -> float:
    """The extra compute of the layers some request reads from the host (``hosts[r]``: request ``r``'s host
    layers), summed one layer at a time as the compiled evaluator does, so both give the same floats."""
    return sum([host_layer_s] * len(_host_layers(hosts))) if host_layer_s else 0.0


def edf_stalls(
    comp: Sequence[float], hosts: Sequence[Sequence[int]], xfer: Sequence[float], abort_above: float = math.inf,
    slots: int = 1, host_layer_s: float = 0.0,
) -> list[float] | None:
    """Per-layer stalls of the executor's schedule (module docstring; the method is in the comment above).
    ``comp``: per-layer compute seconds; ``hosts[r]``: strictly increasing 0-based host layers of request ``r``;
    ``xfer[r]``: seconds (>= 0) to move one layer of request ``r``; ``slots``: prefetch depth (>= 1);
    ``host_layer_s``: extra compute of a layer that reads prefetched KV. Returns None as soon as the step is
    known to take longer than ``abort_above`` seconds (a leaf that cannot win)."""
    # The FIFO's state lives in locals (the pure-Python evaluator is the reference and the planner's fallback
    # without numba); only what runs once per release event is a call (_admit, _queue_release).
    n_layers, n_req = len(comp), len(hosts)
    comp = comp.tolist() if isinstance(comp, np.ndarray) else comp
    avail, rel = _release_lists(n_layers, hosts, slots)  # avail: admitted keys, sorted
    stall = [0.0] * n_layers
    if not avail:
        return stall
    # compute of layers l.. (for abort_above)
    tail = np.cumsum(np.asarray(comp[::-1], dtype=float))[::-1].tolist() if abort_above < math.inf else None
    comp = _with_host_layers(comp, hosts, host_layer_s)  # after the tail: the compiled twin's abort bound
    xk = (xfer.tolist() if isinstance(xfer, np.ndarray) else list(xfer)) * n_layers  # xk[key] = xfer[r]
    big = n_layers * n_req
    last = [-math.inf] * n_layers  # arrival of the last transfer of layer l moved during an earlier layer
    # FIFO of release events not admitted yet: the head (release time nrel, keys head_k; None: empty),
    # then q_t[qh:] / q_k[qh:] (rare: more than one event pending)
    nrel, head_k, q_t, q_k, qh = math.inf, None, [], [], 0
    fmin = big  # smallest key in the FIFO (big: empty)
    t_link = t_prev = 0.0
    lim = 0  # keys < lim belong to layers <= the current one
    for layer in range(n_layers):
        lim += n_req
        while fmin < lim:  # phase 1: one of this layer's transfers is not admitted yet
            thr = t_link + 1e-12 + 1e-9 * t_link
            if nrel <= thr or not avail:
                if nrel > thr:  # nothing released: idle until the earliest release
                    t_link = nrel
                nrel, head_k, fmin, qh = _admit(avail, t_link, head_k, q_t, q_k, qh, big)
            else:
                j = avail.pop(0)
                t_link += xk[j]
                if j >= lim:
                    last[j // n_req] = t_link
        if avail and avail[0] < lim:  # phase 2: this layer's remaining transfers, in key order
            ready = t_link = _move_run(avail, lim, t_link, xk)
        else:
            ready = last[layer]  # all moved ahead of time (-inf: the layer needs nothing)
        if ready > t_prev:
            stall[layer] = ready - t_prev
            t_prev = ready
            if tail is not None and t_prev + tail[layer] > abort_above:
                return None
        t_prev += comp[layer]
        rk = rel[layer]
        if rk:  # release this layer's successors
            if head_k is None:
                nrel, head_k, fmin = t_prev, rk, min(rk)
            else:
                fmin = min(fmin, min(rk))
                nrel, head_k, q_t, q_k, qh = _queue_release(t_prev, rk, nrel, head_k, q_t, q_k, qh)
    return stall


def preemptive_stalls(
    comp: Sequence[float], hosts: Sequence[Sequence[int]], xfer: Sequence[float], abort_above: float = math.inf,
    slots: int = 1, host_layer_s: float = 0.0,
) -> list[float] | None:
    """Per-layer stalls of the ``"preemptive"`` link (module docstring), with :func:`edf_stalls`'s arguments and
    result. Releases happen at layer ends, so the work is kept per release event (``work[0]``: released at t=0,
    ``work[m + 1]``: when layer ``m`` ends) and summed per layer only over the transfers needed by layers up to it;
    layer ``l`` waits until ``max_m event[m] + sum(work[m:])``. The compiled twin
    (``compiled._preemptive``) takes the same float steps in the same order."""
    n_layers = len(comp)
    if not (isinstance(slots, int) and slots >= 1):
        raise ValueError(f"slots (prefetch depth) must be an integer >= 1, got {slots!r}")
    comp = comp.tolist() if isinstance(comp, np.ndarray) else list(comp)
    tail = np.cumsum(np.asarray(comp[::-1], dtype=float))[::-1].tolist() if abort_above < math.inf else None
    need: list[list[tuple[int, float]]] = [[] for _ in range(n_layers)]  # per layer: (release event, seconds)
    for r, hl in enumerate(hosts):
        for k, layer in enumerate(hl):
            need[layer].append((0 if k < slots else hl[k - slots] + 1, xfer[r]))
    work = [0.0] * (n_layers + 1)
    event = [0.0] * (n_layers + 1)
    stall = [0.0] * n_layers
    t = 0.0
    for layer in range(n_layers):
        if need[layer]:
            for m, x in need[layer]:
                work[m] += x
            ready = acc = 0.0
            for m in range(layer, -1, -1):
                acc += work[m]
                if event[m] + acc > ready:
                    ready = event[m] + acc
            if ready > t:
                stall[layer] = ready - t
                t = ready
                if tail is not None and t + tail[layer] > abort_above:
                    return None
            t += comp[layer] + host_layer_s
        else:
            t += comp[layer]
        event[layer + 1] = t
    return stall


def fair_stalls(
    comp: Sequence[float], host_mask: np.ndarray, sizes_s: Sequence[float]
) -> list[float]:
    """Per-layer stalls of Algorithm 1 as printed in the paper (equal bandwidth sharing).

    ``host_mask[r, l]`` True = offloaded; ``sizes_s[r]``: seconds to move one layer of request ``r`` at the
    full link bandwidth (so a share of ``1/n`` makes it take ``n`` times longer).
    """
    n_req, n_layers = host_mask.shape
    pending = [list(np.flatnonzero(host_mask[r])) for r in range(n_req)]
    cur: dict[int, int] = {}  # request -> layer in flight
    stall = [0.0] * n_layers
    comp_prev = 0.0
    for layer in range(n_layers):
        for r in range(n_req):  # CanStart + Promote
            if r in cur or not pending[r]:
                continue
            nxt = pending[r][0]
            if nxt == layer or not host_mask[r, layer]:
                cur[r] = pending[r].pop(0)
        dest = {r for r, lay in cur.items() if lay == layer}
        order = sorted(cur, key=lambda q: (sizes_s[q], q))
        elapsed = 0.0
        n = len(order)
        s = 0.0
        i = 0
        while dest:
            q = order[i]
            elapsed += sizes_s[q] * n
            if elapsed > comp_prev:
                s = elapsed - comp_prev
            dest.discard(q)
            del cur[q]
            n -= 1
            i += 1
        stall[layer] = s
        comp_prev = comp[layer]
    return stall


def batch_extra_s(batch_overhead_s: Sequence[float], request_overhead_s: float, num_requests: int) -> float:
    """Extra compute seconds of a step of ``num_requests`` requests: entry ``R - 2`` of ``batch_overhead_s`` (batches
    of 2, 3, ...), past its end its last entry plus ``request_overhead_s`` per further request (with no entries,
    ``request_overhead_s`` per request beyond the first)."""
    extra = max(int(num_requests) - 1, 0)
    if extra <= len(batch_overhead_s):
        return batch_overhead_s[extra - 1] if extra else 0.0
    if not batch_overhead_s:
        return extra * request_overhead_s
    return batch_overhead_s[-1] + (extra - len(batch_overhead_s)) * request_overhead_s


def _batch_seconds(values: Sequence[float]) -> tuple[float, ...]:
    """``batch_overhead_s`` as a tuple of finite seconds >= 0 (else a ValueError naming it)."""
    batch = tuple(float(v) for v in values)
    if not all(math.isfinite(v) and v >= 0 for v in batch):
        raise ValueError(f"batch_overhead_s must be finite seconds >= 0, got {list(batch)}")
    return batch


def _read_only(attr: str, doc: str) -> property:
    """A read-only attribute backed by ``attr`` (the cost model's parameters never change after __init__)."""
    return property(attrgetter(attr), doc=doc)


class CostModel:
    """Predicts decode-step latency from per-layer compute and link bandwidth.

    ``layer_compute_s``: L floats, or ``callable(total_tokens) -> L floats`` (then ``step`` needs
    ``total_tokens``). ``layer_compute_scale`` (scalar or L floats) multiplies compute; it is what the
    controller's EWMA refresh updates. Instances are immutable; use :meth:`with_updates`.
    """

    def __init__(
        self,
        layer_compute_s: ComputeSpec,
        link_blocks_per_s: float,
        transfer: str = "edf",
        *,
        layer_compute_scale: float | Sequence[float] | np.ndarray = 1.0,
        num_layers: int | None = None,
        request_overhead_s: float = 0.0,
        batch_overhead_s: Sequence[float] = (),
        transfer_latency_s: float = 0.0,
        prefetch_slots: int = 1,
        host_layer_s: float = 0.0,
    ) -> None:
        if transfer not in _TRANSFERS:
            raise ValueError(f"transfer must be one of {_TRANSFERS}, got {transfer!r}")
        if not link_blocks_per_s > 0:
            raise ValueError(f"link_blocks_per_s must be > 0, got {link_blocks_per_s}")
        for name, value in (("request_overhead_s", request_overhead_s), ("transfer_latency_s", transfer_latency_s),
                            ("host_layer_s", host_layer_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if isinstance(prefetch_slots, bool) or not isinstance(prefetch_slots, int) or prefetch_slots < 1:
            raise ValueError(f"prefetch_slots must be an integer >= 1, got {prefetch_slots!r}")
        if prefetch_slots != 1 and transfer == "fair":
            raise ValueError("prefetch_slots > 1 needs transfer='edf' or 'preemptive' (Algorithm 1 as printed has one "
                             "slot)")
        self._slots = prefetch_slots
        self._transfer = transfer
        self._link = float(link_blocks_per_s)
        self._req_overhead = float(request_overhead_s)
        self._batch_overhead = _batch_seconds(batch_overhead_s)
        self._latency = float(transfer_latency_s)
        self._host_layer = float(host_layer_s)
        self._fn: Callable[[int], Sequence[float] | np.ndarray] | None
        if callable(layer_compute_s):
            self._fn = layer_compute_s
            self._fixed = None
            n = num_layers if num_layers is not None else len(np.asarray(layer_compute_s(1)))
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"num_layers must be an integer >= 1, got {n!r}")
        else:
            self._fn = None
            self._fixed = np.asarray(layer_compute_s, dtype=float).copy()
            if self._fixed.ndim != 1 or self._fixed.size == 0:
                raise ValueError("layer_compute_s must be a non-empty 1-D sequence of seconds")
            _check_seconds(self._fixed, "layer_compute_s")
            n = self._fixed.size
            if num_layers is not None and num_layers != n:
                raise ValueError(f"num_layers is {num_layers!r} but layer_compute_s has {n} entries")
        self._num_layers = int(n)
        scale = np.asarray(layer_compute_scale, dtype=float)
        if scale.ndim > 1 or (scale.ndim == 1 and scale.size != self._num_layers):
            raise ValueError(f"layer_compute_scale must be a scalar or {self._num_layers} floats (one per layer), "
                             f"got shape {scale.shape}")
        scale = np.broadcast_to(scale, (self._num_layers,)).copy()
        if not np.all((scale > 0) & np.isfinite(scale)):
            raise ValueError(f"layer_compute_scale must be finite and > 0, got {scale.tolist()}")
        self._scale = scale
        self._cache: dict[int, np.ndarray] = {}

    # -- parameters (read-only) -------------------------------------------------------------------------
    num_layers = _read_only("_num_layers", "Layers of the model.")
    link_blocks_per_s = _read_only("_link", "Link rate in KV blocks per second.")
    transfer = _read_only("_transfer", "Transfer model: 'edf' (the executor's default), 'preemptive' (the same link, "
                                       "preemptive: --kv-link preemptive) or 'fair' (Algorithm 1).")
    prefetch_slots = _read_only("_slots", "Prefetch depth: buffer slots per request (layers of it in flight at once).")
    request_overhead_s = _read_only("_req_overhead", "Compute seconds per request beyond the first, per step.")
    batch_overhead_s = _read_only("_batch_overhead", "Measured extra compute seconds of a step of 2, 3, ... requests "
                                                     "(entry R - 2); past its end request_overhead_s a request.")
    transfer_latency_s = _read_only("_latency", "Fixed seconds per transfer on top of blocks / link rate.")
    host_layer_s = _read_only("_host_layer", "Extra compute seconds of a layer that reads prefetched KV.")

    @property
    def layer_compute_scale(self) -> np.ndarray:
        """Per-layer multiplier of compute (a copy; the controller's EWMA refresh sets it)."""
        return self._scale.copy()

    @property
    def depends_on_tokens(self) -> bool:
        """True when per-layer compute is a function of the batch's total tokens."""
        return self._fn is not None

    def with_updates(
        self,
        *,
        layer_compute_s: ComputeSpec | None = None,
        layer_compute_scale: float | Sequence[float] | np.ndarray | None = None,
        link_blocks_per_s: float | None = None,
        transfer: str | None = None,
        prefetch_slots: int | None = None,
    ) -> CostModel:
        """A copy with some parameters replaced (the controller's EWMA refresh)."""
        comp: ComputeSpec = layer_compute_s if layer_compute_s is not None else (self._fn or self._fixed)
        scale = self._scale if layer_compute_scale is None else layer_compute_scale
        if layer_compute_scale is None and layer_compute_s is not None and np.all(self._scale == self._scale[0]):
            scale = float(self._scale[0])  # a uniform scale carries over to a new layer count
        return CostModel(
            comp,
            self._link if link_blocks_per_s is None else link_blocks_per_s,
            self._transfer if transfer is None else transfer,
            layer_compute_scale=scale,
            num_layers=self._num_layers if layer_compute_s is None else None,
            request_overhead_s=self._req_overhead,
            batch_overhead_s=self._batch_overhead,
            transfer_latency_s=self._latency,
            prefetch_slots=self._slots if prefetch_slots is None else prefetch_slots,
            host_layer_s=self._host_layer,
        )

    def compute(self, total_tokens: int | None = None, num_requests: int = 1) -> np.ndarray:
        """Per-layer compute seconds of a batch of ``num_requests`` requests (read-only array)."""
        if self._fn is None:
            tokens = -1
        else:
            if total_tokens is None:
                raise ValueError("this CostModel's compute depends on total_tokens; pass total_tokens=")
            tokens = int(total_tokens)
        extra = max(int(num_requests) - 1, 0) if (self._req_overhead or self._batch_overhead) else 0
        key = (tokens, extra)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        base = self._fixed if self._fn is None else np.asarray(self._fn(tokens), dtype=float)
        if base.shape != (self._num_layers,):
            raise ValueError(f"layer compute must have {self._num_layers} entries, got shape {base.shape}")
        if self._fn is not None:
            _check_seconds(base, f"layer_compute_s({tokens})")
        if extra:
            base = base + self.batch_extra_s(extra + 1) / self._num_layers
        out = base * self._scale
        out.setflags(write=False)
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[key] = out
        return out

    def batch_extra_s(self, num_requests: int) -> float:
        """Extra compute seconds of a step of ``num_requests`` requests over one request of as many tokens."""
        return batch_extra_s(self._batch_overhead, self._req_overhead, num_requests)

    def transfer_s(self, blocks: float | np.ndarray) -> float | np.ndarray:
        """Seconds of one transfer of ``blocks`` KV blocks over the link (with its fixed latency; 0 for none)."""
        if isinstance(blocks, np.ndarray):
            b = blocks.astype(float)
            return b / self._link + np.where(b > 0, self._latency, 0.0)
        return float(blocks) / self._link + (self._latency if blocks > 0 else 0.0)

    # -- prediction -------------------------------------------------------------------------------------
    @property
    def link_stalls(self) -> Callable[..., list[float] | None]:
        """The per-layer stall evaluator of the ``"edf"`` or ``"preemptive"`` link (:func:`edf_stalls` or
        :func:`preemptive_stalls`, the same arguments): what :meth:`stalls` and the search's leaves run."""
        return preemptive_stalls if self._transfer == "preemptive" else edf_stalls

    def stalls(
        self, host_mask: np.ndarray, blocks_per_layer: Sequence[float] | np.ndarray, comp: np.ndarray
    ) -> list[float]:
        """Per-layer stall seconds for a host mask ``[R, L]`` (True = offloaded), its layers that read prefetched KV
        computing ``host_layer_s`` longer than ``comp``."""
        xfer = self.transfer_s(np.asarray(blocks_per_layer, dtype=float)).tolist()
        if self._transfer == "fair":
            return fair_stalls((comp + self.host_layer_compute(host_mask)).tolist(), host_mask, xfer)
        hosts = [np.flatnonzero(row).tolist() for row in host_mask]
        return self.link_stalls(comp.tolist(), hosts, xfer, slots=self._slots, host_layer_s=self._host_layer)

    def host_layer_compute(self, host_mask: np.ndarray) -> np.ndarray:
        """Per-layer extra compute of a host mask ``[R, L]``: ``host_layer_s`` where some request's KV is on the
        host, else 0."""
        return np.asarray(host_mask, dtype=bool).any(axis=0) * self._host_layer

    def base_layer_compute(self, layer_compute_s: Sequence[float] | np.ndarray,
                           host_layers: Sequence[bool] | np.ndarray) -> np.ndarray:
        """Measured per-layer compute less the extra this model charges a layer that reads prefetched KV
        (``host_layer_s`` where ``host_layers[l]``; at least 0): what the model's own ``comp`` would be. Whatever
        feeds measured compute back into the model (the EWMA's compute scale, a schedule fed measured compute) takes
        it off first, or the extra is counted twice."""
        measured = np.asarray(layer_compute_s, dtype=float)
        return np.maximum(measured - self._host_layer * np.asarray(host_layers, dtype=float), 0.0)

    def added_s(self, host_mask: np.ndarray, blocks_per_layer: Sequence[float] | np.ndarray, comp: np.ndarray) -> float:
        """What a host mask adds to the step's base compute ``comp``: its stalls and its layers' extra compute."""
        stall = float(sum(self.stalls(host_mask, blocks_per_layer, comp)))
        return stall + host_layers_s([np.flatnonzero(row).tolist() for row in host_mask], self._host_layer)

    def step(
        self,
        placement: Placement,
        blocks_per_layer: Sequence[float] | np.ndarray,
        total_tokens: int | None = None,
    ) -> StepEstimate:
        """Predicted latency of one decode step for ``placement`` with ``b_r = blocks_per_layer[r]``."""
        if placement.num_layers != self._num_layers:
            raise ValueError(
                f"placement has {placement.num_layers} layers, cost model {self._num_layers}"
            )
        b = np.asarray(blocks_per_layer, dtype=float)
        if b.shape != (placement.num_requests,):
            raise ValueError(
                f"blocks_per_layer must have length {placement.num_requests}, got shape {b.shape}"
            )
        base = self.compute(total_tokens, placement.num_requests)
        st = np.asarray(self.stalls(placement.host, b, base), dtype=float)
        comp = base + self.host_layer_compute(placement.host)
        c = float(comp.sum())
        s = float(st.sum())
        return StepEstimate(c + s, c, s, st, np.array(comp))
