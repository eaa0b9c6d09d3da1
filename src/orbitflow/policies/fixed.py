"""A placement given up front (`orbitflow generate --placement SPEC`), never re-planned by choice.

SPEC: `none` (all on device), `all` (every layer on host), `distance:D` (1-based layers D, 2D, ... on
host), `random:SEED` (independent random device/host choice per request and layer).
"""

from __future__ import annotations

import zlib

import numpy as np

from orbitflow.plan import Placement, Plan, PlanRequest
from orbitflow.policies.base import PlanContext, Policy, final_blocks


class PlacementError(ValueError):
    pass


def parse_placement_spec(spec: str) -> tuple[str, int | None]:
    kind, _, arg = spec.partition(":")
    if kind in ("none", "all") and not arg:
        return kind, None
    if kind in ("distance", "random") and arg.isdigit():
        value = int(arg)
        if kind == "distance" and value < 1:
            raise PlacementError(f"--placement distance:D needs D >= 1, got {spec!r}")
        return kind, value
    raise PlacementError(f"--placement must be none, all, distance:D or random:SEED, got {spec!r}")


def placement_row(spec: str, num_layers: int, request_id: object) -> np.ndarray:
    kind, value = parse_placement_spec(spec)
    if kind == "none":
        return np.ones(num_layers, dtype=bool)
    if kind == "all":
        return np.zeros(num_layers, dtype=bool)
    if kind == "distance":
        return Placement.from_distances(num_layers, [value]).mask[0]
    rng = np.random.default_rng([value, zlib.crc32(str(request_id).encode())])
    return rng.random(num_layers) < 0.5


class FixedPlacementPolicy(Policy):
    name = "fixed"
    replan_on = frozenset({"batch"})

    def __init__(self, spec: str):
        parse_placement_spec(spec)
        self.spec = spec

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        rows = [placement_row(self.spec, ctx.num_layers, r.request_id) for r in requests]
        placement = Placement.from_mask(np.array(rows, dtype=bool).reshape(len(requests), ctx.num_layers))
        needed = placement.memory_blocks([final_blocks(r, ctx.block_size) for r in requests],
                                         ctx.cost_model.prefetch_slots)
        if needed > ctx.capacity_blocks:
            raise PlacementError(
                f"placement {self.spec!r} needs {int(needed)} device KV blocks (resident + prefetch buffer) "
                f"but --device-kv-blocks is {ctx.capacity_blocks}"
            )
        return ctx.planner(alpha=float("inf")).evaluate(placement, requests)
