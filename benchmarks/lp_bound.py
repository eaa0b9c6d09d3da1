"""How tight could a root bound be? The LP relaxation of the planner's problem against the branch and bound's bounds.

Run: ``python benchmarks/lp_bound.py [--size 16x80] [--batches 30] [--seed 0]`` (needs SciPy, which orbitflow does not
depend on: ``pip install scipy``). Evidence for issue 17's (16, 80) goal, not a planner feature.

The relaxation. Each request ``q`` picks candidate ``k`` with weight ``lam[q, k]`` (convex combination), the transfer
matrices of the propagated bound (:func:`orbitflow.plan.bounds.dp_bound`) are the weighted sums ``v = sum_q x_q
sum_k lam[q, k] N_k``, and the layer finish times ``f`` obey that bound's recursion as inequalities
(``f_l >= f_{l-1} + c_l``, ``f_l >= v[0, l] + c_l``, ``f_l >= f_m + v[m+1, l] + c_l``); the capacity equation at
the window's capacity step holds with the buffer as a variable above every layer's buffered blocks. Minimise
``f_{L-1}``. For integral weights the least ``f_{L-1}`` is the propagated bound of that assignment, which is at most
its exact latency, so the LP optimum bounds every feasible plan (the SLO rule is left out: a relaxation too).

Printed per batch: the LP bound, the planner's own lower bound and plan after ``--cap-s`` seconds (exact solve),
how many requests the LP leaves fractional, and how many complete assignments a search bounded by the LP's duals held
fixed (a Lagrangian bound, O(1) per child) could not cut below that plan (:func:`under_fixed_duals`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from orbitflow.plan import Planner  # noqa: E402
from orbitflow.plan.search import BranchAndBound  # noqa: E402
from orbitflow.plan.types import PlanStats  # noqa: E402

try:
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix
except ImportError:  # pragma: no cover - optional
    linprog = coo_matrix = None

from planner import speed_cases  # noqa: E402  (benchmarks/planner.py: the speed table's batches)

Row = tuple[list[tuple[int, float]], float]  # an LP row: (column, coefficient) entries <= bound


def columns(bb: BranchAndBound) -> tuple[int, int, int]:
    """The LP's column layout: candidates per request (weight of request ``q``'s candidate ``k``: column
    ``q * K + k``), the column of ``f_0`` (``f_l``: ``f_0 + l``) and the buffer's."""
    n_cand = len(bb.tables.counts)
    n_lam = bb.n_req * n_cand
    return n_cand, n_lam, n_lam + bb.n_layers


def window_row(bb: BranchAndBound, m: int, layer: int) -> Row:
    """``f_layer >= f_m + v[m+1, layer] + c_layer`` (``m = -1``: the transfers released at t=0, ``v[0, layer]``)."""
    n_cand, f0, _ = columns(bb)
    mats = bb.tables.mats
    entries = [(q * n_cand + k, bb.x0[q] * mats[k, m + 1, layer]) for q in range(bb.n_req) for k in range(n_cand)
               if mats[k, m + 1, layer]]
    if m >= 0:
        entries.append((f0 + m, 1.0))
    return entries + [(f0 + layer, -1.0)], -bb.comp0[layer]


def chain_row(bb: BranchAndBound, layer: int) -> Row:
    """``f_layer >= f_{layer-1} + c_layer`` (``layer >= 1``)."""
    _, f0, _ = columns(bb)
    return [(f0 + layer - 1, 1.0), (f0 + layer, -1.0)], -bb.comp0[layer]


def buffer_row(bb: BranchAndBound, layer: int) -> Row:
    """The buffer holds the blocks every request prefetches for ``layer``."""
    n_cand, _, buf = columns(bb)
    hosts = bb.tables.hosts_f
    return [(q * n_cand + k, bb.bcap[q] * hosts[k, layer]) for q in range(bb.n_req) for k in range(n_cand)
            if hosts[k, layer]] + [(buf, -1.0)], 0.0


def capacity_row(bb: BranchAndBound) -> Row:
    """The capacity equation at the window's capacity step: resident blocks plus the buffer."""
    n_cand, _, buf = columns(bb)
    counts = bb.tables.counts
    return [(q * n_cand + k, bb.bcap[q] * (bb.n_layers - counts[k])) for q in range(bb.n_req)
            for k in range(n_cand)] + [(buf, 1.0)], bb.cap


def lp_bound(bb: BranchAndBound) -> tuple[float, np.ndarray, float, np.ndarray]:
    """The LP relaxation's optimum (seconds), its weights ``[R, K]``, the solve's seconds and the reduced costs
    ``[R, K]`` of the weights at the LP's duals (see :func:`under_fixed_duals`), for the search's tables (``bb``: a
    :class:`BranchAndBound` of the batch, only read)."""
    n_layers, n_req = bb.n_layers, bb.n_req
    n_cand, n_lam, _ = columns(bb)  # the weights' columns come first: f_0's is their count
    rows, cols, vals, rhs = [], [], [], []

    def row(made: Row) -> None:
        entries, bound = made
        for c, v in entries:
            rows.append(len(rhs))
            cols.append(c)
            vals.append(v)
        rhs.append(bound)

    for layer in range(n_layers):
        row(window_row(bb, -1, layer))
        if layer:
            row(chain_row(bb, layer))
        for m in range(layer):
            row(window_row(bb, m, layer))
        row(buffer_row(bb, layer))
    row(capacity_row(bb))
    n_var = n_lam + n_layers + 1
    a_ub = coo_matrix((vals, (rows, cols)), shape=(len(rhs), n_var)).tocsr()
    a_eq = np.zeros((n_req, n_var))
    for q in range(n_req):
        a_eq[q, q * n_cand:(q + 1) * n_cand] = 1.0
    cost = np.zeros(n_var)
    cost[n_lam + n_layers - 1] = 1.0
    start = time.perf_counter()
    res = linprog(cost, A_ub=a_ub, b_ub=np.array(rhs), A_eq=a_eq, b_eq=np.ones(n_req),
                  bounds=[(0, 1)] * n_lam + [(0, None)] * (n_layers + 1), method="highs")
    took = time.perf_counter() - start
    if res.status != 0:
        raise RuntimeError(f"LP not solved: {res.message}")
    duals = np.maximum(-res.ineqlin.marginals, 0.0)  # y >= 0 of the <= rows
    reduced = (cost + a_ub.T @ duals)[:n_lam].reshape(n_req, n_cand)
    return float(res.fun), res.x[:n_lam].reshape(n_req, n_cand), took, reduced


def under_fixed_duals(reduced: np.ndarray, slack: float, bins: int = 4000) -> float:
    """How many complete assignments the LP's duals, held fixed, cannot cut: with duals ``y`` the Lagrangian
    ``LP + sum_q (reduced[q, k_q] - min_k reduced[q, k])`` bounds every assignment (and, summed over the assigned
    requests only, every node: an O(1) bound per child), so those whose excess stays within ``slack`` (best plan
    minus LP) survive it. Counted by a histogram over the excess, rounded down (an over-count by rounding only)."""
    excess = reduced - reduced.min(axis=1, keepdims=True)
    hist = np.zeros(bins + 1)
    hist[0] = 1.0
    scale = bins / max(slack, 1e-15)
    for row in excess:
        new = np.zeros_like(hist)
        for e in row:
            shift = int(e * scale)
            if shift <= bins:
                new[shift:] += hist[: bins + 1 - shift]
        hist = new
    return float(hist.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="16x80", help="(R)x(L) of the batches (default %(default)s)")
    ap.add_argument("--batches", type=int, default=30, help="batches, drawn as the speed table's (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cap-s", type=float, default=2.0, help="the planner's exact solve is stopped here (seconds)")
    args = ap.parse_args()
    if linprog is None:
        ap.error("needs SciPy: pip install scipy")
    n_req, n_layers = (int(v) for v in args.size.split("x"))
    cases = speed_cases(args.seed, n_req, n_layers, args.batches)
    print("| batch | LP bound ms | LP s | fractional | planner lower bound ms | planner plan ms | proven | "
          "LP to plan | assignments the fixed duals cannot cut |")
    print("|---" * 9 + "|")
    for i, (cm, cap, reqs) in enumerate(cases):
        planner = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False,
                          time_limit_s=args.cap_s)
        plan = planner.plan(reqs)
        if not plan.feasible:
            print(f"| {i} | | | | | no feasible plan found | {plan.stats.exact} | |")
            continue
        rules = planner.constraints
        bb = BranchAndBound(rules, rules.horizon(reqs), PlanStats())
        bound, lam, took, reduced = lp_bound(bb)
        frac = int(((lam > 1e-6).sum(axis=1) > 1).sum())
        uncut = under_fixed_duals(reduced, plan.predicted_step_s - bound)
        print(f"| {i} | {bound * 1e3:.2f} | {took:.2f} | {frac}/{n_req} | {plan.stats.lower_bound_s * 1e3:.2f} | "
              f"{plan.predicted_step_s * 1e3:.2f} | {plan.stats.exact} | "
              f"{100 * (plan.predicted_step_s / bound - 1):.2f}% | {uncut:.3g} |", flush=True)


if __name__ == "__main__":
    main()
