"""The scheduler: owns the waiting, running and paused requests, admission and Pause-Resume (paper 4.3).

Each step, `schedule()` decides in three phases and returns a `ScheduleOutput`:
1. `_schedule_waiting`: resume paused requests, then admit waiting ones, while the policy (through the
   controller) finds a feasible plan for the bigger batch; when none is, the policy's victim is paused.
   A new request whose KV the pools could not hold to its last token beside the admitted ones waits, in
   order, until one finishes (`KVManager.can_allocate`); one that no placement could hold even alone ends at
   `add_request`, before it runs (`fits_alone`).
2. `_schedule_running`: re-plan when the controller says so (batch change, expiry, mismatch), pausing
   victims until the plan is feasible.
3. `_schedule_batch`: install the plan (the KV manager allocates new requests and moves only layers whose
   tier changed) and grow every scheduled row's KV; a shortage there is an answer, not an exception
   (re-plan next step, or end the request that cannot be served). Then build the output.

Pause-Resume. A paused request keeps its KV (its device layers are evicted lazily, only when their space is
needed), so it sits in its own `paused` queue rather than back in `waiting` as a preempted request would in
vLLM, and it comes back under its own gate: only after some in-flight request has completed (the paper's
rule: without it, measurement noise flips feasibility and requests thrash), and only when a plan holds it
without pausing anyone. Paused requests come before new ones, most-paused first; once back, a request may be chosen as
a victim again if a newcomer overloads the batch (the paper's "a new or previously paused request"). The victims a
new request needs are set aside and paused only once a plan holds it: if it must wait after all, nobody was paused for
it.
A layer's blocks live in one pool, so a lone request can outgrow every split of its layers between the device
budget and the host KV the paused requests leave, though the pools hold everyone (admission's check): it is then
paused too, and a paused request runs in its place (`_blocked_by_paused`). When no paused request can run beside
the others' KV and nothing else runs, the last in line gives up its KV and waits to compute it again (`_recompute`,
vLLM's recompute preemption), so no admitted request ends for lack of room.

Order of new requests: FCFS admits in arrival order; SRTF the one with the fewest remaining output tokens
(known from `max_tokens`) first.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from orbitflow.config import EngineConfig
from orbitflow.kv.manager import KVManager
from orbitflow.plan import Plan, PlanRequest
from orbitflow.plan.deposit import balance_after
from orbitflow.plan.placement import capacity_terms, memory_blocks, most_blocks
from orbitflow.runtime.controller import Controller
from orbitflow.runtime.outputs import ScheduleOutput, SeqInput, StepResult
from orbitflow.runtime.request import Request, Status

log = logging.getLogger("orbitflow.engine")

# Only once even the controller's lone-request fallback (any layer count, SLO or not) found no placement: the
# request's KV does not fit the device budget and the host KV left to it, whatever the split.
NO_FIT = "request's KV does not fit the device KV budget and the host pool left to it at any layer placement"


# Times in a row a request may be paused without having moved on since it was let in (admitted or resumed): past
# it, it keeps its place (the newcomer that would have paused it waits), so no request starves under steady load.
# Without the bound, simulator runs at SLO scale 1 paused one request up to 5 times in a row before it moved on.
MAX_IDLE_PAUSES = 2


def deposit_ahead(balance: float, pace_s: float, steps_s: Sequence[float]) -> float:
    """A request's Token-Deposit balance after steps of ``steps_s`` seconds, for a solve started that many steps before
    its own: ``balance`` now, moved by the planner's fluid model (plan/deposit.py: a step of ``T`` seconds adds
    ``1 - T / pace_s``, clamped at 0). A solve ahead took the balance of its start: over steps slower than the pace
    that is more than the steps before its plan leave it, so the plan spent margin it would not have."""
    balance = float(balance)
    steps = [float(t) for t in steps_s]
    if not steps or not all(math.isfinite(t) for t in steps):
        return balance
    n = len(steps)
    return balance_after(balance, pace_s, steps, list(range(n)), list(range(1, n + 1)), n)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, controller: Controller, num_layers: int,
                 clock: Callable[[], float]):
        self.config = config
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.order = config.scheduler.scheduling  # "fcfs" | "srtf"
        self.kv = kv
        self.controller = controller
        self.num_layers = num_layers
        self.block_size = config.cache.block_size
        self.now = clock
        self.requests: dict[str, Request] = {}  # live (not finished) requests by id
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.paused: list[Request] = []
        self.step = 0  # steps executed so far (the step the next output is for)
        self._just_finished: list[Request] = []  # finished since the engine last took them (`take_finished`)
        self._installed: tuple[Plan, list] | None = None  # the plan now in place, and its request ids
        self._batch_version = 0  # bumps on arrival, finish and pause
        self._completions = 0  # requests that held KV and finished so far (the resume gate)
        self._admission_blocked_at: int | None = None  # version at which admission last found no room
        self._out: ScheduleOutput | None = None  # the output being built by `schedule`

    # ---- requests in and out ----------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue `req`, or end it at once (before it runs) when no placement could ever hold it alone."""
        self.requests[req.request_id] = req
        blocks = self.final_blocks(req)
        if not self.fits_alone(blocks):
            self._finish(req, "error", error=f"{req.length_text} {self.no_fit_reason(blocks)}")
            return
        self.waiting.append(req)
        self._batch_version += 1

    def finish_requests(self, request_ids, reason: str, error: str | None = None) -> None:
        """End live requests (abort, error, stop): leave their queue, free their KV, stamp them. Unknown or
        already finished ids are ignored. The engine publishes them (`take_finished`)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, reason, error)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        now = self.now()
        for bucket in (self.waiting, self.running, self.paused):
            if req in bucket:
                bucket.remove(req)
        held_kv = req.request_id in self.kv.tables
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)  # a later abort of it is then a no-op
        req.deposit.flush(now)
        req.delivered_s = [min(d, now) for d in req.delivered_s]
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finished_s = now
        if held_kv:  # what the resume gate waits for: memory freed (not the end of one that never ran)
            self._completions += 1
        self._batch_version += 1
        self._just_finished.append(req)
        if self._out is not None:
            self._out.finished_ids.append(req.request_id)

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call, in finishing order."""
        done, self._just_finished = self._just_finished, []
        return done

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.paused)

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> ScheduleOutput:
        """Decide this step: admit and resume, re-plan (pausing victims), install the plan, pick the batch."""
        self._out = out = ScheduleOutput(step=self.step)
        try:
            self._schedule_waiting()
            self._schedule_running()
            if self.running:
                self._schedule_batch(out)
        finally:
            self._out = None
        out.plan = self.controller.plan
        return out

    def update_from_output(self, out: ScheduleOutput, result: StepResult) -> None:
        """The step ran: its rows' KV now holds their new tokens; a decode step's measurement goes to the
        controller (profile mismatch, EWMA refresh)."""
        for seq in out.seqs:
            req = self.requests.get(seq.req_id)
            if req is not None:
                req.num_cached = seq.start_pos + len(seq.token_ids)
        if out.is_decode and out.predicted_step_s is not None:
            self.controller.observe(out.predicted_step_s, result.step_s, result.layer_compute_s, out.total_tokens,
                                    result.link_blocks_per_s, num_requests=len(out.seqs), host_layers=out.host_layers)

    def finish_step(self) -> None:
        """After the step's outputs are processed: count it, and start solving the plan of a coming expiry in the
        background when the controller says it is time (``Controller.ahead_step``: the batch as it will be then,
        every request that many tokens longer)."""
        self.step += 1
        target = self.controller.ahead_step(self.step) if self.running else None
        if target is not None:
            self.controller.solve_ahead(self._plan_requests(self.running, ahead=target - self.step), target)

    def step_failed(self, out: ScheduleOutput, error: str) -> None:
        """The executor raised: the step is lost, its requests end with the error, the plan is dropped."""
        self.finish_requests([s.req_id for s in out.seqs], "error", error)
        self.controller.forget()

    # ---- admission (phase 1) ----------------------------------------------------------------------
    def candidates(self) -> list[Request]:
        """Paused requests first (most-paused, then longest paused), then waiting ones in policy order."""
        resume = sorted(self.paused, key=lambda r: (-r.num_pauses, r.paused_at_step or 0, r.arrival_s))
        if self.order == "srtf":
            fresh = sorted(self.waiting, key=lambda r: (r.remaining_tokens, r.arrival_s))
        else:
            fresh = sorted(self.waiting, key=lambda r: r.arrival_s)
        return resume + fresh

    def fits(self, candidate: Request) -> bool:
        """The batch limits (--max-num-seqs, --max-num-batched-tokens) with `candidate` added."""
        if len(self.running) >= self.max_num_seqs:
            return False
        if not self.running:  # a single request longer than the cap still runs alone
            return True
        tokens = sum(r.num_tokens + r.remaining_tokens for r in self.running)
        return tokens + candidate.num_tokens + candidate.remaining_tokens <= self.max_num_batched_tokens

    def _schedule_waiting(self) -> None:
        if self._admission_blocked_at == self._batch_version:
            return  # nothing changed since admission last found no room: do not re-solve every step
        self._admission_blocked_at = None
        self._admit()
        while not self.running and (holders := [p for p in self.candidates()[:len(self.paused)]
                                                if p.request_id in self.kv.tables]):
            # Nobody runs, and every paused request needs host KV that another paused request holds (and no new one
            # could start); only the split of layers between the pools brings this about (admission saw that the pools
            # together hold them all). The last in line that holds KV gives it up, to compute it again once admitted,
            # and the others try again. Scheduling allocates no KV, so this ends within len(holders) rounds.
            self._recompute(holders[-1])
            self._admit()

    def _admit(self) -> None:
        """Resume and admit candidates in order until one must wait."""
        blocked = False  # a paused request could not run beside the other paused requests' KV
        for cand in self.candidates():
            if blocked and cand.status is not Status.PAUSED:
                # No newcomer overtakes a paused request: once nothing runs, `_schedule_waiting` breaks the paused
                # requests' deadlock (else newcomers kept the batch busy, and the paused requests waited forever).
                return
            if not self.fits(cand) or not self._may_try(cand):
                return
            placed = self._plan_with(cand)
            if placed is None:
                blocked = True
                continue  # it cannot run alone beside the paused requests' KV: the next paused one may
            if not placed:
                return
            if cand.finished:
                continue
            if cand.status is Status.PAUSED:
                self.paused.remove(cand)
                self._out.resumed_ids.append(cand.request_id)
            else:
                self.waiting.remove(cand)
            cand.status = Status.RUNNING
            cand.outputs_at_start, cand.cached_at_start = len(cand.output_ids), cand.num_cached
            self.running.append(cand)

    def _may_try(self, cand: Request) -> bool:
        """The resume gate for a paused candidate, the KV admission check for a new one; a refusal blocks
        admission until the batch changes."""
        if cand.status is Status.PAUSED:
            # The paper's gate: resume only after some in-flight request has completed (and a plan then
            # holds it). Without it, measurement noise flips feasibility and requests thrash.
            ok = not (self.running and self._completions == cand.completions_at_pause)
        else:
            # Not now: it waits (FCFS order holds) until a request finishes and frees memory. add_request
            # guaranteed that it fits an empty engine, so it cannot wait forever.
            ok = self.kv_fits(cand)
        if not ok:
            self._admission_blocked_at = self._batch_version
        return ok

    def _plan_with(self, cand: Request) -> bool | None:
        """Find a feasible plan for the running batch plus `cand`, setting the policy's victims aside; they are paused
        only once a plan holds `cand`. False when `cand` must keep waiting, and nobody is paused (it would be the
        victim, or it is a paused request and someone would be, or it cannot run even alone beside the running
        requests' KV); None when it cannot run even alone while other paused
        requests hold the host KV it needs (`_blocked_by_paused`: the next candidate may run instead)."""
        resuming = cand.status is Status.PAUSED
        aside: list[Request] = []
        while True:
            trial = [r for r in self.running if r not in aside] + [cand]
            plan = self.controller.solve(self._plan_requests(trial), self.step, "batch")
            if plan.feasible:
                for victim in aside:  # the plan just installed is the one for the batch without them
                    self._pause_request(victim, keep_plan=True)
                return True
            if len(trial) == 1 and aside:
                self.controller.forget()  # not even alone beside the running requests' KV: it waits for them
                self._admission_blocked_at = self._batch_version
                return False
            if len(trial) == 1:
                if self._blocked_by_paused(cand):
                    self.controller.forget()
                    return None
                self._finish(cand, "error", error=NO_FIT)
                return True
            victim = self._victim(plan, trial)
            # A paused request comes back only when a plan holds it without pausing anyone (the overload
            # has cleared); until then no new request overtakes it. Once back it is a running request like any other:
            # if a newcomer overloads the batch again, the policy may choose it as the victim again (paper 4.4: "a
            # new or previously paused request"), even in the same pass (keeping it and making the newcomer wait cost
            # TPOT attainment on the simulator: 0.909 -> 0.872 at SLO scale 1, rate scale 3, 5 seeds); but not a
            # victim already set aside MAX_IDLE_PAUSES times in a row without moving on: it keeps its place and the
            # newcomer waits. Else, under steady arrivals, a request resumed by each completion was paused again for
            # the next arrival before its first step, and never made another token (1 in 300 steps).
            if resuming or victim is cand or (not victim.progressed() and victim.idle_pauses >= MAX_IDLE_PAUSES):
                self.controller.forget()
                self._admission_blocked_at = self._batch_version
                return False  # it would be paused at once: keep it waiting until load allows
            aside.append(victim)

    @property
    def prefetch_slots(self) -> int:
        """Layers of prefetch buffer each request may hold (the policy's prefetch depth)."""
        return self.controller.ctx.cost_model.prefetch_slots

    def final_blocks(self, req: Request) -> int:
        """Blocks per layer the request's KV grows to at most."""
        return math.ceil(req.max_total_tokens / self.block_size)

    def kv_fits(self, cand: Request, ahead: list[Request] = ()) -> bool:
        """Whether both pools together can hold `cand` to its last token while every admitted request (and
        every request of `ahead`, queued before it) also grows to its last token, plus the largest prefetch
        buffer any plan could ask for (prefetch-depth layers of every request). Then no plan of theirs can
        run the host pool dry."""
        admitted = self.running + self.paused + list(ahead) + [cand]
        needed = most_blocks(sum(self.final_blocks(r) for r in admitted), self.num_layers, self.prefetch_slots)
        return self.kv.can_allocate(needed, [r.request_id for r in admitted])

    def fits_alone(self, final_blocks: int) -> bool:
        """Whether some layer count holds a request alone to its last token (`final_blocks` per layer, as
        `final_blocks` counts them): that many layers in the host pool, the
        others plus the prefetch buffer in the device budget. A layer's blocks live in one pool, so the sum check
        (`kv_fits`, the engine's `most_blocks`) can pass for a request that no split holds. One that this passes,
        the controller's lone-request fallback can place while no paused request holds host blocks (it plans with
        the host pool left to the batch)."""
        blocks = np.array([[final_blocks]], dtype=float)
        device, host = self.controller.ctx.capacity_blocks, self.kv.host_pool.num_blocks
        for offloaded in range(self.num_layers + 1):
            on_host = (np.arange(self.num_layers) < offloaded)[None, :]  # which layers does not change the sum
            if offloaded * blocks[0, 0] <= host and memory_blocks(on_host, blocks, self.prefetch_slots)[0] <= device:
                return True
        return False

    def no_fit_reason(self, final_blocks: int) -> str:
        """Why `fits_alone` refuses `final_blocks` per layer, naming what to change."""
        return (f"needs {final_blocks} KV blocks per layer, and no split of its {self.num_layers} layers fits "
                f"the device KV budget ({self.controller.ctx.capacity_blocks} blocks, prefetch buffer included) "
                f"and the host pool ({self.kv.host_pool.num_blocks} blocks); lower max_tokens or the prompt, or "
                "raise --device-kv-blocks or --host-kv-blocks")

    # ---- re-planning and Pause-Resume (phase 2) ---------------------------------------------------
    def _schedule_running(self) -> None:
        while self.running:
            ids = [r.request_id for r in self.running]
            trigger = self.controller.trigger(self.step, ids)
            if trigger is None:
                return
            plan = self.controller.solve(self._plan_requests(self.running), self.step, trigger)
            if plan.feasible:
                return
            if len(self.running) == 1:
                lone = self.running[0]
                if self._blocked_by_paused(lone) and lone.progressed():
                    # It grew past what the pools hold beside the paused requests' KV: it steps aside and they run
                    # (it has made progress since it started, an output or a prefill chunk, so two requests cannot
                    # swap forever without any)
                    log.info("request %s is paused: no split of its layers fits beside the paused requests' KV",
                             lone.request_id)
                    self._pause_request(lone)
                else:
                    self._finish(lone, "error", error=NO_FIT)
            else:
                self._pause_request(self._victim(plan, self.running))

    def _blocked_by_paused(self, req: Request) -> bool:
        """Whether `req`, which no plan places alone, might be placed once the other paused requests are gone:
        some of them hold KV. It fits the empty pools: `add_request` checked `fits_alone`, whose inputs (its last
        token, the device budget, the host pool) never change. A layer's blocks live in one pool, so the pools can
        hold everyone's blocks together (admission's check) while no split of `req`'s layers fits what the paused
        requests leave."""
        return any(p is not req and p.request_id in self.kv.tables for p in self.paused)

    def _victim(self, plan: Plan, batch: list[Request]) -> Request:
        """Whom to set aside: the policy's victim, or (without Pause-Resume) the newest request, as a
        capacity preemption would."""
        if self.controller.policy.pause_resume:
            by_id = {r.request_id: r for r in batch}
            for rid in plan.victims:
                if rid in by_id:
                    return by_id[rid]
        return batch[-1]

    def _pause_request(self, req: Request, keep_plan: bool = False) -> None:
        """The one place a request is paused: its status, counters, the KV manager (its device layers become
        evictable) and the plan (dropped: the batch changed; kept when it was solved for the batch without `req`)."""
        self.running.remove(req)
        req.status = Status.PAUSED
        req.num_pauses += 1
        req.idle_pauses = 0 if req.progressed() else req.idle_pauses + 1
        req.paused_at_step = self.step
        req.completions_at_pause = self._completions
        self.paused.append(req)
        self._out.paused_ids.append(req.request_id)
        self._batch_version += 1
        if req.request_id in self.kv.tables:
            self.kv.pause(req.request_id)
        if not keep_plan:
            self.controller.forget()

    def _recompute(self, req: Request) -> None:
        """The one place a paused request gives up its KV (vLLM's recompute preemption): it waits again, in its
        arrival order, and once admitted its prompt and outputs so far prefill again (`Request.next_input`); its
        outputs, deposit and pause count stay, so its client sees only the delay."""
        log.warning("request %s gives up its KV: it and the other paused requests cannot run beside each other's KV; "
                    "it computes its %d tokens again once admitted", req.request_id, req.num_tokens)
        self.paused.remove(req)
        self.kv.free(req.request_id)
        req.num_cached = 0
        req.num_recomputes += 1
        req.status = Status.WAITING
        self.waiting.append(req)
        self._batch_version += 1
        self._out.recomputed_ids.append(req.request_id)

    def _plan_requests(self, reqs: list[Request], ahead: int = 0) -> list[PlanRequest]:
        """The batch as the planner sees it; also tells the planner how much of the host pool is left to
        this batch (everything but what paused requests hold there)."""
        now = self.now()
        for r in reqs:  # delivered tokens leave the deposits here, on the engine loop (plan_inputs only reads)
            r.deposit.pop_due(now)
        requests, host_capacity = self.plan_inputs(reqs, ahead)
        self.controller.set_host_capacity(host_capacity)
        return requests

    def plan_inputs(self, reqs: list[Request], ahead: int = 0) -> tuple[list[PlanRequest], int]:
        """The planner's view of `reqs` `ahead` steps on, and the host blocks left to them; changes nothing
        (the replica state's what-if asks the planner about a batch the engine is not running)."""
        now = self.now()
        held = 0
        for r in reqs:
            table = self.kv.tables.get(r.request_id)
            if table is not None:
                held += table.host_blocks()
        host_capacity = self.kv.host_pool.num_blocks - (self.kv.host_pool.num_used - held)
        deposits = self.config.planner.token_deposit
        steps_s = self._steps_ahead_s(ahead)
        return [r.plan_request(self.block_size, ahead, deposit_ahead(r.deposit.balance(now), r.pace_s, steps_s)
                               if deposits else 0.0) for r in reqs], host_capacity

    def _steps_ahead_s(self, ahead: int) -> list[float]:
        """What the plan in force predicts the ``ahead`` steps from this one take (per step of its window, its last
        for steps past it); none without a feasible plan in force."""
        plan = self.controller.plan
        if not ahead or plan is None or not plan.feasible:
            return []
        latencies = plan.step_latencies_s or (plan.predicted_step_s,)
        first = self.step - self.controller.plan_step
        return [latencies[min(max(k, 0), len(latencies) - 1)] for k in range(first, first + ahead)]

    # ---- the batch (phase 3) ----------------------------------------------------------------------
    def _schedule_batch(self, out: ScheduleOutput) -> None:
        if not self._install_plan(out):
            return
        chunk = self.config.scheduler.chunked_prefill
        prefilling = [r for r in self.running if not r.prefilled]
        if prefilling and chunk is None:
            batch = prefilling  # the paper's behaviour: decoding waits while new prompts prefill
        elif prefilling:
            batch = [r for r in self.running if r.prefilled] + prefilling[:1]
        else:
            batch = list(self.running)
        for req in batch:
            tokens, start, sample = req.next_input(chunk)
            short = self.kv.grow(req.request_id, start + len(tokens))
            if short is not None:
                if short.tier == "host":
                    self._finish(req, "error", error=f"out of KV memory: {short}")
                else:
                    self.controller.forget()
                continue
            out.seqs.append(SeqInput(req.request_id, tokens, start, sample, req.sampling, len(req.output_ids),
                                     req.prompt_ids, req.output_ids))
        self._room_for_prefetch(out.seqs)
        if out.is_decode and self.controller.plan is not None:
            # what the cost model (the simulator's) predicts for this step's batch and placement
            out.total_tokens = sum(s.start_pos + 1 for s in out.seqs)
            on_device = [self.kv.tables[s.req_id].on_device for s in out.seqs]
            out.host_layers = [not all(col) for col in zip(*on_device)]
            out.predicted_step_s = self.controller.predict(
                on_device, [self.kv.blocks_for(s.start_pos) for s in out.seqs], out.total_tokens)

    def _room_for_prefetch(self, seqs: list[SeqInput]) -> None:
        """Free the device blocks the step's prefetch buffer takes (the capacity equation's buffer term, which the plan
        counted inside the budget): a paused request's device layers give way only on demand, and only a grow or a
        move asked for room, so the staging slots found the budget taken by them and overflowed past it (into
        scratch memory the budget does not count)."""
        if not self.kv.paused:
            return
        rows = [self.kv.tables[s.req_id] for s in seqs if s.start_pos > 0]  # a prefill fetches nothing
        host = np.array([[not d for d in t.on_device] for t in rows], dtype=bool).reshape(len(rows), self.num_layers)
        if not host.any():
            return
        blocks = np.array([[t.blocks_per_layer for t in rows]], dtype=float)
        _, buffer = capacity_terms(host, blocks, self.prefetch_slots)
        short = self.kv.make_room(int(buffer[0]))
        if short is not None:  # the evicted layer has nowhere to go: the slots overflow, and count it
            log.warning("no room for the prefetch buffer: %s", short)

    def _install_plan(self, out: ScheduleOutput) -> bool:
        """Put the plan in force into the KV manager: allocate new requests in their rows, move only the
        layers whose tier changed. False (and no batch this step) on a shortage."""
        plan, ids = self.controller.plan, self.controller.plan_ids
        if self._installed is not None and self._installed[0] is plan and self._installed[1] == ids:
            return True  # already in place: nothing to move
        rows = {rid: [bool(x) for x in plan.placement.mask[i]] for i, rid in enumerate(ids)}  # True = on device
        for req in self.running:
            if req.request_id not in self.kv.tables:
                self.kv.allocate(req.request_id, 0, rows[req.request_id])  # no blocks yet: never short
        running_rows = {r.request_id: rows[r.request_id] for r in self.running}
        short = self.kv.apply_placements(running_rows)
        if short is not None:
            self.controller.forget()
            if short.tier == "host":  # cannot happen after kv_fits admitted everyone; never spin on it
                newest = max(self.running, key=lambda r: r.arrival_s)
                self._finish(newest, "error", error=f"KV memory exhausted: {short}")
            else:
                log.warning("installing the plan failed (%s); re-planning", short)
            return False
        out.placement = running_rows
        self._installed = (plan, list(ids))
        return True
