"""Would an LP-bounded branch and bound prove (16, 80) plans faster than the planner's own search?

Run: ``python benchmarks/lp_search.py [--batches 6] [--max-lps 4000] [--branching single|sos]`` (needs highspy, which
orbitflow does not depend on: ``pip install highspy``). Evidence for issue 17's (16, 80) goal, not a planner feature.

The LP is :mod:`benchmarks.lp_bound`'s relaxation (each request's candidates as convex weights, the propagated
bound's recursion as rows on the layers' finish times, the capacity equation), but its window rows
``f_l >= f_m + v[m+1, l] + c_l`` are generated: start with the rows released at t=0, the layer chain, the buffer and
capacity rows; after each solve, add the window rows on the critical chain of the propagated bound of the LP's own
weights, until that bound is no higher than the LP's value (then the LP is the full one's optimum). The rows stay
for every node (they hold for all weights), and HiGHS re-solves from the last basis.

The search is given the exact planner's plan (``--cap-s``) as its incumbent from the start, so what it does is the
proof alone: depth first, each node's LP re-solved with the requests' allowed candidates as column bounds, cut when
infeasible or no better than the incumbent. It branches on the request whose weights are the most spread
(``single``: its heaviest candidate fixed, then forbidden; ``sos``: its candidates split at the weights' mean
offload count). Compare with ``python benchmarks/planner.py --sections proof``, the planner's own search given the
same incumbent.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from orbitflow.plan import Planner  # noqa: E402
from orbitflow.plan.search import BranchAndBound  # noqa: E402
from orbitflow.plan.types import PlanStats  # noqa: E402

try:
    import highspy
except ImportError:  # pragma: no cover - optional
    highspy = None

from lp_bound import buffer_row, capacity_row, chain_row, columns, window_row  # noqa: E402  (the same LP's rows)
from planner import speed_cases  # noqa: E402  (benchmarks/planner.py: the speed table's batches)


class GeneratedLP:
    """The relaxation of one batch (``bb``: a :class:`BranchAndBound` of it, only read) in a HiGHS model whose
    window rows are added as they are found violated."""

    def __init__(self, bb: BranchAndBound) -> None:
        self.bb = bb
        self.n_layers, self.n_req = n_layers, n_req = bb.n_layers, bb.n_req
        self.n_cand, self.f0, _ = columns(bb)
        self.n_lam = self.f0  # the weights' columns come first
        self.x, self.comp, self.mats = bb.x0, bb.comp0, bb.tables.mats
        inf = highspy.kHighsInf
        self.h = h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        n_var = self.n_lam + n_layers + 1
        h.addVars(n_var, np.zeros(n_var), np.concatenate((np.ones(self.n_lam), np.full(n_layers + 1, inf))))
        h.changeColCost(self.f0 + n_layers - 1, 1.0)
        self.windows: set[tuple[int, int]] = set()
        for q in range(n_req):  # each request's weights sum to one
            self._row([(q * self.n_cand + k, 1.0) for k in range(self.n_cand)], 1.0, lower=1.0)
        for layer in range(n_layers):
            self._row(*buffer_row(bb, layer))
        self._row(*capacity_row(bb))
        for layer in range(n_layers):
            self.add_window(-1, layer)
            if layer:
                self._row(*chain_row(bb, layer))

    def _row(self, entries: list[tuple[int, float]], upper: float, lower: float = -math.inf) -> None:
        idx = np.array([c for c, _ in entries], dtype=np.int32)
        self.h.addRow(max(lower, -highspy.kHighsInf), upper, idx.size, idx,
                      np.array([v for _, v in entries], dtype=float))

    def add_window(self, m: int, layer: int) -> bool:
        """The row ``f_layer >= f_m + v[m+1, layer] + c_layer`` (``m = -1``: released at t=0), once."""
        if (m, layer) in self.windows:
            return False
        self.windows.add((m, layer))
        self._row(*window_row(self.bb, m, layer))
        return True

    def solve(self) -> tuple[float, np.ndarray, int]:
        """The optimum over the rows so far (inf when infeasible), its weights ``[R, K]`` and the re-solves it took,
        after adding the critical chain's rows until the propagated bound of the weights is no higher."""
        solves = 0
        while True:
            self.h.run()
            solves += 1
            if self.h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
                return float("inf"), np.zeros((self.n_req, self.n_cand)), solves
            value = self.h.getInfo().objective_function_value
            lam = np.array(self.h.getSolution().col_value[: self.n_lam]).reshape(self.n_req, self.n_cand)
            bound, chain = self._critical_chain(lam)
            added = sum(self.add_window(m, layer) for m, layer in chain)
            if bound <= value * (1 + 1e-9) or not added:
                return value, lam, solves

    def _critical_chain(self, lam: np.ndarray) -> tuple[float, list[tuple[int, int]]]:
        """The propagated bound of fractional weights and the window terms on its critical chain."""
        v = np.einsum("k,kab->ab", (self.x[:, None] * lam).sum(axis=0), self.mats)
        finish, came = np.empty(self.n_layers), [-1] * self.n_layers
        finish[0] = v[0, 0] + self.comp[0]
        for layer in range(1, self.n_layers):
            later = finish[:layer] + v[1: layer + 1, layer]
            m = int(later.argmax())
            start, came[layer] = finish[layer - 1], -2  # -2: the previous layer's end
            if v[0, layer] > start:
                start, came[layer] = v[0, layer], -1
            if later[m] > start:
                start, came[layer] = later[m], m
            finish[layer] = start + self.comp[layer]
        chain, layer = [], self.n_layers - 1
        while layer >= 0:
            if came[layer] == -2:
                layer -= 1
                continue
            chain.append((came[layer], layer))
            if came[layer] == -1:
                break
            layer = came[layer]
        return float(finish[-1]), chain

    def allow(self, mask: np.ndarray) -> None:
        """Only the candidates ``mask[q, k]`` may carry weight."""
        n = self.n_lam
        self.h.changeColsBounds(n, np.arange(n, dtype=np.int32), np.zeros(n), mask.reshape(-1).astype(float))


def prove(lp: GeneratedLP, incumbent: float, max_lps: int, branching: str) -> dict:
    """Depth-first LP-bounded search for a plan better than ``incumbent``; counts of what it did."""
    out = {"lps": 0, "cut by bound": 0, "infeasible": 0, "leaves": 0, "done": True}
    stack = [np.ones((lp.n_req, lp.n_cand), dtype=bool)]
    while stack:
        if out["lps"] >= max_lps:
            out["done"] = False
            break
        mask = stack.pop()
        lp.allow(mask)
        value, lam, _ = lp.solve()
        out["lps"] += 1
        if not np.isfinite(value):
            out["infeasible"] += 1
            continue
        if value >= incumbent * (1 - 1e-12):
            out["cut by bound"] += 1
            continue
        free = mask.sum(axis=1) > 1
        if not free.any():
            out["leaves"] += 1  # a complete plan with its propagated bound below the incumbent: simulate it
            continue
        spread = np.where(free, 1.0 - lam.max(axis=1), -1.0)
        q = int(spread.argmax())
        if branching == "sos":
            allowed = np.flatnonzero(mask[q])  # candidates in increasing offload count
            w = lam[q, allowed]
            cut = min(max(int((w * np.arange(allowed.size)).sum() / max(w.sum(), 1e-12)), 0), allowed.size - 2)
            parts = [allowed[: cut + 1], allowed[cut + 1:]]
            if lam[q, parts[0]].sum() < 0.5:
                parts.reverse()
        else:
            k = int(lam[q].argmax())
            parts = [np.array([k]), np.setdiff1d(np.flatnonzero(mask[q]), [k])]
        for part in reversed(parts):  # the first part is explored first
            child = mask.copy()
            child[q] = False
            child[q, part] = True
            stack.append(child)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="16x80", help="(R)x(L) of the batches (default %(default)s)")
    ap.add_argument("--batches", type=int, default=6, help="feasible batches to search, drawn as the speed table's "
                    "(default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cap-s", type=float, default=2.0, help="the planner's exact solve (the incumbent) is stopped "
                    "here (seconds)")
    ap.add_argument("--max-lps", type=int, default=4000, help="node LPs before a search gives up (default %(default)s)")
    ap.add_argument("--branching", choices=("single", "sos"), default="single")
    args = ap.parse_args()
    if highspy is None:
        ap.error("needs highspy: pip install highspy")
    n_req, n_layers = (int(v) for v in args.size.split("x"))
    print("| batch | planner proven | root LP ms | root rows | root s | node LPs | cut by bound | infeasible | "
          "leaves | s | proof done |")
    print("|---" * 11 + "|")
    searched = 0
    for i, (cm, cap, reqs) in enumerate(speed_cases(args.seed, n_req, n_layers, 30)):
        if searched >= args.batches:
            break
        planner = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False,
                          time_limit_s=args.cap_s)
        plan = planner.plan(reqs)
        if not plan.feasible:
            continue
        searched += 1
        rules = planner.constraints
        start = time.perf_counter()
        lp = GeneratedLP(BranchAndBound(rules, rules.horizon(reqs), PlanStats()))
        root, _, _ = lp.solve()
        root_s = time.perf_counter() - start
        rows = len(lp.windows)
        got = prove(lp, plan.predicted_step_s, args.max_lps, args.branching)
        took = time.perf_counter() - start
        print(f"| {i} | {plan.stats.exact} | {root * 1e3:.2f} | {rows} | {root_s:.3f} | {got['lps']} | "
              f"{got['cut by bound']} | {got['infeasible']} | {got['leaves']} | {took:.2f} | {got['done']} |",
              flush=True)


if __name__ == "__main__":
    main()
