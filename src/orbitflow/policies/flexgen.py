"""FlexGen and FlexGen+: one offload count (evenly spaced layers) shared by every request.

FlexGen picks it once, offline, for the worst case the workload allows (a full batch at the token
cap) and never changes it. FlexGen+ re-picks it from the current batch whenever the batch changes.
Neither looks at the SLO. Both prefetch at depth 2, as FlexGen's overlapped generation loop does: it loads
layer j+1's cache while layer j computes (DESIGN: every baseline at its real system's prefetch depth).
"""

from __future__ import annotations

import math

from orbitflow.plan import Plan, PlanRequest
from orbitflow.policies.base import PlanContext, Policy, uniform_count_plans


def fastest_fitting(candidates: list[tuple[object, Plan]]) -> tuple[object, Plan]:
    feasible = [(d, p) for d, p in candidates if p.feasible]
    pool = feasible or candidates
    return min(pool, key=lambda dp: (dp[1].predicted_step_s, dp[1].host_blocks))


class FlexGenPolicy(Policy):
    name = "flexgen"
    replan_on = frozenset()
    prefetch_slots = 2

    def __init__(self):
        self.count: int | None = None

    def offline_count(self, ctx: PlanContext) -> int:
        per_request = ctx.max_batch_tokens // ctx.max_num_seqs
        worst = [PlanRequest(f"worst-{i}", math.ceil(per_request / ctx.block_size), per_request, 0)
                 for i in range(ctx.max_num_seqs)]
        return fastest_fitting(uniform_count_plans(worst, ctx, range(ctx.num_layers + 1)))[0]

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        if self.count is None:
            self.count = self.offline_count(ctx)
        return uniform_count_plans(requests, ctx, [self.count])[0][1]


class FlexGenPlusPolicy(Policy):
    name = "flexgen+"
    replan_on = frozenset({"batch"})
    prefetch_slots = 2

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        return fastest_fitting(uniform_count_plans(requests, ctx, range(ctx.num_layers + 1)))[1]
