"""`orbitflow serve --replicas N`: N engine replicas behind the project's own API, on Ray Serve.

Ray Serve does the cluster work: it places the replicas (on this machine, or across the nodes of the Ray
cluster given by ``--ray-address``), health-checks them, restarts a dead one and routes each request through a
request router of ours. The application has two deployments:

- ``orbitflow-engine`` (:class:`EngineReplica`): one engine (LLM + AsyncEngine, exactly what single-process
  serving runs) per replica. ``generate`` streams its tokens; ``record_routing_stats`` reports the replica's
  state (runtime/replica_state.py), a what-if table from its own planner, and its engine metrics;
  ``check_health`` fails when the engine loop died or stalled, and Serve then replaces the replica.
- ``orbitflow-api`` (:class:`ClusterIngress`): the FastAPI app of serve/api.py (`serve_app`) with
  :class:`RemoteEngine` as its engine bridge, so routes, validation, errors, streaming, stop strings,
  Token-Deposit pacing (done in the replica) and /metrics are those of single-process serving.

:class:`OrbitflowRequestRouter` is the deployment's Ray Serve request router: it applies
`orbitflow.runtime.routing.Router` (slo-aware / least-loaded / round-robin, the rule the cluster simulator uses)
to the replicas' routing stats. A replica's report counts the requests it has received; those the router sent it
that the report does not count yet (in flight, at most ``IN_FLIGHT_S`` old) are added to its queue, and its what-if
table, which answers for the replica as it was, is then not known to hold (so a burst spreads by load rather than
all going to the replica whose last report had the most headroom).

A replica that dies ends the requests streaming from it with an error (an error event, or a 500 before the
first token; a request that had not started yet is retried once on another replica, as is one the replica's full
queue refused, which gets the replica's 503 if the retry is refused too); the router stops
choosing it at once (Serve tells it), and Serve starts a replacement.

Ray is the optional ``cluster`` extra: nothing here is imported by single-process serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, suppress

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from orbitflow.config import ClusterConfig, ConfigError, EngineConfig
from orbitflow.model.registry import resolve_model_path
from orbitflow.policies import make_policy
from orbitflow.runtime.engine import QueueFull, RequestRejected
from orbitflow.runtime.replica_state import ReplicaState, WhatIf, lookup_what_if, replica_state, what_if_table
from orbitflow.runtime.routing import DEFAULT_ROUTER, Router
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.serve.async_engine import EngineError, EngineUnavailable, GenerationOutput

log = logging.getLogger("orbitflow.serve.cluster")

APP_NAME = "orbitflow"
ENGINE_DEPLOYMENT = "orbitflow-engine"
INGRESS_DEPLOYMENT = "orbitflow-api"
DEFAULT_STATS_PERIOD_S = 0.5
IN_FLIGHT_S = 5.0  # a request sent to a replica whose reports have not counted it for this long is taken as lost


# ---- the engine replica -----------------------------------------------------------------------------------
class EngineReplica:
    """One engine, as a Ray Serve replica (the deployment's class; Serve constructs it)."""

    def __init__(self, config: EngineConfig, watchdog_s: float = 60.0, profile="measure") -> None:
        from orbitflow.llm import LLM
        from orbitflow.serve.api import max_len_of
        from orbitflow.serve.async_engine import AsyncEngine
        from orbitflow.serve.metrics import engine_metric_values

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.llm = LLM(config, profile=profile)  # "measure": the SLO derives from this node's decode step
        self.engine = AsyncEngine(self.llm.engine, self.llm.tokenizer)
        self.engine.start()
        self.watchdog_s = watchdog_s
        self.max_len = max_len_of(self.llm)
        self._metric_values = engine_metric_values
        self._table: tuple[tuple, list] | None = None  # (engine state key, what-if table)
        self._received = 0  # generate calls so far: the router adds the requests it sent that this does not count
        log.info("replica %s ready: SLO %.1f ms/token", self.replica_id, 1000 * self.llm.engine.default_slo_s)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       stop: tuple[str, ...] = (), avoid: str | None = None
                       ) -> AsyncIterator[tuple[str, GenerationOutput]]:
        """The request's outputs, each with this replica's id. ``avoid``: a replica whose full queue refused it
        (the router reads it; here it means nothing)."""
        self._received += 1
        try:
            async for out in self.engine.generate(request_id, prompt_ids, sampling, stop):
                yield self.replica_id, out
        except QueueFull as exc:  # the ingress retries elsewhere: say where it was refused
            raise QueueFull(str(exc), exc.retry_after_s, self.replica_id) from None

    def info(self) -> dict:
        llm = self.llm
        return {"replica": self.replica_id, "max_len": self.max_len, "vocab_size": llm.loaded.config.vocab_size,
                "model_dir": str(llm.loaded.path), "eos_token_ids": list(llm.loaded.config.eos_token_ids),
                "slo_s": llm.engine.default_slo_s, "deposit_guard_ms": llm.config.planner.deposit_guard_ms}

    # the replica state API
    def state(self) -> dict:
        return replica_state(self.llm.engine).to_dict()

    def what_if(self, prompt_tokens: int, max_tokens: int) -> dict:
        from dataclasses import asdict

        from orbitflow.runtime.replica_state import what_if

        return asdict(what_if(self.llm.engine, prompt_tokens, max_tokens))

    def record_routing_stats(self) -> dict:
        """Called by Serve every routing-stats period; what the router decides on."""
        engine = self.llm.engine
        received = self._received  # before the table and the state: a request counted here is in them or on its way
        key = (tuple(r.request_id for r in list(engine.running)), tuple(r.request_id for r in list(engine.waiting)),
               tuple(r.request_id for r in engine.incoming()), len(engine.paused), engine.stats.steps // 16)
        if self._table is None or self._table[0] != key:
            self._table = (key, what_if_table(engine, self.max_len))
        return {"replica": self.replica_id, "stamp": time.monotonic(), "received": received,
                "state": replica_state(engine).to_dict(), "max_len": self.max_len,
                "what_if": [(p, o, w.feasible, w.predicted_step_s, w.headroom) for p, o, w in self._table[1]],
                "metrics": self._metric_values(engine)}

    def check_health(self) -> None:
        if not self.engine.running:
            raise RuntimeError("the engine thread is not running")
        failure = getattr(self.llm.executor, "failure", None)  # a tensor-parallel rank died or hung
        if failure is not None:
            raise RuntimeError(f"executor failed: {failure}")
        stuck = self.engine.stalled(self.watchdog_s)
        if stuck is not None:
            raise RuntimeError(f"the engine loop has not advanced for {stuck:.0f} s with requests pending")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.llm.close()


# ---- the request router -----------------------------------------------------------------------------------
_ROUTERS: list = []  # the routers of this process (the ingress reads their replicas' stats for /metrics)


def _for_slo(answer: WhatIf, slo_s: float | None) -> WhatIf:
    """A replica's table answers for its default SLO; a request with a tighter one of its own (slo_ms) is feasible
    there only if the planned step meets that one too (the table's plans do not know it: an approximation)."""
    if not slo_s or not answer.feasible:
        return answer
    own = 1.0 - answer.predicted_step_s / slo_s
    if own < 0:
        return WhatIf(False, answer.predicted_step_s, own, "slo")
    return WhatIf(True, answer.predicted_step_s, min(answer.headroom, own))


def _is_generate(pending_request) -> bool:
    """Whether a routed call is a request (`generate`), not the ingress asking a replica something (`info`)."""
    return getattr(getattr(pending_request, "metadata", None), "call_method", "generate") == "generate"


def _stats_state(stats: dict) -> ReplicaState | None:
    return ReplicaState.from_dict(stats["state"]) if stats.get("state") else None


class OrbitflowRequestRouter(RequestRouter):
    """Ray Serve request router applying `orbitflow.runtime.routing.Router` to routing stats. Its choice is for one
    request (its prompt, max_tokens and SLO), so Serve's default matching, which gives the chosen replica to the very
    request it was chosen for, applies: FIFOMixin would give it to the oldest request waiting, whatever its size."""

    def initialize_state(self, policy: str = DEFAULT_ROUTER, seed: int = 0) -> None:
        self.rule = Router(policy, seed)
        self._routed: dict = defaultdict(int)  # replica id -> requests it accepted from this router, ever
        self._routed_at: dict = defaultdict(deque)  # replica id -> when (monotonic) it accepted the recent ones
        self._chosen: dict = {}  # id(pending request) -> (replica id, when): chosen, not yet accepted
        # Serve may load this class by value (its own copy of this module's globals): register in the module
        import orbitflow.serve.cluster as this_module

        this_module._ROUTERS.append(self)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        """Serve: `replica_id` accepted the request (counted when it is a generate call, as the replica counts)."""
        self._chosen.pop(id(pending_request), None)
        if _is_generate(pending_request):
            self._routed[replica_id] += 1
            self._routed_at[replica_id].append(time.monotonic())

    def _in_flight(self, rid, received: int | None, since: float) -> int:
        """Requests sent to `rid` that its last report does not count: accepted after it (the report's `received`
        lags the router's count), or chosen and not yet accepted; none from before `since`."""
        recent = self._routed_at[rid]
        while recent and recent[0] < since:
            recent.popleft()
        accepted = len(recent) if received is None else min(len(recent), max(0, self._routed[rid] - received))
        return accepted + sum(1 for chosen, _ in self._chosen.values() if chosen == rid)

    def _view(self, replica, since: float) -> tuple[ReplicaState, list, bool]:
        """The replica's state with the requests in flight to it (since `since`) queued, its what-if table, and
        whether that table still answers for it (nothing in flight)."""
        stats = replica.routing_stats or {}
        state = _stats_state(stats)
        if state is None:  # not reported yet: an empty replica as far as we know
            state = ReplicaState(0, 0, 0, 0, 0, 0.0, 0.0, 1)
        in_flight = self._in_flight(replica.replica_id, stats.get("received"), since)
        if in_flight:
            state = ReplicaState(**{**state.to_dict(), "queued": state.queued + in_flight})
        return state, stats.get("what_if") or [], not in_flight

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        prompt_tokens, max_tokens, slo_s = 1, 1, None
        generate = pending_request is not None and _is_generate(pending_request) and len(pending_request.args) >= 3
        if generate:
            prompt_tokens = max(1, len(pending_request.args[1]))
            max_tokens = max(1, int(pending_request.args[2].max_tokens))
            slo_s = getattr(pending_request.args[2], "slo_s", None)  # the request's own SLO (slo_ms)
            avoid = pending_request.args[4] if len(pending_request.args) >= 5 else None  # its queue refused it
            others = [r for r in candidate_replicas if r.replica_id.unique_id != avoid]
            candidate_replicas = others or candidate_replicas
        by_id = {r.replica_id: r for r in candidate_replicas}
        since = time.monotonic() - IN_FLIGHT_S  # sent before this: lost, or long counted
        self._chosen = {key: (rid, when) for key, (rid, when) in self._chosen.items() if when >= since}
        views = {rid: self._view(r, since) for rid, r in by_id.items()}

        def what_if(rid) -> WhatIf:
            state, table, current = views[rid]
            if state.running + state.queued + state.paused + 1 > state.max_num_seqs:
                return WhatIf(False, state.predicted_step_s, float("-inf"), "batch full")
            answer = None
            if current:  # (else the table answers for the replica before the requests in flight to it)
                rows = [(p, o, WhatIf(f, s, h)) for p, o, f, s, h in table]
                answer = lookup_what_if(rows, prompt_tokens, max_tokens,
                                        (by_id[rid].routing_stats or {}).get("max_len"))
            if answer is None:
                return WhatIf(False, state.predicted_step_s, float("-inf"), "unknown")
            return _for_slo(answer, slo_s)

        chosen = self.rule.choose([(rid, views[rid][0]) for rid in by_id], what_if)
        if generate:  # in flight from now: requests routed at once must not see the same state
            self._chosen[id(pending_request)] = (chosen, time.monotonic())
        rest = [r for rid, r in by_id.items() if rid != chosen]
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def replica_stats(self) -> list[dict]:
        return [r.routing_stats for r in self.curr_replicas.values() if r.routing_stats]


# ---- the ingress: the project's API over the replicas ------------------------------------------------------
_DEAD_REPLICA_HINTS = ("ActorDiedError", "ActorUnavailableError", "RayActorError", "ActorUnschedulableError")


def _translate(exc: BaseException) -> BaseException:
    """The engine's own exception for one raised in a replica; a dead replica becomes an EngineError, Serve's
    backpressure (every replica and the ingress's queue full) a QueueFull."""
    if any(cls.__name__ == "BackPressureError" for cls in type(exc).__mro__):
        return QueueFull("the server is busy: every replica's queue and the requests waiting for one are full "
                         "(--max-queue-len); retry later", 1)
    cause = getattr(exc, "cause", None)
    for known in (RequestRejected, QueueFull, EngineUnavailable, EngineError, ValueError):
        if isinstance(cause, known):
            return cause
    for known in (RequestRejected, QueueFull, EngineUnavailable, EngineError):
        if isinstance(exc, known):
            return exc
    return EngineError(f"the replica serving this request failed: {type(exc).__name__}: {_first_line(exc)}")


def _replica_died(exc: BaseException) -> bool:
    return any(cls.__name__ in _DEAD_REPLICA_HINTS for cls in type(exc).__mro__)


def _cancel(stream, started: bool) -> None:
    """Cancel a replica stream. One that never started (Serve's backpressure: it was never assigned) re-raises its
    failure from cancel(), which escaped the retry untranslated: Serve's proxy then answered a plain-text 503. A live
    stream whose cancel fails is said: its replica may run the request on, holding KV, until it ends."""
    try:
        stream.cancel()
    except Exception as exc:  # noqa: BLE001 - a cleanup: the request's own outcome is already decided
        (log.warning if started else log.debug)("cancelling a replica stream failed: %s: %s", type(exc).__name__, exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


class RemoteEngine:
    """AsyncEngine's serving surface over the engine deployment's handle (requests go through our router)."""

    def __init__(self, handle, on_routed=None) -> None:
        self.handle = handle
        self.draining = False
        self.on_routed = on_routed  # called with the replica id that took a request
        self._aborts: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}  # requests in flight

    def start(self) -> None:
        pass

    def shutdown(self, timeout_s: float = 30.0) -> None:
        pass

    @property
    def running(self) -> bool:
        """False once the routers know no live engine replica (every one died; Serve is starting others)."""
        routers = list(_ROUTERS)
        return not routers or any(router.curr_replicas for router in routers)  # no router yet: nothing known

    def stalled(self, after_s: float) -> float | None:
        return None  # each replica's own health check covers its loop (Serve replaces a stalled one)

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests (503); let those in flight finish for `grace_s` seconds, then end them with
        finish_reason "abort" (their replicas abort them and free their blocks), as one process does on SIGTERM."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._aborts and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for owner, event in list(self._aborts.values()):
            owner.call_soon_threadsafe(event.set)
        while self._aborts and loop.time() < deadline + 5.0:  # their last events reach the clients
            await asyncio.sleep(0.05)

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       stop: Sequence[str] = ()) -> AsyncIterator[GenerationOutput]:
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        abort = asyncio.Event()
        self._aborts[request_id] = (asyncio.get_running_loop(), abort)
        aborted = asyncio.ensure_future(abort.wait())
        try:  # closed with this generator (a client that hung up): its replica stream is cancelled at once
            async with aclosing(self._attempts(request_id, prompt_ids, sampling, tuple(stop), aborted)) as outs:
                async for out in outs:
                    yield out
        finally:
            aborted.cancel()
            self._aborts.pop(request_id, None)

    async def _attempts(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                        stop: tuple[str, ...], aborted: asyncio.Future) -> AsyncIterator[GenerationOutput]:
        avoid = None  # the replica whose full queue refused the first attempt
        for attempt in (0, 1):
            # a retry has an id of its own: a replica only unavailable for a moment may still hold the first attempt
            engine_id = request_id if attempt == 0 else f"{request_id}-retry"
            started = finished = False
            stream = item = None
            try:  # the call itself raises Serve's BackPressureError (queues full): a 503 of ours, like a QueueFull
                stream = self.handle.options(stream=True).generate.remote(engine_id, prompt_ids, sampling, stop, avoid)
                items = stream.__aiter__()
                while True:
                    item = asyncio.ensure_future(items.__anext__())
                    await asyncio.wait((item, aborted), return_when=asyncio.FIRST_COMPLETED)
                    if not item.done():  # drained: the request ends here (the stream's cancel aborts it)
                        item.cancel()
                        yield GenerationOutput(None, "", "abort")
                        return
                    try:
                        replica, out = item.result()
                    except StopAsyncIteration:
                        return
                    if not started:
                        started = True
                        if self.on_routed is not None:
                            self.on_routed(replica)
                    if out.finish_reason is not None:
                        finished = True
                    yield out
            except (GeneratorExit, asyncio.CancelledError):
                raise
            except Exception as exc:
                error = _translate(exc)
                if not started and attempt == 0 and (_replica_died(exc) or isinstance(error, QueueFull)):
                    avoid = getattr(error, "replica", None)
                    log.warning("request %s: %s before it started; trying another replica", request_id,
                                "its replica's queue was full" if isinstance(error, QueueFull) else "replica died")
                    continue
                raise error from exc
            finally:
                if item is not None and not item.done():
                    item.cancel()
                elif item is not None and not item.cancelled():
                    item.exception()  # read: a stream cancelled under it (a hang-up) raised there, unlogged
                if not finished and stream is not None:
                    _cancel(stream, started)  # the replica aborts the request and frees its blocks


class _ClusterCollector:
    """The engine gauges of single-process serving summed over the replicas' last reports (the plan-gap gauge is
    the largest), its counters summed over the last report of every replica ever seen (so a counter never goes back
    when a replica dies, nor counts one twice when Serve lists a dead one again for a while), plus the replica count.
    """

    def __init__(self) -> None:
        self._counted: dict[str, dict[str, tuple]] = {}  # replica (ever seen) -> its counters' last (kind, doc, value)
        self._lock = threading.Lock()

    def collect(self):
        reports = [s for router in list(_ROUTERS) for s in router.replica_stats()]
        latest: dict[str, dict] = {}
        for s in reports:
            if s.get("replica") is not None:
                latest[s["replica"]] = s
        yield GaugeMetricFamily("orbitflow:cluster_replicas", "Engine replicas reporting to this ingress",
                                value=len(latest))
        totals: dict[str, list] = {}
        with self._lock:
            for replica, s in latest.items():
                counted = self._counted.setdefault(replica, {})
                for name, kind, doc, value in s.get("metrics", []):
                    if kind == "counter":
                        counted[name] = (kind, doc, value)
                        continue
                    entry = totals.setdefault(name, [kind, doc, 0.0])
                    entry[2] = max(entry[2], value) if name.endswith("optimality_gap") else entry[2] + value
            for counted in self._counted.values():
                for name, (kind, doc, value) in counted.items():
                    totals.setdefault(name, [kind, doc, 0.0])[2] += value
        for name, (kind, doc, value) in totals.items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, doc, value=value)


@serve.ingress()
class ClusterIngress:
    def __init__(self, engine_handle, model_name: str, api_key: str | None, max_body_bytes: int,
                 watchdog_s: float) -> None:
        self.handle = engine_handle
        self.model_name, self.api_key = model_name, api_key
        self.max_body_bytes, self.watchdog_s = max_body_bytes, watchdog_s

    async def __serve_build_asgi_app__(self):
        from orbitflow.model.tokenizer import Tokenizer
        from orbitflow.runtime.clock import WallClock
        from orbitflow.serve.api import OpenAIServer, serve_app
        from orbitflow.serve.metrics import ServerMetrics

        info = await self.handle.info.remote()
        tokenizer = Tokenizer.from_dir(info["model_dir"], extra_eos_token_ids=info["eos_token_ids"])
        metrics = ServerMetrics(collector=_ClusterCollector())
        routed = Counter("orbitflow:cluster_requests_routed", "Requests each replica took", ["replica"],
                         registry=metrics.registry)
        remote = self._remote = RemoteEngine(self.handle, on_routed=lambda replica: routed.labels(replica).inc())
        server = OpenAIServer(self.model_name, tokenizer, remote, metrics, WallClock(), info["max_len"],
                              info["vocab_size"], self.watchdog_s, slo_s=info["slo_s"],
                              deposit_guard_ms=info["deposit_guard_ms"])
        return serve_app(server, api_key=self.api_key, max_body_bytes=self.max_body_bytes)

    async def drain(self, grace_s: float) -> None:
        """SIGTERM's drain (`run_cluster`): new requests get 503, those in flight finish or end with "abort"."""
        remote = getattr(self, "_remote", None)
        if remote is not None:
            await remote.drain(grace_s)


# ---- building and running the application -------------------------------------------------------------------
def replica_gpus_for(config: EngineConfig, cluster_gpus: float) -> float:
    """GPUs Ray reserves for a replica when --replica-gpus is not given: one per tensor-parallel rank on CUDA (without a
    reservation Ray would put several replicas on one GPU, each seeing them all), none on the CPU."""
    device = config.model.device
    if device == "cpu" or (device == "auto" and cluster_gpus <= 0):
        return 0.0
    return float(config.parallel.tensor_parallel_size)


def _cluster_gpus() -> float:
    """GPUs of the Ray cluster joined, or of this machine when Ray is not started yet (it will start here)."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0))
    import torch

    return float(torch.cuda.device_count())


def replica_limits(config: EngineConfig) -> tuple[int, int]:
    """Serve's ``max_ongoing_requests`` per replica and ``max_queued_requests`` at the ingress's handle. A replica
    must be sent one request more than its engine holds (the batch and --max-queue-len), or the engine's own refusal
    (QueueFull: retry elsewhere, then a 503) is never reached and the request waits at the ingress with no limit.
    Past the replicas, --max-queue-len more requests may wait at the ingress; beyond, Serve's backpressure (a 503
    too). An unbounded --max-queue-len leaves both unbounded (the engines queue)."""
    sched = config.scheduler
    if sched.max_queue_len is None:
        return 1_000_000, -1
    return sched.max_num_seqs + sched.max_queue_len + 1, sched.max_queue_len


def build_cluster_app(config: EngineConfig, replicas: int, router: str = DEFAULT_ROUTER,
                      served_model_name: str | None = None, api_key: str | None = None,
                      max_body_bytes: int = 8 * 1024 * 1024, watchdog_s: float = 60.0,
                      replica_cpus: float = 1.0, replica_gpus: float | None = None,
                      stats_period_s: float = DEFAULT_STATS_PERIOD_S,
                      health_check_period_s: float = 2.0, seed: int = 0, profile="measure"):
    """The Ray Serve application (bound ingress) of `replicas` engine replicas routed by `router`. ``profile``:
    how each replica gets its hardware profile ("measure" on its node, "rough", or a HardwareProfile)."""
    ClusterConfig(replicas=replicas, router=router, replica_cpus=replica_cpus, replica_gpus=replica_gpus)  # checks
    make_policy(config.planner.policy)  # a mistyped --policy fails here, not in every replica's constructor
    gpus = _replica_gpus(config, replica_gpus)
    max_ongoing, max_queued = replica_limits(config)
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=replicas, max_ongoing_requests=max_ongoing,
        max_queued_requests=max_queued,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": gpus}, health_check_period_s=health_check_period_s,
        health_check_timeout_s=max(30.0, watchdog_s), graceful_shutdown_timeout_s=10.0,
        request_router_config=RequestRouterConfig(
            request_router_class=OrbitflowRequestRouter, request_router_kwargs={"policy": router, "seed": seed},
            request_routing_stats_period_s=stats_period_s, request_routing_stats_timeout_s=max(5.0, stats_period_s)),
    )
    ingress = serve.deployment(ClusterIngress, name=INGRESS_DEPLOYMENT, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=1_000_000)
    return ingress.bind(engine.bind(config, watchdog_s, profile), served_model_name or config.model.name, api_key,
                        max_body_bytes, watchdog_s)


def _replica_gpus(config: EngineConfig, replica_gpus: float | None) -> float:
    """The GPUs each replica reserves: --replica-gpus, or by default what its ranks need on this cluster."""
    return replica_gpus_for(config, _cluster_gpus()) if replica_gpus is None else replica_gpus


def connect(ray_address: str | None = None, num_cpus: float | None = None) -> None:
    """Join the Ray cluster at ``ray_address``, or start Ray on this machine; nothing when Ray is already up. A
    cluster that cannot be reached is a ConfigError naming --ray-address."""
    import ray

    if not ray.is_initialized():
        kwargs = {"address": ray_address} if ray_address else {"num_cpus": num_cpus}
        try:
            ray.init(**kwargs, include_dashboard=False, log_to_driver=True,
                     runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
                     if os.environ.get("PYTHONPATH") else None)
        except ConnectionError as exc:
            if not ray_address:
                raise
            raise ConfigError(f"--ray-address {ray_address}: no Ray cluster there ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_resources(replicas: int, replica_cpus: float, replica_gpus: float) -> None:
    """A ConfigError naming the flags when this machine's Ray cannot place every replica (Serve would wait for the
    resources forever, warning every 30 s, while the proxy already answers)."""
    import ray

    have = ray.cluster_resources()
    for name, each, flag in (("CPU", replica_cpus, "--replica-cpus"), ("GPU", replica_gpus, "--replica-gpus")):
        need = replicas * each
        if need > have.get(name, 0.0) + 1e-9:
            raise ConfigError(f"--replicas {replicas} x {flag} {each:g} needs {need:g} {name}s; this Ray has "
                              f"{have.get(name, 0.0):g} (lower {flag} or --replicas)")


def start_cluster(app, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
                  num_cpus: float | None = None) -> None:
    """Connect to (or start) Ray, start Serve's HTTP proxy on host:port and deploy `app`."""
    connect(ray_address, num_cpus)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/")


def run_cluster(config: EngineConfig, replicas: int, ray_address: str | None, host: str, port: int,
                router: str, shutdown_timeout: float = 10.0, **kwargs) -> None:
    """`orbitflow serve --replicas N`: deploy, serve until SIGINT/SIGTERM, then drain as one process does (new
    requests 503, those in flight finish for `shutdown_timeout` seconds, then end with "abort") and shut the
    application down."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if ray_address is None:  # one line here, not a traceback from every replica (a joined cluster's nodes may
        resolve_model_path(config.model.name)  # hold a model path this driver's machine lacks)
    connect(ray_address)  # first: a replica's GPU reservation reads the cluster's GPUs
    app = build_cluster_app(config, replicas, router, **kwargs)
    if ray_address is None:  # Ray on this machine cannot grow (a joined cluster may autoscale)
        check_resources(replicas, kwargs.get("replica_cpus", 1.0), _replica_gpus(config, kwargs.get("replica_gpus")))
    stop = threading.Event()
    starting = True

    def on_signal(*_) -> None:
        if starting:  # interrupt the deployment itself (Serve may wait for resources); `finally` cleans up
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        start_cluster(app, host, port, ray_address)
        starting = False
        log.info("serving %s on %d replicas (router %s) at http://%s:%d/v1", config.model.name, replicas, router,
                 host, port)
        stop.wait()
        log.info("shutting down: finishing requests in flight for up to %g s", shutdown_timeout)
        try:
            serve.get_app_handle(APP_NAME).drain.remote(shutdown_timeout).result(timeout_s=shutdown_timeout + 15)
        except Exception as exc:  # the ingress is gone or stuck: the deletion below ends what is left
            log.warning("draining the API failed (%s: %s); stopping anyway", type(exc).__name__, exc)
    finally:
        starting = False
        log.info("shutting down the cluster application")
        with suppress(Exception):  # a deployment interrupted early may have left nothing to delete
            serve.delete(APP_NAME)
        if ray_address is None:  # Serve on a joined cluster may run other applications: only ours is deleted
            serve.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
