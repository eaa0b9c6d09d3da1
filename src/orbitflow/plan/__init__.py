"""Placement planner library: placement space, step-latency cost model, solver, decode window, expiry.

Pure Python + NumPy (no torch). Public API::

    from orbitflow.plan import Placement, CostModel, Planner, PlanRequest, Plan, PlanStats, SearchControl
"""

from orbitflow.plan.cost_model import CostModel, StepEstimate
from orbitflow.plan.placement import Placement, pruned_distances, widest_distance
from orbitflow.plan.planner import VICTIM_ORDERS, Planner, resolve_victim_order, warm_up
from orbitflow.plan.search import SearchControl
from orbitflow.plan.types import Plan, PlanRequest, PlanStats

__all__ = [
    "CostModel",
    "Placement",
    "Plan",
    "PlanRequest",
    "PlanStats",
    "Planner",
    "SearchControl",
    "StepEstimate",
    "VICTIM_ORDERS",
    "pruned_distances",
    "resolve_victim_order",
    "warm_up",
    "widest_distance",
]
