"""The background planner: a planner process gives the plan an inline solve gives, takes the controller's
read-only snapshot, and a dead process costs a warning and a thread, never a plan."""

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from types import MappingProxyType

import pytest
from processes import process_alive, process_stat
from scripted_policies import StallsInPlannerProcess

from orbitflow.plan import CostModel, PlanRequest
from orbitflow.policies.base import PlanContext, Policy
from orbitflow.policies.orbitflow import OrbitFlowPolicy
from orbitflow.runtime import background_planner
from orbitflow.runtime.background_planner import BackgroundPlanner, ClockedPlanner, resolve_mode
from orbitflow.runtime.controller import Controller


def wait_until(condition, timeout_s: float = 60.0) -> bool:
    """Poll ``condition`` every 10 ms until it holds (True) or ``timeout_s`` passed (False): tests wait on the
    event they need, not for a fixed time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def context(**kw):
    return PlanContext(num_layers=8, block_size=16, capacity_blocks=60, cost_model=CostModel([1e-3] * 8, 2e4),
                       window=(2, 6), **kw)


def batch(extra=0):
    return [PlanRequest("a", 12, 20 + extra, None, 0.0, 0.02), PlanRequest("b", 9, 15 + extra, None, 0.0, 0.02)]


def test_resolve_mode(monkeypatch):
    assert resolve_mode(True) == "thread" and resolve_mode(False) == "off"
    monkeypatch.setattr(background_planner.os, "cpu_count", lambda: 2)
    assert resolve_mode("auto") == "thread"
    monkeypatch.setattr(background_planner.os, "cpu_count", lambda: 16)
    assert resolve_mode("auto") == "process"
    assert resolve_mode("thread") == "thread"
    with pytest.raises(ValueError, match="--background-planner"):
        resolve_mode("gpu")


def test_process_solves_what_an_inline_solve_solves():
    policy = OrbitFlowPolicy()
    ctx = context(previous=MappingProxyType({"a": 2, "b": 3}))  # the controller's read-only snapshot
    inline = policy.plan(batch(), ctx)
    planner = BackgroundPlanner(policy, "process")
    try:
        plan, solve_s = planner.submit(batch(), ctx).result(timeout=120)
    finally:
        planner.close()
    assert inline.feasible and plan.feasible
    assert plan.distances == inline.distances and plan.predicted_step_s == inline.predicted_step_s
    assert solve_s > 0


def test_a_reply_that_has_arrived_makes_its_future_done_without_a_read():
    """The controller asks done() whether a solve ahead has finished; a process future said False until someone read
    the pipe, so every expiry ran the old plan to the end of its window and its solve was thrown away."""
    planner = BackgroundPlanner(OrbitFlowPolicy(), "process")
    try:
        future = planner.submit(batch(), context())
        assert wait_until(future.done) and future.result(timeout=0)[0].feasible
    finally:
        planner.close()


class _Unpicklable(OrbitFlowPolicy):
    """A library user's policy holding a lock: it cannot cross to a planner process."""

    def __init__(self):
        super().__init__()
        import threading

        self.lock = threading.Lock()


def test_a_policy_that_does_not_pickle_solves_ahead_on_a_thread(caplog):
    """A process planner (auto's choice on 4+ cores) pickles the policy when it starts: one that does not pickle
    raised out of the engine's constructor; it costs a warning and a planner thread."""
    planner = BackgroundPlanner(_Unpicklable(), "process")
    try:
        assert planner.mode == "thread" and "did not start" in caplog.text
        plan, _ = planner.submit(batch(), context()).result(timeout=60)
        assert plan.feasible
    finally:
        planner.close()


def test_uncollected_results_do_not_answer_later_submissions():
    """A solve whose batch changed is never collected; the next submission must get its own plan."""
    planner = BackgroundPlanner(OrbitFlowPolicy(), "process")
    try:
        planner.submit(batch(), context())  # dropped: nobody reads it
        small = [PlanRequest("c", 2, 30, None, 0.0, 0.02)]
        plan, _ = planner.submit(small, context()).result()
        assert tuple(plan.request_ids) == ("c",) and len(plan.distances) == 1
    finally:
        planner.close()


def test_the_context_crosses_the_pipe_only_when_it_changes(monkeypatch):
    """The controller replaces its snapshot when an input changes; the same snapshot is not pickled again, and a
    new one reaches the process (its plans follow the new capacity)."""
    planner = BackgroundPlanner(OrbitFlowPolicy(), "process")
    sent = []
    real_send = planner._pool._conn.send_bytes
    monkeypatch.setattr(planner._pool._conn, "send_bytes",
                        lambda blob: (sent.append(pickle.loads(blob)[2]), real_send(blob))[1])
    try:
        roomy, tight = replace(context(), capacity_blocks=1000), replace(context(), capacity_blocks=130)
        first, _ = planner.submit(batch(), roomy).result()
        again, _ = planner.submit(batch(1), roomy).result()
        changed, _ = planner.submit(batch(1), tight).result()
        assert sent[0] is not None and sent[1] is None and sent[2] is not None
        assert first.distances == again.distances == (None, None)  # everything fits: nothing offloaded
        assert changed.distances == OrbitFlowPolicy().plan(batch(1), tight).distances != again.distances
    finally:
        planner.close()


def test_a_failing_solve_raises_in_the_engine_and_the_process_lives_on():
    planner = BackgroundPlanner(OrbitFlowPolicy(), "process")
    try:
        with pytest.raises(ValueError, match="window"):
            planner.submit(batch(), replace(context(), window=(0, 0))).result()  # the planner rejects it
        plan, _ = planner.submit(batch(), context()).result()
        assert plan.feasible
    finally:
        planner.close()


def test_controller_solves_ahead_in_a_process_and_survives_its_death():
    """The process dies with a solve in flight: the step solves inline, and a thread solves ahead from then on.
    The solve is written while the process lives and never answered (it stalls there), so the read sees the death
    however the OS schedules the kill
    (a death the write sees: test_a_process_that_died_between_solves_costs_no_step)."""
    controller = Controller(StallsInPlannerProcess(), context(), background="process")
    try:
        now = controller.solve(batch(), step=0, trigger="batch")
        controller.solve_ahead(batch(1), step_next=1)
        ahead = controller.solve(batch(1), step=1, trigger="expiry")
        assert controller.records[-1].background and ahead.feasible
        assert ahead.distances == OrbitFlowPolicy().plan(batch(1), controller.ctx).distances
        stalled = [replace(r, request_id="stall") if r.request_id == "a" else r for r in batch(2)]
        controller.solve_ahead(stalled, step_next=2)  # written: the process lives until the kill below
        proc = controller._background._pool._proc
        os.kill(proc.pid, signal.SIGKILL)  # the planner process dies in that solve
        proc.join(timeout=30)
        after = controller.solve(stalled, step=2, trigger="expiry")
        assert after.feasible and not controller.records[-1].background  # solved inline instead
        assert after.distances == OrbitFlowPolicy().plan(stalled, controller.ctx).distances
        assert controller._background.mode == "thread"  # and on a thread from now on
        controller.solve_ahead(batch(3), step_next=3)
        controller.solve(batch(3), step=3, trigger="expiry")
        assert controller.records[-1].background
        assert now.feasible
    finally:
        controller.close()


def test_a_dropped_planner_does_not_leave_its_process_behind():
    """An engine dropped without close() must not leave a planner process behind (the planner's finalizer closes
    the pipe and the process exits on its own; this guards against anything that would keep the planner alive)."""
    import gc
    import multiprocessing

    planner = BackgroundPlanner(OrbitFlowPolicy(), "process")
    planner.submit(batch(), context()).result()
    pids = {planner._pool.pid}
    assert None not in pids
    del planner
    gc.collect()
    assert wait_until(lambda: not pids & {p.pid for p in multiprocessing.active_children()}, 30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")
def test_a_killed_engine_does_not_leave_its_planner_process_behind():
    """An engine's process killed outright (SIGKILL: no finalizer, no atexit) must not leave its planner process
    behind: the planner, waiting for its next solve, sees its pipe end and exits."""
    script = textwrap.dedent("""
        import sys
        from orbitflow.plan import CostModel, PlanRequest
        from orbitflow.policies.base import PlanContext
        from orbitflow.policies.orbitflow import OrbitFlowPolicy
        from orbitflow.runtime.background_planner import PlannerProcess
        planner = PlannerProcess(OrbitFlowPolicy())
        ctx = PlanContext(num_layers=8, block_size=16, capacity_blocks=60, cost_model=CostModel([1e-3] * 8, 2e4))
        assert planner.submit([PlanRequest("a", 12, 20, None, 0.0, 0.02)], ctx).result(timeout=120)[0].feasible
        print(planner.pid, flush=True)  # solved once: the planner waits for its next solve now
        sys.stdin.read()
    """)
    engine = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        pid = int(engine.stdout.readline())
        assert process_alive(pid) and process_stat(pid)[1] == engine.pid
    finally:
        engine.kill()
        engine.wait()
    assert wait_until(lambda: not process_alive(pid), 30), f"planner process {pid} outlived its killed engine"


def test_a_process_that_died_between_solves_costs_no_step():
    """The process dies between two solves: solve_ahead must not raise into the step."""

    controller = Controller(OrbitFlowPolicy(), context(), background="process")
    try:
        controller.solve(batch(), step=0, trigger="batch")
        controller.solve_ahead(batch(1), step_next=1)
        controller.solve(batch(1), step=1, trigger="expiry")
        proc = controller._background._pool._proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)  # dead and reaped before the next submission
        assert not proc.is_alive()
        controller.solve_ahead(batch(2), step_next=2)  # the write fails: a thread takes over
        assert controller.solve(batch(2), step=2, trigger="expiry").feasible
        assert controller.records[-1].background and controller._background.mode == "thread"
    finally:
        controller.close()


def test_replies_nobody_reads_do_not_fill_the_pipe():
    """A controller whose batch keeps changing drops every solve it submitted ahead. The unread replies must not
    pile up until both ends of the pipe block (the engine would hang in submit)."""
    import threading

    planner = BackgroundPlanner(OrbitFlowPolicy(), "process")
    small, ctx = [PlanRequest("c", 2, 30, None, 0.0, 0.02)], context()
    done = threading.Event()

    def engine():
        for _ in range(2500):  # ~1 KB each way per solve: more than the socket buffers hold
            planner.submit(small, ctx)
        done.set()

    try:
        threading.Thread(target=engine, daemon=True).start()
        assert done.wait(120), "submit blocked: the unread replies filled the pipe"
        plan, _ = planner.submit(batch(), ctx).result(timeout=60)
        assert plan.feasible
    finally:
        planner.close()


class _Scripted(Policy):
    """A policy for the planner process's failure paths: sleeps (first creating ``started``, a file the test can wait
    for, if given), then raises ``_TwoArgError`` if told to, or plans."""

    def __init__(self, sleep_s: float = 0.0, unreadable_error: bool = False, only_for: str | None = None,
                 started: str | None = None):
        self.sleep_s, self.unreadable_error, self.only_for = sleep_s, unreadable_error, only_for
        self.started = started

    def plan(self, requests, ctx):
        if self.only_for is None or any(q.request_id == self.only_for for q in requests):
            if self.started is not None:
                open(self.started, "w").close()
            time.sleep(self.sleep_s)
        if self.unreadable_error:
            raise _TwoArgError(1, 2)
        return OrbitFlowPolicy().plan(requests, ctx)


class _TwoArgError(Exception):
    """Pickles in the planner process, but does not unpickle (its one pickled arg is not two)."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def test_a_timeout_is_not_a_death():
    planner = BackgroundPlanner(_Scripted(sleep_s=1.5), "process")
    try:
        slow = planner.submit(batch(), context())
        with pytest.raises(TimeoutError):
            slow.result(timeout=0.2)
        plan, _ = slow.result(timeout=60)  # the same solve, still coming
        assert plan.feasible and planner.mode == "process"
        assert planner.submit(batch(), context()).result(timeout=60)[0].feasible
    finally:
        planner.close()


def test_a_reply_that_does_not_unpickle_fails_its_own_solve_only():
    planner = BackgroundPlanner(_Scripted(unreadable_error=True), "process")
    try:
        with pytest.raises(RuntimeError, match="could not be read"):
            planner.submit(batch(), context()).result(timeout=60)
        planner.submit(batch(), context())  # dropped: its reply is read by the next submission
        # the dropped reply is waiting in the pipe: the next submission reads it first
        assert wait_until(lambda: planner._pool._conn.poll(0))
        nxt = planner.submit(batch(), context())  # raised the unpickling error before the fix
        with pytest.raises(RuntimeError, match="could not be read"):
            nxt.result(timeout=60)
    finally:
        planner.close()


def test_inputs_that_do_not_pickle_fail_their_own_solve_only():
    planner = BackgroundPlanner(OrbitFlowPolicy(), "process")
    try:
        bad = [PlanRequest(lambda: 0, 2, 30, None, 0.0, 0.02)]  # an id that does not pickle
        failed = planner.submit(bad, context())  # raised from submit before the fix
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            failed.result(timeout=60)
        assert planner.submit(batch(), context()).result(timeout=60)[0].feasible
    finally:
        planner.close()


def _lock_is_free(lock) -> bool:
    """Whether no other thread holds ``lock`` (taken and given back at once if so)."""
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


def test_cancel_and_a_second_thread_leave_the_pipe_in_step():
    """A submitted solve runs: cancel() says no. A thread waiting on a slow solve does not hold back another
    thread's submission, and each gets its own plan."""
    import threading

    planner = BackgroundPlanner(_Scripted(sleep_s=1.0), "process")
    try:
        first = planner.submit(batch(), context())
        assert not first.cancel()
        waiter = threading.Thread(target=first.result, kwargs={"timeout": 60})
        waiter.start()
        assert wait_until(lambda: not _lock_is_free(planner._pool._recv_lock))  # the waiter is reading now
        start = time.monotonic()
        second = planner.submit([PlanRequest("c", 2, 30, None, 0.0, 0.02)], context())
        assert time.monotonic() - start < 0.5  # not behind the solve in flight
        waiter.join(60)
        assert tuple(first.result(timeout=0)[0].request_ids) == ("a", "b")
        assert tuple(second.result(timeout=60)[0].request_ids) == ("c",)
    finally:
        planner.close()


def test_close_does_not_wait_for_a_solve_in_flight(tmp_path):
    started = tmp_path / "solving"
    planner = BackgroundPlanner(_Scripted(sleep_s=30, only_for="slow", started=str(started)), "process")
    pool = planner._pool
    assert planner.submit(batch(), context()).result(timeout=60)[0].feasible  # the process is up
    planner.submit([PlanRequest("slow", 2, 30, None, 0.0, 0.02)], context())
    assert wait_until(started.exists, 30)  # solving it now (a fixed sleep could close before the solve began)
    start = time.monotonic()
    planner.close()
    assert time.monotonic() - start < 3 and not pool._proc.is_alive()


def test_a_simulated_solve_charged_past_the_wait_times_out_on_the_clock_as_in_the_engine():
    """The simulator's planner answers at once but is ready only once the clock reaches its charged end: a step that
    waits less than that must give up after the wait, on the clock, as a step of the engine gives up on its planner;
    the planner is free again once restarted."""
    from orbitflow.runtime.clock import VirtualClock

    clock = VirtualClock()
    planner = ClockedPlanner(OrbitFlowPolicy(), clock, lambda wall_s: 40.0)  # every solve charged 40 s
    future = planner.submit(batch(), context())
    with pytest.raises(TimeoutError):
        future.result(timeout=30.0)
    assert clock.now() == pytest.approx(30.0)
    planner.restart()
    plan, _ = planner.submit(batch(), context()).result(timeout=None)  # not queued behind the one given up on
    assert plan.feasible and clock.now() == pytest.approx(70.0)
