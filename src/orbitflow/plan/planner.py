"""Placement planner: exact search of the pruned space, constraints, decode window and expiry.

Problem (paper section 4.3): choose one KV placement for the batch that minimises the predicted latency of
the target step (step 0 of the window), subject to

* capacity: resident blocks + prefetch buffer (``Placement.buffer_blocks`` at the cost model's prefetch depth)
  <= ``capacity_blocks`` at every step of the decode window,
  while each request grows to ``b_r(t) = max(b_r, ceil((tokens_r + min(t, tokens_left_r)) / block_size))``;
* bounded SLO violations: with the Token-Deposit fluid model (per step of predicted latency ``T``,
  ``balance_r += 1 - T / slo_r``; a step whose balance would go negative is one violation of ``r`` and the
  balance clamps at 0), the violations summed over requests and averaged over the window are ``<= alpha``.

Window rule: a placement is feasible when some ``Delta`` in ``[min_steps, max_steps]`` satisfies both
constraints over steps ``0..Delta-1``; the plan's window is the LARGEST such ``Delta``.

Ties in latency (within ``1e-12 * max(latency, 1 s)``) are broken by fewer host blocks moved, then by
search order (requests by decreasing size; a node's candidates by increasing lower bound, then offload
count), which is deterministic.

``tokens`` of a PlanRequest is the context length at the step the plan is for: the runtime calls the
planner one step ahead and passes the counts of that target step.

Token-dependent compute (``CostModel`` given a callable) is evaluated at the batch's total tokens at the
start of each block-constant stretch of the window.

The search (``space="pruned"``) is a depth-first branch and bound over per-request candidates, exact for
the pruned space: bounds are valid lower bounds (see :mod:`orbitflow.plan.bounds`), capacity is bounded
below by the memory the batch takes when every unassigned request offloads all its layers (the least any
of its choices takes), and leaves use the exact model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from orbitflow.plan import compiled as cc
from orbitflow.plan.cost_model import CostModel
from orbitflow.plan.placement import Placement, buffer_slots
from orbitflow.plan.search import REL_TOL as _REL_TOL
from orbitflow.plan.search import BranchAndBound, candidate_tables
from orbitflow.plan.search import better as _better

__all__ = ["PlanRequest", "Plan", "Planner", "VICTIM_ORDERS", "resolve_victim_order"]


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
        for name in ("blocks_per_layer", "tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"request {self.request_id!r}: {name} must be >= 0, got {getattr(self, name)}")
        if self.tokens_left is not None and self.tokens_left < 0:
            raise ValueError(f"request {self.request_id!r}: tokens_left must be >= 0 or None")
        if not self.slo_s > 0:
            raise ValueError(f"request {self.request_id!r}: slo_s must be > 0, got {self.slo_s}")
        if math.isnan(self.deposit):
            raise ValueError(f"request {self.request_id!r}: deposit must be a number, got nan")


@dataclass(frozen=True)
class Plan:
    """Result of :meth:`Planner.plan` / :meth:`Planner.evaluate`.

    ``placement`` is None when no placement is feasible (then ``victims`` gives the pause order).
    ``expiry_step``: the first step at which the plan overflows memory (within ``max_steps``) or, before its
    window ends, some other feasible plan is strictly faster; None if neither. :attr:`replan_step` is when
    the runtime calls the planner again.
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
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def replan_step(self) -> int:
        """Steps after which the runtime should call the planner again: the end of the window or the expiry,
        whichever comes first (0 for an infeasible plan)."""
        if self.expiry_step is None:
            return self.window
        return max(1, min(self.window, self.expiry_step))


# -- victim ordering --------------------------------------------------------------------------------------
VictimOrder = Callable[[Sequence[PlanRequest]], list[Hashable]]


def _largest_kv_deposit(reqs: Sequence[PlanRequest], num_layers: int) -> list[Hashable]:
    return [
        q.request_id
        for q in sorted(reqs, key=lambda q: -(q.blocks_per_layer * num_layers + q.deposit))
    ]


VICTIM_ORDERS = ("largest-kv+deposit", "longest", "shortest", "random")


def resolve_victim_order(
    name: str | VictimOrder, num_layers: int, seed: int = 0
) -> Callable[[Sequence[PlanRequest]], list[Hashable]]:
    """Resolve a victim rule: a name among :data:`VICTIM_ORDERS` or ``callable(requests) -> ids``."""
    if callable(name):
        return name
    if name == "largest-kv+deposit":
        return lambda reqs: _largest_kv_deposit(reqs, num_layers)
    if name == "longest":
        return lambda reqs: [q.request_id for q in sorted(reqs, key=lambda q: -q.tokens)]
    if name == "shortest":
        return lambda reqs: [q.request_id for q in sorted(reqs, key=lambda q: q.tokens)]
    if name == "random":
        rng = np.random.default_rng(seed)
        return lambda reqs: [reqs[i].request_id for i in rng.permutation(len(reqs))]
    raise ValueError(f"victim_order must be one of {VICTIM_ORDERS} or a callable, got {name!r}")


class _Window:
    """Block counts, segments and compute over the planner's horizon for a batch."""

    def __init__(self, planner: Planner, reqs: Sequence[PlanRequest]) -> None:
        self.horizon = planner.max_steps
        bs = planner.block_size
        b_now = np.array([q.blocks_per_layer for q in reqs], dtype=np.int64)
        tok = np.array([q.tokens for q in reqs], dtype=np.int64)
        left = np.array([q.tokens_left if q.tokens_left is not None else 1 << 40 for q in reqs], np.int64)
        t = np.arange(self.horizon + 1)[:, None]
        grown = np.minimum(t, left[None, :])
        blocks = np.maximum(b_now[None, :], -(-(tok[None, :] + grown) // bs))
        self.blocks = blocks.astype(float)  # [H+1, R]
        self.total_tokens = (tok[None, :] + grown).sum(axis=1)  # [H+1]
        change = np.any(self.blocks[1:] != self.blocks[:-1], axis=1)
        starts = [0] + [int(i) + 1 for i in np.flatnonzero(change[: self.horizon - 1])]
        self.seg_starts = starts
        self.seg_ends = starts[1:] + [self.horizon]
        self.seg_starts_a = np.array(self.seg_starts, dtype=np.int64)
        self.seg_ends_a = np.array(self.seg_ends, dtype=np.int64)
        self.boundaries = [int(i) + 1 for i in np.flatnonzero(change)]  # steps 1..H where b changes
        self.cm = planner.cost_model
        self.comp = [self.cm.compute(int(self.total_tokens[s]) if self.cm.depends_on_tokens else None, len(reqs))
                     for s in starts]
        self.compute_grows = all(bool(np.all(c >= self.comp[0])) for c in self.comp[1:])
        self.seg_cache: dict[tuple[bytes, int], float] = {}  # (host mask bytes, segment) -> step latency
        self.tails: list[np.ndarray] | None = None  # compiled evaluator: suffix sums of each segment's compute
        self.slo = np.array([q.slo_s for q in reqs], dtype=float)
        self.deposit = np.array([max(0.0, float(q.deposit)) for q in reqs], dtype=float)


class Planner:
    """Request-wise KV placement planner (paper section 4.3).

    ``space``: ``"pruned"`` (per-request distances, exact branch and bound), ``"uniform"`` (one distance
    for the whole batch, the Batch-Uniform ablation) or ``"full"`` (free per-layer masks; local search
    seeded from the pruned optimum, see :mod:`orbitflow.plan.full_search`).
    ``window``: ``(min_steps, max_steps)`` of the decode window. ``check_better``: whether expiry also
    looks for a strictly better plan at future block boundaries (one extra bounded search per boundary).
    Budgets (like a MILP solver's): ``node_limit`` branch-and-bound nodes for the main search and
    ``time_limit_s`` per :meth:`plan` call (None: unlimited), never spent before the first dive (one node per
    request) is done.
    When one runs out, the best plan found so far is returned with ``plan.stats["exact"] = 0`` and a
    certified ``stats["gap"]``: no plan of the space is faster than ``stats["lower_bound_s"]``; if none was
    found, the plan is infeasible (not proven: ``exact`` 0) and the engine pauses a victim as for a proven
    one. ``gap`` (relative) stops the search once the incumbent is proven within it (0: exact). Each expiry
    search ("is some other plan strictly faster at this future step?") gets ``expiry_node_limit`` nodes
    (None: unlimited); an undecided one ends the plan's validity there (re-planning early is safe).
    ``compiled``: run the search and the step evaluator compiled (:mod:`orbitflow.plan.compiled`, numba,
    without the GIL); None: when numba is installed and ``ORBITFLOW_PLAN_COMPILED`` is not ``0``. Both give the
    same plans; the pure Python / NumPy path is the reference.
    """

    def __init__(
        self,
        cost_model: CostModel,
        capacity_blocks: float,
        alpha: float = 1.0,
        window: tuple[int, int] = (1, 16),
        space: str = "pruned",
        *,
        block_size: int = 16,
        victim_order: str | VictimOrder = "largest-kv+deposit",
        seed: int = 0,
        check_better: bool = True,
        full_max_evals: int = 2000,
        node_limit: int | None = 2000,
        time_limit_s: float | None = None,
        gap: float = 0.0,
        expiry_node_limit: int | None = 200,
        host_capacity_blocks: float = math.inf,
        compiled: bool | None = None,
    ) -> None:
        if space not in ("pruned", "uniform", "full"):
            raise ValueError(f"space must be 'pruned', 'uniform' or 'full', got {space!r}")
        lo, hi = int(window[0]), int(window[1])
        if not 1 <= lo <= hi:
            raise ValueError(f"window must satisfy 1 <= min_steps <= max_steps, got {window}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if not capacity_blocks >= 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        for name, limit in (("node_limit", node_limit), ("expiry_node_limit", expiry_node_limit)):
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be >= 1 (or None: unlimited), got {limit}")
        if full_max_evals < 1:
            raise ValueError(f"full_max_evals must be >= 1, got {full_max_evals}")
        if not gap >= 0:
            raise ValueError(f"gap must be >= 0, got {gap}")
        if time_limit_s is not None and not time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0 or None, got {time_limit_s}")
        self.cost_model = cost_model
        self.capacity_blocks = float(capacity_blocks)
        self.host_capacity_blocks = float(host_capacity_blocks)  # what the batch may hold on the host
        self.alpha = float(alpha)
        self.min_steps, self.max_steps = lo, hi
        self.space = space
        self.block_size = int(block_size)
        self.check_better = check_better
        self.full_max_evals = int(full_max_evals)
        self.node_limit = node_limit
        self.time_limit_s = time_limit_s
        self.gap = float(gap)
        self.expiry_node_limit = expiry_node_limit
        self._victims = resolve_victim_order(victim_order, cost_model.num_layers, seed)
        self.compiled = cc.enabled(compiled)

    @property
    def num_layers(self) -> int:
        return self.cost_model.num_layers

    # ==== public entry points ===========================================================================
    def plan(self, requests: Sequence[PlanRequest], hint: Mapping[Hashable, int | None] | None = None) -> Plan:
        """Best feasible placement for the batch (see module docstring).

        ``hint``: offload distance per request id (typically the previous plan's, for the batch as it is now);
        the search tries it first, with requests it does not name at their greedy choice, so that a budget
        that runs out early still returns a plan at least as good. It changes no proven optimum (only which of
        equally fast plans is returned).
        """
        t0 = time.perf_counter()
        reqs = list(requests)
        self._check_ids(reqs)
        if not reqs:
            comp = self.cost_model.compute(0 if self.cost_model.depends_on_tokens else None)
            return Plan((), Placement(np.ones((0, self.num_layers), bool)), (), True, self.max_steps, None,
                        float(comp.sum()))
        win = _Window(self, reqs)
        stats: dict[str, float] = {"nodes": 0, "leaves": 0}
        deadline = None if self.time_limit_s is None else t0 + self.time_limit_s
        if self.space == "uniform":
            mask = self._solve_uniform(win, stats)
        else:
            mask = self._solve_pruned(win, stats, node_limit=self.node_limit, deadline=deadline,
                                      hint=None if hint is None else [hint.get(q.request_id, -1) for q in reqs])
            if mask is not None and self.space == "full":
                from orbitflow.plan.full_search import improve_full

                mask = improve_full(self, win, mask, stats, deadline)
        if mask is None:
            stats["solve_s"] = time.perf_counter() - t0
            return Plan(tuple(q.request_id for q in reqs), None, None, False, 0, None, math.inf,
                        victims=tuple(self._victims(reqs)), stats=stats)
        plan = self._make_plan(reqs, win, mask, stats, search_better=self.check_better, deadline=deadline)
        stats["solve_s"] = time.perf_counter() - t0
        return plan

    def evaluate(self, placement: Placement, requests: Sequence[PlanRequest]) -> Plan:
        """Check a given placement against the constraints (no search; expiry = capacity only)."""
        reqs = list(requests)
        self._check_ids(reqs)
        if placement.num_requests != len(reqs) or placement.num_layers != self.num_layers:
            raise ValueError(
                f"placement is {placement.num_requests}x{placement.num_layers}, "
                f"expected {len(reqs)}x{self.num_layers}"
            )
        win = _Window(self, reqs)
        stats: dict[str, float] = {"nodes": 0, "leaves": 1}
        return self._make_plan(reqs, win, placement.host.copy(), stats, search_better=False)

    # ==== evaluation of one host mask ===================================================================
    def _seg_latencies(
        self, win: _Window, host: np.ndarray, upto: int | None = None, first: int = 0
    ) -> list[float]:
        """Exact step latency of each block-constant segment (segments ``first..upto-1``), memoised per
        window and host mask (the search's feasibility check and the final plan ask for the same ones)."""
        out = []
        n = len(win.seg_starts) if upto is None else upto
        mask_key = host.tobytes()
        for i in range(first, n):
            lat = win.seg_cache.get((mask_key, i))
            if lat is None:
                comp = win.comp[i]
                if self.compiled and self.cost_model.transfer == "edf":  # same floats, no GIL
                    if win.tails is None:
                        win.tails = [cc.tail(np.asarray(c, dtype=float)) for c in win.comp]
                    xfer = np.asarray(self.cost_model.transfer_s(win.blocks[win.seg_starts[i]].astype(float)))
                    stall = cc.step_stall(np.array(comp, dtype=float), win.tails[i], host, xfer,
                                          self.cost_model.prefetch_slots)
                else:
                    stall = float(sum(self.cost_model.stalls(host, win.blocks[win.seg_starts[i]], comp)))
                lat = win.seg_cache[(mask_key, i)] = float(comp.sum()) + stall
            out.append(lat)
        return out

    def _first_over(self, host: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Steps (rows of ``blocks``) at which the device budget or the host pool would overflow."""
        over = self._memory(host, blocks) > self.capacity_blocks * (1 + _REL_TOL) + 1e-9
        if math.isfinite(self.host_capacity_blocks):
            over |= blocks @ host.sum(axis=1) > self.host_capacity_blocks + 1e-9
        return np.flatnonzero(over)

    def _steps_that_fit(self, win: _Window, host: np.ndarray) -> int:
        """How many steps of the horizon ``host`` fits in memory (no window can be longer)."""
        over = self._first_over(host, win.blocks[: win.horizon])
        return int(over[0]) if over.size else win.horizon

    def _memory(self, host: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Capacity-equation left side for each row of ``blocks`` [T, R]."""
        resident = blocks @ (~host).sum(axis=1)
        slots = self.cost_model.prefetch_slots
        buf = (blocks @ buffer_slots(host, slots)).max(axis=1) if host.shape[0] else np.zeros(blocks.shape[0])
        return resident + buf

    def _violations(self, win: _Window, seg_lat: Sequence[float]) -> np.ndarray:
        """Cumulative violations ``V[k]`` over the first ``k`` steps, k = 0..H (fluid Token-Deposit)."""
        if self.compiled:
            return cc.violations(np.array(seg_lat, dtype=float), win.seg_starts_a, win.seg_ends_a, win.slo,
                                 win.deposit, win.horizon)
        per_step = np.zeros(win.horizon)
        bal = win.deposit.copy()
        for i, lat in enumerate(seg_lat):
            s, e = win.seg_starts[i], win.seg_ends[i]
            n = e - s
            delta = 1.0 - lat / win.slo
            neg = delta < 0
            if not neg.any():
                bal += n * delta
                continue
            ok_steps = np.full(bal.shape, n, dtype=np.int64)
            # clamp before the cast: a huge (or infinite) deposit must not overflow int64
            ok_steps[neg] = np.minimum(np.floor(bal[neg] / -delta[neg] + 1e-9), n).astype(np.int64)
            for k in ok_steps[neg]:
                if k < n:
                    per_step[s + k : e] += 1
            # a request that just made it through the segment may sit a rounding error below 0
            bal = np.where(neg, np.where(ok_steps >= n, np.maximum(bal + n * delta, 0.0), 0.0), bal + n * delta)
        return np.concatenate(([0.0], np.cumsum(per_step)))

    def _window_of(self, win: _Window, host: np.ndarray, seg_lat: Sequence[float]) -> tuple[int, float]:
        """Largest feasible Delta (0 if none) and the violations over it."""
        cap_max = self._steps_that_fit(win, host)
        if cap_max < self.min_steps:
            return 0, 0.0
        cum = self._violations(win, seg_lat)
        for d in range(cap_max, self.min_steps - 1, -1):
            if cum[d] <= self.alpha * d + 1e-9:
                return d, float(cum[d])
        return 0, 0.0

    def _make_plan(
        self,
        reqs: list[PlanRequest],
        win: _Window,
        host: np.ndarray,
        stats: dict[str, float],
        search_better: bool,
        deadline: float | None = None,
    ) -> Plan:
        over = self._first_over(host, win.blocks)
        expiry: int | None = int(over[0]) if over.size and over[0] >= 1 else None
        cap_max = min(int(over[0]), win.horizon) if over.size else win.horizon  # no window is longer
        seg_lat = self._seg_latencies(win, host, upto=max(1, sum(1 for s in win.seg_starts if s < cap_max)))
        window, viol = self._window_of(win, host, seg_lat)
        feasible = window > 0
        lat_steps: list[float] = []
        for i, lat in enumerate(seg_lat):
            lat_steps += [lat] * (win.seg_ends[i] - win.seg_starts[i])
        mem_all = self._memory(host, win.blocks)
        if feasible and search_better and self.space != "uniform":
            # only boundaries inside the window matter (the runtime re-plans at its end), and the window
            # never reaches the capacity expiry
            better = self._better_expiry(reqs, win, host, seg_lat, window, stats, deadline)
            if better is not None:
                expiry = better
        placement = Placement(~host)
        distances = placement.distances()
        shown = window if feasible else 0
        return Plan(
            request_ids=tuple(q.request_id for q in reqs),
            placement=placement,
            distances=tuple(distances) if distances is not None else None,
            feasible=feasible,
            window=shown,
            expiry_step=expiry,
            predicted_step_s=seg_lat[0],
            step_latencies_s=tuple(lat_steps[: max(shown, 1)]),
            violations=viol,
            memory_blocks=float(mem_all[0]),
            peak_memory_blocks=float(mem_all[max(shown, 1) - 1]),  # the last window step: blocks only grow
            host_blocks=float(host.sum(axis=1) @ win.blocks[0]),
            victims=() if feasible else tuple(self._victims(reqs)),
            stats=stats,
        )

    def _better_expiry(
        self,
        reqs: list[PlanRequest],
        win: _Window,
        host: np.ndarray,
        seg_lat: list[float],
        stop: int,
        stats: dict[str, float],
        deadline: float | None = None,
    ) -> int | None:
        """First block boundary before ``stop`` at which some feasible plan is strictly faster (None if none).

        Every boundary is searched unless the plan is stall-free there: the executor's schedule is not
        monotone in transfer sizes, and token-dependent compute can hide other plans' transfers, so a plan
        whose own stall did not grow can still be overtaken.
        """
        for t in win.boundaries:
            if t >= stop:
                break
            if deadline is not None and time.perf_counter() > deadline:  # out of time: end the plan here
                stats["expiry_exact"] = 0
                return t
            # the batch as it will be at step t (finished requests stop growing)
            shifted = [
                PlanRequest(q.request_id, q.blocks_per_layer,
                            q.tokens + (t if q.tokens_left is None else min(t, q.tokens_left)),
                            None if q.tokens_left is None else max(0, q.tokens_left - t),
                            self._deposit_after(q, seg_lat, win, t), q.slo_s)
                for q in reqs
            ]
            win_t = _Window(self, shifted)
            cur = self._seg_latencies(win_t, host, upto=1)[0]
            if cur <= float(win_t.comp[0].sum()) * (1 + _REL_TOL) + 1e-15:
                continue  # nothing can beat a stall-free step
            sub: dict[str, float] = {"nodes": 0, "leaves": 0}
            better = self._solve_pruned(win_t, sub, upper=cur * (1 - 1e-9), first_only=True,
                                        node_limit=self.expiry_node_limit, deadline=deadline)
            stats["nodes"] += sub["nodes"]
            stats["expiry_searches"] = stats.get("expiry_searches", 0) + 1
            if better is not None:
                return t
            if not sub.get("exact", 1):  # undecided within the budget: end the plan here to be safe
                stats["expiry_exact"] = 0
                return t
        return None

    @staticmethod
    def _deposit_after(q: PlanRequest, seg_lat: list[float], win: _Window, t: int) -> float:
        """Token-Deposit balance of ``q`` after ``t`` steps under the plan (fluid model)."""
        bal = max(0.0, float(q.deposit))
        for i, lat in enumerate(seg_lat):
            s, e = win.seg_starts[i], min(win.seg_ends[i], t)
            for _ in range(max(0, e - s)):
                bal = max(0.0, bal + 1.0 - lat / q.slo_s)
        return bal

    # ==== searches ======================================================================================
    def _solve_uniform(self, win: _Window, stats: dict[str, float]) -> np.ndarray | None:
        """Exhaustive search of the one-distance-for-all space (the Batch-Uniform ablation)."""
        tables = candidate_tables(self.num_layers)
        dists, hosts = tables.distances, tables.hosts
        n_req = win.blocks.shape[1]
        best = None
        best_key = (math.inf, math.inf)
        for k in range(len(dists)):
            host = np.repeat(hosts[k][None, :], n_req, axis=0)
            stats["leaves"] += 1
            seg_lat = self._seg_latencies(win, host)
            if self._window_of(win, host, seg_lat)[0] == 0:
                continue
            key = (seg_lat[0], float(host.sum(axis=1) @ win.blocks[0]))
            if _better(key, best_key):
                best, best_key = host, key
        stats["exact"] = 1  # every candidate was evaluated
        if best is not None:
            stats["lower_bound_s"], stats["gap"] = best_key[0], 0.0
        return best

    def _solve_pruned(
        self,
        win: _Window,
        stats: dict[str, float],
        upper: float = math.inf,
        first_only: bool = False,
        node_limit: int | None = None,
        deadline: float | None = None,
        hint: list | None = None,
    ) -> np.ndarray | None:
        """Exact branch and bound over per-request distance candidates; returns the host mask or None.
        ``hint``: a distance per request (-1: none given) tried first."""
        return BranchAndBound(self, win, stats, upper=upper, first_only=first_only, node_limit=node_limit,
                              deadline=deadline, hint=hint).run()

    def _feasible(self, win: _Window, host: np.ndarray, lat0: float, later_lb: float = 0.0) -> bool:
        """Whether ``host`` admits some window, given its exact step-0 latency (lazy in later segments).

        ``later_lb``: a bound on the step-0 latency that only grows with blocks and compute (the search's
        bounds are), so it bounds every later step too when compute does not shrink; violations only grow
        with latency, so failing with it saves computing the later segments exactly.
        """
        cap_max = self._steps_that_fit(win, host)
        if cap_max < self.min_steps:
            return False
        if not np.isfinite(win.slo).any():
            return True
        n_seg = sum(1 for s in win.seg_starts if s < cap_max)
        d = np.arange(self.min_steps, cap_max + 1)
        if n_seg > 1 and later_lb > 0 and win.compute_grows:
            cum = self._violations(win, [lat0] + [later_lb] * (n_seg - 1))
            if not np.any(cum[d] <= self.alpha * d + 1e-9):
                return False
        seg_lat = [lat0] + self._seg_latencies(win, host, upto=n_seg, first=1)
        cum = self._violations(win, seg_lat)
        return bool(np.any(cum[d] <= self.alpha * d + 1e-9))

    def _lat_prefilter(self, win: _Window) -> Callable[[float], bool]:
        """Whether a constant per-step latency lower bound still admits some window under alpha.

        A step-0 bound only bounds the later steps when compute does not shrink over the window (blocks only
        grow); otherwise every bound passes."""
        slo = win.slo
        if not np.isfinite(slo).any() or not win.compute_grows:
            return lambda lb: True
        dep = win.deposit
        d_arr = np.arange(self.min_steps, self.max_steps + 1)
        slo_min = float(slo.min())

        known = [slo_min, math.inf]  # violations only grow with lb: lb <= known[0] passes, lb >= known[1] fails

        def ok(lb: float) -> bool:
            if lb <= known[0]:
                return True
            if lb >= known[1]:
                return False
            delta = 1.0 - lb / slo
            neg = delta < 0
            safe = np.floor(dep[neg] / -delta[neg] + 1e-9)
            viol = np.maximum(d_arr[:, None] - safe[None, :], 0).sum(axis=1)
            passed = bool(np.any(viol <= self.alpha * d_arr + 1e-9))
            known[0 if passed else 1] = lb
            return passed

        return ok

    @staticmethod
    def _check_ids(reqs: list[PlanRequest]) -> None:
        seen: set[Hashable] = set()
        for q in reqs:
            if q.request_id in seen:
                raise ValueError(f"request_id values must be unique: {q.request_id!r} appears twice")
            seen.add(q.request_id)




_warm = False


def warm_up() -> None:
    """Load (or compile) the compiled planner's kernels in this process now, with a tiny solve, so that the first
    real solve does not pay for it. The simulator charges solve time on its virtual clock; without this the first
    solve of each process would be charged for numba's cache load."""
    global _warm
    if _warm or not cc.enabled(None):
        return
    model = CostModel([1e-3] * 4, link_blocks_per_s=1e3)
    requests = [PlanRequest("a", 8, 120, 40, 0.0, 6e-3), PlanRequest("b", 4, 60, 40, 0.0, 6e-3)]
    Planner(model, capacity_blocks=30, window=(1, 4)).plan(requests)
    _warm = True
