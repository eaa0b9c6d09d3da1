"""OrbitFlow built up one mechanism at a time (paper Fig. 13a). Token-Deposit is a run switch
(`--token-deposit`), so "+token-deposit" is OrbitFlow itself run with it on."""

from __future__ import annotations

from orbitflow.plan import Plan, PlanRequest
from orbitflow.policies.base import PlanContext
from orbitflow.policies.orbitflow import OrbitFlowPolicy


class BatchUniformPolicy(OrbitFlowPolicy):
    """The planner restricted to one distance for the whole batch; no Pause-Resume."""

    name = "batch-uniform"
    pause_resume = False

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        return ctx.planner(space="uniform").plan(requests)


class RequestWisePolicy(OrbitFlowPolicy):
    """Per-request distances from the exact planner; no Pause-Resume."""

    name = "+request-wise"
    pause_resume = False


class PauseResumePolicy(OrbitFlowPolicy):
    """Per-request distances plus Pause-Resume (run without Token-Deposit for the ablation)."""

    name = "+pause-resume"
