import contextlib
import dataclasses
import math
import os
import threading
import time

import pytest

from orbitflow.plan import CostModel, PlanRequest
from orbitflow.policies.base import PlanContext
from orbitflow.policies.fixed import FixedPlacementPolicy
from orbitflow.policies.orbitflow import OrbitFlowPolicy
from orbitflow.runtime.clock import VirtualClock
from orbitflow.runtime.controller import Controller


def context(window=(2, 5)):
    return PlanContext(num_layers=4, block_size=16, capacity_blocks=1000, cost_model=CostModel([1e-3] * 4, 1e4),
                       window=window)


def fires(controller, ids, steps):
    return [step for step in steps if controller.trigger(step, ids) is not None]


def test_replans_at_the_end_of_the_window_when_nothing_expires():
    controller = Controller(OrbitFlowPolicy(), context(window=(2, 5)), background=False)
    reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
    plan = controller.solve(reqs, step=3, trigger="batch")
    assert plan.feasible and plan.expiry_step is None and plan.window == 5
    # nothing is guaranteed past the window: the plan must be re-checked then
    assert fires(controller, ["a"], range(3, 12)) == list(range(8, 12))
    assert controller.trigger(8, ["a"]) == "expiry"
    assert controller.trigger(4, ["a", "b"]) == "batch"


def test_replans_at_the_expiry_when_it_comes_first():
    controller = Controller(OrbitFlowPolicy(), context(window=(2, 5)), background=False)
    controller.solve([PlanRequest("a", 1, 10, None, 0.0, math.inf)], step=0, trigger="batch")
    controller.plan = dataclasses.replace(controller.plan, expiry_step=2)
    assert fires(controller, ["a"], range(0, 5)) == [2, 3, 4]


def test_policies_without_expiry_replan_only_on_batch_changes():
    controller = Controller(FixedPlacementPolicy("none"), context(), background=False)
    controller.solve([PlanRequest("a", 1, 10, None, 0.0, math.inf)], step=0, trigger="batch")
    assert fires(controller, ["a"], range(0, 40)) == []


def test_on_the_virtual_clock_a_solve_the_step_waits_for_moves_the_clock():
    """The simulator charges a solve as the engine runs it: one made while the step waits (a batch change, a
    mismatch, every step, an expiry not solved ahead) holds the batch for its charged seconds."""
    clock = VirtualClock()
    controller = Controller(OrbitFlowPolicy(), context(window=(2, 5)), background=False)
    controller.charge_solve_time(clock, lambda wall_s: 0.5)  # every solve costs 0.5 s of virtual time
    reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
    first = controller.solve(reqs, step=0, trigger="batch")
    assert clock.now() == 0.5 and controller.plan is first and controller.records[-1].charged_s == 0.5
    assert controller.trigger(7, ["a"]) == "expiry"  # nothing was solved ahead: the expiry is solved now
    second = controller.solve(reqs, step=7, trigger="expiry")
    assert controller.plan is second and clock.now() == 1.0 and not controller.records[-1].background
    controller.solve(reqs, step=8, trigger="mismatch")
    assert clock.now() == 1.5 and controller.records[-1].charged_s == 0.5


def _clocked(solve_s, window=(2, 5)):
    clock = VirtualClock()
    controller = Controller(OrbitFlowPolicy(), context(window=window), background=False)
    controller.charge_solve_time(clock, lambda wall_s: solve_s)
    first = controller.solve([PlanRequest("a", 1, 10, None, 0.0, math.inf)], step=0, trigger="batch")
    controller.plan = first = dataclasses.replace(first, expiry_step=2)  # a faster plan exists from step 2
    return clock, controller, first


def test_on_the_virtual_clock_an_expiry_solved_ahead_costs_the_steps_nothing_when_it_is_done_in_time():
    clock, controller, first = _clocked(0.5)
    start = clock.now()
    assert controller.ahead_step(1) == 2
    controller.solve_ahead([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step_next=2)
    assert clock.now() == start  # solved beside the steps: nothing charged to them yet
    clock.advance(0.6)  # the step before the expiry ran 0.6 s: the solve is done
    assert controller.trigger(2, ["a"]) == "expiry"
    plan = controller.solve([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step=2, trigger="expiry")
    record = controller.records[-1]
    assert controller.plan is plan and plan is not first and clock.now() == start + 0.6
    assert record.background and record.charged_s == 0.5


def test_on_the_virtual_clock_the_lead_counts_charged_seconds_against_simulated_steps():
    clock, controller, first = _clocked(0.5)
    controller.observe(0.1, 0.1, [0.025] * 4, 10, None)  # a simulated step of 0.1 s
    controller.solve_ahead([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step_next=2)
    clock.advance(0.6)
    controller.solve([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step=2, trigger="expiry")
    assert controller.lead_steps() == 7  # ceil(1.25 * 0.5 s charged / 0.1 s), whatever the wall seconds were


def test_on_the_virtual_clock_one_planner_solves_one_request_at_a_time():
    """A solve ahead that the controller dropped still runs to its end on the engine's one planner: the next one
    queues behind it."""
    clock, controller, first = _clocked(0.5)
    controller.solve_ahead([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step_next=2)  # ready at 0.5 + 0.5
    controller.solve([PlanRequest("a", 1, 11, None, 0.0, math.inf)], step=1, trigger="mismatch")  # drops it
    assert clock.now() == 1.0
    controller.solve_ahead([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step_next=2)
    assert not controller._ahead[2].done()  # queued: ready at 1.0 + 0.5 = 1.5, not 1.0
    clock.advance(0.5)
    assert controller._ahead[2].done()


class SloCapped(OrbitFlowPolicy):
    """OrbitFlow's plans, infeasible under any SLO cap (a lone request's plan then comes from the uncapped solve)."""

    def plan(self, requests, ctx):
        plan = super().plan(requests, ctx)
        return plan if math.isinf(ctx.alpha) else dataclasses.replace(plan, feasible=False)


def test_on_the_virtual_clock_an_infeasible_plan_solved_ahead_charges_only_its_fallback_to_the_step():
    """A lone request whose plan solved ahead is infeasible gets the fastest plan that fits, solved while the step
    waits: the clock moves by that solve only, the record charges both."""
    clock = VirtualClock()
    controller = Controller(SloCapped(), context(window=(2, 5)), background=False)
    controller.charge_solve_time(clock, lambda wall_s: 0.5)
    controller.solve([PlanRequest("a", 1, 10, None, 0.0, math.inf)], step=0, trigger="batch")
    assert clock.now() == 0.5 and controller.plan is not None
    controller.solve_ahead([PlanRequest("a", 1, 11, None, 0.0, math.inf)], step_next=1)
    clock.advance(0.5)  # the solve ahead is done
    plan = controller.solve([PlanRequest("a", 1, 11, None, 0.0, math.inf)], step=1, trigger="expiry")
    record = controller.records[-1]
    assert plan.feasible and record.background and record.charged_s == 1.0 and clock.now() == 1.5


def test_on_the_virtual_clock_a_failed_solve_ahead_is_solved_again_while_the_step_waits():
    class FailingAhead(OrbitFlowPolicy):
        fail = False

        def plan(self, requests, ctx):
            if self.fail:
                raise RuntimeError("planner bug")
            return super().plan(requests, ctx)

    clock, policy = VirtualClock(), FailingAhead()
    controller = Controller(policy, context(window=(2, 5)), background=False)
    controller.charge_solve_time(clock, lambda wall_s: 0.5)
    reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
    controller.solve(reqs, step=0, trigger="batch")
    controller.plan = dataclasses.replace(controller.plan, expiry_step=2)
    policy.fail = True
    controller.solve_ahead([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step_next=2)
    policy.fail = False
    assert controller.trigger(2, ["a"]) == "expiry"  # a failed solve is done: nothing to run on for
    plan = controller.solve([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step=2, trigger="expiry")
    assert plan.feasible and not controller.records[-1].background and clock.now() == 1.0


def test_on_the_virtual_clock_a_late_solve_ahead_runs_the_old_plan_on_inside_its_window_then_waits():
    clock, controller, first = _clocked(1.0)  # first.window == 5: valid for steps 0..4
    controller.solve_ahead([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step_next=2)
    clock.advance(0.3)
    assert [controller.trigger(s, ["a"]) for s in (2, 3)] == [None, None] and controller.ran_on == 2
    clock.advance(0.3)
    assert controller.trigger(4, ["a"]) is None and controller.ran_on == 3 and controller.plan is first
    clock.advance(0.3)  # 0.9 s of the 1.0 s solve: at step 5 the old plan's window is over, so the step waits
    assert controller.trigger(5, ["a"]) == "expiry"
    late = controller.solve([PlanRequest("a", 1, 15, None, 0.0, math.inf)], step=5, trigger="expiry")
    assert math.isclose(clock.now(), 1.0 + 1.0)  # the first solve's 1.0 s, then the wait to the ahead solve's end
    assert controller.plan is late and controller.plan_step == 2 and controller.adopted_late == 1
    assert controller.records[-1].charged_s == 1.0


def test_on_the_virtual_clock_a_batch_change_drops_the_solve_ahead():
    clock, controller, first = _clocked(0.5)
    controller.solve_ahead([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step_next=2)
    clock.advance(1.0)
    assert controller.trigger(2, ["a", "b"]) == "batch"
    reqs = [PlanRequest("a", 1, 12, None, 0.0, math.inf), PlanRequest("b", 1, 10, None, 0.0, math.inf)]
    controller.solve(reqs, step=2, trigger="batch")
    assert not controller.records[-1].background and clock.now() == 0.5 + 1.0 + 0.5


def test_solve_time_off_the_clock_by_default():
    clock = VirtualClock()
    controller = Controller(OrbitFlowPolicy(), context(), background=False)
    controller.solve([PlanRequest("a", 1, 10, None, 0.0, math.inf)], step=0, trigger="batch")
    assert clock.now() == 0.0 and controller.records[-1].charged_s is None


def test_a_lone_request_solved_ahead_still_gets_the_fastest_plan_that_fits():
    """Nothing can be paused for a lone request, so an SLO it cannot meet must not make its plan infeasible,
    whether the plan was solved now or ahead on the planner thread (which used to skip this fallback and end
    the request with 'does not fit the device KV budget even fully offloaded')."""
    controller = Controller(OrbitFlowPolicy(), context(window=(2, 5)), background=True)
    try:
        slo_unmeetable = 1e-6  # a step takes 4 ms whatever the placement
        now = controller.solve([PlanRequest("a", 1, 10, None, 0.0, slo_unmeetable)], step=0, trigger="batch")
        assert now.feasible
        controller.solve_ahead([PlanRequest("a", 1, 11, None, 0.0, slo_unmeetable)], step_next=1)
        ahead = controller.solve([PlanRequest("a", 1, 11, None, 0.0, slo_unmeetable)], step=1, trigger="expiry")
        assert controller.records[-1].background
        assert ahead.feasible and ahead.distances == now.distances
    finally:
        controller.close()


def test_the_controller_loads_the_compiled_planner_when_the_engine_starts(monkeypatch):
    """A real engine's first request must not pay for numba's cache load inside its first step (it did: 0.1-0.3 s,
    which also shifted every later step of sim_vs_engine's engine runs against the simulator's)."""
    from orbitflow.plan import compiled, planner

    if not compiled.enabled(None):
        pytest.skip("no compiler: nothing to load")
    monkeypatch.setattr(planner, "_warm", False)
    calls = []
    real = planner.Planner.plan
    monkeypatch.setattr(planner.Planner, "plan", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    controller = Controller(FixedPlacementPolicy("none"), context(), background=False)
    try:
        assert planner._warm and calls  # a tiny solve ran at construction
    finally:
        controller.close()


class GatedPolicy(OrbitFlowPolicy):
    """OrbitFlow's plans, each solve held until ``gate`` is set and then ``sleep_s`` long at least."""

    def __init__(self, sleep_s: float = 0.0):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.sleep_s = sleep_s

    def plan(self, requests, ctx):
        assert self.gate.wait(60), "the test never opened the gate"
        time.sleep(self.sleep_s)
        return super().plan(requests, ctx)


def test_an_expiry_whose_solve_is_still_running_keeps_the_old_plan_inside_its_window():
    """The engine used to wait for a background solve that was not done at the expiry (the step then held the
    rest of the solve); inside the plan's window the old plan is still valid, so it runs on, and the new plan is
    adopted at the first step after the solve is done, counted from the step it was solved for."""
    policy = GatedPolicy()
    controller = Controller(policy, context(window=(2, 5)), background="thread")
    try:
        reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
        first = controller.solve(reqs, step=0, trigger="batch")
        assert first.window == 5
        controller.plan = first = dataclasses.replace(first, expiry_step=2)  # a faster plan exists from step 2
        assert controller.ahead_step(0) is None and controller.ahead_step(1) == 2
        policy.gate.clear()
        controller.solve_ahead([PlanRequest("a", 1, 12, None, 0.0, math.inf)], step_next=2)
        assert controller.ahead_step(1) is None  # one solve ahead at a time
        assert [controller.trigger(s, ["a"]) for s in (2, 3)] == [None, None] and controller.ran_on == 2
        assert controller.plan is first
        policy.gate.set()
        controller._ahead[2].result(timeout=60)
        assert controller.trigger(4, ["a"]) == "expiry"  # done: adopted now
        late = controller.solve([PlanRequest("a", 1, 14, None, 0.0, math.inf)], step=4, trigger="expiry")
        assert controller.plan is late and controller.plan_step == 2 and controller.adopted_late == 1
        assert controller.records[-1].background and controller.records[-1].step == 2
        assert late.distances == OrbitFlowPolicy().plan([PlanRequest("a", 1, 12, None, 0.0, math.inf)],
                                                        controller.ctx).distances
    finally:
        policy.gate.set()
        controller.close()


def test_past_its_window_the_old_plan_waits_for_the_solve():
    policy = GatedPolicy()
    controller = Controller(policy, context(window=(2, 5)), background="thread")
    try:
        reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
        controller.solve(reqs, step=0, trigger="batch")
        controller.plan = dataclasses.replace(controller.plan, expiry_step=4)
        policy.gate.clear()
        controller.solve_ahead(reqs, step_next=4)
        assert controller.trigger(4, ["a"]) is None  # inside the window (0..4)
        assert controller.trigger(5, ["a"]) == "expiry"  # nothing is guaranteed past it: solve (and wait)
        policy.gate.set()
        plan = controller.solve(reqs, step=5, trigger="expiry")
        assert plan.feasible and controller.plan is plan
    finally:
        policy.gate.set()
        controller.close()


def test_a_solve_slower_than_a_step_starts_that_many_steps_ahead():
    policy = GatedPolicy(sleep_s=0.05)
    controller = Controller(policy, context(window=(2, 5)), background="thread")
    try:
        reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
        controller.solve(reqs, step=0, trigger="batch")
        assert controller.lead_steps() == 1  # nothing measured yet
        controller.solve_ahead(reqs, step_next=5)
        controller.solve(reqs, step=5, trigger="expiry")  # a background solve of 0.05 s or more
        assert controller.lead_steps() == 1  # no step measured yet
        for _ in range(3):  # decode steps of 20 ms, as predicted (no mismatch)
            controller.observe(0.02, 0.02, [0.005] * 4, 10, None)
        lead = controller.lead_steps()
        assert lead >= math.ceil(1.25 * 0.05 / 0.02) and not controller.mismatch
        due = controller.plan_step + controller.plan.replan_step
        assert controller.ahead_step(due - lead - 1) is None
        assert controller.ahead_step(due - lead) == due  # the solve gets `lead` steps before its expiry
        # the expiry is the step about to run (a one-step window, or late): a solve started now would be for a later
        # step, and that step solves its plan at once anyway, dropping it unused
        assert controller.ahead_step(due) is None and controller.ahead_step(due + 3) is None
    finally:
        controller.close()


def test_a_long_running_controller_keeps_its_latest_records_and_counts_every_solve(monkeypatch):
    """A server solves for as long as it runs: the record list grew without bound (about 4 records a request) and
    /metrics summed it at every scrape. The latest RECORDS_KEPT stay; the totals count every solve."""
    from orbitflow.runtime import controller as module

    monkeypatch.setattr(module, "RECORDS_KEPT", 3)
    controller = Controller(OrbitFlowPolicy(), context(), background=False)
    for step in range(5):
        controller.solve([PlanRequest("a", 1, 10 + step, None, 0.0, math.inf)], step=step, trigger="batch")
    assert len(controller.records) == 3 and [r.step for r in controller.records] == [2, 3, 4]
    assert controller.solver_calls == 5 and controller.solver_budget_hits == 0
    assert controller.solver_time_s > sum(r.solve_s for r in controller.records) > 0


class HangsInThePlanner(OrbitFlowPolicy):
    """OrbitFlow's plans, except that a solve ahead never comes back: in a planner process it sleeps for a minute,
    on a planner thread it waits for ``release`` (set by the test, so that no thread outlives it)."""

    def __init__(self):
        super().__init__()
        self.pid = os.getpid()
        self.release = threading.Event()
        self.hang = True  # a planner thread's solves hang while this is set

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "release"}

    def plan(self, requests, ctx):
        if os.getpid() != self.pid:
            time.sleep(60)
        elif self.hang and threading.current_thread().name.startswith("orbitflow-planner"):
            self.release.wait(60)
        return super().plan(requests, ctx)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_step_past_the_window_gives_up_on_a_planner_that_never_answers(monkeypatch, caplog, mode):
    """A planner that never answers (hung, or its process stopped) held the step past the old plan's window, and with
    it every request of the batch, for good. The step now waits `ahead_wait_s`, then solves inline and starts the
    planner afresh."""
    from orbitflow.runtime import controller as module

    monkeypatch.setattr(module, "AHEAD_WAIT_FLOOR_S", 0.5)
    policy = HangsInThePlanner()
    controller = Controller(policy, context(window=(2, 5)), background=mode)
    try:
        reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
        controller.solve(reqs, step=0, trigger="batch")
        controller.plan = dataclasses.replace(controller.plan, expiry_step=4)
        controller.solve_ahead(reqs, step_next=4)
        assert controller.trigger(4, ["a"]) is None and controller.trigger(5, ["a"]) == "expiry"
        hung = controller._background._pool
        start = time.monotonic()
        plan = controller.solve(reqs, step=5, trigger="expiry")
        waited = time.monotonic() - start
        assert plan.feasible and controller.plan is plan and not controller.records[-1].background
        assert 0.5 <= waited < 30  # the floor, not the planner's minute
        assert "step 5 waited 0.5 s for the plan solved ahead" in caplog.text
        assert controller._background._pool is not hung and controller._background.mode == mode
        if mode == "process":
            assert not hung._proc.is_alive()
    finally:
        policy.release.set()
        controller.close()


def test_a_solve_without_a_budget_is_waited_for_and_one_with_a_budget_for_long_enough():
    from orbitflow.runtime import controller as module

    exact = Controller(OrbitFlowPolicy(), dataclasses.replace(context(), node_limit=None), background=False)
    assert exact.ahead_wait_s() is None  # a proof may take that long; an inline solve would too
    timed = Controller(OrbitFlowPolicy(), dataclasses.replace(context(), node_limit=None, time_limit_s=0.01),
                       background=False)
    assert timed.ahead_wait_s() == module.AHEAD_WAIT_FLOOR_S
    timed.ctx = dataclasses.replace(timed.ctx, time_limit_s=5.0)
    assert timed.ahead_wait_s() == module.AHEAD_WAIT_FACTOR * 5.0
    nodes = Controller(OrbitFlowPolicy(), context(), background=False)  # the default node limit
    assert nodes.ahead_wait_s() == module.AHEAD_WAIT_FLOOR_S
    nodes._ahead_solve_s.append(3.0)  # a background solve that took 3 s
    assert nodes.ahead_wait_s() == module.AHEAD_WAIT_FACTOR * 3.0


@contextlib.contextmanager
def planner_thread_that_hangs(monkeypatch):
    """A controller whose planner thread hangs (``policy.hang``), waiting 0.3 s for it, with a plan in force from step
    0 for one request: yields ``(policy, controller, reqs)``."""
    from orbitflow.runtime import controller as module

    monkeypatch.setattr(module, "AHEAD_WAIT_FLOOR_S", 0.3)
    policy = HangsInThePlanner()
    controller = Controller(policy, context(window=(2, 5)), background="thread")
    try:
        reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
        controller.solve(reqs, step=0, trigger="batch")
        yield policy, controller, reqs
    finally:
        policy.release.set()
        controller.close()


def test_a_planner_that_hangs_again_and_again_is_given_up_for_inline_solves(monkeypatch, caplog):
    """Each hang costs its step the wait: after AHEAD_GIVE_UPS of them nothing is solved ahead any more."""
    from orbitflow.runtime import controller as module

    with planner_thread_that_hangs(monkeypatch) as (_, controller, reqs):
        for _ in range(module.AHEAD_GIVE_UPS):
            due = controller.plan_step + controller.plan.replan_step
            assert controller.ahead_step(due - 1) == due
            controller.solve_ahead(reqs, step_next=due)
            late = due + controller.plan.window  # past the window: the step waits, then gives up
            assert controller.trigger(late, ["a"]) == "expiry"
            assert controller.solve(reqs, step=late, trigger="expiry").feasible
        assert "solving every plan inline from now on" in caplog.text
        due = controller.plan_step + controller.plan.replan_step
        assert controller.ahead_step(due - 1) is None and controller._background is None
        assert controller.solve(reqs, step=due, trigger="expiry").feasible  # inline, at once


def test_a_solve_ahead_that_comes_back_clears_the_count_of_waits_given_up(monkeypatch):
    """Hangs far apart, each followed by solves that come back, never stop the solving ahead: the count is of waits
    given up in a row."""
    from orbitflow.runtime import controller as module

    with planner_thread_that_hangs(monkeypatch) as (policy, controller, reqs):
        for hang in [True, False] * module.AHEAD_GIVE_UPS:
            policy.hang = hang
            due = controller.plan_step + controller.plan.replan_step
            controller.solve_ahead(reqs, step_next=due)
            step = due + controller.plan.window if hang else due  # a hung solve is waited for past the window
            assert controller.solve(reqs, step=step, trigger="expiry").feasible
            assert controller.records[-1].background != hang  # the hung one solved inline, the other came back
        assert controller._background is not None and controller.ahead_step(
            controller.plan_step + controller.plan.replan_step - 1) is not None


def test_the_wait_for_a_solve_ahead_follows_the_budget_it_was_submitted_with(monkeypatch, caplog):
    """The inputs changing after the submit (here the budget dropped) leave the solve ahead as it was sent: it had a
    budget, so a step past the window still gives up on it after the wait, and the log names that budget."""
    with planner_thread_that_hangs(monkeypatch) as (_, controller, reqs):
        sent = controller.ctx
        due = controller.plan_step + controller.plan.replan_step
        controller.solve_ahead(reqs, step_next=due)
        controller.ctx = dataclasses.replace(sent, node_limit=None, time_limit_s=None)
        assert controller.ahead_wait_s() is None and controller.ahead_wait_s(sent) is not None
        start = time.perf_counter()
        plan = controller.solve(reqs, step=due + controller.plan.window, trigger="expiry")
        assert plan.feasible and not controller.records[-1].background  # solved inline after the wait
        assert time.perf_counter() - start < 30  # the 0.3 s wait, not the hung policy's minute
        assert f"(budget: {sent.node_limit} nodes)" in caplog.text


def test_a_solve_proven_within_the_plan_gap_is_not_a_budget_hit():
    """orbitflow:solver_budget_reached counts solves cut short unproven; one that ended within --plan-gap (its
    certified gap no wider) is proven for that gap, though not exact."""
    from orbitflow.plan.types import PlanStats

    class Near(OrbitFlowPolicy):
        def plan(self, requests, ctx):
            got = super().plan(requests, ctx)
            return dataclasses.replace(got, stats=PlanStats(exact=False, gap=0.004))

    reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
    for gap, hits in ((0.0, 1), (0.001, 1), (0.01, 0)):
        controller = Controller(Near(), dataclasses.replace(context(), gap=gap), background=False)
        controller.solve(reqs, step=0, trigger="batch")
        assert controller.solver_budget_hits == hits and controller.records[-1].proven == (not hits)
