"""A tensor-parallel server (two rank processes): the openai client, per-rank /metrics, and /health on a dead rank."""

import httpx
import openai
import pytest
from serve.live import MODEL_NAME, live_server, make_server_llm


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    llm = make_server_llm(tiny_chat_dir, link_gbps=1.0,
                          tensor_parallel_size=2, collective_timeout=10.0)
    with live_server(llm) as live:
        yield live


def test_openai_client_metrics_per_rank_then_a_dead_rank_fails_health(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    full = client.completions.create(model=MODEL_NAME, prompt="The planets move", max_tokens=4, temperature=0)
    assert 1 <= full.usage.completion_tokens <= 4  # all 4, unless the model stopped sooner
    assert full.usage.completion_tokens == 4 or full.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt="The planets move", max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == full.choices[0].text

    metrics = httpx.get(f"{server.url}/metrics").text
    for rank in ("0", "1"):
        assert f'orbitflow:tp_kv_blocks_used{{rank="{rank}",tier="device"}}' in metrics
        assert f'orbitflow:tp_link_bytes_total{{direction="h2d",rank="{rank}"}}' in metrics
        # both requests have finished: every rank got its blocks back (frees reach the ranks at once)
        assert f'orbitflow:tp_kv_blocks_used{{rank="{rank}",tier="device"}} 0.0' in metrics
    assert httpx.get(f"{server.url}/health").status_code == 200

    proc = server.llm.executor._procs[1]
    proc.kill()
    proc.join(10)
    health = httpx.get(f"{server.url}/health")  # seen while idle, before any request meets the dead rank
    assert health.status_code == 503 and "rank 1 died" in health.json()["status"]
    with pytest.raises(openai.APIError):
        client.completions.create(model=MODEL_NAME, prompt="The planets move", max_tokens=4, temperature=0)
    assert httpx.get(f"{server.url}/health").status_code == 503
    assert not any(p.is_alive() for p in server.llm.executor._procs)  # the failing step stopped rank 0 too
