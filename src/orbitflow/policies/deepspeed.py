"""DeepSpeed-Inference: every layer's KV lives on the host and is fetched one layer ahead."""

from __future__ import annotations

from orbitflow.plan import Placement, Plan, PlanRequest
from orbitflow.policies.base import PlanContext, Policy


class DeepSpeedPolicy(Policy):
    name = "deepspeed"
    replan_on = frozenset()

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        placement = Placement.from_distances(ctx.num_layers, [1] * len(requests))
        return ctx.planner(alpha=float("inf")).evaluate(placement, requests)
