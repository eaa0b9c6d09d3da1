"""Placement planner: exact search of the pruned space, constraints, decode window and expiry.

Problem (paper section 4.3): choose one KV placement for the batch that minimises the predicted latency of
the target step (step 0 of the window), subject to

* capacity: resident blocks + prefetch buffer (:func:`orbitflow.plan.placement.capacity_terms`, at the cost
  model's prefetch depth) <= ``capacity_blocks`` at every step of the decode window,
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
planner ahead of it (one step or more) and passes the counts of that target step.

Token-dependent compute (``CostModel`` given a callable) is evaluated at the batch's total tokens at the
start of each block-constant stretch of the window.

Where each part lives: the inputs and outputs in :mod:`orbitflow.plan.types`, the horizon and the
constraints (capacity equation, window, Token-Deposit violations) in :mod:`orbitflow.plan.horizon`, the step
latency in :mod:`orbitflow.plan.cost_model`, the searches in :mod:`orbitflow.plan.search` and
:mod:`orbitflow.plan.full_search`; this module ties them together and decides the expiry. Imports go one
way: planner -> searches -> horizon -> cost model, deposit, placement, types.

The search (``space="pruned"``) is a depth-first branch and bound over per-request candidates, exact for
the pruned space: bounds are valid lower bounds (see :mod:`orbitflow.plan.bounds`), capacity is bounded
below by the memory the batch takes when every unassigned request offloads all its layers (the least any
of its choices takes), and leaves use the exact model.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence

import numpy as np

from orbitflow.plan import compiled as cc
from orbitflow.plan.cost_model import CostModel
from orbitflow.plan.full_search import improve_full
from orbitflow.plan.horizon import Constraints, Horizon
from orbitflow.plan.placement import Placement
from orbitflow.plan.search import SearchControl, best_plan, candidate_tables, first_better
from orbitflow.plan.types import REL_TOL, Plan, PlanRequest, PlanStats, better, is_whole

__all__ = ["Planner", "VICTIM_ORDERS", "resolve_victim_order", "warm_up"]


# -- victim ordering --------------------------------------------------------------------------------------
VictimOrder = Callable[[Sequence[PlanRequest]], list[Hashable]]


def _newest_first_by(reqs: Sequence[PlanRequest], key: Callable[[PlanRequest], float]) -> list[Hashable]:
    """Ids by ``key``, least first; among equals the one latest in the batch first. The engine's batch is the running
    requests in the order they were admitted or resumed, then the newcomer: so a newcomer does not pause an equal
    request before it, and requests of one size are served in the order they were let in (a resumed request counts
    from its resumption)."""
    return [reqs[i].request_id for i in sorted(range(len(reqs)), key=lambda i: (key(reqs[i]), -i))]


def _largest_kv_deposit(reqs: Sequence[PlanRequest], num_layers: int) -> list[Hashable]:
    """The paper's victim rule: the most KV blocks plus deposited tokens first."""
    return _newest_first_by(reqs, lambda q: -(q.blocks_per_layer * num_layers + q.deposit))


VICTIM_ORDERS = ("largest-kv+deposit", "longest", "shortest", "random")


def _random_order(reqs: Sequence[PlanRequest], seed: int) -> list[Hashable]:
    """A random order drawn afresh for each batch state, reproducibly: the generator is seeded by ``seed`` and the
    batch (its ids and token counts). A planner is built per solve, so a generator seeded by ``seed`` alone would
    deal every solve the same permutation, a fixed rule by batch position rather than a random one."""
    entropy = [seed, *(zlib.crc32(repr(q.request_id).encode()) for q in reqs), *(int(q.tokens) for q in reqs)]
    return [reqs[i].request_id for i in np.random.default_rng(entropy).permutation(len(reqs))]


def resolve_victim_order(
    name: str | VictimOrder, num_layers: int, seed: int = 0
) -> Callable[[Sequence[PlanRequest]], list[Hashable]]:
    """Resolve a victim rule: a name among :data:`VICTIM_ORDERS` or ``callable(requests) -> ids``."""
    if callable(name):
        return name
    if name == "largest-kv+deposit":
        return lambda reqs: _largest_kv_deposit(reqs, num_layers)
    if name == "longest":
        return lambda reqs: _newest_first_by(reqs, lambda q: -q.tokens)
    if name == "shortest":
        return lambda reqs: _newest_first_by(reqs, lambda q: q.tokens)
    if name == "random":
        return lambda reqs: _random_order(reqs, seed)
    raise ValueError(f"victim_order must be one of {VICTIM_ORDERS} or a callable, got {name!r}")


def _check_limits(space: str, window: tuple[int, int], block_size: int, alpha: float, capacity_blocks: float,
                  node_limit: int | None, expiry_node_limit: int | None, full_max_evals: int, gap: float,
                  time_limit_s: float | None) -> tuple[int, int]:
    """Validate the planner's arguments; returns the window as ``(min_steps, max_steps)``."""
    if space not in ("pruned", "uniform", "full"):
        raise ValueError(f"space must be 'pruned', 'uniform' or 'full', got {space!r}")
    if len(window) != 2 or not all(is_whole(w) for w in window):
        raise ValueError(f"window must be two whole numbers (min_steps, max_steps), got {window!r}")
    lo, hi = int(window[0]), int(window[1])
    if not 1 <= lo <= hi:
        raise ValueError(f"window must satisfy 1 <= min_steps <= max_steps, got {window}")
    if not is_whole(block_size) or block_size < 1:
        raise ValueError(f"block_size must be a whole number >= 1, got {block_size!r}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if not capacity_blocks >= 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    for name, limit in (("node_limit", node_limit), ("expiry_node_limit", expiry_node_limit)):
        if limit is not None and not (is_whole(limit) and limit >= 1):
            raise ValueError(f"{name} must be a whole number >= 1 (or None: unlimited), got {limit!r}")
    if full_max_evals < 1:
        raise ValueError(f"full_max_evals must be >= 1, got {full_max_evals}")
    if not gap >= 0:
        raise ValueError(f"gap must be >= 0, got {gap}")
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 or None, got {time_limit_s}")
    return lo, hi


class Planner:
    """Request-wise KV placement planner (paper section 4.3).

    ``space``: ``"pruned"`` (per-request distances, exact branch and bound), ``"uniform"`` (one distance
    for the whole batch, the Batch-Uniform ablation) or ``"full"`` (free per-layer masks; local search
    seeded from the pruned optimum, see :mod:`orbitflow.plan.full_search`).
    ``window``: ``(min_steps, max_steps)`` of the decode window. ``check_better``: whether expiry also
    looks for a strictly better plan at future block boundaries (one extra bounded search per boundary).
    Budgets (like a MILP solver's): ``node_limit`` branch-and-bound nodes for the main search and
    ``time_limit_s`` per :meth:`plan` call (None: unlimited), never spent before the first dive (one node per
    request) is done; a search cut by it keeps a fifth of it to polish its incumbent (``improve_evals``), which
    that polish gets even when the first dive ran past the limit, unless the search is still finding better plans
    than its first dive's when that fifth begins: then it searches on to the limit.
    When one runs out, the best plan found so far is returned with ``plan.stats.exact`` False and a
    certified ``stats.gap``: no plan of the space is faster than ``stats.lower_bound_s``; if none was
    found, the plan is infeasible (not proven: ``exact`` False) and the engine pauses a victim as for a proven
    one. ``gap`` (relative) stops the search once the incumbent is proven within it (0: exact). Each expiry
    search ("is some other plan strictly faster at this future step?") gets ``expiry_node_limit`` nodes
    (None: unlimited); an undecided one ends the plan's validity there (re-planning early is safe).
    ``improve_evals``: exact evaluations of the local improvement of the first incumbent (moves of one request's
    distance, the others refitted to the capacity, or of two requests' in opposite directions;
    :func:`orbitflow.plan.compiled.improve`) before the
    search; 0 turns it off. It only makes budgeted plans better and exact searches prune earlier.
    ``threads``: a search without a node limit (``node_limit=None``, compiled) splits its subtrees among this many
    threads (:meth:`BranchAndBound._search_parallel`): the same optimum, found sooner on a host with spare cores.
    ``compiled``: run the search and the step evaluator compiled (:mod:`orbitflow.plan.compiled`, numba,
    without the GIL); None: when numba is installed and ``ORBITFLOW_PLAN_COMPILED`` is not ``0``. Both give the
    same plans; the pure Python / NumPy path is the reference.
    ``token_deposit``: False when the engine delivers each token as it is generated (``--no-token-deposit``): then
    no step banks margin for a later one (the fluid balance is capped at 0, :mod:`orbitflow.plan.deposit`), and
    each step slower than a request's SLO is one violation of it.
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
        improve_evals: int = 256,
        threads: int = 1,
        token_deposit: bool = True,
    ) -> None:
        lo, hi = _check_limits(space, window, block_size, alpha, capacity_blocks, node_limit, expiry_node_limit,
                               full_max_evals, gap, time_limit_s)
        if not host_capacity_blocks >= 0:  # NaN read as unlimited, a negative value as "nothing ever fits"
            raise ValueError(f"host_capacity_blocks must be >= 0 (inf: unlimited), got {host_capacity_blocks}")
        self.constraints = Constraints(
            cost_model=cost_model, capacity_blocks=float(capacity_blocks),
            host_capacity_blocks=float(host_capacity_blocks),  # what the batch may hold on the host
            alpha=float(alpha), min_steps=lo, max_steps=hi, block_size=int(block_size), compiled=cc.enabled(compiled),
            token_deposit=bool(token_deposit),
        )
        self.cost_model = cost_model
        self.capacity_blocks = self.constraints.capacity_blocks
        self.host_capacity_blocks = self.constraints.host_capacity_blocks
        self.alpha = self.constraints.alpha
        self.min_steps, self.max_steps = lo, hi
        self.block_size = self.constraints.block_size
        self.compiled = self.constraints.compiled
        self.space = space
        self.check_better = check_better
        self.full_max_evals = int(full_max_evals)
        self.node_limit = node_limit
        self.time_limit_s = time_limit_s
        self.gap = float(gap)
        self.expiry_node_limit = expiry_node_limit
        if improve_evals < 0:
            raise ValueError(f"improve_evals must be >= 0, got {improve_evals}")
        self.improve_evals = int(improve_evals)
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.threads = int(threads)
        self._victims = resolve_victim_order(victim_order, cost_model.num_layers, seed)

    @property
    def num_layers(self) -> int:
        return self.cost_model.num_layers

    # ==== public entry points ===========================================================================
    def plan(self, requests: Sequence[PlanRequest], hint: Mapping[Hashable, int | None] | None = None,
             control: SearchControl | None = None) -> Plan:
        """Best feasible placement for the batch (see module docstring).

        ``hint``: offload distance per request id (typically the previous plan's, for the batch as it is now);
        the search tries it first, with requests it does not name at their greedy choice, so that a budget
        that runs out early still returns a plan at least as good. It changes no proven optimum (only which of
        equally fast plans is returned).
        ``control``: a :class:`~orbitflow.plan.search.SearchControl` another thread watches the solve with (its
        progress) and may stop it with, as a budget would (``orbitflow plan``'s Ctrl-C).
        """
        t0 = time.perf_counter()
        reqs = list(requests)
        _check_ids(reqs)
        if not reqs:
            comp = self.cost_model.compute(0 if self.cost_model.depends_on_tokens else None)
            return Plan((), Placement(np.ones((0, self.num_layers), bool)), (), True, self.max_steps, None,
                        float(comp.sum()))
        win = self.constraints.horizon(reqs)
        stats = PlanStats()
        deadline = None if self.time_limit_s is None else t0 + self.time_limit_s
        mask = self._search(win, stats, deadline, None if hint is None else [hint.get(q.request_id, -1) for q in reqs],
                            control)
        if mask is None:
            plan = Plan(tuple(q.request_id for q in reqs), None, None, False, 0, None, math.inf,
                        victims=tuple(self._victims(reqs)), stats=stats)
        else:
            plan = self._make_plan(reqs, win, mask, stats, search_better=self.check_better, deadline=deadline,
                                   control=control)
        stats.solve_s = time.perf_counter() - t0
        return plan

    def evaluate(self, placement: Placement, requests: Sequence[PlanRequest]) -> Plan:
        """Check a given placement against the constraints (no search; expiry = capacity only)."""
        reqs = list(requests)
        _check_ids(reqs)
        if placement.num_requests != len(reqs) or placement.num_layers != self.num_layers:
            raise ValueError(
                f"placement is {placement.num_requests}x{placement.num_layers}, "
                f"expected {len(reqs)}x{self.num_layers}"
            )
        win = self.constraints.horizon(reqs)
        return self._make_plan(reqs, win, placement.host.copy(), PlanStats(leaves=1), search_better=False)

    # ==== the plan of one host mask =====================================================================
    def _make_plan(
        self,
        reqs: list[PlanRequest],
        win: Horizon,
        host: np.ndarray,
        stats: PlanStats,
        search_better: bool,
        deadline: float | None = None,
        control: SearchControl | None = None,
    ) -> Plan:
        rules = self.constraints
        mem_all = rules.memory(host, win.blocks)
        over = rules.first_over(host, win.blocks, mem_all)
        expiry: int | None = int(over[0]) if over.size and over[0] >= 1 else None
        cap_max = min(int(over[0]), win.horizon) if over.size else win.horizon  # no window is longer
        seg_lat = rules.seg_latencies(win, host, upto=max(1, sum(1 for s in win.seg_starts if s < cap_max)))
        window, viol = rules.window_of(win, host, seg_lat, over)
        feasible = window > 0
        if feasible and search_better and self.space != "uniform":
            # only boundaries inside the window matter (the runtime re-plans at its end), and the window
            # never reaches the capacity expiry
            better_at = self._better_expiry(reqs, win, host, seg_lat, window, stats, deadline, control)
            if better_at is not None:
                expiry = better_at
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
            step_latencies_s=tuple(win.step_latencies(seg_lat)[: max(shown, 1)]),
            violations=viol,
            memory_blocks=float(mem_all[0]),
            peak_memory_blocks=float(mem_all[max(shown, 1) - 1]),  # the last window step: blocks only grow
            host_blocks=float(host.sum(axis=1) @ win.blocks[0]),
            victims=() if feasible else tuple(self._victims(reqs)),
            stats=stats,
        )

    # ==== expiry ========================================================================================
    def _better_expiry(
        self,
        reqs: list[PlanRequest],
        win: Horizon,
        host: np.ndarray,
        seg_lat: list[float],
        stop: int,
        stats: PlanStats,
        deadline: float | None = None,
        control: SearchControl | None = None,
    ) -> int | None:
        """First block boundary before ``stop`` at which some feasible plan is strictly faster (None if none), but
        not before ``min_steps``: the paper's Delta_min, the fewest steps between two solves (a boundary before it
        is searched at ``min_steps``, the batch as it will be then).

        Every boundary is searched unless the plan is stall-free there: the executor's schedule is not
        monotone in transfer sizes, and token-dependent compute can hide other plans' transfers, so a plan
        whose own stall did not grow can still be overtaken.
        """
        rules = self.constraints
        searched = 0
        for t in win.boundaries:
            t = max(t, rules.min_steps)
            if t >= stop:
                break
            if t == searched:
                continue  # several boundaries before min_steps: searched once, there
            searched = t
            if (deadline is not None and time.perf_counter() > deadline) or (control is not None and control.stopped):
                # out of time, or stopped: end the plan here
                stats.expiry_exact = False
                return t
            # the batch as it will be at step t (finished requests stop growing)
            win_t = rules.horizon_after(win, seg_lat, t)
            cur = rules.seg_latencies(win_t, host, upto=1)[0]
            if cur <= float(win_t.comp[0].sum()) * (1 + REL_TOL) + 1e-15:
                continue  # nothing can beat a stall-free step
            sub = PlanStats()
            found = first_better(rules, win_t, sub, cur * (1 - 1e-9), gap=self.gap, node_limit=self.expiry_node_limit,
                                 deadline=deadline, control=control)
            stats.nodes += sub.nodes
            stats.expiry_searches += 1
            if found:
                return t
            if not sub.exact:  # undecided within the budget: end the plan here to be safe
                stats.expiry_exact = False
                return t
        return None

    # ==== searches ======================================================================================
    def _search(self, win: Horizon, stats: PlanStats, deadline: float | None, hint: list | None,
                control: SearchControl | None = None) -> np.ndarray | None:
        """The host mask of the best plan of the planner's space (None: none is feasible)."""
        if self.space == "uniform":
            return self._solve_uniform(win, stats)
        mask = best_plan(self.constraints, win, stats, gap=self.gap, node_limit=self.node_limit, deadline=deadline,
                         hint=hint, improve_evals=self.improve_evals, threads=self.threads, control=control)
        if mask is not None and self.space == "full":
            mask = improve_full(self.constraints, win, mask, stats, deadline, self.full_max_evals)
        return mask

    def _solve_uniform(self, win: Horizon, stats: PlanStats) -> np.ndarray | None:
        """Exhaustive search of the one-distance-for-all space (the Batch-Uniform ablation)."""
        rules = self.constraints
        hosts = candidate_tables(self.num_layers).hosts
        n_req = win.blocks.shape[1]
        best = None
        best_key = (math.inf, math.inf)
        for row in hosts:
            host = np.repeat(row[None, :], n_req, axis=0)
            stats.leaves += 1
            seg_lat = rules.seg_latencies(win, host)
            if rules.window_of(win, host, seg_lat)[0] == 0:
                continue
            key = (seg_lat[0], float(host.sum(axis=1) @ win.blocks[0]))
            if better(key, best_key):
                best, best_key = host, key
        stats.exact = True  # every candidate was evaluated
        if best is not None:
            stats.lower_bound_s, stats.gap = best_key[0], 0.0
        return best


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
    # a search cut by its budget: the local improvement's kernels (inside compiled.best_found), and with a deadline
    # (BranchAndBound, which calls them from Python, the root's probes too)
    model = CostModel([1e-3] * 8, link_blocks_per_s=8e3)
    requests = [PlanRequest("a", 8, 120, 40, 0.0, 2e-2), PlanRequest("b", 4, 60, 40, 0.0, 2e-2),
                PlanRequest("c", 6, 90, 40, 0.0, 2e-2)]
    Planner(model, capacity_blocks=100, window=(1, 4), node_limit=1).plan(requests)
    Planner(model, capacity_blocks=100, window=(1, 4), node_limit=1, time_limit_s=10.0).plan(requests)
    # ... and by its deadline: the kernels' clock
    Planner(model, capacity_blocks=100, window=(1, 4), node_limit=None, time_limit_s=1e-9).plan(requests)
    # two prefetch slots: the search's bounds are not the compiled ones there (its moves run from Python)
    Planner(model.with_updates(prefetch_slots=2), capacity_blocks=120, window=(1, 4), node_limit=1).plan(requests)
    # a plan whose window passes a block boundary where it stalls: the expiry check's search (search.first_better)
    grows = [PlanRequest(q.request_id, q.blocks_per_layer, 16 * q.blocks_per_layer, 40, 0.0, 2e-2) for q in requests]
    Planner(model, capacity_blocks=100, window=(2, 16)).plan(grows)
    # a batch that fits with nothing offloaded: a search with a deadline tries that plan from Python, the only call of
    # try_assignment's dispatcher (the searches above call it inside compiled code), whose load a first real solve
    # paid otherwise (25-65 ms)
    Planner(model, capacity_blocks=1000, window=(1, 4), time_limit_s=10.0).plan(requests)
    # a fixed placement's evaluation (the baselines), at one and at two prefetch slots (DeepSpeed's depth)
    for slots in (1, 2):
        planner = Planner(model.with_updates(prefetch_slots=slots), capacity_blocks=100, window=(1, 4))
        planner.evaluate(Placement.from_distances(8, [1, 2, 4]), requests)
    _warm = True
