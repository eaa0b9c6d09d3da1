"""A placement given up front (`orbitflow generate --placement SPEC`), never re-planned by choice. A batch it cannot
hold to its last tokens waits (the newest request first); a request it cannot hold even alone is refused when added.

SPEC: `none` (all on device), `all` (every layer on host), `distance:D` (1-based layers D, 2D, ... on
host), `random:SEED` (independent random device/host choice per request and layer).
"""

from __future__ import annotations

import zlib

import numpy as np

from orbitflow.plan import Placement, PlanRequest
from orbitflow.policies.base import KeptPlacementPolicy, PlanContext


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


class FixedPlacementPolicy(KeptPlacementPolicy):
    name = "fixed"
    replan_on = frozenset({"batch"})

    def __init__(self, spec: str):
        parse_placement_spec(spec)
        self.spec = spec

    def placement(self, requests: list[PlanRequest], num_layers: int) -> Placement:
        rows = [placement_row(self.spec, num_layers, r.request_id) for r in requests]
        return Placement.from_mask(np.array(rows, dtype=bool).reshape(len(requests), num_layers))

    def placement_name(self) -> str:
        return f"placement {self.spec!r}"

    def _no_layer(self, num_layers: int) -> str | None:
        kind, value = parse_placement_spec(self.spec)
        if kind == "distance" and value is not None and value > num_layers:  # would silently be "none"
            return (f"--placement {self.spec} offloads no layer of the model's {num_layers} (D must be at most "
                    f"{num_layers}; --placement none keeps every layer on the device)")
        return None

    def check_model(self, num_layers: int) -> None:
        reason = self._no_layer(num_layers)
        if reason is not None:
            raise PlacementError(reason)

    def unservable(self, request: PlanRequest, ctx: PlanContext) -> str | None:
        return self._no_layer(ctx.num_layers) or super().unservable(request, ctx)
