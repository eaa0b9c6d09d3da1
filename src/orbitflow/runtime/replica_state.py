"""What a replica tells a router: its load now, and what its planner predicts if one more request joined.

`replica_state(engine)` is a snapshot (running/queued/paused counts, free device and host KV blocks, the
predicted step latency of the plan in force). `what_if(engine, prompt_tokens, max_tokens)` asks the engine's
own policy (planner and cost model, with the EWMA refresh the controller applied) for a plan of the batch the
request would join now: the running requests, those already waiting or paused ahead of it, and the request
itself. It changes nothing in the engine. The request is feasible when the batch limit and admission's
memory rule let it in and the plan meets every request's SLO; headroom is how far under the tightest SLO the
planned step stays (1 - step / SLO).

Both read the engine from outside its loop (a router's thread in serving); the lists are copied first and a
snapshot that raced with a step is retried.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from orbitflow.runtime.request import Request
from orbitflow.runtime.sampling import SamplingParams

_WHAT_IF_ID = "__orbitflow-what-if__"
_RETRIES = 3


@dataclass(frozen=True)
class WhatIf:
    """The planner's answer for one more request joining now."""

    feasible: bool
    predicted_step_s: float  # the planned decode step of the batch with the request in it
    headroom: float  # 1 - predicted step / tightest SLO of that batch (negative: over the SLO)
    reason: str = ""  # why not feasible: "batch full", "memory", "slo"


@dataclass(frozen=True)
class ReplicaState:
    running: int
    queued: int
    paused: int
    free_device_blocks: int
    free_host_blocks: int
    predicted_step_s: float  # of the plan in force (0 when idle)
    slo_s: float  # the replica's default TBT SLO
    max_num_seqs: int

    @property
    def load(self) -> int:
        """Requests the replica holds: what least-loaded routing compares."""
        return self.running + self.queued + self.paused

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaState:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def replica_state(engine) -> ReplicaState:
    plan = engine.controller.plan
    running = list(engine.running)
    return ReplicaState(
        running=len(running), queued=engine.num_queued(), paused=len(engine.paused),
        free_device_blocks=engine.kv.device_pool.num_free, free_host_blocks=engine.kv.host_pool.num_free,
        predicted_step_s=float(plan.predicted_step_s) if plan is not None and running else 0.0,
        slo_s=float(engine.default_slo_s), max_num_seqs=engine.config.scheduler.max_num_seqs,
    )


def what_if(engine, prompt_tokens: int, max_tokens: int, slo_s: float | None = None) -> WhatIf:
    """The planner's predicted step latency and feasibility if this request joined `engine` now."""
    if prompt_tokens < 1 or max_tokens < 1:
        raise ValueError(f"what_if: prompt_tokens and max_tokens must be >= 1, got {prompt_tokens}, {max_tokens}")
    for attempt in range(_RETRIES):
        try:
            return _what_if(engine, prompt_tokens, max_tokens, slo_s)
        except (KeyError, ValueError, RuntimeError):  # the engine's loop moved under the snapshot
            if attempt == _RETRIES - 1:
                raise
    raise AssertionError("unreachable")


def _what_if(engine, prompt_tokens: int, max_tokens: int, slo_s: float | None) -> WhatIf:
    slo = slo_s or engine.default_slo_s
    cand = Request(
        request_id=_WHAT_IF_ID, prompt_ids=[0] * prompt_tokens, sampling=SamplingParams(max_tokens=max_tokens),
        arrival_s=engine.clock.now(), slo_s=slo, deposit=engine.new_deposit(slo),
        target_output_tokens=max_tokens,
    )
    queued = engine.queued_requests()  # waiting, then still in the inbox
    ahead = list(engine.paused) + queued  # all served before the candidate
    batch = list(engine.running) + ahead + [cand]
    # requests still in the engine's inbox (not taken in yet) count toward the batch limit too
    if len(engine.running) + len(engine.paused) + engine.num_queued() + 1 > engine.config.scheduler.max_num_seqs:
        return WhatIf(False, _current_step_s(engine), -math.inf, "batch full")
    if not engine.scheduler.kv_fits(cand, ahead=queued):  # the queue is served first
        return WhatIf(False, _current_step_s(engine), -math.inf, "memory")
    requests, host_capacity = engine.scheduler.plan_inputs(batch)
    ctx = replace(engine.controller.ctx, host_capacity_blocks=host_capacity, previous=None)
    plan = engine.policy.plan(requests, ctx)
    step_s = float(plan.predicted_step_s)
    tightest = min(r.pace_s for r in batch)  # what the planner plans for
    headroom = 1.0 - step_s / tightest if math.isfinite(step_s) else -math.inf
    return WhatIf(bool(plan.feasible), step_s, headroom, "" if plan.feasible else "slo")


def _current_step_s(engine) -> float:
    plan = engine.controller.plan
    return float(plan.predicted_step_s) if plan is not None else 0.0


# ---- a what-if table: the planner's answers for a grid of request sizes ----------------------------------
# A router that cannot ask a replica per request (Ray Serve's routers read the replicas' periodic routing stats)
# looks the request up here: the smallest grid point at least as long in prompt and in output, so the answer
# errs on the safe side; a request beyond the grid is not known feasible. A request sent without max_tokens gets the
# rest of the context (the API sets max_tokens = max_len - prompt), which no fixed output length covers: each
# prompt length also has a point that takes the rest of the context, and such a point covers any request whose
# prompt is no longer and whose prompt plus output fits the context (its KV ends at most as large, and it holds
# at least as many tokens now).
PROMPT_GRID = (128, 512, 2048, 8192, 32768)
OUTPUT_GRID = (64, 512, 4096)


def what_if_points(max_len: int) -> list[tuple[int, int]]:
    """The table's (prompt, output) points: every grid point that fits in `max_len` tokens, and for each grid
    prompt shorter than `max_len` the point taking the rest of it, smallest first."""
    return sorted({(p, o) for p in PROMPT_GRID for o in OUTPUT_GRID if p + o <= max_len}
                  | {(p, max_len - p) for p in PROMPT_GRID if p < max_len}, key=lambda t: (t[0] + t[1], t[0]))


def what_if_table(engine, max_len: int) -> list[tuple[int, int, WhatIf]]:
    """`what_if` at each of `what_if_points(max_len)`."""
    return [(p, o, what_if(engine, p, o)) for p, o in what_if_points(max_len)]


def lookup_what_if(table, prompt_tokens: int, max_tokens: int, max_len: int | None = None) -> WhatIf | None:
    """The answer of the smallest grid point covering the request (None: no point does). With `max_len` (the
    table's), a point that takes the rest of the context covers every request it holds (see above)."""
    def covers(p: int, o: int) -> bool:
        if p < prompt_tokens:
            return False
        rest = max_len is not None and p + o == max_len and prompt_tokens + max_tokens <= max_len
        return o >= max_tokens or rest

    covering = [(p, o, w) for p, o, w in table if covers(p, o)]
    if not covering:
        return None
    return min(covering, key=lambda t: (t[0] + t[1], t[0]))[2]
