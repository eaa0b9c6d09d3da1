"""Per-request sampling: greedy by default, temperature / top-p / top-k when asked."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def sample_next(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Pick the next token from one row of logits; reproducible per (seed, step)."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    if params.seed is None:
        return int(torch.multinomial(probs.cpu(), 1))
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed * 1_000_003 + step)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
