"""DeepSpeed-Inference: every layer's KV lives on the host and is fetched one layer ahead.

Prefetch depth 2 (paper section 5.1, Baselines, item 1: it prefetches the next layer while the current one
runs): layer i+1's KV may move while layer i computes, so the link and the compute overlap.
"""

from __future__ import annotations

from orbitflow.plan import Placement, Plan, PlanRequest
from orbitflow.policies.base import PlanContext, Policy, kept_placement_plan, kept_placement_shortfall


class DeepSpeedPolicy(Policy):
    name = "deepspeed"
    replan_on = frozenset()
    prefetch_slots = 2

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        """Every layer on the host; infeasible when the host pool cannot hold the batch to its last tokens (the
        newest request waits)."""
        return kept_placement_plan(Placement.from_distances(ctx.num_layers, [1] * len(requests)), requests, ctx)

    def unservable(self, request: PlanRequest, ctx: PlanContext) -> str | None:
        short = kept_placement_shortfall(Placement.from_distances(ctx.num_layers, [1]), [request], ctx)
        return None if short is None else f"the deepspeed policy (every layer on the host) needs {short}"
