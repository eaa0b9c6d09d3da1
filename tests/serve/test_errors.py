"""Bad requests get OpenAI-shaped 4xx errors naming the field, and the server keeps serving."""

import httpx
import pytest
from serve.live import MODEL_NAME, live_server, make_server_llm

from orbitflow.serve.protocol import MAX_CHAT_ITEMS, MAX_TOKEN_IDS

KEY = "sk-orbitflow-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    with live_server(make_server_llm(tiny_chat_dir), api_key=KEY) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _completion(**changes):
    return ("/v1/completions", {**GOOD, **changes})


def _chat(**changes):
    return ("/v1/chat/completions", {**CHAT, **changes})


CASES = {
    "wrong type max_tokens": (*_completion(max_tokens="ten"), 400, "max_tokens"),
    "wrong type temperature": (*_completion(temperature="hot"), 400, "temperature"),
    "wrong type prompt": (*_completion(prompt=5), 400, "prompt"),
    "wrong type stream": (*_completion(stream="yes"), 400, "stream"),
    "wrong type messages": (*_chat(messages="hi"), 400, "messages"),
    "bad role": (*_chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    "missing messages": ("/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    "missing prompt": ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    "empty messages": (*_chat(messages=[]), 400, "messages"),
    "empty prompt": (*_completion(prompt=""), 400, "prompt"),
    "negative max_tokens": (*_completion(max_tokens=-1), 400, "max_tokens"),
    "zero max_tokens": (*_chat(max_tokens=0), 400, "max_tokens"),
    "absurd max_tokens": (*_completion(max_tokens=1_000_000_000), 400, "max_tokens"),
    "absurd max_tokens as float": (*_completion(max_tokens=1e9), 400, "max_tokens"),
    "prompt longer than the context": (*_completion(prompt=[5] * 600), 400, "prompt"),
    "token id outside the vocabulary": (*_completion(prompt=[5, 10**9]), 400, "prompt"),
    "two prompts": (*_completion(prompt=["a", "b"]), 400, "prompt"),
    "n too large": (*_completion(n=17), 400, "n"),
    "temperature out of range": (*_completion(temperature=2.5), 400, "temperature"),
    "top_p zero": (*_completion(top_p=0), 400, "top_p"),
    "seed beyond int64": (*_completion(seed=10**30), 400, "seed"),
    "presence_penalty out of range": (*_completion(presence_penalty=3), 400, "presence_penalty"),
    "repetition_penalty zero": (*_completion(repetition_penalty=0), 400, "repetition_penalty"),
    "logit_bias key not a token id": (*_completion(logit_bias={"x": 1}), 400, "logit_bias.x"),
    "logit_bias out of range": (*_completion(logit_bias={"5": 1000}), 400, "logit_bias"),
    "logit_bias outside the vocabulary": (*_completion(logit_bias={"999999": 1}), 400, "logit_bias"),
    "stop_token_ids outside the vocabulary": (*_completion(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    "too many logprobs": (*_completion(logprobs=21), 400, "logprobs"),
    "echo with logprobs": (*_completion(echo=True, logprobs=1), 400, "echo"),
    "suffix": (*_completion(suffix="tail"), 400, "suffix"),
    "best_of other than n": (*_completion(best_of=3), 400, "best_of"),
    "tools": (*_chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    "tool_choice": (*_chat(tool_choice="auto"), 400, "tool_choice"),
    "response_format json": (*_chat(response_format={"type": "json_object"}), 400, "response_format.type"),
    "top_logprobs without logprobs": (*_chat(top_logprobs=2), 400, "top_logprobs"),
    "max_completion_tokens too large": (*_chat(max_completion_tokens=10**6), 400, "max_completion_tokens"),
    "unknown model": (*_completion(model="gpt-9"), 404, "model"),
}


def assert_error(reply: httpx.Response, status: int, param: str | None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


def assert_still_serving(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json=GOOD, headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request(http, case):
    path, body, status, param = CASES[case]
    assert_error(http.post(path, json=body, headers=AUTH), status, param)
    assert_still_serving(http)


# what the message must say: the member of a union the value was meant as, the field a chat request has
MESSAGES = {
    "negative token id": (*_completion(prompt=[1, -5]), "prompt.1", "greater than or equal to 0"),
    "two prompts": (*_completion(prompt=["a", "b"]), "prompt", "one prompt per request"),
    "a number among strings": (*_completion(prompt=["a", 5]), "prompt", "none of the types it accepts"),
    "a string among token lists": (*_completion(prompt=[[1], "a"]), "prompt", "none of the types it accepts"),
    "two token prompts": (*_completion(prompt=[[1], [2]]), "prompt", "one prompt per request"),
    "temperature not a number": (*_completion(temperature="hot"), "temperature", "should be a number"),
    "image content": (*_chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
                      "messages.0.content.0.type", "'text'"),
    "chat longer than the context": (*_chat(messages=[{"role": "user", "content": "hi " * 700}]), "messages",
                                     "prompt tokens leave no room"),
    "suffix": (*_completion(suffix="tail"), "suffix", "suffix: suffix is not supported"),
}


@pytest.mark.parametrize("case", list(MESSAGES))
def test_error_message_names_the_real_cause(http, case):
    path, body, param, says = MESSAGES[case]
    error = assert_error(http.post(path, json=body, headers=AUTH), 400, param)
    assert says in error["message"] and "Value error" not in error["message"], error["message"]


@pytest.mark.parametrize("path, body", [
    _completion(temperature=None, top_p=None, n=None, stream=None, presence_penalty=None, seed=None, stop=None),
    _chat(temperature=None, top_p=None, frequency_penalty=None, stream=None, logprobs=None, max_tokens=2),
    _chat(stream_options=None, max_tokens=2),  # (a stream_options object needs stream: true, as OpenAI's)
])
def test_null_parameters_take_their_defaults(http, path, body):
    reply = http.post(path, json=body, headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def test_max_tokens_null_means_the_rest_of_the_context(http):
    """As vLLM reads it (OpenAI's default for completions is 16, but null is "no limit")."""
    reply = http.post("/v1/completions", json={**GOOD, "max_tokens": None, "ignore_eos": True}, headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] > 16


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]"])
def test_malformed_body(http, body):
    headers = {**AUTH, "Content-Type": "application/json"}
    reply = http.post("/v1/chat/completions", content=body, headers=headers)
    assert_error(reply, 400, None)
    assert_still_serving(http)


@pytest.mark.parametrize("path, param", [("/tokenize", "prompt"), ("/v1/completions", "prompt"),
                                         ("/v1/chat/completions", "messages.0.content")])
def test_text_with_a_lone_surrogate(http, path, param):
    """JSON lets a string carry half of a UTF-16 pair; that is no text to tokenize (/tokenize answered 500)."""
    field = b'"messages": [{"role": "user", "content": "orbit \\ud800"}]' if param.startswith("messages") else \
        b'"prompt": "orbit \\ud800"'
    reply = http.post(path, content=b'{"max_tokens": 2, ' + field + b"}",
                      headers={**AUTH, "Content-Type": "application/json"})
    assert_error(reply, 400, param)
    assert_still_serving(http)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**GOOD, "prompt": [5] * (MAX_TOKEN_IDS + 1)}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [[5] * (MAX_TOKEN_IDS + 1)]}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["a"] * (MAX_TOKEN_IDS + 1)}, "prompt"),
    ("/detokenize", {"tokens": [5] * (MAX_TOKEN_IDS + 1)}, "tokens"),
])
def test_token_id_lists_past_the_cap(http, path, body, param):
    """Every id of a list is checked on the event loop before any handler runs, so the lists are capped (below the
    body cap's 4M ids, which held every other request for seconds)."""
    error = assert_error(http.post(path, json=body, headers=AUTH), 400, param)
    assert str(MAX_TOKEN_IDS) in error["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("prompt, says", [
    ([[-1] * 1000] * 3, "exactly one prompt per request"),  # a batch: checked before any of its ids
    ([[1, 2]] * 300, "exactly one prompt per request"),
    ([[-1] * 1000, "a"], "exactly one prompt per request"),
    ([-1] * 1000, "item 0 (-1) is not a token id"),
    ([5] * 999 + ["a"], "item 999 ('a') is not a token id"),
    ([[5] * 999 + [2**31]], "item 999 (2147483648) is not a token id"),
])
def test_a_long_bad_token_list_gets_one_error_naming_its_first_bad_item(http, prompt, says):
    """Item by item, each member of the prompt's union built an error per item (131K bad ids: 2 s of event loop)."""
    error = assert_error(http.post("/v1/completions", json={**GOOD, "prompt": prompt}, headers=AUTH), 400, "prompt")
    assert says in error["message"], error["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image"}] * 300}]},
     "messages.0.content.0.type", "messages.0.content.0.type: Input should be 'text'"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}] * 299 + [{"role": "bot"}]}, "messages.299.role",
     "messages.299.role: Input should be 'system'"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a"}] * (MAX_CHAT_ITEMS + 1)},
     "messages", f"at most {MAX_CHAT_ITEMS} messages and content parts together"),
])
def test_a_long_bad_chat_gets_one_error_naming_its_first_bad_item(http, path, body, param, says):
    """A chat content of 600K bad parts took 13 s of pydantic errors on the event loop. The error names the item as
    a short chat's would."""
    error = assert_error(http.post(path, json=body, headers=AUTH), 400, param)
    assert says in error["message"], error["message"]
    assert_still_serving(http)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(http, headers):
    for path in ("/v1/completions", "/v1/chat/completions"):
        error = assert_error(http.post(path, json=GOOD, headers=headers), 401, None)
        assert error["code"] == "invalid_api_key"
    assert_error(http.get("/v1/models", headers=headers), 401, None)
    assert_error(http.get("/v1/models/tiny", headers=headers), 401, None)
    assert http.get("/health").status_code == 200  # open, for load balancers
    assert http.get("/metrics").status_code == 200  # open, for Prometheus (as vLLM's)
    assert_still_serving(http)


def test_a_body_that_is_not_json_names_the_content_type(http):
    """`curl -d '{...}'` sends application/x-www-form-urlencoded: the 400 said only "Input should be a valid
    dictionary"."""
    error = assert_error(http.post("/v1/completions", content=b'{"prompt": "hi"}', headers={
        **AUTH, "Content-Type": "application/x-www-form-urlencoded"}), 400, None)
    assert "Content-Type: application/json" in error["message"] and "x-www-form-urlencoded" in error["message"]
    assert_still_serving(http)


def test_unknown_route_is_openai_shaped(http):
    assert_error(http.get("/v1/nothing", headers=AUTH), 404, None)


def test_error_after_streaming_began(http, server):
    """A step failure mid-stream ends the stream with an error chunk and [DONE]; the next request is fine."""
    executor = server.llm.executor
    real_step = executor.step
    chunks: list[str] = []
    body = {**GOOD, "max_tokens": 50, "ignore_eos": True, "stream": True}
    try:
        with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunks.append(line.removeprefix("data: "))
                if len(chunks) == 1:
                    executor.step = _failing_step
    finally:
        executor.step = real_step
    assert chunks[-1] == "[DONE]"
    assert '"error"' in chunks[-2] and "engine step failed" in chunks[-2]
    assert_still_serving(http)


def _failing_step(seqs):
    raise RuntimeError("injected failure")
