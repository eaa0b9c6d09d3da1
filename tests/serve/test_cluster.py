"""Two SmolLM2 engine replicas on Ray Serve behind the project's API: streaming through the official openai
client reaches both replicas, and killing one mid-run ends its streams with an error while the others finish,
new requests go to the live replica, and Serve starts a replacement. Each replica solves ahead in its own planner
process, as `orbitflow serve --replicas N` runs them; the killed replica's planner process ends with it."""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest
from processes import process_alive, spawned_processes

ray = pytest.importorskip("ray")
import httpx  # noqa: E402  (imported here, not in the client threads: concurrent first imports race)
import openai  # noqa: E402

pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")]

MODEL = "smollm2-135m"
PROMPT = "Once upon a time, in a small village by the sea,"
REPLICA = b"ServeReplica:orbitflow:orbitflow-engine"  # the title Ray gives an engine replica's process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routed(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("orbitflow:cluster_requests_routed_total{"):
            replica = line.split('replica="')[1].split('"')[0]
            out[replica] = float(line.rsplit(" ", 1)[1])
    return out


def _engine_replicas() -> list[tuple[str, str]]:
    from ray import serve

    status = serve.status().applications["orbitflow"].deployments["orbitflow-engine"]
    return status.status, status.replica_states


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from orbitflow.config import EngineConfig
    from orbitflow.serve.cluster import build_cluster_app, start_cluster

    port = _free_port()
    # background_planner: what `orbitflow serve` runs on any core count (the engine's auto is a thread on 2 cores)
    config = EngineConfig.build(model=MODEL, device_kv_blocks=256, host_kv_blocks=4096, max_num_seqs=4,
                                compute_threads=1, background_planner="process")
    # profile "rough": no step-latency measurement at start-up (minutes on a loaded 2-core machine)
    app = build_cluster_app(config, replicas=2, router="slo-aware", replica_cpus=0.5, stats_period_s=0.5,
                            health_check_period_s=1.0, profile="rough")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        start_cluster(app, "127.0.0.1", port)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_stream_and_survive_a_kill(cluster):
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=120)
    outcomes: dict[int, str] = {}

    def stream(i: int) -> None:
        try:
            chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=96, stream=True,
                                               extra_body={"ignore_eos": True})
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            outcomes[i] = reasons[-1] if reasons else "none"
        except openai.APIError as exc:  # an error event in the stream, or an error status
            outcomes[i] = f"error: {exc}"
        except Exception as exc:  # a broken stream: not what a dead replica should produce
            outcomes[i] = f"broken: {type(exc).__name__}: {exc}"

    # the client's lazy imports happen once, here, before the threads
    warm = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True)
    assert [c.choices[0].finish_reason for c in warm if c.choices][-1] in ("length", "stop")
    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 90
    started: list[str] = []  # replicas in the order they streamed a first token (a request counts then)
    while len(started) < 2:
        started += [replica for replica in _routed(cluster) if replica not in started]
        assert time.monotonic() < deadline, f"requests did not reach both replicas: {started}"
        time.sleep(0.2)

    planners = spawned_processes(REPLICA)  # one per replica: each engine starts its own with it
    assert len(planners) == 2 and len(set(planners.values())) == 2, planners
    assert all(process_alive(parent) for parent in planners.values())

    # The replica that started last is surely still streaming; the first may have finished its share by then
    # (when the other was slow to start: every stream ended 'length' once, and the kill proved nothing).
    victim = started[-1]
    name = next(n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
                if "orbitflow-engine" in n["name"] and victim in n["name"])
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung after its replica died"
    errors = [o for o in outcomes.values() if o.startswith("error")]
    finished = [o for o in outcomes.values() if o == "length"]
    assert len(errors) + len(finished) == len(threads), outcomes
    assert errors, f"no stream on the killed replica ended with an error: {outcomes}"
    assert finished, f"streams on the live replica did not finish: {outcomes}"
    assert len(errors) <= _routed(cluster)[victim]  # only requests the killed replica had started failed

    # new requests go to the live replica (and, once Serve has replaced it, to the new one)
    for _ in range(3):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert out.choices[0].finish_reason in ("length", "stop")

    deadline = time.monotonic() + 150
    while True:
        status, states = _engine_replicas()
        if states.get("RUNNING", 0) == 2 and victim not in str(_live_names()):
            break
        assert time.monotonic() < deadline, f"Serve did not replace the killed replica: {status} {states}"
        time.sleep(1)

    # the killed replica's planner process ended with it (Ray ends a dead worker's children; the planner's own
    # guard, its pipe's end, is test_background_planner's); the live one's runs on, and the replacement has its own
    orphans = [pid for pid, parent in planners.items() if not process_alive(parent)]
    assert len(orphans) == 1, planners  # exactly one replica process died: the killed one
    deadline = time.monotonic() + 30
    while process_alive(orphans[0]):
        assert time.monotonic() < deadline, f"the killed replica's planner process {orphans[0]} outlived it"
        time.sleep(0.2)
    survivors = [pid for pid in planners if pid != orphans[0]]
    assert process_alive(survivors[0])
    deadline = time.monotonic() + 60
    while len(set(spawned_processes(REPLICA).values())) < 2:  # the replacement's planner starts with its engine
        assert time.monotonic() < deadline, f"the new replica started no planner process: {spawned_processes(REPLICA)}"
        time.sleep(0.5)


def _live_names() -> list[str]:
    return [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if "orbitflow-engine" in n["name"]]
