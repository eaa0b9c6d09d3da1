"""Exact branch and bound over the pruned placement space (one candidate distance per request).

Requests are assigned in decreasing order of size; the children of a node are the candidate distances of
the next request, evaluated all at once with NumPy. A node is cut when

* capacity cannot hold at step ``min_steps - 1`` even if every unassigned request offloads all its layers
  (memory only falls when a layer is offloaded: the resident part drops by ``b_r``, the buffer grows by at
  most ``b_r``), or
* a lower bound on the step-0 latency of every completion is no better than the incumbent in
  (latency, moved blocks), or cannot meet the SLO cap even as a constant per-step latency.

The latency bound of a child is the largest of

* link: layer ``l`` cannot start before the link moved every host block of layers ``<= l`` from t=0, then
  layers ``l..L-1`` still run, and each later layer ``l'`` whose request also offloads ``l'-1`` waits for
  that transfer after layer ``l'-1`` ends: ``W(l) + sum_{k>=l} comp_k + sum_{l'>l} P(l')`` with ``P(l')``
  the transfer seconds of back-to-back host layers at ``l'``;
* forced volume: the unassigned requests must together offload at least ``y`` blocks for capacity to hold,
  so the link moves at least ``W(L-1)`` plus the cheapest fractional cover of ``y``
  (:func:`orbitflow.plan.bounds.cover_cost`) before the last host layer runs (``+ min comp``);
* chain: each request's own transfers are serialised with its compute (single buffer slot);
* separable window bounds (:func:`orbitflow.plan.bounds.separable_tables`): for each tiling of the layers
  into windows, a sum of per-request terms; the assigned requests count exactly, the unassigned ones as the
  cheapest fractional way to offload ``y`` blocks (a convex hull). Their offload is priced at their blocks now
  (``b0``) while capacity counts their blocks at step ``min_steps - 1`` (``bcap``), so the hull is read twice: scaled
  by the least ``b0 / bcap`` among them, and weighted by ``bcap`` less the blocks that grow by then (each costs at
  most every transfer of the densest candidate); the larger holds. The scaled reading alone let one 8-block request
  about to grow a ninth loosen every bound by up to a ninth. This is the bound that does the pruning high in the
  tree, where most requests are still unassigned.

The first three treat unassigned requests as offloading nothing (every term only grows when a host layer
is added), so they bound every completion. Deep in the tree (the requests left unassigned hold at most
``DP_REST_SHARE`` of the batch's blocks per layer, once the first dive is done; always at the last request) the
children that survive also get the propagated release/need bound (:func:`orbitflow.plan.bounds.dp_bound`,
vectorised over children; the compiled search first takes its max at one release layer per layer, those that
gave it last time, and runs it whole only on the children that cheaper bound does not prune), with each unassigned
request at the host layers common to every candidate it can still fit with (when capacity leaves a small request
no candidate but the densest ones, their shared layers already cost it a transfer per layer). Where two or more
requests are left unassigned, the children that bound leaves within reach also get the tail bound
(:meth:`BranchAndBound._tail_bound`): the value of the bound's critical path of windows plus the least the unassigned
requests can add on it while freeing the blocks capacity forces them to free (a linear relaxation of their joint
choice), skipped at depths where it seldom prunes; at the (16, 80) batches it prunes 19-68% of the children it
prices and a proof takes 2-3x fewer nodes. At the last request
those that survive it are run through the exact schedule (stopped part-way once slower than the incumbent) and the
window rule. Nodes are expanded depth first, cheapest bound first; at the root, where the bounds see every other
request unassigned and often tie, a search without a tight deadline visits the first request's candidates by probe
instead
(:meth:`BranchAndBound._probe_root`: the incumbent with that request moved there, the others repaired, priced by
the exact schedule).

Incumbents: before the search, the hint (the previous plan), the greedy by transfer-to-compute ratio and the
sparsest uniform distance that fits, the last two tightened (every request made as sparse as capacity allows:
the optima fill it, since the link is most of a step). Local improvement
(:meth:`BranchAndBound._improve`, compiled :func:`orbitflow.plan.compiled.improve`: one request to any candidate,
the others made denser to keep capacity and then as sparse as it allows, or two requests one candidate each in
opposite directions; an improving feasible move is taken at once) polishes the incumbent of a search that was cut
short, in a share (``IMPROVE_SHARE``) of the time left kept for it, and the first incumbent of a search without a
node budget over a big space. A search that is still finding better plans than its first dive's when that share
begins (a leaf after the first dive became the incumbent) keeps searching to the deadline instead: the share is a
hedge for a search stuck on its first plan (at (R, L) = (4, 32) and 1 ms it took one batch from 25% above the optimum
to 0), and a search that still gains needs the time more (another batch went from 12 in 40 cut solves 6.6% above the
optimum to none). It only ever replaces the incumbent by a strictly better feasible plan, so no proven
optimum changes.

Budgets (node count, deadline) stop the search with the incumbent; the least bound among the children left
unexplored then certifies its gap.
On the compiled path a search runs in one kernel call where it can (:func:`best_plan`: no deadline, no threads;
:func:`first_better`: an expiry check's), its set-up included, so it holds the GIL only to gather its inputs;
:class:`BranchAndBound` runs the others, calling the kernels piece by piece, and is the reference for both.
A search without a node limit may use several threads (``threads``; :meth:`BranchAndBound._search_parallel`): past
``PARALLEL_AFTER`` nodes it gives the open subtrees at the top of its stack to other threads, which share the
incumbent and take work from each other; the same optimum, found sooner where cores are spare.
Identical requests (same sizes over the window, deposit and SLO) are interchangeable where the link treats them alike
(:meth:`BranchAndBound._interchangeable`: the preemptive link always, the EDF link when their indices are adjacent), so
their offload counts are forced non-increasing along the search order.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from orbitflow.plan import compiled as cc
from orbitflow.plan.bounds import (
    TAIL_AVERAGE,
    TAIL_MIN,
    TAIL_MIN_RATE,
    TAIL_PROBE,
    CoverTables,
    SeparableTables,
    count_matrix,
    cover_cost,
    cover_tables,
    critical_windows,
    dp_bound,
    separable_tables,
    tail_cover,
)
from orbitflow.plan.cost_model import host_layers_s
from orbitflow.plan.horizon import Constraints, Horizon
from orbitflow.plan.placement import distance_row, memory_blocks, pruned_distances
from orbitflow.plan.types import REL_TOL, PlanStats, better

PAUSE_S = 1e-4  # kernels without a clock (compiled.HAVE_CLOCK) under a deadline: seconds between its checks (about)
PAUSE_EVERY = 256  # ... and at most this many nodes / evaluations
BIG_SPACE = 10**6  # assignments of the pruned space above which an exact search polishes its first incumbent
DP_REST_SHARE = 0.05  # the propagated bound (dp_bound) where the unassigned requests hold at most this share
IMPROVE_SHARE = 0.2  # of the time left when a search with a deadline starts: kept for the local improvement
PROBE_SHARE = 0.1  # of the time left to a deadline: the most the root's probes may be expected to take
PROBE_S = 6e-9  # seconds per K * R^2 * L the root's probes take (measured: 3.5-6 ns, (4, 32) to (16, 80))
PARALLEL_AFTER = 4096  # nodes a search that may use threads runs alone first (most searches end before)
SYNC_NODES = 1024  # nodes a thread of a parallel search runs between two looks at the shared incumbent
PACED_FIRST = 16  # ... its first chunk where the kernels have no clock (then paced_chunk, at most SYNC_NODES)
WATCH_S = 0.05  # a search watched by a SearchControl: seconds between two looks at it (about)
WATCH_FIRST = 64  # ... nodes before its first look (a (16, 80) batch's first dive takes 17)


class SearchControl:
    """A handle on a solve for another thread (``Planner.plan(..., control=)``): :meth:`stop` ends its searches at their
    next look (about every ``WATCH_S`` seconds; each thread of a parallel search every ``SYNC_NODES`` nodes), as a
    spent budget ends them: the best plan found so far is returned, ``stats.exact`` False, with the gap its search
    certifies (an expiry search stopped ends the plan's validity there, to be safe). The first dive is never stopped,
    and the bounded work around the search (seeds, probes, local improvement) is not looked at. A search stopped
    before it found a feasible plan returns an infeasible one that proves nothing (``stats.exact`` False). ``nodes``
    and ``best_s`` follow the main search: its nodes so far and its incumbent's step-0 latency (inf before it has
    one). The plan is the same as without a control when nobody stops it."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.nodes = 0
        self.best_s = math.inf

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()


def watch_chunk(now: float, since: float, units: int) -> int:
    """Units of work (search nodes) to run before a watched search's next look: about ``WATCH_S`` seconds at the cost
    per unit of the last chunk (``units`` done since ``since``); at least 1."""
    per = (now - since) / max(units, 1)
    return int(max(1, min(1 << 40, WATCH_S / per))) if per > 0 else SYNC_NODES


def paced_chunk(now: float, since: float, units: int, deadline: float) -> int:
    """Units of work (search nodes, evaluations) to run before the next deadline check: about ``PAUSE_S`` seconds
    at the cost per unit of the last chunk (``units`` done since ``since``), not past the deadline by more than
    one unit; at least 1, at most ``PAUSE_EVERY``. A node's cost varies a hundredfold with R and L, so a fixed
    count would overshoot a 1 ms budget at (16, 80) or check the clock every few microseconds at (4, 32)."""
    per = (now - since) / max(units, 1)
    if per <= 0:
        return PAUSE_EVERY
    return int(max(1, min(PAUSE_EVERY, PAUSE_S / per, max(deadline - now, 0.0) / per + 1)))


def prunable(lb: float, moved_lb: float, best: tuple[float, float], gap: float = 0.0) -> bool:
    """Whether no completion with latency ``>= lb`` and moved blocks ``>= moved_lb`` can beat ``best``
    (with ``gap > 0``: by more than the relative ``gap``)."""
    if not math.isfinite(best[0]):
        return False
    if gap > 0:
        return lb >= best[0] * (1 - gap)
    tol = REL_TOL * max(abs(best[0]), 1.0)
    if lb > best[0] + tol:
        return True
    if lb >= best[0] - tol:
        return moved_lb >= best[1] - 1e-9
    return False


class CandidateTables(NamedTuple):
    """Per-L tables of the pruned candidates ``k`` (in increasing offload count); all read-only."""

    distances: tuple[int | None, ...]
    hosts: np.ndarray  # [K, L] bool, True = offloaded
    hosts_f: np.ndarray  # same, float
    counts: np.ndarray  # [K] offload counts
    cumh: np.ndarray  # [K, L] host layers among 0..l
    pairs_after: np.ndarray  # [K, L] back-to-back host layer pairs at layers > l
    lists: tuple[tuple[int, ...], ...]  # host layers of each candidate
    mats: np.ndarray  # [K, L+1, L] release/need transfer counts (bounds.count_matrix)
    gap_first: np.ndarray  # [K, J] chain gaps as (cum index of start, cum index of end), padded
    gap_last: np.ndarray
    sep: SeparableTables
    lay_ptr: np.ndarray  # [K+1] CSR of ``lists`` (compiled search)
    lay: np.ndarray
    least_mats: np.ndarray  # [K, L+1, L] count_matrix of the host layers common to candidates k.. (all denser ones)
    mats_t: np.ndarray  # [K, L, L+1] mats and least_mats transposed (the compiled search's layout)
    least_t: np.ndarray
    least_cum: np.ndarray  # [K, L] host layers among 0..l of least_mats' rows (the compiled search's hinted bound)


@lru_cache(maxsize=64)
def candidate_tables(num_layers: int) -> CandidateTables:
    """The tables of :class:`CandidateTables` for ``num_layers`` layers (cached)."""
    dists = tuple(pruned_distances(num_layers))
    hosts = np.stack([~distance_row(num_layers, d) for d in dists])
    hosts_f = hosts.astype(float)
    counts = hosts.sum(axis=1)
    cumh = np.cumsum(hosts_f, axis=1)
    # back-to-back host layers l-1, l: that transfer is released when layer l-1 ends and needed by layer l
    pairs = np.zeros_like(hosts_f)
    pairs[:, 1:] = hosts_f[:, 1:] * hosts_f[:, :-1]
    pairs_after = np.cumsum(pairs[:, ::-1], axis=1)[:, ::-1] - pairs  # pairs at layers > l
    lists = tuple(tuple(int(i) for i in np.flatnonzero(h)) for h in hosts)
    mats = np.stack([count_matrix(h) for h in hosts])
    # chain gaps (compute that can hide each transfer) as index pairs into the cumulative compute:
    # gap = cum[last] - cum[first]
    width = max(1, int(counts.max()))
    gap_first = np.zeros((len(dists), width), dtype=np.int64)
    gap_last = np.zeros((len(dists), width), dtype=np.int64)
    for k, hl in enumerate(lists):
        for j, layer in enumerate(hl):
            gap_first[k, j] = hl[j - 1] + 1 if j else 0
            gap_last[k, j] = layer
    # the densest candidate (last) offloads every layer another does, so it counts the most transfers of every tiling:
    # the separable bound's correction for blocks that grow reads its row as that most (tests/plan/test_bounds.py)
    sep = separable_tables(mats, counts)
    lay_ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    lay = np.array([i for hl in lists for i in hl], dtype=np.int64)
    common = np.logical_and.accumulate(hosts[::-1], axis=0)[::-1]  # layers offloaded by every candidate k..
    least_mats = np.stack([count_matrix(h) for h in common])
    mats_t, least_t = (np.ascontiguousarray(m.transpose(0, 2, 1)) for m in (mats, least_mats))
    least_cum = np.cumsum(common.astype(float), axis=1)
    for a in (hosts, hosts_f, counts, cumh, pairs_after, mats, gap_first, gap_last, lay_ptr, lay, least_mats, mats_t,
              least_t, least_cum):
        a.setflags(write=False)
    return CandidateTables(dists, hosts, hosts_f, counts, cumh, pairs_after, lists, mats, gap_first, gap_last, sep,
                           lay_ptr, lay, least_mats, mats_t, least_t, least_cum)


class ComputeTables(NamedTuple):
    """What a search reads of one step's per-layer compute (:func:`compute_tables`)."""

    comp0: np.ndarray  # per-layer seconds (a writable copy: the kernels' signatures take writable arrays)
    comp0_list: tuple[float, ...]
    total: float
    least: float  # the least layer's
    suffix: np.ndarray  # sum_{k>=l} comp_k (compiled.tail's floats)
    cum: np.ndarray  # [0, comp_0, comp_0 + comp_1, ...]
    sep_off: np.ndarray  # the separable bound's offsets (separable_tables)
    gaps: np.ndarray  # [K, G] compute between a candidate's consecutive host layers (inf past its last gap)


def compute_tables(comp0: np.ndarray, n_layers: int) -> ComputeTables:
    """The tables of ``comp0`` (per-layer seconds of one step), memoised by value: without token-dependent compute
    every search of a batch size reads the same step (a horizon's expiry checks and the next solves too). Nothing
    writes into them (the kernels only read these arguments)."""
    return _compute_tables(np.ascontiguousarray(comp0, dtype=float).tobytes(), n_layers)


@lru_cache(maxsize=256)
def _compute_tables(comp_bytes: bytes, n_layers: int) -> ComputeTables:
    comp0 = np.frombuffer(comp_bytes, dtype=float).copy()
    tables = candidate_tables(n_layers)
    total = float(comp0.sum())
    cum = np.concatenate(([0.0], np.cumsum(comp0)))
    gaps = cum[tables.gap_last] - cum[tables.gap_first]
    gaps[tables.counts[:, None] <= np.arange(gaps.shape[1])[None, :]] = np.inf  # padding
    return ComputeTables(comp0, tuple(comp0.tolist()), total, float(comp0.min()), cc.tail(comp0), cum,
                         total - tables.sep.between @ cum, gaps)


def search_capacity(rules: Constraints) -> float:
    """The device budget the searches check (with the capacity equation's tolerance)."""
    return rules.capacity_blocks * (1 + REL_TOL) + 1e-9


def chain_bounds(x0: np.ndarray, compute: ComputeTables) -> np.ndarray:
    """Per request and candidate, the chain stall lower bound (its transfers serialised with its compute) [R, K]; the
    kernels' twin is :func:`orbitflow.plan.compiled.chain_bounds`."""
    return np.maximum(x0[:, None, None] - compute.gaps[None], 0.0).sum(axis=2)


def feasibility(rules: Constraints, win: Horizon, tables: CandidateTables, cap: float) -> tuple:
    """The window rule's data for the compiled kernels (:func:`orbitflow.plan.compiled.feasibility_data`)."""
    comp, tails, sums, xfer = win.rows()  # [S, L], [S, L], [S], [S, R]
    cm = rules.cost_model
    return cc.feasibility_data(
        tables.counts, tables.hosts_f, tables.lay_ptr, tables.lay, win.blocks[: win.horizon], cap,
        rules.host_capacity_blocks, rules.alpha, rules.min_steps, win.horizon, win.seg_starts_a, win.seg_ends_a, comp,
        tails, sums, xfer, win.slo, win.deposit, win.compute_grows, cm.host_layer_s, cm.transfer == "preemptive",
        win.bank_max)


_LINK_KIND = {"edf": cc.EDF_LINK, "preemptive": cc.PREEMPTIVE_LINK}


def first_better(rules: Constraints, win: Horizon, stats: PlanStats, upper: float, *, gap: float = 0.0,
                 node_limit: int | None = None, deadline: float | None = None,
                 control: SearchControl | None = None) -> bool:
    """Whether some feasible plan of ``win`` beats ``upper`` at step 0: ``BranchAndBound(..., first_only=True)``'s
    search (the planner's expiry check), its nodes, leaves and exactness into ``stats``. On the compiled path it runs
    in one call (:func:`orbitflow.plan.compiled.first_better`: the same search, its set-up included, without the
    GIL); otherwise, where the kernels cannot read a deadline's clock, or watched by a ``control``, through
    :class:`BranchAndBound`."""
    if not _in_one_call(rules) or not (deadline is None or cc.HAVE_CLOCK) or control is not None:
        return BranchAndBound(rules, win, stats, upper, first_only=True, gap=gap, node_limit=node_limit,
                              deadline=deadline, control=control).run() is not None
    ist, clock = _kernel_state(node_limit)
    found = cc.first_better(ist, upper, gap, cc.kernel_deadline(deadline, clock), *_kernel_inputs(rules, win), clock,
                            np.zeros(win.blocks.shape[1], dtype=np.int64))
    _count_nodes(stats, ist)
    return bool(found)


def best_plan(rules: Constraints, win: Horizon, stats: PlanStats, *, gap: float = 0.0, node_limit: int | None = None,
              deadline: float | None = None, hint: list | None = None, improve_evals: int = 0,
              threads: int = 1, control: SearchControl | None = None) -> np.ndarray | None:
    """The host mask of the best plan of the pruned space for ``win`` (None: none is feasible), the search's
    statistics into ``stats``: ``BranchAndBound(...).run()``. Without a deadline, threads or a ``control`` (the
    engine's solves) on the compiled path it runs in one call (:func:`orbitflow.plan.compiled.best_found`: the same
    search, its set-up, seeds and improvement included, without the GIL)."""
    if (not _in_one_call(rules) or deadline is not None or (threads > 1 and node_limit is None)
            or control is not None):
        return BranchAndBound(rules, win, stats, gap=gap, node_limit=node_limit, deadline=deadline, hint=hint,
                              improve_evals=improve_evals, threads=threads, control=control).run()
    t = candidate_tables(rules.num_layers)
    k_of_dist = {d: k for k, d in enumerate(t.distances)}
    hint_k = np.array([-1 if h == -1 else k_of_dist.get(h, -1) for h in hint or ()], dtype=np.int64)
    ist, clock = _kernel_state(node_limit)
    fst, best_k, evals = np.zeros(cc.N_FST), np.zeros(win.blocks.shape[1], dtype=np.int64), np.zeros(1, np.int64)
    improve_first = node_limit is None and len(t.counts) ** best_k.size > BIG_SPACE  # as BranchAndBound.run
    found = cc.best_found(ist, fst, gap, *_kernel_inputs(rules, win), clock,
                          hint_k if hint is not None else best_k, hint is not None, improve_evals, improve_first,
                          best_k, evals)
    _count_nodes(stats, ist)
    stats.improve_evals += int(evals[0])
    if found == 0:
        return None
    best = float(fst[cc.BEST_LAT])
    lower = best if found == 2 else min(best, float(fst[cc.OPEN_LB]))  # 2: nothing offloaded, provably optimal
    if gap > 0 and found == 1:  # as BranchAndBound.run: cut by the gap rule, only known to be >= best * (1 - gap)
        lower = min(lower, best * (1 - gap))
        if lower < best:
            stats.exact = False
    stats.lower_bound_s = lower
    stats.gap = (best - lower) / best if best > 0 else 0.0
    return t.hosts[best_k]


def _in_one_call(rules: Constraints) -> bool:
    """Whether the compiled kernels run a search whole (the one-slot links their bounds are proven for)."""
    cm = rules.cost_model
    return rules.compiled and cm.transfer in _LINK_KIND and cm.prefetch_slots == 1


def _kernel_state(node_limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A search kernel's integer state (its node limit set; -1: none) and clock."""
    ist = np.zeros(cc.N_IST, dtype=np.int64)
    ist[cc.NODE_LIMIT] = -1 if node_limit is None else node_limit
    return ist, cc.clock_scratch()


def _kernel_inputs(rules: Constraints, win: Horizon) -> tuple:
    """What :func:`orbitflow.plan.compiled.first_better` and ``best_found`` read of the planner and the horizon, from
    ``share`` to ``feas`` (the tables and floats ``BranchAndBound`` builds)."""
    cm, t = rules.cost_model, candidate_tables(rules.num_layers)
    ct = compute_tables(np.asarray(win.comp[0], dtype=float), rules.num_layers)
    b0, cap = win.blocks[0], search_capacity(rules)
    x0 = cm.transfer_s(b0)
    return (DP_REST_SHARE, _LINK_KIND[cm.transfer], cap, cm.link_blocks_per_s, b0, win.blocks[rules.min_steps - 1], x0,
            ct.gaps, win.blocks, win.deposit, win.slo,
            bool(np.isfinite(win.slo).any() and win.compute_grows), rules.alpha, rules.min_steps, rules.max_steps,
            ct.comp0, ct.total, ct.least, ct.suffix, ct.sep_off, t.counts, t.hosts_f, t.cumh, t.pairs_after, t.mats_t,
            t.sep.n, t.sep.slope, t.sep.icept, t.lay_ptr, t.lay, t.least_t, t.least_cum,
            feasibility(rules, win, t, cap))


def _count_nodes(stats: PlanStats, ist: np.ndarray) -> None:
    """A search kernel's nodes and leaves into ``stats`` (as BranchAndBound counts them), and whether its budget cut
    it."""
    stats.leaves += int(ist[cc.LEAVES])
    stats.nodes += int(ist[cc.NODES] - ist[cc.LEAVES])
    if ist[cc.HIT]:
        stats.exact = False


class _Children(NamedTuple):
    """The children of one search node, per candidate ``k`` of the next request (arrays over ``k``)."""

    x: float  # seconds to move one layer of the next request
    alive: np.ndarray  # can fit the capacity equation
    lat_lb: np.ndarray  # lower bound on the step-0 latency of every completion
    key: np.ndarray  # the visiting order (cheapest first): a weaker bound (see _bound_children)
    res: np.ndarray  # resident blocks of the assigned requests
    buf: np.ndarray  # [k, L] buffer blocks per layer of the assigned requests
    vol: np.ndarray  # [k, L] link bound terms (see the module docstring)
    after: np.ndarray
    chain: np.ndarray
    moved: np.ndarray  # blocks moved per step by the assigned requests
    sep: np.ndarray  # [S, k] separable bound terms


class BranchAndBound:
    """One exact search of the pruned space for a horizon; :meth:`run` returns the host mask or None. ``control``:
    another thread's handle on it (:class:`SearchControl`: its progress out, a stop in, looked at every ``WATCH_S``)."""

    def __init__(
        self,
        rules: Constraints,
        win: Horizon,
        stats: PlanStats,
        upper: float = math.inf,
        first_only: bool = False,
        *,
        gap: float = 0.0,
        node_limit: int | None = None,
        deadline: float | None = None,
        hint: list | None = None,
        improve_evals: int = 0,
        threads: int = 1,
        control: SearchControl | None = None,
    ) -> None:
        self.rules, self.win, self.stats, self.control = rules, win, stats, control
        self.threads = threads  # a search without a node limit splits its subtrees among them (_search_parallel)
        self.first_only, self.gap, self.hint = first_only, gap, hint
        self.node_limit = node_limit  # None: unlimited
        self.deadline = deadline  # time.perf_counter() value after which the search stops
        self.improve_deadline = deadline  # ... and the local improvement of its incumbent, when it was cut
        self.gained = False  # a leaf after the first dive became the incumbent: the search runs to improve_deadline
        self.timed_out = False  # the search was stopped by its deadline
        self.improve_s = 0.0  # the improvement's share of the budget, which it gets even past the deadline
        if deadline is not None and improve_evals > 0 and not first_only:  # keep a share for the improvement
            self.improve_s = IMPROVE_SHARE * max(0.0, deadline - time.perf_counter())
            self.deadline = deadline - self.improve_s
        self.nodes = 0
        self.n_layers = rules.num_layers
        self.tables = tables = candidate_tables(self.n_layers)
        self.hosts, self.hosts_f, self.counts = tables.hosts, tables.hosts_f, tables.counts
        self.cumh, self.pairs_after, self.lists, self.mats = tables.cumh, tables.pairs_after, tables.lists, tables.mats
        cm = rules.cost_model
        # the latency bounds are proven for ONE prefetch slot per request only (the preemptive link's latency is the
        # release/need bound); at a deeper prefetch the search keeps just the capacity cut (exact, weaker pruning)
        self.one_slot = cm.transfer in ("edf", "preemptive") and cm.prefetch_slots == 1
        self.link = cm.link_blocks_per_s
        self.b0 = win.blocks[0]
        self.bcap = win.blocks[rules.min_steps - 1]
        self.n_req = self.b0.size
        self.cap = search_capacity(rules)
        self._init_compute(np.asarray(win.comp[0], dtype=float))
        self._init_order()
        self._init_bound_tables()
        self.lat_ok = rules.lat_prefilter(win)
        self.compiled = rules.compiled and self.one_slot
        self.best_host: np.ndarray | None = None
        self.best_k: np.ndarray | None = None  # the incumbent's candidate per request
        self.best_key = (upper, math.inf)
        self.improve_evals = improve_evals
        self._feas_data: tuple | None = None
        self.choice = [0] * self.n_req
        self.done, self.dive_start = False, 0
        self.open_lb = math.inf  # least lower bound of the subtrees left unexplored when the budget ran out
        self.trace: list | None = None  # tests: (assigned candidates, children's bounds, children alive)
        # per depth: the share of the children the tail bound prunes (a moving average), nodes since it last ran
        self.tail_rate = np.repeat([[1.0, 0.0]], self.n_req, axis=0)
        self.root_probe = np.zeros(len(self.counts))  # the first request's visiting order (_probe_root)
        self.clock = cc.clock_scratch()  # the compiled kernels read the time into it

    def _init_compute(self, comp0: np.ndarray) -> None:
        """Step 0's per-layer compute and transfer times, as the bounds and the leaves read them."""
        self.compute = ct = compute_tables(comp0, self.n_layers)
        self.comp0, self.comp0_list, self.comp_total, self.comp_min = ct.comp0, ct.comp0_list, ct.total, ct.least
        self.suffix_comp = ct.suffix  # sum_{k>=l} comp_k
        self.x0 = self.rules.cost_model.transfer_s(self.b0)  # per transfer, with the link's fixed latency
        self.preemptive = self.rules.cost_model.transfer == "preemptive"
        # requests by transfer-to-compute ratio, lowest first (the greedy's order): what tightening and the local
        # improvement's moves walk
        self.ratio_order = np.argsort(self.x0, kind="stable")
        self.x0_list = self.x0.tolist()

    def _init_order(self) -> None:
        """Search order: larger requests first; identical requests adjacent, in index order (symmetry breaking,
        where swapping two of them cannot change a plan's latency: :meth:`_interchangeable`)."""
        win, n_req = self.win, self.n_req
        cols = win.blocks.T.tolist()
        sig = [(tuple(cols[r]), float(win.deposit[r]), float(win.slo[r])) for r in range(n_req)]
        self.order = sorted(range(n_req), key=lambda r: (-self.bcap[r], -self.b0[r], sig[r], r))
        self.same_as_prev = [d > 0 and sig[self.order[d]] == sig[self.order[d - 1]]
                             and self._interchangeable(self.order[d - 1], self.order[d]) for d in range(n_req)]

    def _interchangeable(self, i: int, j: int) -> bool:
        """Whether swapping the placements of identical requests ``i < j`` leaves every step's latency as it is.
        The preemptive link's layer finishes are sums over requests: always. The EDF link moves the copies a layer
        needs in request order, and one of another size between them changes when the link next chooses, so a copy
        released meanwhile may get it or wait (one test batch: 40 against 41 for the mirror plan): only when no
        request lies between them. The fair link breaks ties by request index too: never."""
        transfer = self.rules.cost_model.transfer
        return transfer == "preemptive" or (transfer == "edf" and j == i + 1)

    def _init_bound_tables(self) -> None:
        """What the node bounds read for the unassigned requests (suffixes in search order) and the separable
        and chain bounds' per-request tables."""
        o, tables = self.order, self.tables
        if self.rules.compiled:  # the same tables in one call (compiled.suffix_tables)
            *suffixes, cov_cap, cov_cost, cov_rate, cov_size = cc.suffix_tables(
                np.asarray(o, dtype=np.int64), self.bcap, self.b0, self.x0, self.n_layers, DP_REST_SHARE)
            self.rest_b, self.rest_b0, self.ratio_suffix, self.rest_grow, self.dp_depth = suffixes
            self.cover = CoverTables(cov_cap, cov_cost, cov_rate, cov_size)
        else:
            self.rest_b = np.concatenate((np.cumsum(self.bcap[o][::-1])[::-1], [0.0]))
            self.rest_b0 = np.concatenate((np.cumsum(self.b0[o][::-1])[::-1], [0.0]))
            ratio = np.where(self.bcap > 0, self.b0 / np.maximum(self.bcap, 1e-300), 1.0)
            self.ratio_suffix = np.concatenate((np.minimum.accumulate(ratio[o][::-1])[::-1], [1.0]))
            self.rest_grow = np.concatenate((np.cumsum(np.maximum(self.bcap - self.b0, 0.0)[o][::-1])[::-1], [0.0]))
            # the propagated bound where what is left unassigned is small (it offloads nothing there): always at the
            # last request
            self.dp_depth = self.rest_b0[1:] <= DP_REST_SHARE * self.rest_b0[0]
            self.cover = cover_tables(o, self.bcap, self.x0, self.n_layers)
        sep = tables.sep
        self.sep_n, self.sep_slope, self.sep_icept = sep.n, sep.slope, sep.icept
        self.sep_off = self.compute.sep_off
        self.chain = chain_bounds(self.x0, self.compute)

    # -- driver ---------------------------------------------------------------------------------------
    def run(self) -> np.ndarray | None:
        if self._try_no_offload():
            if not self.first_only:  # stall-free and nothing moved: provably optimal
                self.stats.lower_bound_s = self.best_key[0]
                self.stats.gap = 0.0
                self._report(self.nodes, self.best_key[0])
            return self.best_host
        if not self.first_only:
            self._seed_incumbents()
            if self.node_limit is None and len(self.counts) ** self.n_req > BIG_SPACE:
                self._improve()  # a long search without a node budget: a better incumbent first prunes more of it
            self._probe_root()
        self.dive_start = self.nodes  # the no-offload try and the seeds do not eat into the first dive's allowance
        if self.compiled and self.trace is None:
            self._search_compiled()
        else:
            zero = np.zeros(self.n_layers)
            self._node(0, 0.0, zero, zero, zero, self.comp_total, 0.0, np.zeros(self.sep_off.size),
                       np.zeros(self.mats.shape[1:]))
        if not self.first_only and not self.stats.exact and not (self.gained and self.timed_out):
            self._improve()  # cut short: polish the incumbent in the time kept for it (unless the search took it)
        if self.best_host is not None and not self.first_only:
            best = self.best_key[0]
            lower = min(best, self.open_lb)
            if self.gap > 0:  # children cut by the gap rule are only known to be >= best * (1 - gap)
                lower = min(lower, best * (1 - self.gap))
                if lower < best:
                    self.stats.exact = False
            self.stats.lower_bound_s = lower
            self.stats.gap = (best - lower) / best if best > 0 else 0.0
        self._report(self.nodes, self.best_key[0])
        return self.best_host

    def _try_no_offload(self) -> bool:
        """Offloading nothing is optimal whenever it is feasible (no stall, nothing moved)."""
        host = np.zeros((self.n_req, self.n_layers), dtype=bool)
        if float(self.bcap.sum()) * self.n_layers > self.cap:  # every layer resident, no buffer (integer sums)
            return False
        self._leaf([0] * self.n_req, host)
        return self.best_host is not None

    def _seed_incumbents(self) -> None:
        """First incumbents, so that a search cut short by its budget still returns a good plan and an exact
        one prunes from the start: the hint (the previous plan), then the greedy by transfer-to-compute ratio and
        the sparsest uniform distance that fits, each tightened (:meth:`_tightened`)."""
        greedy = self._greedy()
        seeds = []
        if self.hint is not None:
            k_of_dist = {d: k for k, d in enumerate(self.tables.distances)}
            seeds.append([k_of_dist.get(h, greedy[r]) if h != -1 else greedy[r] for r, h in enumerate(self.hint)])
        seeds.append(self._tightened(greedy))
        # the sparsest uniform distance that fits spreads the transfers over the layers (the greedy bunches them)
        # a uniform placement takes what one request holding all the batch's blocks would: the resident layers
        # and, when it offloads any, one buffered layer (integer sums, exact)
        memory = float(self.bcap.sum()) * (self.n_layers - self.counts + (self.counts > 0))
        fits = np.flatnonzero(memory <= self.cap)
        if fits.size:
            seeds.append(self._tightened([int(fits[0])] * self.n_req))
        if self.compiled:  # compiled.try_each: the same evaluations as _leaf, in one call
            self.stats.leaves += len(seeds)
            self.nodes += len(seeds)
            fst, k_arr = np.array([*self.best_key], dtype=float), np.zeros(self.n_req, dtype=np.int64)
            seeds_a = np.array(seeds, dtype=np.int64)
            if cc.try_each(seeds_a, fst, self.b0, self.comp_total, self.x0, self._feas(), k_arr):
                self._set_best(k_arr, (float(fst[0]), float(fst[1])))
            return
        for k_of in seeds:
            self._leaf([k_of[r] for r in self.order])

    def _probe_root(self) -> None:
        """The first request's candidates in the order of :func:`orbitflow.plan.compiled.root_probes` (the incumbent
        with that request moved there and the others repaired; the reference computes the same floats with its own
        schedule). Under a deadline only when they should take at most ``PROBE_SHARE`` of the time left: measured on
        the speed table's batches, a search with a node budget or none visits fewer nodes (exact at (8, 32): 709k
        nodes over 300 batches against 851k, the same optima; the default node limit: better plans on 16 of 100
        batches at (8, 32), worse on 3). Under a budget they pay at (4, 32) (~35 us): at 1.3 ms the worst budgeted
        batches' excess went from 6.6-7.4% to 0.00% (two runs each way), though at 1 ms the search still stops
        short of the worst one's optimum; at (16, 80) they would take 1.2 ms."""
        if self.best_k is None or self.n_req < 2:
            return
        cost = PROBE_S * len(self.counts) * self.n_req ** 2 * self.n_layers  # the repairs dominate: R moves of L
        if self.deadline is not None and cost > PROBE_SHARE * (self.deadline - time.perf_counter()):
            return
        r = self.order[0]
        cand = np.empty(self.n_req, dtype=np.int64)
        if self.compiled:
            cc.root_probes(self.best_k, r, self.comp_total, self.x0, self._feas(), self.ratio_order, self.bcap,
                           self.cap, cand, self.root_probe)
            return
        n_cand, buf = len(self.counts), np.empty(self.n_layers)
        for k in range(n_cand):
            if k == self.best_k[r]:
                cand[:] = self.best_k
            elif not cc.move(self.best_k, r * n_cand + k, cand, self.ratio_order, self.counts, self.hosts_f,
                             self.bcap, self.cap, buf):
                self.root_probe[k] = math.inf
                continue
            self.root_probe[k] = self._lat0(cand)

    def _tightened(self, k_of: list[int]) -> list[int]:
        """``k_of`` with every request made as sparse as the capacity equation at one slot allows, highest
        transfer-to-compute ratio first (:func:`orbitflow.plan.compiled.tighten`). The greedy and the uniform seed
        step whole candidates, so they often leave capacity unused and move more blocks than they must; at
        (R, L) = (4, 32) that alone put a cut search's plan up to 20% above the optimum. The tightened seed replaces
        the original (it holds the same capacity through ``min_steps`` with fewer host layers), so seeding costs no
        more evaluations than before: each one runs the window rule, which is dear at (16, 80)."""
        tight = np.asarray(k_of, dtype=np.int64)
        cc.tighten(tight, self.ratio_order, self.counts, self.hosts_f, self.bcap, self.cap,
                   np.empty(self.n_layers))
        return tight.tolist()

    def _greedy(self) -> list[int]:
        """Offload until capacity holds at step ``min_steps - 1``: requests whose transfer hides best behind
        compute (lowest transfer-to-compute ratio) first, each at the densest candidate whose gaps hide its
        transfer, then one candidate denser at a time, round robin, in the same order."""
        if self.compiled:  # compiled.greedy, its twin
            k_arr = np.zeros(self.n_req, dtype=np.int64)
            cc.greedy(self.x0, self.comp_total, self.counts, self.hosts_f, self.bcap, self.cap, k_arr)
            return k_arr.tolist()
        n_layers = self.n_layers
        ratio = self.x0 / max(self.comp_total / n_layers, 1e-300)  # layers of compute one transfer takes
        order = np.argsort(ratio, kind="stable")
        counts = self.counts
        k_of = [0] * self.n_req

        def memory() -> float:  # the capacity equation at one slot: the leaves check the exact one
            return float(memory_blocks(self.hosts_f[k_of], self.bcap[None], 1)[0])

        for r in order:  # transfer hidden by the compute between two host layers: distance >= ratio + 1
            if memory() <= self.cap:
                return k_of
            dist = int(math.ceil(ratio[r])) + 1
            fits = np.flatnonzero(counts <= n_layers // max(dist, 1))
            k_of[r] = int(fits[-1]) if fits.size else 0
        while memory() > self.cap:
            grown = False
            for r in order:
                if k_of[r] < len(counts) - 1:
                    k_of[r] += 1
                    grown = True
                    if memory() <= self.cap:
                        return k_of
            if not grown:
                break
        return k_of

    # -- search ---------------------------------------------------------------------------------------
    def _node(self, depth: int, res: float, buf: np.ndarray, vol: np.ndarray, after: np.ndarray,
              chain_lb: float, moved: float, sep: np.ndarray, v: np.ndarray) -> None:
        """Expand the node that assigned requests ``order[:depth]`` (their state: resident blocks ``res``, the
        buffer per layer ``buf``, and the terms of each bound): bound its children, then visit the ones that
        survive, cheapest bound first."""
        self.stats.nodes += 1
        self.nodes += 1
        if self._out_of_budget():
            return
        r = self.order[depth]
        n_kids = self.choice[depth - 1] + 1 if self.same_as_prev[depth] else len(self.counts)
        cut = self._capacity_cut(depth, r, n_kids, res, buf)
        if cut is None:
            return
        kids = self._bound_children(depth, r, n_kids, cut, vol, after, chain_lb, moved, sep, v)
        if self.trace is not None:
            self.trace.append((list(self.choice[:depth]), kids.lat_lb.copy(), kids.alive.copy()))
        self._visit(depth, kids, v)

    def _capacity_cut(self, depth: int, r: int, n_kids: int, res: float, buf: np.ndarray):
        """Capacity at step ``min_steps - 1`` of each child, with every unassigned request fully offloaded (the
        least it can take): the children's resident blocks and buffers, which of them can fit, and the volume
        ``y`` the unassigned requests must then offload at least. None: no child fits."""
        n_layers = self.n_layers
        counts = self.counts[:n_kids]
        bc = self.bcap[r]
        rest = float(self.rest_b[depth + 1])
        new_res = res + bc * (n_layers - counts)
        new_buf = buf[None, :] + bc * self.hosts_f[:n_kids]
        bmax = new_buf.max(axis=1)
        alive = new_res + bmax + rest <= self.cap
        if not alive.any():
            return None
        # forced offload volume y of the unassigned requests (bcap blocks):
        # new_res + rest*L - y + max(bmax, bmean + y/L) <= cap
        bmean = new_buf.mean(axis=1)
        rhs = new_res + rest * n_layers - self.cap
        y1 = rhs + bmax
        if n_layers > 1:
            y2 = (rhs + bmean) / (1 - 1 / n_layers)
            ymin = np.where(y1 / n_layers <= bmax - bmean, y1, y2)
        else:
            ymin = y1
        return new_res, new_buf, alive, np.maximum(ymin, 0.0)

    def _hull(self, u: np.ndarray) -> np.ndarray:
        """``[tiling, child]``: each tiling's lower convex hull (``separable_tables``) read at the children's ``u``."""
        return (self.sep_slope[:, :, None] * u[None, None, :] + self.sep_icept[:, :, None]).max(axis=1)

    def _bound_children(self, depth: int, r: int, n_kids: int, cut, vol: np.ndarray, after: np.ndarray,
                        chain_lb: float, moved: float, sep: np.ndarray, v: np.ndarray) -> _Children:
        """The latency lower bound of each child (module docstring: link, forced volume, chain, separable; deep in
        the tree also the propagated dp bound, and the tail bound on it where two or more requests are left) and the
        state its subtree starts from."""
        new_res, new_buf, alive, ymin = cut
        n_layers = self.n_layers
        x = self.x0[r]
        new_vol = vol[None, :] + x * self.cumh[:n_kids]
        new_after = after[None, :] + x * self.pairs_after[:n_kids]
        link_lb = (new_vol + self.suffix_comp + new_after).max(axis=1)
        forced = new_vol[:, -1] + cover_cost(ymin, self.cover, depth + 1)
        lat_lb = np.maximum(link_lb, np.where(forced > 0, forced + self.comp_min, 0.0))
        # the visiting order's key: the same bound with the forced volume at the least rate (not the cover): ordered
        # by the cover, first dives went to children that leave little to offload to the rest and ended worse
        forced = new_vol[:, -1] + ymin * (self.ratio_suffix[depth + 1] / self.link)
        key = np.maximum(link_lb, np.where(forced > 0, forced + self.comp_min, 0.0))
        # separable window bounds: assigned requests exactly, the rest as their cheapest fractional offload
        kid_sep = sep[:, None] + x * self.sep_n[:, :n_kids]
        rest_b0, rest_b = float(self.rest_b0[depth + 1]), float(self.rest_b[depth + 1])
        if rest_b0 > 0:
            u = np.minimum(ymin * self.ratio_suffix[depth + 1] / rest_b0, n_layers)
            rest_cost = (rest_b0 / self.link) * self._hull(u)
            if rest_b > 0:  # the same bound weighted by the blocks at the capacity step, less what grows by then
                u_cap = np.minimum(ymin / rest_b, n_layers)
                grow = float(self.rest_grow[depth + 1]) * self.sep_n[:, -1:]
                rest_cost = np.maximum(rest_cost, (rest_b * self._hull(u_cap) - grow) / self.link)
        else:
            rest_cost = 0.0
        sep_lb = (self.sep_off[:, None] + kid_sep + rest_cost).max(axis=0)
        kid_chain = np.maximum(self.comp_total + self.chain[r, :n_kids], chain_lb)
        if self.one_slot:
            lat_lb = np.maximum(np.maximum(lat_lb, kid_chain), sep_lb)
            key = np.maximum(np.maximum(key, kid_chain), sep_lb)
        else:  # the bounds are proven for one prefetch slot, on the EDF and the preemptive link, only
            lat_lb = key = np.full(n_kids, self.comp_total)
        new_moved = moved + self.b0[r] * self.counts[:n_kids]
        if self.one_slot and self._propagate_at(depth):
            # deep in the tree: the propagated release/need bound (bounds.dp_bound), the unassigned requests at their
            # least host layers; higher up the separable bound is about as tight and much cheaper
            tail = self._tail_at(depth)
            keep = np.flatnonzero(alive)
            keep = keep[[not prunable(float(lat_lb[k]), float(new_moved[k]), self.best_key, self.gap) for k in keep]]
            if keep.size:
                slack = self.cap - new_res[keep] - new_buf[keep].max(axis=1) - float(self.rest_b[depth + 1])
                kmins = self._least_candidates(depth, slack)
                w = self._least_offload(depth, v[None] + x * self.mats[keep], kmins)
                codes = np.empty((keep.size, n_layers), dtype=np.int64) if tail else None
                dp = dp_bound(w, self.comp0, codes)
                if codes is not None:
                    self._tail_bound(depth, dp, codes, cut[3][keep], kmins)
                lat_lb[keep] = np.maximum(lat_lb[keep], dp)
                key[keep] = np.maximum(key[keep], dp)
        return _Children(x, alive, lat_lb, key, new_res, new_buf, new_vol, new_after, kid_chain, new_moved, kid_sep)

    def _propagate_at(self, depth: int) -> bool:
        """Whether the children of a node at ``depth`` get the propagated bound: at the last request, and where the
        unassigned requests hold little (``dp_depth``) once the first dive (one node per request and its leaf) is
        done; the first dive is what a tight budget buys, and there the bound costs more than it prunes."""
        return depth == self.n_req - 1 or (bool(self.dp_depth[depth]) and self.nodes - self.dive_start > self.n_req + 1)

    def _tail_at(self, depth: int) -> bool:
        """Whether the children of a node at ``depth`` that get the propagated bound also get the tail bound: where
        at least :data:`TAIL_MIN` requests are left unassigned after them (with one left, its least host layers
        already price it about as well: measured, the tail bound cut no child there), unless the share of the children
        it prunes at that depth (``tail_rate``, a moving average) is under ``TAIL_MIN_RATE``; then the node after
        ``TAIL_PROBE`` without it still gets it. The compiled search keeps the same rule
        (:func:`orbitflow.plan.compiled._tail_at`)."""
        if self.n_req - 1 - depth < TAIL_MIN:
            return False
        rate = self.tail_rate[depth]
        if rate[0] < TAIL_MIN_RATE and rate[1] < TAIL_PROBE:
            rate[1] += 1.0
            return False
        rate[1] = 0.0
        return True

    def _tail_bound(self, depth: int, dp: np.ndarray, codes: np.ndarray, ymin: np.ndarray,
                    kmins: list[np.ndarray]) -> None:
        """Raise the propagated bounds ``dp`` of children (``codes``: their :func:`orbitflow.plan.bounds.dp_bound`
        codes, ``ymin`` the blocks the unassigned requests must offload, ``kmins`` each one's first candidate that
        can fit: :meth:`_least_candidates`) by what the unassigned requests must add on the bound's critical path.

        The bound is the value of one path of windows (:func:`orbitflow.plan.bounds.critical_windows`), the unassigned
        requests in it at their least host layers; any completion adds, on that path, each one's transfers in
        those windows beyond its least layers. So a completion's bound is at least ``dp`` plus the least such sum over
        the requests' candidates that free ``ymin`` blocks together (:func:`orbitflow.plan.bounds.tail_cover`, a
        linear relaxation of that choice). The forced volume is priced on the path where it costs the assigned
        requests' schedule most, where the separable bound prices it on fixed tilings with a looser schedule and the
        forced-volume bound only by the link's total. Only children the bound does not already put above the
        incumbent get it, as in the compiled search (:func:`orbitflow.plan.compiled._tail_children`); each updates the
        share it prunes at that depth (``tail_rate``, :meth:`_tail_at`)."""
        rest, rate = self.order[depth + 1:], self.tail_rate[depth]
        n_layers = self.n_layers
        ms, ls = np.empty(n_layers, np.int64), np.empty(n_layers, np.int64)
        a = self.bcap[rest][:, None] * self.counts[None, :]  # blocks each candidate frees, the same for every child
        c = np.zeros(a.shape)
        seg_s, seg_w = np.empty(a.size), np.empty(a.size)
        for i in range(dp.size):
            if prunable(float(dp[i]), -math.inf, self.best_key):
                continue
            n = critical_windows(codes[i], ms, ls)
            rows, cols = ms[:n] + 1, ls[:n]
            n_path = self.mats[:, rows, cols].sum(axis=1)  # each candidate's transfers counted on the path
            lo = np.array([int(km[i]) for km in kmins], dtype=np.int64)
            for j, r in enumerate(rest):
                c[j] = self.x0[r] * (n_path - self.tables.least_mats[lo[j]][rows, cols].sum())
            dp[i] += tail_cover(a, c, lo, float(ymin[i]), seg_s, seg_w)
            rate[0] += TAIL_AVERAGE * ((1.0 if prunable(float(dp[i]), -math.inf, self.best_key) else 0.0) - rate[0])

    def _least_offload(self, depth: int, w: np.ndarray, kmins: list[np.ndarray]) -> np.ndarray:
        """The transfer-count matrices ``w`` of children plus those of the host layers every request not assigned
        yet must offload: the layers common to all its candidates that can still fit, from its first one in each
        child (``kmins``, :meth:`_least_candidates`: candidate ``k`` of request ``r`` cannot fit when
        ``bcap_r (L - count_k)`` exceeds the child's spare capacity with the other unassigned requests fully
        offloaded, the least they take: one block per layer each). The propagated bound only grows with host layers,
        so it still bounds every completion. Requests with the same least candidate are summed first: one matrix per
        candidate."""
        rows = np.arange(w.shape[0])
        coef = np.zeros((w.shape[0], len(self.counts)))  # per child: the requests' transfer seconds per least candidate
        for r, kmin in zip(self.order[depth + 1:], kmins):
            coef[rows, kmin] += self.x0[r]
        for k in range(1, len(self.counts)):  # candidate 0 offloads nothing
            if coef[:, k].any():
                w = w + coef[:, k, None, None] * self.tables.least_mats[k]
        return w

    def _least_candidates(self, depth: int, slack: np.ndarray) -> list[np.ndarray]:
        """Per request not assigned at ``depth`` (in search order), the first candidate it can fit with in each
        child (``slack``: the child's spare capacity with the unassigned requests fully offloaded): candidate ``k``
        of ``r`` cannot fit when ``bcap_r (L - count_k)`` exceeds ``slack + bcap_r`` (what ``r`` took as fully
        offloaded; 1e-6 blocks of slack for rounding). Every later candidate offloads more, so it takes less."""
        out = []
        for r in self.order[depth + 1:]:
            bc = float(self.bcap[r])
            fits = bc * (self.n_layers - self.counts)[None, :] <= (slack + bc + 1e-6)[:, None]
            out.append(np.where(fits.any(axis=1), fits.argmax(axis=1), len(self.counts) - 1))
        return out

    def _visit(self, depth: int, kids: _Children, v: np.ndarray) -> None:
        """Visit the surviving children, cheapest bound first (ties: fewer offloaded layers)."""
        last = depth == self.n_req - 1
        lat_lb, alive = kids.lat_lb, kids.alive
        ordered = np.lexsort((self.counts[: lat_lb.size], kids.key) + ((self.root_probe,) if depth == 0 else ()))
        for i, k in enumerate(ordered):
            if not alive[k]:
                continue
            lb = float(lat_lb[k])
            if prunable(lb, float(kids.moved[k]), self.best_key, self.gap):
                continue
            if not self.lat_ok(lb):
                continue
            self.choice[depth] = int(k)
            if last:
                before = self.best_key
                self._leaf(self.choice, lb=lb)
                if self.best_key != before and self.nodes - self.dive_start > self.n_req + 1:
                    self.gained = True  # still improving on the first dive's plan: search on to improve_deadline
                self._out_of_budget()
            else:
                self._node(depth + 1, float(kids.res[k]), kids.buf[k], kids.vol[k], kids.after[k],
                           float(kids.chain[k]), float(kids.moved[k]), kids.sep[:, k], v + kids.x * self.mats[k])
            if self.done:  # budget spent (or first_only satisfied): what is left here bounds the unexplored part
                self.open_lb = min([self.open_lb, *(float(lat_lb[j]) for j in ordered[i:] if alive[j])])
                return

    def _search_compiled(self) -> None:
        """The search of :meth:`_node`, run by :func:`orbitflow.plan.compiled.bb_search` (no GIL, no Python
        object per node, leaves checked against the window rule there too), which reads the deadline from the clock
        itself; where the kernels have no clock (``compiled.HAVE_CLOCK``) it hands back control every
        :func:`paced_chunk` nodes instead. A search that may use threads (:meth:`_parallel`) and is still running
        after ``PARALLEL_AFTER`` nodes goes on with them (:meth:`_search_parallel`)."""
        state = self._worker_state(own_scratch=False)  # this thread's: the window rule's scratch and clock it has
        ist, fst, best_k, args = state
        paced = self.deadline is not None and not cc.HAVE_CLOCK
        never = 1 << 62
        split_at = self.nodes + PARALLEL_AFTER if self._parallel() else never
        ist[cc.CHUNK_STOP] = min(int(ist[cc.CHUNK_STOP]), split_at)
        states, shared = [state], None
        since, done = time.perf_counter(), self.nodes
        while cc.bb_search(*args) == cc.PAUSED:
            now, nodes = time.perf_counter(), int(ist[cc.NODES])
            tasks = self._donate(state) if nodes >= split_at else []
            if tasks:
                states, shared = self._search_parallel(state, tasks)
                break
            chunk = self._pace(ist, now, since, done) if paced else never
            if self.control is not None:
                chunk = min(chunk, self._look(ist, fst, ist[cc.NODES], now, since, done))
            ist[cc.CHUNK_STOP] = min(nodes + chunk, split_at if nodes < split_at else nodes + SYNC_NODES)
            since, done = now, nodes
        self._collect(states, shared)

    def _look(self, ist: np.ndarray, fst: np.ndarray, nodes: int, now: float, since: float, done: int,
              shared_best: float = math.inf) -> int:
        """A watched search's pause: its progress into the control (``nodes`` so far, all threads'; its incumbent, or
        the threads' shared one where better; the main search only); if the control asks it to stop, it is timed out
        (the kernel then ends it at its next node, with the bound of what it left, as at a deadline). Returns the
        nodes to run before the next look (``done`` nodes having run at ``since`` in this thread)."""
        self._report(nodes, min(float(fst[cc.BEST_LAT]), shared_best))
        if self.control.stopped:
            ist[cc.TIMED_OUT] = 1
        return watch_chunk(now, since, int(ist[cc.NODES]) - done)

    def _report(self, nodes: int, best_s: float) -> None:
        """The main search's progress (nodes so far, its incumbent's step-0 latency) into its control, if watched."""
        if self.control is not None and not self.first_only:
            self.control.nodes, self.control.best_s = int(nodes), float(best_s)

    def _pace(self, ist: np.ndarray, now: float, since: float, done: int) -> int:
        """Where the kernels have no clock, a paused search looks at it for them: past its deadline (the plan's own
        once it has ``GAINED``) it is timed out; returns the nodes to run before the next look (:func:`paced_chunk`,
        ``done`` nodes having run at ``since``)."""
        end = self.improve_deadline if ist[cc.GAINED] else self.deadline
        if now > end:
            ist[cc.TIMED_OUT] = 1
        return paced_chunk(now, since, int(ist[cc.NODES]) - done, end)

    def _collect(self, states: list[tuple], shared: _Shared | None) -> None:
        """What the compiled search's states (one, or one per thread) found and spent, into this search's."""
        nodes0 = self.nodes
        if shared is None:  # one state: its incumbent
            _, fst, best_k, _ = states[0]
            key = (float(fst[cc.BEST_LAT]), float(fst[cc.BEST_MOVED]))
            if better(key, self.best_key):
                self._set_best(best_k, key)
        elif better(shared.best_key, self.best_key):  # threads: the shared one (a thread's own may be stale)
            self._set_best(shared.best_k, shared.best_key)
        for ist, fst, _, _ in states:
            leaves = int(ist[cc.LEAVES])
            self.nodes += int(ist[cc.NODES]) - nodes0
            self.stats.nodes += int(ist[cc.NODES]) - nodes0 - leaves
            self.stats.leaves += leaves
            if ist[cc.HIT]:
                self.stats.exact = False
            self.done = self.done or bool(ist[cc.DONE])
            self.open_lb = min(self.open_lb, float(fst[cc.OPEN_LB]))
            self.gained = self.gained or bool(ist[cc.GAINED])
            self.timed_out = self.timed_out or bool(ist[cc.TIMED_OUT])
        if shared is not None:  # the tasks never started
            self.open_lb = min([self.open_lb, *(lb for _, lb in shared.tasks[shared.next:])])

    def _parallel(self) -> bool:
        """Whether the search may go on with ``threads`` threads: compiled, two requests or more, no node limit (a node
        budget counts the serial search's nodes; threads would spend it in another order)."""
        return (self.threads > 1 and self.compiled and self.trace is None and not self.first_only
                and self.node_limit is None and self.n_req > 1)

    def _search_parallel(self, state: tuple, tasks: list[tuple[tuple[int, ...], float]]) -> tuple[list[tuple], _Shared]:
        """Go on with the compiled search paused in ``state``, which gave away ``tasks`` (:meth:`_donate`), on
        ``threads`` threads at once (the kernels hold no GIL); returns every thread's state and what they shared.

        A task is a subtree: the candidates of the first requests (``compiled.PREFIX`` keeps a search inside them).
        A thread takes the next task when it finishes one; when none is left and a thread waits, the next busy
        thread to pause gives away the open siblings at the top of its own stack, as the serial search would visit
        them next (work stealing), so no thread idles while another holds a big subtree. Every ``SYNC_NODES`` nodes
        a thread swaps incumbents with the shared best: a plan one thread found prunes the others from then on.

        Exact like the serial search: a subtree is only cut by the bound of a plan that was found, so the optimum is
        the same (latency, moved blocks); among plans tied within ``REL_TOL`` the one kept may differ, as it depends
        on which thread found its plan first. Under a deadline every thread stops at it; ``open_lb`` then takes what
        each thread's task left open and the bound of every task not started."""
        _, fst, best_k, _ = state
        shared = _Shared(tasks, (float(fst[cc.BEST_LAT]), float(fst[cc.BEST_MOVED])), best_k, self.threads)
        states = [state] + [self._worker_state() for _ in range(self.threads - 1)]
        self._states = states  # what a watched search reports (_work)
        for other, *_ in states[1:]:  # the first dive is done: budgets apply to the new threads from their first node
            other[cc.DIVE_START] = other[cc.NODES] - self.n_req - 2

        def work(i: int) -> None:
            try:
                self._work(states[i], shared, resume=i == 0)
            except BaseException:
                shared.halt()  # the threads waiting for a task must not wait for this one forever
                raise

        with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="orbitflow-bb") as pool:
            list(pool.map(work, range(self.threads)))
        return states, shared

    def _donate(self, state: tuple) -> list[tuple[tuple[int, ...], float]]:
        """Give away part of the search paused in ``state``: the open siblings at its shallowest level with any
        (not pruned by its incumbent), as tasks ``(candidates of the first requests, bound of the subtree)``; the
        search then keeps to the subtree of its current candidate there (``compiled.PREFIX``). [] if none."""
        ist, fst, _, args = state
        choice, pos, nk, ordk, lat_lb, alive, kid_moved = args[4:11]
        best = (float(fst[cc.BEST_LAT]), float(fst[cc.BEST_MOVED]))
        for level in range(int(ist[cc.PREFIX]), int(ist[cc.DEPTH])):
            ks = [int(k) for k in ordk[level, pos[level] + 1: nk[level]]
                  if alive[level, k] and not prunable(float(lat_lb[level, k]), float(kid_moved[level, k]), best)]
            if ks:
                prefix = tuple(int(c) for c in choice[:level])
                ist[cc.PREFIX] = level + 1
                return [((*prefix, k), float(lat_lb[level, k])) for k in ks]
        return []

    def _worker_state(self, own_scratch: bool = True) -> tuple:
        """One compiled search's state ``(ist, fst, best_k, args of compiled.bb_search)``: its own search scratch, the
        tables shared read-only. ``own_scratch``: also its own window-rule scratch and clock (the kernels write into
        them), for a thread beside the one that owns this search's (its seeds and local improvement use them)."""
        ist, fst = self._compiled_state()
        best_k = np.zeros(self.n_req, dtype=np.int64)
        feas, clock = self._feas(), self.clock
        if own_scratch:
            feas, clock = feas[:-1] + (tuple(np.empty_like(a) for a in feas[-1]),), cc.clock_scratch()
        t, n_cand = self.tables, len(self.counts)
        rates = np.zeros((self.n_req, 4))  # how often compiled._dp_children, and the tail bound, prune per depth
        rates[:, 0], rates[:, 2:] = 1.0, self.tail_rate
        args = self._compiled_args(ist, fst, np.zeros(self.n_req, dtype=np.int64)) + (
            feas, best_k, tuple(self.cover), np.zeros((self.n_req, n_cand)), self.dp_depth, t.least_t, t.least_cum,
            np.zeros((3, n_cand)), np.zeros(t.mats_t.shape[1:]),  # per child: spare, forced volume, tail's; a matrix
            np.full(self.n_layers, -1, dtype=np.int64),  # compiled._dp_children's hint: none yet
            rates,
            np.zeros((n_cand, self.n_layers), dtype=np.int64),  # compiled._dp_children: each child's dp_bound codes
            self.root_probe, clock)
        return ist, fst, best_k, args

    def _work(self, state: tuple, shared: _Shared, resume: bool) -> None:
        """One thread of :meth:`_search_parallel`: its search in ``state`` to the end (``resume``: the paused one
        first), then tasks in turn until every thread waits for one, or the budget is spent."""
        ist, fst, best_k, args = state
        choice = args[4]
        paced = not cc.HAVE_CLOCK and self.deadline is not None  # no clock in the kernels: this thread checks it
        task_lb, chunk = math.inf, PACED_FIRST if paced else SYNC_NODES
        while True:
            if not resume:
                task = shared.take()
                if task is None:
                    return
                prefix, task_lb = task
                choice[: len(prefix)] = prefix
                ist[cc.DEPTH], ist[cc.PHASE], ist[cc.PREFIX] = 0, cc.ENTER, len(prefix)
            resume = False
            while True:
                shared.swap(fst, best_k, ist)
                since, done = time.perf_counter(), int(ist[cc.NODES])
                ist[cc.CHUNK_STOP] = done + chunk
                if cc.bb_search(*args) != cc.PAUSED:
                    break
                if paced:
                    chunk = min(SYNC_NODES, self._pace(ist, time.perf_counter(), since, done))
                if self.control is not None:  # every thread looks, each at its own pause (every SYNC_NODES nodes)
                    nodes = int(self._states[0][0][cc.NODES]) + sum(int(o[0][cc.NODES]) - self.nodes
                                                                    for o in self._states[1:])
                    self._look(ist, fst, nodes, time.perf_counter(), since, done, shared.best_key[0])
                if shared.hungry():
                    shared.give(self._donate(state))
            shared.swap(fst, best_k, ist)
            if ist[cc.DONE]:  # the budget is spent: OPEN_LB holds what this thread left open, ...
                if ist[cc.DEPTH] == 0 and ist[cc.PHASE] == cc.ENTER:  # ... but a task stopped before its root
                    fst[cc.OPEN_LB] = min(fst[cc.OPEN_LB], task_lb)
                shared.halt()
                return

    def _feas(self) -> tuple:
        """The window rule's data for the compiled kernels (:func:`orbitflow.plan.compiled.feasibility_data`),
        built once per search."""
        if self._feas_data is None:
            self._feas_data = feasibility(self.rules, self.win, self.tables, self.cap)
        return self._feas_data

    def _compiled_state(self) -> tuple[np.ndarray, np.ndarray]:
        """The compiled search's integer and float state (``compiled.N_IST`` / ``N_FST`` slots) from this search's."""
        ist = np.zeros(cc.N_IST, dtype=np.int64)
        ist[cc.NODES] = self.nodes
        ist[cc.DIVE_START] = self.dive_start
        ist[cc.FIRST_ONLY] = int(self.first_only)
        ist[cc.NODE_LIMIT] = -1 if self.node_limit is None else self.node_limit
        never = 1 << 62
        paced = self.deadline is not None and not cc.HAVE_CLOCK  # the caller checks the deadline, after the first dive
        ist[cc.CHUNK_STOP] = self.nodes + self.n_req + 2 if paced else never
        if self.control is not None:  # watched: a first look soon (then every WATCH_S)
            ist[cc.CHUNK_STOP] = min(int(ist[cc.CHUNK_STOP]), self.nodes + max(WATCH_FIRST, self.n_req + 2))
        fst = np.zeros(cc.N_FST)
        fst[cc.DEADLINE] = cc.kernel_deadline(self.deadline, self.clock)
        fst[cc.LATE_DEADLINE] = cc.kernel_deadline(self.improve_deadline, self.clock)
        fst[cc.BEST_LAT], fst[cc.BEST_MOVED] = self.best_key
        fst[cc.OPEN_LB] = self.open_lb
        fst[cc.GAP] = self.gap
        fst[cc.KNOWN_PASS] = float(self.win.slo.min())
        fst[cc.KNOWN_FAIL] = math.inf
        return ist, fst

    def _compiled_args(self, ist: np.ndarray, fst: np.ndarray, k_of: np.ndarray) -> tuple:
        """The arguments of :func:`orbitflow.plan.compiled.bb_search`: state, per-depth scratch, tables."""
        n_req, n_layers, n_cand = self.n_req, self.n_layers, len(self.counts)
        win, rules, t = self.win, self.rules, self.tables
        slo_on = bool(np.isfinite(win.slo).any() and win.compute_grows)  # as Constraints.lat_prefilter
        shape_l = (n_req, n_layers)
        return (
            ist, fst, np.asarray(self.order, dtype=np.int64), np.asarray(self.same_as_prev, dtype=np.bool_),
            np.zeros(n_req, dtype=np.int64),
            np.zeros(n_req, np.int64), np.zeros(n_req, np.int64), np.zeros((n_req, n_cand), np.int64),
            np.zeros((n_req, n_cand)), np.zeros((n_req, n_cand), np.bool_), np.zeros((n_req, n_cand)),
            np.zeros(n_req), np.zeros(shape_l), np.zeros(shape_l), np.zeros(shape_l),
            np.full(n_req, self.comp_total), np.zeros(n_req), np.zeros((n_req, self.sep_off.size)),
            np.zeros((n_req, n_layers, n_layers + 1)),  # transposed, as t.mats_t
            self.counts, self.hosts_f, self.cumh, self.pairs_after, t.mats_t, self.sep_n, self.sep_slope,
            self.sep_icept, self.sep_off, self.chain,
            self.bcap, self.b0, self.x0, self.rest_b, self.rest_b0, self.ratio_suffix, self.rest_grow,
            self.suffix_comp, self.comp0, self.comp_total, self.comp_min, self.link,
            self.cap,
            slo_on, win.deposit, win.slo, rules.alpha, rules.min_steps, rules.max_steps,
            self.suffix_comp, t.lay_ptr, t.lay, k_of,
            np.empty(n_req, np.int64), np.empty(n_req, np.int64), np.empty(n_layers), np.empty(t.lay.size + 1),
            np.empty(n_layers), np.empty(n_layers),
        )

    def _out_of_budget(self) -> bool:
        """Whether the node or time budget is spent (then the search stops: ``done``, not ``exact``). Budgets
        never stop the main search's first dive (one node per request and its first leaf), so it gets the
        chance to find a plan (it may still end at a dead end or an infeasible leaf). Once the search has ``gained``
        its deadline is the plan's own (``improve_deadline``), the local improvement's share included."""
        limit = self.node_limit
        self._report(self.nodes, self.best_key[0])
        if self.first_only or self.nodes - self.dive_start > self.n_req + 1:
            deadline = self.improve_deadline if self.gained else self.deadline
            self.timed_out = self.timed_out or (deadline is not None and time.perf_counter() > deadline)
            self.timed_out = self.timed_out or (self.control is not None and self.control.stopped)
            if (limit is not None and self.nodes > limit) or self.timed_out:
                self.stats.exact = False  # best found so far, optimality not proven
                self.done = True
        return self.done

    def _leaf(self, choice: list[int], host: np.ndarray | None = None, lb: float = 0.0) -> None:
        """Exact evaluation of a complete assignment (``choice[d]`` for request ``order[d]``); ``lb``: the
        search's bound on its latency. A leaf counts against the node budget like a node."""
        self.stats.leaves += 1
        self.nodes += 1
        self._try(self.by_request(choice), lb, host)

    def by_request(self, choice: list[int]) -> list[int]:
        """The candidate of each request, from ``choice[d]`` for request ``order[d]`` (the search's order)."""
        k_of = [0] * self.n_req
        for d, k in enumerate(choice):
            k_of[self.order[d]] = k
        return k_of

    def _try(self, k_of: list[int], lb: float = 0.0, host: np.ndarray | None = None) -> bool:
        """Whether the assignment ``k_of`` (candidate per request) beats the incumbent in (step-0 latency, moved
        blocks) and is feasible; then it is the incumbent. ``host``: its mask, when known."""
        if self.compiled:  # the same floats and checks, without the GIL (compiled.try_assignment)
            fst = np.array([*self.best_key], dtype=float)
            k_arr = np.asarray(k_of, dtype=np.int64)
            if not cc.try_assignment(k_arr, lb, fst, self.b0, self.comp_total, self.x0, self._feas()):
                return False
            self._set_best(k_arr, (float(fst[0]), float(fst[1])))
            return True
        moved = float(sum(self.b0[r] * self.counts[k_of[r]] for r in range(self.n_req)))
        if host is None:
            host = self.hosts[k_of]
        if self.one_slot:
            best = self.best_key[0]
            lat0 = self._lat0(k_of, best + 2 * REL_TOL * max(abs(best), 1.0) if math.isfinite(best) else math.inf)
            if lat0 is None:  # slower than the incumbent: stopped part-way
                return False
            self.win.seg_cache[(host.tobytes(), 0)] = lat0
        else:
            lat0 = self.rules.seg_latencies(self.win, host, upto=1)[0]
        key = (lat0, moved)
        if not better(key, self.best_key):
            return False
        if not self.rules.feasible(self.win, host, lat0, later_lb=lb if self.one_slot else 0.0):
            return False
        self._set_best(np.asarray(k_of, dtype=np.int64), key)
        return True

    def _lat0(self, k_of, abort_above: float = math.inf) -> float | None:
        """Step-0 latency of the assignment ``k_of`` (candidate per request) by the reference schedule, the
        compiled one's floats (:func:`orbitflow.plan.compiled.step0_added`); None once above ``abort_above``."""
        lists = [self.lists[k] for k in k_of]
        h = self.rules.cost_model.host_layer_s
        stalls = self.rules.cost_model.link_stalls(self.comp0_list, lists, self.x0_list, abort_above=abort_above,
                                                   host_layer_s=h)
        if stalls is None:
            return None
        return self.comp_total + (float(sum(stalls)) + host_layers_s(lists, h))

    def _set_best(self, k_of: np.ndarray, key: tuple[float, float]) -> None:
        self.best_k, self.best_host, self.best_key = k_of.copy(), self.hosts[k_of], key
        if self.first_only:
            self.done = True

    def _improve(self) -> None:
        """Local improvement of the incumbent before the search (:func:`orbitflow.plan.compiled.improve`; the
        reference runs the same moves through :meth:`_try`): at most ``improve_evals`` exact evaluations,
        stopped at the deadline but given its share of the budget (``improve_s``) even past it. It only ever
        replaces the incumbent by a strictly better feasible plan."""
        if self.best_k is None or self.improve_evals <= 0:
            return
        ist = np.zeros(3, dtype=np.int64)
        k_of, cand = self.best_k.copy(), np.empty(self.n_req, dtype=np.int64)
        order = self.ratio_order
        buf = np.empty(self.n_layers)
        if self.compiled:
            fst = np.array([*self.best_key], dtype=float)
            end, since, chunk = self.improve_deadline, time.perf_counter(), 1
            if end is not None:  # a first dive past the deadline (or a busy machine) does not take the share
                end = max(end, since + self.improve_s)
            end_k = cc.kernel_deadline(end, self.clock)  # inf without a clock: paced below
            while end is None or time.perf_counter() <= end:
                evals = int(ist[cc.EVALS])
                stop = self.improve_evals if end is None or cc.HAVE_CLOCK else evals + chunk
                if cc.improve(k_of, ist, fst, self.improve_evals, stop, self.b0, self.comp_total, self.x0,
                              self._feas(), cand, order, self.bcap, self.cap, self.clock, end_k):
                    break
                if end is not None:
                    now = time.perf_counter()
                    chunk, since = paced_chunk(now, since, int(ist[cc.EVALS]) - evals, end), now
            if (float(fst[0]), float(fst[1])) != self.best_key:
                self._set_best(k_of, (float(fst[0]), float(fst[1])))
        else:
            n_cand = len(self.counts)
            n_moves = self.n_req * (n_cand + self.n_req)
            end = None if self.improve_deadline is None else max(self.improve_deadline,
                                                                 time.perf_counter() + self.improve_s)
            while ist[cc.SINCE] < n_moves and ist[cc.EVALS] < self.improve_evals:
                if end is not None and time.perf_counter() > end:
                    break
                m = int(ist[cc.CURSOR])
                ist[cc.CURSOR], ist[cc.SINCE] = (m + 1) % n_moves, ist[cc.SINCE] + 1
                if cc.move(k_of, m, cand, order, self.counts, self.hosts_f, self.bcap, self.cap, buf):
                    ist[cc.EVALS] += 1
                    if self._try(cand.tolist()):
                        k_of[:], ist[cc.SINCE] = cand, 0
        self.stats.improve_evals += int(ist[cc.EVALS])


class _Shared:
    """What the threads of a parallel search share (:meth:`BranchAndBound._search_parallel`): the tasks (candidates
    of the first requests, with a bound on their subtree) and the next one, how many threads wait for one, the best
    plan found, and whether the search ended (every thread waiting) or the budget stopped it."""

    def __init__(self, tasks: list[tuple[tuple[int, ...], float]], best_key: tuple[float, float],
                 best_k: np.ndarray, threads: int) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.tasks = list(tasks)
        self.next = 0
        self.threads = threads
        self.waiting = 0
        self.finished = False  # every thread waits and no task is left: the tree is searched
        self.stop = False  # the budget stopped a thread: the others stop too
        self.gained = False  # some thread found a better plan than the first dive's (compiled.GAINED)
        self.best_key = best_key
        self.best_k = best_k.copy()

    def take(self) -> tuple[tuple[int, ...], float] | None:
        """The next task, once there is one; None when the search has ended or stopped."""
        with self.wake:
            self.waiting += 1
            while not (self.stop or self.finished or self.next < len(self.tasks)):
                if self.waiting == self.threads:
                    self.finished = True
                    self.wake.notify_all()
                    break
                self.wake.wait()
            self.waiting -= 1
            if self.stop or self.finished:
                return None
            self.next += 1
            return self.tasks[self.next - 1]

    def hungry(self) -> bool:
        """Whether a thread waits and no task is left (read without the lock: a hint for the next pause)."""
        return self.waiting > 0 and self.next >= len(self.tasks)

    def give(self, tasks: list[tuple[tuple[int, ...], float]]) -> None:
        if tasks:
            with self.wake:
                self.tasks += tasks
                self.wake.notify_all()

    def halt(self) -> None:
        with self.wake:
            self.stop = True
            self.wake.notify_all()

    def swap(self, fst: np.ndarray, best_k: np.ndarray, ist: np.ndarray) -> None:
        """Publish a thread's incumbent (``fst``'s, its candidates in ``best_k``) if it beats the shared one, else
        give the thread the shared one (only its key: what its search prunes with). A search still finding better
        plans than its first dive's (``compiled.GAINED``: it searches on to the plan's own deadline) is one search:
        once a thread has gained, every thread has."""
        with self.lock:
            mine = (float(fst[cc.BEST_LAT]), float(fst[cc.BEST_MOVED]))
            if better(mine, self.best_key):
                self.best_key, self.best_k = mine, best_k.copy()
            else:
                fst[cc.BEST_LAT], fst[cc.BEST_MOVED] = self.best_key
            self.gained = self.gained or bool(ist[cc.GAINED])
            ist[cc.GAINED] = int(self.gained)
