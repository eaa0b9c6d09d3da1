"""Schemathesis against the live app: no 5xx, and every response matches the OpenAPI document (status codes,
content types, headers, bodies); bad input is rejected. Bounded: a few examples per operation, and a
64-token context (batches of up to 16) so no generated request decodes for long."""

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serve.live import live_server, make_server_llm

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def api_schema(tiny_chat_dir):
    with live_server(make_server_llm(tiny_chat_dir, max_model_len=64, max_num_seqs=16,
                                                 token_deposit=False)) as live:
        yield schemathesis.openapi.from_url(f"{live.url}/openapi.json")


EXAMPLES = 10  # per operation and generation mode


def test_api_matches_its_openapi_document(api_schema):
    # Driven through hypothesis directly: schemathesis' pytest plugin does not support pytest 9 yet.
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 7
    for operation in operations:
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.body else [])
        for mode in modes:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                      derandomize=True, database=None, phases=[Phase.explicit, Phase.generate])
            def check(case):
                case.call_and_validate(checks=CHECKS, timeout=60)

            check()


STREAMS = [{}, {"stream_options": {"include_usage": True}}, {"n": 2}]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streams_match_their_openapi_document(api_schema, path):
    """Each server-sent event is documented (schemathesis checks every one): its data is a chunk or an error as JSON,
    or [DONE]. A document that called an event a string failed every stream the examples above happened not to
    make."""
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    logprobs = {"logprobs": 2} if path == "/v1/completions" else {"logprobs": True, "top_logprobs": 2}
    for extra in [*STREAMS, logprobs]:
        case = api_schema[path]["POST"].Case(body={**body, "stream": True, "max_tokens": 3, **extra})
        response = case.call_and_validate(checks=CHECKS, timeout=60)
        assert response.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_null_parameters_take_their_defaults_as_documented(api_schema, path):
    """OpenAI clients send null for parameters they leave unset: the server takes the default, and the document says
    so (schemathesis' negative examples had sent null as invalid data and flagged the 200)."""
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    operation = api_schema[path]["POST"]
    case = operation.Case(body={**body, "temperature": None, "n": None, "stream": None, "top_p": None,
                                "max_tokens": 2})
    assert case.call_and_validate(checks=CHECKS, timeout=60).status_code == 200
    name = "CompletionRequest" if path == "/v1/completions" else "ChatCompletionRequest"
    request = api_schema.raw_schema["components"]["schemas"][name]
    assert {"type": "null"} in request["properties"]["temperature"]["anyOf"]
    for field in request["required"]:  # a required field's null is a missing field: a 400
        assert {"type": "null"} not in request["properties"][field].get("anyOf", []), field


def test_unsupported_methods_get_405_with_allow(api_schema):
    import httpx

    base = api_schema.raw_schema["servers"][0]["url"] if "servers" in api_schema.raw_schema else None
    url = api_schema.get_base_url() if base is None else base
    with httpx.Client(base_url=url, timeout=30) as http:
        for path, method, allow in (("/v1/completions", "get", "POST"), ("/v1/models", "delete", "GET"),
                                    ("/health", "post", "GET")):
            reply = http.request(method, path)
            assert reply.status_code == 405 and allow in reply.headers["allow"], (path, reply.headers)
            assert reply.json()["error"]["message"]


def test_openapi_documents_what_is_sent(api_schema):
    raw = api_schema.raw_schema
    for path, operations in raw["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
    completions = raw["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "500", "503"} <= set(completions)
    assert "text/event-stream" in completions["200"]["content"]
    assert "Retry-After" in completions["503"]["headers"]
    assert "text/plain" in "".join(raw["paths"]["/metrics"]["get"]["responses"]["200"]["content"])
    assert {"/tokenize", "/detokenize", "/health", "/v1/models", "/v1/chat/completions"} <= set(raw["paths"])
