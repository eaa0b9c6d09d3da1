"""OpenAI-compatible HTTP API over an LLM: completions, chat completions, models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from orbitflow.runtime.engine import RequestRejected
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.serve.async_engine import AsyncEngine, EngineError
from orbitflow.serve.auth import APIKeyMiddleware
from orbitflow.serve.errors import APIError, bad_request, install_error_handlers
from orbitflow.serve.metrics import ServerMetrics
from orbitflow.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from orbitflow.serve.stop import StopStringFilter


@dataclass
class Delta:
    text: str
    finish_reason: str | None
    completion_tokens: int


class OpenAIServer:
    """What the routes share: the engine bridge, the tokenizer, the limits and the metrics."""

    def __init__(self, llm, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = llm.tokenizer
        self.engine = AsyncEngine(llm.engine, llm.tokenizer)
        self.metrics = ServerMetrics(llm.engine)
        self.created = int(time.time())
        engine = llm.engine
        kv = engine.kv
        # The longest sequence (prompt + output) the engine accepts: the context, and the KV both tiers hold.
        kv_blocks = kv.device_pool.num_blocks + kv.host_pool.num_blocks
        kv_tokens = kv_blocks // engine.num_layers * engine.block_size
        self.max_len = min(engine.max_model_len or kv_tokens, kv_tokens)
        self.vocab_size = llm.loaded.config.vocab_size

    # ---- request preparation ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(
                    f"prompt: token id {bad[0]} is not in the vocabulary (size {self.vocab_size})", "prompt")
            ids = list(prompt)
        if not ids:
            raise bad_request("prompt: the prompt encodes to no tokens", "prompt")
        return ids

    def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:  # no template, or the template refuses these messages
            raise bad_request(f"messages: cannot apply the chat template: {exc}", "messages") from exc

    def sampling(self, req: SamplingFields, prompt_ids: list[int], max_tokens: int | None) -> SamplingParams:
        room = self.max_len - len(prompt_ids)
        if room < 1:
            raise bad_request(f"prompt: {len(prompt_ids)} tokens leave no room for output in this server's "
                              f"context of {self.max_len} tokens", "prompt")
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise bad_request(f"max_tokens: prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) "
                              f"exceeds this server's context of {self.max_len} tokens", "max_tokens")
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, seed=req.seed, ignore_eos=req.ignore_eos)

    # ---- generation ------------------------------------------------------------------------------------
    async def deltas(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     stop: list[str]) -> AsyncIterator[Delta]:
        """Non-empty text deltas, the last one with the finish reason; stop strings applied."""
        clock = self.llm.clock
        tracker = self.metrics.tracker(clock.now(), len(prompt_ids))
        stops = StopStringFilter(stop)
        reason: str | None = "abort"
        try:
            async with aclosing(self.engine.generate(request_id, prompt_ids, sampling)) as outputs:
                async for out in outputs:
                    if out.token_id is not None:
                        tracker.on_token(clock.now())
                    text = stops.push(out.text_delta)
                    if stops.stopped:
                        reason = "stop"
                        yield Delta(text, reason, tracker.num_tokens)
                        return
                    if out.finish_reason is not None:
                        reason = out.finish_reason
                        yield Delta(text + stops.flush(), reason, tracker.num_tokens)
                        return
                    if text:
                        yield Delta(text, None, tracker.num_tokens)
        except RequestRejected:
            reason = None
            raise
        except EngineError:
            reason = "error"
            raise
        finally:
            if reason is not None:
                tracker.on_finish(reason)

    async def first_delta(self, deltas: AsyncIterator[Delta]) -> Delta:
        """Awaits the first delta, so that a request failing before any token gets a proper status."""
        try:
            return await anext(deltas)
        except RequestRejected as exc:
            await deltas.aclose()
            raise bad_request(str(exc), "max_tokens") from exc
        except EngineError as exc:
            await deltas.aclose()
            raise APIError(500, str(exc), "server_error") from exc

    async def collect(self, deltas: AsyncIterator[Delta]) -> tuple[str, Delta]:
        first = await self.first_delta(deltas)
        parts, last = [first.text], first
        try:
            async with aclosing(deltas):
                while last.finish_reason is None:
                    last = await anext(deltas)
                    parts.append(last.text)
        except EngineError as exc:
            raise APIError(500, str(exc), "server_error") from exc
        return "".join(parts), last

    async def sse(
        self,
        first: Delta,
        deltas: AsyncIterator[Delta],
        chunk: Callable[[Delta], dict],
        usage_chunk: Callable[[Delta], dict] | None,
        preamble: dict | None = None,
    ) -> AsyncIterator[str]:
        try:
            async with aclosing(deltas):
                if preamble is not None:
                    yield _sse(preamble)
                delta = first
                while True:
                    yield _sse(chunk(delta))
                    if delta.finish_reason is not None:
                        break
                    delta = await anext(deltas)
            if usage_chunk is not None:
                yield _sse(usage_chunk(delta))
        except EngineError as exc:
            yield _sse(APIError(500, str(exc), "server_error").body())
        yield "data: [DONE]\n\n"

    def usage(self, num_prompt: int, delta: Delta) -> dict:
        return {"prompt_tokens": num_prompt, "completion_tokens": delta.completion_tokens,
                "total_tokens": num_prompt + delta.completion_tokens}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("length" if reason == "length" else "stop")


def build_app(llm, model_name: str, api_key: str | None = None) -> FastAPI:
    server = OpenAIServer(llm, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        await asyncio.to_thread(server.engine.shutdown)

    app = FastAPI(title="orbitflow", lifespan=lifespan)
    app.state.server = server
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if not server.engine.running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": server.created, "owned_by": "orbitflow",
            "max_model_len": server.max_len,
        }]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Response:
        server.check_model(req.model)
        prompt_ids = server.prompt_ids(req.prompt)
        sampling = server.sampling(req, prompt_ids, req.max_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        deltas = server.deltas(request_id, prompt_ids, sampling, req.stop_strings)

        def body(choices: list[dict], usage: dict | None) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created, "model": model_name,
                    "choices": choices, "usage": usage}

        def choice(text: str, reason: str | None) -> dict:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": _finish_reason(reason)}

        if not req.stream:
            text, last = await server.collect(deltas)
            return JSONResponse(body([choice(text, last.finish_reason)], server.usage(len(prompt_ids), last)))
        first = await server.first_delta(deltas)
        usage_chunk = (lambda d: body([], server.usage(len(prompt_ids), d))) if req.include_usage else None
        return _stream(server.sse(first, deltas, lambda d: body([choice(d.text, d.finish_reason)], None),
                                  usage_chunk))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        server.check_model(req.model)
        prompt_ids = server.chat_prompt_ids(req)
        sampling = server.sampling(req, prompt_ids, req.token_limit)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        deltas = server.deltas(request_id, prompt_ids, sampling, req.stop_strings)

        def body(obj: str, choices: list[dict], usage: dict | None) -> dict:
            return {"id": request_id, "object": obj, "created": created, "model": model_name,
                    "choices": choices, "usage": usage}

        if not req.stream:
            text, last = await server.collect(deltas)
            message = {"role": "assistant", "content": text}
            choices = [{"index": 0, "message": message, "logprobs": None,
                        "finish_reason": _finish_reason(last.finish_reason)}]
            return JSONResponse(body("chat.completion", choices, server.usage(len(prompt_ids), last)))

        def chunk(d: Delta) -> dict:
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": _finish_reason(d.finish_reason)}
            return body("chat.completion.chunk", [choice], None)

        first = await server.first_delta(deltas)
        preamble = body("chat.completion.chunk", [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}], None)
        usage_chunk = ((lambda d: body("chat.completion.chunk", [], server.usage(len(prompt_ids), d)))
                       if req.include_usage else None)
        return _stream(server.sse(first, deltas, chunk, usage_chunk, preamble))

    return app


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
