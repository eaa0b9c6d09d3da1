"""Dynamic Heuristic (the paper's strongest baseline): every iteration, per request, the fewest
offloaded layers that fit the device, growing the offload of the largest requests first."""

from __future__ import annotations

from orbitflow.plan import Placement, Plan, PlanRequest
from orbitflow.plan.placement import pruned_distances
from orbitflow.policies.base import PlanContext, Policy, final_blocks


class DynamicHeuristicPolicy(Policy):
    name = "dynamic"
    replan_on = frozenset({"step"})

    def __init__(self):
        self._last: tuple[tuple, Plan] | None = None

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        # The decision only changes when some request's block count does: reuse it in between. Its feasibility and
        # predicted step also read the host KV left to the batch and the cost model (refreshed from measurements):
        # either changing is a new decision.
        key = (ctx.capacity_blocks, ctx.host_capacity_blocks, ctx.cost_model,  # a model compares by identity
               tuple((r.request_id, r.blocks_per_layer) for r in requests))
        last = self._last  # read once: a what-if on another thread may replace it meanwhile
        if last is not None and last[0] == key:
            return last[1]
        plan = self._decide(requests, ctx)
        self._last = (key, plan)
        return plan

    def _decide(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        options = pruned_distances(ctx.num_layers)  # increasing offload count, None first
        level = [0] * len(requests)
        blocks = [max(r.blocks_per_layer, min(final_blocks(r, ctx.block_size), r.blocks_per_layer + 1))
                  for r in requests]
        by_size = sorted(range(len(requests)), key=lambda i: -blocks[i])  # largest first

        def placement() -> Placement:
            return Placement.from_distances(ctx.num_layers, [options[k] for k in level])

        while placement().memory_blocks(blocks, ctx.cost_model.prefetch_slots) > ctx.capacity_blocks:
            growable = [i for i in by_size if level[i] < len(options) - 1]
            if not growable:
                break
            level[growable[0]] += 1  # the largest request gives up layers first: fewest layers moved
        return ctx.planner(alpha=float("inf")).evaluate(placement(), requests)
