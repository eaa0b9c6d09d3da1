"""Lower bounds on the step latency of any link schedule (used by the branch and bound).

All bounds hold for every schedule that respects the executor's rules (one buffer slot per request, one
transfer at a time on the link, preemptive or not), so they are valid for ``"edf"`` and for ``"preemptive"``, whose
latency the release/need recursion is; they only grow when host layers are added,
so a partial assignment (unassigned requests offload nothing) bounds all its completions. EDF's own latency does
not have that property (another request's copies can shorten a step:
``tests/plan/test_cost_model.py::test_edf_is_not_monotone_in_added_copies``), so a bound that holds only for EDF's
order could not treat unassigned requests this way.

* Link bound. Let ``C`` be the total compute. Layer ``l`` cannot start before every transfer it needs has
  arrived. Transfers of request ``r`` whose previous host layer is ``>= m`` are released only after layer
  ``m`` finished, i.e. not before ``sum_{k<=m} comp_k``. Hence for all ``m < l``::

      T >= C + V(m, l) - sum_{m<k<l} comp_k,   V(m, l) = sum_r xfer_r * max(0, n_r[m..l] - 1)

  and, with every transfer released at t=0, ``T >= C + W(<=l) - sum_{k<l} comp_k``. :func:`count_matrix`
  holds the transfer counts ``n_r`` of one host row.
* Chain bound (computed in :mod:`orbitflow.plan.search`). Between the end of request r's (j-1)-th host
  layer and the start of its j-th, its j-th transfer must fit, so the stalls in that stretch are at least
  ``xfer_r - (compute strictly between)``. The stretches are disjoint, so the total stall is at least their
  sum, for each request separately.
* Separable window bounds. Summing the link constraint over disjoint windows (a tiling of the layers)
  bounds the total stall by a sum of per-request terms, so requests not assigned yet can be bounded by a
  convex relaxation of their choices (:func:`separable_tables`).
* The release/need recursion (:func:`dp_bound`) propagates the link constraints from layer to layer.
* Tail bound (:func:`critical_windows`, :func:`tail_cover`). The recursion's value is that of one path of windows;
  host layers the unassigned requests add only raise that path's value by their transfers inside its windows, so a
  partial assignment's bound rises by the least such sum over the unassigned requests' joint choices that free the
  blocks capacity forces them to free (its linear relaxation, a multiple-choice knapsack's).
* Forced cover (:func:`cover_tables`, :func:`cover_cost`). When capacity forces the requests not assigned yet
  to offload at least ``y`` blocks, the link moves at least the cheapest fractional cover of ``y``: each
  offloaded layer of request ``r`` frees ``b_r`` blocks and costs ``xfer_r`` seconds, at most ``L`` layers each,
  so the least link time is the fractional knapsack cover, requests taken in increasing ``xfer_r / b_r``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

NEG = -1e30


def count_matrix(host_row: np.ndarray) -> np.ndarray:
    """``N[(L+1), L]`` transfer counts of one host row (True = offloaded) for the link bound."""
    h = np.asarray(host_row, dtype=np.int64)
    n_layers = h.size
    cum = np.concatenate(([0], np.cumsum(h)))  # cum[i] = host layers among 0..i-1
    out = np.zeros((n_layers + 1, n_layers))
    out[0] = cum[1:]
    # rows m+1: for l > m, max(0, (cum[l+1] - cum[m]) - 1)
    m_idx = np.arange(n_layers)[:, None]
    l_idx = np.arange(n_layers)[None, :]
    cnt = cum[1:][None, :] - cum[:-1][:, None]
    val = np.where(l_idx > m_idx, np.maximum(cnt - 1, 0), 0)
    out[1:] = val
    return out


def dp_bound(v: np.ndarray, comp: np.ndarray, codes: np.ndarray | None = None) -> np.ndarray:
    """Propagated link bound for a batch of transfer-time matrices ``v[K, L+1, L]`` (= sum xfer_r N_r).

    ``S[l] >= max(F[l-1], v[0, l], max_{m<l} F[m] + v[m+1, l])`` with ``F[m] = S[m] + comp[m]``: the same
    constraints as the link bound, but stalls propagate to later layers (which also subsumes the chain
    bound, as a request's consecutive host layers give ``v[m+1, l] >= xfer_r``). Returns ``T >= F[L-1]``.

    It is the exact latency a PREEMPTIVE earliest-need-first link would give (transfers needed by layers
    ``<= l`` would never wait for later ones, so they would all be done at ``max over release times rho of
    rho + their work released at or after rho``); the gap to ``"edf"`` is the time a non-preemptive copy for
    a later layer holds up one that became urgent.

    ``codes`` (``[K, L]`` int64, optional) receives which term gave each ``S[l]``, for :func:`critical_windows`:
    :data:`CONTINUE` (``F[l-1]``), :data:`FROM_START` (``v[0, l]``) or the release layer ``m``; ties go to the
    earlier of those, and to the least ``m``.
    """
    comp = np.asarray(comp, dtype=float)
    n_layers = comp.size
    k = v.shape[0]
    f = np.empty((k, n_layers))
    f[:, 0] = v[:, 0, 0] + comp[0]
    if codes is not None:
        codes[:, 0] = FROM_START
    for layer in range(1, n_layers):
        s = np.maximum(f[:, layer - 1], v[:, 0, layer])
        terms = f[:, :layer] + v[:, 1 : layer + 1, layer]
        cand = terms.max(axis=1)
        f[:, layer] = np.maximum(s, cand) + comp[layer]
        if codes is not None:
            start = v[:, 0, layer]
            codes[:, layer] = np.where(f[:, layer - 1] >= np.maximum(start, cand), CONTINUE,
                                       np.where(start >= cand, FROM_START, terms.argmax(axis=1)))
    return f[:, -1]


# -- the tail bound: the propagated bound's critical path, with the unassigned requests' forced offload on it -------
CONTINUE, FROM_START = -2, -1  # dp_bound's codes: S[l] came from F[l-1], from v[0, l]; else the release layer m
TAIL_MIN = 2  # the searches add the tail bound where at least this many requests are left unassigned
# ... and skip it at a depth while the share of the children it prunes there (a moving average, weight TAIL_AVERAGE
# per child it prices) is under TAIL_MIN_RATE, but for the node after TAIL_PROBE without it. Measured shares: 19-68%
# at (R, L) = (16, 80), where it takes 2-3x fewer nodes; 0-14% at most depths of (8, 32), where it only cost time.
TAIL_MIN_RATE, TAIL_AVERAGE, TAIL_PROBE = 0.2, 1 / 32, 16.0


def critical_windows(code: np.ndarray, ms: np.ndarray, ls: np.ndarray) -> int:
    """The windows on the path that gave one :func:`dp_bound` its value, from its ``codes`` row: ``(ms[i], ls[i])``
    for the entry ``v[ms[i] + 1, ls[i]]`` (``ms[i] = -1``: ``v[0, ls[i]]``), last layer first; returns how many.

    ``F[L-1]`` is the sum of those entries and of compute along the path, and every other path is a lower bound on
    it, so for a matrix grown by ``D`` (more host layers), ``dp_bound(v + D) >= dp_bound(v) + sum_i D[ms[i] + 1,
    ls[i]]``: the path's value with ``D`` added. Scalar loops over arrays, so the compiled search runs it as it is."""
    n = 0
    layer = code.size - 1
    while layer >= 0:
        c = code[layer]
        if c == CONTINUE:
            layer -= 1
            continue
        ms[n] = c
        ls[n] = layer
        n += 1
        if c == FROM_START:
            break
        layer = c
    return n


def tail_cover(a: np.ndarray, c: np.ndarray, lo: np.ndarray, y: float, seg_s: np.ndarray, seg_w: np.ndarray) -> float:
    """Least ``sum_i c[i, k_i]`` over one candidate ``k_i >= lo[i]`` per row ``i`` with ``sum_i a[i, k_i] >= y``, in
    its linear relaxation (so a lower bound on it): each row at its cheapest candidate (ties: the one that frees
    most), then the pieces of the rows' lower convex hulls to the right of it, least cost per unit of ``a`` first,
    until ``y`` is reached (``y`` capped at what the rows free at most). ``a[i]`` increases along ``k``.
    ``seg_s``, ``seg_w``: scratch of ``a.size``. Scalar loops over arrays, so the compiled search runs it as it is
    (the same floats in both searches)."""
    n_rows, n_cand = a.shape
    total, have, most, n_seg = 0.0, 0.0, 0.0, 0
    for i in range(n_rows):
        p = lo[i]
        for k in range(lo[i] + 1, n_cand):
            if c[i, k] <= c[i, p]:
                p = k
        total += c[i, p]
        have += a[i, p]
        most += a[i, n_cand - 1]
        while p < n_cand - 1:  # the hull to the right of p: the next point of least slope (ties: the farthest)
            nxt, best = -1, 0.0
            for k in range(p + 1, n_cand):
                if a[i, k] > a[i, p]:
                    s = (c[i, k] - c[i, p]) / (a[i, k] - a[i, p])
                    if nxt < 0 or s <= best:
                        nxt, best = k, s
            if nxt < 0:
                break
            seg_s[n_seg] = best
            seg_w[n_seg] = a[i, nxt] - a[i, p]
            n_seg += 1
            p = nxt
    need = min(y, most) - have
    if need <= 0.0:
        return total
    for j in np.argsort(seg_s[:n_seg], kind="mergesort"):
        take = min(seg_w[j], need)
        total += seg_s[j] * take
        need -= take
        if need <= 0.0:
            break
    return total


# -- separable window bounds (partial assignments) -------------------------------------------------------
def window_tilings(n_layers: int, max_len: int = 8) -> list[list[tuple[int, int]]]:
    """Tilings of the layers into disjoint windows, as ``(row, l)`` entries of :func:`count_matrix`.

    Window ``(m, l]`` (layers ``m+1..l``, transfers released after layer ``m`` ends) is entry ``(m+1, l)``;
    the first window may instead start at t=0, entry ``(0, l)``. Every length ``g <= max_len`` at every
    phase, plus the lengths ``L, L/2, L/3, L/4`` at phase 0.
    """
    lengths = list(range(1, min(max_len, n_layers) + 1))
    lengths += sorted({n_layers // k for k in (1, 2, 3, 4)} - set(lengths) - {0})
    out = []
    for g in lengths:
        for phase in range(g if g <= max_len else 1):
            tiling = [(0, phase - 1)] if phase else []
            end = phase - 1  # last layer covered so far
            while end < n_layers - 1:
                last = min(end + g, n_layers - 1)
                tiling.append((end + 1, last))
                end = last
            out.append(tiling)
    return out


class SeparableTables(NamedTuple):
    """Separable window bounds of the candidates of one ``L`` (see :func:`separable_tables`)."""

    n: np.ndarray  # [J, K] transfers counted by tiling j for candidate k
    between: np.ndarray  # [J, L+1] offset_j = C - between_j @ cum(comp), cum(comp)[i] = sum comp[0..i-1]
    slope: np.ndarray  # [J, P] hull pieces: phi_j(u) = max_p slope * u + icept
    icept: np.ndarray


def separable_tables(mats: np.ndarray, counts: np.ndarray) -> SeparableTables:
    """Per-candidate linear lower bounds on the step latency, and their convex relaxations.

    For one tiling, the stalls inside window ``(m, l]`` are at least ``v[m+1, l]`` minus the compute of layers
    ``m+1..l-1`` (see :func:`dp_bound`; for the t=0 window, minus layers ``0..l-1``), so
    ``T >= offset_j + sum_r xfer_r * n[j, k_r]``: a sum of per-request terms. Requests not yet assigned that
    must still offload ``y`` layer-blocks in all, ``B`` blocks per layer together, cost at least
    ``B * phi_j(y / B)``, ``phi_j`` being the lower convex hull of the points ``(counts[k], n[j, k])``
    (by Jensen, equal fractions are optimal for the relaxation).
    """
    n_layers = mats.shape[2]
    tilings = window_tilings(n_layers)
    n_vec = np.stack([sum(mats[:, row, l] for row, l in t) for t in tilings])
    between = np.zeros((len(tilings), n_layers + 1))
    for j, t in enumerate(tilings):
        for row, l in t:  # compute of layers row..l-1 = cum[l] - cum[row]
            between[j, l] += 1.0
            between[j, row] -= 1.0
    hulls = [_lower_hull(counts.astype(float), row) for row in n_vec]
    width = max(len(h) for h in hulls)
    slope = np.array([[a for a, _ in h] + [h[-1][0]] * (width - len(h)) for h in hulls])
    icept = np.array([[b for _, b in h] + [h[-1][1]] * (width - len(h)) for h in hulls])
    for a in (n_vec, between, slope, icept):
        a.setflags(write=False)
    return SeparableTables(n_vec, between, slope, icept)


def _lower_hull(xs: np.ndarray, ys: np.ndarray) -> list[tuple[float, float]]:
    """Pieces ``(slope, intercept)`` of the lower convex hull of points with increasing ``xs``."""
    pts: list[tuple[float, float]] = []
    for x, y in zip(xs.tolist(), ys.tolist()):
        while len(pts) >= 2:
            (x1, y1), (x2, y2) = pts[-2], pts[-1]
            if (y2 - y1) * (x - x1) >= (y - y1) * (x2 - x1):  # pts[-1] on or above the chord
                pts.pop()
            else:
                break
        pts.append((x, y))
    if len(pts) == 1:
        return [(0.0, pts[0][1])]
    return [((y2 - y1) / (x2 - x1), y1 - (y2 - y1) / (x2 - x1) * x1) for (x1, y1), (x2, y2) in zip(pts, pts[1:])]


# -- forced cover (unassigned requests that must offload) --------------------------------------------------
class CoverTables(NamedTuple):
    """Per search depth ``e`` (requests ``order[e:]`` not assigned), the fractional cover in increasing cost per
    block: ``cap[e, j]`` blocks and ``cost[e, j]`` seconds of the first ``j`` requests (all ``L`` layers each),
    ``rate[e, j]`` the seconds per block of the ``j``-th, ``size[e]`` how many requests can free blocks."""

    cap: np.ndarray  # [R+1, R+1]
    cost: np.ndarray  # [R+1, R+1]
    rate: np.ndarray  # [R+1, R]
    size: np.ndarray  # [R+1] int64


def cover_tables(order: list[int], blocks: np.ndarray, xfer: np.ndarray, n_layers: int) -> CoverTables:
    """The tables of :func:`cover_cost` for requests assigned in ``order``, ``blocks[r]`` blocks per layer freed
    by offloading one layer of ``r``, ``xfer[r]`` seconds to move it."""
    n_req = len(order)
    cap, cost = np.zeros((n_req + 1, n_req + 1)), np.zeros((n_req + 1, n_req + 1))
    rate, size = np.zeros((n_req + 1, max(n_req, 1))), np.zeros(n_req + 1, dtype=np.int64)
    for e in range(n_req + 1):
        rest = [r for r in order[e:] if blocks[r] > 0]
        rest.sort(key=lambda r: xfer[r] / blocks[r])
        size[e] = len(rest)
        for j, r in enumerate(rest):
            rate[e, j] = xfer[r] / blocks[r]
            cap[e, j + 1] = cap[e, j] + blocks[r] * n_layers
            cost[e, j + 1] = cost[e, j] + xfer[r] * n_layers
    return CoverTables(cap, cost, rate, size)


def cover_cost(y: np.ndarray, tables: CoverTables, e: int) -> np.ndarray:
    """Least link seconds for the requests ``order[e:]`` to offload ``y`` blocks (per entry of ``y``), as a
    fractional cover: a lower bound on what any assignment of them that frees ``y`` blocks moves. Past what
    they can free it stays at the cost of freeing everything (no assignment exists then)."""
    n = int(tables.size[e])
    y = np.asarray(y, dtype=float)
    j = np.searchsorted(tables.cap[e, 1 : n + 1], y, side="left")
    full = j >= n
    jj = np.minimum(j, max(n - 1, 0))
    part = tables.cost[e, jj] + (y - tables.cap[e, jj]) * tables.rate[e, jj]
    return np.where(y <= 0, 0.0, np.where(full, tables.cost[e, n], part))
