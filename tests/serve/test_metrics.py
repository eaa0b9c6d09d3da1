"""Engine metrics as a cluster replica reports them (`engine_metric_values`)."""

from __future__ import annotations

from orbitflow.plan.hardware import load_preset
from orbitflow.runtime.tp_executor import RankStats
from orbitflow.serve.metrics import ServerMetrics, engine_metric_values
from orbitflow.sim.runner import build_sim_engine, sim_config


def test_replica_values_are_the_unlabelled_families_only():
    """A tensor-parallel engine adds per-rank families (labels rank/tier): a replica's flat report must not
    squash one of them into its first sample (rank 0's device blocks reported as the family's value)."""
    profile = load_preset("a100-llama3-8b")
    engine = build_sim_engine(profile, sim_config(profile))
    try:
        engine.executor.rank_stats = [RankStats(r, 10 + r, 20 + r, 64, 1000 * (r + 1), 0, 0.0, 0.0, "preemptive", 3 * r)
                                      for r in range(2)]
        engine.stats.link_preemptions = 3
        values = {name: value for name, _, _, value in engine_metric_values(engine)}
        assert not any(name.startswith("orbitflow:tp_") for name in values), values
        assert values["orbitflow:kv_device_blocks_total"] == engine.kv.device_pool.num_blocks
        # the single-process /metrics still shows every rank
        text = ServerMetrics(engine).render().decode()
        assert 'orbitflow:tp_kv_blocks_used{rank="1",tier="host"} 21.0' in text
        assert 'orbitflow:tp_link_preemptions_total{rank="1"} 3.0' in text
        assert values["orbitflow:kv_link_preemptions"] == 3
    finally:
        engine.close()


def test_delivered_violations_are_counted_on_the_stream_as_sent():
    """The server's own stopwatch: a gap over the SLO by the event loop's jitter counts, whatever the deposit's
    schedule said; the schedule's count is a metric of its own."""
    metrics = ServerMetrics(collector=type("NoEngine", (), {"collect": lambda self: iter(())})())
    tracker = metrics.tracker(0.0, 5, slo_s=0.050)
    for t in (0.100, 0.150, 0.2004, 0.250, 0.320):  # 50 ms apart, then 50.4 ms (jitter), 49.6, 70
        tracker.on_token(t)
    assert metrics.violations._value.get() == 2
    tracker.on_finish("length")  # its longest gap, once per request: 70 ms
    assert 'orbitflow:request_max_inter_token_latency_seconds_bucket{le="0.06"} 0.0' in metrics.render().decode()
    assert 'orbitflow:request_max_inter_token_latency_seconds_bucket{le="0.08"} 1.0' in metrics.render().decode()
    untracked = metrics.tracker(0.0, 5)  # no SLO known: nothing counted
    for t in (0.1, 0.9):
        untracked.on_token(t)
    assert metrics.violations._value.get() == 2
    assert "orbitflow:slo_violations_delivered_total 2.0" in metrics.render().decode()


def test_delivered_gaps_are_judged_against_the_slo_of_the_engine_that_made_them():
    """Behind a cluster the ingress's default SLO is one replica's; a replica on other hardware measured its own. Each
    token carries the SLO its engine paces the request for, and the server's stopwatch judges the gaps against it."""
    import asyncio

    from orbitflow.runtime.clock import VirtualClock
    from orbitflow.runtime.sampling import SamplingParams
    from orbitflow.serve.api import OpenAIServer
    from orbitflow.serve.async_engine import GenerationOutput

    clock = VirtualClock()

    class SlowReplica:  # tokens 80 ms apart, paced for its own SLO of 100 ms
        async def generate(self, request_id, prompt_ids, sampling, stop=()):
            for token in range(4):
                clock.advance(0.080)
                yield GenerationOutput(token, "x", None, slo_s=0.100)
            yield GenerationOutput(None, "", "length")

    metrics = ServerMetrics(collector=type("NoEngine", (), {"collect": lambda self: iter(())})())
    server = OpenAIServer("m", None, SlowReplica(), metrics, clock, 64, 100, slo_s=0.050)  # the ingress's: 50 ms

    async def run():
        return [d async for d in server.deltas(0, "r", [1, 2], SamplingParams(max_tokens=4), [])]

    assert asyncio.run(run())[-1].finish_reason == "length"
    assert metrics.violations._value.get() == 0  # 80 ms gaps against the replica's 100 ms (50 ms would count 3)
