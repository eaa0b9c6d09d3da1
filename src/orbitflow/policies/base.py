"""The one seam between the engine and a placement strategy.

The engine asks its Policy for a plan whenever one of the policy's re-plan triggers fires; every
policy (OrbitFlow, each baseline, each ablation) answers with an `orbitflow.plan.Plan`, so they all run
on the same engine, the same KV manager and the same metrics.

Triggers: "batch" (a request arrived, finished, paused or resumed), "expiry" (the plan's own expiry
step), "mismatch" (measured step latency off the prediction), "step" (every iteration).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from orbitflow.plan import CostModel, Placement, Plan, Planner, PlanRequest


@dataclass(frozen=True)
class PlanContext:
    """Everything a policy plans with, as one immutable snapshot. The controller builds a new one whenever an
    input changes (the EWMA-refreshed cost model, the host pool left to the batch, the plan in place) and hands
    that object to the solve, so a solve on the planner thread never sees its inputs change."""

    num_layers: int
    block_size: int
    capacity_blocks: int
    cost_model: CostModel
    alpha: float = 1.0
    window: tuple[int, int] = (4, 64)
    victim: str = "largest-kv+deposit"
    seed: int = 0
    max_num_seqs: int = 4
    max_batch_tokens: int = 32768  # the workload's worst case (FlexGen plans for it offline)
    host_capacity_blocks: float = math.inf  # host blocks the batch may use (the engine sets it per solve)
    node_limit: int | None = 2000  # planner budget per solve
    time_limit_s: float | None = None
    gap: float = 0.0  # relative: a solve stops once its plan is proven within it (0: exact)
    threads: int = 1  # threads of a solve without a node limit
    token_deposit: bool = True  # False: the planner lets no step bank margin for a later one
    # offload distance per request id of the plan in place (the search's first try); read-only
    previous: Mapping | None = None

    @classmethod
    def from_profile(cls, config, profile, policy: Policy | None = None) -> PlanContext:
        """Planning inputs for an engine built from `config` on hardware described by `profile` (``policy``:
        whose own prefetch depth applies when the config leaves it open)."""
        return cls(
            num_layers=profile.num_layers,
            block_size=config.cache.block_size,
            capacity_blocks=config.cache.device_kv_blocks,
            # the one cost model the simulator also runs on, at this policy's prefetch depth
            cost_model=profile.cost_model(config.cache.kv_link, prefetch_slots_for(config, policy)),
            alpha=config.planner.alpha,
            window=(config.planner.window_min, config.planner.window_max),
            victim=config.planner.victim,
            seed=config.model.seed,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_batch_tokens=config.scheduler.max_num_batched_tokens,
            node_limit=config.planner.plan_node_limit,
            time_limit_s=config.planner.plan_time_limit_s,
            gap=config.planner.plan_gap,
            threads=config.planner.plan_threads,
            token_deposit=config.planner.token_deposit,
        )

    def planner(self, space: str = "pruned", alpha: float | None = None) -> Planner:
        return Planner(
            self.cost_model,
            self.capacity_blocks,
            alpha=self.alpha if alpha is None else alpha,
            window=self.window,
            space=space,
            block_size=self.block_size,
            victim_order=self.victim,
            seed=self.seed,
            host_capacity_blocks=self.host_capacity_blocks,
            node_limit=self.node_limit,
            time_limit_s=self.time_limit_s,
            gap=self.gap,
            threads=self.threads,
            token_deposit=self.token_deposit,
        )


class Policy:
    """Subclasses set `name`, `replan_on`, `pause_resume` and implement `plan`."""

    name = "policy"
    replan_on: frozenset[str] = frozenset({"batch"})
    pause_resume = False  # may the engine pause a victim when the plan is infeasible?
    prefetch_slots = 1  # the prefetch depth the real system uses (CacheConfig.prefetch_slots overrides it)

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        raise NotImplementedError

    def unservable(self, request: PlanRequest, ctx: PlanContext) -> str | None:
        """Why this policy could never serve ``request``, even alone in the engine (``ctx`` with the whole host pool);
        None when it can. The engine rejects such a request when it is added, before it runs."""
        return None

    def check_model(self, num_layers: int) -> None:
        """Raise a ConfigError (a PlacementError for --placement) naming the flag if this policy cannot run on a model
        of ``num_layers`` layers whatever the requests (``LLM`` asks once the model's config is read, before it
        measures anything)."""

    def describe(self) -> str:
        return self.name


def prefetch_slots_for(config, policy: Policy | None) -> int:
    """The prefetch depth a run uses: the config's if set, else the policy's own."""
    if config.cache.prefetch_slots is not None:
        return int(config.cache.prefetch_slots)
    return int(getattr(policy, "prefetch_slots", 1))


def default_slo_s(config, profile) -> float:
    """--slo-ms if given, else --slo-scale x the base SLO: a no-offload decode step with the device
    budget full of KV (the base SLO the paper's SLO scales multiply)."""
    if config.planner.slo_ms is not None:
        return config.planner.slo_ms / 1000.0
    budget = config.cache.device_kv_blocks
    return config.planner.slo_scale * profile.with_overrides(device_kv_blocks=budget).base_slo_s()


def final_blocks(request: PlanRequest, block_size: int) -> int:
    """Blocks per layer the request will hold when it has generated everything it may."""
    left = request.tokens_left or 0
    return math.ceil((request.tokens + left) / block_size)


class KeptPlacementPolicy(Policy):
    """A policy whose placement does not adapt to the batch or the pools (fixed placements, DeepSpeed). A batch the
    placement cannot hold to its last tokens gets an infeasible plan, so admission keeps the newest request waiting
    rather than run a pool dry mid-generation; a request it cannot hold even alone is unservable. Subclasses give the
    placement and what to call it in an error."""

    def placement(self, requests: list[PlanRequest], num_layers: int) -> Placement:
        raise NotImplementedError

    def placement_name(self) -> str:
        raise NotImplementedError

    def plan(self, requests: list[PlanRequest], ctx: PlanContext) -> Plan:
        placement = self.placement(requests, ctx.num_layers)
        plan = ctx.planner(alpha=float("inf")).evaluate(placement, requests)
        if _shortfall(placement, requests, ctx) is None:
            return plan
        return replace(plan, placement=None, distances=None, feasible=False, window=0, expiry_step=None,
                       victims=(requests[-1].request_id,))

    def unservable(self, request: PlanRequest, ctx: PlanContext) -> str | None:
        short = _shortfall(self.placement([request], ctx.num_layers), [request], ctx)
        return None if short is None else f"{self.placement_name()} needs {short}"


def _shortfall(placement: Placement, requests: list[PlanRequest], ctx: PlanContext) -> str | None:
    """What ``placement``, kept as it is until every request of ``requests`` has its last token, lacks: the device
    blocks it holds then (resident and prefetch buffer) beyond the budget, or the host blocks beyond what the batch may
    use of the host pool; None when both fit."""
    final = [final_blocks(r, ctx.block_size) for r in requests]
    device = placement.memory_blocks(final, ctx.cost_model.prefetch_slots)
    if device > ctx.capacity_blocks:
        return (f"{int(device)} device KV blocks (resident + prefetch buffer), and --device-kv-blocks is "
                f"{ctx.capacity_blocks}")
    host = float(np.dot(final, placement.offload_counts()))
    if host > ctx.host_capacity_blocks:
        return f"{int(host)} host KV blocks, and the host pool has {int(ctx.host_capacity_blocks)} for it " \
               "(--host-kv-blocks)"
    return None


def evenly_spaced_row(num_layers: int, count: int) -> np.ndarray:
    """Device mask offloading `count` layers spread evenly over the depth (distance d when count = L/d)."""
    row = np.ones(num_layers, dtype=bool)
    if count:
        row[(np.arange(1, count + 1) * num_layers) // count - 1] = False
    return row


def uniform_count_plans(requests: list[PlanRequest], ctx: PlanContext, counts) -> list[tuple[int, Plan]]:
    """Evaluate, for each offload count, that many evenly spaced layers offloaded for every request
    (the layer-granular, batch-uniform placement of DeepSpeed/FlexGen-style systems)."""
    planner = ctx.planner(alpha=float("inf"))
    out = []
    for n in counts:
        mask = np.tile(evenly_spaced_row(ctx.num_layers, n), (len(requests), 1))
        out.append((n, planner.evaluate(Placement.from_mask(mask), requests)))
    return out
