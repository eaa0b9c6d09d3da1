"""Policies whose feasibility (or timing) a test scripts (shared by the scheduler's, the engine's and the background
planner's tests)."""

from __future__ import annotations

import multiprocessing
import time

import numpy as np

from orbitflow.plan import Placement, Plan
from orbitflow.policies.base import Policy
from orbitflow.policies.fixed import FixedPlacementPolicy
from orbitflow.policies.orbitflow import OrbitFlowPolicy


class CapPolicy(Policy):
    """Feasible while the batch has at most `cap` requests (everything on the device); otherwise the
    victim is the request named `victim` if present, else the last one."""

    name = "cap"
    pause_resume = True

    def __init__(self, cap: int, victim: str | None = None, layers: int = 4):
        self.cap, self.victim, self.layers = cap, victim, layers

    def plan(self, requests, ctx) -> Plan:
        ids = tuple(r.request_id for r in requests)
        if len(requests) <= self.cap:
            placement = Placement.from_distances(self.layers, [None] * len(requests))
            return Plan(ids, placement, (None,) * len(ids), True, 8, None, 0.01)
        victims = tuple(i for i in ids if i == self.victim) or ids[-1:]
        return Plan(ids, None, None, False, 8, None, float("inf"), victims=victims)


class CrowdedPolicy(CapPolicy):
    """CapPolicy, except that no plan holds a batch with a request of `crowded` in it while a paused request outside
    the batch holds KV (`scheduler` set): what a layer split that fits only the empty pools looks like to the
    scheduler."""

    def __init__(self, cap: int, victim: str | None = None, layers: int = 4):
        super().__init__(cap, victim, layers)
        self.crowded: set[str] = set()
        self.scheduler = None

    def plan(self, requests, ctx) -> Plan:
        ids = tuple(r.request_id for r in requests)
        kv, paused = self.scheduler.kv, self.scheduler.paused
        if self.crowded & set(ids) and any(p.request_id not in ids and p.request_id in kv.tables for p in paused):
            return Plan(ids, None, None, False, 8, None, float("inf"), victims=ids[-1:])
        return super().plan(requests, ctx)


class StallsInPlannerProcess(OrbitFlowPolicy):
    """OrbitFlow's policy, except that in the planner process a batch with a request named ``stall`` never comes
    back (the solve sleeps an hour): a test can kill the process while that solve is surely in flight."""

    name = "stalls-in-planner-process"

    def plan(self, requests, ctx) -> Plan:
        if multiprocessing.current_process().name == "orbitflow-planner" and any(
            r.request_id == "stall" for r in requests
        ):
            time.sleep(3600)
        return super().plan(requests, ctx)


class OvertakingPolicy(FixedPlacementPolicy):
    """The shortest request on the host at layers 0-1, the longest at layers 4-5, the others on the device: on the
    preemptive link the longest's layer-4 fetch (it starts when the shortest's layer 0 has landed) yields to the
    shortest's layer 1 if that is released (at the start of layer 1's attention) while the fetch still has a chunk
    to go. Whether it does is timing, not the policy: the window, (its blocks - 1) chunks of link time, must outlast
    layer 0's compute and layer 1's up to attention, and the caller sizes it (link rate, chunk, the longest prompt).
    It is not ~10x a layer's compute by itself: under TP a layer also waits on gloo all-reduces and a rank's block
    is half as large, and at 0.5 MB/s with a 41-token longest the window was ~8-12 ms, about one layer's compute
    (see test_tp_executor's OVERTAKING_LINK_GBPS)."""

    def __init__(self):
        super().__init__("none")

    def plan(self, requests, ctx):
        rows = np.ones((len(requests), ctx.num_layers), dtype=bool)
        order = sorted(range(len(requests)), key=lambda i: requests[i].tokens)
        rows[order[0], :2] = False
        rows[order[-1], 4:6] = False
        return ctx.planner(alpha=float("inf")).evaluate(Placement.from_mask(rows), requests)


class PausesAForB(Policy):
    """a and b together: infeasible, victim a. a alone: every layer on the device; b alone: every second layer on
    the host (distance 2)."""

    name = "pauses-a-for-b"
    pause_resume = True
    replan_on = frozenset({"batch"})

    def plan(self, requests, ctx):
        rids = tuple(r.request_id for r in requests)
        if len(rids) > 1:
            return Plan(rids, None, None, False, 0, None, float("inf"), victims=("a",))
        d = [None] if rids == ("a",) else [2]
        return Plan(rids, Placement.from_distances(ctx.num_layers, d), tuple(d), True, 8, None, 0.01)
