"""The adaptive controller (paper 4.4): decides when to ask the policy for a new plan.

Triggers: a batch change (arrival, finish, pause, resume), the plan's expiry step or the end of its decode
window (whichever comes first: ``Plan.replan_step``; nothing is guaranteed past the window), a profile mismatch
(measured step latency off the shared cost model's prediction for that very step, batch and placement, by
more than `mismatch_threshold`: per-layer compute and link bandwidth are then refreshed by EWMA), and, for
policies that want it, every step. An expiry is solved in the background (a planner process, or a thread:
runtime/background_planner.py) while the steps before it run, so the solver's cost stays off the critical path:
the solve starts one step ahead, or more when the last background solves took longer than a step
(:meth:`Controller.lead_steps`). If it is still running when the expiry comes and the plan in force still holds
(inside its window), that plan runs on and the new one is adopted at the first step after it is done, as the
simulator charges it; only past the window does the step wait for it, and for a solve with a budget not past
:meth:`Controller.ahead_wait_s` (a planner that never answers, hung or stopped, would hold every request of the
batch for good): then the planner is started afresh and the step solves inline (after ``AHEAD_GIVE_UPS`` such
waits in a row, every plan is solved inline). Every call is recorded.

On a virtual clock (the simulator) the solver's time is charged with :meth:`Controller.charge_solve_time`, by
the same rules: an expiry is solved ahead (:class:`~orbitflow.runtime.background_planner.ClockedPlanner`: the solve
runs at once and its plan is ready once the clock has moved on by its charged seconds), so the steps before it hide
it, the old plan runs on inside its window while it is not ready and the step waits for it past the window (at
most :meth:`Controller.ahead_wait_s` of the clock, then the step solves inline as in the engine); every
other solve (a batch change, a profile mismatch, every step, an expiry not solved ahead) is made while the step
waits, as the engine makes it, so the clock advances by its charged seconds.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from orbitflow.plan import Placement, Plan, PlanRequest, warm_up
from orbitflow.plan.cost_model import StepEstimate
from orbitflow.policies.base import PlanContext, Policy, uniform_count_plans
from orbitflow.runtime.background_planner import BackgroundPlanner, ClockedPlanner, resolve_mode

log = logging.getLogger(__name__)

LEAD_MARGIN = 1.25  # a background solve starts when the expiry is this many of its expected durations away ...
MAX_LEAD_STEPS = 8  # ... but at most this many steps ahead
AHEAD_WAIT_FLOOR_S = 30.0  # a step past the window waits this long at least for a solve ahead with a budget ...
AHEAD_WAIT_FACTOR = 20  # ... or this many of its time budget or of the slowest recent solve, if longer
AHEAD_GIVE_UPS = 2  # after this many such waits given up in a row, every plan is solved inline (none ahead)
RECORDS_KEPT = 4096  # the latest solves kept for inspection (`Controller.records`); their totals count every solve


def lead_steps(solve_s: Sequence[float], step_s: float | None) -> int:
    """Steps ahead of an expiry to start its background solve: enough steps of ``step_s`` to cover the slowest of
    the recent solves ``solve_s`` with ``LEAD_MARGIN``; 1 while either is unknown, at most ``MAX_LEAD_STEPS``."""
    if not solve_s or not step_s:
        return 1
    return int(min(MAX_LEAD_STEPS, max(1, math.ceil(LEAD_MARGIN * max(solve_s) / step_s))))


class _Ahead(NamedTuple):
    """The solve started ahead: for which step and batch, its future, and the planning inputs it was given."""

    step: int
    ids: list
    future: Future
    ctx: PlanContext


def _budget_text(ctx: PlanContext) -> str:
    nodes, secs = ctx.node_limit, ctx.time_limit_s
    return ", ".join(([f"{nodes} nodes"] if nodes is not None else [])
                     + ([f"{1000 * secs:g} ms"] if secs is not None else [])) or "none"


@dataclass
class PlanRecord:
    step: int
    trigger: str
    solve_s: float
    request_ids: list
    distances: list | None
    window: int | None
    expiry_step: int | None
    feasible: bool
    predicted_step_s: float
    background: bool = False
    proven: bool = True  # False when the planner's budget ran out before optimality (within --plan-gap) was proven
    gap: float = 0.0  # the planner's certified relative gap to the best possible plan
    charged_s: float | None = None  # seconds of virtual clock charged for this solve (simulator only)


class Controller:
    def __init__(
        self,
        policy: Policy,
        ctx: PlanContext,
        mismatch_threshold: float = 0.25,
        ewma: float = 0.3,
        background: str | bool = True,
    ):
        """``background``: where expiries known a step ahead are solved: ``process``, ``thread``, ``auto``
        (see background_planner.py) or ``off``; True/False mean thread/off."""
        self.policy = policy
        self.ctx = ctx  # the planning inputs now: a frozen snapshot, replaced (never changed) when one changes
        self.mismatch_threshold = mismatch_threshold
        self.ewma = ewma
        self.plan: Plan | None = None
        self.plan_ids: list = []
        self.plan_step = 0
        self.mismatch = False
        # The latest solves, for inspection (a server solves for as long as it runs: a list grew without bound, and
        # /metrics summed it at every scrape); their totals are counted as they come.
        self.records: deque[PlanRecord] = deque(maxlen=RECORDS_KEPT)
        self.solver_calls = 0
        self.solver_time_s = 0.0
        self.solver_budget_hits = 0  # solves whose budget (--plan-node-limit / --plan-time-limit-ms) ran out unproven
        self.solver_charged_s = 0.0  # seconds of virtual clock the solves were charged (simulator only)
        mode = resolve_mode(background)
        self._background = BackgroundPlanner(policy, mode) if mode != "off" else None
        self._ahead: _Ahead | None = None
        self._give_ups = 0  # waits for a solve ahead given up in a row (ahead_wait_s)
        self._clock = None  # set by charge_solve_time (simulator)
        self._solve_time: Callable[[float], float] | None = None
        self.adopted_late = 0  # re-plans adopted after the old plan ran on while they solved
        self.ran_on = 0  # steps past an expiry that ran the old plan because the solve ahead was not done
        self._ahead_solve_s: deque[float] = deque(maxlen=8)  # the last background solves' seconds (lead_steps)
        self._step_s: float | None = None  # EWMA of the measured decode step seconds (observe)
        # Load the compiled planner now (once per process): the first request's solve would otherwise pay for
        # numba's cache load (0.1-0.3 s, seconds without a cache) inside its first step.
        warm_up()

    def charge_solve_time(self, clock, solve_time: Callable[[float], float]) -> None:
        """Put every solve on ``clock``: ``solve_time(measured wall seconds)`` is what it costs there. Expiries
        are then solved ahead on that clock (:class:`ClockedPlanner`), as the engine solves them ahead in time."""
        self._clock = clock
        self._solve_time = solve_time
        if self._background is not None:
            self._background.close()
        self._background = ClockedPlanner(self.policy, clock, solve_time)

    def _charged(self, solve_s: float) -> float:
        """Seconds a solve of ``solve_s`` wall seconds takes on the clock the steps run on."""
        return float(self._solve_time(solve_s)) if self._clock is not None else solve_s

    # ---- when -------------------------------------------------------------------------------------
    def trigger(self, step: int, batch_ids: list) -> str | None:
        if self.plan is None or batch_ids != self.plan_ids:
            return "batch"
        wanted = self.policy.replan_on
        if "step" in wanted:
            return "step"
        if "mismatch" in wanted and self.mismatch:
            return "mismatch"
        if "expiry" in wanted and step >= self.plan_step + self.plan.replan_step:
            if self._ahead_running(step, batch_ids):
                self.ran_on += 1
                return None  # solved ahead and not done yet: the old plan runs on while its window lasts
            return "expiry"
        return None

    def _ahead_running(self, step: int, batch_ids: list) -> bool:
        """Whether the solve started ahead for this batch is still running and the plan in force still holds at
        ``step`` (inside its window: memory and the SLO were checked that far). Then waiting for the solve would
        put its remaining time into this step."""
        if self._ahead is None:
            return False
        ahead = self._ahead
        return (ahead.step <= step and ahead.ids == batch_ids and not ahead.future.done()
                and step < self.plan_step + self.plan.window)

    # ---- solving ----------------------------------------------------------------------------------
    def set_host_capacity(self, blocks: float) -> None:
        """Host blocks the batch may use from the next solve on (the engine tells it before each solve)."""
        if blocks != self.ctx.host_capacity_blocks:
            self.ctx = replace(self.ctx, host_capacity_blocks=blocks)

    def solve(self, requests: list[PlanRequest], step: int, trigger: str) -> Plan:
        """Plan now, unless the background thread already solved this very step for this batch."""
        ids = [r.request_id for r in requests]
        plan, ahead_s = None, None  # ahead_s: seconds of the background solve whose result this step took
        if self._ahead is not None:
            ahead = self._ahead
            self._ahead = None
            if ahead.step <= step and ahead.ids == ids and trigger == "expiry":
                plan, ahead_s = self._ahead_result(ahead, step)
                if plan is not None and ahead.step < step:  # it finished while the old plan ran on (trigger)
                    if plan.feasible and step < ahead.step + plan.replan_step:
                        self.adopted_late += 1
                        return self._install(plan, ids, ahead.step, trigger, ahead_s, None, background=True)
                    plan = None  # already expired, or infeasible: solve for this step (ahead_s stays counted)
        background = plan is not None
        start, inline = time.perf_counter(), plan is None
        if plan is None:
            plan = self.policy.plan(requests, self.ctx)
        if not plan.feasible and (len(requests) == 1 or not self.policy.pause_resume):
            # Nothing to pause (or a policy without Pause-Resume): settle for the fastest plan that fits
            # memory, SLO cap or not. This holds for a plan solved ahead on the planner thread too.
            plan, inline = self._settle(requests), True
        # The plan in force handed back as it is (Dynamic's decision reused until a block count changes) computed
        # nothing: no solve to charge, whatever the charge model (a fixed cost per call charged every step's reuse).
        reused = inline and plan is self.plan
        inline_s = time.perf_counter() - start if inline and not reused else None
        return self._install(plan, ids, step, trigger, ahead_s, inline_s, background)

    def _settle(self, requests: list[PlanRequest]) -> Plan:
        """The plan when nobody can be paused: the policy's fastest that fits memory, SLO cap or not (the request
        runs and misses its SLO rather than fail). A lone request the policy's space cannot place gets the fastest
        layer count that fits both pools: OrbitFlow's pruned counts jump from all layers offloaded to half of them,
        and a request too big for the host pool alone and for the device beyond a few layers fits neither, though
        admission (`Scheduler.fits_alone`) saw that some count holds it."""
        plan = self.policy.plan(requests, replace(self.ctx, alpha=math.inf))
        if plan.feasible or len(requests) > 1:
            return plan
        counts = uniform_count_plans(requests, self.ctx, range(self.ctx.num_layers + 1))
        fitting = [p for _, p in counts if p.feasible]
        return min(fitting, key=lambda p: (p.predicted_step_s, p.host_blocks), default=plan)

    def _ahead_result(self, ahead: _Ahead, step: int) -> tuple[Plan | None, float | None]:
        """The background solve's plan and seconds, or None (then the caller solves inline for ``step``) if it
        failed or did not come within :meth:`ahead_wait_s` of the budget it was submitted with."""
        wait_s = self.ahead_wait_s(ahead.ctx)
        try:
            plan, solve_s = ahead.future.result(timeout=wait_s)
            self._ahead_solve_s.append(self._charged(solve_s))
            self._give_ups = 0
            return plan, solve_s
        except BrokenProcessPool:
            self._background.fall_back_to_thread()
        except TimeoutError:  # concurrent.futures' too (an alias since Python 3.11)
            self._give_ups += 1
            last = self._give_ups >= AHEAD_GIVE_UPS
            log.error("step %d waited %.1f s for the plan solved ahead on the planner %s (budget: %s); %s", step,
                      wait_s, self._background.mode, _budget_text(ahead.ctx),
                      f"that is {self._give_ups} times: solving every plan inline from now on" if last
                      else "starting the planner afresh and solving inline")
            if last:
                self._background.close()
                self._background = None  # ahead_step: nothing is solved ahead any more
            else:
                self._background.restart()
        except Exception:
            log.exception("background plan failed; solving inline")
        return None, None

    def ahead_wait_s(self, ctx: PlanContext | None = None) -> float | None:
        """Seconds a step past the old plan's window waits for the solve ahead before giving up on the planner:
        ``AHEAD_WAIT_FACTOR`` times the solve's time budget or the slowest recent background solve, and
        ``AHEAD_WAIT_FLOOR_S`` at least. None (wait for good) for a solve without a budget (``--plan-node-limit
        none`` and no ``--plan-time-limit-ms``): a proof may take that long, and solving it again inline would too.
        ``ctx``: the planning inputs the solve was submitted with (default: those now)."""
        ctx = ctx or self.ctx
        if ctx.node_limit is None and ctx.time_limit_s is None:
            return None
        longest = max([ctx.time_limit_s or 0.0, *self._ahead_solve_s])
        return max(AHEAD_WAIT_FLOOR_S, AHEAD_WAIT_FACTOR * longest)

    def ahead_step(self, step: int) -> int | None:
        """With ``step`` the next step to run: the step whose plan to start solving in the background now, or None.

        That is the plan's expiry once it is at most :meth:`lead_steps` steps after ``step``, so a solve that takes
        longer than a step starts early enough to be done when the expiry comes. An expiry at ``step`` itself (a plan
        whose window is one step) is too close: the solve would run while ``step`` does and be for a later step, and
        ``step`` solves its plan at once anyway (``trigger``), which drops a solve for a later step unused."""
        if self._background is None or self.plan is None or "expiry" not in self.policy.replan_on:
            return None
        if self._ahead is not None:
            return None
        due = self.plan_step + self.plan.replan_step
        return due if step < due <= step + self.lead_steps() else None

    def lead_steps(self) -> int:
        """:func:`lead_steps` of the last background solves and the decode steps' EWMA."""
        return lead_steps(self._ahead_solve_s, self._step_s)

    def solve_ahead(self, requests_next: list[PlanRequest], step_next: int) -> None:
        """Start solving the plan for step ``step_next`` now, in the background (the caller passes the batch as
        it will be then: every request that many tokens longer, its Token-Deposit balance moved on by the plan in
        force's predicted steps, ``scheduler.deposit_ahead``). The solve gets the current snapshot of the planning
        inputs; later changes replace ``self.ctx`` and leave that snapshot alone."""
        try:
            future = self._background.submit(requests_next, self.ctx)
        except BrokenProcessPool:  # the planner process died between solves
            self._background.fall_back_to_thread()
            future = self._background.submit(requests_next, self.ctx)
        self._ahead = _Ahead(step_next, [r.request_id for r in requests_next], future, self.ctx)

    def _install(self, plan: Plan, ids: list, step: int, trigger: str, ahead_s: float | None,
                 inline_s: float | None, background: bool) -> Plan:
        """Record and adopt a solve's plan. ``ahead_s``: seconds of the background solve this decision took (None:
        none), its plan's (``background``) or one found expired or infeasible when it came; ``inline_s``: seconds
        solved while the step waited (None: none). On a virtual clock the inline part moves the clock; the
        background part was charged on it while the steps ran (:class:`ClockedPlanner`)."""
        charged = None
        if self._clock is not None:
            waited = self._charged(inline_s) if inline_s is not None else 0.0
            self._clock.advance(waited)  # the batch waits for what was solved inline
            charged = waited + (self._charged(ahead_s) if ahead_s is not None else 0.0)
        record = PlanRecord(
            step=step, trigger=trigger, solve_s=(ahead_s or 0.0) + (inline_s or 0.0), request_ids=list(ids),
            distances=list(plan.distances) if plan.distances is not None else None,
            window=plan.window, expiry_step=plan.expiry_step, feasible=plan.feasible,
            predicted_step_s=float(plan.predicted_step_s), background=background,
            proven=plan.stats.proven(self.ctx.gap), gap=float(plan.stats.gap or 0.0), charged_s=charged,
        )
        self.records.append(record)
        self.solver_calls += 1
        self.solver_time_s += record.solve_s
        self.solver_budget_hits += not record.proven
        self.solver_charged_s += charged or 0.0
        if plan.feasible:
            self._adopt(plan, ids, step)
        return plan

    def _adopt(self, plan: Plan, ids: list, step: int) -> None:
        """Put a feasible plan in place; it is also the next search's first try."""
        self.plan, self.plan_ids, self.plan_step = plan, list(ids), step
        previous = MappingProxyType(dict(zip(ids, plan.distances))) if plan.distances is not None else None
        self.ctx = replace(self.ctx, previous=previous)
        self.mismatch = False

    def forget(self) -> None:
        self.plan, self.plan_ids = None, []

    # ---- observing --------------------------------------------------------------------------------
    def predict(self, on_device: list[list[bool]], blocks_per_layer: list[int], total_tokens: int) -> float:
        """Step latency of a decode step of this batch under the placement in force, by the shared cost model
        (the profile's, as the simulator charges it, with the EWMA refresh applied): what `observe` checks."""
        return float(self.estimate(on_device, blocks_per_layer, total_tokens).total_s)

    def estimate(self, on_device: list[list[bool]], blocks_per_layer: list[int], total_tokens: int) -> StepEstimate:
        """:meth:`predict` term by term (compute, stalls)."""
        mask = np.asarray(on_device, dtype=bool).reshape(len(blocks_per_layer), -1)
        return self.ctx.cost_model.step(Placement.from_mask(mask), blocks_per_layer, total_tokens=total_tokens)

    def observe(self, predicted_s: float, measured_s: float, layer_compute_s: list[float],
                total_tokens: int, link_blocks_per_s: float | None, num_requests: int = 1,
                host_layers: list[bool] | None = None) -> None:
        """Compare a decode step with its prediction (made by the planner with the profile's cost model, the
        one the simulator charges); on mismatch refresh that model's compute scale and link rate by EWMA.
        ``host_layers``: the layers that read prefetched KV (their measured compute holds the model's
        ``host_layer_s``, which the scale must not learn)."""
        self._step_s = measured_s if self._step_s is None else (1 - self.ewma) * self._step_s + self.ewma * measured_s
        if predicted_s <= 0 or abs(measured_s - predicted_s) <= self.mismatch_threshold * predicted_s:
            return
        self.mismatch = True
        cm = self.ctx.cost_model
        base = np.asarray(cm.compute(total_tokens if cm.depends_on_tokens else None, num_requests))
        base = base / cm.layer_compute_scale
        measured = np.asarray(layer_compute_s, dtype=float)
        if host_layers is not None:
            measured = cm.base_layer_compute(measured, host_layers)
        observed_scale = np.clip(measured / np.maximum(base, 1e-12), 0.05, 20.0)
        scale = (1 - self.ewma) * cm.layer_compute_scale + self.ewma * observed_scale
        link = None
        if link_blocks_per_s:
            link = (1 - self.ewma) * cm.link_blocks_per_s + self.ewma * link_blocks_per_s
        self.ctx = replace(self.ctx, cost_model=cm.with_updates(layer_compute_scale=scale, link_blocks_per_s=link))

    def close(self) -> None:
        if self._background is not None:
            self._background.close()
