"""Admission order and batch limits (continuous batching).

FCFS admits in arrival order; SRTF admits the request with the fewest remaining output tokens
(known from `max_tokens`) first. Paused requests always come before new ones, most-paused first,
so a request that keeps being set aside is resumed first once load allows (no starvation).
"""

from __future__ import annotations

from orbitflow.runtime.request import Request


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, policy: str = "fcfs"):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy

    def candidates(self, waiting: list[Request], paused: list[Request]) -> list[Request]:
        resume = sorted(paused, key=lambda r: (-r.num_pauses, r.paused_at_step or 0, r.arrival_s))
        if self.policy == "srtf":
            fresh = sorted(waiting, key=lambda r: (r.remaining_tokens, r.arrival_s))
        else:
            fresh = sorted(waiting, key=lambda r: r.arrival_s)
        return resume + fresh

    def fits(self, running: list[Request], candidate: Request) -> bool:
        if len(running) >= self.max_num_seqs:
            return False
        if not running:  # a single request longer than the cap still runs alone
            return True
        tokens = sum(r.num_tokens + r.remaining_tokens for r in running)
        return tokens + candidate.num_tokens + candidate.remaining_tokens <= self.max_num_batched_tokens
