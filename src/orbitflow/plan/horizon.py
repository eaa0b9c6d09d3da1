"""The decode horizon of a batch and the constraints a placement must meet over it (paper section 4.3).

:class:`Horizon` is what the batch looks like over the next ``max_steps`` steps: each request's blocks per
layer at every step (requests grow by one token a step until they finish), the block-constant segments
of that stretch, and the compute of each segment. :class:`Constraints` holds the planner's limits (device
budget, host pool, SLO cap ``alpha``, window bounds) and answers, for one host mask over one horizon: how much
memory it takes (the capacity equation, :func:`orbitflow.plan.placement.memory_blocks`), its exact step
latency per segment, its Token-Deposit violations (:mod:`orbitflow.plan.deposit`), and its window: the
largest ``Delta`` in ``[min_steps, max_steps]`` over which both constraints hold. The searches
(:mod:`orbitflow.plan.search`, :mod:`orbitflow.plan.full_search`) and the planner ask it; it asks none of them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from orbitflow.plan import compiled as cc
from orbitflow.plan import deposit
from orbitflow.plan.cost_model import CostModel
from orbitflow.plan.placement import memory_blocks
from orbitflow.plan.types import REL_TOL, PlanRequest

__all__ = ["Constraints", "Horizon"]

UNBOUNDED = 1 << 40  # tokens_left of a request without a known end


class Horizon:
    """Block counts, segments and compute over the next ``steps`` decode steps of a batch."""

    def __init__(self, reqs: Sequence[PlanRequest], steps: int, block_size: int, cost_model: CostModel,
                 bank_max: float = math.inf, compiled: bool | None = None) -> None:
        bank_max = float(bank_max)
        self._compiled = cc.enabled(compiled)  # its blocks by the compiled kernel (the planner's switch)
        self._build(np.array([q.blocks_per_layer for q in reqs], dtype=np.int64),
                    np.array([q.tokens for q in reqs], dtype=np.int64),
                    np.array([q.tokens_left if q.tokens_left is not None else UNBOUNDED for q in reqs], np.int64),
                    np.array([q.tokens_left is not None for q in reqs], dtype=bool),
                    np.array([q.slo_s for q in reqs], dtype=float),
                    np.array([min(max(0.0, float(q.deposit)), bank_max) for q in reqs], dtype=float),
                    steps, block_size, cost_model, bank_max)

    def after(self, steps: int, deposit: np.ndarray) -> Horizon:
        """The horizon of the same batch ``steps`` decode steps later (a finished request stops growing), each
        request's Token-Deposit balance then ``deposit`` (in ``[0, bank_max]``): what ``Horizon([q.after(steps, d)
        for q, d in ...], ...)`` builds, from this one's arrays."""
        later = object.__new__(Horizon)
        later._compiled = self._compiled
        grown = np.minimum(steps, self._left)
        left = np.where(self._known, np.maximum(0, self._left - steps), UNBOUNDED)
        later._build(self._b_now, self._tok + grown, left, self._known, self.slo, np.asarray(deposit, dtype=float),
                     self.horizon, self._block_size, self.cm, self.bank_max)
        return later

    def _build(self, b_now: np.ndarray, tok: np.ndarray, left: np.ndarray, known: np.ndarray, slo: np.ndarray,
               deposit: np.ndarray, steps: int, block_size: int, cost_model: CostModel, bank_max: float) -> None:
        """Per request: blocks per layer now, tokens, tokens left (``UNBOUNDED`` where not ``known``), SLO seconds
        and Token-Deposit balance (already in ``[0, bank_max]``)."""
        self._b_now, self._tok, self._left, self._known, self._block_size = b_now, tok, left, known, block_size
        self.horizon = steps
        # blocks per layer [H+1, R], tokens of the batch [H+1] and whether the blocks change at step t (t = 1..H)
        grow = cc.horizon_blocks if self._compiled else horizon_blocks
        self.blocks, self.total_tokens, changed = grow(b_now, tok, left, steps, block_size)
        self.boundaries = (np.flatnonzero(changed) + 1).tolist()  # steps 1..H
        starts = [0] + [t for t in self.boundaries if t < steps]  # where b changes, within the horizon
        self.seg_starts = starts
        self.seg_ends = starts[1:] + [steps]
        self.seg_starts_a = np.array(self.seg_starts, dtype=np.int64)
        self.seg_ends_a = np.array(self.seg_ends, dtype=np.int64)
        self.cm = cost_model
        n_req = b_now.size
        if cost_model.depends_on_tokens:
            self.comp = [cost_model.compute(int(self.total_tokens[s]), n_req) for s in starts]
            self.compute_grows = all(bool(np.all(c >= self.comp[0])) for c in self.comp[1:])
        else:  # one (cached, read-only) array for every segment
            self.comp = [cost_model.compute(None, n_req)] * len(starts)
            self.compute_grows = True
        self.seg_cache: dict[tuple[bytes, int], float] = {}  # (host mask bytes, segment) -> step latency
        self._rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None  # see rows()
        self.slo = slo
        self.bank_max = bank_max  # the cap on a Token-Deposit balance: inf, or 0 without Token-Deposit
        self.deposit = deposit

    def rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per segment, what the compiled evaluator and window rule read, built once per horizon: its compute
        ``[S, L]``, the suffix sums of that compute (:func:`orbitflow.plan.compiled.tail` of each row, the same
        floats), the compute's total ``[S]`` (each row's own sum, as the reference takes it) and the seconds of one
        transfer of each request ``[S, R]`` at the segment's blocks."""
        if self._rows is None:
            if self.cm.depends_on_tokens:
                comp, tails, sums = _segment_compute(np.array(self.comp, dtype=float))
            else:  # every segment computes the same: shared by every horizon of this many segments
                comp, tails, sums = _same_compute(np.ascontiguousarray(self.comp[0], dtype=float).tobytes(),
                                                  len(self.comp))
            self._rows = (comp, tails, sums,
                          np.asarray(self.cm.transfer_s(self.blocks[self.seg_starts_a]), dtype=float))
        return self._rows

    def step_latencies(self, seg_lat: Sequence[float]) -> list[float]:
        """Per-step latencies from per-segment ones."""
        out: list[float] = []
        for i, lat in enumerate(seg_lat):
            out += [lat] * (self.seg_ends[i] - self.seg_starts[i])
        return out


def horizon_blocks(b_now: np.ndarray, tok: np.ndarray, left: np.ndarray, steps: int,
                   block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over steps ``0..steps`` of requests holding ``b_now`` blocks per layer and ``tok`` tokens with ``left`` to go
    (each grows a token a step until it is done): the blocks per layer of each ``[H+1, R]`` (floats of integers), the
    batch's tokens ``[H+1]`` and whether some request's blocks change at step ``t`` (``t = 1..H``). Integer sums:
    :func:`orbitflow.plan.compiled.horizon_blocks` gives the same."""
    grown = np.minimum(np.arange(steps + 1)[:, None], left[None, :])
    blocks = np.maximum(b_now[None, :], -(-(tok[None, :] + grown) // block_size))
    return blocks.astype(float), (tok[None, :] + grown).sum(axis=1), (blocks[1:] != blocks[:-1]).any(axis=1)


def _segment_compute(comp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per segment (rows of ``comp`` ``[S, L]``): the compute, its suffix sums and its total (Horizon.rows)."""
    return comp, np.cumsum(comp[:, ::-1], axis=1)[:, ::-1].copy(), np.array([float(c.sum()) for c in comp])


@functools.lru_cache(maxsize=256)
def _same_compute(comp_bytes: bytes, n_seg: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_segment_compute` of ``n_seg`` segments that all compute ``comp_bytes`` (writable arrays: the kernels'
    signatures; they only read them)."""
    comp = np.frombuffer(comp_bytes, dtype=float)
    return _segment_compute(np.repeat(comp[None, :], n_seg, axis=0))


@dataclass(frozen=True)
class Constraints:
    """The planner's limits, and the checks of one host mask (``[R, L]`` bool, True = offloaded) against them."""

    cost_model: CostModel
    capacity_blocks: float
    host_capacity_blocks: float
    alpha: float
    min_steps: int
    max_steps: int
    block_size: int
    compiled: bool
    token_deposit: bool = True  # False: nothing banks (plan/deposit.py's bank_max 0), as with --no-token-deposit

    @property
    def num_layers(self) -> int:
        return self.cost_model.num_layers

    def horizon(self, reqs: Sequence[PlanRequest]) -> Horizon:
        return Horizon(reqs, self.max_steps, self.block_size, self.cost_model,
                       math.inf if self.token_deposit else 0.0, self.compiled)

    # ---- capacity -------------------------------------------------------------------------------------
    def memory(self, host: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Capacity-equation left side for each row of ``blocks`` [T, R]."""
        return memory_blocks(host, blocks, self.cost_model.prefetch_slots)

    def first_over(self, host: np.ndarray, blocks: np.ndarray, memory: np.ndarray | None = None) -> np.ndarray:
        """Steps (rows of ``blocks``) at which the device budget or the host pool would overflow (``memory``: the
        :meth:`memory` of those rows, when the caller has it)."""
        over = (self.memory(host, blocks) if memory is None else memory) > self.capacity_blocks * (1 + REL_TOL) + 1e-9
        if math.isfinite(self.host_capacity_blocks):
            over |= blocks @ host.sum(axis=1) > self.host_capacity_blocks + 1e-9
        return np.flatnonzero(over)

    def steps_that_fit(self, win: Horizon, host: np.ndarray, over: np.ndarray | None = None) -> int:
        """How many steps of the horizon ``host`` fits in memory (no window can be longer); ``over``: the caller's
        :meth:`first_over` of ``host`` at every step (``win.blocks``). Block counts are integers, so a row's memory is
        the same whichever rows are computed with it."""
        if over is None:
            over = self.first_over(host, win.blocks[: win.horizon])
        return int(over[0]) if over.size and over[0] < win.horizon else win.horizon

    # ---- latency --------------------------------------------------------------------------------------
    def seg_latencies(self, win: Horizon, host: np.ndarray, upto: int | None = None, first: int = 0) -> list[float]:
        """Exact step latency of each block-constant segment (segments ``first..upto-1``), memoised per
        horizon and host mask (the search's feasibility check and the final plan ask for the same ones)."""
        n = len(win.seg_starts) if upto is None else upto
        mask_key = host.tobytes()
        out = [win.seg_cache.get((mask_key, i)) for i in range(first, n)]
        missing = [i for i, lat in zip(range(first, n), out) if lat is None]
        if missing:
            for i, lat in zip(missing, self._segment_latencies(win, host, missing)):
                win.seg_cache[(mask_key, i)] = lat
            out = [win.seg_cache[(mask_key, i)] for i in range(first, n)]
        return out

    def _segment_latencies(self, win: Horizon, host: np.ndarray, segs: list[int]) -> list[float]:
        """The step latency of each segment in ``segs``: by the compiled schedule (all of them in one call, the same
        floats, no GIL) on the links it has, else by the cost model."""
        cm = self.cost_model
        if self.compiled and cm.transfer in ("edf", "preemptive"):
            comp, tails, sums, xfer = win.rows()
            added = np.empty(len(segs))
            cc.segments_added(np.ascontiguousarray(host, dtype=np.bool_).view(np.uint8), comp, tails, xfer,
                              np.array(segs, dtype=np.int64), np.int64(cm.prefetch_slots), float(cm.host_layer_s),
                              cm.transfer == "preemptive", added)
            return [float(sums[i]) + float(a) for i, a in zip(segs, added)]
        return [float(win.comp[i].sum()) + cm.added_s(host, win.blocks[win.seg_starts[i]], win.comp[i]) for i in segs]

    # ---- Token-Deposit and the window -----------------------------------------------------------------
    def violations(self, win: Horizon, seg_lat: Sequence[float]) -> np.ndarray:
        """Cumulative violations ``V[k]`` over the first ``k`` steps, k = 0..H (fluid Token-Deposit)."""
        if self.compiled:
            return cc.violations(np.array(seg_lat, dtype=float), win.seg_starts_a, win.seg_ends_a, win.slo,
                                 win.deposit, win.horizon, win.bank_max)
        return deposit.violations(seg_lat, win.seg_starts, win.seg_ends, win.slo, win.deposit, win.horizon,
                                  win.bank_max)

    def window_of(self, win: Horizon, host: np.ndarray, seg_lat: Sequence[float],
                  over: np.ndarray | None = None) -> tuple[int, float]:
        """Largest feasible Delta (0 if none) and the violations over it (``over``: as :meth:`steps_that_fit`)."""
        cap_max = self.steps_that_fit(win, host, over)
        if cap_max < self.min_steps:
            return 0, 0.0
        cum = self.violations(win, seg_lat)
        for d in range(cap_max, self.min_steps - 1, -1):
            if cum[d] <= self.alpha * d + 1e-9:
                return d, float(cum[d])
        return 0, 0.0

    def feasible(self, win: Horizon, host: np.ndarray, lat0: float, later_lb: float = 0.0) -> bool:
        """Whether ``host`` admits some window, given its exact step-0 latency (lazy in later segments).

        ``later_lb``: a bound on the step-0 latency that only grows with blocks and compute (the search's
        bounds are), so it bounds every later step too when compute does not shrink; violations only grow
        with latency, so failing with it saves computing the later segments exactly.
        """
        cap_max = self.steps_that_fit(win, host)
        if cap_max < self.min_steps:
            return False
        if not np.isfinite(win.slo).any():
            return True
        n_seg = sum(1 for s in win.seg_starts if s < cap_max)
        d = np.arange(self.min_steps, cap_max + 1)
        if n_seg > 1 and later_lb > 0 and win.compute_grows:
            cum = self.violations(win, [lat0] + [later_lb] * (n_seg - 1))
            if not np.any(cum[d] <= self.alpha * d + 1e-9):
                return False
        # the violations over the first d steps read only the segments covering them: schedule the segments one at a
        # time and stop at the first window that passes (the plan's longest window is window_of's)
        seg_lat = [lat0]
        for i in range(n_seg):
            if i:
                seg_lat += self.seg_latencies(win, host, upto=i + 1, first=i)
            d = np.arange(max(self.min_steps, win.seg_starts[i] + 1), min(win.seg_ends[i], cap_max) + 1)
            if d.size and np.any(self.violations(win, seg_lat)[d] <= self.alpha * d + 1e-9):
                return True
        return False

    def lat_prefilter(self, win: Horizon) -> Callable[[float], bool]:
        """Whether a constant per-step latency lower bound still admits some window under alpha.

        A step-0 bound only bounds the later steps when compute does not shrink over the window (blocks only
        grow); otherwise every bound passes."""
        slo = win.slo
        if not np.isfinite(slo).any() or not win.compute_grows:
            return lambda lb: True
        dep = win.deposit
        d_arr = np.arange(self.min_steps, self.max_steps + 1)
        known = [float(slo.min()), math.inf]  # violations only grow with lb: <= known[0] passes, >= known[1] fails

        def ok(lb: float) -> bool:
            if lb <= known[0]:
                return True
            if lb >= known[1]:
                return False
            viol = deposit.constant_latency_violations(lb, slo, dep, d_arr)
            passed = bool(np.any(viol <= self.alpha * d_arr + 1e-9))
            known[0 if passed else 1] = lb
            return passed

        return ok

    def horizon_after(self, win: Horizon, seg_lat: Sequence[float], t: int) -> Horizon:
        """The batch's horizon ``t`` steps into a plan with these segment latencies (its balances then: every
        request's :func:`orbitflow.plan.deposit.balance_after`, the same floats): what an expiry check searches."""
        if self.compiled:
            bal = cc.balances_after(win.deposit, win.slo, np.array(seg_lat, dtype=float), win.seg_starts_a,
                                    win.seg_ends_a, t, win.bank_max)
        else:
            bal = deposit.balances_after(win.deposit, win.slo, seg_lat, win.seg_starts, win.seg_ends, t, win.bank_max)
        return win.after(t, bal)
