"""What crosses the scheduler / executor boundary once per step.

The scheduler returns a `ScheduleOutput`; an executor (`runtime/executor.py`) runs it and returns a
`StepResult`; the engine turns that into tokens and finishes. Nothing here imports the model or torch, so a
scheduler, a simulated executor or a tensor-parallel driver can use these types without loading either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orbitflow.runtime.sampling import Sample


@dataclass
class SeqInput:
    """One row of a step's batch: the tokens one request processes now."""

    req_id: object  # the request id
    token_ids: list[int]  # tokens to process this step
    start_pos: int  # tokens of this sequence already in the KV cache
    sample: bool = True  # produce a next token (False for a non-final prefill chunk)
    sampling: Any = None  # SamplingParams (None: greedy defaults)
    generated: int = 0  # tokens generated so far (seeds per-request sampling)
    prompt_ids: Sequence[int] = ()  # the request's prompt and output so far (penalties read them)
    output_ids: Sequence[int] = ()

    def __post_init__(self) -> None:
        if self.sampling is None:
            from orbitflow.runtime.sampling import SamplingParams

            self.sampling = SamplingParams()

    @property
    def is_decode(self) -> bool:
        """One new token on top of a cached context (anything else is a prefill or a prefill chunk)."""
        return self.start_pos > 0 and len(self.token_ids) == 1


@dataclass
class ScheduleOutput:
    """The scheduler's decision for one step; valid for that step only.

    By the time the executor sees it, the KV manager already holds every block the step needs and the
    placement in force: the scheduler allocated, grew and moved KV (or paused and re-planned until it could)
    before putting a request into `seqs`, so an executor never meets a shortage.
    """

    step: int  # the engine step this output is for (0-based, counts executed steps)
    # The batch, in row order: StepResult.tokens[i] answers seqs[i]. Either all prompts (a prefill step,
    # decoding waits as in the paper), decodes plus at most one prefill chunk (chunked prefill), or all decodes.
    seqs: list[SeqInput] = field(default_factory=list)
    # Placement installed for this step (request id -> per layer, True = on device): every running row when
    # a new plan was put in force now (new requests allocated, changed layers moved), empty when the plan was
    # already in place. The KV manager already holds it; it is what a worker in another process would mirror.
    placement: dict[object, list[bool]] = field(default_factory=dict)
    paused_ids: list = field(default_factory=list)  # requests paused while scheduling this step (Pause-Resume)
    resumed_ids: list = field(default_factory=list)  # paused requests brought back into the running batch
    recomputed_ids: list = field(default_factory=list)  # paused requests whose KV was dropped, to be computed again
    finished_ids: list = field(default_factory=list)  # requests ended while scheduling (an error; their KV is freed)
    plan: Any = None  # the Plan in force for the running batch (None: no feasible plan installed)
    # The cost model's latency for this decode step's batch and placement, the batch's total tokens and which
    # layers read prefetched KV (None for a step with a prefill, or without a plan): what the controller
    # compares the measurement with.
    predicted_step_s: float | None = None
    total_tokens: int = 0
    host_layers: list[bool] | None = None

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def is_decode(self) -> bool:
        return bool(self.seqs) and all(s.is_decode for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs if not s.is_decode)


@dataclass
class StepResult:
    """What an executor measured and produced for one ScheduleOutput."""

    tokens: list[int | None]  # per row of ScheduleOutput.seqs, None where sample=False
    step_s: float
    layer_compute_s: list[float]
    layer_stall_s: list[float]
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    device_blocks_used: int = 0
    host_blocks_used: int = 0
    prefill_tokens: int = 0
    link_blocks_per_s: float | None = None  # measured effective link rate of this step's prefetches
    link_preemptions: int = 0  # prefetches that yielded the link to an earlier layer's (--kv-link preemptive)
    overflow_blocks: int = 0  # the most prefetch staging blocks held outside the device budget so far (no room)
    replacement_s: float = 0.0  # simulated time of the placement changes installed before the step
    samples: list[Sample | None] = field(default_factory=list)  # per row (empty: tokens only)

    @property
    def compute_s(self) -> float:
        return sum(self.layer_compute_s)

    @property
    def stall_s(self) -> float:
        return sum(self.layer_stall_s)
