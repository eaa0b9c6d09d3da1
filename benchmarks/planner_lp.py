"""How tight a linear relaxation of the step can be at (16, 80), and what proving a plan with it would take.

The release/need recursion (``bounds.dp_bound``) is the latency of a preemptive link and a lower bound on every link
order, the executor's EDF one included. Its value is the largest over paths of windows of a sum that is linear in
each request's choice: a path ``P`` (``bounds.critical_windows``) costs its compute ``c_P`` plus, per request ``r``,
``xfer_r`` times the transfers of its candidate counted in ``P``'s windows. So every path gives a valid inequality
``T >= c_P + sum_r sum_k y_rk g_rk(P)`` over the 0/1 choice ``y_rk`` (request ``r`` takes candidate ``k``), and the
least ``T`` over fractional choices that keep the capacity rows (one per layer: the resident blocks plus that layer's
prefetch buffer; an integral choice meets them all exactly when it fits) bounds every plan from below. The paths
are generated as needed: solve the LP over the paths known so far, take the recursion's critical path at the LP's
fractional choice, add it while it is violated (scipy's HiGHS).

Reduced-cost fixing (`reduced_costs`, `plans_within`): the root LP's marginals price what each request's candidate adds
to the bound at least, so a plan whose additions keep the bound under the best plan found is all such a search could
not rule out without pricing it; the script counts those plans. The same prices bound every plan under a partial plan
(`fixing_bound`); the script counts the nodes of a traced exact search that bound would cut.

This script measures that bound at the root of the (16, 80) batches of the speed table, against the plans the exact
search finds in ``--exact-cap-s`` and the bound it certifies by then, and runs a best-first branch and bound on it
(branching on a request's candidate range, preemptive link, the best plan found as its incumbent from the start) to
see how many LP nodes a proof within a relative gap takes.

Run:  python benchmarks/planner_lp.py [--calls 30] [--gap 1e-4] [--lp-cap-s 5] [--fix-cap 100000]
      [--trace-cap-s 5] [--md docs/results/planner_lp.md]
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import shlex
import sys
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from planner import (  # noqa: E402
    EXACT,
    _machine,
    pct,
    require_positive,
    speed_cases,
    traced_children,
    write_fragment,
)

from orbitflow.plan import Placement, Planner, warm_up  # noqa: E402
from orbitflow.plan.bounds import critical_windows, dp_bound  # noqa: E402
from orbitflow.plan.search import BranchAndBound  # noqa: E402
from orbitflow.plan.types import PlanStats  # noqa: E402

LP_TOL = 1e-7  # HiGHS's primal feasibility tolerance: a path (or a plan) within it of a bound does not raise it


def _within_tol(value: float, bound: float) -> bool:
    """Whether ``value`` is at most ``bound`` up to :data:`LP_TOL` (relative, absolute below 1)."""
    return value <= bound + LP_TOL * max(bound, 1.0)


class PathLP:
    """The path relaxation of one batch's step 0 (module docstring), its path inequalities kept across solves (each
    is valid for every plan, so a branch and bound shares them). One prefetch slot only (a deeper one releases
    transfers earlier than the paths assume); with ``host_layer_s`` > 0 still a bound, no longer a plan's own step."""

    ROUNDS = 200  # most paths one solve adds (then its bound, over the paths so far, is still a lower bound)

    def __init__(self, tree: BranchAndBound):
        if tree.rules.cost_model.prefetch_slots != 1:
            raise ValueError("PathLP models one prefetch slot per request")
        t = tree.tables
        self.n_req, self.n_cand, self.n_layers = tree.n_req, len(t.counts), tree.n_layers
        self.x0, self.comp, self.mats = tree.x0, tree.comp0, t.mats
        n_var = self.n_req * self.n_cand + 1  # y_rk, then T
        resident = tree.bcap[:, None] * (self.n_layers - t.counts)[None, :]  # [R, K]
        self.cap_rows = np.zeros((self.n_layers, n_var))
        for layer in range(self.n_layers):
            self.cap_rows[layer, :-1] = (resident + tree.bcap[:, None] * t.hosts_f[None, :, layer]).ravel()
        self.cap = tree.cap
        self.eq = np.zeros((self.n_req, n_var))
        for r in range(self.n_req):
            self.eq[r, r * self.n_cand:(r + 1) * self.n_cand] = 1.0
        self.objective = np.zeros(n_var)
        self.objective[-1] = 1.0
        self.rows: list[np.ndarray] = []
        self.rhs: list[float] = []
        self.solves = 0
        self.last = None  # the last HiGHS result (its marginals price each candidate: `reduced_costs`)
        self.last_full = False  # whether that solve kept every candidate of every request (the root)
        self._ms = np.empty(self.n_layers + 1, np.int64)
        self._ls = np.empty(self.n_layers + 1, np.int64)

    def path(self, y: np.ndarray) -> float:
        """The recursion at the (fractional) choice ``y`` [R, K]; adds its critical path's inequality and returns the
        recursion's value (= that path's value at ``y``)."""
        v = np.einsum("rk,r,kml->ml", y, self.x0, self.mats)
        codes = np.empty((1, self.n_layers), np.int64)
        value = float(dp_bound(v[None], self.comp, codes)[0])
        g = np.zeros(self.n_cand)
        skipped = 0.0  # compute of the layers inside the path's windows: not on the path
        for j in range(critical_windows(codes[0], self._ms, self._ls)):
            m, layer = self._ms[j], self._ls[j]
            skipped += float(self.comp[m + 1:layer].sum() if m >= 0 else self.comp[:layer].sum())
            g += self.mats[:, m + 1, layer]
        row = np.zeros(self.n_req * self.n_cand + 1)
        row[:-1] = (self.x0[:, None] * g[None, :]).ravel()
        row[-1] = -1.0
        self.rows.append(row)
        self.rhs.append(-(float(self.comp.sum()) - skipped))
        return value

    def solve(self, lo: list[int], hi: list[int], cutoff: float = math.inf) -> tuple[float, np.ndarray | None]:
        """The least ``T`` with request ``r``'s candidates kept to ``lo[r]..hi[r]``, adding paths until none is
        violated by more than HiGHS's tolerance, the bound reaches ``cutoff``, or :attr:`ROUNDS` paths were added;
        ``(inf, None)`` when no fractional choice fits."""
        from scipy.optimize import linprog

        ranges = [(0.0, 1.0 if lo[r] <= k <= hi[r] else 0.0) for r in range(self.n_req) for k in range(self.n_cand)]
        if not self.rows:
            start = np.zeros((self.n_req, self.n_cand))
            start[np.arange(self.n_req), lo] = 1.0
            self.path(start)
        for _ in range(self.ROUNDS):
            res = linprog(self.objective, A_ub=np.vstack([self.cap_rows, *self.rows]),
                          b_ub=np.concatenate([np.full(self.n_layers, self.cap), self.rhs]), A_eq=self.eq,
                          b_eq=np.ones(self.n_req), bounds=[*ranges, (0.0, None)], method="highs")
            self.solves += 1
            self.last, self.last_full = res, all(lo[r] == 0 and hi[r] == self.n_cand - 1 for r in range(self.n_req))
            if res.status == 2:
                return math.inf, None
            if res.status != 0:
                raise RuntimeError(f"LP failed: {res.message}")
            y, bound = res.x[:-1].reshape(self.n_req, self.n_cand), float(res.x[-1])
            if bound >= cutoff or _within_tol(self.path(y), bound):
                return bound, y
        return bound, y


def reduced_costs(lp: PathLP) -> np.ndarray:
    """What each choice adds to the bound of the last :meth:`PathLP.solve`, which must have kept every candidate (the
    root; a candidate fixed out of a node's range carries a marginal of its own, which this reading would spread to
    the others): ``pen[r, k]`` such that every plan that takes candidate ``k_r`` for each request ``r`` steps at least
    ``bound + sum_r pen[r, k_r]`` on any link. LP duality with HiGHS's marginals of the variable bounds: the
    objective at any feasible ``y`` is at least the bound plus ``lower_j * y_j + upper_j * (y_j - 1)`` summed (lower
    marginals >= 0, upper ones <= 0, both terms >= 0 on [0, 1]), which at an integral choice is the table's sum."""
    res = lp.last
    if res is None or res.status != 0 or not lp.last_full:
        raise ValueError("reduced_costs needs a PathLP solved over every candidate (the root)")
    shape = (lp.n_req, lp.n_cand)
    lower = np.maximum(res.lower.marginals[:-1].reshape(shape), 0.0)  # HiGHS's signs, clipped of its float noise
    upper = np.maximum(-res.upper.marginals[:-1].reshape(shape), 0.0)
    return lower + upper.sum(axis=1, keepdims=True) - upper


def plans_within(lp: PathLP, pen: np.ndarray, budget: float, cap: int) -> int:
    """Plans that fit capacity (the relaxation's per-layer rows, met exactly by an integral choice) with
    ``sum_r pen[r, k_r] < budget``: those that reduced-cost fixing leaves to be priced one by one (counted up to
    ``cap``). Depth first over the requests, cheapest candidate first, cut by the least penalty and the least blocks
    per layer the requests after each level can still add."""
    n_req, n_cand = lp.n_req, lp.n_cand
    use = lp.cap_rows[:, :-1].reshape(lp.n_layers, n_req, n_cand).transpose(1, 2, 0)  # [R, K, L]
    least_pen = np.concatenate([np.cumsum(pen.min(axis=1)[::-1])[::-1], [0.0]])
    least_use = np.concatenate([np.cumsum(use.min(axis=1)[::-1], axis=0)[::-1], np.zeros((1, lp.n_layers))])
    order = np.argsort(pen, axis=1, kind="stable")
    room = lp.cap * (1 + 1e-12)
    count = 0

    def visit(r: int, spent: float, used: np.ndarray) -> None:
        nonlocal count
        if r == n_req:
            count += 1
            return
        for k in order[r]:
            if count >= cap or spent + pen[r, k] + least_pen[r + 1] >= budget:
                return
            now = used + use[r, k]
            if np.all(now + least_use[r + 1] <= room):
                visit(r + 1, spent + pen[r, k], now)

    visit(0, 0.0, np.zeros(lp.n_layers))
    return count


def fixing_bound(root: float, pen: np.ndarray, partial: np.ndarray) -> float:
    """The root's reduced costs as a bound of every plan under the partial plan ``partial`` (the candidate per
    request, -1 where unassigned): ``root`` plus each assigned request's penalty and each other one's least. It never
    falls as requests are assigned (a request's penalty is at least its least), so a node whose bound reaches the
    incumbent has every node under it cut too."""
    assigned = partial >= 0
    rows = np.flatnonzero(assigned)
    return float(root + pen[rows, partial[rows]].sum() + pen[~assigned].min(axis=1).sum())


def lp_branch_and_bound(lp: PathLP, plan_of, best: float, gap: float, cap_s: float) -> dict:
    """Best-first branch and bound on :class:`PathLP` (one slot, the preemptive link, no ``host_layer_s``: there the
    relaxation at an integral choice is the plan's step): a node keeps each request to a range of its candidates and
    is cut once its bound is within ``gap`` of ``best`` (the incumbent, known from the start); a fractional request's
    range is split at its mean candidate; an integral LP choice is a plan, priced by ``plan_of(candidates)`` (its
    latency, inf where it breaks a rule the LP does not see: the SLO window). A feasible one whose step is the node's
    bound (within :data:`LP_TOL`) is the node's best plan, and the node is done; any other is cut out of the node:
    for the open
    requests in turn, children that keep the earlier ones at the plan's candidate and move this one off it. Returns
    the LP nodes, the LP solves (the path relaxation's rounds, the root's included), whether every node left is cut
    (within ``cap_s`` seconds), and the best plan."""
    n_req, n_cand = lp.n_req, lp.n_cand
    heap = [(0.0, 0, (0,) * n_req, (n_cand - 1,) * n_req)]
    pushed, nodes, plans, start = 1, 0, 0, time.perf_counter()

    def push(bound, lo, hi, r, a, b):
        nonlocal pushed
        if a <= b:
            heapq.heappush(heap, (bound, pushed, lo[:r] + (a,) + lo[r + 1:], hi[:r] + (b,) + hi[r + 1:]))
            pushed += 1

    while heap and time.perf_counter() - start < cap_s:
        bound, _, lo, hi = heapq.heappop(heap)
        if bound >= best * (1 - gap):
            continue
        nodes += 1
        bound, y = lp.solve(list(lo), list(hi), best * (1 - gap))
        if y is None or bound >= best * (1 - gap):
            continue
        spread = 1.0 - y.max(axis=1)
        if spread.max() > 1e-6:  # fractional: split the most fractional request's range at its mean candidate
            r = int(spread.argmax())
            split = min(max(int(math.floor(float(np.arange(n_cand) @ y[r]))), lo[r]), hi[r] - 1)
            push(bound, lo, hi, r, lo[r], split)
            push(bound, lo, hi, r, split + 1, hi[r])
            continue
        ks = y.argmax(axis=1).tolist()
        plans += 1
        price = plan_of(ks)
        best = min(best, price)
        if _within_tol(price, bound):  # the node's bound is this plan's step: nothing in it is better
            continue
        for r in (q for q in range(n_req) if hi[q] > lo[q]):  # the node without this plan
            push(bound, lo, hi, r, lo[r], ks[r] - 1)
            push(bound, lo, hi, r, ks[r] + 1, hi[r])
            lo, hi = lo[:r] + (ks[r],) + lo[r + 1:], hi[:r] + (ks[r],) + hi[r + 1:]
    done = all(b >= best * (1 - gap) for b, *_ in heap)
    return {"nodes": nodes, "solves": lp.solves, "plans": plans, "done": done, "best": best}


def plan_pricer(pl: Planner, reqs, distances, n_layers: int):
    """``plan_of`` of :func:`lp_branch_and_bound`: a plan's step latency by ``pl`` (inf where it is not feasible),
    from one candidate index per request (into ``distances``)."""
    def plan_of(ks: list[int]) -> float:
        e = pl.evaluate(Placement.from_distances(n_layers, [distances[k] for k in ks]), reqs)
        return e.predicted_step_s if e.feasible else math.inf
    return plan_of


def _solve(cm, cap, reqs, transfer: str, cap_s: float):
    pl = Planner(cm.with_updates(transfer=transfer), cap, alpha=1.0, window=(4, 16), time_limit_s=cap_s, **EXACT)
    return pl, pl.plan(reqs)


def _lp_nodes(nodes: list[tuple[int, bool]]) -> str:
    """The LP nodes of the proven and of the open LP branch and bounds, ``(nodes, done)`` each, as the summary says
    them: ' (proofs: 1-13 LP nodes; open after 416-1673)'."""
    def span(xs: list[int]) -> str:
        return f"{min(xs)}" if min(xs) == max(xs) else f"{min(xs)}-{max(xs)}"
    done = [n for n, d in nodes if d]
    open_ = [n for n, d in nodes if not d]
    parts = ([f"proofs: {span(done)} LP nodes"] if done else []) + ([f"open after {span(open_)}"] if open_ else [])
    return f" ({'; '.join(parts)})" if parts else ""


def bench_lp(calls: int, seed: int, exact_cap_s: float, gap: float, lp_cap_s: float, out: list[str],
             n_req: int = 16, n_layers: int = 80, fix_cap: int = 100_000, trace_cap_s: float = 5.0) -> None:
    """The section's tables (module docstring)."""
    out.append(f"\n### The path relaxation at ({n_req}, {n_layers})\n")
    out.append(f"The {calls} batches of the speed table, those where the preemptive link's search found a plan within "
               f"the SLO (a plan that meets it on the EDF link meets it there too). best: the plan the compiled exact "
               f"search "
               f"finds within {exact_cap_s:g} s (EDF: the executor's link; pre: the preemptive link, "
               "`CostModel(transfer=\"preemptive\")`), proven or not; search lb: the bound it certifies by then; LP "
               "root: the path relaxation's bound at the root (a bound on both links), how many paths it took, its "
               f"time with scipy's HiGHS, and how many requests its solution splits between candidates. LP B&B: the "
               f"best-first branch and bound on it (preemptive link, the best plan found as its incumbent from the "
               f"start), cut at a relative gap of {gap:g} (Gurobi's default MIPGap is 1e-4), capped at {lp_cap_s:g} s: "
               "LP nodes and LP solves (path rounds, the root's included), and whether it proved the plan within the "
               "gap. Fixing: reduced-cost fixing at the root (`reduced_costs`: HiGHS's marginals give each request's "
               "candidates what they add to the root bound at least); 'candidates left' of the "
               f"{n_req} x K, those whose addition keeps the bound under the best plan (pre / EDF), 'plans left' the "
               "plans that fit capacity with their additions' sum keeping it under (`plans_within`, counted up to "
               f"{fix_cap}: '>=' where it reached that): the plans such a search would still have to price one by one. "
               "'traced nodes under a fixing cut': the same reduced costs as a bound inside the exact search "
               "(`fixing_bound`: the root bound plus each assigned request's penalty and each other one's least, a "
               "bound of every plan under a partial plan, on both links): of the nodes the reference search with every "
               f"bound at every node (`planner.py`'s `FixedBounds`) expands in its first {trace_cap_s:g} s against "
               "the best EDF plan, how many that bound would cut (it never falls down the tree, so those are nodes "
               "a search with both bounds would not expand); 'done' where the traced search finished."
               "\n")
    out.append("| batch | best EDF | proven | search lb under it | best pre | proven | search lb under it | LP root "
               "under best pre | under best EDF | paths | LP root s | split requests | LP B&B nodes | LP solves | "
               "proven within gap | fixing: candidates left pre / EDF | plans left pre / EDF | "
               "traced nodes under a fixing cut (EDF) |")
    out.append("|---" * 18 + "|")
    summary = {"root": [], "search": [], "nodes": [], "done": 0, "rows": 0, "left": [], "exact": ([], []),
               "traced": []}
    for i, (cm, cap, reqs) in enumerate(tqdm(speed_cases(seed, n_req, n_layers, calls), desc="lp", leave=False)):
        pl_edf, edf = _solve(cm, cap, reqs, "edf", exact_cap_s)
        pl, pre = _solve(cm, cap, reqs, "preemptive", exact_cap_s)
        if not pre.feasible:
            continue
        tree = BranchAndBound(pl.constraints, pl.constraints.horizon(reqs), PlanStats())
        lp = PathLP(tree)
        t0 = time.perf_counter()
        root, y = lp.solve([0] * tree.n_req, [len(tree.counts) - 1] * tree.n_req)
        root_s, paths = time.perf_counter() - t0, len(lp.rows)
        pen = reduced_costs(lp)
        edf_best = edf.predicted_step_s if edf.feasible else math.inf
        left = [(int((pen < best - root).sum()), plans_within(lp, pen, best - root, fix_cap)) if math.isfinite(best)
                else None for best in (pre.predicted_step_s, edf_best)]
        shown = [("-", "-") if x is None else (str(x[0]), (">=" if x[1] >= fix_cap else "") + str(x[1])) for x in left]
        traced = "-"
        if edf.feasible:
            search, _, nodes = traced_children(pl_edf.constraints, reqs, edf_best * (1 + 1e-9), trace_cap_s)
            # counted cut only clear of HiGHS's tolerance above the best plan: a conservative count
            cut = sum(fixing_bound(root, pen, a) >= edf_best * (1 + LP_TOL) for a in nodes)
            if nodes:
                summary["traced"].append((cut, len(nodes), not search.timed_out, edf.stats.exact))
            traced = f"{cut} of {len(nodes)}{' done' if not search.timed_out else ''}"
        bb = lp_branch_and_bound(lp, plan_pricer(pl, reqs, tree.tables.distances, n_layers), pre.predicted_step_s, gap,
                                 lp_cap_s)
        under = lambda lb, best: f"{100 * (1 - lb / best):.3f}%" if lb is not None and math.isfinite(best) else "-"  # noqa: E731
        out.append(f"| {i} | {edf_best:.5f} | {edf.stats.exact} | {under(edf.stats.lower_bound_s, edf_best)} | "
                   f"{pre.predicted_step_s:.5f} | {pre.stats.exact} | "
                   f"{under(pre.stats.lower_bound_s, pre.predicted_step_s)} | {under(root, pre.predicted_step_s)} | "
                   f"{under(root, edf_best)} | {paths} | {root_s:.2f} | {int((1 - y.max(axis=1) > 1e-6).sum())} | "
                   f"{bb['nodes']} | {bb['solves']} | {bb['done']} | {shown[0][0]} / {shown[1][0]} | "
                   f"{shown[0][1]} / {shown[1][1]} | {traced} |")
        summary["rows"] += 1
        summary["left"].append(left)
        summary["exact"][0].append(pre.stats.exact)
        summary["exact"][1].append(edf.stats.exact)
        summary["root"].append(100 * (1 - root / pre.predicted_step_s))
        if not pre.stats.exact and pre.stats.lower_bound_s is not None:
            summary["search"].append(100 * (1 - pre.stats.lower_bound_s / pre.predicted_step_s))
        summary["nodes"].append((bb["nodes"], bb["done"]))
        summary["done"] += bb["done"]
    if summary["rows"]:
        out.append(f"\nLP root bound under the best preemptive plan: p50 {pct(summary['root'], 50):.3f}%, max "
                   f"{max(summary['root']):.3f}% (the search's own bound after {exact_cap_s:g} s, where it did not "
                   f"prove: p50 {pct(summary['search'], 50):.3f}%). LP B&B within a gap of {gap:g}: "
                   f"{summary['done']} of {summary['rows']} proven within {lp_cap_s:g} s{_lp_nodes(summary['nodes'])}.")
        for j, link in enumerate(("preemptive", "EDF")):
            counts = [x[j][1] for x in summary["left"] if x[j] is not None]
            proven = [x[j][1] for x, e in zip(summary["left"], summary["exact"][j]) if x[j] is not None and e]
            where = (f"; where that plan is proven optimal ({len(proven)} batches), at least {min(proven)} plans left"
                     if proven else "")
            capped = sum(c >= fix_cap for c in counts)
            out.append(f"Reduced-cost fixing against the best {link} plan: plans left p50 {pct(counts, 50):.0f} "
                       f"({capped} of {len(counts)} at the count's cap of {fix_cap}){where}.")
    if summary["traced"]:
        shares = [100 * cut / n for cut, n, _, _ in summary["traced"]]
        proven = [100 * cut / n for cut, n, _, exact in summary["traced"] if exact]
        finished = sum(done for _, _, done, _ in summary["traced"])
        out.append(f"The reduced costs as a bound inside the exact search: of the nodes each traced search expanded, "
                   f"they cut p50 {pct(shares, 50):.1f}%, max {max(shares):.1f}% (none in "
                   f"{sum(s == 0 for s in shares)} of {len(shares)} batches"
                   + (f"; where the EDF plan is proven optimal, p50 {pct(proven, 50):.1f}%" if proven else "")
                   + "). A search with both bounds would not expand those nodes: the bound never falls down the "
                   "tree, and that search's incumbent is never above the best EDF plan. "
                   f"{finished} of {len(shares)} traces finished within {trace_cap_s:g} s; the others are the first "
                   "part of a depth-first search, so how much of it they cover depends on the machine's speed. The "
                   "root LP the reduced costs come from took the 'LP root s' above.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=30, help="(16, 80) batches of the speed table (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exact-cap-s", type=float, default=2.0, help="cap of each exact solve, s (default %(default)s)")
    ap.add_argument("--gap", type=float, default=1e-4,
                    help="relative gap of the LP branch and bound (default %(default)s)")
    ap.add_argument("--lp-cap-s", type=float, default=5.0,
                    help="cap of each LP branch and bound, s (default %(default)s)")
    ap.add_argument("--note", default="", help="a sentence added to the --md fragment (e.g. how fast the machine ran)")
    ap.add_argument("--fix-cap", type=int, default=100_000,
                    help="most plans reduced-cost fixing counts per batch and link (default %(default)s)")
    ap.add_argument("--trace-cap-s", type=float, default=5.0,
                    help="seconds of each traced reference search the fixing bound is checked on (default %(default)s)")
    ap.add_argument("--md", metavar="PATH", help="write the table as a Markdown fragment (docs/results/planner_lp.md)")
    args = ap.parse_args()
    require_positive(ap, args, ("calls", "exact_cap_s", "lp_cap_s", "fix_cap", "trace_cap_s"))
    if not 0 <= args.gap < 1:
        ap.error(f"--gap must be in [0, 1), got {args.gap}")
    warm_up()
    started, machine = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), _machine()
    out: list[str] = []
    bench_lp(args.calls, args.seed, args.exact_cap_s, args.gap, args.lp_cap_s, out, fix_cap=args.fix_cap,
             trace_cap_s=args.trace_cap_s)
    print("\n".join(out))
    if args.md:
        write_fragment(args.md, "Planner: how tight a linear relaxation gets at (16, 80)",
                       "python benchmarks/planner_lp.py " + shlex.join(sys.argv[1:]), started, machine,
                       f"seed {args.seed}. The batches of `benchmarks/planner.py`'s speed table"
                       + (f". {args.note.rstrip('.')}" if args.note else ""), out)


if __name__ == "__main__":
    main()
