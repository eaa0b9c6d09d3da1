"""Placement planner library: placement space, step-latency cost model, solver, decode window, expiry.

Pure Python + NumPy (no torch). Public API::

    from orbitflow.plan import Placement, CostModel, Planner, PlanRequest, Plan
"""

from orbitflow.plan.cost_model import CostModel, StepEstimate
from orbitflow.plan.placement import Placement, pruned_distances, widest_distance
from orbitflow.plan.planner import VICTIM_ORDERS, Plan, Planner, PlanRequest, resolve_victim_order, warm_up

__all__ = [
    "CostModel",
    "Placement",
    "Plan",
    "PlanRequest",
    "Planner",
    "StepEstimate",
    "VICTIM_ORDERS",
    "pruned_distances",
    "resolve_victim_order",
    "warm_up",
    "widest_distance",
]
