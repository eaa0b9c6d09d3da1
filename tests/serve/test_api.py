"""Regression tests of issue 13's defects D1-D6 against a live server (each failed on the code before it)."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from serve.live import MODEL_NAME, kv_empty, live_server, make_server_llm, wait_until_idle

GOOD = {"model": MODEL_NAME, "prompt": "The orbit of a planet", "max_tokens": 24, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    llm = make_server_llm(tiny_chat_dir, max_num_seqs=4, max_queue_len=8)
    with live_server(llm, watchdog_s=0.5) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def stream_text(http: httpx.Client, body: dict) -> str:
    import json

    text = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"] if chunk["choices"] else "")
    return "".join(text)


def test_d1_parameters_that_failed_inside_the_step_touch_nobody_else(http, server):
    solo = http.post("/v1/completions", json=GOOD).json()["choices"][0]["text"]
    hostile = [{"seed": 10**30, "temperature": 1.0}, {"temperature": 1e-300}, {"top_p": 5e-324, "temperature": 1.0},
               {"logit_bias": {"1": 100, "2": -100}, "temperature": 2.0, "presence_penalty": 2.0}]
    with ThreadPoolExecutor(8) as pool:
        normal = [pool.submit(stream_text, http, GOOD) for _ in range(2)]
        replies = list(pool.map(lambda extra: http.post("/v1/completions", json={**GOOD, **extra}), hostile * 2))
        assert [f.result() for f in normal] == [solo, solo]
    statuses = [r.status_code for r in replies]
    assert statuses[0] == statuses[4] == 400 and replies[0].json()["error"]["param"] == "seed"
    assert all(s == 200 for i, s in enumerate(statuses) if i % 4), [r.text for r in replies]
    assert replies[1].json()["choices"][0]["text"] == solo  # a vanishing temperature is greedy
    wait_until_idle(server.llm)
    assert kv_empty(server.llm)


def test_d2_a_non_streaming_request_is_aborted_when_its_client_disconnects(server):
    engine = server.llm.engine
    body = {**GOOD, "max_tokens": 400}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=0.5)) as c:
        c.post("/v1/completions", json=body)
    deadline = time.monotonic() + 10
    while engine.has_work() or engine.running:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.02)
    last = engine.finished[-1]
    assert last.finish_reason == "abort" and len(last.output_ids) < 400
    assert kv_empty(server.llm)


@contextmanager
def engine_steps(server, step):
    """Meanwhile the engine's executor runs ``step(real_step, seqs)`` for each of its steps."""
    executor = server.llm.executor
    real_step = executor.step
    executor.step = lambda seqs: step(real_step, seqs)
    try:
        yield
    finally:
        executor.step = real_step


def submit_running(pool, http, server):
    """Send GOOD from the pool; returns its future once the engine runs it."""
    future = pool.submit(http.post, "/v1/completions", json=GOOD)
    while not server.llm.engine.running:
        time.sleep(0.01)
    return future


def test_d3_overflow_of_the_queue_gets_503_with_retry_after(http, server):
    """With the engine stuck in a step, requests queue up to --max-queue-len (8) beyond the batch's free places
    (3 of --max-num-seqs 4); the next gets 503 at once with Retry-After. /health turns 503 too (D6's watchdog), and
    both recover when the engine moves again."""
    release = threading.Event()

    def stuck_step(real_step, seqs):
        release.wait(30)
        return real_step(seqs)

    try:
        with engine_steps(server, stuck_step), ThreadPoolExecutor(12) as pool:
            running = submit_running(pool, http, server)
            queued = [pool.submit(http.post, "/v1/completions", json=GOOD) for _ in range(11)]
            while server.llm.engine.num_queued() < 11:
                time.sleep(0.01)
            over = http.post("/v1/completions", json=GOOD)
            assert over.status_code == 503 and int(over.headers["retry-after"]) >= 1
            assert over.json()["error"]["code"] == "server_busy"
            time.sleep(0.6)
            health = http.get("/health")
            assert health.status_code == 503 and "stalled" in health.json()["status"]
            release.set()
            assert all(f.result().status_code == 200 for f in [running, *queued])
    finally:
        release.set()
    assert http.get("/health").json() == {"status": "ok"}
    wait_until_idle(server.llm)
    assert kv_empty(server.llm)


def test_a_long_step_that_advances_layer_by_layer_is_not_a_stall(http, server):
    """A step that takes several watchdog periods but starts a layer every so often (a long prefill on a CPU)
    keeps /health at ok: the watchdog reads the executor's layer progress, not only the loop's turns."""
    checked, long_steps = [], []

    def long_step(real_step, seqs):
        if len(long_steps) == 2:  # the request's first two steps are long; the rest run as they are
            return real_step(seqs)
        long_steps.append(seqs)
        for _ in range(12):  # 1.2 s: more than twice the test server's watchdog, a layer every 0.1 s
            server.llm.executor.progress_at = time.monotonic()
            time.sleep(0.1)
            if not checked:
                time.sleep(0.6)  # ... except once, where it waits past the watchdog: that is a stall
                checked.append(http.get("/health").status_code)
        return real_step(seqs)

    with engine_steps(server, long_step), ThreadPoolExecutor(1) as pool:
        reply = submit_running(pool, http, server)
        time.sleep(0.9)
        during = http.get("/health")
        assert reply.result().status_code == 200
    assert checked == [503] and len(long_steps) == 2
    assert during.status_code == 200, during.text


def test_d4_openai_parameters_are_served(http, server):
    reply = http.post("/v1/completions", json={**GOOD, "n": 3, "logprobs": 2, "temperature": 1.0, "seed": 5,
                                              "frequency_penalty": 1.0, "max_tokens": 6})
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for c in choices:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
        assert all(v <= 0 for v in lp["token_logprobs"]) and all(len(t) <= 3 for t in lp["top_logprobs"])  # + sampled
    assert reply.json()["usage"]["completion_tokens"] == 18
    echo = http.post("/v1/completions", json={**GOOD, "echo": True, "max_tokens": 3}).json()
    assert echo["choices"][0]["text"].startswith(GOOD["prompt"])
    ids = http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert ids["count"] == len(ids["tokens"]) >= 2
    assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "hello world"}
    http.post("/v1/completions", json={**GOOD, "max_tokens": 8})
    third = server.llm.engine.finished[-1].output_ids[2]
    cut = http.post("/v1/completions", json={**GOOD, "max_tokens": 8, "stop_token_ids": [third]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] <= 3


def test_d5_body_size_limit_and_405_allow(tiny_chat_dir):
    with live_server(make_server_llm(tiny_chat_dir), max_body_bytes=1000) as live, \
            httpx.Client(base_url=live.url, timeout=30) as http:
        big = http.post("/v1/completions", json={**GOOD, "prompt": "x" * 2000})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"

        def chunks():
            yield b'{"prompt": "'
            for _ in range(20):
                yield b"y" * 100
            yield b'"}'

        chunked = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413
        assert http.post("/v1/completions", json=GOOD).status_code == 200
        wrong = http.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"


def test_the_advertised_context_is_what_the_engine_accepts(tiny_chat_dir):
    """With a small host pool no split of the layers holds what the two pools' sum would: /v1/models advertises the
    engine's longest servable request, a request without max_tokens gets the rest of it and runs, one more token
    is a 400 naming max_tokens (the server advertised the sum, and every request without max_tokens got a 400)."""
    llm = make_server_llm(tiny_chat_dir, device_kv_blocks=20, host_kv_blocks=10)
    with live_server(llm) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        engine = llm.engine
        longest = engine.longest_servable()
        assert longest < (20 + 10) // (engine.num_layers + engine.prefetch_slots) * engine.block_size
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == longest
        body = {**GOOD, "max_tokens": None}  # null: the rest of the context
        ok = http.post("/v1/completions", json=body)
        assert ok.status_code == 200, ok.text
        usage = ok.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == longest
        over = http.post("/v1/completions", json={**body, "max_tokens": longest - usage["prompt_tokens"] + 1})
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens", over.text
        wait_until_idle(llm)
        assert kv_empty(llm)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_d6_sigterm_drains_and_exits_0_without_traceback(tiny_chat_dir):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "orbitflow.cli", "serve", "--model", str(tiny_chat_dir), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--device-kv-blocks", "256", "--host-kv-blocks", "1024",
           "--shutdown-timeout", "0.2", "--slo-ms", "20",  # Token-Deposit paces the stream: 450 tokens take 9 s
           "--policy", "fixed:all", "--link-gbps", "0.01"]
    # The engine generates ahead of the paced stream, and a finish releases what it holds at once: a grace period
    # long enough for the engine to generate all 450 tokens ends the stream with "length", not "abort" (the tiny
    # model did, within 0.2 s, in one fresh clone's run). So every layer's KV lives on the host and comes back
    # over a 10 MB/s link: a step takes 5-50 ms, and 450 tokens seconds.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        lines = []
        with httpx.Client(timeout=60) as http, http.stream(
                "POST", f"{url}/v1/completions", json={**GOOD, "max_tokens": 450, "stream": True}) as reply:
            for line in reply.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 2:
                    start = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        assert "Traceback" not in stderr, stderr
        assert time.monotonic() - start < 15
        assert lines[-1] == "data: [DONE]" and '"finish_reason": "abort"' in "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_request_carries_its_own_slo(http, server):
    """`slo_ms` (an extension) is the SLO the engine plans and paces this request for, and the one the metrics time
    it against; a bad one is a 400 naming it."""
    ok = http.post("/v1/completions", json={**GOOD, "slo_ms": 1234.5})
    assert ok.status_code == 200, ok.text
    wait_until_idle(server.llm)
    assert [r.slo_s for r in server.llm.engine.finished][-1] == pytest.approx(1.2345)
    for bad in (0, -5, "fast", 10**9, 5e-324):  # the last one is 0 once in seconds
        reply = http.post("/v1/completions", json={**GOOD, "slo_ms": bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "slo_ms", reply.text


def test_the_developer_role_is_the_system_role(http):
    """`developer` is OpenAI's system role (templates know only `system`: it rendered as an unknown turn beside the
    template's default system prompt). (Text that is not Unicode: test_errors.test_text_with_a_lone_surrogate.)"""
    def ids(messages):
        reply = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
        assert reply.status_code == 200, reply.text
        return reply.json()["tokens"]

    turn = [{"role": "user", "content": "hi"}]
    as_developer = ids([{"role": "developer", "content": "Be brief."}, *turn])
    assert as_developer == ids([{"role": "system", "content": "Be brief."}, *turn])


def test_completion_logprobs_always_hold_the_sampled_token(http):
    """OpenAI returns the sampled token's logprob among up to logprobs + 1 entries; at temperature 1.5 the sampled
    token was missing from its own top_logprobs nearly every time, and logprobs: 0 gave empty entries."""
    for k in (0, 1):
        reply = http.post("/v1/completions", json={**GOOD, "temperature": 1.5, "seed": 7, "logprobs": k})
        choice = reply.json()["choices"][0]
        lp = choice["logprobs"]
        n = reply.json()["usage"]["completion_tokens"]
        assert n >= 1 and len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["token_logprobs"]) == n
        assert all(tok in top and top[tok] == chosen and len(top) <= k + 1
                   for tok, top, chosen in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]))


def test_a_user_turn_without_content_is_a_400_naming_it(http):
    """OpenAI refuses it; it was served as an empty turn. The server then serves the next request as before."""
    reply = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": None}]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith("messages") and "a user message needs content" in error["message"], error
    ok = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text
