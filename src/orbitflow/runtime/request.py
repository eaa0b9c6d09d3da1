"""A request's state as it moves through the engine: waiting -> running <-> paused -> finished."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from orbitflow.plan.types import PlanRequest
from orbitflow.runtime.deposit import TokenDeposit
from orbitflow.runtime.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_s: float
    slo_s: float
    deposit: TokenDeposit
    eos_token_ids: tuple[int, ...] = ()
    # Simulation only: a fixed output length stands in for the model's choice of when to stop.
    target_output_tokens: int | None = None
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is in the cache
    generated_s: list[float] = field(default_factory=list)
    delivered_s: list[float] = field(default_factory=list)
    num_pauses: int = 0
    idle_pauses: int = 0  # pauses in a row without moving on in between (Scheduler: MAX_IDLE_PAUSES)
    num_recomputes: int = 0  # times its KV was dropped while paused, to be computed again (Scheduler._recompute)
    paused_at_step: int | None = None
    completions_at_pause: int = 0  # the engine's finished-request count when this request was paused
    outputs_at_start: int = 0  # its output tokens when it last started running (admitted or resumed)
    cached_at_start: int = 0  # ... and its tokens in the KV cache then (a chunked prefill progresses without outputs)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    finished_s: float | None = None

    def progressed(self) -> bool:
        """Whether it moved on since it last started running: an output token, or a chunk of its prefill."""
        return len(self.output_ids) > self.outputs_at_start or self.num_cached > self.cached_at_start

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_end(self) -> int:
        """Tokens whose KV the prefill computes: the prompt, or (its KV dropped by a recompute) the prompt and every
        output but the last, which the next decode step feeds as usual."""
        return max(self.num_prompt, self.num_tokens - 1)

    @property
    def prefilled(self) -> bool:
        return self.num_cached >= self.prefill_end

    @property
    def max_output_tokens(self) -> int:
        return self.target_output_tokens or self.sampling.max_tokens

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus every token it may generate: what its KV grows to at most."""
        return self.num_prompt + self.max_output_tokens

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_output_tokens - len(self.output_ids))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def length_text(self) -> str:
        """What a rejection says of its length: "prompt (N tokens) plus max_tokens (M)"."""
        return f"prompt ({self.num_prompt} tokens) plus max_tokens ({self.max_output_tokens})"

    @property
    def pace_s(self) -> float:
        """The interval Token-Deposit paces this request's tokens at: its SLO less the engine's guard
        (``--deposit-guard-ms``), so delivery jitter stays inside the SLO. The planner plans for it."""
        return self.deposit.slo_s

    def plan_request(self, block_size: int, ahead: int = 0, deposit: float = 0.0) -> PlanRequest:
        """The planner's view of this request ``ahead`` decode steps on, with Token-Deposit balance ``deposit``."""
        tokens = self.num_tokens + ahead
        return PlanRequest(request_id=self.request_id, blocks_per_layer=math.ceil(tokens / block_size), tokens=tokens,
                           tokens_left=max(0, self.remaining_tokens - ahead), deposit=deposit, slo_s=self.pace_s)

    def next_input(self, chunk: int | None) -> tuple[list[int], int, bool]:
        """Tokens to feed next, where they start, and whether a token is sampled after them (not after a recompute's
        prefill: its next token comes from the decode step that feeds the last output)."""
        if not self.prefilled:
            target = self.prefill_end
            end = target if chunk is None else min(target, self.num_cached + chunk)
            source = self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids
            return source[self.num_cached:end], self.num_cached, end == target and not self.output_ids
        return [self.output_ids[-1]], self.num_cached, True

    def check_stop(self, token: int) -> str | None:
        if self.target_output_tokens is not None:
            return "length" if len(self.output_ids) >= self.target_output_tokens else None
        if token in self.sampling.stop_token_ids or (not self.sampling.ignore_eos and token in self.eos_token_ids):
            return "stop"  # ignore_eos ignores the model's end-of-sequence token only, not the caller's stop ids
        if len(self.output_ids) >= self.sampling.max_tokens:
            return "length"
        return None
