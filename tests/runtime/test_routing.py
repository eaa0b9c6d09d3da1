"""The routing rule shared by the Ray Serve router and the cluster simulator."""

from __future__ import annotations

import math

import pytest

from orbitflow.runtime.replica_state import ReplicaState, WhatIf
from orbitflow.runtime.routing import Router, least_loaded


def state(running=0, queued=0, paused=0, free_device=100) -> ReplicaState:
    return ReplicaState(running, queued, paused, free_device, 1000, 0.01, 0.05, 8)


def test_round_robin_cycles_over_candidates():
    router = Router("round-robin")
    cands = [(i, state()) for i in range(3)]
    assert [router.choose(cands, None) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_counts_every_request_held_then_free_device_blocks():
    cands = [("a", state(running=2)), ("b", state(running=1, queued=1, paused=1)), ("c", state(running=1, queued=0))]
    assert Router("least-loaded").choose(cands, None) == "c"
    ties = [("a", state(running=1, free_device=10)), ("b", state(running=1, free_device=50))]
    assert Router("least-loaded").choose(ties, None) == "b"


def test_slo_aware_prefers_the_most_headroom_over_the_lighter_load():
    cands = [("busy", state(running=3)), ("idle", state(running=0))]
    answers = {"busy": WhatIf(True, 0.02, 0.6), "idle": WhatIf(True, 0.04, 0.2)}
    assert Router("slo-aware").choose(cands, answers.__getitem__) == "busy"
    answers = {"busy": WhatIf(True, 0.02, 0.6), "idle": WhatIf(False, 0.09, -0.8, "slo")}
    assert Router("slo-aware").choose(cands, answers.__getitem__) == "busy"


def test_slo_aware_falls_back_to_the_least_loaded_of_all_when_no_sample_is_feasible():
    cands = [(i, state(running=4 - i)) for i in range(4)]  # replica 3 is the least loaded
    asked = []

    def what_if(rid):
        asked.append(rid)
        return WhatIf(False, 0.1, -math.inf, "batch full")

    router = Router("slo-aware", seed=1)
    for _ in range(5):
        assert router.choose(cands, what_if) == 3
    assert router.fallbacks == 5
    assert len(asked) == 10  # power of two choices: two replicas asked per decision, never all four


def test_slo_aware_samples_two_distinct_replicas_reproducibly():
    cands = [(i, state()) for i in range(10)]
    picks = []
    for _ in range(2):
        asked: list = []
        router = Router("slo-aware", seed=7)
        chosen = [router.choose(cands, lambda r, asked=asked: asked.append(r) or WhatIf(True, 0.01, r / 10))
                  for _ in range(20)]
        assert all(len({a, b}) == 2 for a, b in zip(asked[::2], asked[1::2]))
        assert all(c == max(pair) for c, pair in zip(chosen, zip(asked[::2], asked[1::2])))
        picks.append(chosen)
    assert picks[0] == picks[1]


def test_bad_router_name_and_no_candidates_are_refused():
    with pytest.raises(ValueError, match="--router"):
        Router("random")
    with pytest.raises(ValueError, match="no replica"):
        Router().choose([], None)


def test_least_loaded_breaks_exact_ties_at_random():
    import random

    rng = random.Random(0)
    seen = {least_loaded([("a", state()), ("b", state())], rng) for _ in range(50)}
    assert seen == {"a", "b"}
