"""Cluster simulation: N simulated engines behind the shared routing rule."""

from __future__ import annotations

import pytest

from orbitflow.bench.workload import Trace, TraceRequest
from orbitflow.plan.hardware import load_preset
from orbitflow.sim.cluster import simulate_cluster
from orbitflow.sim.runner import sim_config


def _trace(n=12, gap_s=0.05):
    return Trace([TraceRequest(request_id=f"r{i}", arrival_s=i * gap_s, input_tokens=300 + 50 * (i % 4),
                               output_tokens=20 + 5 * (i % 3)) for i in range(n)])


@pytest.mark.parametrize("router", ["slo-aware", "round-robin", "least-loaded"])
def test_every_request_finishes_and_no_block_leaks(router):
    profile = load_preset("a100-llama3-8b")
    config = sim_config(profile, device_kv_blocks=2048, max_num_seqs=2)
    trace = _trace()
    result = simulate_cluster(profile, trace, config, 3, router, seed=0)
    assert result.metrics.num_finished == len(trace) and result.rejected == 0
    assert result.blocks_in_use == 0
    assert sum(result.per_replica_requests) == len(trace)
    assert all(n > 0 for n in result.per_replica_requests)
    if router == "round-robin":
        assert result.per_replica_requests == [4, 4, 4]
    again = simulate_cluster(profile, trace, config, 3, router, seed=0)
    assert again.per_replica_requests == result.per_replica_requests
    assert again.metrics.tbt_attainment == result.metrics.tbt_attainment


def test_one_replica_matches_the_single_engine_simulation():
    from orbitflow.sim.runner import simulate_trace

    profile = load_preset("a100-llama3-8b")
    config = sim_config(profile, device_kv_blocks=2048, max_num_seqs=2)
    trace = _trace(8)
    single = simulate_trace(profile, trace, config).metrics
    cluster = simulate_cluster(profile, trace, config, 1, "least-loaded").metrics
    for key in ("num_finished", "tbt_attainment", "makespan_s", "total_output_tokens", "p95_tbt_s"):
        assert getattr(cluster, key) == pytest.approx(getattr(single, key)), key


def test_bad_replica_count_is_refused():
    profile = load_preset("a100-llama3-8b")
    with pytest.raises(ValueError, match="--replicas"):
        simulate_cluster(profile, _trace(2), sim_config(profile), 0, "round-robin")
