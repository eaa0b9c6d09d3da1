"""The one seam between the engine and a placement strategy.

The engine asks its Policy for a plan whenever one of the policy's re-plan triggers fires; every
policy (OrbitFlow, each baseline, each ablation) answers with an `orbitflow.plan.Plan`, so they all run
on the same engine, the same KV manager and the same metrics.

Triggers: "batch" (a request arrived, finished, paused or resumed), "expiry" (the plan's own expiry
step), "mismatch" (measured step latency off the prediction), "step" (every iteration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orbitflow.plan import CostModel, Plan, Planner, PlanRequest


@dataclass
class PlanContext:
    num_layers: int
    block_size: int
    capacity_blocks: int
    cost_model: CostModel
    alpha: float = 1.0
    window: tuple[int, int] = (4, 64)
    victim: str = "largest-kv+deposit"
    seed: int = 0

    def planner(self, space: str = "pruned", alpha: float | None = None) -> Planner:
        return Planner(
            self.cost_model,
            self.capacity_blocks,
            alpha=self.alpha if alpha is None else alpha,
            window=self.window,
            space=space,
            block_size=self.block_size,
            victim_order=self.victim,
        )


class Policy:
    name = "policy"
    replan_on: frozenset[str] = frozenset({"batch"})
    pause_resume = False  # may the engine pause a victim when the plan is infeasible?

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


def final_blocks(request: PlanRequest, block_size: int) -> int:
    """Blocks per layer the request will hold when it has generated everything it may."""
    left = request.tokens_left or 0
    return math.ceil((request.tokens + left) / block_size)
