"""The engine loop: continuous batching over an executor, steered by a policy through the controller.

One iteration (`step`):
1. take in new requests and aborts (thread-safe inbox);
2. resume paused requests, then admit waiting ones, while the policy finds a plan for the bigger batch
   (OrbitFlow pauses the policy's victim when none is feasible); a request whose KV the pools cannot
   hold beside the admitted ones waits (in order) until one finishes;
3. re-plan when the controller says so, pausing victims until the plan is feasible;
4. install the plan: the KV manager moves only layers whose tier changed;
5. run one step: a prefill of newly admitted prompts (decoding waits, as in the paper) or, with
   chunked prefill, one chunk beside the decode batch; otherwise one decode step;
6. stamp each new token's delivery time with its Token-Deposit, finish requests, free their blocks.
   What fails for one request there (its sampling, its stop check, a listener) ends that request alone.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from orbitflow.config import EngineConfig
from orbitflow.kv.pool import OutOfBlocks
from orbitflow.plan import Plan, PlanRequest
from orbitflow.policies.base import PlanContext, Policy
from orbitflow.runtime.controller import Controller
from orbitflow.runtime.deposit import SLO_TOLERANCE_S, TokenDeposit
from orbitflow.runtime.executor import SeqInput, StepResult
from orbitflow.runtime.request import Request, Status
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.runtime.scheduler import Scheduler

log = logging.getLogger("orbitflow.engine")


class RequestRejected(ValueError):
    """The request can never be served (too long for the model or for KV memory)."""


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue_len`: the request may be retried later."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class TokenEvent:
    request_id: str
    token: int | None  # None for a pure finish / error event
    generated_s: float
    due_s: float  # when Token-Deposit releases it to the client
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None  # of `token`, when the request asked for logprobs
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    pauses: int = 0
    resumes: int = 0
    busy_s: float = 0.0
    stall_s: float = 0.0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    device_blocks_peak: int = 0
    host_blocks_peak: int = 0
    device_util_sum: float = 0.0  # sum over decode steps of device blocks used / budget
    generated_violations: int = 0
    delivered_violations: int = 0
    step_s: deque = field(default_factory=lambda: deque(maxlen=100_000))

    @property
    def device_mem_util(self) -> float:
        return self.device_util_sum / self.decode_steps if self.decode_steps else 0.0


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        executor,
        policy: Policy,
        ctx: PlanContext,
        clock,
        default_slo_s: float,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int | None = None,
    ):
        self.config = config
        self.executor = executor
        self.kv = executor.kv
        self.policy = policy
        self.clock = clock
        self.default_slo_s = default_slo_s
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.num_layers = executor.num_layers
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, config.scheduling)
        self.controller = Controller(
            policy, ctx, config.mismatch_threshold, config.ewma, background=config.plan_in_background
        )
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.paused: list[Request] = []
        self.finished: deque[Request] = deque(maxlen=100_000)  # in finishing order; bounded for long-running servers
        self.listeners: list[Callable[[TokenEvent], None]] = []
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._add_lock = threading.Lock()  # makes the queue-length check and the enqueue one step
        self._wakeup = threading.Event()
        self._last_prediction: tuple[float, int, int] | None = None  # (step seconds, tokens, requests)
        self._installed: tuple[Plan, list] | None = None  # the plan now in place, and its request ids
        self._batch_version = 0  # bumps on arrival, finish and pause
        self._completions = 0  # requests finished so far (the resume gate)
        self._admission_blocked_at: int | None = None  # version at which admission last found no room

    # ---- public, thread-safe ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        slo_s: float | None = None,
        arrival_s: float | None = None,
        target_output_tokens: int | None = None,
    ) -> Request:
        if not prompt_ids:
            raise RequestRejected("prompt must contain at least one token")
        slo = slo_s or self.default_slo_s
        req = Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            arrival_s=self.clock.now() if arrival_s is None else arrival_s,
            slo_s=slo,
            deposit=TokenDeposit(slo, enabled=self.config.token_deposit),
            eos_token_ids=self.eos_token_ids,
            target_output_tokens=target_output_tokens,
        )
        if self.max_model_len is not None and req.max_total_tokens > self.max_model_len:
            raise RequestRejected(
                f"prompt ({req.num_prompt} tokens) plus max_tokens ({req.max_output_tokens}) "
                f"exceeds the model's context length of {self.max_model_len} tokens"
            )
        # What admission asks of an empty engine (`_memory_for`): every layer plus the prefetch buffer. A
        # request that passes waits until memory frees up; one that does not could never be admitted.
        final = self._final_blocks(req)
        blocks = final * (self.num_layers + self.prefetch_slots)
        capacity = self.kv.device_pool.num_blocks + self.kv.host_pool.num_blocks
        if blocks > capacity:
            raise RequestRejected(
                f"request needs {blocks} KV blocks but device + host pools hold {capacity}; "
                "raise --host-kv-blocks or lower max_tokens"
            )
        with self._add_lock:
            limit = self.config.max_queue_len
            if limit is not None and self.num_queued() >= limit:
                raise QueueFull(f"the server is busy: {limit} requests are already waiting (--max-queue-len); "
                                "retry later", self.retry_after_s())
            self._inbox.put(("add", req))
        self._wakeup.set()
        return req

    def num_queued(self) -> int:
        """Requests waiting for admission, counting those not yet taken from the inbox (thread-safe,
        approximate: aborts still in the inbox count too)."""
        return len(self.waiting) + self._inbox.qsize()

    def retry_after_s(self) -> int:
        """A rough wait before a retry may be admitted: until the running request closest to its end
        finishes, at the recent mean step time (1 to 60 s)."""
        recent = list(self.stats.step_s)[-50:]
        step_s = sum(recent) / len(recent) if recent else 0.05
        remaining = min((r.remaining_tokens for r in list(self.running)), default=0)
        return int(min(60, max(1, math.ceil(remaining * step_s))))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.paused or not self._inbox.empty())

    def wait_for_work(self, timeout: float | None = None) -> None:
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> StepResult | None:
        self._drain_inbox()
        self._admit()
        self._replan()
        if not self.running:
            return None
        seqs, reqs = self._build_inputs()
        if not seqs:
            return None
        is_decode = all(s.is_decode for s in seqs)
        try:
            result = self.executor.step(seqs)
        except Exception as exc:  # the step is lost; its requests end with an error, the engine lives on
            log.exception("step failed")
            for req in reqs:
                self._finish(req, "error", error=f"engine step failed: {exc}")
            self.controller.forget()
            return None
        self.clock.advance(result.replacement_s + result.step_s)  # a wall clock has moved by itself
        now = self.clock.now()
        self._account(result, is_decode)
        samples = result.samples or [None] * len(seqs)
        for seq, req, token, drawn in zip(seqs, reqs, result.tokens, samples):
            try:
                req.num_cached = seq.start_pos + len(seq.token_ids)
                if drawn is not None and drawn.error is not None:
                    self._finish(req, "error", error=f"sampling failed: {drawn.error}")
                elif token is not None:
                    self._emit_token(req, token, now, drawn)
            except Exception as exc:  # this request's output processing failed: end it alone
                log.exception("processing the output of request %s failed", req.request_id)
                if not req.finished:
                    self._finish(req, "error", error=f"output processing failed: {type(exc).__name__}: {exc}")
        if is_decode and self._last_prediction is not None:
            # the batch the prediction was made for (requests that finished this step have left `running`)
            predicted, total, num_requests = self._last_prediction
            self.controller.observe(predicted, result.step_s, result.layer_compute_s, total,
                                    result.link_blocks_per_s, num_requests=num_requests)
        self.stats.steps += 1
        if self.running and self.controller.expires_at(self.stats.steps + 1):
            self.controller.solve_ahead(self._plan_requests(self.running, ahead=1), self.stats.steps + 1)
        return result

    def run_until_done(self, on_step: Callable[[], None] | None = None) -> None:
        while self.has_work():
            self.step()
            if on_step is not None:
                on_step()

    # ---- inbox ------------------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            kind, item = self._inbox.get()
            if kind == "add":
                self.requests[item.request_id] = item
                self.waiting.append(item)
                self._batch_version += 1
            else:
                req = self.requests.get(item)
                if req is not None and not req.finished:
                    self._finish(req, "abort")

    # ---- planning ---------------------------------------------------------------------------------
    def _plan_requests(self, reqs: list[Request], ahead: int = 0) -> list[PlanRequest]:
        """The batch as the planner sees it; also tells the planner how much of the host pool is left to
        this batch (everything but what paused requests hold there)."""
        requests, host_capacity = self.plan_inputs(reqs, ahead)
        self.controller.ctx.host_capacity_blocks = host_capacity
        return requests

    def plan_inputs(self, reqs: list[Request], ahead: int = 0) -> tuple[list[PlanRequest], int]:
        """The planner's view of `reqs` and the host blocks left to them, changing nothing (the replica
        state's what-if asks the planner about a batch the engine is not running)."""
        now = self.clock.now()
        held = 0
        for r in reqs:
            table = self.kv.tables.get(r.request_id)
            if table is not None:
                held += table.host_blocks()
        host_capacity = self.kv.host_pool.num_blocks - (self.kv.host_pool.num_used - held)
        return [
            PlanRequest(
                request_id=r.request_id,
                blocks_per_layer=math.ceil((r.num_tokens + ahead) / self.block_size),
                tokens=r.num_tokens + ahead,
                tokens_left=max(0, r.remaining_tokens - ahead),
                deposit=float(r.deposit.balance(now)) if self.config.token_deposit else 0.0,
                slo_s=r.slo_s,
            )
            for r in reqs
        ], host_capacity

    def _admit(self) -> None:
        if self._admission_blocked_at == self._batch_version:
            return  # nothing changed since admission last found no room: do not re-solve every step
        self._admission_blocked_at = None
        for cand in self.scheduler.candidates(self.waiting, self.paused):
            if not self.scheduler.fits(self.running, cand):
                return
            resuming = cand.status is Status.PAUSED
            if resuming and self.running and self._completions == cand.completions_at_pause:
                # The paper's gate: resume only after some in-flight request has completed (and a plan
                # then holds it). Without it, measurement noise flips feasibility and requests thrash.
                self._admission_blocked_at = self._batch_version
                return
            if not resuming and not self._memory_for(cand):
                # Not now: it waits (FCFS order holds) until a request finishes and frees memory. add_request
                # guaranteed that it fits an empty engine, so it cannot wait forever.
                self._admission_blocked_at = self._batch_version
                return
            while True:
                trial = self.running + [cand]
                plan = self.controller.solve(self._plan_requests(trial), self.stats.steps, "batch")
                if plan.feasible:
                    break
                if len(trial) == 1:
                    self._finish(cand, "error", error="request does not fit the device KV budget even fully offloaded")
                    break
                victim = self._victim(plan, trial)
                # A paused request comes back only when a plan holds it without pausing anyone (the
                # overload has cleared); until then nobody overtakes it, so it cannot starve.
                if resuming or victim is cand:
                    self.controller.forget()
                    self._admission_blocked_at = self._batch_version
                    return  # it would be paused at once: keep it waiting until load allows
                self._pause(victim)
            if cand.finished:
                continue
            if cand.status is Status.PAUSED:
                self.paused.remove(cand)
                self.stats.resumes += 1
            else:
                self.waiting.remove(cand)
            cand.status = Status.RUNNING
            self.running.append(cand)

    @property
    def prefetch_slots(self) -> int:
        """Layers of prefetch buffer each request may hold (the policy's prefetch depth)."""
        return self.controller.ctx.cost_model.prefetch_slots

    def _final_blocks(self, req: Request) -> int:
        return math.ceil(req.max_total_tokens / self.block_size)

    def fits_memory(self, cand: Request) -> bool:
        """Whether admission's memory rule lets `cand` in now (read-only; the replica state's what-if)."""
        return self._memory_for(cand)

    def _memory_for(self, cand: Request) -> bool:
        """Whether both pools together can hold `cand` to its last token while every admitted request
        also grows to its last token, plus the largest prefetch buffer any plan could ask for (prefetch-depth
        layers of every request). Then no plan of theirs can run the host pool dry."""
        admitted = self.running + self.paused + [cand]
        final = sum(self._final_blocks(r) for r in admitted)
        free = self.kv.device_pool.num_free + self.kv.host_pool.num_free
        held = sum(self.kv.tables[r.request_id].blocks_per_layer for r in admitted if r.request_id in self.kv.tables)
        return final * (self.num_layers + self.prefetch_slots) <= free + held * self.num_layers

    def _victim(self, plan: Plan, batch: list[Request]) -> Request:
        """Whom to set aside: the policy's victim, or (without Pause-Resume) the newest request, as a
        capacity preemption would."""
        if self.policy.pause_resume:
            by_id = {r.request_id: r for r in batch}
            for rid in plan.victims:
                if rid in by_id:
                    return by_id[rid]
        return batch[-1]

    def _replan(self) -> None:
        while self.running:
            ids = [r.request_id for r in self.running]
            trigger = self.controller.trigger(self.stats.steps, ids)
            if trigger is None:
                return
            plan = self.controller.solve(self._plan_requests(self.running), self.stats.steps, trigger)
            if plan.feasible:
                return
            if len(self.running) == 1:
                self._finish(self.running[0], "error",
                             error="request does not fit the device KV budget even fully offloaded")
            else:
                self._pause(self._victim(plan, self.running))

    def _pause(self, req: Request) -> None:
        self.running.remove(req)
        req.status = Status.PAUSED
        req.num_pauses += 1
        req.paused_at_step = self.stats.steps
        req.completions_at_pause = self._completions
        self.paused.append(req)
        self.stats.pauses += 1
        self._batch_version += 1
        if req.request_id in self.kv.tables:
            self.kv.pause(req.request_id)
        self.controller.forget()

    # ---- running ----------------------------------------------------------------------------------
    def _install_plan(self) -> None:
        plan, ids = self.controller.plan, self.controller.plan_ids
        if self._installed is not None and self._installed[0] is plan and self._installed[1] == ids:
            return  # already in place: nothing to move
        rows = {rid: [bool(x) for x in plan.placement.mask[i]] for i, rid in enumerate(ids)}
        for req in self.running:
            if req.request_id not in self.kv.tables:
                self.kv.allocate(req.request_id, 0, rows[req.request_id])
        self.kv.apply_placements({r.request_id: rows[r.request_id] for r in self.running})
        self._installed = (plan, list(ids))

    def _build_inputs(self) -> tuple[list[SeqInput], list[Request]]:
        try:
            self._install_plan()
        except OutOfBlocks as exc:
            self.controller.forget()
            if exc.tier == "host":  # cannot happen after _memory_for admitted everyone; never spin on it
                newest = max(self.running, key=lambda r: r.arrival_s)
                self._finish(newest, "error", error=f"KV memory exhausted: {exc}")
            else:
                log.warning("installing the plan failed (%s); re-planning", exc)
            return [], []
        chunk = self.config.chunked_prefill
        prefilling = [r for r in self.running if not r.prefilled]
        if prefilling and chunk is None:
            batch = prefilling  # the paper's behaviour: decoding waits while new prompts prefill
        elif prefilling:
            batch = [r for r in self.running if r.prefilled] + prefilling[:1]
        else:
            batch = list(self.running)
        seqs, reqs = [], []
        for req in batch:
            tokens, start, sample = req.next_input(chunk)
            try:
                self.kv.ensure_capacity(req.request_id, start + len(tokens))
            except OutOfBlocks as exc:
                if exc.tier == "host":
                    self._finish(req, "error", error=f"out of KV memory: {exc}")
                else:
                    self.controller.forget()
                continue
            seqs.append(SeqInput(req.request_id, tokens, start, sample, req.sampling, len(req.output_ids),
                                 req.prompt_ids, req.output_ids))
            reqs.append(req)
        if seqs and all(s.is_decode for s in seqs) and self.controller.plan is not None:
            # what the cost model (the simulator's) predicts for this step's batch and placement
            total = sum(s.start_pos + 1 for s in seqs)
            predicted = self.controller.predict(
                [self.kv.tables[s.req_id].on_device for s in seqs], [self.kv.blocks_for(s.start_pos) for s in seqs],
                total)
            self._last_prediction = (predicted, total, len(seqs))
        else:
            self._last_prediction = None
        return seqs, reqs

    def _emit_token(self, req: Request, token: int, now: float, drawn=None) -> None:
        prev_gen = req.generated_s[-1] if req.generated_s else None
        prev_due = req.delivered_s[-1] if req.delivered_s else None
        req.output_ids.append(token)
        req.generated_s.append(now)
        due = req.deposit.push(token, now)
        req.delivered_s.append(due)
        if prev_gen is not None and now - prev_gen > req.slo_s + SLO_TOLERANCE_S:
            self.stats.generated_violations += 1
        if prev_due is not None and due - prev_due > req.slo_s + SLO_TOLERANCE_S:
            self.stats.delivered_violations += 1
        event = TokenEvent(req.request_id, token, now, due)
        if drawn is not None and drawn.logprob is not None:
            event.logprob, event.top_logprobs = drawn.logprob, drawn.top_logprobs
        self._notify(event)
        reason = req.check_stop(token)
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        now = self.clock.now()
        for bucket in (self.waiting, self.running, self.paused):
            if req in bucket:
                bucket.remove(req)
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)  # a later abort of it is then a no-op
        req.deposit.flush(now)
        req.delivered_s = [min(d, now) for d in req.delivered_s]
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finished_s = now
        self.finished.append(req)
        self._completions += 1
        self._batch_version += 1
        self._notify(TokenEvent(req.request_id, None, now, now, finished=True, finish_reason=reason, error=error))

    def _notify(self, event: TokenEvent) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not fail the step (or the other listeners)
                log.exception("token listener failed on an event of request %s", event.request_id)

    def _account(self, result: StepResult, is_decode: bool) -> None:
        s = self.stats
        s.busy_s += result.step_s
        s.step_s.append(result.step_s)
        s.stall_s += result.stall_s
        s.bytes_h2d += result.bytes_h2d
        s.bytes_d2h += result.bytes_d2h
        s.device_blocks_peak = max(s.device_blocks_peak, result.device_blocks_used)
        s.host_blocks_peak = max(s.host_blocks_peak, result.host_blocks_used)
        if is_decode:
            s.decode_steps += 1
            s.device_util_sum += result.device_blocks_used / self.kv.device_pool.num_blocks
        else:
            s.prefill_steps += 1

    def close(self) -> None:
        self.controller.close()
        self.kv.close()
