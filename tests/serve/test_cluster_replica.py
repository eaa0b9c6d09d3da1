"""An engine replica's health check (serve/cluster.py), without starting Ray: the replica object alone."""

from __future__ import annotations

import asyncio
import time
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


# ---- the request router, on fake replicas -------------------------------------------------------------------
def _stats(rid, headroom, running=0, queued=0, received=0, max_len=4096):
    """A replica's routing stats as EngineReplica.record_routing_stats reports them (its table's points, every
    answer feasible with `headroom`)."""
    from orbitflow.runtime.replica_state import what_if_points

    state = dict(running=running, queued=queued, paused=0, free_device_blocks=256, free_host_blocks=4096,
                 predicted_step_s=0.1, slo_s=0.2, max_num_seqs=4)
    return {"replica": rid, "stamp": time.monotonic(), "received": received, "state": state, "max_len": max_len,
            "what_if": [(p, o, True, 0.1, headroom) for p, o in what_if_points(max_len)]}


def _router():
    from orbitflow.serve.cluster import OrbitflowRequestRouter

    router = object.__new__(OrbitflowRequestRouter)  # Serve constructs it; the routing state is ours
    router.initialize_state(policy="slo-aware", seed=0)
    return router


_ID = {name: type("ReplicaID", (), {"unique_id": name})()
       for name in "ABC"}  # Serve's ReplicaID: hashable, with the unique_id the replica reports


def _running(name, stats):
    """A replica as the router sees it (Serve's RunningReplica)."""
    return SimpleNamespace(replica_id=_ID[name], routing_stats=stats)


def _route(router, replicas, max_tokens=32, prompt=10, avoid=None, method="generate", slo_s=None):
    """One call through choose_replicas, accepted by the replica chosen (as Serve reports it); its replica's name."""
    from orbitflow.runtime.sampling import SamplingParams

    request = SimpleNamespace(args=("id", [1] * prompt, SamplingParams(max_tokens=max_tokens, slo_s=slo_s), (), avoid),
                              metadata=SimpleNamespace(call_method=method))
    chosen = asyncio.run(router.choose_replicas(replicas, request))[0][0].replica_id
    router.on_request_routed(request, chosen, None)
    return chosen.unique_id


def test_a_burst_spreads_over_the_replicas_instead_of_following_one_stale_report():
    """Four requests at once into two idle replicas: the what-if tables answer for the replicas before any of them,
    so only the first follows the headroom; the rest go by load, two each (it was four on A, which then paused one
    and spilled to host memory while B held nothing)."""
    router = _router()
    a = _running("A", _stats("A", headroom=0.40))
    b = _running("B", _stats("B", headroom=0.35))
    chosen = [_route(router, [a, b]) for _ in range(4)]
    assert chosen[0] == "A" and sorted(chosen) == ["A", "A", "B", "B"], chosen


def test_requests_in_flight_count_until_the_replicas_report_counts_them():
    """A report stamped after the router sent requests, which do not count in it yet, does not make them vanish:
    A took 4 (its batch), reports idle without having received them, and the next request goes to B."""
    router = _router()
    a = _running("A", _stats("A", headroom=0.40))
    b = _running("B", _stats("B", headroom=0.35))
    for _ in range(4):
        router.on_request_routed(SimpleNamespace(), _ID["A"], None)
    a.routing_stats = _stats("A", headroom=0.40)  # a new report, still received=0
    assert [_route(router, [a, b]) for _ in range(2)] == ["B", "B"]
    # once A's report counts them (received=4, running 4), they are no longer in flight: its table holds again
    a.routing_stats = _stats("A", headroom=0.40, running=2, received=4)
    b.routing_stats = _stats("B", headroom=0.35, running=2, received=2)
    assert _route(router, [a, b]) == "A" and router.rule.fallbacks == 1  # the one decision with both unknown


def test_a_request_without_max_tokens_is_routed_by_headroom():
    """The API gives a request without max_tokens the rest of the context; the tables' rest-of-context points
    cover it, so slo-aware decides by headroom rather than falling back to least-loaded every time."""
    router = _router()
    a = _running("A", _stats("A", headroom=0.10, max_len=2176))
    b = _running("B", _stats("B", headroom=0.30, max_len=2176))
    assert _route(router, [a, b], prompt=13, max_tokens=2176 - 13) == "B"
    assert router.rule.fallbacks == 0


# ---- the ingress's engine bridge and metrics, on fake replicas ------------------------------------------------
class _Stream:
    """A replica's token stream as a Serve handle gives it: ``n`` tokens ``delay_s`` apart, then a finish."""

    def __init__(self, n: int, delay_s: float) -> None:
        from orbitflow.serve.async_engine import GenerationOutput

        self.items = [("R", GenerationOutput(i, "x", None)) for i in range(n)] + [("R", GenerationOutput(None, "",
                                                                                                         "length"))]
        self.delay_s, self.cancelled = delay_s, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        await asyncio.sleep(self.delay_s)
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


def _handle(streams: list):
    def remote(*args):
        streams.append(_Stream(*streams.pop(0)))
        return streams[-1]

    generate = SimpleNamespace(remote=remote)
    return SimpleNamespace(options=lambda **kw: SimpleNamespace(generate=generate))


def test_drain_lets_short_requests_finish_and_ends_the_rest_with_abort():
    """SIGTERM with --replicas (run_cluster asks the ingress to drain): a request that finishes within the grace
    ends as usual, one that does not ends with finish_reason "abort" and its replica stream is cancelled (the replica
    aborts it), and a new request is refused as the server shuts down (503), as in one process."""
    from orbitflow.serve.async_engine import EngineUnavailable
    from orbitflow.serve.cluster import RemoteEngine

    streams = [(3, 0.01), (1000, 0.01)]  # a short request, a long one
    remote = RemoteEngine(_handle(streams))

    async def run():
        async def collect(rid):
            return [out async for out in remote.generate(rid, [1, 2], None)]

        short, long = asyncio.ensure_future(collect("s")), asyncio.ensure_future(collect("l"))
        await asyncio.sleep(0.1)
        await remote.drain(0.3)
        with pytest.raises(EngineUnavailable, match="shutting down"):
            await anext(remote.generate("new", [1], None))
        return await short, await long

    short, long = asyncio.run(run())
    assert short[-1].finish_reason == "length" and len(short) == 4
    assert long[-1].finish_reason == "abort" and 10 < len(long) < 1000
    assert [s.cancelled for s in streams] == [False, True]
    assert remote._aborts == {}


def test_health_reports_no_engine_once_every_replica_is_gone(monkeypatch):
    """/health answers 503 'engine not running' when the routers know no live replica (it said ok while every
    request hung)."""
    import orbitflow.serve.cluster as cluster

    remote = cluster.RemoteEngine(handle=None)
    monkeypatch.setattr(cluster, "_ROUTERS", [])
    assert remote.running  # no router yet: nothing known (none is made before the first request)
    router = SimpleNamespace(curr_replicas={"A": object()})
    monkeypatch.setattr(cluster, "_ROUTERS", [router])
    assert remote.running
    router.curr_replicas = {}
    assert not remote.running


def test_cluster_counters_never_go_back_when_a_replica_dies(monkeypatch):
    import orbitflow.serve.cluster as cluster

    def report(replica, steps, running):
        return {"replica": replica, "metrics": [("orbitflow:engine_steps", "counter", "steps", steps),
                                                ("orbitflow:num_requests_running", "gauge", "running", running)]}

    reports = [report("A", 400, 2), report("B", 300, 1)]
    monkeypatch.setattr(cluster, "_ROUTERS", [SimpleNamespace(replica_stats=lambda: list(reports))])
    collector = cluster._ClusterCollector()

    def values():
        return {m.name: m.samples[0].value for m in collector.collect()}

    assert values()["orbitflow:engine_steps"] == 700
    reports[:] = [report("B", 310, 1)]  # A died: what it counted stays, its gauge goes
    got = values()
    assert got["orbitflow:engine_steps"] == 710 and got["orbitflow:num_requests_running"] == 1
    reports[:] = [report("A", 400, 2), report("B", 310, 1)]  # Serve lists the dead A again for a while
    assert values()["orbitflow:engine_steps"] == 710
    reports[:] = [report("B", 310, 1)]
    assert values()["orbitflow:engine_steps"] == 710
    reports[:] = [report("B", 320, 1), report("C", 5, 1)]  # Serve's replacement starts from 0
    assert values()["orbitflow:engine_steps"] == 725 and values()["orbitflow:cluster_replicas"] == 2


def test_a_client_that_hangs_up_cancels_its_replica_stream_at_once():
    """Closing the ingress's stream (the API does when the client disconnects) cancels the replica's stream then and
    there, so the replica aborts the request and frees its blocks, not whenever the inner generator is collected."""
    from orbitflow.serve.cluster import RemoteEngine

    streams = [(1000, 0.001)]
    remote = RemoteEngine(_handle(streams))

    async def run():
        outs = remote.generate("r", [1], None)
        await anext(outs)
        await anext(outs)
        await outs.aclose()
        return streams[0].cancelled, dict(remote._aborts)

    assert asyncio.run(run()) == (True, {})


def test_calls_that_are_not_requests_are_not_in_flight():
    """The ingress's start-up `info` call goes through the router too; the replica counts only requests
    (`generate`), so counting it left that replica 'in flight' for good (its table unknown, its queue one long)."""
    router = _router()
    a = _running("A", _stats("A", headroom=0.40))
    b = _running("B", _stats("B", headroom=0.35))
    _route(router, [a], method="info")
    assert _route(router, [a, b]) == "A"
    a.routing_stats = _stats("A", headroom=0.40, running=1, received=1)  # its report counts the request
    assert _route(router, [a, b]) == "A" and router.rule.fallbacks == 0


def test_a_request_a_full_queue_refused_goes_to_another_replica():
    router = _router()
    a = _running("A", _stats("A", headroom=0.40))
    b = _running("B", _stats("B", headroom=0.35))
    assert _route(router, [a, b], avoid="A") == "B"
    assert _route(router, [a], avoid="A") == "A"  # no other: it tries the same one (and gets its 503)


def test_a_refusal_names_its_replica_across_processes():
    import pickle

    from orbitflow.runtime.engine import QueueFull

    again = pickle.loads(pickle.dumps(QueueFull("busy", 3, "A")))
    assert (str(again), again.retry_after_s, again.replica) == ("busy", 3, "A")


class ActorUnavailableError(Exception):
    """What Ray raises for a replica it cannot reach (matched by name, as for the real one)."""


def test_a_retry_after_an_unreachable_replica_runs_under_an_id_of_its_own():
    """The replica may only have been unreachable for a moment and still hold the first attempt: the retry must not
    collide with it there (the engine refuses an id in use)."""
    from orbitflow.serve.cluster import RemoteEngine

    ids, streams = [], [(2, 0.0)]

    class Unreachable(_Stream):
        async def __anext__(self):  # Ray raises it where the stream is read
            raise ActorUnavailableError("replica unreachable")

    def remote(request_id, *args):
        ids.append(request_id)
        return Unreachable(0, 0.0) if len(ids) == 1 else _Stream(*streams.pop(0))

    handle = SimpleNamespace(options=lambda **kw: SimpleNamespace(generate=SimpleNamespace(remote=remote)))

    async def run():
        return [out async for out in RemoteEngine(handle).generate("r", [1], None)]

    assert asyncio.run(run())[-1].finish_reason == "length"
    assert ids == ["r", "r-retry"]


def test_a_mistyped_policy_fails_before_any_replica_starts():
    """Each replica builds its own LLM; a bad --policy must not surface as one failed constructor per replica."""
    from orbitflow.config import ConfigError, EngineConfig
    from orbitflow.serve.cluster import build_cluster_app

    with pytest.raises(ConfigError, match="--policy"):
        build_cluster_app(EngineConfig.build(policy="orbitflw"), replicas=2)


def test_a_replica_reserves_a_gpu_per_rank_on_cuda_and_none_on_the_cpu():
    """Without a reservation Ray puts several replicas on one GPU, each seeing them all (all on cuda:0)."""
    from orbitflow.config import EngineConfig
    from orbitflow.serve.cluster import replica_gpus_for

    assert replica_gpus_for(EngineConfig.build(device="cuda", tensor_parallel_size=2), cluster_gpus=0) == 2
    assert replica_gpus_for(EngineConfig.build(device="auto"), cluster_gpus=8) == 1
    assert replica_gpus_for(EngineConfig.build(device="auto"), cluster_gpus=0) == 0
    assert replica_gpus_for(EngineConfig.build(device="cpu"), cluster_gpus=8) == 0


def test_a_full_queue_is_reachable_and_serves_backpressure_as_a_503():
    """Serve sends a replica one request more than its engine holds, so the engine's QueueFull (retry elsewhere, then
    503) fires; past the replicas, Serve's own backpressure becomes the same QueueFull, not a hang or a 500."""
    from ray.serve.exceptions import BackPressureError

    from orbitflow.config import EngineConfig
    from orbitflow.runtime.engine import QueueFull
    from orbitflow.serve.cluster import _translate, replica_limits

    config = EngineConfig.build(max_num_seqs=4, max_queue_len=8)
    ongoing, queued = replica_limits(config)
    assert ongoing > 4 + 8 and queued == 8  # the engine refuses at running + waiting == max_num_seqs + max_queue_len
    assert replica_limits(EngineConfig.build(max_queue_len=None))[1] == -1  # unbounded: the engines queue
    error = _translate(BackPressureError(num_queued_requests=8, max_queued_requests=8))
    assert isinstance(error, QueueFull) and "--max-queue-len" in str(error) and error.retry_after_s >= 1


@pytest.mark.parametrize("where", ["call", "stream"])
def test_backpressure_is_a_503_of_ours_after_one_retry(where):
    """Serve raises BackPressureError when the queues are full: from the call, or where the stream is read, and then
    again from the failed stream's cancel(). It escaped untranslated, and Serve's proxy answered a plain-text 503
    with no Retry-After (seen on a live cluster). Now it is a QueueFull, tried once more."""
    from ray.serve.exceptions import BackPressureError

    from orbitflow.runtime.engine import QueueFull
    from orbitflow.serve.cluster import RemoteEngine

    ids = []

    class Refused(_Stream):
        async def __anext__(self):
            raise BackPressureError(num_queued_requests=1, max_queued_requests=1)

        def cancel(self):
            raise BackPressureError(num_queued_requests=1, max_queued_requests=1)

    def remote(request_id, *args):
        ids.append(request_id)
        if where == "call":
            raise BackPressureError(num_queued_requests=1, max_queued_requests=1)
        return Refused(0, 0.0)

    handle = SimpleNamespace(options=lambda **kw: SimpleNamespace(generate=SimpleNamespace(remote=remote)))

    async def run():
        return [out async for out in RemoteEngine(handle).generate("r", [1], None)]

    with pytest.raises(QueueFull, match="--max-queue-len") as refused:
        asyncio.run(run())
    assert ids == ["r", "r-retry"] and refused.value.retry_after_s >= 1


def test_a_request_with_its_own_slo_is_judged_against_it():
    """The replicas' tables answer for their default SLO (0.2 s); a request whose slo_ms the planned step (0.1 s)
    misses is not feasible there, and one it meets keeps the tighter of the two headrooms."""
    from orbitflow.runtime.replica_state import WhatIf
    from orbitflow.serve.cluster import _for_slo

    table = WhatIf(True, 0.1, 0.5)
    assert _for_slo(table, None) == table
    assert _for_slo(table, 0.05) == WhatIf(False, 0.1, -1.0, "slo")
    assert _for_slo(table, 0.125).headroom == pytest.approx(0.2)
    router = _router()
    a, b = _running("A", _stats("A", headroom=0.5)), _running("B", _stats("B", headroom=0.4))
    assert _route(router, [a, b], slo_s=0.05) in ("A", "B") and router.rule.fallbacks == 1  # neither: by load


def test_each_request_gets_the_replica_chosen_for_it_through_serves_matching():
    """Through Serve's own request matching (its private `_choose_replica_for_request`: no public entry point routes
    a request without a cluster): a long and a short prompt pending at once, replicas answering Serve's queue-length
    probes after random delays. A holds short prompts only and has the most headroom for them; B holds anything.
    With FIFOMixin the replica chosen for one request went to whichever was first in the queue, and the long prompt
    landed on A in about half the trials."""
    import random

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from orbitflow.runtime.sampling import SamplingParams
    from orbitflow.serve.cluster import OrbitflowRequestRouter

    class Replica:  # what Serve reads of a RunningReplica here
        def __init__(self, name: str, holds_long: bool):
            stats = _stats(name, headroom=0.1 if holds_long else 0.5, max_len=16384)
            stats["what_if"] = [(p, o, holds_long or p <= 512, 0.1, h) for p, o, _, _, h in stats["what_if"]]
            self.replica_id, self.routing_stats = _ID[name], stats
            self.max_ongoing_requests, self.node_id, self.availability_zone = 100, "node", None
            self.multiplexed_model_ids: set = set()

        async def get_queue_len(self, *, deadline_s):
            await asyncio.sleep(random.uniform(0, 0.01))
            return 0

    def pending(name, prompt):
        metadata = RequestMetadata(request_id=name, internal_request_id=name, call_method="generate")
        return PendingRequest(args=[name, [1] * prompt, SamplingParams(max_tokens=64), (), None], kwargs={},
                              metadata=metadata)

    async def where_the_long_one_goes(seed):
        random.seed(seed)
        router = OrbitflowRequestRouter(DeploymentID(name="engine", app_name="orbitflow"),
                                        DeploymentHandleSource.REPLICA)
        router.initialize_state(policy="slo-aware", seed=seed)
        router.update_replicas([Replica("A", holds_long=False), Replica("B", holds_long=True)])
        long, short = pending("long", 8000), pending("short", 100)
        got = await asyncio.gather(router._choose_replica_for_request(long), router._choose_replica_for_request(short))
        return got[0].replica_id.unique_id, got[1].replica_id.unique_id

    outcomes = [asyncio.run(where_the_long_one_goes(seed)) for seed in range(20)]
    assert all(long == "B" for long, _ in outcomes), outcomes
    assert any(short == "A" for _, short in outcomes)  # the short one still goes where it has the most headroom


def test_start_up_mistakes_are_one_line_naming_the_flag(monkeypatch):
    """From a review of `serve --replicas`: a missing model took 39 s and ~200 lines of every replica's traceback; an
    unreachable --ray-address was a traceback; more replicas than this machine's Ray can place waited forever while
    /health answered 200."""
    import ray

    from orbitflow.config import ConfigError, EngineConfig
    from orbitflow.model.errors import ModelLoadError
    from orbitflow.serve import cluster

    connect = cluster.connect
    connected = []
    monkeypatch.setattr(cluster, "connect", lambda *args: connected.append(args))
    with pytest.raises(ModelLoadError, match="model not found: /no/such/model"):
        cluster.run_cluster(EngineConfig.build(model="/no/such/model"), 2, None, "127.0.0.1", 8000, "slo-aware")
    assert connected == []  # refused before Ray starts

    def unreachable(**kwargs):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", unreachable)
    with pytest.raises(ConfigError, match="--ray-address auto: no Ray cluster there \\(Could not find any"):
        connect("auto")

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    cluster.check_resources(2, 1.0, 0.0)  # fits
    with pytest.raises(ConfigError, match="--replicas 3 x --replica-cpus 1 needs 3 CPUs; this Ray has 2"):
        cluster.check_resources(3, 1.0, 0.0)
    with pytest.raises(ConfigError, match="--replica-gpus 1 needs 2 GPUs; this Ray has 0"):
        cluster.check_resources(2, 0.5, 1.0)
