"""Request bodies: a hostile body costs one error, not one per item (each error costs the event loop microseconds,
and every other request waits for it)."""

import pytest
from pydantic import ValidationError

from orbitflow.serve.protocol import (
    MAX_CHAT_ITEMS,
    MAX_LOGIT_BIAS,
    MAX_TOKEN_IDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    token_id_cap,
)

GOOD_PART = {"type": "text", "text": "a"}
BAD_PART = {"type": "image_url"}


def _errors(model, body) -> list[dict]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value.errors()


def _chat(messages):
    return {"messages": messages}


@pytest.mark.parametrize("messages, loc, says", [
    ([{"role": "user", "content": [BAD_PART] * 5000}], ("messages",), "item 0.content.0.type: Input should be 'text'"),
    ([{"role": "user", "content": [GOOD_PART] * 4999 + [BAD_PART]}], ("messages",),
     "item 0.content.4999.type: Input should be 'text'"),
    ([{"role": "user", "content": "a"}] * 4999 + [{"role": "robot"}], ("messages",), "item 4999.role: Input should be"),
    # short lists whose parts add up: one message's errors, not 60 x 255 x 2
    ([{"role": "user", "content": "a"}] + [{"role": "user", "content": [BAD_PART] * 255}] * 60, ("messages",),
     "item 1.content.0.type: Input should be 'text'"),
    ([{"role": "user", "content": [GOOD_PART] * 200 + [5]}] * 2, ("messages",),
     "item 0.content: has none of the types it accepts"),  # as a short chat's content.200 would read
    ([{"role": "user", "content": "a"}] * MAX_CHAT_ITEMS + [{"role": "user", "content": "a"}], ("messages",),
     f"at most {MAX_CHAT_ITEMS} messages and content parts together, got {MAX_CHAT_ITEMS + 1}"),
    ([{"role": "user", "content": [GOOD_PART] * MAX_CHAT_ITEMS}], ("messages",),
     f"at most {MAX_CHAT_ITEMS} messages and content parts together, got {MAX_CHAT_ITEMS + 1}"),
    ([{"role": "user", "content": [BAD_PART] * 10**6}], ("messages",), "got 1000001"),
])
def test_a_long_chat_gets_one_error_naming_its_first_bad_item(messages, loc, says):
    for model in (ChatCompletionRequest, TokenizeRequest):
        errors = _errors(model, _chat(messages))
        assert len(errors) == 1, errors[:3]
        assert errors[0]["loc"] == loc
        assert says in errors[0]["msg"], errors[0]["msg"]


def test_a_short_chat_keeps_item_by_item_errors():
    errors = _errors(ChatCompletionRequest, _chat([{"role": "robot"}, {"role": "user", "content": [BAD_PART]}]))
    assert [e["loc"][:3] for e in errors] == [("messages", 0, "role"), ("messages", 1, "content")] + \
        [("messages", 1, "content")] * (len(errors) - 2)


def test_a_long_chat_reads_as_a_short_one():
    """The items validated one at a time are the ones the request keeps (not validated twice, not lost)."""
    parts = [{"type": "text", "text": str(i), "extra": 1} for i in range(3000)]
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}] * 150
    for model in (ChatCompletionRequest, TokenizeRequest):
        req = model.model_validate(_chat([{"role": "system", "content": parts}, *turns]))
        assert req.messages[0].text == "\n".join(map(str, range(3000)))
        assert [m.role for m in req.messages[1:]] == [t["role"] for t in turns]
        assert [m.text for m in req.messages[1:]] == ["x", ""] * 150
    at_cap = [{"role": "user", "content": [GOOD_PART] * (MAX_CHAT_ITEMS - 1)}]
    assert ChatCompletionRequest.model_validate(_chat(at_cap)).messages[0].text == "\n".join("a" * (MAX_CHAT_ITEMS - 1))


@pytest.mark.parametrize("model, body, loc, says", [
    (CompletionRequest, {"prompt": "a", "stop": [1] * 10**5}, ("stop",), "at most 16 stop strings"),
    (CompletionRequest, {"prompt": "a", "logit_bias": {f"x{i}": "y" for i in range(10**5)}}, ("logit_bias",),
     f"at most {MAX_LOGIT_BIAS} entries"),
    (ChatCompletionRequest, {**_chat([{"role": "user", "content": "a"}]), "tools": [1] * 10**5}, ("tools",),
     "tool calling is not supported"),
    (ChatCompletionRequest, {**_chat([{"role": "user", "content": "a"}]), "functions": [1] * 10**5},
     ("functions",), "tool calling is not supported"),
])
def test_a_list_past_its_cap_is_refused_before_its_items(model, body, loc, says):
    """pydantic checks a dict's length (and a union's list's) only after every item: 1.2M errors for logit_bias."""
    errors = _errors(model, body)
    assert len(errors) == 1, errors[:3]
    assert errors[0]["loc"] == loc
    assert says in errors[0]["msg"]


@pytest.mark.parametrize("model, body, says", [
    (CompletionRequest, {"prompt": [""] * MAX_TOKEN_IDS}, "exactly one prompt per request"),
    (CompletionRequest, {"prompt": ["a"] * 300}, "exactly one prompt per request"),
    (CompletionRequest, {"prompt": [["a"] * 300]}, "item 0 ('a') is not a token id"),
    (ChatCompletionRequest, {**_chat([{"role": "user", "content": "a"}]),
                             "tool_choice": {f"k{i}": 1 for i in range(10**5)}}, "only 'none'"),
    (ChatCompletionRequest, {**_chat([{"role": "user", "content": "a"}]),
                             "function_call": {f"k{i}": 1 for i in range(10**5)}}, "only 'none'"),
])
def test_other_long_bodies_get_one_error(model, body, says):
    """A batch of 131K empty text prompts built 393K errors (5 s over HTTP); a 600K-key tool_choice was validated
    whole before being refused."""
    errors = _errors(model, body)
    assert len(errors) == 1, errors[:3]
    assert says in errors[0]["msg"], errors[0]["msg"]


def test_a_container_of_the_wrong_kind_is_not_called_too_long():
    assert "entries" not in _errors(CompletionRequest, {"prompt": "a", "logit_bias": ["1"] * 301})[0]["msg"]
    stop = {str(i): "x" for i in range(17)}
    assert "stop strings" not in _errors(CompletionRequest, {"prompt": "a", "stop": stop})[0]["msg"]
    for model in (ChatCompletionRequest, TokenizeRequest):
        assert _errors(model, _chat([]))[0]["msg"] == "List should have at least 1 item after validation, not 0"


def test_nulls_take_defaults_among_many_unknown_keys():
    body = {"prompt": "a", "temperature": None, "max_tokens": None, **{f"u{i}": None for i in range(10**5)}}
    req = CompletionRequest.model_validate(body)
    assert req.temperature == 1.0 and req.max_tokens is None  # max_tokens takes null: the rest of the context
    assert body["temperature"] is None  # the client's body is not changed


def test_lists_within_their_caps_keep_their_checks():
    assert _errors(CompletionRequest, {"prompt": "a", "stop": ["x" * 300]})[0]["loc"] == ("stop",)
    assert _errors(CompletionRequest, {"prompt": "a", "logit_bias": {"x": 1}})[0]["loc"][0] == "logit_bias"
    req = CompletionRequest.model_validate({"prompt": "a", "stop": ["x"] * 16, "logit_bias": {"7": 1}})
    assert req.stop_strings == ["x"] * 16 and req.logit_bias == {"7": 1}
    assert ChatCompletionRequest.model_validate({**_chat([{"role": "user", "content": "a"}]), "tools": []})


def test_the_token_id_cap_is_the_servers():
    """A server whose model's context is longer than MAX_TOKEN_IDS takes token-id prompts that long (the static cap
    refused a 1M-context model's long prompts given as ids, while the same text was taken)."""
    long = [5] * (MAX_TOKEN_IDS + 1)
    assert "at most" in _errors(CompletionRequest, {"prompt": long})[0]["msg"]
    token = token_id_cap.set(MAX_TOKEN_IDS + 1)
    try:
        assert CompletionRequest.model_validate({"prompt": long}).prompt == long
        assert DetokenizeRequest.model_validate({"tokens": long}).tokens == long
        assert "at most 131073 token ids" in _errors(DetokenizeRequest, {"tokens": [*long, 5]})[0]["msg"]
        assert "at most 131073 token ids" in _errors(CompletionRequest, {"prompt": [[*long, 5]]})[0]["msg"]
    finally:
        token_id_cap.reset(token)


def test_the_server_sets_its_token_id_cap_per_request():
    import asyncio

    from orbitflow.serve.api import TokenIdCap

    seen = []

    async def app(scope, receive, send):
        seen.append(token_id_cap.get())

    asyncio.run(TokenIdCap(app, cap=10**6)({"type": "http"}, None, None))
    assert seen == [10**6] and token_id_cap.get() == MAX_TOKEN_IDS


@pytest.mark.parametrize("extra", [{"min_p": 0.99}, {"min_tokens": 8}, {"guided_json": {"type": "object"}},
                                   {"guided_choice": ["a", "b"]}, {"use_beam_search": True}, {"prompt_logprobs": 1},
                                   {"skip_special_tokens": False}, {"include_stop_str_in_output": True}])
def test_a_vllm_parameter_the_server_does_not_implement_is_refused_by_name(extra):
    """A vLLM user's min_p or guided_json was silently ignored (200, as if unset); it is refused naming itself."""
    (name,) = extra
    errors = _errors(CompletionRequest, {"prompt": "a", **extra})
    assert f"{name}: this vLLM parameter is not supported" in errors[0]["msg"]
    ok = CompletionRequest.model_validate({"prompt": "a", "min_p": 0.0, "skip_special_tokens": True,
                                           "min_tokens": None})
    assert ok.prompt == "a"  # its "off" value (or null) is accepted


def test_stream_options_need_stream():
    """OpenAI and vLLM refuse stream_options on a non-streaming request; it was accepted and include_usage dropped."""
    body = {"prompt": "a", "stream_options": {"include_usage": True}}
    assert "stream_options: only allowed when stream is true" in _errors(CompletionRequest, body)[0]["msg"]
    assert CompletionRequest.model_validate({**body, "stream": True}).include_usage


def test_chat_content_parts_stay_apart():
    chat = ChatCompletionRequest.model_validate(_chat([{"role": "user", "content": [
        {"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]}]))
    assert chat.messages[0].text == "line one\nline two"  # was "line oneline two"


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "system", "content": None}, {"role": "tool"}])
def test_a_turn_without_content_is_refused_unless_the_assistants(message):
    with pytest.raises(ValidationError, match=f"a {message['role']} message needs content"):
        ChatCompletionRequest.model_validate(_chat([message]))
    chat = ChatCompletionRequest.model_validate(_chat([{"role": "user", "content": "hi"}, {"role": "assistant"}]))
    assert chat.messages[1].text == ""


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_number_that_is_not_finite_is_named_as_such(value):
    """Python's JSON reader takes NaN and Infinity; NaN was refused as 'less than or equal to 2'."""
    body = '{"model": "m", "prompt": "x", "temperature": ' + value + "}"
    with pytest.raises(ValidationError, match="temperature\\n  Input should be a finite number"):
        CompletionRequest.model_validate_json(body)
