"""OpenAI-compatible HTTP API over an LLM: completions, chat completions, models, tokenize, health, metrics.

Every request is checked at the edge (protocol.py: a 400 naming the field); anything that still fails for
one request ends that request alone (an error event in its stream, or a 500 for it alone). A client that
disconnects aborts its request, streaming or not, so its KV blocks go back at the engine's next step.
Requests that do not fit now wait in the engine's queue; past `--max-queue-len` they get 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic.json_schema import models_json_schema

from orbitflow.config import ConfigError
from orbitflow.runtime.deposit import pace_s
from orbitflow.runtime.engine import QueueFull, RequestRejected
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.serve import protocol as p
from orbitflow.serve.async_engine import AsyncEngine, EngineError, EngineUnavailable
from orbitflow.serve.auth import APIKeyMiddleware, BodySizeLimitMiddleware
from orbitflow.serve.errors import APIError, bad_request, install_error_handlers, unavailable
from orbitflow.serve.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_WATCHDOG_S = 60.0


@dataclass
class TokenInfo:
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


@dataclass
class Delta:
    """Text released for one choice, the tokens consumed since the previous delta, and the finish."""

    index: int
    text: str
    finish_reason: str | None
    completion_tokens: int
    tokens: list[TokenInfo] = field(default_factory=list)


def check_unicode(text: str, param: str) -> None:
    """Text that is not Unicode (a lone surrogate, which JSON allows) is a 400 naming ``param``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param}: not valid Unicode text ({exc.reason} at character {exc.start})", param) from exc


class OpenAIServer:
    """What the routes share: the engine bridge, the tokenizer, the limits and the metrics.

    ``engine`` is anything with AsyncEngine's serving surface (`generate`, `start`, `shutdown`, `running`,
    `draining`, `stalled`): the local engine thread, or (serve/cluster.py) the engine replicas of a Ray
    Serve deployment. :meth:`local` builds it over an in-process LLM.
    """

    def __init__(self, model_name: str, tokenizer, engine, metrics: ServerMetrics, clock, max_len: int,
                 vocab_size: int, watchdog_s: float = DEFAULT_WATCHDOG_S, llm=None,
                 max_choices: int | None = None, slo_s: float | None = None,
                 deposit_guard_ms: float | None = 0.0) -> None:
        self.llm, self.engine, self.metrics, self.clock = llm, engine, metrics, clock  # llm: None on a cluster
        self.model_name, self.tokenizer, self.vocab_size = model_name, tokenizer, vocab_size
        self.max_len, self.watchdog_s = max_len, watchdog_s
        self.max_choices = max_choices  # the most choices (n) the engine can ever hold at once; None: no cap
        self.created = int(time.time())
        self.slo_s = slo_s  # the engine's TBT SLO: the metrics count the delivered gaps over it
        self.deposit_guard_ms = deposit_guard_ms  # the engines' --deposit-guard-ms: a request's slo_ms must clear it

    @classmethod
    def local(cls, llm, model_name: str, watchdog_s: float = DEFAULT_WATCHDOG_S) -> OpenAIServer:
        sched = llm.engine.config.scheduler
        # Each choice is a request of its own: past the batch and the queue, the last ones would meet a full queue
        # on an idle server, and a 503 that no retry can turn into a 200.
        max_choices = None if sched.max_queue_len is None else sched.max_num_seqs + sched.max_queue_len
        max_len = max_len_of(llm)
        if max_len < 2:  # a prompt token and an output token: with less, every request would get a 400
            cache = llm.config.cache
            raise ConfigError(f"--device-kv-blocks {cache.device_kv_blocks} and --host-kv-blocks "
                              f"{cache.host_kv_blocks} hold no request (the longest one these pools and the policy "
                              f"can serve is {max_len} tokens); raise them")
        return cls(model_name, llm.tokenizer, AsyncEngine(llm.engine, llm.tokenizer), ServerMetrics(llm.engine),
                   llm.clock, max_len, llm.loaded.config.vocab_size, watchdog_s, llm=llm, max_choices=max_choices,
                   slo_s=llm.engine.default_slo_s, deposit_guard_ms=llm.config.planner.deposit_guard_ms)

    # ---- request preparation ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"{param}: token id {bad[0]} is not in the vocabulary (size {self.vocab_size})", param)

    def encode_text(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids; text that is not Unicode (a lone surrogate) is a 400 naming ``param``. A long text
        takes seconds: the handlers run this off the event loop (and the tokenizer releases the GIL)."""
        check_unicode(text, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(self.encode_text, prompt, "prompt")
        else:
            self.check_token_ids(prompt, "prompt")
            ids = list(prompt)
        if not ids:
            raise bad_request("prompt: the prompt encodes to no tokens", "prompt")
        return ids

    async def chat_prompt_ids(self, messages: list[p.ChatMessage], add_generation_prompt: bool = True,
                              template_kwargs: dict[str, Any] | None = None) -> list[int]:
        # OpenAI's "developer" role is the system role of newer models: chat templates know only "system"
        turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in messages]
        for i, turn in enumerate(turns):  # a lone surrogate: the 400 names the message, as encode_text names prompt
            check_unicode(turn["content"], f"messages.{i}.content")
        try:  # off the event loop, as encode_text
            return await asyncio.to_thread(self.tokenizer.apply_chat_template, turns,
                                           add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        except Exception as exc:  # no template, or the template refuses these messages
            raise bad_request(f"messages: cannot apply the chat template: {exc}", "messages") from exc

    def sampling(self, req: p.SamplingFields, prompt_ids: list[int], max_tokens: int | None,
                 logprobs: int | None) -> SamplingParams:
        if self.max_choices is not None and req.n > self.max_choices:
            raise bad_request(f"n: {req.n} choices exceed the {self.max_choices} requests this server holds at once "
                              "(--max-num-seqs plus --max-queue-len)", "n")
        room = self.max_len - len(prompt_ids)
        if room < 1:
            what = "messages" if isinstance(req, p.ChatCompletionRequest) else "prompt"
            raise bad_request(f"{what}: {len(prompt_ids)} prompt tokens leave no room for output in this server's "
                              f"context of {self.max_len} tokens", what)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise bad_request(f"{param}: prompt ({len(prompt_ids)} tokens) plus {param} ({max_tokens}) "
                              f"exceeds this server's context of {self.max_len} tokens", param)
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
        self.check_token_ids(list(bias), "logit_bias")
        self.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        slo_s = None if req.slo_ms is None else float(req.slo_ms) / 1000
        if slo_s is not None:  # the engine's own check, here so the 400 names slo_ms (0 too: an slo_ms that underflows)
            try:
                pace_s(self.deposit_guard_ms, slo_s)
            except ValueError as exc:
                raise bad_request(f"slo_ms: {exc}", "slo_ms") from None
        return SamplingParams(
            slo_s=slo_s, max_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p),
            top_k=max(0, req.top_k), seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, presence_penalty=float(req.presence_penalty),
            frequency_penalty=float(req.frequency_penalty), repetition_penalty=float(req.repetition_penalty),
            logit_bias=tuple(sorted(bias.items())), logprobs=logprobs,
        )

    # ---- generation ------------------------------------------------------------------------------------
    async def deltas(self, index: int, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     stop: list[str]) -> AsyncIterator[Delta]:
        """One choice's text deltas, the last one with the finish reason; stop strings applied (by the engine's
        bridge, where the text is made as it is generated)."""
        clock = self.clock
        # n choices share one prompt: counted once (with choice 0), as the response's usage counts it. The gaps are
        # judged against the SLO the engine that makes the tokens paces them for (each token says it: behind a cluster,
        # the replica's, measured on its own hardware); this server's default until the first token.
        slo_s = self.slo_s if sampling.slo_s is None else sampling.slo_s
        tracker = self.metrics.tracker(clock.now(), len(prompt_ids) if index == 0 else 0, slo_s)
        reason: str | None = "abort"
        tokens: list[TokenInfo] = []
        try:
            async with aclosing(self.engine.generate(request_id, prompt_ids, sampling, stop)) as outputs:
                async for out in outputs:
                    if out.token_id is not None:
                        if out.slo_s is not None:
                            tracker.slo_s = out.slo_s
                        tracker.on_token(clock.now())
                        tokens.append(TokenInfo(out.token_id, out.logprob, out.top_logprobs))
                    text = out.text_delta
                    if out.finish_reason is not None:
                        reason = out.finish_reason
                        yield Delta(index, text, reason, tracker.num_tokens, tokens)
                        return
                    if text:
                        yield Delta(index, text, None, tracker.num_tokens, tokens)
                        tokens = []
        except (RequestRejected, QueueFull, EngineUnavailable):
            reason = None
            raise
        except EngineError:
            reason = "error"
            raise
        finally:
            if reason is not None:
                tracker.on_finish(reason)

    def choices(self, prefix: str, prompt_ids: list[int], sampling: SamplingParams, n: int,
                stop: list[str]) -> tuple[str, AsyncIterator[Delta]]:
        """The request id and the merged deltas of its n choices (choice i has seed + i when seeded)."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        streams = []
        for i in range(n):
            params = sampling
            if n > 1 and sampling.seed is not None:
                params = _with_seed(sampling, (sampling.seed + i) % (1 << 63))
            sub_id = request_id if n == 1 else f"{request_id}-{i}"
            streams.append(self.deltas(i, sub_id, prompt_ids, params, stop))
        return request_id, _merge(streams)

    async def first_delta(self, deltas: AsyncIterator[Delta]) -> Delta:
        """Awaits the first delta, so that a request failing before any token gets a proper status."""
        try:
            return await anext(deltas)
        except BaseException as exc:
            await deltas.aclose()
            raise _status(exc) from exc

    async def collect(self, deltas: AsyncIterator[Delta], n: int) -> list[list[Delta]]:
        """Every choice's deltas, in order, up to its finish."""
        per_choice: list[list[Delta]] = [[] for _ in range(n)]
        first = await self.first_delta(deltas)
        per_choice[first.index].append(first)
        try:
            async for delta in deltas:
                per_choice[delta.index].append(delta)
        except EngineError as exc:
            raise APIError(500, str(exc), "server_error") from exc
        return per_choice

    async def sse(self, first: Delta, deltas: AsyncIterator[Delta], chunks: Callable[[Delta], list[dict]],
                  usage_chunk: Callable[[int], dict] | None, preamble: list[dict]) -> AsyncIterator[str]:
        completion_tokens: dict[int, int] = {}
        try:
            for payload in preamble:
                yield _sse(payload)
            delta: Delta | None = first
            while delta is not None:
                completion_tokens[delta.index] = delta.completion_tokens
                for payload in chunks(delta):
                    yield _sse(payload)
                delta = await anext(deltas, None)
            if usage_chunk is not None:
                yield _sse(usage_chunk(sum(completion_tokens.values())))
        except EngineError as exc:  # this request failed after its stream began: an error event ends it
            yield _sse(APIError(500, str(exc), "server_error").body())
        finally:
            await deltas.aclose()
        yield "data: [DONE]\n\n"

    def usage(self, num_prompt: int, completion_tokens: int) -> p.Usage:
        return p.Usage(prompt_tokens=num_prompt, completion_tokens=completion_tokens,
                       total_tokens=num_prompt + completion_tokens)

    # ---- token strings for logprobs ----------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        """A token as logprobs show it: its text, the bytes of a character it holds only part of escaped
        (``\\xf0\\x9f``), so that no two tokens print alike and none prints as U+FFFD."""
        return self.tokenizer.token_bytes(token).decode("utf-8", "backslashreplace")

    def completion_logprobs(self, tokens: list[TokenInfo], offsets: TextOffsets) -> p.CompletionLogprobs:
        out = p.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for info in tokens:
            out.tokens.append(self.token_text(info.token))
            out.token_logprobs.append(info.logprob)
            # the sampled token is always among them (OpenAI: up to logprobs + 1 entries), as vLLM returns it
            top = {self.token_text(t): lp for t, lp in info.top}
            if info.logprob is not None:
                top.setdefault(self.token_text(info.token), info.logprob)
            out.top_logprobs.append(top)
            skipped = info.token in self.tokenizer.special_ids  # decode leaves it out of the text
            out.text_offset.append(offsets.next(b"" if skipped else self.tokenizer.token_bytes(info.token)))
        return out

    def chat_logprobs(self, tokens: list[TokenInfo]) -> p.ChatLogprobs:
        def entry(token: int, logprob: float) -> p.TopLogprob:
            return p.TopLogprob(token=self.token_text(token), logprob=logprob,
                                bytes=list(self.tokenizer.token_bytes(token)))

        content = [
            p.ChatTokenLogprob(**entry(i.token, i.logprob or 0.0).model_dump(),
                               top_logprobs=[entry(t, lp) for t, lp in i.top])
            for i in tokens
        ]
        return p.ChatLogprobs(content=content)


class TextOffsets:
    """The ``text_offset`` of a choice's tokens: the characters of text completed before each one, counted from the
    tokens' bytes (a token that ends inside a character completes none of it). A streamed response gets the same
    offsets as a whole one, whatever its stop strings hold back."""

    def __init__(self, start: int) -> None:
        self.at = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token_bytes: bytes) -> int:
        """The offset of a token with these bytes, after every token before it."""
        at = self.at
        self.at += len(self._utf8.decode(token_bytes))
        return at


async def _merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Deltas of several choices as they come; closing it closes (and so aborts) every choice."""
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                yield delta
                if delta.finish_reason is None:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with suppress(BaseException):
                await task
        for stream in streams:
            with suppress(BaseException):
                await stream.aclose()


def _with_seed(sampling: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(sampling, seed=seed)


def _status(exc: BaseException) -> BaseException:
    """The HTTP error for a request that failed before its first token."""
    if isinstance(exc, RequestRejected):
        return bad_request(str(exc), "max_tokens")
    if isinstance(exc, QueueFull):
        return unavailable(str(exc), exc.retry_after_s)
    if isinstance(exc, EngineUnavailable):
        return unavailable(str(exc))
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), "server_error")
    return exc


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else (reason if reason in ("length", "abort") else "stop")


async def _unless_disconnected(request: Request, work: Awaitable):
    """Runs `work` until done, or cancels it when the client hangs up first (its requests are aborted)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with suppress(BaseException):
            await task
        return None
    finally:
        watch.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- OpenAPI ---------------------------------------------------------------------------------------------
def _errors(*codes: int) -> dict:
    text = {400: "invalid request (the error's param names the field)", 401: "missing or invalid API key",
            404: "unknown model", 413: "request body too large", 500: "this request failed inside the engine",
            503: "busy (queue full) or shutting down: retry after Retry-After seconds"}
    out: dict = {}
    for code in codes:
        out[code] = {"model": p.ErrorResponse, "description": text[code]}
        if code == 503:
            out[code]["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                                    "schema": {"type": "integer"}}}
    return out


def _streamed(model: type, chunk: type) -> dict:
    """A 200 that is ``model``, or with stream=true server-sent events. OpenAPI 3.1's ``schema`` of an event stream
    describes one event (schemathesis checks each): its ``data`` is a ``chunk`` or an ``ErrorResponse`` as JSON, or
    ``[DONE]``. The chunk's schema joins the document's components (:func:`_openapi`)."""
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json",
                       "contentSchema": {"anyOf": [{"$ref": f"{_COMPONENTS}{chunk.__name__}"},
                                                   {"$ref": f"{_COMPONENTS}{p.ErrorResponse.__name__}"}]}}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    assert chunk in _CHUNKS, f"add {chunk.__name__} to _CHUNKS"
    return {200: {"model": model, "description": f"a {model.__name__}, or with stream=true server-sent events: "
                                                 f"`data: <{chunk.__name__}>` lines, an error event on failure, "
                                                 "then `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": event}}}}


_COMPONENTS = "#/components/schemas/"
_CHUNKS = (p.ChatCompletionChunk, p.CompletionResponse)  # the streamed chunks' models, in the document's components


def _openapi(app: FastAPI) -> Callable[[], dict]:
    """FastAPI documents 422 for validation errors; this server sends them as 400 (documented per route)."""

    def build() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            _, defs = models_json_schema([(m, "serialization") for m in _CHUNKS],
                                         ref_template=_COMPONENTS + "{model}")
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(name, definition)
            app.openapi_schema = schema
        return app.openapi_schema

    return build


def max_len_of(llm) -> int:
    """The longest sequence (prompt + output) the engine accepts (`Engine.longest_servable`: the context, and what
    the KV pools and the policy hold of one request alone)."""
    return llm.engine.longest_servable()


def build_app(llm, model_name: str, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              watchdog_s: float = DEFAULT_WATCHDOG_S) -> FastAPI:
    """The API of one engine in this process."""
    return serve_app(OpenAIServer.local(llm, model_name, watchdog_s), api_key=api_key, max_body_bytes=max_body_bytes)


def serve_app(server: OpenAIServer, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The API over `server` (one process's engine, or a cluster's replicas): lifecycle (the engine loop runs
    while the app does), middleware, then the routes by group."""
    app = FastAPI(title="orbitflow", version="0.1.0", lifespan=_lifespan(server),
                  description="OpenAI-compatible API of orbitflow, an SLO-aware long-context LLM server.")
    app.openapi = _openapi(app)
    app.state.server = server
    install_error_handlers(app)
    _add_middleware(app, server, api_key, max_body_bytes)
    auth = (401,) if api_key else ()
    _add_service_routes(app, server, auth)
    _add_token_routes(app, server, auth)
    generation_errors = _errors(400, *auth, 404, 413, 500, 503)
    _add_completion_routes(app, server, generation_errors)
    _add_chat_routes(app, server, generation_errors)
    return app


def _lifespan(server: OpenAIServer):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        await asyncio.to_thread(server.engine.shutdown)

    return lifespan


class TokenIdCap:
    """Sets ``protocol.token_id_cap`` for the requests of one server: the longest token-id list its bodies may hold
    (a 128k context's worth, or its model's context where longer)."""

    def __init__(self, app, cap: int) -> None:
        self.app, self.cap = app, cap

    async def __call__(self, scope, receive, send) -> None:
        token = p.token_id_cap.set(self.cap)
        try:
            await self.app(scope, receive, send)
        finally:
            p.token_id_cap.reset(token)


def _add_middleware(app: FastAPI, server: OpenAIServer, api_key: str | None, max_body_bytes: int) -> None:
    app.add_middleware(TokenIdCap, cap=max(p.MAX_TOKEN_IDS, server.max_len))
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)


def _add_service_routes(app: FastAPI, server: OpenAIServer, auth: tuple[int, ...]) -> None:
    """/health, /metrics and /v1/models."""
    @app.get("/health", response_model=p.HealthResponse,
             responses={503: {"model": p.HealthResponse,
                              "description": "the engine is not running, or its loop is stuck with work pending"}})
    async def health() -> Response:
        if not server.engine.running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        if server.engine.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        failure = getattr(getattr(server.llm, "executor", None), "failure", None)  # a TP rank died or hung
        if failure is not None:
            return JSONResponse({"status": f"executor failed: {failure}"}, status_code=503)
        stuck = server.engine.stalled(server.watchdog_s)
        if stuck is not None:
            return JSONResponse({"status": f"engine stalled: its loop has not advanced for {stuck:.0f} s "
                                           "while requests are pending"}, status_code=503)
        return JSONResponse({"status": "ok"})

    exposition = {"description": "Prometheus text exposition",
                  "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}

    @app.get("/metrics", response_class=Response, responses={**_errors(*auth), 200: exposition})
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> p.ModelCard:
        return p.ModelCard(id=server.model_name, created=server.created, owned_by="orbitflow",
                           max_model_len=server.max_len)

    @app.get("/v1/models", response_model=p.ModelList, responses=_errors(*auth))
    async def models() -> p.ModelList:
        return p.ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", response_model=p.ModelCard, responses=_errors(*auth, 404))
    async def model(model: str) -> p.ModelCard:  # the openai client's models.retrieve(name)
        server.check_model(model)
        return card()


def _add_token_routes(app: FastAPI, server: OpenAIServer, auth: tuple[int, ...]) -> None:
    """/tokenize and /detokenize."""
    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=_errors(400, *auth, 404, 413))
    async def tokenize(req: p.TokenizeRequest) -> p.TokenizeResponse:
        server.check_model(req.model)
        if req.messages is not None:
            ids = await server.chat_prompt_ids(req.messages, req.add_generation_prompt)
        else:
            ids = await asyncio.to_thread(server.encode_text, req.prompt, "prompt", req.add_special_tokens)
        return p.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=server.max_len)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=_errors(400, *auth, 404, 413))
    async def detokenize(req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        server.check_model(req.model)
        server.check_token_ids(req.tokens, "tokens")
        return p.DetokenizeResponse(prompt=server.tokenizer.decode(req.tokens))


def _add_completion_routes(app: FastAPI, server: OpenAIServer, generation_errors: dict) -> None:
    """/v1/completions."""
    model_name = server.model_name

    @app.post("/v1/completions", response_model=p.CompletionResponse,
              responses={**generation_errors, **_streamed(p.CompletionResponse, p.CompletionResponse)})
    async def completions(req: p.CompletionRequest, request: Request) -> Response:
        server.check_model(req.model)
        prompt_ids = await server.prompt_ids(req.prompt)
        sampling = server.sampling(req, prompt_ids, req.max_tokens, req.logprobs)
        request_id, deltas = server.choices("cmpl", prompt_ids, sampling, req.n, req.stop_strings)
        created = int(time.time())
        echo = (req.prompt if isinstance(req.prompt, str) else server.tokenizer.decode(prompt_ids)) if req.echo else ""

        def body(choices: list[p.CompletionChoice], usage: p.Usage | None) -> p.CompletionResponse:
            return p.CompletionResponse(id=request_id, created=created, model=model_name, choices=choices,
                                        usage=usage)

        if not req.stream:
            per_choice = await _unless_disconnected(request, server.collect(deltas, req.n))
            if per_choice is None:
                return Response(status_code=499)  # the client is gone; nobody reads this
            choices = []
            for i, ds in enumerate(per_choice):
                text = "".join(d.text for d in ds)
                logprobs = (server.completion_logprobs([t for d in ds for t in d.tokens], TextOffsets(len(echo)))
                            if req.logprobs is not None else None)
                choices.append(p.CompletionChoice(index=i, text=echo + text, logprobs=logprobs,
                                                  finish_reason=_finish_reason(ds[-1].finish_reason)))
            used = sum(ds[-1].completion_tokens for ds in per_choice)
            return JSONResponse(body(choices, server.usage(len(prompt_ids), used)).model_dump(mode="json"))

        offsets = [TextOffsets(len(echo)) for _ in range(req.n)]

        def chunks(d: Delta) -> list[dict]:
            logprobs = None
            if req.logprobs is not None:
                logprobs = server.completion_logprobs(d.tokens, offsets[d.index])
            choice = p.CompletionChoice(index=d.index, text=d.text, logprobs=logprobs,
                                        finish_reason=_finish_reason(d.finish_reason))
            return [body([choice], None).model_dump(mode="json")]

        first = await _first_or_disconnect(server, request, deltas)
        preamble = ([body([p.CompletionChoice(index=i, text=echo)], None).model_dump(mode="json")
                     for i in range(req.n)] if echo else [])
        usage_chunk = ((lambda used: body([], server.usage(len(prompt_ids), used)).model_dump(mode="json"))
                       if req.include_usage else None)
        return _stream(server.sse(first, deltas, chunks, usage_chunk, preamble))


def _add_chat_routes(app: FastAPI, server: OpenAIServer, generation_errors: dict) -> None:
    """/v1/chat/completions."""

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse,
              responses={**generation_errors, **_streamed(p.ChatCompletionResponse, p.ChatCompletionChunk)})
    async def chat_completions(req: p.ChatCompletionRequest, request: Request) -> Response:
        server.check_model(req.model)
        prompt_ids = await server.chat_prompt_ids(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        sampling = server.sampling(req, prompt_ids, req.token_limit, logprobs)
        request_id, deltas = server.choices("chatcmpl", prompt_ids, sampling, req.n, req.stop_strings)
        created = int(time.time())

        if not req.stream:
            per_choice = await _unless_disconnected(request, server.collect(deltas, req.n))
            if per_choice is None:
                return Response(status_code=499)
            choices = [
                p.ChatChoice(index=i, message=p.AssistantMessage(content="".join(d.text for d in ds)),
                             logprobs=server.chat_logprobs([t for d in ds for t in d.tokens]) if req.logprobs else None,
                             finish_reason=_finish_reason(ds[-1].finish_reason))
                for i, ds in enumerate(per_choice)
            ]
            used = sum(ds[-1].completion_tokens for ds in per_choice)
            response = p.ChatCompletionResponse(id=request_id, created=created, model=server.model_name,
                                                choices=choices, usage=server.usage(len(prompt_ids), used))
            return JSONResponse(response.model_dump(mode="json"))

        def chunk(choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> dict:
            out = p.ChatCompletionChunk(id=request_id, created=created, model=server.model_name, choices=choices,
                                        usage=usage).model_dump(mode="json")
            for choice in out["choices"]:  # as OpenAI's: a delta names only what it carries ({} at the finish)
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return out

        def chunks(d: Delta) -> list[dict]:
            delta = p.ChatDelta(content=d.text) if d.text or d.finish_reason is None else p.ChatDelta()
            logprobs = server.chat_logprobs(d.tokens) if req.logprobs else None
            return [chunk([p.ChatChunkChoice(index=d.index, delta=delta, logprobs=logprobs,
                                             finish_reason=_finish_reason(d.finish_reason))])]

        first = await _first_or_disconnect(server, request, deltas)
        preamble = [chunk([p.ChatChunkChoice(index=i, delta=p.ChatDelta(role="assistant", content=""))])
                    for i in range(req.n)]
        usage_chunk = ((lambda used: chunk([], server.usage(len(prompt_ids), used))) if req.include_usage else None)
        return _stream(server.sse(first, deltas, chunks, usage_chunk, preamble))


async def _first_or_disconnect(server: OpenAIServer, request: Request, deltas: AsyncIterator[Delta]) -> Delta:
    """The first delta of a streamed request (its errors become statuses); a hang-up before it aborts."""
    first = await _unless_disconnected(request, server.first_delta(deltas))
    if first is None:
        await deltas.aclose()
        raise APIError(499, "client disconnected")
    return first


class _EventStream(StreamingResponse):
    """Closes its event generator however the response ends, so a disconnect aborts the request at once
    rather than whenever the abandoned generator is garbage-collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _stream(events: AsyncIterator[str]) -> StreamingResponse:
    return _EventStream(events, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
