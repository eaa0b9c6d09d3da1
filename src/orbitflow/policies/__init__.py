"""Placement policies behind one interface; `make_policy(name)` builds any of them by name."""

from __future__ import annotations

from collections.abc import Callable

from orbitflow.config import ConfigError
from orbitflow.policies.ablations import BatchUniformPolicy, PauseResumePolicy, RequestWisePolicy
from orbitflow.policies.base import PlanContext, Policy
from orbitflow.policies.deepspeed import DeepSpeedPolicy
from orbitflow.policies.dynamic import DynamicHeuristicPolicy
from orbitflow.policies.fixed import FixedPlacementPolicy, PlacementError, parse_placement_spec
from orbitflow.policies.flexgen import FlexGenPlusPolicy, FlexGenPolicy
from orbitflow.policies.orbitflow import OrbitFlowPolicy
from orbitflow.policies.slo_aware import SLOAwarePolicy

POLICIES: dict[str, Callable[[], Policy]] = {
    "orbitflow": OrbitFlowPolicy,
    "deepspeed": DeepSpeedPolicy,
    "flexgen": FlexGenPolicy,
    "flexgen+": FlexGenPlusPolicy,
    "slo-aware": SLOAwarePolicy,
    "dynamic": DynamicHeuristicPolicy,
}
ABLATIONS: dict[str, Callable[[], Policy]] = {
    "batch-uniform": BatchUniformPolicy,
    "+request-wise": RequestWisePolicy,
    "+pause-resume": PauseResumePolicy,
    "+token-deposit": OrbitFlowPolicy,
}
BASELINES = ["deepspeed", "flexgen", "flexgen+", "slo-aware", "dynamic"]


def policy_names() -> list[str]:
    return list(POLICIES) + list(ABLATIONS)


def make_policy(name: str) -> Policy:
    if name.startswith(("fixed:", "placement:")):
        return FixedPlacementPolicy(name.partition(":")[2])
    factory = POLICIES.get(name) or ABLATIONS.get(name)
    if factory is None:
        raise ConfigError(f"--policy must be one of {', '.join(policy_names())}, got {name!r}")
    policy = factory()
    if name == "+token-deposit":
        policy.name = name
    return policy


__all__ = [
    "FixedPlacementPolicy", "OrbitFlowPolicy", "PlacementError", "PlanContext", "Policy", "make_policy",
    "parse_placement_spec", "policy_names",
]
