"""Clients that hang up mid-stream: every request is aborted and both KV tiers drain to zero."""

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve.live import MODEL_NAME, live_server, make_server_llm, wait_until_idle

NUM_STREAMS = 50


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    llm = make_server_llm(tiny_chat_dir, device_kv_blocks=40, host_kv_blocks=2048, max_num_seqs=4)
    with live_server(llm) as live:
        yield live


def hang_up_after(url: str, i: int) -> int:
    """Streams one request and closes the connection after 1-3 data chunks; returns the chunks read."""
    rng = random.Random(i)
    wanted = rng.randint(1, 3)
    words = " ".join(["orbit"] * rng.randint(3, 60))
    if i % 2:
        path, body = "/v1/completions", {"prompt": words}
    else:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": words}]}
    body |= {"model": MODEL_NAME, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    seen = 0
    with httpx.Client(timeout=120) as client, client.stream("POST", url + path, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert line != "data: [DONE]", "the stream should not have finished"
                seen += 1
                if seen == wanted:
                    break
    return seen


def test_disconnects_free_every_block(server):
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(hang_up_after, [server.url] * NUM_STREAMS, range(NUM_STREAMS)))
    wait_until_idle(server.llm)
    with httpx.Client(timeout=60) as http:
        assert server.metric(http, "orbitflow:kv_device_blocks_used") == 0.0
        assert server.metric(http, "orbitflow:kv_host_blocks_used") == 0.0
        assert server.metric(http, 'orbitflow:requests_total{finish_reason="abort"}') == NUM_STREAMS
        body = {"model": MODEL_NAME, "prompt": "still there?", "max_tokens": 3, "temperature": 0}
        reply = http.post(f"{server.url}/v1/completions", json=body)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
