"""A burst of three times more long requests than the KV pools hold: each ends 200 or 503 with Retry-After,
none 500, and both pools return to empty (issue 13's D3 and "Done means")."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve.live import MODEL_NAME, kv_empty, live_server, make_server_llm, wait_until_idle

# 4 layers; a long request (61 prompt + 30 output tokens) grows to 6 blocks per layer, so it needs
# 4 x 6 + 6 (prefetch buffer) = 30 blocks: the 24 + 40 blocks of both pools hold two at once, not three.
LONG = {"model": MODEL_NAME, "prompt": "orbit " * 60, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
HELD_AT_ONCE = 2


def burst(url: str, count: int) -> list[httpx.Response]:
    def one(_):
        with httpx.Client(timeout=180) as http:
            return http.post(url + "/v1/completions", json=LONG)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


@pytest.mark.parametrize("max_queue_len, max_num_seqs", [(None, 8), (2, HELD_AT_ONCE)])
def test_burst_beyond_the_kv_budget_waits_or_gets_503(tiny_chat_dir, max_queue_len, max_num_seqs):
    """Without a queue limit the whole burst waits for KV; with --max-queue-len 2 beside as many seats as the KV holds,
    the burst overflows the seats and the queue (2 + 2 of 6), so some requests get 503 (as many as overflowed, fewer
    if one finished before the last came)."""
    llm = make_server_llm(tiny_chat_dir, device_kv_blocks=24, host_kv_blocks=40, max_num_seqs=max_num_seqs,
                          max_queue_len=max_queue_len, token_deposit=False)
    with live_server(llm) as live:
        replies = burst(live.url, 3 * HELD_AT_ONCE)
        statuses = [r.status_code for r in replies]
        assert set(statuses) <= {200, 503}, [r.text for r in replies]
        for reply in replies:
            if reply.status_code == 503:
                assert int(reply.headers["retry-after"]) >= 1
            else:
                assert reply.json()["usage"]["completion_tokens"] == 30
        if max_queue_len is None:
            assert statuses == [200] * len(statuses)  # nobody is turned away: they wait their turn
        else:
            assert 1 <= statuses.count(503) <= len(statuses) - max_num_seqs - max_queue_len, statuses
        assert len({r.json()["choices"][0]["text"] for r in replies if r.status_code == 200}) == 1
        wait_until_idle(llm)
        assert kv_empty(llm)


def test_more_choices_than_the_server_ever_holds_is_a_400_naming_n(tiny_chat_dir):
    """Each choice is a request of its own. With n above --max-num-seqs plus --max-queue-len the last choices met a
    full queue even on an idle server: a 503 whose Retry-After no retry could ever honour. It is a 400 naming n."""
    llm = make_server_llm(tiny_chat_dir, max_num_seqs=2, max_queue_len=2, token_deposit=False)
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with live_server(llm) as live, httpx.Client(timeout=120) as http:
        too_many = http.post(live.url + "/v1/completions", json={**body, "n": 5})
        assert too_many.status_code == 400, too_many.text
        assert too_many.json()["error"]["param"] == "n"
        assert "--max-queue-len" in too_many.json()["error"]["message"]
        chat = http.post(live.url + "/v1/chat/completions",
                         json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                               "n": 5})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "n"
        held = http.post(live.url + "/v1/completions", json={**body, "n": 4})
        assert held.status_code == 200, held.text
        assert len(held.json()["choices"]) == 4
        wait_until_idle(llm)
        assert kv_empty(llm)
        # the 400s are not served requests, and the 4 choices share one prompt: counted once, as usage counts it
        assert live.metric(http, "orbitflow:prompt_tokens_total") == held.json()["usage"]["prompt_tokens"]
        assert live.metric(http, 'orbitflow:requests_total{finish_reason="length"}') == 4


def test_pools_that_hold_no_request_are_refused_at_start_naming_the_flags(tiny_chat_dir, monkeypatch):
    """A server whose KV pools cannot hold one prompt token and one output token started, and answered every request
    with a 400; it now refuses to start, naming the flags to raise: as soon as the model's layers are known (before
    `serve` measures the machine for a minute or more), and, for pools that pass that check but hold no request the
    policy can serve, once the engine is up."""
    import orbitflow.llm
    from orbitflow.config import ConfigError
    from orbitflow.serve.api import build_app

    with pytest.raises(ConfigError, match="--device-kv-blocks 1 and --host-kv-blocks 1 hold no request: the shortest "
                                          "one takes 5 blocks"):  # 4 layers and a prefetch slot
        make_server_llm(tiny_chat_dir, device_kv_blocks=1, host_kv_blocks=1)
    monkeypatch.setattr(orbitflow.llm, "_check_pools_hold_a_request", lambda *_: None)
    llm = make_server_llm(tiny_chat_dir, device_kv_blocks=1, host_kv_blocks=1)
    try:
        with pytest.raises(ConfigError, match="--device-kv-blocks 1 and --host-kv-blocks 1 hold no request"):
            build_app(llm, MODEL_NAME)
    finally:
        llm.close()
