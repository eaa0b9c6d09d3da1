"""SLO-aware offloading (Select-N style): one shared offload count (evenly spaced layers), picked from
the profiled compute and transfer costs so that the step stays within the SLO while offloading as much
as possible (freeing the most device memory); re-picked when the batch changes. Falls back to the
fastest fitting one."""

from __future__ import annotations

import math

from orbitflow.plan import Plan, PlanRequest
from orbitflow.policies.base import PlanContext, Policy, uniform_count_plans
from orbitflow.policies.flexgen import fastest_fitting


class SLOAwarePolicy(Policy):
    name = "slo-aware"
    replan_on = frozenset({"batch"})

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        candidates = uniform_count_plans(requests, ctx, range(ctx.num_layers + 1))
        slo = min((r.slo_s for r in requests), default=math.inf)  # an empty batch meets any SLO
        within = [(d, p) for d, p in candidates if p.feasible and p.predicted_step_s <= slo]
        if within:
            return max(within, key=lambda dp: (dp[1].host_blocks, -dp[1].predicted_step_s))[1]
        return fastest_fitting(candidates)[1]
