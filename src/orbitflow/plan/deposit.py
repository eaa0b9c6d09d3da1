"""The fluid Token-Deposit model the planner plans with (paper section 4.2), written once.

``runtime/deposit.py`` is the real mechanism: a FIFO of tokens, each due one SLO after the previous one. The
planner sees it as a fluid balance: each decode step of predicted latency ``T`` adds ``1 - T / slo_r`` to
request ``r``'s balance (the tokens generated ahead of their due time); a step that would take the balance
below 0 is one SLO violation of ``r`` and the balance clamps at 0. Without Token-Deposit (``--no-token-deposit``)
nothing is held back, so nothing banks: the balance is also capped at ``bank_max = 0`` (every step slower than the
SLO is a violation, whatever came before it); with it the cap is ``inf``.

The compiled planner has jitted twins of :func:`violations` and :func:`constant_latency_violations`
(``compiled.violations``, ``compiled._lat_ok``): numba cannot call these NumPy functions from its loops;
tests/plan/test_compiled.py proves that the twins agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["balance_after", "constant_latency_violations", "covered_steps", "violations"]


def covered_steps(balance: np.ndarray, drift: np.ndarray) -> np.ndarray:
    """Steps a balance covers at a negative drift per step (``1 - T / slo < 0``) before it would go below 0."""
    return np.floor(balance / -drift + 1e-9)


def violations(seg_lat: Sequence[float], seg_starts: Sequence[int], seg_ends: Sequence[int], slo: np.ndarray,
               deposit: np.ndarray, horizon: int, bank_max: float = math.inf) -> np.ndarray:
    """Cumulative violations ``V[k]`` over the first ``k`` steps, ``k = 0..horizon``, of requests with SLOs
    ``slo`` and starting balances ``deposit`` when the steps of segment ``i`` (``seg_starts[i]`` up to
    ``seg_ends[i]``) each take ``seg_lat[i]`` seconds; no balance grows above ``bank_max``."""
    per_step = np.zeros(horizon)
    bal = np.minimum(deposit, bank_max)
    for i, lat in enumerate(seg_lat):
        s, e = seg_starts[i], seg_ends[i]
        n = e - s
        delta = 1.0 - lat / slo
        neg = delta < 0
        if not neg.any():
            bal = np.minimum(bal + n * delta, bank_max)
            continue
        ok_steps = np.full(bal.shape, n, dtype=np.int64)
        # clamp before the cast: a huge (or infinite) deposit must not overflow int64
        ok_steps[neg] = np.minimum(covered_steps(bal[neg], delta[neg]), n).astype(np.int64)
        for k in ok_steps[neg]:
            if k < n:
                per_step[s + k : e] += 1
        # a request that just made it through the segment may sit a rounding error below 0
        bal = np.where(neg, np.where(ok_steps >= n, np.maximum(bal + n * delta, 0.0), 0.0),
                       np.minimum(bal + n * delta, bank_max))
    return np.concatenate(([0.0], np.cumsum(per_step)))


def balance_after(deposit: float, slo_s: float, seg_lat: Sequence[float], seg_starts: Sequence[int],
                  seg_ends: Sequence[int], steps: int, bank_max: float = math.inf) -> float:
    """Balance of one request after ``steps`` steps of the segments' latencies, step by step."""
    bal = min(max(0.0, float(deposit)), bank_max)
    for i, lat in enumerate(seg_lat):
        for _ in range(max(0, min(seg_ends[i], steps) - seg_starts[i])):
            bal = min(max(0.0, bal + 1.0 - lat / slo_s), bank_max)
    return bal


def balances_after(deposit: np.ndarray, slo: np.ndarray, seg_lat: Sequence[float], seg_starts: Sequence[int],
                   seg_ends: Sequence[int], steps: int, bank_max: float = math.inf) -> np.ndarray:
    """:func:`balance_after` of every request at once (``deposit``, ``slo``: per request), the same floats."""
    bal = np.minimum(np.maximum(0.0, np.asarray(deposit, dtype=float)), bank_max)
    for i, lat in enumerate(seg_lat):
        for _ in range(max(0, min(seg_ends[i], steps) - seg_starts[i])):
            bal = np.minimum(np.maximum(0.0, bal + 1.0 - lat / slo), bank_max)
    return bal


def constant_latency_violations(latency: float, slo: np.ndarray, deposit: np.ndarray,
                                steps: np.ndarray) -> np.ndarray:
    """Violations over the first ``steps[j]`` steps when every step takes ``latency`` seconds (the cap on the balance
    does not matter here: a constant step either never goes negative or never banks)."""
    delta = 1.0 - latency / slo
    neg = delta < 0
    safe = covered_steps(deposit[neg], delta[neg])
    return np.maximum(steps[:, None] - safe[None, :], 0).sum(axis=1)
