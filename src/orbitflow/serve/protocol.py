"""OpenAI request and response bodies (what orbitflow serves) as pydantic models; the OpenAPI document is
generated from them.

Every parameter has a documented range and a value outside it is a 400 naming the field. Unknown fields are
ignored, as OpenAI clients send many optional ones; known ones that orbitflow does not implement (tools,
response_format other than text, suffix, best_of other than n, ...) are a 400 naming the parameter rather
than silently ignored. Checks that need the model (context length, vocabulary) are made by the routes.
"""

from __future__ import annotations

import itertools
import math
from contextvars import ContextVar
from functools import cache
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_TOP_LOGPROBS = 20
MAX_N = 16
# token-id lists (a prompt, /detokenize): a 128k context's worth, or the served model's context where longer (the
# server sets token_id_cap per request). Checking each id costs about 0.5 us on the event loop, before any handler
# runs, so the 8 MiB body cap alone (4M ids) would hold every other request for 2 s
MAX_TOKEN_IDS = 1 << 17
token_id_cap: ContextVar[int] = ContextVar("token_id_cap", default=MAX_TOKEN_IDS)
# messages and content parts of one chat, together: a 1M context's worth of short turns. pydantic takes about 3 us per
# message (8 us and two errors per bad part) on the event loop, so the body cap alone (500K parts in 8 MiB) held every
# other request for 13 s
MAX_CHAT_ITEMS = 1 << 14
_INT64 = (-(2**63), 2**63 - 1)

def _json_number(value: Any) -> Any:
    """A JSON number: 7 or 0.5, never "7" or true (pydantic's lax float would take both). A type error, so that a
    union reports the member the value was meant as (serve/errors.py)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError("float_type", "Input should be a number")
    if isinstance(value, float) and not math.isfinite(value):  # NaN and Infinity, which Python's JSON reader takes
        raise PydanticCustomError("finite_number", "Input should be a finite number")
    return value


def _json_integer(value: Any) -> Any:
    """JSON Schema's integer: 7 and 7.0, never "7" or true (pydantic's lax int would take both); a type error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


_IDS_CAP_DOC = f"at most {MAX_TOKEN_IDS} token ids, or the model's context where longer"

Number = Annotated[float, BeforeValidator(_json_number)]
Int = Annotated[int, BeforeValidator(_json_integer)]
TOKEN_ID_MAX = 2**31 - 1
TokenId = Annotated[Int, Field(ge=0, le=TOKEN_ID_MAX)]


def _range(lo: float, hi: float, default: float, doc: str, *, gt: bool = False) -> Any:
    bounds = {"gt": lo} if gt else {"ge": lo}
    return Field(default=default, le=hi, description=doc, **bounds)


_SCHEMA_META = ("title", "description", "default", "examples")


def _document_nulls(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The OpenAPI document says what :class:`NullIsDefault` accepts: null for each parameter, meaning its default."""
    props = schema.get("properties", {})
    for name in _not_nullable(cls):
        key = cls.model_fields[name].alias or name
        if key in props and not cls.model_fields[name].is_required():  # a required one's null is a missing field
            prop = props[key]
            props[key] = {"anyOf": [{k: v for k, v in prop.items() if k not in _SCHEMA_META}, {"type": "null"}],
                          **{k: prop[k] for k in _SCHEMA_META if k in prop}}


class NullIsDefault(BaseModel):
    """A body whose parameters sent as null take their defaults, as OpenAI's API and vLLM read them (clients send
    nulls for every parameter they leave unset); a parameter that takes null (``max_tokens``: the rest of the
    context) keeps it. The OpenAPI document marks every parameter nullable accordingly."""

    model_config = ConfigDict(json_schema_extra=_document_nulls)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):  # only the known fields are looked at: a body may carry 600K unknown keys
            nulls = [k for k in _not_nullable(cls) if k in data and data[k] is None]
            if nulls:
                data = dict(data)
                for k in nulls:
                    del data[k]
        return data


@cache
def _not_nullable(cls: type[BaseModel]) -> frozenset[str]:
    """The fields of ``cls`` whose type does not admit None (once per body class, not per request)."""
    return frozenset(name for name, f in cls.model_fields.items() if type(None) not in get_args(f.annotation))


class StreamOptions(NullIsDefault):
    include_usage: StrictBool = Field(False, description="send a last chunk with the usage of the request")
    continuous_usage_stats: StrictBool = Field(False, description="vLLM's usage on every chunk: not supported")

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous_usage(cls, value: bool) -> bool:
        if value:
            raise _unsupported("stream_options.continuous_usage_stats", "usage on every chunk is not supported "
                               "(include_usage sends it once, last)")
        return value


# vLLM's sampling and output extensions this server does not implement, each with the value that means "off": a vLLM
# user's request that sets one is refused by name (a 400), not served as if it had not (null or "off" is accepted).
VLLM_UNSUPPORTED: dict[str, Any] = {
    "min_p": 0, "min_tokens": 0, "use_beam_search": False, "length_penalty": 1, "early_stopping": False,
    "prompt_logprobs": None, "include_stop_str_in_output": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": [],
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None, "structured_outputs": None,
    "continue_final_message": False, "logits_processors": None, "priority": 0, "return_tokens_as_token_ids": False,
}
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs entries (each a variable the chat template may read)


class SamplingFields(NullIsDefault):
    """Parameters shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = Field(None, description="must be the served model's name when given")
    max_tokens: Int | None = Field(None, ge=1, le=2**31 - 1,
                                         description="tokens to generate at most (prompt + max_tokens <= context)")
    temperature: Number = _range(0.0, 2.0, 1.0, "0 (or below 1e-5) samples greedily")
    top_p: Number = _range(0.0, 1.0, 1.0, "nucleus sampling mass, in (0, 1]", gt=True)
    top_k: Int = Field(0, ge=-1, le=2**31 - 1, description="keep the k most likely tokens; 0 or -1: off")
    seed: Int | None = Field(None, ge=_INT64[0], le=_INT64[1], description="reproducible sampling (int64)")
    presence_penalty: Number = _range(-2.0, 2.0, 0.0, "subtracted once from each token already generated")
    frequency_penalty: Number = _range(-2.0, 2.0, 0.0, "subtracted per occurrence of a generated token")
    repetition_penalty: Number = _range(0.0, 2.0, 1.0, "divides positive (multiplies negative) logits of "
                                        "prompt and generated tokens; 1: off", gt=True)
    logit_bias: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")],
                     Annotated[Number, Field(ge=-100, le=100)]] | None = Field(
        None, description=f"token id (as a string) -> bias added to its logit, in [-100, 100]; "
                          f"at most {MAX_LOGIT_BIAS} entries")
    stop: StrictStr | list[StrictStr] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters; "
                          "the output ends before the first one")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS,
                                                 description="token ids that end the output (kept in it)")
    n: Int = Field(1, ge=1, le=MAX_N, description="choices to generate for the prompt")
    best_of: Int | None = Field(None, description="only best_of = n is supported")
    stream: StrictBool = Field(False, description="stream chunks as server-sent events")
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = Field(False, description="keep generating past the end-of-sequence token")
    slo_ms: Number | None = Field(None, gt=0, le=3_600_000, description="this request's per-token (TBT) SLO in ms, "
                                  "which the planner plans for and Token-Deposit paces (default: the server's)")
    user: StrictStr | None = Field(None, description="accepted and ignored")

    @model_validator(mode="before")
    @classmethod
    def _no_vllm_extensions(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, off in VLLM_UNSUPPORTED.items():
                value = data.get(name)
                if value is not None and value != off:
                    raise _unsupported(name, f"this vLLM parameter is not supported (leave it out, or {off!r})")
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_count(cls, value: Any) -> Any:
        return _too_many(value, list, MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are supported")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if any(len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> Any:
        return _too_many(value, dict, MAX_LOGIT_BIAS, f"at most {MAX_LOGIT_BIAS} entries are supported")

    @model_validator(mode="after")
    def _check_best_of(self) -> SamplingFields:
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "best_of other than n is not supported")
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM refuse it
            raise _unsupported("stream_options", "only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class UnsupportedParameter(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _unsupported(param: str, message: str) -> UnsupportedParameter:
    return UnsupportedParameter(param, f"{param}: {message}")


# a batch of prompts parses too, so that _one_prompt can say that one prompt per request is supported
_DETAILED_UP_TO = 256  # items of a prompt list whose errors the union below reports item by item


def _is_token_id(x: Any) -> bool:
    whole = (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, float) and x.is_integer())
    return whole and 0 <= x <= TOKEN_ID_MAX


def _prompt_list_checked(value: Any) -> Any:
    """A long prompt list gets one pass and at most one error before the union below sees it: each member of the
    union that fails builds an error per item (4M ids under the body cap held the event loop for a minute, 131K bad
    ones for 2 s). Past the cap (token_id_cap) it is refused; a long list that is neither token ids nor strings is
    refused at its first bad item; a short one keeps the union's item-by-item errors."""
    if not isinstance(value, list):
        return value
    inner = value[0] if len(value) == 1 and isinstance(value[0], list) else value
    n, cap = max(len(value), len(inner)), token_id_cap.get()
    if n > cap:  # first: the scans below are then bounded by the cap
        raise PydanticCustomError("too_long", "a prompt holds at most {cap} token ids (or one prompt), got {n}",
                                  {"cap": cap, "n": n})
    if len(value) > 1 and any(isinstance(x, list) for x in value):  # a batch of prompts, some of them token lists:
        nested = sum(len(x) for x in value if isinstance(x, list))  # a short one keeps the union's own errors
        if nested > _DETAILED_UP_TO or all(isinstance(x, list) for x in value):
            raise PydanticCustomError("one_prompt", "exactly one prompt per request is supported")
    if inner is not value or not all(isinstance(x, str) for x in inner):
        _long_ids_checked(inner)  # [[...]] can only be token ids
    elif len(value) > _DETAILED_UP_TO:  # a long batch of text prompts: every member of the union fails per item
        raise PydanticCustomError("one_prompt", "exactly one prompt per request is supported")
    return value


def _long_ids_checked(value: Any) -> Any:
    """A long list of token ids: one pass, and one error at its first bad item (pydantic would build one per item)."""
    cap = token_id_cap.get()
    if isinstance(value, list) and len(value) > cap:  # (max_length would say so after checking them all)
        raise PydanticCustomError("too_long", "at most {cap} token ids, got {n}", {"cap": cap, "n": len(value)})
    if isinstance(value, list) and len(value) > _DETAILED_UP_TO:
        bad = next((i for i, x in enumerate(value) if not _is_token_id(x)), None)
        if bad is not None:
            raise PydanticCustomError("token_id", "item {i} ({x}) is not a token id (an integer in [0, {top}])",
                                      {"i": bad, "x": repr(value[bad])[:40], "top": TOKEN_ID_MAX})
    return value


def union_tag(part: str | int) -> bool:
    """Whether a part of a pydantic error's ``loc`` is the member of a union it tried ("str", "list[int]",
    "TextPart", ...) rather than a field name or an index."""
    if isinstance(part, int):
        return False
    return not part.isidentifier() or part in ("str", "int", "float", "bool") or part[0].isupper()


NO_MEMBER = "has none of the types it accepts (see /openapi.json)"


def main_error(errors: list[dict]) -> tuple[list[str], str, dict]:
    """The error of pydantic's ``errors`` (non-empty) that a client should read, as ``(loc, message, error)``; ``loc``
    leaves out union member tags. A value that fits no member of a union gets one error per member: the first that
    is not a plain type mismatch names the member the value was meant as (a token id below 0 in a list of ids, not
    "should be a string"); when every one is a type mismatch, the message says the value has none of the union's
    types, at the location they share. A long list's one error (``_items_checked``) is named at its bad item."""
    locs = [[str(part) for part in e.get("loc", ()) if not union_tag(part)] for e in errors]
    i = next((i for i, e in enumerate(errors) if not _mismatch(e.get("type", ""))), None)
    if i is None and len(errors) > 1:
        shared = [parts[0] for parts in itertools.takewhile(lambda parts: len(set(parts)) == 1, zip(*locs))]
        if shared:
            return shared, NO_MEMBER, errors[0]
    i = i or 0
    if errors[i].get("type") == "bad_item":  # one item of a long list (_items_checked): named as a short list's
        return [*locs[i], *errors[i]["ctx"]["where"]], errors[i]["ctx"]["detail"], errors[i]
    return locs[i], str(errors[i].get("msg", "")).removeprefix("Value error, "), errors[i]


def _mismatch(kind: str) -> bool:
    """A pydantic error type that says "not this type" (one per member of a union the value is not)."""
    return kind.endswith(("_type", "_parsing"))


@cache
def _adapter(item_type: Any) -> TypeAdapter:
    return TypeAdapter(item_type)


def _items_checked(value: Any, item_type: Any, size: int | None = None) -> Any:
    """A long list of models (``size``: how long it counts as, its length by default): validated one item at a time
    and refused with one error, at its first bad item (pydantic would build every item's errors, two per bad member
    of a union). The validated items are returned, so pydantic does not validate them again. A short list keeps
    pydantic's own item-by-item errors."""
    if not isinstance(value, list) or (len(value) if size is None else size) <= _DETAILED_UP_TO:
        return value
    adapter, out = _adapter(item_type), []
    for i, item in enumerate(value):
        try:
            out.append(adapter.validate_python(item))
        except ValidationError as exc:
            loc, message, _ = main_error(exc.errors(include_url=False))
            where = [str(i), *loc]  # below the list: where a short list's error would be (serve/errors.py)
            raise PydanticCustomError("bad_item", "item {where_text}: {detail}",
                                      {"where": where, "where_text": ".".join(where), "detail": message}) from None
    return out


def _too_many(value: Any, kind: type, cap: int, message: str) -> Any:
    """``message`` as the error when ``value``, a ``kind`` (list or dict), has over ``cap`` entries, checked before
    its items are (pydantic checks a dict's length, and a union's list's, only after validating every item)."""
    if isinstance(value, kind) and len(value) > cap:
        raise ValueError(message)
    return value


TokenIds = Annotated[list[TokenId], Field(min_length=1)]  # at most token_id_cap ids (_prompt_list_checked)
Prompt = Annotated[Annotated[StrictStr, Field(min_length=1)] | TokenIds
                   | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1)]
                   | Annotated[list[TokenIds], Field(min_length=1)], BeforeValidator(_prompt_list_checked)]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(description=f"text or token ids (one prompt per request; {_IDS_CAP_DOC})")
    max_tokens: Int | None = Field(16, ge=1, le=2**31 - 1,
                                         description="tokens to generate at most (OpenAI's default: 16)")
    echo: StrictBool = Field(False, description="prepend the prompt to the text (not with logprobs)")
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                       description="return each token's logprob and this many alternatives")
    suffix: StrictStr | None = Field(None, description="not supported (400 when given)")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Prompt) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("exactly one prompt per request is supported")
            value = value[0]
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value:
            raise ValueError("suffix is not supported")
        return None

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise _unsupported("echo", "echo with logprobs (prompt logprobs) is not supported")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[StrictStr | list[TextPart] | None,
                       BeforeValidator(lambda value: _items_checked(value, TextPart))] = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        """Only an assistant turn may come without content (OpenAI's rule: its tool calls stand in for it); any other
        turn without it was a mistake the chat template rendered as an empty turn."""
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "a {role} message needs content", {"role": self.role})
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # parts stay apart (as vLLM joins them)


def _chat_checked(value: Any) -> Any:
    """A chat's messages: at most MAX_CHAT_ITEMS messages and content parts together (counted before either is
    validated). A chat of more than _DETAILED_UP_TO of them is validated a message at a time (``_items_checked``),
    so at most one message's errors are built, however its parts are spread among messages."""
    if not isinstance(value, list):
        return value
    n = len(value)
    if n <= MAX_CHAT_ITEMS:
        n += sum(len(m["content"]) for m in value if isinstance(m, dict) and isinstance(m.get("content"), list))
    if n > MAX_CHAT_ITEMS:
        raise PydanticCustomError("too_long", "a chat holds at most {cap} messages and content parts together, "
                                  "got {n}", {"cap": MAX_CHAT_ITEMS, "n": n})
    return _items_checked(value, ChatMessage, size=n)


Messages = Annotated[list[ChatMessage], Field(min_length=1), BeforeValidator(_chat_checked)]


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"response_format {value!r} is not supported (only 'text')")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: Messages = Field(description=f"at most {MAX_CHAT_ITEMS} messages and content parts")
    max_completion_tokens: Int | None = Field(None, ge=1, le=2**31 - 1,
                                                    description="tokens to generate at most (wins over max_tokens)")
    logprobs: StrictBool = Field(False, description="return each generated token's logprob")
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                           description="alternatives per token (needs logprobs: true)")
    response_format: ResponseFormat | None = Field(None, description="only {'type': 'text'}")
    tools: list[dict[str, Any]] | None = Field(None, description="not supported (400 when non-empty)")
    tool_choice: StrictStr | dict[str, Any] | None = Field(None, description="only 'none'")
    functions: list[dict[str, Any]] | None = Field(None, description="not supported (400 when non-empty)")
    function_call: StrictStr | dict[str, Any] | None = Field(None, description="only 'none'")
    add_generation_prompt: StrictBool = Field(True, description="end the rendered chat with the assistant prefix")
    chat_template_kwargs: dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")],
                               Any] | None = Field(
        None, description=f"extra variables for the chat template (e.g. enable_thinking), at most "
                          f"{MAX_TEMPLATE_KWARGS}; not messages or add_generation_prompt")
    echo: StrictBool = Field(False, description="vLLM's echo of the last message: not supported")

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, value: Any) -> Any:
        value = _too_many(value, dict, MAX_TEMPLATE_KWARGS, f"at most {MAX_TEMPLATE_KWARGS} entries")
        if isinstance(value, dict):
            taken = sorted({"messages", "add_generation_prompt"} & set(value))
            if taken:
                raise ValueError(f"{', '.join(taken)} cannot be set here (give them as request fields)")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise _unsupported("echo", "echoing the last message is not supported for chat completions")
        return value

    @field_validator("tools", "functions", mode="before")
    @classmethod
    def _no_tools(cls, value: Any) -> Any:
        return _too_many(value, list, 0, "tool calling is not supported")  # before the list's items are validated

    @field_validator("tool_choice", "function_call", mode="before")  # before a 600K-key dict is validated
    @classmethod
    def _no_tool_choice(cls, value: Any) -> None:
        if value is not None and value != "none":
            raise ValueError("tool calling is not supported (only 'none')")
        return None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise _unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = Field(None, description="text to tokenize (or messages)")
    messages: Messages | None = Field(None, description="chat to render and tokenize")
    add_special_tokens: StrictBool = Field(True, description="for prompt: add the tokenizer's special tokens")
    add_generation_prompt: StrictBool = Field(True, description="for messages: end with the assistant prefix")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _unsupported("prompt", "give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: Annotated[list[TokenId], BeforeValidator(_long_ids_checked)] = Field(description=_IDS_CAP_DOC)


# ---- responses ---------------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "abort", "error"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _choice_model(name: str, body: str, body_type: Any, logprobs_type: Any) -> type[BaseModel]:
    """A choice of a response or chunk: ``index``, its body (``text``, ``message`` or ``delta``), ``logprobs``
    and ``finish_reason``, in that order (the order clients see)."""
    return create_model(name, index=(int, ...), **{body: (body_type, ...)},
                        logprobs=(logprobs_type | None, None), finish_reason=(FinishReason | None, None))


CompletionChoice = _choice_model("CompletionChoice", "text", str, CompletionLogprobs)


class _ResponseHead(BaseModel):
    """The fields every completion response and chunk opens with (each narrows `object` to its literal)."""

    id: str
    object: str
    created: int
    model: str


def _response_model(name: str, kind: str, choice_type: type[BaseModel], usage_required: bool) -> type[BaseModel]:
    """A completion response or chunk: the head with ``object`` fixed to ``kind``, then choices and usage."""
    usage = (Usage, ...) if usage_required else (Usage | None, None)
    return create_model(name, __base__=_ResponseHead, object=(Literal[kind], kind),
                        choices=(list[choice_type], ...), usage=usage)


CompletionResponse = _response_model("CompletionResponse", "text_completion", CompletionChoice, False)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


ChatChoice = _choice_model("ChatChoice", "message", AssistantMessage, ChatLogprobs)


ChatCompletionResponse = _response_model("ChatCompletionResponse", "chat.completion", ChatChoice, True)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


ChatChunkChoice = _choice_model("ChatChunkChoice", "delta", ChatDelta, ChatLogprobs)


ChatCompletionChunk = _response_model("ChatCompletionChunk", "chat.completion.chunk", ChatChunkChoice, False)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: str
