"""SLO-aware offloading (Select-N style): one shared offload count (evenly spaced layers), picked from
the profiled compute and transfer costs so that the step stays within the SLO while offloading as much
as possible (freeing the most device memory); re-picked when the batch changes. Falls back to the
fastest fitting one.

The count holds until the batch changes, and the step grows with the context meanwhile, so the SLO is
checked at the batch's last step as well as now: Select-N looks the distance up in a profile indexed by
sequence length, for the lengths the batch will reach. Checked now only, the most-offloading count sits
at the SLO by design and drifts over it a few tokens later."""

from __future__ import annotations

import math

import numpy as np

from orbitflow.plan import Plan, PlanRequest
from orbitflow.policies.base import PlanContext, Policy, uniform_count_plans
from orbitflow.policies.flexgen import fastest_fitting


def steps_until_batch_changes(requests: list[PlanRequest], ctx: PlanContext) -> int:
    """Decode steps after this one that the batch runs unchanged at the latest: until its first request has
    generated its last token (unknown lengths: the planner's longest window)."""
    left = [r.tokens_left for r in requests if r.tokens_left is not None]
    return max(0, min(left) - 1) if left else ctx.window[1]


def last_step(requests: list[PlanRequest], ctx: PlanContext) -> tuple[np.ndarray, int]:
    """Blocks per layer of each request and the batch's tokens at its last step before it changes."""
    later = [r.after(steps_until_batch_changes(requests, ctx), r.deposit) for r in requests]
    blocks = np.array([max(r.blocks_per_layer, math.ceil(r.tokens / ctx.block_size)) for r in later], dtype=float)
    return blocks, sum(r.tokens for r in later)


class SLOAwarePolicy(Policy):
    name = "slo-aware"
    replan_on = frozenset({"batch"})

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        candidates = uniform_count_plans(requests, ctx, range(ctx.num_layers + 1))
        slo = min((r.slo_s for r in requests), default=math.inf)  # an empty batch meets any SLO
        blocks, tokens = last_step(requests, ctx)
        within = [(d, p) for d, p in candidates if p.feasible and p.predicted_step_s <= slo
                  and ctx.cost_model.step(p.placement, blocks, total_tokens=tokens).total_s <= slo]
        if within:
            return max(within, key=lambda dp: (dp[1].host_blocks, -dp[1].predicted_step_s))[1]
        return fastest_fitting(candidates)[1]
