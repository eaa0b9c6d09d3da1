"""Placement policies behind one interface; `make_policy(name)` builds any of them by name."""

from __future__ import annotations

from collections.abc import Callable

from orbitflow.policies.base import PlanContext, Policy
from orbitflow.policies.fixed import FixedPlacementPolicy, PlacementError, parse_placement_spec
from orbitflow.policies.orbitflow import OrbitFlowPolicy

POLICIES: dict[str, Callable[[], Policy]] = {
    "orbitflow": OrbitFlowPolicy,
}


def policy_names() -> list[str]:
    return list(POLICIES)


def make_policy(name: str) -> Policy:
    if name.startswith(("fixed:", "placement:")):
        return FixedPlacementPolicy(name.partition(":")[2])
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {name!r}") from None


__all__ = [
    "FixedPlacementPolicy", "OrbitFlowPolicy", "PlacementError", "PlanContext", "Policy", "make_policy",
    "parse_placement_spec", "policy_names",
]
