"""Four normal streams and 50 hostile requests at once: the four outputs equal a solo run, and both KV pools
return to empty (issue 13's "Done means")."""

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve.live import MODEL_NAME, kv_empty, live_server, make_server_llm, wait_until_idle

NORMAL = [{"model": MODEL_NAME, "prompt": f"Orbit number {i} flows around", "max_tokens": 12 + 2 * i,
           "temperature": 0, "ignore_eos": True} for i in range(4)]


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    llm = make_server_llm(tiny_chat_dir, device_kv_blocks=60, host_kv_blocks=2048, max_num_seqs=6,
                          max_queue_len=64, token_deposit=False)
    with live_server(llm, max_body_bytes=256 * 1024) as live:
        yield live


def stream(url: str, body: dict) -> str:
    text = []
    with httpx.Client(timeout=120) as http, http.stream("POST", url + "/v1/completions",
                                                        json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
    return "".join(text)


def hostile(url: str, i: int) -> int | None:
    """One hostile request; returns its status (None for a client that hung up)."""
    rng = random.Random(i)
    base = {"model": MODEL_NAME, "prompt": "hostile " * rng.randint(1, 30), "max_tokens": 8}
    kind = i % 10
    if kind == 0:
        body = {**base, "max_tokens": 10**30, "temperature": 1e308, "seed": -(10**40)}
    elif kind == 1:
        body = {**base, "temperature": 1e-300, "top_p": 5e-324, "seed": 2**63 - 1, "top_k": 2**31 - 1}
    elif kind == 2:
        body = {**base, "max_tokens": "many", "stream": "yes", "prompt": {"not": "a prompt"}}
    elif kind == 3:
        body = {**base, "prompt": "word " * 60_000}  # over the body limit
    elif kind == 4:
        body = {**base, "prompt": [7] * 5000}  # longer than the context
    elif kind == 5:
        body = {**base, "logit_bias": {str(t): rng.choice([-100, 100]) for t in range(300)}, "temperature": 2,
                "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1e-9}
    elif kind == 6:
        body = {**base, "n": 4, "temperature": 1.5, "logprobs": 20}
    else:  # instant disconnects: streaming and not
        with httpx.Client(timeout=httpx.Timeout(30, read=0.05)) as http:
            try:
                if kind == 7:
                    with http.stream("POST", url + "/v1/completions", json={**base, "stream": True}):
                        pass
                else:
                    http.post(url + "/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": base["prompt"]}], "max_tokens": 200})
            except httpx.TimeoutException:
                pass
        return None
    with httpx.Client(timeout=120) as http:
        return http.post(url + "/v1/completions", json=body).status_code


def test_hostile_requests_leave_normal_streams_untouched(server):
    solo = [stream(server.url, body) for body in NORMAL]
    with ThreadPoolExecutor(16) as pool:
        normal = [pool.submit(stream, server.url, body) for body in NORMAL]
        statuses = list(pool.map(hostile, [server.url] * 50, range(50)))
        assert [f.result() for f in normal] == solo
    assert all(s is None or s in (200, 400, 413, 503) for s in statuses), list(enumerate(statuses))  # 503: load
    assert {400, 413, 200} <= set(statuses)
    wait_until_idle(server.llm)
    assert kv_empty(server.llm)
    assert server.llm.engine.kv.host_pool.num_used == server.llm.engine.kv.device_pool.num_used == 0


def test_a_prompt_being_tokenized_holds_no_other_request(server, monkeypatch):
    """Tokenizing runs off the event loop (an 8 MB prompt takes seconds): while one prompt's encode is held, /health
    and a request with token ids are answered. On the event loop, /health would wait for the encode."""
    tokenizer = server.llm.tokenizer
    real_encode = tokenizer.encode
    entered, release = threading.Event(), threading.Event()

    def held_encode(text, add_special_tokens=True):
        if "held" in text:
            entered.set()
            release.wait(120)
        return real_encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=server.url, timeout=30) as http:
        try:
            held = [pool.submit(http.post, "/v1/completions", json={**NORMAL[0], "prompt": "held prompt"}),
                    pool.submit(http.post, "/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "held chat"}], "max_tokens": 4})]
            assert entered.wait(60)
            assert http.get("/health").status_code == 200
            assert http.post("/v1/completions", json={**NORMAL[1], "prompt": [5, 6, 7]}).status_code == 200
            assert not any(f.done() for f in held)  # both still in their encode
        finally:
            release.set()
        assert [f.result().status_code for f in held] == [200, 200]
    wait_until_idle(server.llm)
    assert kv_empty(server.llm)
