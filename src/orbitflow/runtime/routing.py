"""Which replica takes a request: the decision both the Ray Serve router and the cluster simulator make.

Three rules over the replicas' states (:class:`~orbitflow.runtime.replica_state.ReplicaState`):

- ``slo-aware``: power of two choices. Two replicas drawn at random are asked what their planner predicts
  if the request joined now (``what_if``); of those whose plan keeps every request inside its SLO, the one
  with the most headroom wins. When neither can (or neither's answer is known: a Ray Serve router does not know
  it for a replica with requests in flight to it), the least loaded replica of all takes it (it will queue there
  the shortest).
- ``least-loaded``: fewest requests held (running + queued + paused), then most free device KV blocks.
- ``round-robin``: each replica in turn.

Ties are broken at random from the router's seeded generator, so a run is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence

from orbitflow.config import ROUTER_CHOICES
from orbitflow.runtime.replica_state import ReplicaState, WhatIf

ROUTERS = ROUTER_CHOICES  # the --router flag (config.ClusterConfig)
DEFAULT_ROUTER = "slo-aware"


class Router:
    """A routing rule with its own state (the round-robin cursor, the seeded generator)."""

    def __init__(self, name: str = DEFAULT_ROUTER, seed: int = 0) -> None:
        if name not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {name!r}")
        self.name = name
        self.rng = random.Random(seed)
        self._next = 0
        self.fallbacks = 0  # slo-aware decisions where neither sampled replica had a known feasible plan

    def choose(self, candidates: Sequence[tuple[Hashable, ReplicaState]],
               what_if: Callable[[Hashable], WhatIf]) -> Hashable:
        """The id of the replica to take the request; ``what_if(id)`` is asked only by ``slo-aware``."""
        if not candidates:
            raise ValueError("no replica to route to")
        if self.name == "round-robin":
            chosen = candidates[self._next % len(candidates)][0]
            self._next += 1
            return chosen
        if self.name == "least-loaded" or len(candidates) == 1:
            return least_loaded(candidates, self.rng)
        return self._slo_aware(candidates, what_if)

    def _slo_aware(self, candidates, what_if) -> Hashable:
        sampled = self.rng.sample(list(candidates), 2)
        answers = [(rid, state, what_if(rid)) for rid, state in sampled]
        feasible = [a for a in answers if a[2].feasible]
        if feasible:
            best = max(a[2].headroom for a in feasible)
            top = [a for a in feasible if a[2].headroom == best]
            return least_loaded([(rid, state) for rid, state, _ in top], self.rng)
        self.fallbacks += 1
        return least_loaded(candidates, self.rng)


def least_loaded(candidates: Sequence[tuple[Hashable, ReplicaState]], rng: random.Random) -> Hashable:
    """The replica holding the fewest requests, then with the most free device KV blocks (random among ties)."""
    def key(item):
        return (item[1].load, -item[1].free_device_blocks)

    best = min(key(c) for c in candidates)
    ties = [rid for rid, state in candidates if key((rid, state)) == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)
