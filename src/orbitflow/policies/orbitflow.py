"""OrbitFlow: the exact planner over per-request distances, re-planned on batch change, expiry and
profile mismatch, with Pause-Resume when no plan meets capacity and the SLO cap (paper section 4)."""

from __future__ import annotations

from orbitflow.plan import Plan, PlanRequest
from orbitflow.policies.base import PlanContext, Policy


class OrbitFlowPolicy(Policy):
    name = "orbitflow"
    replan_on = frozenset({"batch", "expiry", "mismatch"})
    pause_resume = True

    def __init__(self, space: str = "pruned"):
        self.space = space

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        return ctx.planner(space=self.space).plan(requests, hint=ctx.previous)
