"""The engine loop: drain the inbox, `Scheduler.schedule()`, `Executor.execute()` once, process the outputs.

Output processing stays here: each new token's delivery time is stamped by its Token-Deposit, listeners are
told, stops end requests. What fails for one request there (its sampling, its stop check, a listener) ends
that request alone; a failed step ends that step's requests, and the engine lives on.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from orbitflow.config import ConfigError, EngineConfig
from orbitflow.kv.manager import KVManager
from orbitflow.plan.placement import most_blocks
from orbitflow.plan.types import PlanRequest
from orbitflow.policies.base import PlanContext, Policy
from orbitflow.runtime.controller import Controller
from orbitflow.runtime.deposit import SLO_TOLERANCE_S, TokenDeposit, pace_s
from orbitflow.runtime.executor import Executor
from orbitflow.runtime.outputs import ScheduleOutput, StepResult
from orbitflow.runtime.request import Request
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.runtime.scheduler import Scheduler

log = logging.getLogger("orbitflow.engine")


class RequestRejected(ValueError):
    """The request can never be served (too long for the model or for KV memory)."""


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue_len`: the request may be retried later."""

    def __init__(self, message: str, retry_after_s: int, replica: str | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.replica = replica  # the cluster replica that refused it (None in one process)

    def __reduce__(self):  # pickled whole: a cluster replica's refusal reaches the ingress as itself (a 503)
        return type(self), (str(self), self.retry_after_s, self.replica)


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
    slo_s: float | None = None  # on a token: the request's TBT SLO (the server judges the delivered gaps against it)


@dataclass
class EngineStats:
    steps: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    pauses: int = 0
    resumes: int = 0
    recomputes: int = 0
    busy_s: float = 0.0
    stall_s: float = 0.0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    link_preemptions: int = 0  # prefetches that yielded the link to an earlier layer's (--kv-link preemptive)
    overflow_blocks_peak: int = 0  # most prefetch staging blocks held outside the device budget at once
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
        executor: Executor,
        policy: Policy,
        ctx: PlanContext,
        clock,
        default_slo_s: float,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int | None = None,
        kv: KVManager | None = None,
        vocab_size: int | None = None,
    ):
        """`kv` is the KV manager the executor runs over (default: `executor.kv`); the scheduler installs
        placements and grows blocks in it. `vocab_size`: prompt token ids must lie below it (None: unchecked, as
        for a simulated model)."""
        self.config = config
        self.executor = executor
        self.kv = kv if kv is not None else executor.kv
        self.policy = policy
        self.clock = clock
        self.default_slo_s = default_slo_s
        try:
            pace_s(config.planner.deposit_guard_ms, default_slo_s)
        except ValueError as exc:  # the SLO is known only now, once the profile is in
            raise ConfigError(str(exc)) from None
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_size = config.cache.block_size
        self.num_layers = executor.num_layers
        planner = config.planner
        self.controller = Controller(
            policy, ctx, planner.mismatch_threshold, planner.ewma, background=planner.background_planner
        )
        self.scheduler = Scheduler(config, self.kv, self.controller, self.num_layers, clock.now)
        self.finished: deque[Request] = deque(maxlen=100_000)  # in finishing order; bounded for long-running servers
        self.listeners: list[Callable[[TokenEvent], None]] = []
        self.stats = EngineStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._add_lock = threading.Lock()  # makes the queue-length check and the enqueue one step
        self._inbox_adds = 0  # requests in the inbox (its aborts do not wait for admission); under _add_lock
        self._incoming: dict[str, Request] = {}  # those requests, by id (a what-if counts them); under _add_lock
        self._live: set[str] = set()  # ids of the requests added and not yet finished; under _add_lock
        self._wakeup = threading.Event()

    # The scheduler's queues, read by the server's metrics and by tests.
    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def paused(self) -> list[Request]:
        return self.scheduler.paused

    @property
    def prefetch_slots(self) -> int:
        """Layers of prefetch buffer each request may hold (the policy's prefetch depth)."""
        return self.scheduler.prefetch_slots

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
        # (the API and the CLI check it too; through the Python API a max_tokens of 0 still generated one token, and a
        # negative one shrank the KV the admission checks reserve)
        if isinstance(sampling.max_tokens, bool) or not isinstance(sampling.max_tokens, int) or sampling.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be an integer >= 1, got {sampling.max_tokens!r}")
        # else the embedding lookup fails the whole batch's step, not just this one (min/max: C loops, for long prompts)
        if self.vocab_size is not None and (min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size):
            bad = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
            raise RequestRejected(f"prompt token id {bad} is not in the vocabulary (size {self.vocab_size})")
        slo = next((s for s in (slo_s, sampling.slo_s) if s is not None), self.default_slo_s)  # 0 is refused below
        req = Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            arrival_s=self.clock.now() if arrival_s is None else arrival_s,
            slo_s=slo,
            deposit=self.new_deposit(slo),
            eos_token_ids=self.eos_token_ids,
            target_output_tokens=target_output_tokens,
        )
        self._check_servable(req)
        with self._add_lock:
            if request_id in self._live:  # it would take the other's place in the scheduler and its KV table
                raise ValueError(f"request_id {request_id!r} is already in use by a request that has not finished")
            limit = self.config.scheduler.max_queue_len
            if limit is not None and self.num_queued() - self.free_seats() >= limit:
                raise QueueFull(f"the server is busy: {limit} requests are already waiting beyond the batch's "
                                "free places (--max-queue-len); retry later", self.retry_after_s())
            self._inbox.put(("add", req))
            self._inbox_adds += 1
            self._incoming[request_id] = req
            self._live.add(request_id)
        self._wakeup.set()
        return req

    def new_deposit(self, slo_s: float) -> TokenDeposit:
        """The Token-Deposit of a request with TBT SLO ``slo_s``: it paces delivery ``--deposit-guard-ms`` under the
        SLO (the planner plans for that pace too: `Request.pace_s`)."""
        try:
            pace = pace_s(self.config.planner.deposit_guard_ms, slo_s)
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        return TokenDeposit(pace, enabled=self.config.planner.token_deposit)

    def _check_servable(self, req: Request) -> None:
        reason = self._why_unservable(req.max_total_tokens, req.plan_request(self.block_size))
        if reason is not None:
            raise RequestRejected(f"{req.length_text} {reason}")

    def _why_unservable(self, total_tokens: int, request: PlanRequest) -> str | None:
        """Why a request whose KV grows to ``total_tokens`` could never be served, even alone; None when it can.
        ``request``: the planner's view of it, for the policy's own check."""
        if self.max_model_len is not None and total_tokens > self.max_model_len:
            return (f"exceeds the {self.max_model_len} tokens a request may hold here (--max-model-len, or the "
                    "model's context length)")
        # What admission asks of an empty engine (`Scheduler.kv_fits`): every layer plus the prefetch buffer.
        # A request that passes waits until memory frees up; one that does not could never be admitted.
        per_layer = math.ceil(total_tokens / self.block_size)
        blocks = most_blocks(per_layer, self.num_layers, self.prefetch_slots)
        capacity = self.kv.device_pool.num_blocks + self.kv.host_pool.num_blocks
        if blocks > capacity:
            return (f"needs {blocks} KV blocks but device + host pools hold {capacity}; raise --host-kv-blocks or "
                    "lower max_tokens")
        if not self.scheduler.fits_alone(per_layer):  # the sum fits, but no split of the layers between the pools does
            return self.scheduler.no_fit_reason(per_layer)
        ctx = replace(self.controller.ctx, host_capacity_blocks=self.kv.host_pool.num_blocks)
        reason = self.controller.policy.unservable(request, ctx)  # e.g. a fixed placement too big for a pool
        if reason is not None:
            return f"cannot be served: {reason}; lower max_tokens or the prompt, or raise that budget"
        return None

    def longest_servable(self) -> int:
        """The most tokens (prompt + output) one request may grow to and still be accepted by `add_request`: the
        context length, and what the KV pools and the policy can hold of it alone. A server advertises it as its
        context, and gives a request without max_tokens the rest of it."""
        def servable(total: int) -> bool:
            probe = PlanRequest("longest-servable", math.ceil(1 / self.block_size), 1, total - 1, 0.0,
                                self.default_slo_s)
            return self._why_unservable(total, probe) is None

        lo, hi = 0, self.max_model_len or 1  # servable(lo) (or lo == 0); find hi with servable(hi) False
        while self.max_model_len is None and servable(hi):
            lo, hi = hi, 2 * hi
        if self.max_model_len is not None and servable(hi):
            return hi
        while hi - lo > 1:  # every check only grows harder with the tokens
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if servable(mid) else (lo, mid)
        return lo

    def free_seats(self) -> int:
        """Places the batch has for requests now queued (--max-num-seqs less those running or paused, which
        resume first): that many of the queue start at once, memory permitting (thread-safe, approximate)."""
        return max(0, self.config.scheduler.max_num_seqs - len(self.running) - len(self.paused))

    def incoming(self) -> list[Request]:
        """Requests added but not yet taken in by the loop (in the order they were added): a what-if that left them
        out answered for a batch without them, through a long step's worth of arrivals."""
        with self._add_lock:
            return list(self._incoming.values())

    def queued_requests(self) -> list[Request]:
        """The waiting requests, then those still in the inbox: one snapshot, so a request the loop is taking in
        counts once (the loop moves it from one to the other under the same lock)."""
        with self._add_lock:
            return list(self.waiting) + list(self._incoming.values())

    def num_queued(self) -> int:
        """Requests waiting for admission, counting those not yet taken from the inbox (thread-safe; a request
        whose abort is still in the inbox counts until the engine loop takes both)."""
        return len(self.waiting) + self._inbox_adds

    def retry_after_s(self) -> int:
        """A rough wait before a retry may be admitted: until the running request closest to its end
        finishes, at the recent mean step time (1 to 60 s)."""
        steps = self.stats.step_s  # the last 50 read from the end: copying all 100,000 cost each 503 ~2 ms
        recent = [steps[-i] for i in range(1, min(50, len(steps)) + 1)]
        step_s = sum(recent) / len(recent) if recent else 0.05
        remaining = min((r.remaining_tokens for r in list(self.running)), default=0)
        return int(min(60, max(1, math.ceil(remaining * step_s))))

    def abort(self, request_id: str) -> None:
        self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: str) -> None:
        """End a request from outside the engine loop (thread-safe): "abort", or "stop" when its caller found a stop
        string in the text it generated. Unknown or finished ids are ignored."""
        self._inbox.put(("finish", (request_id, reason)))
        self._wakeup.set()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def wait_for_work(self, timeout: float | None = None) -> None:
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self) -> StepResult | None:
        self._drain_inbox()
        out = self.scheduler.schedule()
        self.stats.pauses += len(out.paused_ids)
        self.stats.resumes += len(out.resumed_ids)
        self.stats.recomputes += len(out.recomputed_ids)
        self._publish_finished()
        if out.is_empty:
            return None
        try:
            result = self.executor.execute(out)
        except Exception as exc:  # the step is lost; its requests end with an error, the engine lives on
            log.exception("step failed")
            self.scheduler.step_failed(out, f"engine step failed: {exc}")
            self._publish_finished()
            return None
        self.clock.advance(result.replacement_s + result.step_s)  # a wall clock has moved by itself
        self._account(out, result)
        self.scheduler.update_from_output(out, result)
        self._emit_outputs(out, result)
        self.stats.steps += 1
        self.scheduler.finish_step()
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
                with self._add_lock:  # one step for a what-if: a request is in the inbox or queued, never both
                    try:
                        self.scheduler.add_request(item)
                    finally:
                        self._inbox_adds -= 1
                        self._incoming.pop(item.request_id, None)
            else:
                request_id, reason = item
                self._finish_ids([request_id], reason)

    # ---- output processing ------------------------------------------------------------------------
    def _emit_outputs(self, out: ScheduleOutput, result: StepResult) -> None:
        now = self.clock.now()
        samples = result.samples or [None] * len(out.seqs)
        for seq, token, drawn in zip(out.seqs, result.tokens, samples):
            req = self.requests.get(seq.req_id)
            if req is None:
                continue
            try:
                if drawn is not None and drawn.error is not None:
                    self._finish_ids([seq.req_id], "error", error=f"sampling failed: {drawn.error}")
                elif token is not None:
                    self._emit_token(req, token, now, drawn)
            except Exception as exc:  # this request's output processing failed: end it alone
                log.exception("processing the output of request %s failed", req.request_id)
                self._finish_ids([seq.req_id], "error",
                                 error=f"output processing failed: {type(exc).__name__}: {exc}")

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
        event = TokenEvent(req.request_id, token, now, due, slo_s=req.slo_s)
        if drawn is not None and drawn.logprob is not None:
            event.logprob, event.top_logprobs = drawn.logprob, drawn.top_logprobs
        self._notify(event)
        reason = req.check_stop(token)
        if reason is not None:
            self._finish_ids([req.request_id], reason)

    def _finish_ids(self, request_ids, reason: str, error: str | None = None) -> None:
        self.scheduler.finish_requests(request_ids, reason, error)
        self._publish_finished()

    def keep_finished(self, count: int) -> None:
        """Keep only the last ``count`` finished requests in :attr:`finished` (each holds its prompt and output ids
        and timestamps). A server, which reads none of them, keeps a few: 100,000 requests of 8k tokens would hold
        tens of GB."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.finished = deque(self.finished, maxlen=count)

    def _publish_finished(self) -> None:
        """Record and announce the requests the scheduler finished (their KV is already free)."""
        for req in self.scheduler.take_finished():
            with self._add_lock:
                self._live.discard(req.request_id)
            self.finished.append(req)
            now = req.finished_s
            self._notify(TokenEvent(req.request_id, None, now, now, finished=True, finish_reason=req.finish_reason,
                                    error=req.error))

    def _notify(self, event: TokenEvent) -> None:
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not fail the step (or the other listeners)
                log.exception("token listener failed on an event of request %s", event.request_id)

    def _account(self, out: ScheduleOutput, result: StepResult) -> None:
        s = self.stats
        s.busy_s += result.step_s
        s.step_s.append(result.step_s)
        s.stall_s += result.stall_s
        s.bytes_h2d += result.bytes_h2d
        s.bytes_d2h += result.bytes_d2h
        s.link_preemptions += result.link_preemptions
        s.overflow_blocks_peak = max(s.overflow_blocks_peak, result.overflow_blocks)
        s.device_blocks_peak = max(s.device_blocks_peak, result.device_blocks_used)
        s.host_blocks_peak = max(s.host_blocks_peak, result.host_blocks_used)
        if out.is_decode:
            s.decode_steps += 1
            s.device_util_sum += result.device_blocks_used / self.kv.device_pool.num_blocks
        else:
            s.prefill_steps += 1

    def close(self) -> None:
        self.controller.close()
        self.kv.close()
