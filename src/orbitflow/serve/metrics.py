"""Prometheus metrics of one served app, on a registry of its own.

Latency histograms are taken on the stream as delivered to the client (after Token-Deposit), so the
inter-token latency here is the TBT the SLO is about, and ``slo_violations_delivered`` counts that stream's gaps over
the SLO the engine paced that request for (each token carries it: a cluster's replicas each measure their own);
``slo_violations_scheduled`` counts the deposit's schedule, which a token's delivery may miss by the event
loop's jitter (``--deposit-guard-ms`` paces under the SLO to absorb it). Engine state (batch, KV blocks, solver, pauses,
violations) is read at scrape time by a collector, so it never goes stale.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from orbitflow.runtime.deposit import SLO_TOLERANCE_S
from orbitflow.runtime.engine import Engine

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        buckets = (("running", engine.running), ("waiting", engine.waiting), ("paused", engine.paused))
        for name, bucket in buckets:
            yield GaugeMetricFamily(f"orbitflow:num_requests_{name}", f"Requests {name} in the engine",
                                    value=len(bucket))
        device_used, host_used = engine.kv.usage()
        yield GaugeMetricFamily("orbitflow:kv_device_blocks_used", "Device KV blocks in use",
                                value=device_used)
        yield GaugeMetricFamily("orbitflow:kv_host_blocks_used", "Host KV blocks in use", value=host_used)
        yield GaugeMetricFamily("orbitflow:kv_device_blocks_total", "Device KV block budget",
                                value=engine.kv.device_pool.num_blocks)
        yield GaugeMetricFamily("orbitflow:kv_host_blocks_total", "Host KV pool size in blocks",
                                value=engine.kv.host_pool.num_blocks)
        yield GaugeMetricFamily("orbitflow:kv_prefetch_overflow_blocks_peak", "Most prefetch staging blocks held "
                                "outside the device KV budget at once (the pool had no room; 0 when the budget held)",
                                value=engine.stats.overflow_blocks_peak)
        stats = engine.stats
        counters = (
            ("orbitflow:solver_calls", "Placement solver calls", engine.controller.solver_calls),
            ("orbitflow:solver_seconds", "Time spent in the placement solver",
             engine.controller.solver_time_s),
            ("orbitflow:solver_budget_reached", "Solves stopped by the planner budget before proving optimality "
                                                "(within --plan-gap)",
             engine.controller.solver_budget_hits),
            ("orbitflow:slo_violations_scheduled", "Token gaps over the SLO in Token-Deposit's delivery schedule",
             stats.delivered_violations),
            ("orbitflow:slo_violations_generated", "Token gaps over the SLO as generated",
             stats.generated_violations),
            ("orbitflow:pauses", "Requests paused to make the plan feasible", stats.pauses),
            ("orbitflow:resumes", "Paused requests resumed", stats.resumes),
            ("orbitflow:recomputes", "Paused requests whose KV was dropped, to be computed again",
             stats.recomputes),
            ("orbitflow:engine_steps", "Engine steps run", stats.steps),
            ("orbitflow:kv_link_preemptions", "KV prefetches that yielded the link to an earlier layer's "
             "(--kv-link preemptive; summed over tensor-parallel ranks)", stats.link_preemptions),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield from _rank_metrics(engine.executor)
        records = engine.controller.records
        yield GaugeMetricFamily("orbitflow:plan_optimality_gap",
                                "Certified relative gap of the latest plan to the best possible one (0: optimal)",
                                value=records[-1].gap if records else 0.0)


def _rank_metrics(executor) -> Iterator[Metric]:
    """Per-rank KV pool use and link bytes of a tensor-parallel executor (as of its last step)."""
    ranks = getattr(executor, "rank_stats", None)
    if not ranks:
        return
    blocks = GaugeMetricFamily("orbitflow:tp_kv_blocks_used", "KV blocks in use on one tensor-parallel rank",
                               labels=["rank", "tier"])
    pool_bytes = GaugeMetricFamily("orbitflow:tp_kv_bytes_used", "KV bytes in use on one tensor-parallel rank "
                                   "(its shard of the KV heads)", labels=["rank", "tier"])
    link = CounterMetricFamily("orbitflow:tp_link_bytes", "KV bytes moved over one rank's host link",
                               labels=["rank", "direction"])
    preempted = CounterMetricFamily("orbitflow:tp_link_preemptions", "KV prefetches on one rank's host link that "
                                    "yielded it to an earlier layer's (--kv-link preemptive)", labels=["rank"])
    for r in ranks:
        for tier, used in (("device", r.device_blocks_used), ("host", r.host_blocks_used)):
            blocks.add_metric([str(r.rank), tier], used)
            pool_bytes.add_metric([str(r.rank), tier], used * r.block_bytes)
        link.add_metric([str(r.rank), "h2d"], r.bytes_h2d)
        link.add_metric([str(r.rank), "d2h"], r.bytes_d2h)
        preempted.add_metric([str(r.rank)], r.preemptions)
    yield from (blocks, pool_bytes, link, preempted)


def engine_metric_values(engine: Engine) -> list[tuple[str, str, str, float]]:
    """The engine's gauges and counters as (name, type, help, value): what a cluster replica reports, so the
    cluster's /metrics can sum them under the same names. Labelled families (a tensor-parallel engine's per-rank
    figures) are left out: one value cannot stand for them, and summing rank 0 of every replica means nothing."""
    return [(m.name, m.type, m.documentation, float(m.samples[0].value)) for m in _EngineCollector(engine).collect()
            if not any(s.labels for s in m.samples)]


class ServerMetrics:
    def __init__(self, engine: Engine | None = None, collector=None) -> None:
        """Engine state comes from `engine` (one process) or from `collector` (a cluster's replicas)."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine) if engine is not None else collector)
        self.ttft = Histogram("orbitflow:time_to_first_token_seconds", "Time to first token, as delivered",
                              buckets=_LATENCY_BUCKETS + (20.0, 40.0), registry=self.registry)
        self.itl = Histogram("orbitflow:inter_token_latency_seconds",
                             "Gap between consecutive tokens as delivered (after Token-Deposit)",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("orbitflow:time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1), as delivered",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.max_itl = Histogram("orbitflow:request_max_inter_token_latency_seconds",
                                 "Per request: its longest gap between consecutive tokens as delivered (a pause, "
                                 "a recompute or a stall shows here even when the mean gap meets the SLO)",
                                 buckets=_LATENCY_BUCKETS + (20.0, 40.0), registry=self.registry)
        self.e2e = Histogram("orbitflow:e2e_request_latency_seconds", "Request arrival to last token",
                             buckets=_REQUEST_BUCKETS, registry=self.registry)
        self.requests = Counter("orbitflow:requests", "Requests ended, by finish reason (each of n choices counts)",
                                ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("orbitflow:prompt_tokens", "Prompt tokens of served requests (once for n choices)",
                                     registry=self.registry)
        self.generation_tokens = Counter("orbitflow:generation_tokens", "Tokens delivered",
                                         registry=self.registry)
        self.violations = Counter("orbitflow:slo_violations_delivered", "Token gaps over the SLO as delivered "
                                  "(this server's stopwatch on the stream)", registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, arrival_s: float, num_prompt: int, slo_s: float | None = None) -> RequestTracker:
        return RequestTracker(self, arrival_s, num_prompt, slo_s)


class RequestTracker:
    """Stopwatch of one request's delivered stream."""

    def __init__(self, metrics: ServerMetrics, arrival_s: float, num_prompt: int, slo_s: float | None = None) -> None:
        self.metrics = metrics
        self.slo_s = slo_s  # the request's TBT SLO (None: no violations counted)
        self.arrival_s = arrival_s
        self.num_prompt = num_prompt
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.num_tokens = 0
        self.max_gap_s = 0.0

    def on_token(self, now: float) -> None:
        if self.first_s is None:
            self.first_s = now
            self.metrics.ttft.observe(now - self.arrival_s)
        else:
            gap = now - self.last_s
            self.max_gap_s = max(self.max_gap_s, gap)
            self.metrics.itl.observe(gap)
            if self.slo_s is not None and gap > self.slo_s + SLO_TOLERANCE_S:
                self.metrics.violations.inc()
        self.last_s = now
        self.num_tokens += 1

    def on_finish(self, finish_reason: str) -> None:
        m = self.metrics
        m.requests.labels(finish_reason).inc()
        m.prompt_tokens.inc(self.num_prompt)
        m.generation_tokens.inc(self.num_tokens)
        if self.last_s is not None:
            m.e2e.observe(self.last_s - self.arrival_s)
        if self.num_tokens > 1:
            m.tpot.observe((self.last_s - self.first_s) / (self.num_tokens - 1))
            m.max_itl.observe(self.max_gap_s)
