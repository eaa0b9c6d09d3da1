"""Planner benchmark: solve time per call, brute-force agreement, and full vs pruned space.

Run: ``python benchmarks/planner.py [--quick] [--md docs/results/planner.md]`` (from the repo root, with ``src`` on
the path or installed). Every speed number is the compiled planner against the pure Python / NumPy reference
(``Planner(compiled=False)``) measured in the same run, interleaved; nothing here is a timed assertion.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections import deque

import numpy as np
from tqdm import tqdm

try:
    from numba import njit
except ImportError:  # pragma: no cover - the link-order search then runs interpreted (slowly)
    def njit(**_):
        return lambda fn: fn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from orbitflow.plan import CostModel, Placement, Planner, PlanRequest, pruned_distances, search, warm_up  # noqa: E402
from orbitflow.plan.bounds import TAIL_MIN, dp_bound  # noqa: E402
from orbitflow.plan.types import PlanStats  # noqa: E402


def random_instance(rng: np.random.Generator, n_req: int, n_layers: int, slo_scale: float | None = None):
    """Realistic random batch: 8..1024 blocks per layer, 1-2 ms per layer, link 1.9-6x a layer's compute
    for one layer of the whole batch, capacity 0.3-0.6 of the full KV, SLO 1.5-2.5x the no-offload step."""
    base = rng.uniform(1e-3, 2e-3)
    comp = base * rng.uniform(0.95, 1.05, n_layers)
    b = np.exp(rng.uniform(np.log(8), np.log(1024), n_req)).astype(int)
    ratio = rng.uniform(1.9, 6.0)
    link = float(b.sum() / (ratio * comp.mean()))
    cap = float(b.sum() * n_layers * rng.uniform(0.3, 0.6))
    scale = slo_scale if slo_scale is not None else rng.uniform(1.5, 2.5)
    slo = scale * float(comp.sum())
    reqs = [
        PlanRequest(
            request_id=i,
            blocks_per_layer=int(b[i]),
            tokens=int(b[i] * 16 - rng.integers(0, 16)),
            tokens_left=int(rng.integers(1, 4000)) if rng.random() < 0.7 else None,
            deposit=float(rng.uniform(0, 20)),
            slo_s=slo,
        )
        for i in range(n_req)
    ]
    return CostModel(comp, link), cap, reqs


def speed_cases(seed: int, n_req: int, n_layers: int, n: int) -> list:
    """The speed table's ``n`` batches of size (``n_req``, ``n_layers``) for ``seed``: every section and script that
    compares against that table draws them here."""
    rng = np.random.default_rng(seed + 1000 * n_req + n_layers)
    return [random_instance(rng, n_req, n_layers) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def batches_of(calls: int, n_layers: int) -> int:
    """Batches per size of the speed table and the sections that re-solve them: a tenth at L=80 (3 at least)."""
    return calls if n_layers < 80 else max(3, calls // 10)


def _solve(cm, cap, reqs, compiled: bool, cpu=time.thread_time, **kwargs):
    """One plan() call: (wall seconds, CPU seconds by ``cpu``: this thread's, or every thread's with
    ``time.process_time``, plan)."""
    pl = Planner(cm, cap, alpha=1.0, window=(4, 16), compiled=compiled, **kwargs)
    w, c = time.perf_counter(), cpu()
    p = pl.plan(reqs)
    return time.perf_counter() - w, cpu() - c, p


def _load_compiled(sizes, seed: int) -> None:
    """Load the compiled code (numba's on-disk cache) for each size before timing."""
    for n_req, n_layers in sizes:
        _solve(*random_instance(np.random.default_rng(seed), n_req, n_layers), compiled=True, time_limit_s=0.05)


IMPLS = {"compiled": True, "reference": False}
EXACT = {"node_limit": None, "check_better": False}  # the optimisation proven (expiry checks are extra searches)


def _budget_vs_baseline(size: str, got: list[float], baseline: dict | None) -> str:
    """The table cell comparing the compiled budgeted plans' latencies with a baseline run's (``--compare-budget``)
    on the same batches: how many are worse (by more than 1e-9 relative) and how many better."""
    if baseline is None:
        return ""
    old = baseline.get(size)
    if old is None or len(old) != len(got):
        return " n/a |"
    worse = sum(new > o * (1 + 1e-9) for new, o in zip(got, old))
    better = sum(new < o * (1 - 1e-9) for new, o in zip(got, old))
    return f" {worse} worse, {better} better |"


def bench_speed(sizes, calls: int, seed: int, budget_s: float, exact_cap_s: float, out: list[str],
                baseline: dict | None = None, dump: dict | None = None, threads: int = 1) -> None:
    """Exact and budgeted solves, compiled vs the pure Python / NumPy reference, interleaved per batch; with
    ``threads`` > 1 also the compiled exact solve on that many threads. ``baseline``: budgeted latencies per size of
    another run (``--compare-budget``); ``dump``: filled with this run's (``--dump-budget``)."""
    par = f"compiled, {threads} threads"
    out.append(f"\n### Solve time per plan() call: compiled vs reference\n\n"
               f"space=pruned, window=(4, 16), alpha=1. exact: `node_limit=None, check_better=False` (the optimum "
               f"proven), stopped at `time_limit_s={exact_cap_s:g}` (then counted in 'exact unproven' and its time "
               f"is a lower bound); budget: `time_limit_s={budget_s:g}`, Planner defaults otherwise (expiry checks "
               f"included). "
               f"Per batch both implementations run back to back, alternating which goes first. wall: "
               f"perf_counter; cpu: the solving thread's CPU time (what a quiet machine's wall time would be). "
               f"excess: predicted step latency of the budgeted plan over the exact optimum; same opt: the "
               f"compiled and reference exact plans have the same predicted latency (batches where both proved a "
               f"feasible optimum; the excess, too, only counts batches with a proven optimum: n/a where none)."
               + (f" {par}: the compiled exact solve with `threads={threads}` (Planner's: its search split among "
                  f"{threads} threads once past {search.PARALLEL_AFTER} nodes; budgeted solves keep a node limit, so "
                  f"they run on one thread), after the other two; its cpu column is the process's CPU time (every "
                  f"thread's), its same opt compares it with the compiled one-thread exact plans."
                  if threads > 1 else "")
               + (f" vs baseline: the compiled budgeted plan's predicted latency against the baseline run's "
                  f"(`--compare-budget`, {baseline.get('source', '?')}) on the same batches (infeasible: infinite)."
                  if baseline is not None else "") + "\n")
    out.append("| R | L | batches | impl | exact p50 ms | exact p99 ms | exact p99 cpu ms | exact unproven | "
               "budget p50 ms | budget p99 ms | budget p99 cpu ms | excess mean | excess max | budget unproven | "
               "same opt |" + (" vs baseline |" if baseline is not None else ""))
    out.append("|---" * (16 if baseline is not None else 15) + "|")
    _load_compiled(sizes, seed)
    for n_req, n_layers in sizes:
        n_calls = batches_of(calls, n_layers)
        cases = speed_cases(seed, n_req, n_layers, n_calls)
        rec = {name: {"ew": [], "ec": [], "bw": [], "bc": [], "opt": [], "excess": [], "lost": 0, "cut": 0, "open": 0,
                      "lat": []} for name in IMPLS}
        for i, (cm, cap, reqs) in enumerate(tqdm(cases, desc=f"R={n_req} L={n_layers}", leave=False)):
            names = list(IMPLS) if i % 2 == 0 else list(IMPLS)[::-1]
            for name in names:
                r = rec[name]
                w, c, p = _solve(cm, cap, reqs, IMPLS[name], time_limit_s=exact_cap_s, **EXACT)
                r["open"] += not p.stats.exact
                r["ew"].append(w)
                r["ec"].append(c)
                opt = p.predicted_step_s if p.feasible and p.stats.exact else None
                r["opt"].append(opt)
                w, c, b = _solve(cm, cap, reqs, IMPLS[name], time_limit_s=budget_s)
                r["bw"].append(w)
                r["bc"].append(c)
                r["cut"] += not b.stats.exact
                r["lat"].append(b.predicted_step_s if b.feasible else float("inf"))
                if b.feasible and opt is not None:
                    r["excess"].append(b.predicted_step_s / opt - 1)
                elif opt is not None:
                    r["lost"] += 1  # out of budget before any plan: reported infeasible though one exists
            if threads > 1:
                w, c, p = _solve(cm, cap, reqs, True, cpu=time.process_time, threads=threads,
                                 time_limit_s=exact_cap_s, **EXACT)
                r = rec.setdefault(par, {"ew": [], "ec": [], "opt": [], "open": 0})
                r["ew"].append(w)
                r["ec"].append(c)
                r["open"] += not p.stats.exact
                r["opt"].append(p.predicted_step_s if p.feasible and p.stats.exact else None)
        both = [(a, b) for a, b in zip(rec["compiled"]["opt"], rec["reference"]["opt"])
                if a is not None and b is not None]
        same = f"{sum(a == b for a, b in both)}/{len(both)}"
        size = f"{n_req}x{n_layers}"
        if dump is not None:
            dump[size] = rec["compiled"]["lat"]
        for name, r in rec.items():
            if name == par:  # exact only; the same optimum as the compiled one-thread search
                pair = [(a, b) for a, b in zip(rec["compiled"]["opt"], r["opt"]) if a is not None and b is not None]
                out.append(f"| {n_req} | {n_layers} | {n_calls} | {name} | {1e3 * pct(r['ew'], 50):.2f} | "
                           f"{1e3 * pct(r['ew'], 99):.2f} | {1e3 * pct(r['ec'], 99):.2f} | {r['open']}/{n_calls} | "
                           f"- | - | - | - | - | - | {sum(a == b for a, b in pair)}/{len(pair)} |"
                           + (" |" if baseline is not None else ""))
                continue
            versus = _budget_vs_baseline(size, r["lat"], baseline) if name == "compiled" else (
                " |" if baseline is not None else "")
            ex = r["excess"]
            lost = f" ({r['lost']} infeasible)" if r["lost"] else ""
            out.append(
                f"| {n_req} | {n_layers} | {n_calls} | {name} | {1e3 * pct(r['ew'], 50):.2f} | "
                f"{1e3 * pct(r['ew'], 99):.2f} | {1e3 * pct(r['ec'], 99):.2f} | {r['open']}/{n_calls} | "
                f"{1e3 * pct(r['bw'], 50):.2f} | "
                f"{1e3 * pct(r['bw'], 99):.2f} | {1e3 * pct(r['bc'], 99):.2f} | "
                + (f"{100 * float(np.mean(ex)):.2f}% | {100 * max(ex):.2f}%{lost} | " if ex else f"n/a | n/a{lost} | ")
                + f"{r['cut']}/{n_calls} | {same} |" + versus)
        print("\n".join(out[-len(rec):]), flush=True)


def bench_budget_seeds(size: tuple[int, int], calls: int, seeds: list[int], budget_s: float, out: list[str]) -> None:
    """The compiled budgeted solves' excess over the optimum on other seeds' batches: how much the speed table's
    one draw can be trusted. A budget-cut plan depends on how far the search got, so on timing too: the same batch
    can land either side of a threshold on two runs."""
    n_req, n_layers = size
    out.append(f"\n### Budgeted plans on other seeds (compiled)\n\n({n_req}, {n_layers}), {calls} random batches "
               f"per seed drawn as in the table above, `time_limit_s={budget_s:g}` with the Planner's defaults; excess "
               f"over the compiled exact optimum of the same batch (batches with a proven feasible optimum). A "
               f"budget-cut plan depends on how far the search got, so on the machine's speed at that moment too.\n")
    out.append("| seed | batches | budget p50 ms | budget p99 ms | excess mean | excess max | plans > 1% | "
               "plans > 5% |")
    out.append("|---" * 8 + "|")
    for seed in seeds:
        cases = speed_cases(seed, n_req, n_layers, calls)
        _solve(*cases[0], compiled=True, time_limit_s=0.05)  # load the compiled code
        walls, excess, lost = [], [], 0
        for cm, cap, reqs in tqdm(cases, desc=f"seed {seed}", leave=False):
            _, _, ex = _solve(cm, cap, reqs, True, time_limit_s=2.0, **EXACT)
            w, _, b = _solve(cm, cap, reqs, True, time_limit_s=budget_s)
            walls.append(w)
            if ex.feasible and ex.stats.exact:
                if b.feasible:
                    excess.append(b.predicted_step_s / ex.predicted_step_s - 1)
                else:
                    lost += 1
        lost_s = f" ({lost} infeasible)" if lost else ""
        out.append(f"| {seed} | {len(excess) + lost} | {1e3 * pct(walls, 50):.2f} | {1e3 * pct(walls, 99):.2f} | "
                   f"{100 * float(np.mean(excess)):.2f}% | {100 * max(excess):.2f}%{lost_s} | "
                   f"{sum(e > 0.01 for e in excess)} | {sum(e > 0.05 for e in excess) + lost} |")
        print(out[-1], flush=True)


def bench_bruteforce(trials: int, seed: int) -> None:
    print(f"\n== exactness vs brute-force enumeration of the pruned space ({trials} instances, "
          "R<=5, L<=12; L<=8 when R=5) ==")
    rng = np.random.default_rng(seed)
    mism = unproven = 0
    for _ in range(trials):
        n_req = int(rng.integers(1, 6))
        n_layers = int(rng.integers(2, 13 if n_req < 5 else 9))
        cm, cap, reqs = random_instance(rng, n_req, n_layers, slo_scale=float(rng.uniform(1.0, 3.0)))
        pl = Planner(cm, cap, alpha=float(rng.choice([0.0, 0.5, 1.0])), window=(2, 12), check_better=False)
        got = pl.plan(reqs)
        unproven += int(got.stats.exact) == 0
        best = None
        for ds in itertools.product(pruned_distances(n_layers), repeat=n_req):
            e = pl.evaluate(Placement.from_distances(n_layers, ds), reqs)
            if e.feasible and (best is None or e.predicted_step_s < best):
                best = e.predicted_step_s
        same = (best is None and not got.feasible) or (
            best is not None and got.feasible and abs(best - got.predicted_step_s) <= 1e-9 * best
        )
        mism += not same
    print(f"mismatches: {mism} / {trials} (searches that hit node_limit: {unproven})")


def bench_floor(calls: int, seed: int, n_req: int = 4, n_layers: int = 32) -> None:
    """How fast could ANY exact search be here, if its bounds were never tighter than a preemptive link's
    latency (``bounds.dp_bound``, the tightest of ours)? Every placement that fits capacity, passes the SLO
    prefilter and whose preemptive latency is below the optimum can only be ruled out by simulating the
    executor's non-preemptive schedule. Those simulations alone, each stopped once it passes the optimum,
    give a floor on the solve time, with free bounds and an oracle that knows the optimum up front."""
    from orbitflow.plan.bounds import dp_bound
    from orbitflow.plan.cost_model import edf_stalls
    from orbitflow.plan.search import candidate_tables

    print(f"\n== exactness floor at (R, L) = ({n_req}, {n_layers}), {calls} instances: placements only a "
          "simulation can rule out ==")
    tables = candidate_tables(n_layers)
    every = np.array(list(itertools.product(range(len(tables.counts)), repeat=n_req)))  # [N, R] candidates
    hosts = tables.hosts_f[every]  # [N, R, L]
    counts, floors = [], []
    for cm, cap, reqs in speed_cases(seed, n_req, n_layers, calls):
        pl = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False)
        best = pl.plan(reqs)
        if not best.feasible:
            continue
        opt = best.predicted_step_s
        win = pl.constraints.horizon(reqs)
        bcap = win.blocks[pl.min_steps - 1][None, :, None]
        memory = (bcap * (1 - hosts)).sum(axis=(1, 2)) + (bcap * hosts).sum(axis=1).max(axis=1)
        fits = every[memory <= cap * (1 + 1e-12) + 1e-9]
        xfer, comp = win.blocks[0] / cm.link_blocks_per_s, np.asarray(win.comp[0])
        preemptive = np.concatenate([
            dp_bound(np.einsum("r,nrab->nab", xfer, tables.mats[chunk]), comp)
            for chunk in np.array_split(fits, max(1, len(fits) // 512))
        ]) if len(fits) else np.zeros(0)
        slo_ok = pl.constraints.lat_prefilter(win)
        rivals = [ks for ks, lat in zip(fits, preemptive) if lat < opt * (1 - 1e-12) and slo_ok(float(lat))]
        comp_list, xfer_list = comp.tolist(), xfer.tolist()
        t = time.perf_counter()
        for ks in rivals:
            edf_stalls(comp_list, [tables.lists[k] for k in ks], xfer_list, abort_above=opt)
        floors.append(time.perf_counter() - t)
        counts.append(len(rivals))
    print(f"placements to simulate: p50 {pct(counts, 50):.0f}, p90 {pct(counts, 90):.0f}, "
          f"p99 {pct(counts, 99):.0f}, max {max(counts)}")
    print(f"time for those simulations alone: p50 {1e3 * pct(floors, 50):.2f} ms, p90 {1e3 * pct(floors, 90):.2f} "
          f"ms, p99 {1e3 * pct(floors, 99):.2f} ms, max {1e3 * max(floors):.2f} ms")


class LeafGaps(search.BranchAndBound):
    """The reference search (the ``compiled=False`` path), recording in ``seen`` the (release/need bound, exact step-0
    latency) of each leaf: a complete plan it schedules exactly because no bound cut it (the proof section), and in
    ``plans`` the candidate per request of the same leaf."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiled = False  # the reference path: its leaves pass through _leaf
        self.seen: list[tuple[float, float]] = []
        self.plans: list[list[int]] = []

    def _leaf(self, choice, host=None, lb=0.0):
        k_of = self.by_request(choice)
        v = sum(self.x0[r] * self.mats[k] for r, k in enumerate(k_of))
        self.seen.append((float(dp_bound(v[None], self.comp0)[0]), self._lat0(k_of)))
        self.plans.append(k_of)
        super()._leaf(choice, host, lb)


# -- link orders (proof section): is the gap at the leaves non-preemption, or EDF's order? ----------------------------
# Any non-preemptive schedule of the link is an order of its copies, each started as soon as the link is free and the
# copy released (a request's next copy once its previous host layer has run; slots = 1), so the best order's latency
# is the least any non-preemptive link reaches. A copy is an id ``t`` of the flattened host lists: ``lay[t]`` its
# layer, ``first[t]`` whether it is its request's first (released at t=0), ``xf[t]`` its seconds.
def order_arrays(comp, hosts, xfer) -> tuple:
    """The arrays :func:`order_latency` reads, for host lists ``hosts[r]`` (increasing) and seconds ``xfer[r]``."""
    lay = np.asarray([layer for h in hosts for layer in h], dtype=np.int64)
    first = np.asarray([i == 0 for h in hosts for i in range(len(h))], dtype=np.bool_)
    xf = np.asarray([x for h, x in zip(hosts, xfer) for _ in h], dtype=float)
    need = np.bincount(lay, minlength=len(comp)).astype(np.int64)
    return np.asarray(comp, dtype=float), lay, first, xf, need


@njit()
def order_latency(comp, lay, first, xf, need, seq):
    """Step latency when the link moves the copies in the order ``seq`` (inf: a copy waits on a layer whose KV comes
    later in ``seq``, so the order deadlocks)."""
    n_layers = comp.size
    got, arrive, end = np.zeros(n_layers, np.int64), np.zeros(n_layers), np.zeros(n_layers)
    done, prev, t = 0, 0.0, 0.0  # layers run so far, the last one's end, the link's time
    for s in seq:
        if not first[s]:
            p = lay[s - 1]  # released when its request's previous host layer has run
            while done <= p:
                if got[done] < need[done]:
                    return np.inf
                prev = max(prev, arrive[done]) + comp[done]
                end[done] = prev
                done += 1
            t = max(t, end[p])
        t += xf[s]
        got[lay[s]] += 1
        arrive[lay[s]] = max(arrive[lay[s]], t)
    while done < n_layers:
        if got[done] < need[done]:
            return np.inf
        prev = max(prev, arrive[done]) + comp[done]
        done += 1
    return prev


@njit()
def improve_order(comp, lay, first, xf, need, seq, span=8, max_passes=50):
    """Local search over link orders from ``seq``: move one copy up to ``span`` places, keep the first move that
    shortens the step; returns (latency, order) once a pass over every copy finds none (or after ``max_passes``)."""
    n = seq.size
    seq, buf = seq.copy(), np.empty_like(seq)
    best = order_latency(comp, lay, first, xf, need, seq)
    for _ in range(max_passes):
        improved = False
        for j in range(n):
            for k in range(max(0, j - span), min(n, j + span + 1)):
                if k == j:
                    continue
                buf[:] = seq
                if k < j:
                    buf[k + 1 : j + 1] = seq[k:j]
                else:
                    buf[j:k] = seq[j + 1 : k + 1]
                buf[k] = seq[j]
                lat = order_latency(comp, lay, first, xf, need, buf)
                if lat < best * (1 - 1e-12):
                    best, improved = lat, True
                    seq[:] = buf
                    break
        if not improved:
            break
    return best, seq


def edf_order(comp, hosts, xfer) -> np.ndarray:
    """The copy ids in the order the executor's EDF link moves them (cost_model's schedule, simulated event by event:
    whenever the link is free it moves the released copy needed earliest, ties to the lower request)."""
    n_layers = len(comp)
    start = np.concatenate(([0], np.cumsum([len(h) for h in hosts]))).astype(int)
    released = {r: 0.0 for r, h in enumerate(hosts) if h}  # request -> release time of its next copy
    nxt, arrive, seq = [0] * len(hosts), {}, []
    by_layer = [[(r, i) for r, h in enumerate(hosts) for i, layer in enumerate(h) if layer == lv]
                for lv in range(n_layers)]
    end, layer, t = 0.0, 0, 0.0
    while layer < n_layers:
        if all(c in arrive for c in by_layer[layer]):  # the layer runs once its KV is here
            end = max([end] + [arrive[c] for c in by_layer[layer]]) + comp[layer]
            for r, i in by_layer[layer]:
                if i + 1 < len(hosts[r]):
                    released[r] = end
            layer += 1
            continue
        ready = [(hosts[r][nxt[r]], r) for r, rel in released.items() if rel <= t + 1e-12 + 1e-9 * t]
        if not ready:
            t = min(released.values())
            continue
        r = min(ready)[1]
        t += xfer[r]
        arrive[(r, nxt[r])] = t
        seq.append(start[r] + nxt[r])
        nxt[r] += 1
        del released[r]
    return np.asarray(seq, dtype=np.int64)


def depth_profile(tree: search.BranchAndBound, upper: float) -> list[tuple[int, int, int, list[float]]]:
    """Where a traced search's nodes are (``tree.trace``: one entry per node it expanded). Per depth ``d`` (a node
    there has assigned the first ``d`` requests of the search order): the nodes, their children, the children
    capacity keeps alive, and for each alive child that no bound cuts against ``upper`` (the best plan known from the
    start; the cut :func:`orbitflow.plan.search.prunable` and the SLO prefilter make before any leaf improves on it)
    how far its bound sits under ``upper`` (%). Every node at depth ``d + 1`` is such a child of one at depth ``d``."""
    rows = [(0, 0, 0, []) for _ in range(tree.n_req)]
    for prefix, lat_lb, kid_alive in tree.trace:
        nodes, kids, alive, under = rows[len(prefix)]
        under += [100 * (1 - lb / upper) for lb in lat_lb[kid_alive].tolist()
                  if not search.prunable(lb, 0.0, (upper, math.inf)) and tree.lat_ok(lb)]
        rows[len(prefix)] = (nodes + 1, kids + lat_lb.size, alive + int(kid_alive.sum()), under)
    return rows


def _order_gaps(gaps: LeafGaps, low_idx: np.ndarray, plan, best: float, n_leaves: int,
                seed: int) -> tuple[list[float], int, float]:
    """Up to ``n_leaves`` of the leaves ``low_idx`` (indices into ``gaps.seen``, drawn with ``seed``), each with the
    best link order :func:`improve_order` finds from EDF's: that order's latency over ``best`` (%) per leaf, and how
    many reach their release/need bound; then how much shorter the first solve's ``plan`` steps in its best order
    found (%)."""
    comp, xfer = gaps.comp0_list, gaps.x0_list
    below = sorted({(gaps.seen[j][0], tuple(gaps.plans[j])) for j in low_idx})
    rng = np.random.default_rng(seed)
    over, reached = [], 0
    for j in rng.permutation(len(below))[:n_leaves]:
        bound, k_of = below[j]
        hosts = [gaps.lists[k] for k in k_of]
        lat, _ = improve_order(*order_arrays(comp, hosts, xfer), edf_order(comp, hosts, xfer))
        reached += lat <= bound * (1 + 1e-9)
        over.append(100 * (lat / best - 1))
    hosts = [plan.placement.host_layers(r) for r in range(plan.placement.num_requests)]
    arrays, seq = order_arrays(comp, hosts, xfer), edf_order(comp, hosts, xfer)
    return over, reached, 100 * (1 - improve_order(*arrays, seq)[0] / order_latency(*arrays, seq))


def bench_proof(calls: int, seed: int, exact_cap_s: float, proof_cap_s: float, leaf_cap_s: float, out: list[str],
                n_req: int = 16, n_layers: int = 80, order_leaves: int = 6) -> None:
    """Is a better first plan what the exact search lacks at this size, or are its bounds, and which? Each batch is
    solved exactly (capped at ``exact_cap_s``), then searched again with that plan's latency as the bound to beat
    from the start (an oracle incumbent: the optimum where the first solve proved one): what is left is the proof
    alone. Then the reference search does the same for ``leaf_cap_s`` and records every complete plan it had to
    schedule exactly (its bounds did not cut it): the release/need bound of that plan (:func:`~orbitflow.plan.
    bounds.dp_bound`, the preemptive link; an LP over the same constraints is this bound once every request is
    assigned, so no bound of that family cuts such a plan) and its exact step latency. Last, for up to
    ``order_leaves`` of those below the best plan and for the first solve's plan, the best link order a local search
    finds (:func:`improve_order`): is the gap the link's non-preemption, or EDF's order?"""
    from orbitflow.plan.search import BranchAndBound

    out.append(f"\n### Why ({n_req}, {n_layers}) is not proven within 100 ms\n")
    out.append(f"{calls} batches of the speed table. Each is solved exactly (capped at {exact_cap_s:g} s), then "
               f"searched again knowing that plan's latency from the start (an oracle incumbent), by the compiled "
               f"search (capped at {proof_cap_s:g} s) and by the reference search for {leaf_cap_s:g} s. 'leaves': "
               "complete plans a search scheduled exactly because no bound cut them. For the reference search's "
               "leaves: how many have a release/need bound (`bounds.dp_bound`, the link as if preemptive; an LP "
               "relaxation over the same constraints equals it once every request is assigned) below the best plan "
               "(no bound of that family can cut them), and how far their exact (non-preemptive EDF) latency and "
               "that bound sit from the best plan. A first solve that did not prove its plan gives an incumbent that "
               "may not be optimal: a search may beat it there (a leaf: a negative 'over'), and the summary counts "
               f"the batches with a proven optimum only. 'best order': for up to {order_leaves} of the leaves with a "
               "bound below the best plan, the link order a local search finds from EDF's (`improve_order`: one copy "
               "moved up to 8 places at a time while the step shortens; any non-preemptive link is such an order), "
               "its latency over the best plan at the median and how many of them reach their bound; 'plan with best "
               "order': how much shorter the first solve's plan steps in the best order found than in EDF's.\n")
    out.append("| batch | first solve proven | first solve s | proof s | proof done | nodes | leaves | "
               "sampled leaves | bound < best | their latency over best p50 / min / max | their bound under best p50 | "
               "best order over best p50 / reach bound | plan with best order |")
    out.append("|---" * 13 + "|")
    done_s, over, under, beaten, shapes = [], [], [], 0, []
    order_over, order_n, order_reached, plan_gain = [], 0, 0, []
    profile: dict[int, list] = {}  # depth -> nodes, children, alive, bounds under best (%), over unfinished proofs
    warm_up()  # load (or compile) the kernels before the first solve is timed
    for i, (cm, cap, reqs) in enumerate(tqdm(speed_cases(seed, n_req, n_layers, calls), desc="proof", leave=False)):
        planner = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False,
                          time_limit_s=exact_cap_s)
        t = time.perf_counter()
        plan = planner.plan(reqs)
        first_s = time.perf_counter() - t
        if not plan.feasible:
            continue
        best = plan.predicted_step_s
        upper = best * (1 + 1e-9)  # the search's bound to beat: the first solve's plan, ties included
        stats = PlanStats()
        rules = planner.constraints
        search = BranchAndBound(rules, rules.horizon(reqs), stats, upper=upper,
                                deadline=time.perf_counter() + proof_cap_s)
        t = time.perf_counter()
        search.run()
        proof_s = time.perf_counter() - t
        if not search.timed_out:
            done_s.append(proof_s)
        else:
            shapes.append((stats.nodes, stats.leaves))
        gaps = LeafGaps(rules, rules.horizon(reqs), PlanStats(), upper=upper,
                        deadline=time.perf_counter() + leaf_cap_s)
        gaps.trace = []
        gaps.run()
        if search.timed_out:  # where the unfinished proofs spend their nodes
            for d, row in enumerate(depth_profile(gaps, upper)):
                profile[d] = [a + b for a, b in zip(profile[d], row)] if d in profile else list(row)
        seen = np.array(gaps.seen).reshape(-1, 2)
        is_low = seen[:, 0] < best * (1 - 1e-9)
        low = seen[is_low]
        lat_over = 100 * (low[:, 1] / best - 1)
        bound_under = 100 * (1 - low[:, 0] / best)
        if plan.stats.exact:
            over += lat_over.tolist()
            under += bound_under.tolist()
        elif search.best_key[0] < best * (1 - 1e-9) or np.any(seen[:, 1] < best * (1 - 1e-9)):
            beaten += 1
        spread = (f"{np.median(lat_over):.2f}% / {lat_over.min():.2f}% / {lat_over.max():.2f}% | "
                  f"{np.median(bound_under):.2f}%" if low.size else "- | -")
        ordered, reached, gain = _order_gaps(gaps, np.flatnonzero(is_low), plan, best, order_leaves, seed + i)
        plan_gain.append(gain)
        if plan.stats.exact:
            order_over += ordered
            order_n, order_reached = order_n + len(ordered), order_reached + reached
        ordered_cell = f"{np.median(ordered):.2f}% / {reached} of {len(ordered)}" if ordered else "-"
        out.append(f"| {i} | {plan.stats.exact} | {first_s:.2f} | {proof_s:.2f} | {not search.timed_out} | "
                   f"{stats.nodes} | {stats.leaves} | {len(seen)} | {len(low)} | {spread} | {ordered_cell} | "
                   f"{gain:.2f}% |")
        print(out[-1], flush=True)
    out.append("")
    summary = len(out)
    if done_s:
        out.append(f"Proofs done within {proof_cap_s:g} s: {len(done_s)}; their time p50 {pct(done_s, 50):.2f} s, "
                   f"least {min(done_s):.2f} s. Unproven first solves whose plan either search beat: {beaten}.")
    if shapes:
        heavy = sum(leaves > nodes / 2 for nodes, leaves in shapes)
        few = [nodes for nodes, leaves in shapes if leaves < 100]
        out.append(f"Proofs not done within {proof_cap_s:g} s: {len(shapes)}. In {heavy} of them the search scheduled "
                   "more leaves than half its nodes (plans the bounds cannot cut, each scheduled exactly); in "
                   f"{len(few)} it scheduled fewer than 100 leaves"
                   + (f", in {pct(few, 50):.0f} nodes at the median (bounds that cut only near the leaves)." if few
                      else "."))
    if over:
        out.append(f"In the batches with a proven optimum, {len(over)} sampled leaves had a release/need bound below "
                   f"it: their exact latency is {pct(over, 50):.2f}% above the optimum at the median "
                   f"({pct(over, 10):.2f}% at p10), their bound {pct(under, 50):.2f}% under it. The gap is the "
                   "link's schedule (a copy for a later layer holding the link when an urgent one is released): a "
                   "search whose bounds all come from the preemptive relaxation schedules every such plan exactly.")
    if order_n:
        out.append(f"Is that gap the link's non-preemption, or EDF's order? Of {order_n} of those leaves (proven "
                   f"batches), the local search found a non-preemptive link order reaching the release/need bound for "
                   f"{order_reached}, and one no slower than the optimum for {sum(o <= 1e-7 for o in order_over)} "
                   f"(median {pct(order_over, 50):+.3f}%). Such a plan is slower than the optimum only in EDF's order, "
                   "so no bound that holds for every order of the link can cut it; and a bound on EDF's own order "
                   "cannot count the requests not yet assigned as offloading nothing, as every bound of the search "
                   "does, since EDF is not monotone in the copies added "
                   "(`tests/plan/test_cost_model.py::test_edf_is_not_monotone_in_added_copies`).")
    if plan_gain:
        out.append(f"The first solves' plans step {pct(plan_gain, 50):.2f}% faster at the median (max "
                   f"{max(plan_gain):.2f}%, {sum(g > 1e-7 for g in plan_gain)} of {len(plan_gain)} faster at all) in "
                   "the best link order found than in EDF's, which the executor runs.")
    if profile:
        _depth_table(profile, n_req, leaf_cap_s, out)
    print("\n".join(out[summary:]))


LINKS = ("edf", "preemptive")


GAPS = (0.0, 1e-4, 1e-3)  # relative gaps of the gap section: exact, Gurobi's default MIPGap, ten times that


def bench_gap(sizes, calls: int, seed: int, exact_cap_s: float, out: list[str], gaps=GAPS) -> None:
    """The speed table's batches solved by the compiled search stopped once its plan is proven within a relative gap
    (``Planner(gap=...)``, as a MIP solver's MIPGap): what a solver that calls such a plan optimal would report."""
    out.append("\n### Exact, or within a gap\n")
    out.append(f"The speed table's batches, each solved by the compiled search with `node_limit=None, "
               f"check_better=False`, stopped at `time_limit_s={exact_cap_s:g}`, for each relative gap: 0 (the "
               f"exact search of the speed table), 1e-4 (Gurobi's default MIPGap, what the paper's solver calls "
               f"optimal) and 1e-3: the search cuts a node whose bound is within the gap of its best plan, so it "
               f"ends once that plan is proven within the gap. 'proven': solves that ended before the cap (exact, or "
               f"within the gap); nodes: the search nodes of all the batches' solves; 'certified gap': what the "
               f"unproven ones certify at the cap (their best plan over the least bound left), median and most; "
               f"'over the exact': the plan's predicted step over the gap-0 solve's, mean and most, over the batches "
               f"where both proved their plan (the optimum, and a plan within the gap of it). The three solves of a "
               f"batch run back to back, in an order that rotates from batch to batch.\n")
    out.append("| R | L | batches | gap | p50 ms | p99 ms | proven | nodes | certified gap of the rest p50 / max | "
               "over the exact mean / max |")
    out.append("|---" * 10 + "|")
    _load_compiled(sizes, seed)
    notes = []
    for n_req, n_layers in sizes:
        n_calls = batches_of(calls, n_layers)
        rec = {g: {"t": [], "nodes": 0, "open_gap": [], "lat": []} for g in gaps}
        for i, (cm, cap, reqs) in enumerate(tqdm(speed_cases(seed, n_req, n_layers, n_calls),
                                                 desc=f"gap R={n_req} L={n_layers}", leave=False)):
            for g in gaps[i % len(gaps):] + gaps[: i % len(gaps)]:
                w, _, p = _solve(cm, cap, reqs, True, time_limit_s=exact_cap_s, gap=g, **EXACT)
                r = rec[g]
                r["t"].append(w)
                r["nodes"] += p.stats.nodes
                done = p.stats.proven(g)
                if not done and p.stats.gap is not None:
                    r["open_gap"].append(p.stats.gap)
                r["lat"].append((p.predicted_step_s if p.feasible else math.inf, done))
        for g in gaps:
            r = rec[g]
            og = r["open_gap"]
            opened = f"{100 * pct(og, 50):.2f}% / {100 * max(og):.2f}%" if og else "-"
            over = [lat / ex - 1 for (lat, done), (ex, ex_done) in zip(r["lat"], rec[gaps[0]]["lat"])
                    if done and ex_done and math.isfinite(ex) and math.isfinite(lat)]
            versus = f"{100 * float(np.mean(over)):.4f}% / {100 * max(over):.4f}%" if over and g else "-"
            out.append(f"| {n_req} | {n_layers} | {n_calls} | {g:g} | {1e3 * pct(r['t'], 50):.2f} | "
                       f"{1e3 * pct(r['t'], 99):.2f} | {sum(done for _, done in r['lat'])}/{n_calls} | {r['nodes']} | "
                       f"{opened} | {versus} |")
        print("\n".join(out[-len(gaps):]), flush=True)
        exact_done = [done for _, done in rec[gaps[0]]["lat"]]
        extra = {g: sum(done and not ex for (_, done), ex in zip(rec[g]["lat"], exact_done)) for g in gaps[1:]}
        notes.append(f"({n_req}, {n_layers}) " + ", ".join(f"{n} within {g:g}" for g, n in extra.items()))
    out.append("\nBatches proven within a gap that the exact search left unproven: " + "; ".join(notes) + ".")


class FixedBounds(LeafGaps):
    """The reference search with every bound at every node: each child gets the propagated bound and, where
    :data:`~orbitflow.plan.bounds.TAIL_MIN` requests are left, the tail bound, whatever the incumbent, the first dive
    and the moving average the search reads to skip them where they seldom pay. Its children's bounds are then a
    function of the partial plan and the batch alone (the replan section compares two batches' bounds), and no
    lower than the search's; with the same incumbent it prunes at least as much."""

    def _propagate_at(self, depth: int) -> bool:
        return True

    def _tail_at(self, depth: int) -> bool:
        return self.n_req - 1 - depth >= TAIL_MIN

    def _bound_children(self, *args):
        best, self.best_key = self.best_key, (math.inf, math.inf)  # no child skips a bound for being cut already
        try:
            return super()._bound_children(*args)
        finally:
            self.best_key = best


def traced_children(rules, reqs, upper: float, cap_s: float) -> tuple[FixedBounds, dict[bytes, float],
                                                                      list[np.ndarray]]:
    """A traced :class:`FixedBounds` search of ``reqs`` against ``upper`` from the start, for ``cap_s`` seconds: the
    search, the latency bound of every child it evaluated that capacity kept alive, and the partial plan of every
    node it expanded. A partial plan is the candidate per request, -1 where unassigned (the children's keys: its
    int16 bytes), so the same key in two batches is the same partial plan whatever order each searched in."""
    tree = FixedBounds(rules, rules.horizon(reqs), PlanStats(), upper=upper, deadline=time.perf_counter() + cap_s)
    tree.trace = []
    tree.run()
    kids: dict[bytes, float] = {}
    nodes = []
    order = np.asarray(tree.order)
    for prefix, lat_lb, alive in tree.trace:
        a = np.full(tree.n_req, -1, dtype=np.int16)
        a[order[:len(prefix)]] = prefix
        nodes.append(a.copy())
        r = order[len(prefix)]
        for k in np.flatnonzero(alive).tolist():
            a[r] = k
            kids[a.tobytes()] = float(lat_lb[k])
    return tree, kids, nodes


def under_cut(node: np.ndarray, order: list[int], cut: set[bytes]) -> bool:
    """Whether the partial plan ``node`` is, or lies under, a partial plan in ``cut`` that assigned the first requests
    of ``order`` (another search's order)."""
    a = np.full(node.size, -1, dtype=np.int16)
    for r in order:
        if node[r] < 0:
            return False
        a[r] = node[r]
        if a.tobytes() in cut:
            return True
    return False


def replan_case(planner: Planner, reqs, steps: int | None, proof_cap_s: float, trace_cap_s: float) -> dict | None:
    """One batch of the replan section (:func:`bench_replan`): B (``reqs``) and B1 (the same batch ``steps`` decode
    steps later; None: at B's plan's ``replan_step``), what the table prints of them. None: either is infeasible."""
    p0 = planner.plan(reqs)
    if not p0.feasible:
        return None
    n_steps = steps or p0.replan_step
    reqs1 = [q.after(n_steps, q.deposit) for q in reqs]
    p1 = planner.plan(reqs1)
    if not p1.feasible:
        return None
    rules = planner.constraints
    best0, best1 = p0.predicted_step_s, p1.predicted_step_s
    up0, kept = best0 * (1 + 1e-9), (best1 * (1 + 1e-9), math.inf)
    oracle = search.BranchAndBound(rules, rules.horizon(reqs1), PlanStats(), upper=kept[0],
                                   deadline=time.perf_counter() + proof_cap_s)
    t = time.perf_counter()
    oracle.run()
    proof_s = time.perf_counter() - t
    tree0, kids0, _ = traced_children(rules, reqs, up0, trace_cap_s)
    tree1, kids1, nodes1 = traced_children(rules, reqs1, kept[0], trace_cap_s)
    cuts = {key: lb for key, lb in kids0.items() if search.prunable(lb, 0.0, (up0, math.inf))}
    strong = {key for key, lb in cuts.items() if search.prunable(lb, 0.0, kept)}
    common = [(kids1[key], lb) for key, lb in kids0.items() if key in kids1]
    plans = {tuple(k_of): lat for k_of, (_, lat) in zip(tree0.plans, tree0.seen)}  # distinct plans, exact latency
    return {
        "steps": n_steps, "best0": best0, "best1": best1, "both": p0.stats.exact and p1.stats.exact,
        "crossed": int((tree1.b0 != tree0.b0).sum()),  # requests with more blocks at step 0
        "proof_ms": 1e3 * proof_s, "proof_nodes": oracle.stats.nodes, "proof_done": not oracle.timed_out,
        "cuts": len(cuts), "reopen": len(cuts) - len(strong), "common": len(common),
        "lower": sum(lb1 < lb * (1 - 1e-9) for lb1, lb in common),
        # partial plans B cut against B1's optimum that B1 does not: where B's bound is the stronger one for B1
        "stronger0": sum(key in kids1 and not search.prunable(kids1[key], 0.0, kept) for key in strong),
        "least": min((lb1 / lb - 1 for lb1, lb in common if lb > 0), default=math.nan),
        "traced1": len(nodes1), "under": sum(under_cut(a, tree0.order, strong) for a in nodes1),
        "whole0": not tree0.timed_out, "whole1": not tree1.timed_out, "same_order": tree0.order == tree1.order,
        "plans": len(plans), "faster": sum(tree1._lat0(list(k_of)) < lat * (1 - 1e-9) for k_of, lat in plans.items()),
    }


def bench_replan(sizes, calls: int, seed: int, exact_cap_s: float, proof_cap_s: float, trace_cap_s: float,
                 out: list[str], steps: int | None = None) -> None:
    """Would a re-plan's exact proof be cheap if it reused the last solve's search (its cut subtrees and their
    bounds)? Each batch B and the same batch ``steps`` decode steps later (B1, ``PlanRequest.after``; None: at the
    step B's plan asks to be re-planned, ``Plan.replan_step``, as the controller re-plans) are solved exactly.
    B1's proof alone (the search knowing B1's optimum from the start) expands every node whose bound is below that
    optimum (bar those the SLO prefilter or the symmetry rule cuts); reuse can spare such a node only where B's
    bound for the same partial plan was higher than B1's and still holds for B1. The table measures both
    conditions with every bound at every node (:class:`FixedBounds`): how often a bound falls when the blocks grow,
    how many of B1's nodes lie under such a cut of B's, and whether B's plans can step faster in B1 (then a bound of
    B's need not hold for B1)."""
    out.append("\n### Re-planning: what reusing the last proof could save\n")
    later = (f"{steps} decode step(s) later" if steps else "at the step B's plan asks to be re-planned "
             "(`Plan.replan_step`, its expiry or the end of its window, when the controller re-plans it)")
    out.append(
        f"Batches of the speed table (B) and the same batch {later} (B1, `PlanRequest.after`; 'after': the "
        f"steps; the compute per layer is the same in both, the blocks grow), each solved exactly (capped at "
        f"{exact_cap_s:g} s). 'optimum moved': B1's best plan over B's. 'oracle proof of B1': the compiled search "
        f"of B1 knowing B1's best plan from the start (capped at {proof_cap_s:g} s): the proof alone, which "
        "expands every node whose bound, as that search computes it, is below B1's optimum (bar those the SLO "
        "prefilter or the symmetry rule cuts); where it is done it proved that plan optimal. Then both batches are "
        f"searched traced ({trace_cap_s:g} s each) against their own best plans by the reference search with every "
        "bound at every node (`FixedBounds`: a child's bound is then a function of its partial plan and the batch "
        "alone, and no lower than the compiled search's). 'B's cuts': the children B's search cut by bound; 'to "
        "re-open': the share of those whose bound is below B1's optimum (a re-plan must bound them again). 'bounds "
        "compared': partial plans both searches bounded; 'lower in B1': how many of them B1 bounds lower than B "
        "(where any is, the bounds are not monotone in the blocks), and the least ratio minus 1. 'B1 nodes under a "
        "B cut': how many of the nodes B1's traced search expanded (and bounded children of) are, or lie under, a "
        "child B cut with a bound at or above B1's optimum ('done' where B1's traced search finished: then no "
        "search in this order with these bounds, the symmetry rule and the SLO prefilter expands fewer; 'B in "
        "part' where B's did not): where both finished, the most reuse could spare of those nodes if B's bounds "
        "held for B1; where either did not, a lower count over the traced part. 'B plans faster in B1': of the "
        "distinct plans B's traced search evaluated exactly, how many step faster in B1, with more blocks (where "
        "any does, the step is not monotone in the blocks, and a bound proven for B does not carry over to B1 by "
        "itself).\n")
    out.append("| R | L | batch | after | requests with a new block | optimum moved | both proven | "
               "oracle proof of B1 ms | nodes | done | B's cuts | to re-open | bounds compared | lower in B1 (least) | "
               "B1 nodes under a B cut | B plans faster in B1 |")
    out.append("|---" * 16 + "|")
    _load_compiled(sizes, seed)
    summary = []
    for n_req, n_layers in sizes:
        rec = []
        for i, (cm, cap, reqs) in enumerate(tqdm(speed_cases(seed, n_req, n_layers, calls),
                                                 desc=f"replan R={n_req} L={n_layers}", leave=False)):
            planner = Planner(cm, cap, alpha=1.0, window=(4, 16), time_limit_s=exact_cap_s, **EXACT)
            c = replan_case(planner, reqs, steps, proof_cap_s, trace_cap_s)
            if c is None:
                continue
            rec.append(c)
            traced = (f"{c['under']} of {c['traced1']}"
                      f"{' done' if c['whole1'] else ''}{'' if c['whole0'] else ' (B in part)'}")
            out.append(f"| {n_req} | {n_layers} | {i} | {c['steps']} | {c['crossed']} | "
                       f"{100 * (c['best1'] / c['best0'] - 1):+.3f}% | {c['both']} | {c['proof_ms']:.1f} | "
                       f"{c['proof_nodes']} | {c['proof_done']} | {c['cuts']} | "
                       f"{100 * c['reopen'] / max(c['cuts'], 1):.1f}% | {c['common']} | {c['lower']} "
                       f"({c['least']:+.2e}) | {traced} | {c['faster']} of {c['plans']} |")
            print(out[-1], flush=True)
        if rec:
            summary.append(_replan_summary(n_req, n_layers, calls, proof_cap_s, rec))
    out.append("")
    out += summary


def _replan_summary(n_req: int, n_layers: int, calls: int, proof_cap_s: float, rec: list[dict]) -> str:
    """The replan section's summary of one size, from its batches' :func:`replan_case` records."""
    proven = [c for c in rec if c["both"]]
    text = f"({n_req}, {n_layers}), {len(rec)} of {calls} batches feasible at both steps"
    if proven:
        ms = [c["proof_ms"] for c in proven]
        text += (f"; in the {len(proven)} with both optima proven, B1's proof alone takes p50 {pct(ms, 50):.1f} ms "
                 f"and p99 {pct(ms, 99):.1f} ms ({sum(m > 100 for m in ms)} over 100 ms; nodes p50 "
                 f"{pct([c['proof_nodes'] for c in proven], 50):.0f})")
    text += (f". Over all {len(rec)}: B1's proof alone done within {proof_cap_s:g} s in "
             f"{sum(c['proof_done'] for c in rec)}, within 100 ms in "
             f"{sum(c['proof_done'] and c['proof_ms'] <= 100 for c in rec)}; with every bound at every node, B1's "
             f"traced search finished in {sum(c['whole1'] for c in rec)}; a bound fell as the blocks grew in "
             f"{sum(c['lower'] > 0 for c in rec)}; B's plans stepped faster in B1 in "
             f"{sum(c['faster'] > 0 for c in rec)}.")
    whole = [c["under"] / max(c["traced1"], 1) for c in rec if c["whole0"] and c["whole1"]]
    part = [c for c in rec if not (c["whole0"] and c["whole1"])]
    if whole:
        text += (f" Where both traced searches finished ({len(whole)}), reuse could spare at most "
                 f"{100 * pct(whole, 50):.1f}% of B1's traced nodes (every bound at every node) at the median and "
                 f"{100 * max(whole):.1f}% at most, and only if B's bounds held for B1.")
    if part:
        text += (f" Where either did not ({len(part)}), B1's traced nodes under B's cuts found so far: "
                 f"{sum(c['under'] for c in part)} of {sum(c['traced1'] for c in part)} (a lower count).")
    return text


def bench_link(sizes, calls: int, seed: int, exact_cap_s: float, out: list[str]) -> None:
    """The same batches planned for the executor's link (EDF, one copy at a time) and for a preemptive one
    (``CostModel(transfer="preemptive")``: a copy yields to a more urgent one): how fast the exact search proves
    its plan on each, how many plans it must schedule exactly, and how much shorter the best step is."""
    from orbitflow.sim.sweep import mean_ci95

    out.append("\n### The preemptive link: what it would give the plans and the exact search\n")
    out.append(f"The speed table's batches, each planned twice by the compiled exact search (`node_limit=None, "
               f"check_better=False`, stopped at `time_limit_s={exact_cap_s:g}`): for the executor's link (`edf`: "
               "one copy at a time, earliest-needed layer first) and for the same link made preemptive (`preemptive`: "
               "a copy yields the moment a more urgent one is released, and resumes; switches free), whose step "
               "latency is the release/need bound the search already prunes with (`bounds.dp_bound`). 'leaves': "
               "complete plans scheduled exactly because no bound cut them (their sum over the batches). 'best step, "
               "preemptive / edf': each batch's best plan's predicted step on the preemptive link over its best on "
               "the EDF link (mean with a 95% t interval, and the least: the largest gain), over the batches both "
               "found feasible; where a solve hit the cap its plan is the best found, not a proven optimum. "
               "'preemptive only': batches where only the preemptive link's search found a plan within the SLO (the "
               "EDF one proved there is none, or found none before the cap; a plan that meets the SLO on the EDF "
               "link meets it on the preemptive one). The executor runs the EDF link by default and the preemptive one "
               "with `--kv-link preemptive` (in chunks, `benchmarks/kv_link.py` measures it on the engine).\n")
    out.append("| R | L | batches | link | exact p50 ms | exact p99 ms | unproven | leaves | nodes p50 | feasible | "
               "best step, preemptive / edf: mean [95% CI] | least | preemptive only |")
    out.append("|---" * 13 + "|")
    for n_req, n_layers in sizes:  # load the compiled code before timing
        cm, cap, reqs = random_instance(np.random.default_rng(seed), n_req, n_layers)
        for link in LINKS:
            _solve(cm.with_updates(transfer=link), cap, reqs, compiled=True, time_limit_s=0.05)
    for n_req, n_layers in sizes:
        n_calls = batches_of(calls, n_layers)
        rec = {link: {"t": [], "cut": 0, "leaves": 0, "nodes": [], "lat": []} for link in LINKS}
        for i, (cm, cap, reqs) in enumerate(tqdm(speed_cases(seed, n_req, n_layers, n_calls),
                                                 desc=f"link {n_req}x{n_layers}", leave=False)):
            for link in LINKS if i % 2 == 0 else LINKS[::-1]:
                w, _, p = _solve(cm.with_updates(transfer=link), cap, reqs, compiled=True, time_limit_s=exact_cap_s,
                                 **EXACT)
                r = rec[link]
                r["t"].append(w)
                r["cut"] += not p.stats.exact
                r["leaves"] += p.stats.leaves
                r["nodes"].append(p.stats.nodes)
                r["lat"].append(p.predicted_step_s if p.feasible else math.inf)
        edf, pre = np.array(rec["edf"]["lat"]), np.array(rec["preemptive"]["lat"])
        both = np.isfinite(edf) & np.isfinite(pre)
        ratio = pre[both] / edf[both]
        ci = mean_ci95(ratio.tolist())
        gain = (f"{ci['mean']:.4f} [{ci['mean'] - ci['ci95']:.4f}, {ci['mean'] + ci['ci95']:.4f}] (n={ci['n']}) | "
                f"{ratio.min():.4f} | {int((~np.isfinite(edf) & np.isfinite(pre)).sum())} |"
                if ratio.size else "n/a | n/a | 0 |")
        for link in LINKS:
            r = rec[link]
            out.append(f"| {n_req} | {n_layers} | {n_calls} | {link} | {pct(r['t'], 50) * 1e3:.2f} | "
                       f"{pct(r['t'], 99) * 1e3:.2f} | {r['cut']}/{n_calls} | {r['leaves']} | "
                       f"{pct(r['nodes'], 50):.0f} | {int(np.isfinite(r['lat']).sum())}/{n_calls} | "
                       + (gain if link == "preemptive" else " | | |"))
        print(out[-2] + "\n" + out[-1], flush=True)


def _depth_table(profile: dict[int, list], n_req: int, leaf_cap_s: float, out: list[str]) -> None:
    """The proof section's table of where the unfinished proofs' nodes are (:func:`depth_profile`, summed over
    those batches)."""
    total = sum(row[0] for row in profile.values())
    out.append(f"\nWhere the unfinished proofs' nodes are: the reference search of the same batches (the first "
               f"{leaf_cap_s:g} s of the search that knows its best plan from the start, in the compiled search's "
               f"order: {total} nodes), by depth. A node at depth d has assigned the d largest requests; its children "
               "assign the next one. 'cut by capacity': children that cannot fit even with every request after them "
               "fully offloaded; 'cut by a bound': alive children whose latency bound is not below the best plan "
               "(or fails the SLO prefilter); the surviving children's bounds, under the best plan at the median and "
               "p90: a child whose bound is under it by less than the gap its subtree's leaves open is expanded "
               "anyway.\n")
    out.append("| depth | requests left after its children | nodes | share of nodes | children | cut by capacity | "
               "cut by a bound | surviving | their bound under best p50 / p90 |")
    out.append("|---" * 9 + "|")
    for d in sorted(profile):
        nodes, kids, alive, under = profile[d]
        if not nodes:
            continue
        spread = f"{pct(under, 50):.3f}% / {pct(under, 90):.3f}%" if under else "-"
        out.append(f"| {d} | {n_req - d - 1} | {nodes} | {100 * nodes / total:.1f}% | {kids} | "
                   f"{100 * (kids - alive) / kids:.1f}% | {100 * (alive - len(under)) / kids:.1f}% | {len(under)} | "
                   f"{spread} |")
    tail = [d for d in profile if n_req - d - 1 <= 3]
    tail_nodes = sum(profile[d][0] for d in tail)
    tail_under = [u for d in tail if d < n_req - 1 for u in profile[d][3]]
    out.append(f"\n{100 * tail_nodes / max(total, 1):.0f}% of these nodes sit where at most 3 requests (the smallest) "
               f"are left after their children; the bounds of those children that survive and are not leaves sit "
               f"{pct(tail_under, 50):.2f}% under the best plan at the median.")


def bench_full(sizes, calls: int, seed: int) -> None:
    print("\n== full space (local search seeded from the pruned optimum) vs pruned ==")
    print(f"{'R':>3} {'L':>3} | {'both feas':>9} {'full wins':>9} {'mean gain':>9} {'max gain':>9} | "
          f"{'pruned p50 ms':>13} {'full p50 ms':>11} {'full p99 ms':>11}")
    for n_req, n_layers in sizes:
        rng = np.random.default_rng(seed + 7 * n_req + n_layers)
        tp, tf, gains, both = [], [], [], 0
        for _ in range(calls):
            cm, cap, reqs = random_instance(rng, n_req, n_layers)
            pp = Planner(cm, cap, window=(4, 16), check_better=False)
            pf = Planner(cm, cap, window=(4, 16), space="full", check_better=False, full_max_evals=400)
            t = time.perf_counter()
            a = pp.plan(reqs)
            tp.append(time.perf_counter() - t)
            t = time.perf_counter()
            f = pf.plan(reqs)
            tf.append(time.perf_counter() - t)
            if a.feasible and f.feasible:
                both += 1
                gains.append(1.0 - f.predicted_step_s / a.predicted_step_s)
        g = np.asarray(gains) if gains else np.zeros(1)
        wins = int((g > 1e-9).sum())
        print(f"{n_req:>3} {n_layers:>3} | {both:>9} {wins:>9} {100 * g.mean():>8.2f}% "
              f"{100 * g.max():>8.2f}% | "
              f"{1e3 * pct(tp, 50):>13.3f} {1e3 * pct(tf, 50):>11.3f} {1e3 * pct(tf, 99):>11.3f}")


def bench_uniform(sizes, calls: int, seed: int) -> None:
    print("\n== request-wise (pruned) vs Batch-Uniform: feasibility and latency ==")
    print(f"{'R':>3} {'L':>3} | {'pruned feas':>11} {'uniform feas':>12} "
          f"{'mean latency gain (both feas)':>29}")
    for n_req, n_layers in sizes:
        rng = np.random.default_rng(seed + 13 * n_req + n_layers)
        fp = fu = 0
        gains = []
        for _ in range(calls):
            cm, cap, reqs = random_instance(rng, n_req, n_layers)
            a = Planner(cm, cap, window=(4, 16), check_better=False).plan(reqs)
            u = Planner(cm, cap, window=(4, 16), space="uniform", check_better=False).plan(reqs)
            fp += a.feasible
            fu += u.feasible
            if a.feasible and u.feasible:
                gains.append(1.0 - a.predicted_step_s / u.predicted_step_s)
        g = 100 * float(np.mean(gains)) if gains else float("nan")
        print(f"{n_req:>3} {n_layers:>3} | {fp / calls:>11.0%} {fu / calls:>12.0%} {g:>28.2f}%")


ENGINE_MODES = ("thread", "process")  # runtime/background_planner.py: where the engine solves ahead
# "paced": the engine's own pattern: one solve in flight, read at the step it is due (Controller.lead_steps ahead),
# on either background planner (`auto` picks the thread below 4 cores)
PACED = "paced"
PACED_MODES = tuple(f"{PACED} {mode}" for mode in ENGINE_MODES)
# "pool": the planner process as it was before the pipe (a one-worker ProcessPoolExecutor), for the same-run A/B
POOL = "pool process"
# "busy": a planner process solving on its own, with no round trip to the engine: the interference of a busy
# planner alone (the engine submits one solve per expiry, not hundreds per second as the loop above does)
BUSY = "busy process"


def bench_engine(rounds: int, block: int, seed: int, torch_threads: int, sizes, out: list[str],
                 model: str = "smollm2-135m") -> None:
    """Decode step time of the real engine (``model``, 4 sequences; on CUDA where there is one) while its
    background planner (a thread or a process: runtime/background_planner.py, compiled planner, the engine's
    default node limit) solves continuously, vs idle and vs a thread that burns a core without the GIL;
    conditions interleaved in blocks of ``block`` steps."""
    import threading

    import torch

    from orbitflow.policies import OrbitFlowPolicy
    from orbitflow.runtime.background_planner import BackgroundPlanner
    from orbitflow.runtime.controller import lead_steps

    modes = (*ENGINE_MODES, POOL, *PACED_MODES, BUSY)
    conditions = ["idle", "burner"] + [f"{mode} {r}x{l}" for r, l in sizes for mode in modes]
    llm = _decoding_llm(model, torch_threads, rounds * block * len(conditions), seed)
    engine = llm.engine
    planners = {mode: BackgroundPlanner(OrbitFlowPolicy(), mode) for mode in ENGINE_MODES}
    planners[POOL] = _PoolPlanner()
    cases = {(r, l): [_engine_case(np.random.default_rng(seed + k), r, l) for k in range(16)] for r, l in sizes}
    for bp in planners.values():  # start the process and load the compiled code before timing
        bp.submit(*cases[sizes[0]][0]).result()
    busy = {size: _BusyPlanner(cases[size]) for size in sizes}
    steps: dict[str, list[float]] = {c: [] for c in conditions}
    solves: dict[str, list[int]] = {c: [0] for c in conditions}
    busy_s: dict[str, float] = {c: 0.0 for c in conditions}
    paced_solve_s = {c: deque(maxlen=8) for c in conditions}  # per paced condition, what Controller.lead_steps
    paced_step_s: dict[str, float | None] = {c: None for c in conditions}  # reads
    for rnd in tqdm(range(rounds), desc="engine rounds", leave=False):
        for cond in conditions[rnd % len(conditions):] + conditions[: rnd % len(conditions)]:
            stop = threading.Event()
            if cond == "idle" or cond.startswith((BUSY, PACED)):
                th = None
            elif cond == "burner":
                th = threading.Thread(target=_burner_loop, args=(stop, solves[cond]))
            else:
                mode, size = cond.rsplit(" ", 1)
                r, l = (int(v) for v in size.split("x"))
                th = threading.Thread(target=_solve_loop, args=(stop, planners[mode], cases[(r, l)], solves[cond]))
            if th is not None:
                th.start()
                time.sleep(0.002)
            busy_one = busy[tuple(int(v) for v in cond.split(" ")[-1].split("x"))] if cond.startswith(BUSY) else None
            if busy_one is not None:
                busy_one.run.set()
                time.sleep(0.002)
            paced = cases[tuple(int(v) for v in cond.split(" ")[-1].split("x"))] if cond.startswith(PACED) else None
            t_cond = time.perf_counter()
            ahead = None  # paced: (future, steps until it is read)
            for i in range(block):
                t = time.perf_counter()
                lead = lead_steps(paced_solve_s[cond], paced_step_s[cond])
                if paced is not None and ahead is None and i + lead <= block:  # as Controller.ahead_step/solve_ahead
                    ahead = [planners[cond.split(" ")[1]].submit(*paced[solves[cond][0] % len(paced)]), lead]
                engine.step()
                if ahead is not None:
                    ahead[1] -= 1
                    if ahead[1] == 0:  # the expiry's step reads it (Controller.solve), waiting if it is not done
                        paced_solve_s[cond].append(ahead[0].result()[1])
                        solves[cond][0] += 1
                        ahead = None
                steps[cond].append(time.perf_counter() - t)
                if paced is not None:  # the controller's EWMA of the decode steps
                    last, was = steps[cond][-1], paced_step_s[cond]
                    paced_step_s[cond] = last if was is None else 0.7 * was + 0.3 * last
            busy_s[cond] += time.perf_counter() - t_cond
            stop.set()
            if th is not None:
                th.join()
            if busy_one is not None:
                busy_one.run.clear()
    where = (f"CUDA ({torch.cuda.get_device_name(0)})" if llm.kv.device_pool.storage.device.type == "cuda"
             else "CPU")
    for bp in planners.values():
        bp.close()
    for size, one in busy.items():
        solves[f"{BUSY} {size[0]}x{size[1]}"][0] = one.stop()
    llm.close()
    out.append(f"\n### Engine decode step while the planner solves\n\n{model} on {where}, 4 sequences of 128+ "
               f"tokens, torch threads {torch_threads}, no offload. The engine's background planner "
               f"(runtime/background_planner.py: a planner thread, or a planner process) solves continuously "
               f"(OrbitFlow policy, compiled planner, the engine's default node limit; 16 random batches of the "
               f"size shown, round robin), each solve a round trip from a thread of the engine's process; pool "
               f"process: the same, through a one-worker ProcessPoolExecutor (the planner process before it got "
               f"its pipe); paced thread, paced process: the engine's own pattern on that planner, one solve in "
               f"flight, submitted by the step loop before a step and read after the step it is due, inside the "
               f"timed step (waiting if it is not done), due as many steps ahead as the controller would start it "
               f"(Controller.lead_steps: the last solves and the steps' EWMA); busy process: a planner process "
               f"solving the same batches on its own, with no round trip; burner: a thread that keeps a core busy "
               f"without the GIL (CPU contention alone; per second: SHA-256 of 1 MiB); idle: the engine alone. "
               f"{rounds} rounds x {block} steps per condition, conditions interleaved. slowdown: median step time "
               f"over idle's, with a 95% bootstrap interval over the steps; paired by round: the median over the "
               f"rounds of each round's ratio (its {block} steps' median over idle's {block} in the same round, where "
               f"the sequences are about as long: they grow by {block * len(conditions)} tokens a round), with a 95% "
               f"bootstrap interval over the rounds (`paired_slowdown`).\n")
    _engine_table(conditions, steps, solves, busy_s, seed, out, block)


def _decoding_llm(model: str, torch_threads: int, steps: int, seed: int):
    """The engine sections' engine: ``model`` with 4 sequences of 128 random prompt tokens, prefilled and warmed up,
    that decode at least ``steps`` more steps; no offload."""
    import torch

    from orbitflow.config import EngineConfig
    from orbitflow.llm import LLM
    from orbitflow.policies import FixedPlacementPolicy
    from orbitflow.runtime.sampling import SamplingParams

    torch.set_num_threads(torch_threads)
    llm = LLM(EngineConfig.build(model=model, max_num_seqs=4, device_kv_blocks=16384),
              policy=FixedPlacementPolicy("none"), profile="rough")
    rng = np.random.default_rng(seed)
    vocab = llm.loaded.config.vocab_size
    for i in range(4):
        llm.engine.add_request(f"bench-{i}", rng.integers(100, vocab - 100, 128).tolist(),
                               SamplingParams(max_tokens=steps + 24, ignore_eos=True))
    for _ in range(8):  # prefill and warm-up
        llm.engine.step()
    return llm


class _PoolPlanner:
    """The planner process before the pipe: a one-worker ProcessPoolExecutor (a queue feeder thread and a
    manager thread in the engine's process, both woken per solve)."""

    def __init__(self):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from orbitflow.policies import OrbitFlowPolicy

        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_pool_init, initargs=(OrbitFlowPolicy(),))

    def submit(self, requests, ctx):
        return self._pool.submit(_pool_solve, requests, ctx)

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)


_pool_policy = None


def _pool_init(policy) -> None:
    global _pool_policy
    _pool_policy = policy
    warm_up()


def _pool_solve(requests, ctx):
    from orbitflow.runtime.background_planner import _timed_plan

    return _timed_plan(_pool_policy, requests, ctx)


class KernelClock:
    """Seconds spent inside the compiled planner's kernels (numba, nopython, ``nogil``: the GIL released) while it is
    entered: every numba dispatcher of :mod:`orbitflow.plan.compiled` is wrapped in a timer (the planner calls them
    as module attributes, ``cc.name``), and put back on exit. Kernels called from other kernels run inside the outer
    call's time; a wrapper costs well under a microsecond of Python per call, counted as Python."""

    def __init__(self) -> None:
        from orbitflow.plan import compiled

        self._module = compiled
        self._saved: dict[str, object] = {}
        self.seconds = 0.0
        self.calls = 0

    def __enter__(self) -> KernelClock:
        for name, value in vars(self._module).copy().items():
            if hasattr(value, "py_func") and callable(value):  # a numba dispatcher
                self._saved[name] = value
                setattr(self._module, name, self._timed(value))
        return self

    def __exit__(self, *exc) -> None:
        for name, value in self._saved.items():
            setattr(self._module, name, value)
        self._saved.clear()

    def _timed(self, kernel):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return kernel(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed


def bench_gil(sizes, n: int, seed: int, out: list[str]) -> list[dict]:
    """Where a solve in the engine's pattern spends its wall time: inside the compiled kernels (the GIL released)
    or in Python and NumPy around them (holding it: what a planner thread takes from the engine's step). The engine
    section's batches (``_engine_case`` of seeds ``seed + k``), the OrbitFlow policy with the engine's defaults
    (expiry searches included), each batch solved once to warm, then timed once."""
    from orbitflow.plan import compiled
    from orbitflow.policies import OrbitFlowPolicy

    warm_up()
    rows = []
    for n_req, n_layers in sizes:
        cases = [_engine_case(np.random.default_rng(seed + k), n_req, n_layers) for k in range(n)]
        policy = OrbitFlowPolicy()
        for case in cases:
            policy.plan(*case)
        wall, kernel, calls, nodes = [], [], [], []
        for case in tqdm(cases, desc=f"gil {n_req}x{n_layers}", leave=False):
            with KernelClock() as clock:
                start = time.perf_counter()
                plan = policy.plan(*case)
                wall.append(time.perf_counter() - start)
            kernel.append(min(clock.seconds, wall[-1]))
            calls.append(clock.calls)
            nodes.append(plan.stats.nodes + plan.stats.leaves)
        held = [w - k for w, k in zip(wall, kernel)]
        rows.append(dict(size=f"{n_req}x{n_layers}", solves=n, wall_p50=pct(wall, 50), kernel_p50=pct(kernel, 50),
                         held_p50=pct(held, 50), held_share=sum(held) / sum(wall), calls_p50=pct(calls, 50),
                         nodes_p50=pct(nodes, 50)))
    compiled_on = compiled.enabled(None)
    out.append("\n### Where a solve holds the GIL\n\n"
               "The engine section's batches, solved as the engine's background planner solves them (OrbitFlow "
               "policy, compiled planner, the engine's default node limit, expiry searches included), each once to "
               "warm and then timed once. in kernels: wall time inside the compiled kernels (numba nopython, nogil: "
               "the GIL released), timed by wrapping each kernel (`KernelClock`); GIL held: the rest of the solve's "
               "wall time, Python and NumPy around the kernels, which a planner thread takes from the engine's step "
               "(the paced thread rows of the engine section); share: its sum over every solve's wall time. nodes: "
               "the solve's branch-and-bound nodes and leaves, expiry searches included."
               + ("" if compiled_on else " numba is missing here: every solve runs in Python and holds the GIL.")
               + "\n\n| R x L | solves | wall p50 ms | in kernels p50 ms | GIL held p50 ms | GIL held share "
                 "| kernel calls p50 | nodes p50 |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        out.append(f"| {r['size']} | {r['solves']} | {1e3 * r['wall_p50']:.3f} | {1e3 * r['kernel_p50']:.3f} | "
                   f"{1e3 * r['held_p50']:.3f} | {100 * r['held_share']:.0f}% | {r['calls_p50']:.0f} | "
                   f"{r['nodes_p50']:.0f} |")
    for r in rows:
        print(f"gil {r['size']}: wall p50 {1e3 * r['wall_p50']:.3f} ms, GIL held p50 {1e3 * r['held_p50']:.3f} ms "
              f"({100 * r['held_share']:.0f}% of the solves' wall time), nodes p50 {r['nodes_p50']:.0f}")
    return rows


# The synthetic planner of the gil_share section: one cycle is a 4x32 solve's wall time over its kernel calls
# (docs/results/planner_gil.md: 0.511 ms over 8 calls); it holds the GIL for a share of each cycle.
GIL_CYCLE_S = 64e-6
GIL_SHARES = (0.56, 0.28, 0.12, 0.05, 0.02, 0.0)  # 0.56: a 4x32 solve's today (planner_gil.md); 0: CPU alone


def interleaved_rounds(rounds: int, block: int, conditions, step, beside, desc: str):
    """Time ``block`` calls of ``step(cond)`` per condition and round, the conditions in turn (the order rotated by
    one each round): ``beside(cond, stop)`` starts what runs beside that condition's block (a started thread, or
    None) and returns it; after the block ``stop`` is set and the thread joined. Returns per condition its step times
    (in round order, ``block`` per round, as :func:`paired_slowdown` reads them) and the seconds its blocks ran."""
    import threading

    steps: dict[str, list[float]] = {c: [] for c in conditions}
    busy_s: dict[str, float] = {c: 0.0 for c in conditions}
    for rnd in tqdm(range(rounds), desc=desc, leave=False):
        for cond in conditions[rnd % len(conditions):] + conditions[: rnd % len(conditions)]:
            stop = threading.Event()
            th = beside(cond, stop)
            if th is not None:
                time.sleep(0.002)
            try:
                start = time.perf_counter()
                for _ in range(block):
                    t = time.perf_counter()
                    step(cond)
                    steps[cond].append(time.perf_counter() - t)
                busy_s[cond] += time.perf_counter() - start
            finally:
                stop.set()
                if th is not None:
                    th.join()
    return steps, busy_s


@njit(nogil=True)
def _spin(n: int) -> float:
    """``n`` iterations of arithmetic without the GIL: the synthetic planner's kernel part."""
    x = 0.0
    for i in range(n):
        x += (i % 7) * 1e-9
    return x


def _spin_rate() -> float:
    """Iterations of :func:`_spin` per second on this machine."""
    _spin(1000)
    n = 2_000_000
    start = time.perf_counter()
    _spin(n)
    return n / (time.perf_counter() - start)


def _held_loop(stop, held_s: float, free_iters: int, tally: list[float]) -> None:
    """A synthetic planner thread, back to back: holds the GIL ``held_s`` (a Python loop), then runs ``free_iters``
    of :func:`_spin` without it. ``tally`` gains [cycles, seconds holding the GIL in the loop, seconds run]: the
    share it held is measured, not assumed (its cycles stretch beside an engine that holds the GIL in turn)."""
    clock = time.perf_counter
    first = clock()
    cycles, held = 0, 0.0
    while not stop.is_set():
        start = clock()
        end = start + held_s
        while clock() < end:
            pass
        held += clock() - start
        _spin(free_iters)
        cycles += 1
    tally[0] += cycles
    tally[1] += held
    tally[2] += clock() - first


def _held_thread(stop, share: float, rate: float, tally: list[float]):
    """A started :func:`_held_loop` thread holding the GIL ``share`` of each :data:`GIL_CYCLE_S` (``rate``: what
    :func:`_spin_rate` measured), run until ``stop`` is set."""
    import threading

    th = threading.Thread(target=_held_loop, args=(stop, share * GIL_CYCLE_S, int((1 - share) * GIL_CYCLE_S * rate),
                                                   tally))
    th.start()
    return th


def _held_alone(share: float, rate: float, seconds: float = 0.3) -> float:
    """The share of its time the synthetic thread holds the GIL with nothing beside it (what the gil section measures
    of a real solve)."""
    import threading

    stop, tally = threading.Event(), [0.0, 0.0, 0.0]
    th = _held_thread(stop, share, rate, tally)
    time.sleep(seconds)
    stop.set()
    th.join()
    return tally[1] / tally[2]


def bench_gil_share(rounds: int, block: int, seed: int, torch_threads: int, out: list[str],
                    model: str = "smollm2-135m", shares=GIL_SHARES) -> dict[str, tuple[float, float]]:
    """Decode step time of the real engine beside a synthetic planner thread that holds the GIL a given share of
    each :data:`GIL_CYCLE_S` and runs without it the rest, back to back: how little of a solve may hold the GIL for a
    planner thread solving continuously to cost the engine a few percent. Conditions interleaved in blocks of
    ``block`` steps, as the engine section's. Returns each condition's measured share held (alone, beside the
    engine)."""
    conditions = ["idle"] + [f"held {100 * share:.0f}%" for share in shares]
    share_of = dict(zip(conditions[1:], shares))
    llm = _decoding_llm(model, torch_threads, rounds * block * len(conditions), seed)
    rate = _spin_rate()
    alone = {cond: _held_alone(share, rate) for cond, share in share_of.items()}
    tally: dict[str, list[float]] = {c: [0.0, 0.0, 0.0] for c in conditions}

    def beside(cond, stop):
        return _held_thread(stop, share_of[cond], rate, tally[cond]) if cond in share_of else None

    steps, busy_s = interleaved_rounds(rounds, block, conditions, lambda _: llm.engine.step(), beside,
                                        "gil_share rounds")
    llm.close()
    measured = {c: (alone[c], tally[c][1] / tally[c][2] if tally[c][2] > 0 else 0.0) for c in share_of}
    label = {c: c if c not in share_of else f"{c}: {100 * measured[c][0]:.0f}% / {100 * measured[c][1]:.0f}%"
             for c in conditions}
    out.append(f"\n### Engine decode step beside a thread that holds the GIL a share of the time\n\n{model} on the "
               f"CPU, 4 sequences of 128+ tokens, torch threads {torch_threads}, no offload, as the engine section. "
               f"Beside it a synthetic planner thread runs back to back: in each cycle it holds the GIL for a Python "
               f"loop of the share shown of {1e6 * GIL_CYCLE_S:.0f} us (a 4x32 solve's wall time over its kernel "
               f"calls, `planner_gil.md`), then runs a numba `nogil` loop sized for the rest. 'held 56%' is the share "
               f"a 4x32 solve holds today (the gil section's, measured alone). After the colon, the share of its time "
               f"it measurably held: alone (0.3 s before the rounds; comparable with the gil section's), and beside "
               f"the engine, where its cycles stretch while it waits for the GIL in turn. 'held 0%' still takes the "
               f"GIL for its loop's own Python each cycle: the least a Python-driven thread holds. {rounds} rounds x "
               f"{block} steps per condition, interleaved; the columns as the engine section's (paired by round: "
               f"`paired_slowdown`); the last one counts the thread's cycles per second.\n")
    _engine_table([label[c] for c in conditions], {label[c]: steps[c] for c in conditions},
                  {label[c]: [tally[c][0]] for c in conditions}, {label[c]: busy_s[c] for c in conditions}, seed, out,
                  block, rate_label="cycles/s beside the engine")
    return measured


GIL_SWITCH_INTERVALS = (5e-3, 1e-3, 1e-4, 2e-5, 5e-6)  # Python's default, the KV copy thread's, and shorter


def aten_calls_per_step(engine) -> int:
    """The aten operator calls of one ``engine.step()``, as its torch calls from Python dispatch them (one call may
    dispatch more than one, ``torch.tensor`` two): each such call releases the GIL and takes it back, where a thread
    beside it may hold it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        engine.step()
    return Count.calls


def bench_gil_switch(rounds: int, block: int, seed: int, torch_threads: int, out: list[str],
                     model: str = "smollm2-135m", intervals=GIL_SWITCH_INTERVALS, size=(4, 32)) -> int:
    """Decode step time of the real engine beside the engine's planner thread solving ``size`` batches back to back
    (the engine section's 'thread' condition) under several ``sys.setswitchinterval`` values: whether a thread
    that must hand the GIL back sooner costs the engine less. Conditions interleaved in blocks of ``block`` steps,
    as the engine section's; the interval is set for the condition's block only. Returns the aten calls of one
    step (:func:`aten_calls_per_step`)."""
    import threading

    from orbitflow.policies import OrbitFlowPolicy
    from orbitflow.runtime.background_planner import BackgroundPlanner

    conditions = ["idle"] + [f"thread {size[0]}x{size[1]}, switch interval {1e6 * v:g} us" for v in intervals]
    interval_of = dict(zip(conditions[1:], intervals))
    llm = _decoding_llm(model, torch_threads, rounds * block * len(conditions) + 1, seed)
    calls = aten_calls_per_step(llm.engine)
    planner = BackgroundPlanner(OrbitFlowPolicy(), "thread")
    cases = [_engine_case(np.random.default_rng(seed + k), *size) for k in range(16)]
    planner.submit(*cases[0]).result()  # load the compiled code before timing
    before = sys.getswitchinterval()
    solves: dict[str, list[int]] = {c: [0] for c in conditions}

    def beside(cond, stop):
        sys.setswitchinterval(interval_of.get(cond, before))  # idle's steps run at the process's own
        if cond not in interval_of:
            return None
        th = threading.Thread(target=_solve_loop, args=(stop, planner, cases, solves[cond]))
        th.start()
        return th

    try:
        steps, busy_s = interleaved_rounds(rounds, block, conditions, lambda _: llm.engine.step(), beside,
                                           "gil_switch rounds")
    finally:
        sys.setswitchinterval(before)
        planner.close()
        llm.close()
    out.append(f"\n### Engine decode step beside a planner thread, by GIL switch interval\n\n{model} on the CPU, 4 "
               f"sequences of 128+ tokens, torch threads {torch_threads}, no offload, as the engine section. Beside "
               f"it the engine's planner thread (runtime/background_planner.py) solves {size[0]}x{size[1]} batches "
               f"back to back (the engine section's 'thread' condition), with `sys.setswitchinterval` set to the "
               f"value shown for that condition's steps (the engine's process runs at {1e6 * before:g} us otherwise; "
               f"Python's default is 5000 us): how long a thread may keep the GIL while another waits for it. One "
               f"decode step dispatches {calls} aten calls from its torch calls, each of which releases the GIL and "
               f"takes it back (a torch call may dispatch more than one, so it makes somewhat fewer handoffs). "
               f"{rounds} rounds x {block} steps per condition, interleaved; the columns as the engine section's "
               f"(paired by round: `paired_slowdown`).\n")
    _engine_table(conditions, steps, solves, busy_s, seed, out, block)
    idle = float(np.median(steps["idle"]))
    extra = ", ".join(f"{1e6 * (float(np.median(steps[c])) - idle) / calls:.0f} us at {1e6 * v:g} us"
                      for c, v in interval_of.items())
    out.append(f"\nThe step time the thread adds, over the step's {calls} aten calls (median step over idle's): "
               f"{extra}.")
    print(out[-1], flush=True)
    return calls


GIL_GRAIN_CALLS = (2176, 272, 34)  # a SmolLM2 decode step's aten calls (gil_switch), 8 per call, 64 per call
GIL_GRAIN_ROWS = 6 * 2176  # rows of the step's matrix products in all, split among its calls


def _grain_step(x, w, n_calls: int) -> None:
    """A synthetic decode step: the products of ``x``'s rows (torch, ``[GIL_GRAIN_ROWS, d]``) with ``w``, in
    ``n_calls`` torch calls of equal rows: the same arithmetic whatever ``n_calls``, released to the GIL in as many
    pieces."""
    import torch

    for piece in x.chunk(n_calls):
        torch.mm(piece, w)


def _scripted_grain_step(x, w, n_calls: int, per_call: int, scripted) -> None:
    """:func:`_grain_step` with ``n_calls * per_call`` products, made in ``n_calls`` calls of ``scripted`` (the
    TorchScript function of :func:`_script_products`) of ``per_call`` products each: the same arithmetic as
    ``_grain_step(x, w, n_calls * per_call)``, handing the GIL back ``n_calls`` times."""
    for piece in x.chunk(n_calls):
        scripted(piece, w, per_call)


def _script_products():
    """A TorchScript function ``(x, w, n)`` returning the products of ``n`` equal row pieces of ``x`` with ``w``: one
    call from Python that releases the GIL for all ``n`` (torch 2.13 calls ``torch.jit.script`` deprecated: the
    warning is silenced here, where it is only a measuring tool)."""
    import warnings

    import torch

    def products(x: torch.Tensor, w: torch.Tensor, n: int) -> list[torch.Tensor]:
        return [torch.mm(piece, w) for piece in torch.chunk(x, n)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*torch.jit.script.* is deprecated")
        return torch.jit.script(products)


GIL_GRAIN_HELD = (0.05,)  # gil_share's synthetic thread: a planner holding the GIL for about 10 us of a solve


def bench_gil_grain(rounds: int, block: int, seed: int, torch_threads: int, out: list[str], calls=GIL_GRAIN_CALLS,
                    rows: int = GIL_GRAIN_ROWS, dim: int = 576, size=(4, 32),
                    held=GIL_GRAIN_HELD) -> dict[tuple[str, str], tuple[float, float, float]]:
    """A synthetic decode step (:func:`_grain_step`: the same products in ``calls`` torch calls; and the finest of
    them made in as many calls as the coarsest, each a TorchScript function doing its share,
    :func:`_scripted_grain_step`) alone, beside the engine's planner thread solving ``size`` batches back to back, and
    beside gil_share's synthetic thread holding the GIL each share of ``held``: whether a step made of fewer, longer
    GIL-free calls loses less to the thread (gil_switch: the engine's step grows by some 40 us per aten call), and
    what the two levers give together. Each (step, what runs beside it) is a condition of
    :func:`interleaved_rounds`, ``block`` steps per round. Returns per (step's label, beside) the paired slowdown over
    the step alone (median, 95% interval)."""
    import threading

    import torch

    from orbitflow.policies import OrbitFlowPolicy
    from orbitflow.runtime.background_planner import BackgroundPlanner

    fine, coarse = max(calls), min(calls)
    if any(rows % n for n in calls) or fine % coarse:
        raise ValueError(f"gil_grain: {rows} rows must split evenly into each of {calls} calls, and {fine} products "
                         f"into {coarse} calls")
    torch.set_num_threads(torch_threads)
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, dim, generator=gen), torch.randn(dim, dim, generator=gen)
    scripted = _script_products()
    grains = {f"{n}": (rows // n, lambda n=n: _grain_step(x, w, n)) for n in calls}
    grains[f"{coarse}, TorchScript"] = (rows // fine,
                                        lambda: _scripted_grain_step(x, w, coarse, fine // coarse, scripted))
    share_of = {f"a thread holding the GIL {100 * h:.0f}%": h for h in held}
    rate = _spin_rate() if held else 0.0
    planner = BackgroundPlanner(OrbitFlowPolicy(), "thread")
    cases = [_engine_case(np.random.default_rng(seed + k), *size) for k in range(16)]
    planner.submit(*cases[0]).result()  # load the compiled code before timing
    for _, step in grains.values():
        step()  # warm (TorchScript profiles its first runs)
        step()
    kinds = ("the planner thread", *share_of)
    conditions = [(label, kind) for label in grains for kind in ("alone", *kinds)]
    counts = {cond: [0.0, 0.0, 0.0] for cond in conditions}  # solves, or the held thread's tally

    def beside(cond, stop):
        if cond[1] in share_of:
            return _held_thread(stop, share_of[cond[1]], rate, counts[cond])
        if cond[1] == "alone":
            return None
        th = threading.Thread(target=_solve_loop, args=(stop, planner, cases, counts[cond]))
        th.start()
        return th

    try:
        steps, busy_s = interleaved_rounds(rounds, block, conditions, lambda cond: grains[cond[0]][1](), beside,
                                           "gil_grain rounds")
    finally:
        planner.close()
    held_text = "".join(f"; '{k}': gil_share's synthetic planner thread, back to back, holding the GIL for that "
                        f"share of each {1e6 * GIL_CYCLE_S:.0f} us cycle and running without it the rest (the "
                        f"planner thread holds it for about half of its time today, planner_gil.md)"
                        for k in share_of)
    out.append(f"\n### A synthetic step beside a planner thread, by how many torch calls make it\n\nA synthetic decode "
               f"step: the products of a {rows} x {dim} matrix with a {dim} x {dim} one (torch, {torch_threads} "
               f"thread(s)), split by rows into the number of torch calls shown: the same arithmetic each time, "
               f"released to the GIL in that many pieces ({fine}: about the SmolLM2 decode step's aten calls, "
               f"gil_switch). '{coarse}, TorchScript': the {fine} products of {rows // fine} rows, made in {coarse} "
               f"calls of a `torch.jit.script` function doing {fine // coarse} each (the same aten calls as the "
               f"{fine}-call step, run without the GIL from one call from Python). Beside it: the engine's planner "
               f"thread (runtime/background_planner.py) solving {size[0]}x{size[1]} batches back to back, as in the "
               f"engine section's 'thread' condition{held_text}. Each step alone and with each thread beside it is a "
               f"condition, {block} steps per round, all of them interleaved (their order rotated by one each "
               f"round); {rounds} rounds. slowdown: paired by round (`paired_slowdown`: each round's median beside "
               f"the thread over its median alone), with a 95% bootstrap interval over the rounds; the last column "
               f"counts the planner thread's solves or the synthetic thread's cycles.\n")
    out.append("| torch calls per step | rows per product | beside | step alone, median ms | beside, median ms | "
               "slowdown, paired | 95% CI | solves or cycles/s |")
    out.append("|---|---|---|---|---|---|---|---|")
    boot, result = np.random.default_rng(seed), {}
    for label, (per_product, _) in grains.items():
        alone = steps[(label, "alone")]
        for kind in kinds:
            cond = (label, kind)
            med, lo, hi = paired_slowdown(steps[cond], alone, block, boot)
            result[cond] = (med, lo, hi)
            rate_s = counts[cond][0] / busy_s[cond] if busy_s[cond] > 0 else 0.0
            out.append(f"| {label} | {per_product} | {kind} | {1e3 * float(np.median(alone)):.2f} | "
                       f"{1e3 * float(np.median(steps[cond])):.2f} | {100 * (med - 1):+.1f}% | "
                       f"[{100 * (lo - 1):+.1f}%, {100 * (hi - 1):+.1f}%] | {rate_s:.0f} |")
    print("\n".join(out[-len(result) - 2:]), flush=True)
    return result


def _engine_case(rng: np.random.Generator, n_req: int, n_layers: int):
    """A random batch as the background planner receives it: (requests, planning context)."""
    from orbitflow.policies.base import PlanContext

    cm, cap, reqs = random_instance(rng, n_req, n_layers)
    return reqs, PlanContext(num_layers=n_layers, block_size=16, capacity_blocks=int(cap), cost_model=cm,
                             alpha=1.0, window=(4, 16))


class _BusyPlanner:
    """A planner process that solves ``cases`` round robin while ``run`` is set (started once, before timing)."""

    def __init__(self, cases):
        import multiprocessing

        mp = multiprocessing.get_context("spawn")
        self.run, self._quit, self._count = mp.Event(), mp.Event(), mp.Value("l", 0)
        self._proc = mp.Process(target=_busy_planner_main, args=(cases, self.run, self._quit, self._count),
                                daemon=True)
        self._proc.start()

    def stop(self) -> int:
        self._quit.set()
        self.run.clear()
        self._proc.join(timeout=30)
        return int(self._count.value)


def _busy_planner_main(cases, run, quit_, count) -> None:
    from orbitflow.policies import OrbitFlowPolicy

    warm_up()
    policy, i = OrbitFlowPolicy(), 0
    while not quit_.is_set():
        if not run.wait(0.05):
            continue
        policy.plan(*cases[i % len(cases)])
        i += 1
        with count.get_lock():
            count.value += 1


def _solve_loop(stop, planner, cases, count: list[int]) -> None:
    i = 0
    while not stop.is_set():
        planner.submit(*cases[i % len(cases)]).result()
        i += 1
        count[0] += 1


def _burner_loop(stop, count: list[int]) -> None:
    """A thread that keeps one core busy without the GIL (hashlib releases it on large buffers): the slowdown
    that CPU contention alone causes, as a baseline for the planner."""
    import hashlib

    data = bytes(1 << 20)
    while not stop.is_set():
        hashlib.sha256(data).digest()
        count[0] += 1


def paired_slowdown(xs, idle, block: int, rng, resamples: int = 1000) -> tuple[float, float, float]:
    """A condition's step times over idle's, paired by round: both ran ``block`` steps in each round (in that order),
    so round ``k``'s ratio is the median of its block over the median of idle's block of the same round, where the
    sequences have about the same length. Returns the median of those ratios and a 95% bootstrap interval over the
    rounds (the contexts grow through a run, which widens an interval that pools every step)."""
    xs, idle = np.asarray(xs, dtype=float), np.asarray(idle, dtype=float)
    if xs.size != idle.size or xs.size % block or xs.size == 0:
        raise ValueError(f"paired_slowdown needs {block} steps per round on both sides, got {xs.size} and {idle.size}")
    ratios = np.median(xs.reshape(-1, block), axis=1) / np.median(idle.reshape(-1, block), axis=1)
    boot = [float(np.median(rng.choice(ratios, ratios.size))) for _ in range(resamples)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(np.median(ratios)), float(lo), float(hi)


def _engine_table(conditions, steps, solves, busy_s, seed: int, out: list[str], block: int,
                  rate_label: str = "solves/s beside the engine") -> None:
    out.append("| condition | median step ms | p90 step ms | slowdown vs idle | 95% CI | paired by round | 95% CI "
               f"| {rate_label} |")
    out.append("|---|---|---|---|---|---|---|---|")
    idle = np.asarray(steps["idle"])
    boot = np.random.default_rng(seed)
    for cond in conditions:
        xs = np.asarray(steps[cond])
        ratio = float(np.median(xs) / np.median(idle))
        ci = [float(np.median(boot.choice(xs, xs.size)) / np.median(boot.choice(idle, idle.size)))
              for _ in range(1000)]
        lo, hi = np.percentile(ci, [2.5, 97.5])
        paired, p_lo, p_hi = paired_slowdown(xs, idle, block, boot)
        rate = solves[cond][0] / busy_s[cond] if busy_s[cond] > 0 else 0.0
        out.append(f"| {cond} | {1e3 * float(np.median(xs)):.2f} | {1e3 * pct(xs.tolist(), 90):.2f} | "
                   f"{100 * (ratio - 1):+.1f}% | [{100 * (lo - 1):+.1f}%, {100 * (hi - 1):+.1f}%] | "
                   f"{100 * (paired - 1):+.1f}% | [{100 * (p_lo - 1):+.1f}%, {100 * (p_hi - 1):+.1f}%] | {rate:.0f} |")
    print("\n".join(out[-len(conditions) - 2:]), flush=True)


def _engine_device() -> str:
    """Where the engine section's engine runs: CUDA where there is one, else the CPU."""
    import torch

    return "CUDA" if torch.cuda.is_available() else "CPU"


def _machine() -> str:
    import platform

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"numpy {np.__version__}, numba {_numba_version()}; load average at the start {load:.1f}")


def _source() -> str:
    """The git commit of the planner this script imports (the baseline's name in --compare-budget)."""
    import subprocess

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _numba_version() -> str:
    try:
        import numba

        return numba.__version__
    except ImportError:
        return "missing"


SECTION_TITLES = {  # the --md page's title of a section run alone
    "proof": "Planner: what an exact proof at (16, 80) takes",
    "link": "Planner: the executor's link vs a preemptive one",
    "gap": "Planner: exact, or within a gap",
    "replan": "Planner: what a re-plan could reuse",
    "gil": "Planner: where a solve holds the GIL",
    "gil_share": "Planner: how much of a solve may hold the GIL",
    "gil_switch": "Planner: a planner thread by GIL switch interval",
    "gil_grain": "Planner: a planner thread beside a step of fewer torch calls",
}
SECTIONS = ("speed", "budget_seeds", "engine", "gil", "gil_share", "gil_switch", "gil_grain", "bruteforce", "floor",
            "uniform", "full", "proof", "link", "gap", "replan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer calls (smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calls", type=int, default=None,
                    help="random batches per size for the speed table (default 300, quick 20; a tenth at L=80)")
    ap.add_argument("--budget-ms", type=float, default=1.0, help="time_limit_s of the budgeted solves, in ms")
    ap.add_argument("--exact-cap-s", type=float, default=2.0, help="wall-clock cap of one exact solve, in seconds")
    ap.add_argument("--threads", type=int, default=2,
                    help="speed: also time the compiled exact solve on this many threads (1: not)")
    ap.add_argument("--sections", default="speed,budget_seeds,engine,bruteforce,floor,uniform,full",
                    help=f"comma-separated subset of {','.join(SECTIONS)} (proof: not by default, ~5 min; link: not "
                         "by default, the same batches planned for a preemptive link, ~3 min; gap: not by default, the "
                         "same batches solved within relative gaps 0, 1e-4 and 1e-3, ~3 min; replan: not by default, "
                         "what a re-plan at the plan's expiry could reuse of the last search, ~3 min; gil: not by "
                         "default, where a solve in the engine's pattern holds the GIL, ~1 min; gil_share: not by "
                         "default, the engine's step beside a thread holding the GIL a given share, ~3 min; "
                         "gil_switch: not by default, the engine's step beside a planner thread at several GIL "
                         "switch intervals, ~4 min; gil_grain: not by default, a synthetic step made of more or "
                         "fewer torch calls beside a planner thread, ~3 min)")
    ap.add_argument("--proof-cap-s", type=float, default=10.0,
                    help="proof, replan: wall-clock cap of the search that knows its best plan (default "
                         "%(default)s)")
    ap.add_argument("--leaf-cap-s", type=float, default=5.0,
                    help="proof: seconds the reference search records the plans it schedules (default %(default)s)")
    ap.add_argument("--order-leaves", type=int, default=6,
                    help="proof: leaves per batch whose best link order is searched (default %(default)s)")
    ap.add_argument("--replan-batches", type=int, default=None,
                    help="replan: batches per size, the speed table's first ones (default 20, quick 2)")
    ap.add_argument("--replan-steps", type=int, default=None,
                    help="replan: decode steps between a batch and its re-plan (default: the step its plan asks to "
                         "be re-planned, Plan.replan_step, as the controller does)")
    ap.add_argument("--trace-cap-s", type=float, default=2.0,
                    help="replan: seconds each traced search records its bounds (default %(default)s)")
    ap.add_argument("--budget-seeds", type=int, default=4,
                    help="budget_seeds: how many other seeds (seed+1..) re-draw the first size's batches (default 4)")
    ap.add_argument("--engine-rounds", type=int, default=None,
                    help="engine, gil_share, gil_switch, gil_grain: interleaved rounds (default 12, 20, 20 and "
                         "20, quick 3)")
    ap.add_argument("--gil-batches", type=int, default=200,
                    help="gil: batches per size, each solved once to warm and once timed (default %(default)s)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads of the engine")
    ap.add_argument("--model", default="smollm2-135m",
                    help="model of the engine section: a built-in name or an HF directory (default %(default)s)")
    ap.add_argument("--sizes", default="4x32,8x32,16x80",
                    help="(R)x(L) batch sizes of the speed section, comma-separated (default %(default)s)")
    ap.add_argument("--dump-budget", metavar="JSON", help="speed: write the compiled budgeted plans' predicted "
                    "latencies per size (to compare another version of the planner on the same batches)")
    ap.add_argument("--compare-budget", metavar="JSON", help="speed: count the batches whose compiled budgeted plan "
                    "is slower / faster than in this file (written by --dump-budget, same --seed and --calls)")
    ap.add_argument("--md", metavar="PATH", help="write the speed and engine tables as a Markdown fragment "
                    "(docs/results/planner.md)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}")
    if args.order_leaves < 0:
        ap.error(f"--order-leaves must be >= 0, got {args.order_leaves}")
    if args.replan_steps is not None and args.replan_steps < 1:
        ap.error(f"--replan-steps must be >= 1, got {args.replan_steps}")
    if args.gil_batches < 1:
        ap.error(f"--gil-batches must be >= 1, got {args.gil_batches}")
    if args.replan_batches is not None and args.replan_batches < 1:
        ap.error(f"--replan-batches must be >= 1, got {args.replan_batches}")
    if not args.trace_cap_s > 0:
        ap.error(f"--trace-cap-s must be > 0, got {args.trace_cap_s}")
    calls = args.calls or (20 if args.quick else 300)
    try:
        sizes = [tuple(int(v) for v in item.split("x")) for item in args.sizes.split(",")]
        if any(len(sz) != 2 or min(sz) < 1 for sz in sizes):
            raise ValueError
    except ValueError:
        ap.error(f"--sizes: expected RxL items like 4x32,16x80, got {args.sizes!r}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = _machine()
    print(f"orbitflow planner benchmark ({machine}, {'quick' if args.quick else 'full'} run)")
    out: list[str] = []
    if "speed" in sections:
        baseline = None
        if args.compare_budget:
            with open(args.compare_budget) as f:
                baseline = json.load(f)
            if (baseline.get("seed"), baseline.get("calls")) != (args.seed, calls):
                ap.error(f"--compare-budget: {args.compare_budget} has seed {baseline.get('seed')} and calls "
                         f"{baseline.get('calls')}, this run {args.seed} and {calls}")
        dump = {"seed": args.seed, "calls": calls, "source": _source()} if args.dump_budget else None
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        bench_speed(sizes, calls, args.seed, args.budget_ms / 1e3, args.exact_cap_s, out, baseline, dump,
                    args.threads)
        if dump is not None:
            with open(args.dump_budget, "w") as f:
                json.dump(dump, f)
    if "budget_seeds" in sections:
        bench_budget_seeds(sizes[0], calls, list(range(args.seed + 1, args.seed + 1 + args.budget_seeds)),
                           args.budget_ms / 1e3, out)
    if "engine" in sections:
        bench_engine(args.engine_rounds or (3 if args.quick else 12), 5, args.seed, args.torch_threads,
                     [(4, 32), (16, 80)], out, model=args.model)
    if "gil" in sections:
        bench_gil(sizes, 16 if args.quick else args.gil_batches, args.seed, out)
    if "gil_share" in sections:
        bench_gil_share(args.engine_rounds or (3 if args.quick else 20), 10, args.seed, args.torch_threads, out,
                        model=args.model)
    if "gil_switch" in sections:
        bench_gil_switch(args.engine_rounds or (3 if args.quick else 20), 6, args.seed, args.torch_threads, out,
                         model=args.model)
    if "gil_grain" in sections:
        bench_gil_grain(args.engine_rounds or (3 if args.quick else 20), 4, args.seed, args.torch_threads, out)
    if "bruteforce" in sections:
        bench_bruteforce(20 if args.quick else 100, args.seed)
    if "floor" in sections:
        bench_floor(10 if args.quick else 100, args.seed)
    if "proof" in sections:
        bench_proof(3 if args.quick else 30, args.seed, args.exact_cap_s, args.proof_cap_s, args.leaf_cap_s, out,
                    order_leaves=args.order_leaves)
    if "link" in sections:
        bench_link(sizes, calls, args.seed, args.exact_cap_s, out)
    if "gap" in sections:
        bench_gap(sizes, calls, args.seed, args.exact_cap_s, out)
    if "replan" in sections:
        bench_replan(sizes, args.replan_batches or (2 if args.quick else 20), args.seed, args.exact_cap_s,
                     args.proof_cap_s, args.trace_cap_s, out, steps=args.replan_steps)
    if "uniform" in sections:
        bench_uniform(sizes, 5 if args.quick else 50, args.seed)
    if "full" in sections:
        bench_full([(4, 32), (8, 32)], 10 if args.quick else 40, args.seed)
    if args.md:
        cmd = "python benchmarks/planner.py " + " ".join(sys.argv[1:])
        if sections & {"speed", "budget_seeds"}:
            title = "Planner speed: compiled vs pure Python / NumPy reference"
        elif len(sections) == 1 and next(iter(sections)) in SECTION_TITLES:
            title = SECTION_TITLES[next(iter(sections))]
        else:
            title = f"The planner beside the engine ({_engine_device()}, {os.cpu_count()} cores)"
        about = (f"seed {args.seed}. Random batches from `benchmarks/planner.py:random_instance` (8-1024 blocks per "
                 "layer, link 1.9-6x a layer's compute, capacity 0.3-0.6 of the KV, SLO 1.5-2.5x the no-offload step)")
        if sections == {"gil_share"}:
            about = f"seed {args.seed}. No planner solves here: the thread beside the engine is synthetic"
        write_fragment(args.md, title, cmd, started, machine, about, out)


def require_positive(ap: argparse.ArgumentParser, args: argparse.Namespace, names) -> None:
    """Exit through ``ap.error``, naming the flag, unless every option of ``names`` (attribute names) is > 0."""
    for name in names:
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")


def write_fragment(path: str, title: str, cmd: str, started: str, machine: str, about: str, out: list[str]) -> None:
    """Write a section's tables ``out`` as a Markdown fragment of docs/results.md, headed by ``title`` and the command,
    start time and machine (:func:`_machine` at the start) that made it (``about``: what it ran on)."""
    head = f"## {title}\n\nProduced by `{cmd}` on {started} ({machine}), {about}.\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(head + "\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
