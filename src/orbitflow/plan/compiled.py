"""Compiled kernels of the planner: the executor's EDF schedule (and the preemptive link's, ``CostModel(transfer=
"preemptive")``, through :func:`_link`), the branch and bound's inner loop, the window
rule of one assignment (:func:`leaf_feasible`), the first incumbents and their local improvement, and whole
searches with their set-up: an expiry check's first-found one (:func:`first_better`) and one without a deadline
(:func:`best_found`).

Compiled with numba (nopython, ``nogil``, ``cache=True``), so a solve on the planner thread does not hold the
GIL while it searches and the engine's step loop keeps running beside it. Every function takes float64 / int64
/ uint8 / bool arrays only (one signature each, compiled once and cached on disk; the bool ones are flag arrays,
``bb_search``'s ``same_as_prev`` and ``alive``).

The pure Python / NumPy code stays the reference (:func:`orbitflow.plan.cost_model.edf_stalls`,
:class:`orbitflow.plan.search.BranchAndBound`'s ``_node``) and the fallback when numba is missing or
``ORBITFLOW_PLAN_COMPILED=0`` is set. The compiled code performs the same float operations in the same order
(up to one rounding in a mean), so both give the same stalls, the same bounds and the same plans
(tests/plan/test_compiled.py). The tail bound's scalar code (:func:`orbitflow.plan.bounds.critical_windows`,
:func:`orbitflow.plan.bounds.tail_cover`, its constants) is the reference's own, compiled here. Its sums are of
integer transfer counts, exact in any order. numba's on-disk cache checks only the file that defines a kernel, so every
kernel's cache entry is also stamped with the contents of the modules compiled into it (:func:`_jit`,
``DEPENDS_ON``): after an edit of ``bounds.py`` the kernels compile afresh instead of running the old code.

Prefetch depth (``slots``): with ``d`` buffer slots per request, a request's first ``d`` host-resident layers
may start moving at t=0 and its ``k``-th host-resident layer (``k >= d``, 0-based) is released when its
``(k-d)``-th host-resident layer has finished computing; ``d=1`` is the executor's one slot per request.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from orbitflow.plan import bounds
from orbitflow.plan import types as plan_types
from orbitflow.plan.types import REL_TOL

try:  # numba is a runtime dependency, but the planner must keep working without it
    import numba

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised by installs without numba
    numba = None
    HAVE_NUMBA = False

DEPENDS_ON = (bounds, plan_types)  # modules whose code or constants the kernels compile in, beside this file


def _jit(fn, depends_on=DEPENDS_ON):
    """``fn`` compiled with numba (nopython, ``nogil``, cached on disk); ``fn`` itself without numba. numba keeps a
    cache entry while the file defining ``fn`` is unchanged (its source stamp), even when a function or constant
    it compiled in from another module has changed since. So the entry's stamp also carries a digest of the
    ``depends_on`` modules' files: an edit of one of them makes numba compile ``fn`` afresh. (The stamp is a private
    attribute of numba's cache: if a numba release renames it, or a module has no readable file, the kernels keep
    numba's own stamp.)"""
    if not HAVE_NUMBA:
        return fn
    kernel = numba.njit(nogil=True, cache=True)(fn)
    index = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
    digest = _digest(tuple(getattr(m, "__file__", None) for m in depends_on))
    if index is not None and hasattr(index, "_source_stamp") and digest is not None:
        index._source_stamp = (index._source_stamp, digest)
    return kernel


@functools.cache
def _digest(paths: tuple[str | None, ...]) -> str | None:
    """sha256 of the files' contents; None if one cannot be read (a zip or frozen install)."""
    h = hashlib.sha256()
    try:
        for path in paths:
            with open(path, "rb") as f:
                h.update(f.read())
    except (OSError, TypeError):
        return None
    return h.hexdigest()


__all__ = ["HAVE_CLOCK", "HAVE_NUMBA", "enabled", "edf_stalls", "kernel_deadline"]

# The kernels read the monotonic clock themselves (libc's clock_gettime, a vDSO call of ~30 ns, declared by name so
# that numba's on-disk cache still works), so a search under a deadline runs in one call instead of returning to
# Python every ~100 us to look at the time; each return and re-entry cost ~10-20 us of a 1 ms budget. Where that
# clock is missing (Windows, 32-bit) the callers keep pausing (``PAUSED``) and checking the time themselves.
HAVE_CLOCK = HAVE_NUMBA and hasattr(time, "CLOCK_MONOTONIC") and sys.platform != "win32" and sys.maxsize > 2**32

if HAVE_CLOCK:
    from llvmlite import ir
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def _clock_gettime(typingctx, clock_id, timespec):
        """``clock_gettime(clock_id, &timespec)`` with ``timespec`` an int64 array (seconds, nanoseconds)."""
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[1])(context, builder, args[1]).data
            byte_ptr = ir.IntType(8).as_pointer()
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), byte_ptr])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "clock_gettime")
            return builder.call(fn, [args[0], builder.bitcast(data, byte_ptr)])

        return numba.types.int32(numba.types.int32, timespec), codegen

    @_jit
    def _now(clock):
        """Seconds on the monotonic clock whose id is ``clock[2]`` (``clock``: int64 scratch of 3)."""
        _clock_gettime(np.int32(clock[2]), clock)
        return clock[0] + clock[1] * 1e-9
else:
    @_jit
    def _now(clock):
        return -math.inf  # no clock: the kernels never see a deadline pass; the caller pauses them instead


def clock_scratch() -> np.ndarray:
    """The ``clock`` argument of the kernels that read the time."""
    return np.array([0, 0, time.CLOCK_MONOTONIC if HAVE_CLOCK else 0], dtype=np.int64)


def kernel_deadline(deadline: float | None, clock: np.ndarray) -> float:
    """A ``time.perf_counter()`` deadline on the kernels' clock (inf: none, or no clock). The two clocks are the
    same one on Linux; the offset is measured anyway, so another platform's perf_counter cannot skew it."""
    if deadline is None or not HAVE_CLOCK:
        return math.inf
    return _now(clock) + (deadline - time.perf_counter())

ENV = "ORBITFLOW_PLAN_COMPILED"


def enabled(compiled: bool | None = None) -> bool:
    """Whether the compiled kernels are used: ``compiled`` if given, else numba is installed and the
    environment variable ``ORBITFLOW_PLAN_COMPILED`` is not ``0``."""
    if compiled is None:
        return HAVE_NUMBA and os.environ.get(ENV, "1") != "0"
    if compiled and not HAVE_NUMBA:
        raise ValueError("compiled=True needs numba (pip install numba), or pass compiled=False")
    return bool(compiled)


# ==== the executor's schedule ===============================================================================
@_jit
def _edf(comp, tail, ptr, lay, row, xfer, slots, abort_above, nxt, cur, fin, arr, stall, hl):
    """Per-layer stalls of the EDF schedule into ``stall``; returns what the placement adds to the compute (the
    stalls, plus ``hl`` of extra compute per layer that reads prefetched KV), or -1.0 once the step is known
    to take longer than ``abort_above``.

    Request ``r``'s host layers are ``lay[ptr[row[r]]:ptr[row[r] + 1]]`` (CSR, increasing); ``xfer[r]`` the
    seconds to move one of them; ``tail[l]`` the compute of layers ``l..`` (for the abort). ``nxt`` / ``cur``
    (R), ``fin`` (L) and ``arr`` (len(lay)) are scratch. The link is simulated lazily, as in the reference:
    decisions are taken while a layer waits for its KV; each decision scans the requests (R is small), moves
    the released transfer needed earliest (ties: lower request index) or idles until the next release.
    """
    # NOTE: kept whole: the jitted twin of cost_model.edf_stalls, one event loop whose state is a few scalars
    # and the scratch arrays; split, every piece would take and return all of it.
    # Per request, the transfer it moves next (nxt) is kept with its release time (nrel: inf until the layer that
    # releases it has run, or when the request has none left) and its EDF key (nkey), so a decision reads two
    # arrays; pend[l] counts layer l's transfers not started yet (a layer waits while it is > 0).
    n_req = row.size
    n_layers = comp.size
    inf = math.inf
    nrel = np.empty(n_req)
    nkey = np.empty(n_req, np.int64)
    pend = np.zeros(n_layers, np.int64)
    for r in range(n_req):
        p, end = ptr[row[r]], ptr[row[r] + 1]
        nxt[r] = p
        cur[r] = p
        nrel[r] = 0.0 if p < end else inf  # a request's first transfers are released at t=0
        nkey[r] = lay[p] * n_req + r if p < end else 0
        for a in range(p, end):
            pend[lay[a]] += 1
    for layer in range(n_layers):
        stall[layer] = 0.0
        fin[layer] = inf
    t_link = 0.0
    t = 0.0
    added = 0.0
    for layer in range(n_layers):
        while pend[layer] > 0:  # this layer waits for a transfer not started yet
            thr = t_link + 1e-12 + 1e-9 * t_link
            pick = -1
            pick_key = 1 << 62
            next_rel = inf
            for r in range(n_req):
                rel = nrel[r]
                if rel <= thr:
                    if nkey[r] < pick_key:
                        pick_key = nkey[r]
                        pick = r
                elif rel < next_rel:
                    next_rel = rel
            if pick < 0:
                if next_rel == inf:  # cannot happen: the waiting transfer was released by an earlier layer
                    break
                t_link = next_rel  # idle until the next release
                continue
            t_link += xfer[pick]
            a = nxt[pick]
            arr[a] = t_link
            pend[lay[a]] -= 1
            a += 1
            nxt[pick] = a
            if a < ptr[row[pick] + 1]:
                nrel[pick] = 0.0 if a - ptr[row[pick]] < slots else fin[lay[a - slots]]
                nkey[pick] = lay[a] * n_req + pick
            else:
                nrel[pick] = inf
        ready = -inf
        extra = 0.0
        for r in range(n_req):
            c = cur[r]
            if c < ptr[row[r] + 1] and lay[c] == layer:
                if arr[c] > ready:
                    ready = arr[c]
                extra = hl
        if ready > t:
            stall[layer] = ready - t
            t = ready
            if t + tail[layer] > abort_above:
                return -1.0
        t += comp[layer] + extra
        fin[layer] = t
        added += extra
        for r in range(n_req):  # the layer has run: it releases the transfer slots later of each request it read
            c = cur[r]
            if c < ptr[row[r] + 1] and lay[c] == layer:
                cur[r] = c + 1
                if nxt[r] == c + slots and c + slots < ptr[row[r] + 1]:
                    nrel[r] = t
    total = 0.0
    for layer in range(n_layers):
        total += stall[layer]
    return total + added


@_jit
def _preemptive(comp, tail, ptr, lay, row, xfer, slots, abort_above, cur, stall, hl):
    """Jitted twin of :func:`orbitflow.plan.cost_model.preemptive_stalls`, with :func:`_edf`'s arguments and result
    (``cur``: scratch of R): the same float steps in the same order."""
    n_req = row.size
    n_layers = comp.size
    work = np.zeros(n_layers + 1)  # by release event: 0 at t=0, m + 1 when layer m ends
    event = np.zeros(n_layers + 1)
    for r in range(n_req):
        cur[r] = ptr[row[r]]
    t = 0.0
    added = 0.0
    for layer in range(n_layers):
        stall[layer] = 0.0
        has = False
        for r in range(n_req):
            c = cur[r]
            if c < ptr[row[r] + 1] and lay[c] == layer:
                has = True
                k = c - ptr[row[r]]
                work[0 if k < slots else lay[c - slots] + 1] += xfer[r]
                cur[r] = c + 1
        if has:
            ready = 0.0
            acc = 0.0
            for m in range(layer, -1, -1):
                acc += work[m]
                if event[m] + acc > ready:
                    ready = event[m] + acc
            if ready > t:
                stall[layer] = ready - t
                t = ready
                if t + tail[layer] > abort_above:
                    return -1.0
            t += comp[layer] + hl
            added += hl
        else:
            t += comp[layer]
        event[layer + 1] = t
    total = 0.0
    for layer in range(n_layers):
        total += stall[layer]
    return total + added


@_jit
def _link(preemptive, comp, tail, ptr, lay, row, xfer, slots, abort_above, nxt, cur, fin, arr, stall, hl):
    """What a placement adds to a step's compute on the link the cost model names: :func:`_preemptive` when
    ``preemptive`` (CostModel ``transfer="preemptive"``), else :func:`_edf` (the executor's)."""
    if preemptive:
        return _preemptive(comp, tail, ptr, lay, row, xfer, slots, abort_above, cur, stall, hl)
    return _edf(comp, tail, ptr, lay, row, xfer, slots, abort_above, nxt, cur, fin, arr, stall, hl)


def tail(comp: np.ndarray) -> np.ndarray:
    """``out[l] = sum(comp[l:])`` as the reference evaluator computes it."""
    return np.cumsum(comp[::-1])[::-1].copy()


def edf_stalls(
    comp: Sequence[float] | np.ndarray,
    hosts: Sequence[Sequence[int]],
    xfer: Sequence[float] | np.ndarray,
    slots: int = 1,
    abort_above: float = math.inf,
    host_layer_s: float = 0.0,
    preemptive: bool = False,
) -> np.ndarray | None:
    """Compiled counterpart of :func:`orbitflow.plan.cost_model.edf_stalls` with ``slots`` buffer slots per
    request (module docstring); of :func:`~orbitflow.plan.cost_model.preemptive_stalls` with ``preemptive``.
    Returns the per-layer stalls, or None once the step is known to take longer than ``abort_above`` seconds."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    c = np.ascontiguousarray(comp, dtype=np.float64)
    x = np.ascontiguousarray(xfer, dtype=np.float64)
    if x.size != len(hosts):
        raise ValueError(f"xfer has {x.size} entries for {len(hosts)} requests")
    lens = [len(h) for h in hosts]
    ptr = np.zeros(len(hosts) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum(lens)
    lay = np.fromiter((int(i) for h in hosts for i in h), dtype=np.int64, count=int(ptr[-1]))
    n_req, n_layers = len(hosts), c.size
    stall = np.empty(n_layers)
    total = _link(bool(preemptive), c, tail(c), ptr, lay, np.arange(n_req, dtype=np.int64), x, np.int64(slots),
                  float(abort_above), np.empty(n_req, np.int64), np.empty(n_req, np.int64), np.empty(n_layers),
                  np.empty(lay.size + 1), stall, float(host_layer_s))
    return None if total < 0 else stall


@_jit
def segments_added(host, comp, tails, xfer, segs, slots, host_layer_s, preemptive, out):
    """What the host mask ``host`` (uint8 ``[R, L]``) adds to the compute of each window segment ``segs[j]``
    (:func:`_link` on its row of ``comp``, ``tails`` and ``xfer``, the horizon's ``rows``) into ``out[j]``: the
    mask's host layers gathered once for every segment."""
    n_req, n_layers = host.shape
    ptr = np.zeros(n_req + 1, np.int64)
    for r in range(n_req):
        ptr[r + 1] = ptr[r]
        for layer in range(n_layers):
            ptr[r + 1] += host[r, layer] != 0
    lay = np.empty(ptr[n_req], np.int64)
    for r in range(n_req):
        j = ptr[r]
        for layer in range(n_layers):
            if host[r, layer]:
                lay[j] = layer
                j += 1
    rows, nxt, cur = np.arange(n_req), np.empty(n_req, np.int64), np.empty(n_req, np.int64)
    fin, arr, stall = np.empty(n_layers), np.empty(lay.size + 1), np.empty(n_layers)
    for j in range(segs.size):
        i = segs[j]
        out[j] = _link(preemptive, comp[i], tails[i], ptr, lay, rows, xfer[i], slots, math.inf, nxt, cur, fin, arr,
                       stall, host_layer_s)


# ==== the search's set-up ===================================================================================
@_jit
def suffix_tables(order, bcap, b0, x0, n_layers, share):
    """The branch and bound's per-depth tables of the requests not assigned yet (``BranchAndBound._init_bound_tables``
    in NumPy, and :func:`orbitflow.plan.bounds.cover_tables`), in one call: ``rest_b``, ``rest_b0`` (their blocks at
    the capacity step and now), ``ratio_suffix`` (their least ``b0 / bcap``), ``rest_grow`` (their blocks that grow
    by the capacity step, ``sum max(bcap - b0, 0)``), ``dp_depth`` (where they hold at most
    ``share`` of the batch's blocks) and the cover tables ``(cap, cost, rate, size)``. The same floats as the
    reference (block counts are integers; the cover's sums run in the same order); tests/plan/test_compiled.py
    checks it."""
    n_req = order.size
    rest_b = np.zeros(n_req + 1)
    rest_b0 = np.zeros(n_req + 1)
    ratio_suffix = np.ones(n_req + 1)
    rest_grow = np.zeros(n_req + 1)
    for i in range(n_req - 1, -1, -1):
        r = order[i]
        rest_b[i] = rest_b[i + 1] + bcap[r]  # the sentinel 0.0 adds nothing
        rest_b0[i] = rest_b0[i + 1] + b0[r]
        rest_grow[i] = rest_grow[i + 1] + max(bcap[r] - b0[r], 0.0)
        ratio = b0[r] / max(bcap[r], 1e-300) if bcap[r] > 0 else 1.0
        ratio_suffix[i] = min(ratio_suffix[i + 1], ratio) if i < n_req - 1 else ratio  # not the sentinel 1.0
    dp_depth = np.empty(n_req, np.bool_)
    for i in range(n_req):
        dp_depth[i] = rest_b0[i + 1] <= share * rest_b0[0]
    # the cover: requests by cost per block (stable, so ties stay in search order); each suffix keeps that order
    rate_of = np.empty(n_req)
    for i in range(n_req):
        r = order[i]
        rate_of[i] = x0[r] / bcap[r] if bcap[r] > 0 else math.inf
    by_rate = np.argsort(rate_of, kind="mergesort")
    cap = np.zeros((n_req + 1, n_req + 1))
    cost = np.zeros((n_req + 1, n_req + 1))
    rate = np.zeros((n_req + 1, max(n_req, 1)))
    size = np.zeros(n_req + 1, np.int64)
    for e in range(n_req + 1):
        j = 0
        for i in by_rate:
            r = order[i]
            if i < e or not bcap[r] > 0:
                continue
            rate[e, j] = x0[r] / bcap[r]
            cap[e, j + 1] = cap[e, j] + bcap[r] * n_layers
            cost[e, j + 1] = cost[e, j] + x0[r] * n_layers
            j += 1
        size[e] = j
    return rest_b, rest_b0, ratio_suffix, rest_grow, dp_depth, cap, cost, rate, size


# ==== branch and bound ======================================================================================
# integer state (ist)
# GAINED: a leaf after the first dive became the incumbent (the search still improves on its first dive's plan);
# PREFIX: the search covers only the subtree of the first PREFIX candidates in ``choice`` (one task of a parallel
# search, BranchAndBound._search_parallel; 0: the whole tree)
(DEPTH, PHASE, NODES, LEAVES, DONE, HIT, DIVE_START, CHUNK_STOP, TIMED_OUT, FIRST_ONLY, NODE_LIMIT, GAINED,
 PREFIX) = range(13)
N_IST = 13
# float state (fst); deadlines on the kernels' clock (kernel_deadline), inf: none. DEADLINE: where the search stops
# and hands the rest to the local improvement; LATE_DEADLINE: where it stops instead once it has GAINED
BEST_LAT, BEST_MOVED, OPEN_LB, KNOWN_PASS, KNOWN_FAIL, GAP, DEADLINE, LATE_DEADLINE = range(8)
N_FST = 8
# _dp_children's first try at the propagated bound (at the hinted release layers): skipped at a depth while under this
# share of the children it tries there are pruned by it (a moving average, weight HINT_AVERAGE per child), but for
# one child in HINT_PROBE. It costs about a tenth of the full bound, which it spares the children it prunes.
HINT_MIN_RATE, HINT_AVERAGE, HINT_PROBE = 0.1, 1 / 32, 16.0
# phases and return codes
ENTER, LOOP = 0, 1
FINISHED, PAUSED = 0, 2


@_jit
def _better(lat, moved, best_lat, best_moved):
    """Jitted twin of :func:`orbitflow.plan.types.better` (numba cannot call the Python one)."""
    tol = REL_TOL * max(abs(best_lat), 1.0) if math.isfinite(best_lat) else 0.0
    if lat < best_lat - tol:
        return True
    if lat <= best_lat + tol:
        return moved < best_moved - 1e-9
    return False


@_jit
def _prunable(lb, moved_lb, best_lat, best_moved, gap):
    if not math.isfinite(best_lat):
        return False
    if gap > 0:
        return lb >= best_lat * (1 - gap)
    tol = REL_TOL * max(abs(best_lat), 1.0)
    if lb > best_lat + tol:
        return True
    if lb >= best_lat - tol:
        return moved_lb >= best_moved - 1e-9
    return False


@_jit
def _beyond(lb, best_lat, gap):
    """Whether a child whose latency bound is ``lb`` is pruned whatever else is known of it: above the incumbent by
    more than the tie tolerance (``gap > 0``: within the gap of it), so that its moved blocks do not matter and
    an incumbent that only improves keeps it pruned."""
    if not math.isfinite(best_lat):
        return False
    if gap > 0:
        return lb >= best_lat * (1 - gap)
    return lb > best_lat + REL_TOL * max(abs(best_lat), 1.0)


@_jit
def _lat_ok(lb, fst, slo_on, dep, slo, alpha, d_lo, d_hi):
    """Jitted twin of the planner's SLO prefilter (``Constraints.lat_prefilter`` over
    :func:`orbitflow.plan.deposit.constant_latency_violations`), memoised in ``fst``; tests/plan/test_compiled.py
    checks that they agree."""
    if not slo_on:
        return True
    if lb <= fst[KNOWN_PASS]:
        return True
    if lb >= fst[KNOWN_FAIL]:
        return False
    passed = False
    for d in range(d_lo, d_hi + 1):
        viol = 0.0
        for r in range(slo.size):
            delta = 1.0 - lb / slo[r]
            if delta < 0:
                safe = np.floor(dep[r] / -delta + 1e-9)
                viol += max(d - safe, 0.0)
        if viol <= alpha * d + 1e-9:
            passed = True
            break
    if passed:
        fst[KNOWN_PASS] = lb
    else:
        fst[KNOWN_FAIL] = lb
    return passed


@_jit
def _cover_cost(y, cover, e):
    """Jitted twin of :func:`orbitflow.plan.bounds.cover_cost` for one ``y`` (``cover``: its tables as a tuple)."""
    cov_cap, cov_cost, cov_rate, cov_size = cover
    if y <= 0:
        return 0.0
    n = cov_size[e]
    j = 0
    while j < n and cov_cap[e, j + 1] < y:
        j += 1
    if j >= n:
        return cov_cost[e, n]
    return cov_cost[e, j] + (y - cov_cap[e, j]) * cov_rate[e, j]


@_jit
def _unwind(depth, pos, nk, ordk, alive, lat_lb, fst, prefix, choice):
    """Budget spent: the least bound of the children left unexplored at every open level (above ``prefix``, the
    fixed candidates' only: the others are other tasks')."""
    for d in range(depth, -1, -1):
        for i in range(pos[d], nk[d]):
            k = ordk[d, i]
            if d < prefix and k != choice[d]:
                continue
            if alive[d, k] and lat_lb[d, k] < fst[OPEN_LB]:
                fst[OPEN_LB] = lat_lb[d, k]


@_jit
def _budget_spent(ist, fst, clock, n_req):
    """``BranchAndBound._out_of_budget``: never during the first dive; the deadline read from the clock (the late
    one once the search has GAINED)."""
    if ist[FIRST_ONLY] or ist[NODES] - ist[DIVE_START] > n_req + 1:
        if fst[DEADLINE] < math.inf and _now(clock) > (fst[LATE_DEADLINE] if ist[GAINED] else fst[DEADLINE]):
            ist[TIMED_OUT] = 1
        if (ist[NODE_LIMIT] >= 0 and ist[NODES] > ist[NODE_LIMIT]) or ist[TIMED_OUT]:
            ist[HIT] = 1
            ist[DONE] = 1
    return ist[DONE] != 0


@_jit
def _expand(d, r, n_kids, res, buf, vol, after, chain_lb, moved, sep, v,
            lat_lb, alive, kid_moved, ordk, fst,
            counts, hosts_f, cumh, pairs_after, mats, sep_n, sep_slope, sep_icept, sep_off, chain,
            bcap, b0, x0, rest_b, rest_b0, ratio_suffix, rest_grow, suffix_comp, comp0, comp_total, comp_min, link, cap,
            use_dp, f_scratch, cover, lat_key, order, least, least_cum, slack, w_scratch, dp_hint, rates,
            tail_codes, root_probe):
    """Bounds of the children of the node at depth ``d`` (``BranchAndBound._node``), ordered by ``lat_key`` (at the
    root by ``root_probe`` first: :func:`root_probes`); with ``use_dp`` also the propagated bound (and where it pays,
    the tail bound on it: :func:`_dp_children`)."""
    # NOTE: kept whole: the jitted twin of BranchAndBound._capacity_cut + _bound_children as one loop over the
    # children, without the temporaries NumPy would make; tests/plan/test_compiled.py checks they agree.
    n_layers = comp0.size
    n_tiles = sep_off.size
    n_pieces = sep_slope.shape[1]
    bc = bcap[r]
    rest = rest_b[d + 1]
    x = x0[r]
    rb0 = rest_b0[d + 1]
    rs = ratio_suffix[d + 1]
    grow = rest_grow[d + 1]
    n_cand = counts.size
    any_alive = False
    for k in range(n_kids):
        new_res = res[d] + bc * (n_layers - counts[k])
        bmax = -math.inf
        bsum = 0.0
        for layer in range(n_layers):
            nb = buf[d, layer] + bc * hosts_f[k, layer]
            bsum += nb
            if nb > bmax:
                bmax = nb
        bmean = bsum / n_layers
        alive[d, k] = new_res + bmax + rest <= cap
        any_alive = any_alive or alive[d, k]
        slack[0, k] = cap - new_res - bmax - rest
        rhs = new_res + rest * n_layers - cap
        y1 = rhs + bmax
        if n_layers > 1:
            y2 = (rhs + bmean) / (1 - 1 / n_layers)
            ymin = y1 if y1 / n_layers <= bmax - bmean else y2
        else:
            ymin = y1
        ymin = max(ymin, 0.0)
        slack[1, k] = ymin
        lat = -math.inf
        for layer in range(n_layers):
            new_after = after[d, layer] + x * pairs_after[k, layer]
            val = (vol[d, layer] + x * cumh[k, layer]) + suffix_comp[layer] + new_after
            if val > lat:
                lat = val
        vol_last = vol[d, n_layers - 1] + x * cumh[k, n_layers - 1]
        forced = vol_last + ymin * (rs / link)  # the order's key (BranchAndBound._bound_children)
        key = max(lat, forced + comp_min if forced > 0 else 0.0)
        forced = vol_last + _cover_cost(ymin, cover, d + 1)
        lat = max(lat, forced + comp_min if forced > 0 else 0.0)
        kid_chain = max(comp_total + chain[r, k], chain_lb[d])
        kid_moved[d, k] = moved[d] + b0[r] * counts[k]
        cheap = max(lat, kid_chain)
        if not alive[d, k] or _beyond(cheap, fst[BEST_LAT], fst[GAP]):
            lat_lb[d, k] = cheap  # never visited: the separable bound would only raise it
            lat_key[d, k] = max(key, kid_chain)
            continue
        sep_lb = -math.inf
        u = min(ymin * rs / rb0, n_layers) if rb0 > 0 else 0.0
        u_cap = min(ymin / rest, n_layers) if rest > 0 else 0.0
        for j in range(n_tiles):
            val = sep_off[j] + (sep[d, j] + x * sep_n[j, k])
            if rb0 > 0:
                phi = -math.inf
                phi_cap = -math.inf
                for p in range(n_pieces):
                    q = sep_slope[j, p] * u + sep_icept[j, p]
                    if q > phi:
                        phi = q
                    q = sep_slope[j, p] * u_cap + sep_icept[j, p]
                    if q > phi_cap:
                        phi_cap = q
                cost = (rb0 / link) * phi
                if rest > 0:  # the same bound weighted by the blocks at the capacity step, less what grows by then
                    cost = max(cost, (rest * phi_cap - grow * sep_n[j, n_cand - 1]) / link)
                val = val + cost
            if val > sep_lb:
                sep_lb = val
        lat_lb[d, k] = max(cheap, sep_lb)
        lat_key[d, k] = max(max(key, kid_chain), sep_lb)
    if use_dp and any_alive:  # the propagated bound (bounds.dp_bound) for the children that survive so far; where
        # none fits, the reference does not get this far (BranchAndBound._node), nor count a node for the tail bound
        _dp_children(d, n_kids, x, v, mats, least, cumh, least_cum, order, bcap, x0, slack, alive, lat_lb, lat_key,
                     kid_moved, fst, comp0, counts, f_scratch, w_scratch, dp_hint, rates, tail_codes)
    # stable order by (root probe at d = 0, key, offload count); counts increase with k
    for i in range(n_kids):
        ordk[d, i] = i
    for i in range(1, n_kids):
        k = ordk[d, i]
        j = i - 1
        while j >= 0 and _after(d, ordk[d, j], k, lat_key, root_probe):
            ordk[d, j + 1] = ordk[d, j]
            j -= 1
        ordk[d, j + 1] = k


@_jit
def _after(d, a, b, lat_key, root_probe):
    """Whether child ``a`` of depth ``d`` is visited after child ``b``: by root probe (depth 0), then by key."""
    if d == 0 and root_probe[a] != root_probe[b]:
        return root_probe[a] > root_probe[b]
    return lat_key[d, a] > lat_key[d, b]


@_jit
def _least_candidate(bc, slack_k, counts, n_layers):
    """The first candidate a request of ``bc`` blocks per layer can fit with, given a child's spare capacity
    ``slack_k`` (``BranchAndBound._least_candidates``)."""
    lim = slack_k + bc + 1e-6
    kmin = 0
    while kmin < counts.size - 1 and bc * (n_layers - counts[kmin]) > lim:
        kmin += 1
    return kmin


@_jit
def _least_terms(d, order, bcap, x0, slack_k, counts, n_layers, coef, terms_k, terms_c):
    """The least host layers of each request not assigned at depth ``d`` (``BranchAndBound._least_offload``: those
    common to every candidate it can still fit with, ``slack_k`` the child's spare capacity with the unassigned
    requests fully offloaded), as terms: the candidates ``terms_k`` (increasing) whose least layers some request
    must offload, ``terms_c`` the transfer seconds of those requests summed (``coef``: scratch of K), so the matrices
    are added once per candidate, not once per request. Returns the number of terms (0: none must offload)."""
    coef[:] = 0.0
    for e in range(d + 1, order.size):
        q = order[e]
        kmin = _least_candidate(bcap[q], slack_k, counts, n_layers)
        if kmin > 0:
            coef[kmin] += x0[q]
    n_terms = 0
    for kmin in range(1, counts.size):
        if coef[kmin] != 0.0:
            terms_k[n_terms] = kmin
            terms_c[n_terms] = coef[kmin]
            n_terms += 1
    return n_terms


@_jit
def _least_into(w, d, k, x, v, mats, least, terms_k, terms_c, n_terms):
    """Child ``k``'s transfer-count matrix plus the least host layers of the unassigned requests (:func:`_least_terms`)
    into ``w``, the entries the propagated bound reads only. Matrices are transposed (``[layer, row]`` of
    :func:`orbitflow.plan.bounds.count_matrix`, row ``<= layer`` only): the bound's inner loop runs along a row of
    them."""
    n_layers = w.shape[0]
    for layer in range(n_layers):
        for i in range(layer + 1):
            w[layer, i] = v[d, layer, i] + x * mats[k, layer, i]
    for t in range(n_terms):
        c = terms_c[t]
        kmin = terms_k[t]
        for layer in range(n_layers):
            for i in range(layer + 1):
                w[layer, i] = w[layer, i] + c * least[kmin, layer, i]


@_jit
def _count(cum, layer, m):
    """Entry ``[m + 1, layer]`` of :func:`orbitflow.plan.bounds.count_matrix` (``m = -1``: row 0) from the host
    row's running count ``cum`` (host layers among ``0..l``): row 0 counts the host layers ``<= layer``, row ``m + 1``
    those in ``m..layer``, less one."""
    if m < 0:
        return cum[layer]
    return max(cum[layer] - (cum[m - 1] if m > 0 else 0.0) - 1.0, 0.0)


_critical_windows = _jit(bounds.critical_windows)  # the reference's own scalar code, compiled: the same floats
_tail_cover = _jit(bounds.tail_cover)


@_jit
def _dp_hinted(k, x, gv, cumh, least_cum, terms_k, terms_c, n_terms, hint, comp0, f):
    """The propagated bound with the max over release layers ``m`` taken at one ``m`` per layer only: ``hint``, the
    ``m`` that gave the max in the last full evaluation (-1: none). A max over fewer terms is no larger, so this is
    still a lower bound, at O(L) instead of O(L^2): where it prunes, the full bound would too. ``gv``: the node's
    matrix ``v`` at row 0 and at the hinted row of each layer. The entries are those :func:`_least_into` builds, the
    same floats, with the child's and the least layers' transfer counts taken from their running host counts
    (``cumh``, ``least_cum``: host layers among ``0..l``) instead of read from the matrices."""
    n_layers = comp0.size
    for layer in range(n_layers):
        s = f[layer - 1] if layer > 0 else -math.inf
        for j in range(2):  # row 0 (the transfers released at t=0), then the hinted row
            m = -1 if j == 0 else hint[layer]
            if j == 1 and not 0 <= m < layer:
                continue
            val = gv[j, layer] + x * _count(cumh[k], layer, m)
            for t in range(n_terms):
                val = val + terms_c[t] * _count(least_cum[terms_k[t]], layer, m)
            q = val if m < 0 else f[m] + val
            if q > s:
                s = q
        f[layer] = s + comp0[layer]
    return f[n_layers - 1]


@_jit
def _dp_children(d, n_kids, x, v, mats, least, cumh, least_cum, order, bcap, x0, slack, alive, lat_lb, lat_key,
                 kid_moved, fst, comp0, counts, f, w, hint, rates, codes):
    """The propagated bound (:func:`orbitflow.plan.bounds.dp_bound`) of each child still alive and not pruned, the
    unassigned requests at their least host layers (:func:`_least_terms`); raises ``lat_lb`` and ``lat_key``.
    ``slack``: per child, the spare capacity with the unassigned requests fully offloaded and the blocks they must
    offload (rows 0, 1); row 2 and ``codes`` (per child, ``dp_bound``'s codes) are the tail bound's scratch.

    Each child first gets the bound at the hinted release layers only (:func:`_dp_hinted`: per layer the ``m`` that
    gave the max in the last full evaluation, which siblings and cousins mostly share). A child that bound puts above
    the incumbent by more than the tie tolerance is pruned, as the full bound would prune it; the others get the full
    bound, whose maximising ``m`` become the hint. So the search visits the same children in the same order; a pruned
    child may keep the smaller (hinted) bound, which sits above the incumbent all the same, so the gap a cut search
    certifies is the same too. Where the first try seldom prunes (a search whose leaves the bounds cannot cut: every
    child survives), it is only overhead, so it is skipped at a depth while its share of prunes there is below
    :data:`HINT_MIN_RATE`, but for one try in :data:`HINT_PROBE`: ``rates[d, :2]`` holds that share (a moving
    average) and the children since the last try. Then, where it pays (:func:`_tail_at`), the tail bound of the
    children the full bound leaves within reach of the incumbent (:func:`_tail_children`)."""
    n_layers = comp0.size
    n_cand = counts.size
    coef = np.empty(n_cand)
    terms_k = np.empty(n_cand, np.int64)
    terms_c = np.empty(n_cand)
    best = fst[BEST_LAT]
    gv = np.empty((2, n_layers))  # this node's v at row 0 and at the hinted row of each layer, once a child needs it
    have_gv = False
    tail = _tail_at(d, order.size, rates)
    reach = slack[2]  # per child: its bound where it leaves the child within reach (-inf: not), for the tail bound
    if tail:
        reach[:n_kids] = -math.inf
    for k in range(n_kids):
        if not alive[d, k] or _prunable(lat_lb[d, k], kid_moved[d, k], fst[BEST_LAT], fst[BEST_MOVED], fst[GAP]):
            continue
        n_terms = _least_terms(d, order, bcap, x0, slack[0, k], counts, n_layers, coef, terms_k, terms_c)
        t = -math.inf
        tried = math.isfinite(best) and (rates[d, 0] >= HINT_MIN_RATE or rates[d, 1] >= HINT_PROBE)
        if tried:
            if not have_gv:
                for layer in range(n_layers):
                    gv[0, layer] = v[d, layer, 0]
                    gv[1, layer] = v[d, layer, hint[layer] + 1] if 0 <= hint[layer] < layer else 0.0
                have_gv = True
            t = _dp_hinted(k, x, gv, cumh, least_cum, terms_k, terms_c, n_terms, hint, comp0, f)
            rates[d, 0] += HINT_AVERAGE * ((1.0 if _beyond(t, best, 0.0) else 0.0) - rates[d, 0])
            rates[d, 1] = 0.0
        else:
            rates[d, 1] += 1.0
        if not _beyond(t, best, 0.0):  # not above the incumbent by more than the tie tolerance: the full bound
            use_w = n_terms > 0
            if use_w:
                _least_into(w, d, k, x, v, mats, least, terms_k, terms_c, n_terms)
            t = _dp_full(d, k, x, v, mats, w, use_w, comp0, f, hint, gv, tried, codes, k if tail else 0, tail)
            if tail and not _beyond(t, best, 0.0):
                reach[k] = t
        if t > lat_lb[d, k]:
            lat_lb[d, k] = t
        if t > lat_key[d, k]:
            lat_key[d, k] = t
    if tail:  # a loop apart: the call inside the loop above slowed every node, tail or not (measured at (8, 32))
        _tail_children(d, n_kids, reach, codes, slack, order, bcap, x0, counts, cumh, least_cum, best, rates, lat_lb,
                       lat_key)


@_jit
def _tail_children(d, n_kids, reach, codes, slack, order, bcap, x0, counts, cumh, least_cum, best, rates, lat_lb,
                   lat_key):
    """The tail bound (:func:`_tail_bound`) of each child whose propagated bound ``reach[k]`` left it within reach of
    the incumbent (-inf: not), on that bound's ``codes[k]``; raises ``lat_lb`` and ``lat_key``, and keeps the share
    of these children it prunes at depth ``d`` (``rates[d, 2]``, :func:`_tail_at`)."""
    for k in range(n_kids):
        if reach[k] == -math.inf:
            continue
        t = reach[k] + _tail_bound(d, codes[k], slack[0, k], slack[1, k], order, bcap, x0, counts, cumh, least_cum)
        rates[d, 2] += bounds.TAIL_AVERAGE * ((1.0 if _beyond(t, best, 0.0) else 0.0) - rates[d, 2])
        if t > lat_lb[d, k]:
            lat_lb[d, k] = t
        if t > lat_key[d, k]:
            lat_key[d, k] = t


@_jit
def _tail_at(d, n_req, rates):
    """Whether the children of a node at depth ``d`` get the tail bound (``BranchAndBound._tail_at``, to the float, as
    it changes the search): where at least :data:`orbitflow.plan.bounds.TAIL_MIN` requests are unassigned after them,
    unless the share of the children it prunes at that depth (``rates[d, 2]``, a moving average) is under
    ``TAIL_MIN_RATE``; then the node after ``TAIL_PROBE`` without it still gets it (``rates[d, 3]``: those nodes)."""
    if n_req - 1 - d < bounds.TAIL_MIN:
        return False
    if rates[d, 2] < bounds.TAIL_MIN_RATE and rates[d, 3] < bounds.TAIL_PROBE:
        rates[d, 3] += 1.0
        return False
    rates[d, 3] = 0.0
    return True


@_jit
def _tail_bound(d, codes, slack_k, ymin, order, bcap, x0, counts, cumh, least_cum):
    """What the requests unassigned at depth ``d`` add at least to a child's propagated bound, on its critical path
    (``codes``, :func:`orbitflow.plan.bounds.critical_windows`): each at its candidates that can fit (``slack_k``),
    priced by their transfers in the path's windows beyond its least host layers, the least way to free ``ymin``
    blocks together (:func:`orbitflow.plan.bounds.tail_cover`). The twin of ``BranchAndBound._tail_bound``."""
    n_cand = counts.size
    n_layers = codes.size
    n_tail = order.size - 1 - d
    ms = np.empty(n_layers, np.int64)
    ls = np.empty(n_layers, np.int64)
    n_path = np.empty(n_cand)
    a = np.empty((n_tail, n_cand))
    c = np.empty((n_tail, n_cand))
    lo = np.empty(n_tail, np.int64)
    n = _critical_windows(codes, ms, ls)
    first = n_cand
    for j in range(lo.size):
        lo[j] = _least_candidate(bcap[order[d + 1 + j]], slack_k, counts, n_layers)
        first = min(first, lo[j])
    for kk in range(first, n_cand):  # no request reads the candidates before its first
        n_path[kk] = 0.0
        for i in range(n):
            n_path[kk] += _count(cumh[kk], ls[i], ms[i])
    for j in range(lo.size):
        q = order[d + 1 + j]
        base = 0.0
        for i in range(n):
            base += _count(least_cum[lo[j]], ls[i], ms[i])
        for kk in range(lo[j], n_cand):
            a[j, kk] = bcap[q] * counts[kk]
            c[j, kk] = x0[q] * (n_path[kk] - base)
    return _tail_cover(a, c, lo, ymin, np.empty(a.size), np.empty(a.size))


@_jit
def _dp_full(d, k, x, v, mats, w, use_w, comp0, f, hint, gv, record, codes, row, track):
    """The propagated bound of child ``k`` (:func:`orbitflow.plan.bounds.dp_bound`) over ``w`` (``use_w``: built by
    :func:`_least_into`) or else the node's ``v`` plus the child's own matrix. ``record`` (the child had the hinted
    try, so ``gv`` is built): also keep the maximising release layer of each layer as the hint, and ``gv`` in step;
    ``track``: also write the bound's codes (``dp_bound``'s) into ``codes[row]``. The loop without either is kept
    apart, as the bookkeeping in the inner loop would slow the depths where neither is wanted."""
    n_layers = comp0.size
    f[0] = (w[0, 0] if use_w else v[d, 0, 0] + x * mats[k, 0, 0]) + comp0[0]
    if track:
        codes[row, 0] = bounds.FROM_START
    for layer in range(1, n_layers):
        prev = f[layer - 1]
        start = w[layer, 0] if use_w else v[d, layer, 0] + x * mats[k, layer, 0]
        s = max(prev, start)
        cand = -math.inf
        if record or track:
            arg = 0
            for m in range(layer):
                q = f[m] + (w[layer, m + 1] if use_w else v[d, layer, m + 1] + x * mats[k, layer, m + 1])
                if q > cand:
                    cand = q
                    arg = m
            if record:
                hint[layer] = arg
                gv[1, layer] = v[d, layer, arg + 1]
            if track:
                codes[row, layer] = bounds.CONTINUE if prev >= max(start, cand) else (
                    bounds.FROM_START if start >= cand else arg)
        else:
            for m in range(layer):
                q = f[m] + (w[layer, m + 1] if use_w else v[d, layer, m + 1] + x * mats[k, layer, m + 1])
                if q > cand:
                    cand = q
        f[layer] = max(s, cand) + comp0[layer]
    return f[n_layers - 1]


@_jit
def bb_search(ist, fst, order, same_as_prev, choice, pos, nk, ordk, lat_lb, alive, kid_moved,
              res, buf, vol, after, chain_lb, moved, sep, v,
              counts, hosts_f, cumh, pairs_after, mats, sep_n, sep_slope, sep_icept, sep_off, chain,
              bcap, b0, x0, rest_b, rest_b0, ratio_suffix, rest_grow, suffix_comp, comp0, comp_total, comp_min, link,
              cap, slo_on, dep, slo, alpha, d_lo, d_hi,
              tail, lay_ptr, lay, k_of, e_nxt, e_cur, e_fin, e_arr, e_stall, f_scratch, feas, best_k, cover, lat_key,
              dp_depth, least, least_cum, slack, w_scratch, dp_hint, rates, tail_codes, root_probe, clock):
    """Depth-first branch and bound over per-request candidates (``BranchAndBound._node`` as a loop over an
    explicit stack, so it can stop and resume).

    A leaf that beats the incumbent at step 0 and passes the window rule (:func:`leaf_feasible`, the data in
    ``feas``: :func:`feasibility_data`) becomes the incumbent (``fst[BEST_*]``, its candidates in ``best_k``).
    Stops at ``fst[DEADLINE]`` (read from the clock at every node; ``fst[LATE_DEADLINE]`` once a leaf after the
    first dive became the incumbent, ``ist[GAINED]``) like at the node limit; returns ``PAUSED`` when
    ``ist[NODES]`` reaches ``ist[CHUNK_STOP]`` (without a clock: the caller checks its deadline, sets
    ``ist[TIMED_OUT]`` and resumes), or ``FINISHED``. One function, kept whole: its state is the stack.
    """
    # NOTE: kept whole: a depth-first loop over an explicit stack (ist/fst and the per-depth arrays) that
    # returns to Python at a leaf or a deadline check and resumes where it stopped; calls cannot do that.
    n_req = order.size
    n_cand = counts.size
    n_layers = comp0.size
    while True:
        d = ist[DEPTH]
        phase = ist[PHASE]
        if phase == ENTER:
            if ist[NODES] >= ist[CHUNK_STOP]:
                return PAUSED
            ist[NODES] += 1
            if _budget_spent(ist, fst, clock, n_req):
                _unwind(d - 1, pos, nk, ordk, alive, lat_lb, fst, ist[PREFIX], choice)
                return FINISHED
            n_kids = choice[d - 1] + 1 if same_as_prev[d] else n_cand
            nk[d] = n_kids
            # BranchAndBound._propagate_at: not above the last request during the first dive
            use_dp = d == n_req - 1 or (dp_depth[d] and ist[NODES] - ist[DIVE_START] > n_req + 1)
            _expand(d, order[d], n_kids, res, buf, vol, after, chain_lb, moved, sep, v,
                    lat_lb, alive, kid_moved, ordk, fst,
                    counts, hosts_f, cumh, pairs_after, mats, sep_n, sep_slope, sep_icept, sep_off, chain,
                    bcap, b0, x0, rest_b, rest_b0, ratio_suffix, rest_grow, suffix_comp, comp0, comp_total, comp_min,
                    link, cap, use_dp, f_scratch, cover, lat_key, order, least, least_cum, slack, w_scratch, dp_hint,
                    rates, tail_codes, root_probe)
            pos[d] = 0
            ist[PHASE] = LOOP
            continue
        descended = False
        i = pos[d]
        while i < nk[d]:
            k = ordk[d, i]
            lb = lat_lb[d, k]
            if d < ist[PREFIX] and k != choice[d]:  # another task's subtree
                i += 1
                continue
            if (not alive[d, k] or _prunable(lb, kid_moved[d, k], fst[BEST_LAT], fst[BEST_MOVED], fst[GAP])
                    or not _lat_ok(lb, fst, slo_on, dep, slo, alpha, d_lo, d_hi)):
                i += 1
                continue
            choice[d] = k
            pos[d] = i
            r = order[d]
            if d == n_req - 1:  # a leaf: the exact schedule, stopped once slower than the incumbent
                if ist[NODES] >= ist[CHUNK_STOP]:
                    return PAUSED
                ist[LEAVES] += 1
                ist[NODES] += 1
                for dd in range(n_req):
                    k_of[order[dd]] = choice[dd]
                mv = 0.0
                for q in range(n_req):
                    mv += b0[q] * counts[k_of[q]]
                best = fst[BEST_LAT]
                cut = best + 2 * REL_TOL * max(abs(best), 1.0) if math.isfinite(best) else math.inf
                st = _link(feas[6][4] == 1, comp0, tail, lay_ptr, lay, k_of, x0, 1, cut, e_nxt, e_cur, e_fin, e_arr,
                           e_stall, feas[5][3])
                if st >= 0:
                    lat0 = comp_total + st
                    if _better(lat0, mv, fst[BEST_LAT], fst[BEST_MOVED]) and leaf_feasible(k_of, lat0, lb, feas):
                        fst[BEST_LAT] = lat0
                        fst[BEST_MOVED] = mv
                        best_k[:] = k_of
                        if ist[NODES] - ist[DIVE_START] > n_req + 1:
                            ist[GAINED] = 1
                        if ist[FIRST_ONLY]:
                            ist[DONE] = 1
                if _budget_spent(ist, fst, clock, n_req):
                    _unwind(d, pos, nk, ordk, alive, lat_lb, fst, ist[PREFIX], choice)
                    return FINISHED
                i += 1
                continue
            # descend: the child's accumulators (same operations as the reference)
            bc = bcap[r]
            x = x0[r]
            e = d + 1
            res[e] = res[d] + bc * (n_layers - counts[k])
            for layer in range(n_layers):
                buf[e, layer] = buf[d, layer] + bc * hosts_f[k, layer]
                vol[e, layer] = vol[d, layer] + x * cumh[k, layer]
                after[e, layer] = after[d, layer] + x * pairs_after[k, layer]
            chain_lb[e] = max(comp_total + chain[r, k], chain_lb[d])
            moved[e] = kid_moved[d, k]
            for j in range(sep_off.size):
                sep[e, j] = sep[d, j] + x * sep_n[j, k]
            for layer in range(n_layers):  # transposed, the entries the propagated bound reads (_least_into)
                for m in range(layer + 1):
                    v[e, layer, m] = v[d, layer, m] + x * mats[k, layer, m]
            ist[DEPTH] = e
            ist[PHASE] = ENTER
            descended = True
            break
        if descended:
            continue
        pos[d] = nk[d]
        if d == 0:
            return FINISHED
        ist[DEPTH] = d - 1
        pos[d - 1] += 1


# ==== whole searches in one call ===========================================================================
# the link's schedule, for search_order's symmetry rule (BranchAndBound._interchangeable)
EDF_LINK, PREEMPTIVE_LINK, OTHER_LINK = 0, 1, 2


@_jit
def _same_signature(a, b, blocks, dep, slo):
    """Whether requests ``a`` and ``b`` have the same blocks at every step, Token-Deposit balance and SLO."""
    for s in range(blocks.shape[0]):
        if blocks[s, a] != blocks[s, b]:
            return False
    return dep[a] == dep[b] and slo[a] == slo[b]


@_jit
def _before(a, b, bcap, b0, blocks, dep, slo):
    """Whether request ``a`` comes before ``b`` in the search order: larger at the capacity step, then now, then by
    signature (blocks per step, balance, SLO), then index (``BranchAndBound._init_order``'s sort key)."""
    if bcap[a] != bcap[b]:
        return bcap[a] > bcap[b]
    if b0[a] != b0[b]:
        return b0[a] > b0[b]
    for s in range(blocks.shape[0]):
        if blocks[s, a] != blocks[s, b]:
            return blocks[s, a] < blocks[s, b]
    if dep[a] != dep[b]:
        return dep[a] < dep[b]
    if slo[a] != slo[b]:
        return slo[a] < slo[b]
    return a < b


@_jit
def search_order(bcap, b0, blocks, dep, slo, link_kind):
    """The branch and bound's request order and its symmetry rule (``BranchAndBound._init_order``, the same
    order): ``(order, same_as_prev)``; ``blocks`` is the horizon's ``[S, R]`` block counts, ``link_kind`` one of
    ``EDF_LINK``, ``PREEMPTIVE_LINK``, ``OTHER_LINK``."""
    n_req = b0.size
    order = np.arange(n_req)
    for i in range(1, n_req):  # insertion sort: a strict total order (the index breaks every tie)
        r = order[i]
        j = i - 1
        while j >= 0 and _before(r, order[j], bcap, b0, blocks, dep, slo):
            order[j + 1] = order[j]
            j -= 1
        order[j + 1] = r
    same_as_prev = np.zeros(n_req, np.bool_)
    for d in range(1, n_req):
        i, j = order[d - 1], order[d]
        swappable = link_kind == PREEMPTIVE_LINK or (link_kind == EDF_LINK and j == i + 1)
        same_as_prev[d] = swappable and _same_signature(i, j, blocks, dep, slo)
    return order, same_as_prev


@_jit
def _block_sum(a, lo, n):
    """NumPy's sum of ``a[lo:lo + n]`` for ``n <= 128``: in order below 8, else eight partial sums."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r = np.empty(8)
    for j in range(8):
        r[j] = a[lo + j]
    i = 8
    while i < n - n % 8:
        for j in range(8):
            r[j] += a[lo + i + j]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@_jit
def _pairwise_sum(a, lo, n):
    """``a[lo:lo + n].sum()`` as NumPy sums a contiguous float64 row (pairwise: :func:`_block_sum` of blocks of up
    to 128, halves added above, left + right), so the search's tables hold the reference's floats
    (tests/plan/test_compiled.py checks it against NumPy). The halving runs on an explicit stack: numba's disk
    cache cannot hold a recursive function (a cached one crashed on load)."""
    if n <= 128:
        return _block_sum(a, lo, n)
    f_lo, f_n = np.empty(64, np.int64), np.empty(64, np.int64)
    f_stage, f_left = np.zeros(64, np.int64), np.empty(64)  # stage 1: its left half is being summed, 2: its right
    top = 0
    f_lo[0], f_n[0], f_stage[0] = lo, n, 0
    while True:
        if f_n[top] > 128:  # split: the left half first
            half = f_n[top] // 2
            half -= half % 8
            f_stage[top] = 1
            top += 1
            f_lo[top], f_n[top], f_stage[top] = f_lo[top - 1], half, 0
            continue
        v = _block_sum(a, f_lo[top], f_n[top])
        top -= 1
        while top >= 0 and f_stage[top] == 2:  # a right half done: its parent's sum
            v = f_left[top] + v
            top -= 1
        if top < 0:
            return v
        f_left[top] = v  # a left half done: the right half next
        f_stage[top] = 2
        half = f_n[top] // 2
        half -= half % 8
        top += 1
        f_lo[top], f_n[top], f_stage[top] = f_lo[top - 1] + half, f_n[top - 1] - half, 0


@_jit
def chain_bounds(x0, gaps):
    """``search.chain_bounds`` (per request and candidate, its transfers serialised with its compute), the same
    floats: ``max(x0[r] - gaps[k], 0)`` summed as NumPy sums it."""
    n_req, (n_cand, n_gap) = x0.size, gaps.shape
    out = np.empty((n_req, n_cand))
    row = np.empty(n_gap)
    for r in range(n_req):
        for k in range(n_cand):
            for g in range(n_gap):
                row[g] = max(x0[r] - gaps[k, g], 0.0)
            out[r, k] = _pairwise_sum(row, 0, n_gap)
    return out


@_jit
def first_better(ist, upper, gap, deadline, share, link_kind, cap, link, b0, bcap, x0, gaps, blocks, dep, slo,
                 slo_on, alpha, d_lo, d_hi, comp0, comp_total, comp_min, suffix_comp, sep_off,
                 counts, hosts_f, cumh, pairs_after, mats, sep_n, sep_slope, sep_icept, lay_ptr, lay, least_t,
                 least_cum, feas, clock, best_k):
    """``BranchAndBound(first_only=True).run()`` on the compiled path, in one call: whether some assignment beats
    ``upper`` at step 0 and is feasible (its candidates into ``best_k``). The same search: the order, the tables,
    the no-offload try, then :func:`bb_search`, from the same inputs (``x0``, the compute tables and their ``gaps``
    as the search computes them). ``ist`` (``N_IST``): in, ``ist[NODE_LIMIT]`` (-1: none); out, ``ist[NODES]`` and
    ``ist[LEAVES]`` counted as ``BranchAndBound`` counts them, ``ist[HIT]`` (the budget stopped it)."""
    n_layers = comp0.size
    order, same_as_prev = search_order(bcap, b0, blocks, dep, slo, link_kind)
    tables = suffix_tables(order, bcap, b0, x0, n_layers, share)
    chain = chain_bounds(x0, gaps)
    if not float(np.sum(bcap)) * n_layers > cap:  # BranchAndBound._try_no_offload: a leaf
        ist[NODES] += 1
        ist[LEAVES] += 1
        fst = np.array([upper, math.inf])
        best_k[:] = 0
        if try_assignment(best_k, 0.0, fst, b0, comp_total, x0, feas):
            return True
    leaves = ist[LEAVES]
    ist[LEAVES] = 0
    ist[DIVE_START] = ist[NODES]
    ist[FIRST_ONLY] = 1
    ist[CHUNK_STOP] = 1 << 62
    fst = np.full(N_FST, math.inf)  # BEST_MOVED, OPEN_LB, KNOWN_FAIL: inf, as BranchAndBound._compiled_state
    fst[DEADLINE] = deadline
    fst[LATE_DEADLINE] = deadline  # a first-found search keeps no share for an improvement
    fst[BEST_LAT] = upper
    fst[GAP] = gap
    fst[KNOWN_PASS] = np.min(slo)
    _run_search(ist, fst, order, same_as_prev, tables, cap, link, b0, bcap, x0, chain, dep, slo, slo_on, alpha,
                d_lo, d_hi, comp0, comp_total, comp_min, suffix_comp, sep_off, counts, hosts_f, cumh, pairs_after,
                mats, sep_n, sep_slope, sep_icept, lay_ptr, lay, least_t, least_cum, feas, clock,
                np.zeros(counts.size), best_k)
    ist[LEAVES] += leaves
    return _better(fst[BEST_LAT], fst[BEST_MOVED], upper, math.inf)


@_jit
def best_found(ist, fst, gap, share, link_kind, cap, link, b0, bcap, x0, gaps, blocks, dep, slo, slo_on, alpha, d_lo,
               d_hi, comp0, comp_total, comp_min, suffix_comp, sep_off, counts, hosts_f, cumh, pairs_after, mats,
               sep_n, sep_slope, sep_icept, lay_ptr, lay, least_t, least_cum, feas, clock, hint_k, has_hint,
               improve_evals, improve_first, best_k, evals):
    """``BranchAndBound.run()`` on the compiled path without a deadline or threads, in one call: the order and tables,
    the no-offload try, the seeds (``hint_k``: the hint's candidate per request, -1 for none, where ``has_hint``),
    the local improvement of the first incumbent where ``improve_first``, the root's probes, :func:`bb_search`, and
    the improvement of an incumbent the node limit (``ist[NODE_LIMIT]``) cut. Returns 0 (no feasible plan), 1 (the
    best found: ``best_k``, its key in ``fst[BEST_*]``, what the search left open in ``fst[OPEN_LB]``) or 2 (the plan
    that offloads nothing, optimal); ``ist[NODES]``, ``ist[LEAVES]``, ``ist[HIT]`` and ``evals[0]`` (improvement
    evaluations) as ``BranchAndBound`` counts them."""
    n_req, n_layers = b0.size, comp0.size
    order, same_as_prev = search_order(bcap, b0, blocks, dep, slo, link_kind)
    tables = suffix_tables(order, bcap, b0, x0, n_layers, share)
    chain = chain_bounds(x0, gaps)
    ratio_order = np.argsort(x0, kind="mergesort")  # the greedy's order, which tightening and improvement walk
    fst[:] = math.inf  # BEST_*, OPEN_LB, KNOWN_FAIL, the deadlines: inf, as BranchAndBound._compiled_state
    fst[GAP] = gap
    fst[KNOWN_PASS] = np.min(slo)
    best_k[:] = 0
    if not float(np.sum(bcap)) * n_layers > cap:  # BranchAndBound._try_no_offload: a leaf
        ist[NODES] += 1
        ist[LEAVES] += 1
        if try_assignment(best_k, 0.0, fst, b0, comp_total, x0, feas):
            return 2
    g = np.zeros(n_req, np.int64)
    greedy(x0, comp_total, counts, hosts_f, bcap, cap, g)
    seeds = _seeds(g, hint_k, has_hint, ratio_order, counts, hosts_f, bcap, cap, n_layers)
    ist[NODES] += seeds.shape[0]
    ist[LEAVES] += seeds.shape[0]
    has_best = try_each(seeds, fst, b0, comp_total, x0, feas, best_k)
    if improve_first and has_best:
        _polish(best_k, fst, improve_evals, b0, comp_total, x0, feas, ratio_order, bcap, cap, clock, evals)
    root_probe = np.zeros(counts.size)
    if has_best and n_req >= 2:  # BranchAndBound._probe_root (no deadline to gate it)
        root_probes(best_k, order[0], comp_total, x0, feas, ratio_order, bcap, cap, np.empty(n_req, np.int64),
                    root_probe)
    leaves = ist[LEAVES]
    ist[LEAVES] = 0
    ist[DIVE_START] = ist[NODES]
    ist[CHUNK_STOP] = 1 << 62
    best_lat, best_moved = fst[BEST_LAT], fst[BEST_MOVED]
    found_k = np.zeros(n_req, np.int64)
    _run_search(ist, fst, order, same_as_prev, tables, cap, link, b0, bcap, x0, chain, dep, slo, slo_on, alpha,
                d_lo, d_hi, comp0, comp_total, comp_min, suffix_comp, sep_off, counts, hosts_f, cumh, pairs_after,
                mats, sep_n, sep_slope, sep_icept, lay_ptr, lay, least_t, least_cum, feas, clock, root_probe, found_k)
    ist[LEAVES] += leaves
    if _better(fst[BEST_LAT], fst[BEST_MOVED], best_lat, best_moved):  # BranchAndBound._collect
        best_k[:] = found_k
        has_best = True
    if has_best and ist[HIT] and not (ist[GAINED] and ist[TIMED_OUT]):
        _polish(best_k, fst, improve_evals, b0, comp_total, x0, feas, ratio_order, bcap, cap, clock, evals)
    return 1 if has_best else 0


@_jit
def _seeds(g, hint_k, has_hint, ratio_order, counts, hosts_f, bcap, cap, n_layers):
    """``BranchAndBound._seed_incumbents``'s seeds ``[n, R]``: the hint (the greedy's candidate where it has none),
    the greedy ``g`` tightened, and the sparsest uniform candidate that fits, tightened."""
    n_req = g.size
    total = float(np.sum(bcap))
    fits = -1
    for k in range(counts.size):  # a uniform placement's memory, as one request of the batch's blocks
        if total * (n_layers - counts[k] + (1 if counts[k] > 0 else 0)) <= cap:
            fits = k
            break
    seeds = np.empty((1 + int(has_hint) + int(fits >= 0), n_req), np.int64)
    i = 0
    if has_hint:
        for r in range(n_req):
            seeds[0, r] = hint_k[r] if hint_k[r] >= 0 else g[r]
        i = 1
    seeds[i] = g
    tighten(seeds[i], ratio_order, counts, hosts_f, bcap, cap, np.empty(n_layers))
    if fits >= 0:
        seeds[i + 1] = fits
        tighten(seeds[i + 1], ratio_order, counts, hosts_f, bcap, cap, np.empty(n_layers))
    return seeds


@_jit
def _polish(best_k, fst, improve_evals, b0, comp_total, x0, feas, ratio_order, bcap, cap, clock, evals):
    """``BranchAndBound._improve`` without a deadline: :func:`improve` of the incumbent ``best_k`` (key in
    ``fst[BEST_*]``), taken where it changed; its evaluations added to ``evals[0]``."""
    if improve_evals <= 0:
        return
    state = np.zeros(3, np.int64)
    k_of = best_k.copy()
    key = np.array([fst[BEST_LAT], fst[BEST_MOVED]])
    improve(k_of, state, key, improve_evals, improve_evals, b0, comp_total, x0, feas, np.empty(k_of.size, np.int64),
            ratio_order, bcap, cap, clock, math.inf)
    if key[0] != fst[BEST_LAT] or key[1] != fst[BEST_MOVED]:
        best_k[:] = k_of
        fst[BEST_LAT] = key[0]
        fst[BEST_MOVED] = key[1]
    evals[0] += state[EVALS]


@_jit
def _run_search(ist, fst, order, same_as_prev, tables, cap, link, b0, bcap, x0, chain, dep, slo, slo_on, alpha,
                d_lo, d_hi, comp0, comp_total, comp_min, suffix_comp, sep_off, counts, hosts_f, cumh, pairs_after,
                mats, sep_n, sep_slope, sep_icept, lay_ptr, lay, least_t, least_cum, feas, clock, root_probe, best_k):
    """:func:`bb_search` from the state ``ist``/``fst``, with the scratch ``BranchAndBound._worker_state`` gives it
    (:func:`first_better`, :func:`best_found`)."""
    rest_b, rest_b0, ratio_suffix, rest_grow, dp_depth, cov_cap, cov_cost, cov_rate, cov_size = tables
    n_req, n_cand, n_layers = b0.size, counts.size, comp0.size
    shape_k, shape_l = (n_req, n_cand), (n_req, n_layers)
    rates = np.zeros((n_req, 4))  # how often _dp_children and the tail bound prune, per depth: none seen yet
    rates[:, 0] = 1.0
    rates[:, 2] = 1.0
    best_k[:] = 0
    bb_search(ist, fst, order, same_as_prev, np.zeros(n_req, np.int64),
              np.zeros(n_req, np.int64), np.zeros(n_req, np.int64), np.zeros(shape_k, np.int64),
              np.zeros(shape_k), np.zeros(shape_k, np.bool_), np.zeros(shape_k),
              np.zeros(n_req), np.zeros(shape_l), np.zeros(shape_l), np.zeros(shape_l),
              np.full(n_req, comp_total), np.zeros(n_req), np.zeros((n_req, sep_off.size)),
              np.zeros((n_req, n_layers, n_layers + 1)),
              counts, hosts_f, cumh, pairs_after, mats, sep_n, sep_slope, sep_icept, sep_off, chain,
              bcap, b0, x0, rest_b, rest_b0, ratio_suffix, rest_grow, suffix_comp, comp0, comp_total, comp_min, link,
              cap, slo_on, dep, slo, alpha, d_lo, d_hi,
              suffix_comp, lay_ptr, lay, np.zeros(n_req, np.int64),
              np.empty(n_req, np.int64), np.empty(n_req, np.int64), np.empty(n_layers), np.empty(lay.size + 1),
              np.empty(n_layers), np.empty(n_layers),
              feas, best_k, (cov_cap, cov_cost, cov_rate, cov_size), np.zeros(shape_k), dp_depth, least_t, least_cum,
              np.zeros((3, n_cand)), np.zeros((mats.shape[1], mats.shape[2])), np.full(n_layers, -1, np.int64),
              rates, np.zeros((n_cand, n_layers), np.int64), root_probe, clock)


# ==== the window rule ======================================================================================
@_jit
def violations(seg_lat, seg_starts, seg_ends, slo, deposit, horizon, bank_max):
    """Jitted twin of :func:`orbitflow.plan.deposit.violations` (the fluid Token-Deposit model; numba needs its
    own copy): cumulative violations over the first ``k`` steps. tests/plan/test_compiled.py checks that they
    agree."""
    per_step = np.zeros(horizon)
    bal = np.minimum(deposit, bank_max)
    for i in range(seg_lat.size):
        _deposit_segment(seg_lat[i], seg_starts[i], seg_ends[i], slo, bal, per_step, bank_max)
    cum = np.zeros(horizon + 1)
    acc = 0.0
    for step in range(horizon):
        acc += per_step[step]
        cum[step + 1] = acc
    return cum


@_jit
def horizon_blocks(b_now, tok, left, steps, block_size):
    """Jitted twin of :func:`orbitflow.plan.horizon.horizon_blocks` (blocks per layer of each request over the
    horizon, the batch's tokens, where the blocks change): integers, so the same values."""
    n_req = b_now.size
    blocks = np.empty((steps + 1, n_req))
    total = np.zeros(steps + 1, dtype=np.int64)
    changed = np.zeros(steps, dtype=np.bool_)
    prev = np.empty(n_req, dtype=np.int64)  # the last step's blocks, compared as integers
    for t in range(steps + 1):
        for r in range(n_req):
            tokens = tok[r] + min(t, left[r])
            total[t] += tokens
            b = max(b_now[r], (tokens + block_size - 1) // block_size)
            blocks[t, r] = b
            if t > 0 and prev[r] != b:
                changed[t - 1] = True
            prev[r] = b
    return blocks, total, changed


@_jit
def balances_after(deposit, slo, seg_lat, seg_starts, seg_ends, steps, bank_max):
    """Jitted twin of :func:`orbitflow.plan.deposit.balances_after` (every request's balance after ``steps`` steps of
    the segments' latencies, step by step), with Python's ``min`` / ``max`` written out, so that the floats are
    :func:`~orbitflow.plan.deposit.balance_after`'s."""
    bal = np.empty(deposit.size)
    for r in range(deposit.size):
        v = deposit[r] if deposit[r] > 0.0 else 0.0
        bal[r] = bank_max if bank_max < v else v
    for i in range(seg_lat.size):
        for _ in range(max(0, min(seg_ends[i], steps) - seg_starts[i])):
            for r in range(bal.size):
                v = bal[r] + 1.0 - seg_lat[i] / slo[r]
                v = v if v > 0.0 else 0.0
                bal[r] = bank_max if bank_max < v else v
    return bal


@_jit
def _deposit_segment(lat, s, e, slo, bal, per_step, bank_max):
    """One segment of :func:`violations`: steps ``s..e-1`` of ``lat`` seconds each, the balances ``bal`` updated in
    place (none above ``bank_max``) and each request's violations counted into ``per_step``. Only steps ``s..e-1``
    are touched, so the violations over the first ``d`` steps are known once the segments covering them are done."""
    n = e - s
    for r in range(slo.size):
        delta = 1.0 - lat / slo[r]
        if delta < 0:
            ok = min(np.floor(bal[r] / -delta + 1e-9), float(n))
            if ok < n:
                for step in range(s + int(ok), e):
                    per_step[step] += 1
                bal[r] = 0.0
            else:
                bal[r] = max(bal[r] + n * delta, 0.0)
        else:
            bal[r] = min(bal[r] + n * delta, bank_max)


# ==== the window rule of one assignment, and local improvement ==============================================
def feasibility_data(counts, hosts_f, lay_ptr, lay, blocks_h, cap, host_cap, alpha, min_steps, horizon, seg_starts,
                     seg_ends, seg_comp, seg_tail, seg_sum, seg_xfer, slo, dep, compute_grows,
                     host_layer_s: float = 0.0, preemptive: bool = False, bank_max: float = math.inf) -> tuple:
    """What :func:`leaf_feasible` reads, as one tuple (numba passes it whole): the candidate tables, the blocks
    of every window step ``[H, R]``, the budgets (``cap``: the device budget with its tolerance, as
    ``Constraints.first_over``), and per block-constant segment its compute, compute suffix sums, compute total
    and transfer seconds per request; ``fpar[3]`` the extra compute of a layer that reads prefetched KV, ``fpar[4]``
    the cap on a Token-Deposit balance (:func:`violations`; ``dep``, the starting balances, are at most it, as
    ``Horizon.deposit``); ``ipar[4]`` 1 on the ``"preemptive"`` link (:func:`_link`)."""
    n_req, n_layers = blocks_h.shape[1], hosts_f.shape[1]
    scratch = (np.empty(n_req, np.int64), np.empty(n_req, np.int64), np.empty(n_layers), np.empty(lay.size + 1),
               np.empty(n_layers), np.empty(len(seg_starts)), np.empty(n_layers), np.empty(horizon), np.empty(n_req))
    fpar = np.array([cap, host_cap, alpha, host_layer_s, bank_max], dtype=np.float64)
    ipar = np.array([min_steps, horizon, int(np.isfinite(slo).any()), int(compute_grows), int(preemptive)],
                    dtype=np.int64)
    return (counts, hosts_f, lay_ptr, lay, np.ascontiguousarray(blocks_h), fpar, ipar, seg_starts, seg_ends, seg_comp,
            seg_tail, seg_sum, seg_xfer, slo, dep, scratch)


@_jit
def steps_that_fit(k_of, feas):
    """``Constraints.steps_that_fit`` of the assignment ``k_of`` (candidate per request; one prefetch slot):
    the first window step at which the capacity equation or the host pool overflows (H if none). Blocks are
    constant within a segment, so only segment starts are checked; block counts are integers, so every sum is
    exact."""
    counts, hosts_f, blocks_h, fpar, starts = feas[0], feas[1], feas[4], feas[5], feas[7]
    n_req = blocks_h.shape[1]
    n_layers = hosts_f.shape[1]
    for i in range(starts.size):
        t = starts[i]
        res = 0.0
        held = 0.0
        for r in range(n_req):
            res += blocks_h[t, r] * (n_layers - counts[k_of[r]])
            held += blocks_h[t, r] * counts[k_of[r]]
        bmax = 0.0
        for layer in range(n_layers):
            b = 0.0
            for r in range(n_req):
                b += blocks_h[t, r] * hosts_f[k_of[r], layer]
            bmax = max(bmax, b)
        if res + bmax > fpar[0] or (math.isfinite(fpar[1]) and held > fpar[1] + 1e-9):
            return t
    return blocks_h.shape[0]


@_jit
def _window_ok(cum, d_lo, d_hi, alpha):
    for d in range(d_lo, d_hi + 1):
        if cum[d] <= alpha * d + 1e-9:
            return True
    return False


@_jit
def leaf_feasible(k_of, lat0, later_lb, feas):
    """Jitted twin of ``Constraints.feasible`` for the assignment ``k_of`` with step-0 latency ``lat0`` (the later
    segments' latencies by :func:`_edf`, as ``Constraints.seg_latencies``); tests/plan/test_compiled.py checks
    that they agree."""
    cap_max = steps_that_fit(k_of, feas)
    return cap_max >= feas[6][0] and _window_rule(k_of, lat0, later_lb, cap_max, feas)


@_jit
def _window_rule(k_of, lat0, later_lb, cap_max, feas):
    """The SLO part of :func:`leaf_feasible`, for an assignment that fits ``cap_max`` steps: whether some window of
    ``d`` steps, ``min_steps <= d <= cap_max``, keeps the violations over its steps within ``alpha * d``.

    The violations over the first ``d`` steps read the segments covering them only, so the segments are scheduled
    one at a time, in order, and the rule stops at the first window that passes: a plan that meets it over the
    shortest window costs the segments of those few steps, not the horizon's (the final plan's longest window is
    ``Constraints.window_of``'s). The same floats in the same order as :func:`violations`, so the same answer."""
    lay_ptr, lay, fpar, ipar = feas[2], feas[3], feas[5], feas[6]
    starts, ends, seg_comp, seg_tail, seg_sum, seg_xfer, slo, dep, scr = feas[7:16]
    d_lo, horizon = ipar[0], ipar[1]
    alpha = fpar[2]
    if ipar[2] == 0:  # no finite SLO
        return True
    n_seg = 0
    for i in range(starts.size):
        if starts[i] < cap_max:
            n_seg += 1
    seg_lat = scr[5][:n_seg]
    seg_lat[0] = lat0
    if n_seg > 1 and later_lb > 0 and ipar[3]:  # every later step at least later_lb: fails without a schedule
        for i in range(1, n_seg):
            seg_lat[i] = later_lb
        if not _window_ok(violations(seg_lat, starts, ends, slo, dep, horizon, fpar[4]), d_lo, cap_max, alpha):
            return False
    per_step, bal = scr[7], scr[8]
    per_step[:] = 0.0
    bal[:] = dep  # already at most the cap (Horizon.deposit)
    acc = 0.0
    for i in range(n_seg):
        if i > 0:
            seg_lat[i] = seg_sum[i] + _link(ipar[4] == 1, seg_comp[i], seg_tail[i], lay_ptr, lay, k_of, seg_xfer[i], 1,
                                            math.inf, scr[0], scr[1], scr[2], scr[3], scr[4], fpar[3])
        _deposit_segment(seg_lat[i], starts[i], ends[i], slo, bal, per_step, fpar[4])
        for step in range(starts[i], min(ends[i], cap_max)):
            acc += per_step[step]  # the violations over the first step + 1 steps, as violations() sums them
            if step + 1 >= d_lo and acc <= alpha * (step + 1) + 1e-9:
                return True
    return False


@_jit
def try_assignment(k_of, later_lb, fst, b0, comp_total, x0, feas):
    """``BranchAndBound._try``: whether ``k_of`` beats the incumbent ``fst[BEST_*]`` and is feasible (then it is
    the incumbent). Capacity first (cheap), then the exact schedule, stopped once slower than the incumbent."""
    counts = feas[0]
    cap_max = steps_that_fit(k_of, feas)
    if cap_max < feas[6][0]:
        return False
    mv = 0.0
    for r in range(k_of.size):
        mv += b0[r] * counts[k_of[r]]
    best = fst[BEST_LAT]
    st = step0_added(k_of, best + 2 * REL_TOL * max(abs(best), 1.0) if math.isfinite(best) else math.inf, x0, feas)
    if st < 0:
        return False
    lat0 = comp_total + st
    if not _better(lat0, mv, fst[BEST_LAT], fst[BEST_MOVED]) or not _window_rule(k_of, lat0, later_lb, cap_max, feas):
        return False
    fst[BEST_LAT] = lat0
    fst[BEST_MOVED] = mv
    return True


@_jit
def greedy(x0, comp_total, counts, hosts_f, bcap, cap, k_of):
    """Jitted twin of ``BranchAndBound._greedy`` (the first incumbent by transfer-to-compute ratio) into
    ``k_of``; the memory it checks is the capacity equation at one slot, an integer sum."""
    n_layers = hosts_f.shape[1]
    n_cand = counts.size
    ratio = x0 / max(comp_total / n_layers, 1e-300)
    order = np.argsort(ratio, kind="mergesort")
    k_of[:] = 0
    if _memory1(k_of, counts, hosts_f, bcap) <= cap:
        return
    for r in order:
        dist = int(math.ceil(ratio[r])) + 1
        lim = n_layers // max(dist, 1)
        k_of[r] = 0
        for k in range(n_cand):
            if counts[k] <= lim:
                k_of[r] = k
        if _memory1(k_of, counts, hosts_f, bcap) <= cap:
            return
    while True:
        grown = False
        for r in order:
            if k_of[r] < n_cand - 1:
                k_of[r] += 1
                grown = True
                if _memory1(k_of, counts, hosts_f, bcap) <= cap:
                    return
        if not grown:
            return


@_jit
def _memory1(k_of, counts, hosts_f, bcap):
    buf = np.empty(hosts_f.shape[1])
    return _memory_parts(k_of, counts, hosts_f, bcap, buf) + buf.max()


@_jit
def try_each(seeds, fst, b0, comp_total, x0, feas, best_k):
    """:func:`try_assignment` of each row of ``seeds`` in turn; the last one taken into ``best_k`` (False: none)."""
    taken = False
    for i in range(seeds.shape[0]):
        if try_assignment(seeds[i], 0.0, fst, b0, comp_total, x0, feas):
            best_k[:] = seeds[i]
            taken = True
    return taken


@_jit
def root_probes(k_of, r, comp_total, x0, feas, order, bcap, cap, cand, probe):
    """The order in which the branch and bound visits the first request's candidates (``probe``, lowest first):
    per candidate ``k`` of request ``r``, the step-0 latency of the incumbent ``k_of`` with ``r`` at ``k`` and the
    others repaired by :func:`move` (inf where that cannot fit). At the root the bounds see every other request
    unassigned and often tie across candidates; the optimum's first candidate then came late in the order
    (8th of 11 for the worst budgeted batch at (4, 32)). ``cand`` (R) is scratch."""
    counts, hosts_f = feas[0], feas[1]
    n_cand = counts.size
    for k in range(n_cand):
        if k == k_of[r]:
            cand[:] = k_of
        elif not move(k_of, r * n_cand + k, cand, order, counts, hosts_f, bcap, cap, feas[15][6]):
            probe[k] = math.inf
            continue
        probe[k] = comp_total + step0_added(cand, math.inf, x0, feas)


@_jit
def step0_added(k_of, abort_above, x0, feas):
    """What the assignment ``k_of`` adds to step 0's compute (:func:`_link`, the cost model's link, over the window's
    first segment), or -1.0 once the step is known to take longer than ``abort_above``."""
    scr = feas[15]
    return _link(feas[6][4] == 1, feas[9][0], feas[10][0], feas[2], feas[3], k_of, x0, 1, abort_above, scr[0], scr[1],
                 scr[2], scr[3], scr[4], feas[5][3])


# local improvement state (ist of improve)
CURSOR, SINCE, EVALS = range(3)


@_jit
def move(k_of, m, out, order, counts, hosts_f, bcap, cap, buf):
    """Local move ``m`` of an assignment into ``out``; False when it does not apply. Moves ``r * K + k``: request
    ``r`` to candidate ``k != k_of[r]``, and when that breaks the capacity equation (at one slot, step
    ``min_steps - 1``: ``bcap``), the other requests made denser one candidate at a time, in ``order`` (lowest
    transfer-to-compute ratio first: their transfers hide best), each as far as needed before the next; then the
    others made as sparse as the capacity left allows (:func:`_sparser`), so that a move of ``r`` to a denser
    candidate hands the memory it frees to the others; then ``R * K + r * R + q``: ``r`` one candidate denser and
    ``q`` (``!= r``) one sparser (trading memory between two requests). ``buf`` (L) is scratch."""
    n_req, n_cand = k_of.size, counts.size
    out[:] = k_of
    if m < n_req * n_cand:
        r, k = m // n_cand, m % n_cand
        if k == k_of[r]:
            return False
        out[r] = k
        res = _memory_parts(out, counts, hosts_f, bcap, buf)
        for q in order:
            while q != r and out[q] < n_cand - 1 and res + buf.max() > cap:
                # q one candidate denser: its resident layers and its buffer share change, integer sums
                res -= bcap[q] * (counts[out[q] + 1] - counts[out[q]])
                buf += bcap[q] * (hosts_f[out[q] + 1] - hosts_f[out[q]])
                out[q] += 1
        if res + buf.max() > cap:
            return False
        _sparser(out, r, order, counts, hosts_f, bcap, cap, res, buf)
        return True
    p = m - n_req * n_cand
    r, q = p // n_req, p % n_req
    if q == r or k_of[r] + 1 >= n_cand or k_of[q] < 1:
        return False
    out[r] = k_of[r] + 1
    out[q] = k_of[q] - 1
    return True


@_jit
def _sparser(out, skip, order, counts, hosts_f, bcap, cap, res, buf):
    """The requests of ``out`` other than ``skip`` made sparser one candidate at a time while the capacity equation
    (at one slot: ``res`` resident blocks and ``buf`` the buffer per layer, both kept up to date) still holds,
    highest transfer-to-compute ratio first (``order`` read backwards: their transfers hide worst), each as far as
    it goes. A plan that leaves capacity unused moves more blocks than it must, and here the link is most of the
    step's latency (the optima fill the capacity to within a percent). Integer sums: a step taken back restores
    ``res`` and ``buf`` exactly."""
    for i in range(order.size - 1, -1, -1):
        q = order[i]
        while q != skip and out[q] > 0:
            k = out[q]
            res += bcap[q] * (counts[k] - counts[k - 1])
            buf += bcap[q] * (hosts_f[k - 1] - hosts_f[k])
            if res + buf.max() > cap:
                res -= bcap[q] * (counts[k] - counts[k - 1])
                buf -= bcap[q] * (hosts_f[k - 1] - hosts_f[k])
                break
            out[q] = k - 1


@_jit
def tighten(k_of, order, counts, hosts_f, bcap, cap, buf):
    """Every request of ``k_of`` (in place) made as sparse as the capacity equation at one slot allows, as
    :func:`_sparser` (nothing changes when ``k_of`` does not fit); the first incumbents (the greedy, the uniform
    seed) overshoot, since they step whole candidates at a time. ``buf`` (L) is scratch."""
    res = _memory_parts(k_of, counts, hosts_f, bcap, buf)
    if res + buf.max() <= cap:
        _sparser(k_of, -1, order, counts, hosts_f, bcap, cap, res, buf)


@_jit
def _memory_parts(k_of, counts, hosts_f, bcap, buf):
    """The capacity equation at one slot of ``k_of``: returns the resident blocks, the buffer per layer in
    ``buf`` (integer sums: exact in any order)."""
    n_layers = hosts_f.shape[1]
    res = 0.0
    buf[:] = 0.0
    for r in range(k_of.size):
        res += bcap[r] * (n_layers - counts[k_of[r]])
        for layer in range(n_layers):
            buf[layer] += bcap[r] * hosts_f[k_of[r], layer]
    return res


@_jit
def improve(k_of, ist, fst, max_evals, stop_evals, b0, comp_total, x0, feas, cand, order, bcap, cap, clock,
            deadline):
    """First-improvement local search from the incumbent ``k_of`` (feasible, its key in ``fst[BEST_*]``) over the
    moves of :func:`move`, scanned round robin from ``ist[CURSOR]``: an improving feasible move is taken at
    once. Stops when a whole round finds none (True) or at ``max_evals`` evaluations (True), or pauses at
    ``stop_evals`` or once the clock passes ``deadline`` (False) so the caller can check its own."""
    n_cand = feas[0].size
    n_moves = k_of.size * n_cand + k_of.size * k_of.size
    while ist[SINCE] < n_moves:
        if ist[EVALS] >= max_evals:
            return True
        if ist[EVALS] >= stop_evals or (deadline < math.inf and _now(clock) > deadline):
            return False
        m = ist[CURSOR]
        ist[CURSOR] = (m + 1) % n_moves
        ist[SINCE] += 1
        if not move(k_of, m, cand, order, feas[0], feas[1], bcap, cap, feas[15][6]):
            continue
        ist[EVALS] += 1
        if try_assignment(cand, 0.0, fst, b0, comp_total, x0, feas):
            k_of[:] = cand
            ist[SINCE] = 0
    return True
