import dataclasses
import math

from orbitflow.plan import CostModel, PlanRequest
from orbitflow.policies.base import PlanContext
from orbitflow.policies.fixed import FixedPlacementPolicy
from orbitflow.policies.orbitflow import OrbitFlowPolicy
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


def test_slow_solve_delays_the_plans_adoption_on_the_virtual_clock():
    from orbitflow.runtime.clock import VirtualClock

    clock = VirtualClock()
    controller = Controller(OrbitFlowPolicy(), context(window=(2, 5)), background=False)
    controller.charge_solve_time(clock, lambda wall_s: 0.5)  # every solve costs 0.5 s of virtual time
    reqs = [PlanRequest("a", 1, 10, None, 0.0, math.inf)]
    first = controller.solve(reqs, step=0, trigger="batch")
    # nothing ran before: the batch waits for its first plan, so the clock moves by the solve time
    assert clock.now() == 0.5 and controller.plan is first and controller.records[-1].charged_s == 0.5
    # an expiry re-plan of the same batch: the old plan keeps running while the new one solves
    assert controller.trigger(7, ["a"]) == "expiry"
    second = controller.solve(reqs, step=7, trigger="expiry")
    assert second is not first and controller.plan is first and clock.now() == 0.5
    clock.advance(0.3)  # a step of 0.3 s: still solving
    assert controller.trigger(8, ["a"]) is None and controller.plan is first
    clock.advance(0.3)  # 0.6 s after the solve started: adopted at the next decision
    controller.trigger(9, ["a"])
    assert controller.plan is second and controller.adopted_late == 1
    # a batch change drops a solve in flight: its plan was for the old batch
    controller.solve(reqs, step=12, trigger="expiry")
    assert controller.trigger(12, ["a", "b"]) == "batch" and controller.plan is second


def test_solve_time_off_the_clock_by_default():
    from orbitflow.runtime.clock import VirtualClock

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
        return  # no compiler: nothing to load
    monkeypatch.setattr(planner, "_warm", False)
    calls = []
    real = planner.Planner.plan
    monkeypatch.setattr(planner.Planner, "plan", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    controller = Controller(FixedPlacementPolicy("none"), context(), background=False)
    try:
        assert planner._warm and calls  # a tiny solve ran at construction
    finally:
        controller.close()
