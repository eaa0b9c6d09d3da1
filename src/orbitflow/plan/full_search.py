"""``space="full"``: free per-layer masks, searched by local search seeded from the pruned optimum.

This search is a heuristic (no optimality proof over the 2^(R*L) masks). Starting from the exact optimum of
the pruned space, it repeatedly applies the first improving move, in a fixed order, among

* shift: move one host layer of a request to a neighbouring device layer (same offload count),
* drop: bring one host layer back on the device (fewer transfers; needs capacity slack),
* swap: bring one host layer of request ``r`` back and offload one device layer of request ``q`` that
  frees at least as many blocks (trades KV between requests),

where "improving" means feasible (capacity and alpha over some window) and strictly better in
(step latency, moved blocks). It stops at a local optimum, after ``planner.full_max_evals`` exact
evaluations or at the planner's deadline. The result is never worse than the pruned optimum, but nothing
is proven about the full space: the plan's ``stats.exact`` is False and it carries no lower bound.
"""

from __future__ import annotations

import time

import numpy as np

from orbitflow.plan.horizon import Constraints, Horizon
from orbitflow.plan.types import PlanStats, better


def _moves(host: np.ndarray, blocks: np.ndarray):
    n_req, n_layers = host.shape
    for r in range(n_req):
        hl = np.flatnonzero(host[r])
        for layer in hl:  # shift
            for nb in (layer - 1, layer + 1):
                if 0 <= nb < n_layers and not host[r, nb]:
                    yield ((r, layer, False), (r, nb, True))
        for layer in hl:  # drop
            yield ((r, layer, False),)
    for r in range(n_req):  # swap
        for layer in np.flatnonzero(host[r]):
            for q in range(n_req):
                if q == r or blocks[q] < blocks[r]:
                    continue
                dev = np.flatnonzero(~host[q])
                if dev.size:
                    # offload the device layer of q closest after `layer` (keeps transfers spread out)
                    after = dev[dev > layer]
                    pick = int(after[0]) if after.size else int(dev[-1])
                    yield ((r, layer, False), (q, pick, True))


def improve_full(
    rules: Constraints, win: Horizon, host: np.ndarray, stats: PlanStats, deadline: float | None = None,
    max_evals: int = 2000,
) -> np.ndarray:
    """Local search from ``host`` (feasible), at most ``max_evals`` exact evaluations; returns a feasible mask
    no worse than ``host``."""
    b0 = win.blocks[0]
    cur = host.copy()
    cur_key = (rules.seg_latencies(win, cur, upto=1)[0], float(cur.sum(axis=1) @ b0))
    evals = 0
    improved = True
    while improved and evals < max_evals:
        improved = False
        for move in _moves(cur, b0):
            if deadline is not None and time.perf_counter() > deadline:
                break
            cand = cur.copy()
            for r, layer, val in move:
                cand[r, layer] = val
            evals += 1
            lat0 = rules.seg_latencies(win, cand, upto=1)[0]
            key = (lat0, float(cand.sum(axis=1) @ b0))
            if better(key, cur_key):
                seg = [lat0] + rules.seg_latencies(win, cand)[1:]
                if rules.window_of(win, cand, seg)[0] > 0:
                    cur, cur_key = cand, key
                    improved = True
                    break
            if evals >= max_evals:
                break
    stats.full_evals = evals
    stats.exact = False  # a local optimum; the pruned search's bound does not bound the full space
    stats.lower_bound_s = stats.gap = None
    return cur
