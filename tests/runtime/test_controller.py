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
