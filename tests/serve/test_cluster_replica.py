"""An engine replica's health check (serve/cluster.py), without starting Ray: the replica object alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray")
from orbitflow.serve.cluster import EngineReplica  # noqa: E402


def _replica(failure):
    replica = object.__new__(EngineReplica)  # Serve constructs it; here only what check_health reads
    # shutdown and close: what the replica's finalizer calls when the test drops it
    replica.engine = SimpleNamespace(running=True, stalled=lambda after_s: None, shutdown=lambda: None)
    replica.llm = SimpleNamespace(executor=SimpleNamespace(failure=failure), close=lambda: None)
    replica.watchdog_s = 60.0
    return replica


def test_health_check_fails_on_a_failed_executor():
    """A tensor-parallel replica whose rank died fails Serve's health check (so Serve replaces it), as /health
    does for one process."""
    _replica(None).check_health()
    with pytest.raises(RuntimeError, match="rank 1 died"):
        _replica("tensor-parallel rank 1 died (exit code -9)").check_health()
