"""Per-request sampling: greedy by default; penalties, logit bias, temperature / top-k / top-p when asked.

`sample` never raises: whatever goes wrong for one request (a parameter that slipped past the API's
checks, a degenerate distribution) comes back as `Sample.error`, so the engine ends that request alone
and the step goes on for the others.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before penalties, bias
and temperature), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (dividing by it would overflow)
_SEED_SPACE = 1 << 64  # torch generators take seeds in [0, 2**64)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # return the chosen token's logprob and this many top alternatives
    slo_s: float | None = None  # this request's per-token SLO (None: the engine's); the API's `slo_ms`

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the request's prompt and output tokens (a penalty is set)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)


@dataclass
class Sample:
    token: int | None  # None when sampling failed for this request
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # best first
    error: str | None = None


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
    generated: int | None = None,
) -> Sample:
    """The next token of one request from its row of logits; reproducible per (seed, position). ``generated``: the
    tokens generated so far (the position; default ``len(output_ids)``), so that a caller may leave the histories out
    when ``params.reads_history`` is False."""
    step = len(output_ids) if generated is None else generated
    try:  # the logprobs too: a `logprobs` the API would refuse (2.5, say) came through the Python API to the batch
        token = _draw(_processed(logits.float(), params, prompt_ids, output_ids), params, step)
        if params.logprobs is None:
            return Sample(token)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if params.logprobs > 0:
            values, ids = torch.topk(logprobs, min(params.logprobs, logprobs.numel()))
            top = tuple(zip(ids.tolist(), values.tolist()))
        return Sample(token, float(logprobs[token]), top)
    except Exception as exc:  # noqa: BLE001 - one request's failure must not reach the batch
        return Sample(None, error=f"{type(exc).__name__}: {exc}")


def _processed(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int],
               output_ids: Sequence[int]) -> torch.Tensor:
    """Logits after the repetition, presence and frequency penalties and the logit bias."""
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids, counts = torch.unique(torch.tensor(list(output_ids), dtype=torch.long), return_counts=True)
        ids = ids.to(logits.device)
        logits = logits.clone()
        logits[ids] -= params.frequency_penalty * counts.to(logits) + params.presence_penalty
    if params.logit_bias:
        ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long, device=logits.device)
        logits = logits.clone()
        logits[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device)
    return logits


def _draw(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    top = torch.isposinf(logits)
    if bool(top.any()):  # past float32's range (a repetition_penalty near 0, a temperature near GREEDY_BELOW): the
        logits = torch.where(top, 0.0, float("-inf"))  # limit of the softmax is uniform over those tokens
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p
        keep[0] = True  # the most likely token always stays, however small top_p is
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        raise ValueError("the sampling distribution is degenerate (non-finite or all-zero probabilities)")
    if params.seed is None:
        return int(torch.multinomial(probs.cpu(), 1))
    generator = torch.Generator(device="cpu")
    generator.manual_seed((params.seed * 1_000_003 + step) % _SEED_SPACE)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
