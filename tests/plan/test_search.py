"""The branch and bound's parallel search (BranchAndBound._search_parallel): the serial search's optimum, a certified
bound when a deadline stops it, and the serial path wherever it does not apply; and a search watched and stopped from
another thread (SearchControl), serial or parallel."""

import math
import threading
import time

import numpy as np
import pytest
from plan.test_planner import brute_force_case, plan_matches_brute_force, random_case

import orbitflow.plan.search as search
from orbitflow.plan import Planner, SearchControl
from orbitflow.plan import compiled as cc

pytestmark = pytest.mark.skipif(not cc.HAVE_NUMBA, reason="the parallel search runs the compiled kernels")


class _Splits(list):
    """The tasks of each search that split, and ``gifts``: how many times a search gave tasks away (the split
    included; the rest: a busy thread's work taken by a waiting one)."""

    gifts = 0


@pytest.fixture(autouse=True)
def splits(monkeypatch):
    """Searches split after 3 nodes (not 4096) and swap incumbents every 3 nodes, so the small batches below run on
    threads too, hundreds of swaps each."""
    monkeypatch.setattr(search, "PARALLEL_AFTER", 3)
    monkeypatch.setattr(search, "SYNC_NODES", 3)
    calls = _Splits()
    split = search.BranchAndBound._search_parallel

    def counted(self, state, tasks):
        calls.append(len(tasks))
        return split(self, state, tasks)

    monkeypatch.setattr(search.BranchAndBound, "_search_parallel", counted)
    donate = search.BranchAndBound._donate

    def counted_donate(self, state):
        tasks = donate(self, state)
        if tasks:
            calls.gifts += 1
        return tasks

    monkeypatch.setattr(search.BranchAndBound, "_donate", counted_donate)
    return calls


def _solve(cm, cap, reqs, threads, **kw):
    kw.setdefault("node_limit", None)
    pl = Planner(cm, cap, alpha=1.0, window=(2, 10), check_better=False, compiled=True, threads=threads, **kw)
    return pl.plan(reqs)


def _solved_feasible(rng, count):
    """Of ``count`` random batches of 8 requests x 24 layers, the feasible ones, each with its proven serial optimum."""
    for _ in range(count):
        cm, cap, reqs = random_case(rng, 8, 24)
        exact = _solve(cm, cap, reqs, 1)
        assert exact.stats.exact
        if exact.feasible:
            yield cm, cap, reqs, exact


def _key(plan, reqs):
    """What the search optimises: (step latency, blocks moved per step)."""
    if not plan.feasible:
        return None
    by_id = {q.request_id: q for q in reqs}
    counts = plan.placement.offload_counts()
    b0 = [max(by_id[i].blocks_per_layer, -(-by_id[i].tokens // 16)) for i in plan.request_ids]  # step 0's blocks
    return plan.predicted_step_s, sum(b * int(c) for b, c in zip(b0, counts))


@pytest.mark.parametrize("seed", range(4))
def test_parallel_search_is_exact_vs_brute_force(seed, splits):
    rng = np.random.default_rng(700 + seed)
    for threads in rng.integers(2, 4, 8):
        pl, reqs, n_layers = brute_force_case(rng, min_req=3, min_layers=6, compiled=True, node_limit=None,
                                              threads=int(threads))
        got, _ = plan_matches_brute_force(pl, reqs, n_layers)
        assert got.stats.exact
    assert splits  # some of them went on with threads


@pytest.mark.parametrize("seed", range(3))
def test_parallel_search_finds_the_serial_optimum_while_threads_swap_incumbents(seed, splits):
    rng = np.random.default_rng(800 + seed)
    for _ in range(6):
        cm, cap, reqs = random_case(rng, int(rng.integers(5, 8)), int(rng.integers(12, 25)))
        serial = _solve(cm, cap, reqs, 1)
        assert serial.stats.exact
        for threads in (2, 3):
            par = _solve(cm, cap, reqs, threads)
            assert par.stats.exact and par.feasible == serial.feasible
            if serial.feasible:
                lat, moved = _key(par, reqs)
                assert lat == pytest.approx(serial.predicted_step_s, rel=1e-12, abs=0)
                assert moved == _key(serial, reqs)[1]
                assert par.stats.lower_bound_s == par.predicted_step_s
            # each task searches its own subtree only: the threads together visit about what one thread does, not a
            # whole tree per task
            assert par.stats.nodes + par.stats.leaves <= 2 * (serial.stats.nodes + serial.stats.leaves) + 100
    assert len(splits) >= 6


class _BusyThreadWaitsForAHungryOne(search._Shared):
    """Scripted work stealing: a busy thread's first look at whether another waits (``hungry``, at its first pause)
    waits itself until the other threads have taken every task and one waits for more, so the busy thread then
    gives away part of its subtree whatever the scheduling; and after its first gift it waits until another thread
    took one of those tasks (else, holding the GIL, it could finish its subtree and take them back itself). Counts the
    given tasks another thread took (``stolen``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.looked, self.gave, self.donor, self.stolen = False, False, {}, 0
        searches.append(self)

    def hungry(self) -> bool:
        if not self.looked:
            self.looked = True
            deadline = time.perf_counter() + 10
            while not (super().hungry() or self.stop or self.finished) and time.perf_counter() < deadline:
                time.sleep(1e-4)
        return super().hungry()

    def give(self, tasks):
        with self.lock:
            self.donor.update((id(task), threading.get_ident()) for task in tasks)
            first, self.gave = bool(tasks) and not self.gave, self.gave or bool(tasks)
        super().give(tasks)
        deadline = time.perf_counter() + 10
        while first and not (self.stolen or self.stop or self.finished) and time.perf_counter() < deadline:
            time.sleep(1e-4)

    def take(self):
        task = super().take()
        with self.lock:
            if task is not None and self.donor.get(id(task), threading.get_ident()) != threading.get_ident():
                self.stolen += 1
        return task


searches: list[_BusyThreadWaitsForAHungryOne] = []


def test_a_thread_that_runs_out_of_tasks_takes_work_from_a_busy_one(monkeypatch, splits):
    monkeypatch.setattr(search, "_Shared", _BusyThreadWaitsForAHungryOne)
    searches.clear()
    rng = np.random.default_rng(801)
    for _ in range(6):
        cm, cap, reqs = random_case(rng, 7, 24)
        serial = _solve(cm, cap, reqs, 1)
        par = _solve(cm, cap, reqs, 2)
        assert par.stats.exact and par.feasible == serial.feasible
        if par.feasible:
            assert _key(par, reqs) == pytest.approx(_key(serial, reqs), rel=1e-12, abs=0)
        if searches and searches[-1].stolen:  # a waiting thread took a subtree a busy one gave away
            return
    pytest.fail("no thread took work from a busy one")


def test_a_deadline_stops_every_thread_with_a_certified_bound(splits):
    cut = 0
    for cm, cap, reqs, exact in _solved_feasible(np.random.default_rng(3), 6):
        par = _solve(cm, cap, reqs, 2, time_limit_s=2e-3)
        assert par.feasible
        assert par.predicted_step_s >= exact.predicted_step_s * (1 - 1e-12)
        # no plan is faster than the certified bound, which may not exceed the plan it certifies
        assert par.stats.lower_bound_s <= exact.predicted_step_s * (1 + 1e-12)
        assert par.stats.lower_bound_s <= par.predicted_step_s
        if not par.stats.exact:
            cut += 1
            assert par.stats.gap == pytest.approx(
                (par.predicted_step_s - par.stats.lower_bound_s) / par.predicted_step_s)
    assert cut > 0 and splits  # the deadline stopped some searches that had split


def test_a_search_stopped_as_it_splits_certifies_every_subtree_it_left(monkeypatch, splits):
    # the deadline has passed for the threads the split starts: each stops at the root of the first task it takes
    # (the first one to ask gets one), the tasks left are never started, and the paused search finishes its own
    # subtree; the bound must cover every task
    split = search.BranchAndBound._search_parallel

    def late(self, state, tasks):
        self.deadline = self.improve_deadline = time.perf_counter() - 1.0  # what the new threads' states read
        return split(self, state, tasks)

    work = search.BranchAndBound._work

    def after_a_take(self, state, shared, resume):  # the paused search goes on once another thread took a task
        deadline = time.monotonic() + 5
        while resume and shared.next == 0 and time.monotonic() < deadline:
            time.sleep(1e-4)
        work(self, state, shared, resume)

    monkeypatch.setattr(search.BranchAndBound, "_work", after_a_take)

    monkeypatch.setattr(search.BranchAndBound, "_search_parallel", late)
    collect = search.BranchAndBound._collect
    left = []  # per split: the least bound of the tasks stopped at their root, of those never taken, the certificate

    def collected(self, states, shared):
        collect(self, states, shared)
        if shared is None:
            return
        bound = dict(shared.tasks)  # each task's subtree, by its prefix, and its bound
        at_root = [bound[tuple(int(c) for c in args[4][: ist[cc.PREFIX]])] for ist, _, _, args in states
                   if ist[cc.DONE] and ist[cc.DEPTH] == 0 and ist[cc.PHASE] == cc.ENTER]
        left.append((min(at_root, default=math.inf), min((lb for _, lb in shared.tasks[shared.next:]),
                                                         default=math.inf), self.open_lb))

    monkeypatch.setattr(search.BranchAndBound, "_collect", collected)
    rng = np.random.default_rng(21)
    checked = 0
    for _ in range(16):
        cm, cap, reqs = random_case(rng, int(rng.integers(5, 8)), int(rng.integers(8, 17)))
        exact = _solve(cm, cap, reqs, 1)
        stopped = _solve(cm, cap, reqs, 3, time_limit_s=60.0)
        if stopped.stats.exact or not stopped.feasible:  # ended before it split, or stopped before any plan
            continue
        checked += 1
        assert stopped.stats.lower_bound_s <= exact.predicted_step_s * (1 + 1e-12) <= stopped.predicted_step_s * (
            1 + 2e-12)
    assert checked >= 6
    assert any(math.isfinite(taken) for taken, _, _ in left) and any(math.isfinite(rest) for _, rest, _ in left)
    assert all(open_lb <= min(taken, rest) for taken, rest, open_lb in left)


def test_without_a_kernel_clock_each_thread_checks_the_deadline_within_a_few_nodes(monkeypatch, splits):
    """Where the kernels cannot read the clock, each thread pauses to look at it: the first time after
    ``PACED_FIRST`` nodes, then as often as ``paced_chunk`` says (not every ``SYNC_NODES``: at (16, 80) that ran a
    50 ms budget 45% over). The deadline passes as the search splits; no thread runs far past it. It pauses from the
    first dive on, but splits only past ``PARALLEL_AFTER`` nodes, as with a clock."""
    monkeypatch.setattr(cc, "HAVE_CLOCK", False)
    monkeypatch.setattr(search, "SYNC_NODES", 1024)
    monkeypatch.setattr(search, "PARALLEL_AFTER", 20)
    split, collect, ran = search.BranchAndBound._search_parallel, search.BranchAndBound._collect, []

    def late(self, state, tasks):
        self.deadline = self.improve_deadline = time.perf_counter() - 1.0
        self.split_nodes = int(state[0][cc.NODES])
        assert self.split_nodes - self.nodes >= search.PARALLEL_AFTER  # paused earlier, it splits no earlier
        return split(self, state, tasks)

    def collected(self, states, shared):
        if shared is not None:  # nodes each thread ran after the split
            ran.append([int(states[0][0][cc.NODES]) - self.split_nodes]
                       + [int(ist[cc.NODES]) - self.nodes for ist, *_ in states[1:]])
        collect(self, states, shared)

    monkeypatch.setattr(search.BranchAndBound, "_search_parallel", late)
    monkeypatch.setattr(search.BranchAndBound, "_collect", collected)
    rng = np.random.default_rng(4)
    for _ in range(8):
        cm, cap, reqs = random_case(rng, 8, 24)
        _solve(cm, cap, reqs, 3, time_limit_s=30.0)
    assert ran and all(n <= search.PACED_FIRST + 8 + 3 for nodes in ran for n in nodes), ran


def test_threads_leave_a_node_budgeted_search_serial(splits):
    rng = np.random.default_rng(11)
    cm, cap, reqs = random_case(rng, 6, 16)
    one = _solve(cm, cap, reqs, 1, node_limit=50)
    two = _solve(cm, cap, reqs, 2, node_limit=50)
    assert (one.stats.nodes, one.stats.leaves) == (two.stats.nodes, two.stats.leaves)
    assert _key(one, reqs) == _key(two, reqs)
    assert not splits


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_threads_must_be_a_positive_integer(bad):
    cm, cap, reqs = random_case(np.random.default_rng(0), 2, 4)
    with pytest.raises(ValueError, match="threads"):
        Planner(cm, cap, threads=bad)


def test_no_feasible_plan_is_proven_by_threads_too(splits):
    cm, cap, reqs = random_case(np.random.default_rng(149), 6, 12)  # no plan is feasible, and proving it takes a search
    one, two = (Planner(cm, cap * 0.5, alpha=0.0, window=(2, 10), check_better=False, compiled=True, node_limit=None,
                        threads=threads).plan(reqs) for threads in (1, 2))
    assert not one.feasible and not two.feasible and one.stats.nodes > 30
    assert two.stats.exact and two.victims == one.victims
    assert splits  # the second search did go on with threads


def _solve_into(box: dict, *args) -> None:
    """``_solve(*args)``, its RuntimeError kept in ``box["error"]`` (run on a thread that the test can time out)."""
    try:
        _solve(*args)
    except RuntimeError as exc:
        box["error"] = exc


def test_a_thread_that_fails_stops_the_others_and_the_error_reaches_the_caller(monkeypatch, splits):
    rng = np.random.default_rng(800)
    work = search.BranchAndBound._work

    def failing(self, state, shared, resume):
        if resume:  # the search that split fails; the others wait for tasks once theirs are done
            raise RuntimeError("kernel failed")
        work(self, state, shared, resume)

    monkeypatch.setattr(search.BranchAndBound, "_work", failing)
    failed = 0
    for _ in range(6):
        cm, cap, reqs = random_case(rng, 7, 20)
        before = len(splits)
        box = {}
        runner = threading.Thread(target=_solve_into, args=(box, cm, cap, reqs, 3), daemon=True)
        runner.start()
        runner.join(30)
        assert not runner.is_alive(), "the solve hangs: a thread waits for a task that will never come"
        error = box.get("error")
        if error is None:
            assert len(splits) == before  # it ended before it split: nothing to fail
            continue
        assert str(error) == "kernel failed" and len(splits) > before
        failed += 1
    assert failed


def test_threads_share_their_incumbent_and_whether_the_search_still_gains():
    shared = search._Shared([], (1.0, 5.0), np.zeros(2, dtype=np.int64), threads=2)
    a_ist, b_ist = np.zeros(cc.N_IST, dtype=np.int64), np.zeros(cc.N_IST, dtype=np.int64)
    a_fst, b_fst = np.zeros(cc.N_FST), np.zeros(cc.N_FST)
    a_fst[cc.BEST_LAT], a_fst[cc.BEST_MOVED] = 0.5, 9.0  # thread a found a faster plan, after its first dive
    a_ist[cc.GAINED] = 1
    shared.swap(a_fst, np.array([3, 4]), a_ist)
    assert shared.best_key == (0.5, 9.0) and shared.best_k.tolist() == [3, 4]
    b_fst[cc.BEST_LAT], b_fst[cc.BEST_MOVED] = 0.9, 1.0  # thread b's own is slower: it takes a's key
    shared.swap(b_fst, np.array([7, 7]), b_ist)
    assert (b_fst[cc.BEST_LAT], b_fst[cc.BEST_MOVED]) == (0.5, 9.0) and shared.best_k.tolist() == [3, 4]
    assert b_ist[cc.GAINED] == 1  # ... and searches on to the plan's deadline with it


def test_compute_tables_are_memoised_by_value_and_hold_the_direct_floats():
    """compute_tables: one entry per compute (equal values share it, whatever the array), holding exactly what the
    search computed from the step's compute before (sums, suffix sums, the separable offsets, the chain gaps)."""
    rng = np.random.default_rng(5)
    for n_layers in (1, 4, 32):
        comp = rng.uniform(1e-3, 2e-3, n_layers)
        ct = search.compute_tables(comp, n_layers)
        assert search.compute_tables(comp.copy(), n_layers) is ct
        assert search.compute_tables(comp * 1.5, n_layers) is not ct
        t = search.candidate_tables(n_layers)
        cum = np.concatenate(([0.0], np.cumsum(comp)))
        gaps = cum[t.gap_last] - cum[t.gap_first]
        gaps[t.counts[:, None] <= np.arange(gaps.shape[1])[None, :]] = np.inf
        assert np.array_equal(ct.comp0, comp) and ct.comp0_list == tuple(comp.tolist())
        assert ct.total == float(comp.sum()) and ct.least == float(comp.min())
        assert np.array_equal(ct.suffix, cc.tail(comp)) and np.array_equal(ct.cum, cum)
        assert np.array_equal(ct.sep_off, float(comp.sum()) - t.sep.between @ cum) and np.array_equal(ct.gaps, gaps)
        assert ct.comp0.flags.writeable and ct.suffix.flags.c_contiguous  # the kernels' signatures


# ---- SearchControl ------------------------------------------------------------------------------------------------
class _StopAfter(SearchControl):
    """Asks the search to stop once it has reported ``after`` nodes (at a look, so at a known point of the search)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    @property
    def stopped(self) -> bool:
        return self.nodes >= self.after


def _watched(cm, cap, reqs, threads, control, compiled=True):
    """``_solve``'s search, watched by ``control``."""
    pl = Planner(cm, cap, alpha=1.0, window=(2, 10), check_better=False, compiled=compiled, threads=threads,
                 node_limit=None)
    return pl.plan(reqs, control=control)


def _certifies(stopped, exact) -> None:
    """A stopped search's plan, and the bound it certifies, against the same batch's proven optimum."""
    assert not stopped.stats.exact and stopped.feasible
    assert stopped.stats.lower_bound_s <= exact.predicted_step_s * (1 + 1e-12)
    assert exact.predicted_step_s <= stopped.predicted_step_s * (1 + 1e-12)
    assert stopped.stats.gap == pytest.approx(
        (stopped.predicted_step_s - stopped.stats.lower_bound_s) / stopped.predicted_step_s)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_search_asked_to_stop_before_it_starts_returns_its_best_plan_with_a_certified_bound(compiled):
    # stopped before it starts: it runs its first dive (never stopped), then ends at its first look
    rng = np.random.default_rng(11)
    cut = 0
    for _ in range(8):
        cm, cap, reqs = random_case(rng, 8, 24)
        exact = _watched(cm, cap, reqs, 1, None, compiled)
        if not exact.feasible:
            continue
        control = SearchControl()
        control.stop()
        stopped = _watched(cm, cap, reqs, 1, control, compiled)
        assert stopped.stats.exact or (
            stopped.stats.nodes + stopped.stats.leaves < exact.stats.nodes + exact.stats.leaves)
        if stopped.stats.exact:  # the whole search fit before its first look
            continue
        cut += 1
        _certifies(stopped, exact)
        assert control.best_s == stopped.predicted_step_s  # its final incumbent, reported as the search ends
    assert cut >= 3


def test_a_watched_search_nobody_stops_finds_the_plan_an_unwatched_one_does():
    rng = np.random.default_rng(12)
    for _ in range(6):
        cm, cap, reqs = random_case(rng, int(rng.integers(4, 8)), int(rng.integers(12, 25)))
        control = SearchControl()
        watched = _watched(cm, cap, reqs, 1, control)  # through BranchAndBound, looking every WATCH_S
        plain = _solve(cm, cap, reqs, 1)  # the one-call kernel
        assert watched.stats.exact and watched.feasible == plain.feasible
        assert watched.distances == plain.distances
        assert watched.stats.nodes == plain.stats.nodes and watched.stats.leaves == plain.stats.leaves
        assert control.nodes == watched.stats.nodes + watched.stats.leaves  # the main search's nodes, leaves included
        assert control.best_s == (watched.predicted_step_s if watched.feasible else math.inf)


def test_a_parallel_search_stops_on_every_thread_with_a_certified_bound(splits):
    cut = 0
    for cm, cap, reqs, exact in _solved_feasible(np.random.default_rng(13), 8):
        if exact.stats.nodes + exact.stats.leaves < 200:
            continue
        control = _StopAfter(60)  # past the split (3 nodes here), each thread looking every 3 nodes
        stopped = _watched(cm, cap, reqs, 2, control)
        if stopped.stats.exact:
            continue
        cut += 1
        _certifies(stopped, exact)
        assert stopped.stats.nodes + stopped.stats.leaves < 60 + 2 * 8 * search.SYNC_NODES + 50  # stopped soon after
    assert cut >= 3 and splits
