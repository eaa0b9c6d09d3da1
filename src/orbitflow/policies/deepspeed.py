"""DeepSpeed-Inference: every layer's KV lives on the host and is fetched one layer ahead.

Prefetch depth 2 (paper section 5.1, Baselines, item 1: it prefetches the next layer while the current one
runs): layer i+1's KV may move while layer i computes, so the link and the compute overlap.
"""

from __future__ import annotations

from orbitflow.plan import Placement, PlanRequest
from orbitflow.policies.base import KeptPlacementPolicy


class DeepSpeedPolicy(KeptPlacementPolicy):
    name = "deepspeed"
    replan_on = frozenset()
    prefetch_slots = 2

    def placement(self, requests: list[PlanRequest], num_layers: int) -> Placement:
        """Every layer on the host."""
        return Placement.from_distances(num_layers, [1] * len(requests))

    def placement_name(self) -> str:
        return "the deepspeed policy (every layer on the host)"
