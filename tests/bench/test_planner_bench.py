"""benchmarks/planner.py's proof section: its leaf recorder sees what the search schedules, its link orders run the
executor's schedule and only ever shorten it, and its table reads right."""

import math
import sys
import time

import numpy as np
import pytest
from benchmark_scripts import load_benchmark

from orbitflow.plan import Planner
from orbitflow.plan.bounds import count_matrix, dp_bound
from orbitflow.plan.cost_model import edf_stalls
from orbitflow.plan.types import PlanStats


def _random_link(rng):
    """A random step: compute per layer, host layers per request, seconds per copy (integers half the time, so that
    releases and link times tie)."""
    n_layers, n_req = int(rng.integers(1, 13)), int(rng.integers(1, 6))
    draw = (lambda n: rng.integers(1, 6, n).astype(float)) if rng.random() < 0.5 else (lambda n: rng.uniform(0.1, 5, n))
    hosts = [sorted(rng.choice(n_layers, int(rng.integers(0, n_layers + 1)), replace=False).tolist())
             for _ in range(n_req)]
    return draw(n_layers).tolist(), hosts, draw(n_req).tolist()


def _batches(bench, n):
    """The speed table's batches of 5 requests over 16 layers (seed 3): small enough for every proof to finish."""
    return bench.speed_cases(3, 5, 16, n)


def _solved(bench, n):
    """The feasible ones of those batches, each with its exact planner and plan: (planner, requests, plan)."""
    for cm, cap, reqs in _batches(bench, n):
        planner = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False)
        plan = planner.plan(reqs)
        if plan.feasible:
            yield planner, reqs, plan


def test_leaf_recorder_changes_no_plan_and_every_leaf_bound_holds():
    """LeafGaps is the reference search with a recorder: the same optimum as the planner's exact solve, the
    release/need bound it records never exceeds the exact latency of the same plan (the bound is valid), and the plan
    it records beside them is the one they price."""
    bench = load_benchmark("planner")
    leaves = 0
    for cm, cap, reqs in _batches(bench, 6):
        planner = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False)
        plan = planner.plan(reqs)
        rules = planner.constraints
        gaps = bench.LeafGaps(rules, rules.horizon(reqs), PlanStats())
        host = gaps.run()
        assert (host is None) == (not plan.feasible)
        if host is not None:
            assert np.isclose(gaps.best_key[0], plan.predicted_step_s, rtol=1e-9)
        assert len(gaps.plans) == len(gaps.seen)
        for (bound, lat), k_of in zip(gaps.seen, gaps.plans):
            assert bound <= lat * (1 + 1e-9)
            assert gaps._lat0(k_of) == lat  # the plan recorded beside it is that leaf's
        leaves += len(gaps.seen)
    assert leaves > 0


def test_proof_table_has_a_row_per_feasible_batch_and_no_leaf_beats_a_proven_optimum():
    bench = load_benchmark("planner")
    out: list[str] = []
    bench.bench_proof(4, 3, 5.0, 5.0, 2.0, out, n_req=5, n_layers=16)
    rows = [line for line in out if line.startswith("| ") and not line.startswith("| batch")]
    feasible = sum(Planner(cm, cap, alpha=1.0, window=(4, 16)).plan(reqs).feasible
                   for cm, cap, reqs in _batches(bench, 4))
    assert len(rows) == feasible > 0
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "True"  # every batch this small is proven within the cap
        if cells[9] != "-":
            least = float(cells[9].split("/")[1].rstrip("% "))
            assert least >= 0.0  # a proven optimum: no leaf is faster
        if cells[11] != "-":  # "p50% / reached of sampled"
            reached, sampled = (int(x) for x in cells[11].split("/")[1].split(" of "))
            assert 0 <= reached <= sampled
        assert float(cells[12].rstrip("%")) >= 0.0  # a better order only ever shortens the plan's step
    assert any(line.startswith("Proofs done within") for line in out)


def test_depth_profile_counts_every_node_once_and_each_comes_from_a_surviving_child():
    """depth_profile's rows of a finished search that knew its optimum from the start: the nodes add up to the trace,
    no depth has more nodes than the depth above let children survive (a node is such a child), and a surviving child's
    bound is never above the best plan."""
    bench = load_benchmark("planner")
    checked = 0
    for planner, reqs, plan in _solved(bench, 6):
        rules = planner.constraints
        upper = plan.predicted_step_s * (1 + 1e-9)
        gaps = bench.LeafGaps(rules, rules.horizon(reqs), PlanStats(), upper=upper)
        gaps.trace = []
        gaps.run()
        rows = bench.depth_profile(gaps, upper)
        assert sum(nodes for nodes, *_ in rows) == len(gaps.trace) > 0
        for d, (_nodes, kids, alive, under) in enumerate(rows):
            assert kids >= alive >= len(under) >= 0
            assert all(u >= -1e-7 for u in under)
            if d + 1 < len(rows):
                assert rows[d + 1][0] <= len(under)
        checked += 1
    assert checked > 0


def test_proof_section_shows_where_unfinished_proofs_spend_their_nodes():
    """With no time for the proofs they stop unfinished, and the depth table appears: its rows add up to the nodes
    its text names, and its shares to 100%."""
    bench = load_benchmark("planner")
    out: list[str] = []
    bench.bench_proof(3, 3, 5.0, 0.0, 1.0, out, n_req=5, n_layers=16)
    start = next(i for i, line in enumerate(out) if line.startswith("| depth |"))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out[start + 2:] if line.startswith("| ")]
    assert rows and int(rows[0][0]) == 0
    total = int(out[start - 1].split(" nodes), by depth")[0].rsplit(" ", 1)[1])
    assert sum(int(r[2]) for r in rows) == total
    assert abs(sum(float(r[3].rstrip("%")) for r in rows) - 100) < 0.1 * len(rows)


def test_edf_order_replayed_is_the_executor_schedule():
    """The link order edf_order reads off, replayed by order_latency, gives the cost model's EDF latency exactly."""
    bench = load_benchmark("planner")
    rng = np.random.default_rng(5)
    for _ in range(400):
        comp, hosts, xfer = _random_link(rng)
        seq = bench.edf_order(comp, hosts, xfer)
        assert sorted(seq.tolist()) == list(range(sum(map(len, hosts))))
        replay = bench.order_latency(*bench.order_arrays(comp, hosts, xfer), seq)
        assert math.isclose(replay, sum(comp) + sum(edf_stalls(comp, hosts, xfer)), rel_tol=1e-12)


def test_improve_order_only_shortens_and_never_beats_the_release_need_bound():
    """The local search's order is a permutation priced as it says, no slower than EDF's and never below the
    preemptive release/need bound (which holds for every order); an order that feeds a layer after a copy waiting on
    it deadlocks (inf)."""
    bench = load_benchmark("planner")
    rng = np.random.default_rng(6)
    shorter = 0
    for _ in range(300):
        comp, hosts, xfer = _random_link(rng)
        arrays = bench.order_arrays(comp, hosts, xfer)
        edf = bench.edf_order(comp, hosts, xfer)
        lat, seq = bench.improve_order(*arrays, edf)
        assert sorted(seq.tolist()) == sorted(edf.tolist())
        assert lat == bench.order_latency(*arrays, seq) <= bench.order_latency(*arrays, edf)
        mask = np.zeros((len(hosts), len(comp)), dtype=bool)
        for r, h in enumerate(hosts):
            mask[r, h] = True
        v = sum(x * count_matrix(row) for x, row in zip(xfer, mask))
        assert lat >= float(dp_bound(np.asarray(v)[None], np.asarray(comp))[0]) * (1 - 1e-12)
        shorter += lat < bench.order_latency(*arrays, edf)
    assert shorter > 0
    # request 1's copy for layer 1 released at t=2 waits behind request 0's 5 s copy in EDF's order (13 s); moved
    # ahead of it, nothing waits but layer 2 (11 s)
    comp, hosts, xfer = [1.0, 3.0, 3.0], [[2], [0, 1]], [5.0, 1.0]
    arrays = bench.order_arrays(comp, hosts, xfer)
    assert bench.order_latency(*arrays, bench.edf_order(comp, hosts, xfer)) == 13.0
    assert bench.improve_order(*arrays, bench.edf_order(comp, hosts, xfer))[0] == 11.0
    assert bench.order_latency(*arrays, np.array([2, 1, 0])) == math.inf  # layer 1's copy before layer 0's


def test_link_section_prices_both_links_on_the_same_batches_and_the_preemptive_is_never_slower():
    """The link section plans each batch for both links: a row per link, every small batch proven, and the
    preemptive link's best step never above the EDF link's (mean ratio and least <= 1)."""
    bench = load_benchmark("planner")
    out: list[str] = []
    bench.bench_link([(5, 16)], 12, 3, 5.0, out)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out if line.startswith("| 5 |")]
    assert [r[3] for r in rows] == ["edf", "preemptive"]
    assert all(r[6] == "0/12" for r in rows)  # every proof finished
    feasible = [int(r[9].split("/")[0]) for r in rows]
    assert feasible[1] >= feasible[0] > 0  # a faster link never turns a plan infeasible
    mean, least = float(rows[1][10].split()[0]), float(rows[1][11])
    assert least <= mean <= 1.0
    # fewer plans scheduled exactly on these batches (its last bound is its latency; not a rule: the trees differ)
    assert int(rows[1][7]) <= int(rows[0][7])


def test_gap_table_proves_small_batches_within_each_gap():
    """The gap section: a row per gap; at 5 x 16 every solve ends within its cap, a wider gap takes fewer nodes, and
    a plan proven within a gap is never slower than the exact optimum by more than that gap (the table's own 'over
    the exact' column)."""
    bench = load_benchmark("planner")
    out: list[str] = []
    gaps = (0.0, 1e-3, 0.05)
    bench.bench_gap([(5, 16)], 8, 3, 5.0, out, gaps=gaps)
    rows = [line.strip("|").split("|") for line in out if line.startswith("| 5 |")]
    assert [float(row[3]) for row in rows] == list(gaps)
    nodes = [int(row[7]) for row in rows]
    assert nodes[0] >= nodes[1] >= nodes[2] and nodes[2] < nodes[0]  # the gap cuts the search short
    for row, g in zip(rows, gaps):
        assert row[6].strip() == "8/8"
        if g:
            mean, most = (float(v.strip().rstrip("%")) for v in row[9].split("/"))
            assert 0 <= mean <= most <= 100 * g / (1 - g)  # the certified gap is over the plan, not the optimum
    assert out[-1].strip() == ("Batches proven within a gap that the exact search left unproven: (5, 16) 0 within "
                               "0.001, 0 within 0.05.")


def test_traced_children_keys_each_child_by_its_partial_plan():
    """traced_children: a node per trace entry holding its prefix's candidates (in the search's order), and each
    child that capacity kept alive under its own partial plan (the node's plus one more request), with the bound the
    trace gave it; no two children share a key."""
    bench = load_benchmark("planner")
    checked = 0
    for planner, reqs, plan in _solved(bench, 4):
        tree, kids, nodes = bench.traced_children(planner.constraints, reqs, plan.predicted_step_s * (1 + 1e-9), 5.0)
        assert not tree.timed_out and len(nodes) == len(tree.trace) > 0
        assert len(kids) == sum(int(alive.sum()) for _, _, alive in tree.trace) > 0
        for (prefix, lat_lb, alive), node in zip(tree.trace, nodes):
            depth = len(prefix)
            assert node[tree.order[:depth]].tolist() == prefix and (node >= 0).sum() == depth
            for k in np.flatnonzero(alive).tolist():
                child = node.copy()
                child[tree.order[depth]] = k
                assert kids[child.tobytes()] == float(lat_lb[k])
        checked += 1
    assert checked > 0


def test_fixed_bounds_bound_no_lower_and_find_the_same_optimum():
    """FixedBounds (every bound at every node): from no incumbent it proves the same optimum as the reference
    search, and knowing the optimum from the start it gives every child both searches bounded a bound no lower."""
    bench = load_benchmark("planner")
    checked = 0
    for planner, reqs, plan in _solved(bench, 6):
        rules = planner.constraints
        ref = bench.LeafGaps(rules, rules.horizon(reqs), PlanStats())
        ref.run()
        fixed = bench.FixedBounds(rules, rules.horizon(reqs), PlanStats())
        fixed.run()
        assert np.isclose(fixed.best_key[0], ref.best_key[0], rtol=1e-9)
        upper = plan.predicted_step_s * (1 + 1e-9)
        oracle = [bench.LeafGaps(rules, rules.horizon(reqs), PlanStats(), upper=upper),
                  bench.FixedBounds(rules, rules.horizon(reqs), PlanStats(), upper=upper)]
        bounds = []
        for tree in oracle:
            tree.trace = []
            tree.run()
            bounds.append({(tuple(prefix), k): float(lb[k]) for prefix, lb, alive in tree.trace
                           for k in np.flatnonzero(alive).tolist()})
        shared = bounds[0].keys() & bounds[1].keys()
        assert shared and all(bounds[1][key] >= bounds[0][key] * (1 - 1e-12) for key in shared)
        checked += 1
    assert checked > 0


def test_under_cut_finds_a_cut_ancestor_in_another_order():
    bench = load_benchmark("planner")
    cut_plan = np.array([-1, 3, -1, 2], dtype=np.int16)  # requests 3 then 1 assigned, in the other search's order
    cut = {cut_plan.tobytes()}
    assert bench.under_cut(np.array([0, 3, -1, 2], dtype=np.int16), [3, 1, 0, 2], cut)  # below it
    assert bench.under_cut(cut_plan, [3, 1, 0, 2], cut)  # the cut child itself
    assert not bench.under_cut(np.array([0, 3, -1, 1], dtype=np.int16), [3, 1, 0, 2], cut)  # another candidate
    assert not bench.under_cut(np.array([0, 3, 1, -1], dtype=np.int16), [3, 1, 0, 2], cut)  # request 3 unassigned
    assert not bench.under_cut(np.array([0, 3, -1, 2], dtype=np.int16), [1, 0, 3, 2], cut)  # never that prefix


def test_replan_case_no_reopening_when_the_optimum_did_not_rise_and_no_node_under_a_cut_unless_a_bound_fell():
    """replan_case at 5 x 16, where every solve and traced search finishes: B's cuts need re-opening only where B1's
    optimum rose; and where both searched in one order and B1 cut every child B cut against B1's optimum that it
    bounded too, B1 expands no node under such a cut (it bounded that cut child itself, being one of its ancestors)."""
    bench = load_benchmark("planner")
    cases, same = 0, 0
    for cm, cap, reqs in _batches(bench, 8):
        planner = Planner(cm, cap, alpha=1.0, window=(4, 16), node_limit=None, check_better=False)
        c = bench.replan_case(planner, reqs, None, 5.0, 5.0)
        if c is None:
            continue
        cases += 1
        assert c["both"] and c["proof_done"] and c["whole0"] and c["whole1"]
        assert 0 <= c["reopen"] <= c["cuts"] and 0 <= c["under"] <= c["traced1"] and 0 <= c["faster"] <= c["plans"]
        if c["best1"] <= c["best0"]:
            assert c["reopen"] == 0
        if c["same_order"]:
            same += 1
            if c["stronger0"] == 0:
                assert c["under"] == 0
    assert cases >= 4 and same > 0


def test_replan_table_and_summary_read_right_on_small_batches():
    """The replan section at 5 x 16: a row per feasible batch, every proof done and both traces finished; the
    summary's counts are the table's."""
    bench = load_benchmark("planner")
    out: list[str] = []
    bench.bench_replan([(5, 16)], 8, 3, 5.0, 5.0, 5.0, out)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out if line.startswith("| 5 |")]
    assert len(rows) >= 4 and all(len(r) == 16 for r in rows)
    for r in rows:
        assert r[6] == "True" and r[9] == "True"
        assert r[14].endswith(" done")  # B1's traced search finished, and B's ("B in part" otherwise)
        under, traced = r[14].removesuffix(" done").split(" of ")
        assert 0 <= int(under) <= int(traced)
    fell = sum(not r[13].startswith("0 ") for r in rows)
    faster = sum(not r[15].startswith("0 of") for r in rows)
    assert out[-1].startswith(f"(5, 16), {len(rows)} of 8 batches feasible at both steps; in the {len(rows)} with "
                              "both optima proven, B1's proof alone takes p50 ")
    assert (f"B1's traced search finished in {len(rows)}; a bound fell as the blocks grew in {fell}; B's plans stepped "
            f"faster in B1 in {faster}. Where both traced searches finished ({len(rows)}), reuse could spare at most "
            ) in out[-1] and "a lower count" not in out[-1]


def test_paired_slowdown_cancels_the_drift_that_widens_the_pooled_interval():
    """Step times that grow through the run (the sequences lengthen) with a 2% slowdown and 1% noise: the rounds'
    ratios find it within a narrow interval, where pooling every step's times gives one several times wider."""
    bench = load_benchmark("planner")
    rng = np.random.default_rng(0)
    rounds, block = 60, 5
    trend = np.repeat(np.linspace(0.07, 0.09, rounds), block)
    idle = trend * (1 + 0.01 * rng.standard_normal(trend.size))
    slow = 1.02 * trend * (1 + 0.01 * rng.standard_normal(trend.size))
    ratio, lo, hi = bench.paired_slowdown(slow, idle, block, np.random.default_rng(1))
    assert lo < 1.02 < hi and hi - lo < 0.01 and ratio == pytest.approx(1.02, abs=0.005)
    boot = np.random.default_rng(1)
    pooled = [np.median(boot.choice(slow, slow.size)) / np.median(boot.choice(idle, idle.size)) for _ in range(1000)]
    assert np.subtract(*np.percentile(pooled, [97.5, 2.5])) > 3 * (hi - lo)
    same, lo, hi = bench.paired_slowdown(idle, idle, block, np.random.default_rng(1))
    assert same == lo == hi == 1.0
    with pytest.raises(ValueError, match="5 steps per round"):
        bench.paired_slowdown(slow[:-1], idle, block, rng)


@pytest.mark.skipif(not __import__("orbitflow.plan.compiled", fromlist=["enabled"]).enabled(None),
                    reason="numba missing: no compiled kernels to time")
def test_kernel_clock_times_the_kernels_of_a_solve_and_puts_them_back():
    """Inside KernelClock a compiled solve's kernels are timed (a kernel that sleeps is charged its sleep); on exit
    every dispatcher is the original again, with an error raised inside too."""
    from orbitflow.plan import compiled

    bench = load_benchmark("planner")
    kernels = {name: v for name, v in vars(compiled).items() if hasattr(v, "py_func")}
    assert "bb_search" in kernels
    cm, cap, reqs = bench.speed_cases(0, 4, 32, 1)[0]
    planner = Planner(cm, cap, window=(4, 16))
    planner.plan(reqs)
    with bench.KernelClock() as clock:
        assert compiled.bb_search is not kernels["bb_search"]
        planner.plan(reqs)
        one, calls = clock.seconds, clock.calls
        assert calls > 0 and one > 0
        clock._timed(lambda: time.sleep(0.02))()  # a slow kernel: its time lands in the clock
        assert clock.seconds - one >= 0.02 and clock.calls == calls + 1
    assert all(getattr(compiled, name) is v for name, v in kernels.items())
    with pytest.raises(RuntimeError), bench.KernelClock():
        raise RuntimeError
    assert all(getattr(compiled, name) is v for name, v in kernels.items())


def test_gil_section_splits_each_solve_into_kernel_and_python_time():
    """The gil section's rows: the kernel time never exceeds the wall time, the held share is a share, and the table
    has a row per size."""
    bench = load_benchmark("planner")
    out: list[str] = []
    rows = bench.bench_gil([(4, 32), (2, 8)], 4, 0, out)
    assert [r["size"] for r in rows] == ["4x32", "2x8"]
    for r in rows:
        assert 0 <= r["kernel_p50"] <= r["wall_p50"] and 0 <= r["held_share"] <= 1 and r["solves"] == 4
        assert r["held_p50"] <= r["wall_p50"]
    table = "\n".join(out)
    assert "| 4x32 | 4 |" in table and "| 2x8 | 4 |" in table


def test_gil_share_section_times_every_share_beside_the_engine_and_measures_what_it_held(tiny_chat_dir):
    """The gil_share section: a row per share and idle's, the synthetic thread ran its cycles beside the engine in
    every held condition, the engine's steps were timed in each, and the share it held is measured: a thread told to
    hold the GIL for most of each cycle holds it more than one told to hold none."""
    bench = load_benchmark("planner")
    out: list[str] = []
    measured = bench.bench_gil_share(2, 2, 0, 1, out, model=str(tiny_chat_dir), shares=(0.6, 0.0))
    rows = {line.split(" | ")[0].lstrip("| ").split(":")[0]: line.split(" | ") for line in out if line.startswith("| ")}
    assert set(rows) == {"condition", "idle", "held 60%", "held 0%"}
    assert rows["condition"][-1] == "cycles/s beside the engine |"
    assert float(rows["idle"][-1].rstrip(" |")) == 0
    for cond in ("held 60%", "held 0%"):
        assert float(rows[cond][-1].rstrip(" |")) > 0 and float(rows[cond][1]) > 0
        assert all(0 <= share <= 1 for share in measured[cond])
    assert measured["held 60%"][0] > 0.3 > measured["held 0%"][0]  # alone: 60% of a cycle against a loop's overhead
    assert measured["held 60%"][1] > measured["held 0%"][1]


def test_gil_switch_section_times_the_planner_thread_at_every_interval_and_puts_the_interval_back(tiny_chat_dir,
                                                                                                 monkeypatch):
    """The gil_switch section: a row per switch interval and idle's, the planner thread solved beside the engine at
    each interval, the engine's aten calls per step are counted, and the process's switch interval is what it was
    before (3 rounds: the last block run is a thread's, at its own interval)."""
    bench = load_benchmark("planner")
    seen, real_loop = set(), bench._solve_loop

    def loop(*args):
        seen.add(round(sys.getswitchinterval() * 1e6))  # microseconds: Python keeps the interval in them
        real_loop(*args)

    monkeypatch.setattr(bench, "_solve_loop", loop)
    out: list[str] = []
    original = sys.getswitchinterval()
    sys.setswitchinterval(5e-4)  # below the 1 ms the engine's KV copy thread sets where it is longer
    try:
        calls = bench.bench_gil_switch(3, 2, 0, 1, out, model=str(tiny_chat_dir), intervals=(1e-3, 1e-5), size=(2, 8))
        assert sys.getswitchinterval() == 5e-4
    finally:
        sys.setswitchinterval(original)
    assert seen == {1000, 10}
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in out if line.startswith("| ")}
    threads = ("thread 2x8, switch interval 1000 us", "thread 2x8, switch interval 10 us")
    assert set(rows) == {"condition", "idle", *threads}
    assert float(rows["idle"][-1].rstrip(" |")) == 0
    for cond in threads:
        assert float(rows[cond][-1].rstrip(" |")) > 0 and float(rows[cond][1]) > 0
    assert calls > 0 and f"dispatches {calls} aten calls" in out[0]


def test_gil_grain_section_times_each_step_alone_and_beside_the_planner_thread(monkeypatch):
    """The gil_grain section: the synthetic steps split their rows evenly, the TorchScript one makes the same products
    as the finest step (equal results) in as many calls as the coarsest; a row per step and thread beside it (the
    planner thread, a synthetic one holding the GIL a share), each timed against the step alone, and each thread ran."""
    import torch

    bench = load_benchmark("planner")
    x, w = torch.randn(48, 16), torch.randn(16, 16)
    calls, real_mm = [], torch.mm
    with monkeypatch.context() as m:
        m.setattr(torch, "mm", lambda a, b: calls.append(a.shape[0]) or real_mm(a, b))
        bench._grain_step(x, w, 8)
        bench._grain_step(x, w, 2)
    assert calls == [6] * 8 + [24] * 2
    scripted, pieces = bench._script_products(), []
    bench._scripted_grain_step(x, w, 2, 4, lambda piece, w_, n: pieces.append(scripted(piece, w_, n)))
    assert [len(p) for p in pieces] == [4, 4] and all(p.shape == (6, 16) for group in pieces for p in group)
    got = torch.cat([p for group in pieces for p in group])
    assert torch.equal(got, torch.cat([real_mm(piece, w) for piece in x.chunk(8)]))
    out: list[str] = []
    with pytest.raises(ValueError, match="split evenly"):
        bench.bench_gil_grain(2, 2, 0, 1, out, calls=(16, 3), rows=64, dim=32, size=(2, 8))
    result = bench.bench_gil_grain(2, 2, 0, 1, out, calls=(16, 2), rows=64, dim=32, size=(2, 8), held=(0.5,))
    beside = ("the planner thread", "a thread holding the GIL 50%")
    assert set(result) == {(label, kind) for label in ("16", "2", "2, TorchScript") for kind in beside}
    assert all(0 < lo and math.isfinite(hi) for _, lo, hi in result.values())
    rows = [line.split(" | ") for line in out if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0].lstrip("| "), r[2]) for r in rows] == [(label, kind) for label in ("16", "2", "2, TorchScript")
                                                         for kind in beside]
    assert [r[1] for r in rows] == ["4", "4", "32", "32", "4", "4"]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    for kind in beside:  # each thread ran beside the steps
        assert sum(float(r[-1].rstrip(" |")) for r in rows if r[2] == kind) > 0
