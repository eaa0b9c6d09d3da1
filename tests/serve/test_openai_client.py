"""The official openai client against a live server: streaming equals non-streaming (greedy), usage."""

import json
import time

import httpx
import openai
import pytest
from serve.live import MODEL_NAME, live_server, make_server_llm

PROMPT = "The planets move"


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    with live_server(make_server_llm(tiny_chat_dir)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Write one sentence about orbits."}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert 1 <= full.usage.completion_tokens <= 12  # all 12, unless the model stopped sooner
    assert full.usage.completion_tokens == 12 or full.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_completion_stream_equals_non_stream(client, server):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    assert full.object == "text_completion" and full.choices[0].text
    assert full.usage.prompt_tokens == len(server.llm.tokenizer.encode(PROMPT))
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_token_id_prompt_and_stop_string(client, server):
    ids = server.llm.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    text = by_text.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 10  # the engine stopped it where the stop string was generated
    while not (server.llm.engine.finished and server.llm.engine.finished[-1].request_id.startswith(cut.id)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ended = server.llm.engine.finished[-1]
    assert ended.finish_reason == "stop" and len(ended.output_ids) <= cut.usage.completion_tokens + 1
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10,
                                         temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    with httpx.Client() as http:
        assert http.get(f"{server.url}/health").json() == {"status": "ok"}
        text = http.get(f"{server.url}/metrics").text
    for name in (
        "orbitflow:time_to_first_token_seconds_bucket", "orbitflow:inter_token_latency_seconds_count",
        "orbitflow:time_per_output_token_seconds_sum", "orbitflow:e2e_request_latency_seconds_count",
        "orbitflow:request_max_inter_token_latency_seconds_count",
        "orbitflow:num_requests_running", "orbitflow:kv_device_blocks_total 512.0",
        "orbitflow:solver_calls_total", "orbitflow:solver_budget_reached_total", "orbitflow:plan_optimality_gap",
        "orbitflow:slo_violations_delivered_total", "orbitflow:slo_violations_scheduled_total",
        "orbitflow:slo_violations_generated_total",
        "orbitflow:pauses_total", "orbitflow:recomputes_total", "orbitflow:kv_prefetch_overflow_blocks_peak 0.0",
    ):
        assert name in text


def test_logprobs_n_and_penalties_through_the_openai_client(client, server):
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a planet."}], max_tokens=5, temperature=0.8,
        seed=3, n=3, logprobs=True, top_logprobs=3, presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.2})
    assert [c.index for c in chat.choices] == [0, 1, 2]
    for choice in chat.choices:
        content = choice.logprobs.content
        assert len(content) == 5 and all(t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
        assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
    assert chat.usage.completion_tokens == 15
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a planet."}], max_tokens=5, temperature=0.8,
        seed=3, n=3, presence_penalty=0.5, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2})
    assert [c.message.content for c in again.choices] == [c.message.content for c in chat.choices]  # seeded

    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = greedy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 8
    # Greedy picks the most likely token: its logprob is the best of the alternatives.
    assert all(abs(max(top.values()) - chosen) < 1e-4 for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    first_id = server.llm.engine.finished[-1].output_ids[0]
    banned = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                       logit_bias={str(first_id): -100})
    assert server.llm.engine.finished[-1].output_ids[0] != first_id
    assert banned.choices[0].text != greedy.choices[0].text

    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1] and chunks[-1].usage.completion_tokens == 8


# SmolLM2's tokens ' \xf0\x9f', '\x8e', '\x89', '\x8a' ('🎉' is the first three, '🎊' the first two and the last): each
# holds part of a character, so decoded alone each is U+FFFD.
EMOJI_PARTS = {"15107": 40, "232": 40, "227": 40, "228": 40}


def test_logprobs_of_tokens_that_split_characters(client):
    """Streamed text_offset equals the whole response's and never goes back or past the text; a token's string and
    bytes are its own (the bytes join into the text), not U+FFFD's."""
    args = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, logit_bias=EMOJI_PARTS,
                stop=["no such stop string"])
    whole = client.completions.create(**args).choices[0]
    lp = whole.logprobs
    assert "\ufffd" not in "".join(lp.tokens) and any(t.startswith(("\\x", " \\x")) for t in lp.tokens)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(whole.text)
    streamed = list(client.completions.create(**args, stream=True))
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.text

    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Celebrate"}],
                                          max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                                          logit_bias=EMOJI_PARTS).choices[0]
    content = chat.logprobs.content
    assert all("\ufffd" not in t.token and t.bytes != [239, 191, 189] for t in content)
    joined = bytes(b for t in content for b in t.bytes).decode("utf-8", "replace")
    assert joined.startswith(chat.message.content) and chat.message.content


def test_vllm_chat_options_are_served_or_refused_by_name(client, server):
    """Found by a review against vLLM: these were accepted and silently ignored (a Qwen3 user turning thinking off
    still got it). The template options now reach the chat template; the others are refused by name."""
    messages = [{"role": "user", "content": "Hi"}]
    usage = {}
    for extra in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0,
                                               extra_body=extra)
        usage[str(extra)] = reply.usage.prompt_tokens
    assert usage["{'add_generation_prompt': False}"] < usage["{}"]  # no assistant prefix rendered
    assert usage["{'chat_template_kwargs': {'enable_thinking': False}}"] == usage["{}"]  # SmolLM2 reads no such flag
    for extra, param in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"echo": True}, "echo"), ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
                         ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1, extra_body=extra)
        assert param in str(err.value), err.value


def test_models_retrieve_and_chat_deltas_without_nulls(client, server):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=60) as http:
        lines = [line[6:] for line in http.post(f"{server.url}/v1/chat/completions", json=body).text.splitlines()
                 if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["delta"] for chunk in lines for c in json.loads(chunk)["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}  # OpenAI's: a delta names only what it carries
    assert all(set(d) <= {"content"} and None not in d.values() for d in deltas[1:]), deltas
