"""What goes into the planner and what comes out: :class:`PlanRequest`, :class:`Plan`, :class:`PlanStats`.

Plain frozen data (the stats are filled in by one solve, then read), shared by the planner, the searches,
the policies and the runtime controller.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from orbitflow.plan.placement import Placement

__all__ = ["REL_TOL", "Plan", "PlanRequest", "PlanStats", "better", "is_whole"]

REL_TOL = 1e-12  # latencies within REL_TOL * max(latency, 1 s) tie
MAX_COUNT = 2**62  # a request's tokens and blocks: the planner counts them (and their growth) in int64


def is_whole(value) -> bool:
    """Whether ``value`` is a finite whole number (an int, a numpy integer, or a float like 4.0), not a bool."""
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            and math.isfinite(value) and float(value).is_integer())


def better(key: tuple[float, float], best: tuple[float, float]) -> bool:
    """The order on plans: lexicographic (latency, moved blocks); latencies within ``REL_TOL * max(latency,
    1 s)`` tie."""
    tol = REL_TOL * max(abs(best[0]), 1.0) if math.isfinite(best[0]) else 0.0
    if key[0] < best[0] - tol:
        return True
    if key[0] <= best[0] + tol:
        return key[1] < best[1] - 1e-9
    return False


@dataclass(frozen=True)
class PlanRequest:
    """One running request as the planner sees it (counts at the target step)."""

    request_id: Hashable
    blocks_per_layer: int
    tokens: int
    tokens_left: int | None = None
    deposit: float = 0.0
    slo_s: float = math.inf

    def __post_init__(self) -> None:
        for name in ("blocks_per_layer", "tokens", "tokens_left"):
            value = getattr(self, name)
            if value is None and name == "tokens_left":
                continue
            if not (is_whole(value) and 0 <= value < MAX_COUNT):  # the planner counts them in int64
                raise ValueError(f"request {self.request_id!r}: {name} must be >= 0 and a whole number below 2**62"
                                 f"{' (or None)' if name == 'tokens_left' else ''}, got {value!r}")
        if not self.slo_s > 0:
            raise ValueError(f"request {self.request_id!r}: slo_s must be > 0, got {self.slo_s}")
        if math.isnan(self.deposit):
            raise ValueError(f"request {self.request_id!r}: deposit must be a number, got nan")

    def after(self, steps: int, deposit: float) -> PlanRequest:
        """The request ``steps`` decode steps later (a finished one stops growing), with balance ``deposit``."""
        left = self.tokens_left
        grown = steps if left is None else min(steps, left)
        return PlanRequest(self.request_id, self.blocks_per_layer, self.tokens + grown,
                           None if left is None else max(0, left - steps), deposit, self.slo_s)


@dataclass
class PlanStats:
    """What one solve did. Filled in by the search that produced the plan, read-only afterwards."""

    nodes: int = 0  # branch-and-bound nodes, expiry searches included
    leaves: int = 0  # complete placements evaluated exactly
    improve_evals: int = 0  # placements the local improvement of the first incumbent evaluated exactly
    exact: bool = True  # False: a budget ran out (or the space was searched locally) before a proof
    lower_bound_s: float | None = None  # certified: no plan of the space has a faster step 0 (None: unknown)
    gap: float | None = None  # (predicted - lower_bound) / predicted (None: unknown)
    expiry_searches: int = 0  # "is some other plan strictly faster at this boundary?" searches run
    expiry_exact: bool = True  # False: an expiry search ran out of budget (the plan ends there to be safe)
    full_evals: int | None = None  # space="full": exact evaluations of the local search
    solve_s: float | None = None  # wall seconds of the solve (set for plan(), not for evaluate())

    def proven(self, gap: float = 0.0) -> bool:
        """Whether the solve proved its plan optimal or, for a relative ``gap`` > 0 (``Planner(gap=...)``), within
        that gap of the best possible plan (its certified gap is no wider)."""
        return self.exact or (gap > 0 and self.gap is not None and self.gap <= gap * (1 + 1e-9))


@dataclass(frozen=True)
class Plan:
    """Result of :meth:`Planner.plan` / :meth:`Planner.evaluate`.

    ``placement`` is None when no placement is feasible (then ``victims`` gives the pause order).
    ``expiry_step``: the first step at which the plan overflows memory (within ``max_steps``) or, before its
    window ends and not before the window's least length (``min_steps``, the paper's Delta_min), some other feasible
    plan is strictly faster; None if neither. :attr:`replan_step` is when the runtime calls the planner again.
    """

    request_ids: tuple[Hashable, ...]
    placement: Placement | None
    distances: tuple[int | None, ...] | None
    feasible: bool
    window: int
    expiry_step: int | None
    predicted_step_s: float
    step_latencies_s: tuple[float, ...] = ()
    violations: float = 0.0
    memory_blocks: float = 0.0
    peak_memory_blocks: float = 0.0
    host_blocks: float = 0.0
    victims: tuple[Hashable, ...] = ()
    stats: PlanStats = field(default_factory=PlanStats)

    @property
    def replan_step(self) -> int:
        """Steps after which the runtime should call the planner again: the end of the window or the expiry,
        whichever comes first (0 for an infeasible plan)."""
        if not self.feasible:
            return 0
        if self.expiry_step is None:
            return self.window
        return max(1, min(self.window, self.expiry_step))
