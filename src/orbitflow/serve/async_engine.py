"""Bridge between the single-threaded engine loop and asyncio request handlers.

The engine steps on a thread of its own; its TokenEvents are handed to the event loop and queued per
request. `generate` releases each token to its consumer no earlier than the token's Token-Deposit due
time, except that a finish event releases everything still held at once. Each token is detokenized and its
request's stop strings are applied as it is generated, not as it is delivered: the engine stops the request at
once (finish reason "stop") rather than decoding on for as long as the deposit holds tokens back, and the held
tokens before the stop then go out with the finish, as at an end-of-sequence token.

The engine thread beats a heartbeat every loop iteration; `stalled` says when it has not beaten for a while
although work is pending (the /health watchdog). `drain` stops taking requests and aborts what is still in
flight when its grace period ends (graceful shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from orbitflow.model.tokenizer import IncrementalDecoder
from orbitflow.runtime.engine import Engine, TokenEvent
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.serve.stop import StopStringFilter

log = logging.getLogger("orbitflow.serve")

_IDLE_WAIT_S = 0.05  # how long the engine thread sleeps between checks for work or shutdown
SERVED_FINISHED_KEPT = 256  # finished requests the engine keeps for inspection while serving (it reads none of them)


class EngineError(RuntimeError):
    """The engine ended a request with an error (a failed step, out of memory, ...)."""


class EngineUnavailable(RuntimeError):
    """The engine is not taking requests (not running, or shutting down): retry elsewhere or later."""


@dataclass
class GenerationOutput:
    token_id: int | None  # None on the final item, which only carries the finish reason and held-back text
    text_delta: str
    finish_reason: str | None  # "stop" | "length" | "abort" on the final item
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    slo_s: float | None = None  # on a token: the TBT SLO the engine that made it paces the request for


@dataclass
class _Stream:
    """A request's events, filled on the event loop (never from the engine thread directly)."""

    events: deque[TokenEvent] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, event: TokenEvent) -> None:
        self.events.append(event)
        self.wakeup.set()


class AsyncEngine:
    def __init__(self, engine: Engine, tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Stream]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._heartbeat = time.monotonic()  # last time the engine loop went round
        self.draining = False
        engine.listeners.append(self._on_event)
        engine.keep_finished(SERVED_FINISHED_KEPT)

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="orbitflow-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread; requests still in flight are aborted and their blocks freed."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._thread = None
        if self._on_event in self.engine.listeners:
            self.engine.listeners.remove(self._on_event)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stalled(self, after_s: float) -> float | None:
        """Seconds since the engine last made progress, when that is over `after_s` with work pending. Progress is a
        turn of the loop or a layer of the step it is in (``executor.progress_at``): a prefill of tens of thousands
        of tokens can take minutes on a CPU, layer by layer, and is busy, not stalled."""
        last = max(self._heartbeat, getattr(self.engine.executor, "progress_at", 0.0))
        idle = time.monotonic() - last
        return idle if idle > after_s and self.engine.has_work() else None

    def drain(self, grace_s: float) -> None:
        """Stop taking requests; abort the ones still in flight once `grace_s` has passed."""
        if self.draining:
            return
        self.draining = True
        timer = threading.Timer(grace_s, self.abort_all)
        timer.daemon = True
        timer.start()

    def abort_all(self) -> None:
        with self._lock:
            in_flight = list(self._streams)
        for request_id in in_flight:
            self.engine.abort(request_id)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._heartbeat = time.monotonic()
            if not engine.has_work():
                engine.wait_for_work(_IDLE_WAIT_S)
                continue
            try:
                engine.step()
            except Exception:  # a bug below the engine's own error handling: fail what is in flight, go on
                log.exception("engine step raised; aborting the requests in flight")
                self._fail_all("internal engine error (see the server log)")
        with self._lock:
            in_flight = list(self._streams)
        for request_id in in_flight:
            engine.abort(request_id)
        try:
            engine.step()  # drains the aborts, so every block goes back to its pool
        except Exception:
            log.exception("engine step raised during shutdown")

    def _fail_all(self, message: str) -> None:
        """End every request in flight with an error. A stream is known just before its request enters the engine's
        inbox, so the abort sent here may reach the engine first (and be ignored): the stream aborts its request
        again once the error reaches it (`generate`; the engine ignores a request it has already ended)."""
        now = self.engine.clock.now()
        with self._lock:
            in_flight = list(self._streams)
        for request_id in in_flight:
            self.engine.abort(request_id)
            self._on_event(TokenEvent(request_id, None, now, now, finished=True, finish_reason="error",
                                      error=message))

    # ---- events: engine thread -> event loop ---------------------------------------------------------
    def _on_event(self, event: TokenEvent) -> None:
        with self._lock:
            entry = self._streams.get(event.request_id)
        if entry is None:
            return  # not ours (e.g. offline generate) or already gone
        loop, stream = entry
        try:
            loop.call_soon_threadsafe(stream.push, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---- requests ------------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, stop: Sequence[str] = ()
    ) -> AsyncIterator[GenerationOutput]:
        """Tokens as they become due, then one final item with the finish reason. ``stop``: the request's stop
        strings. The text ends before the first one (text that could begin one is held back until it cannot), and
        the token that completes it is the last generated and delivered (finish reason "stop").

        Raises RequestRejected (before anything is yielded) when the request can never be served, and
        EngineError when the engine ends it with an error. Closing or cancelling the iterator early aborts
        the request in the engine.
        """
        if self.draining:
            raise EngineUnavailable("the server is shutting down")
        if not self.running:
            raise EngineUnavailable("the engine is not running")
        stream = _Stream()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            self.engine.add_request(request_id, prompt_ids, sampling)
            text = _Text(self.tokenizer, stop)
            clock = self.engine.clock
            held: deque[tuple[TokenEvent, str]] = deque()  # generated, not yet due: with their text
            while True:
                final = None
                while stream.events:
                    event = stream.events.popleft()
                    if event.finished:
                        final = event
                    elif not text.stopped:
                        held.append((event, text.push(event.token)))
                        if text.stopped:  # its text is complete: the engine ends it (tokens it makes meanwhile go)
                            self.engine.finish(request_id, "stop")
                if final is not None or text.stopped:
                    finished = final is None or final.finish_reason != "error"  # else abort again: `_fail_all`
                    for event, piece in held:  # finish flushes the deposit: everything left goes now
                        yield _output(event, piece)
                    if final is not None and final.finish_reason == "error" and not text.stopped:
                        raise EngineError(final.error or "the engine failed this request")
                    tail = text.flush()
                    yield GenerationOutput(None, tail, "stop" if text.stopped else final.finish_reason)
                    return
                if held and held[0][0].due_s <= clock.now():
                    yield _output(*held.popleft())
                    continue
                stream.wakeup.clear()
                delay = held[0][0].due_s - clock.now() if held else None
                try:
                    await asyncio.wait_for(stream.wakeup.wait(), delay)
                except TimeoutError:
                    pass  # the oldest held token is due
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)  # disconnect, cancellation, rejection or error: free its blocks


class _Text:
    """A request's text as it is generated: detokenized token by token, its stop strings applied."""

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopStringFilter(list(stop))

    @property
    def stopped(self) -> bool:
        """A stop string has been generated: the text is complete."""
        return self.stops.stopped

    def push(self, token: int) -> str:
        """The text `token` releases."""
        return _alone("applying stop strings", self.stops.push, _alone("detokenizing", self.decoder.push, token))

    def flush(self) -> str:
        """What is still held back once the request ends."""
        if self.stopped:
            return ""
        tail = _alone("applying stop strings", self.stops.push, _alone("detokenizing", self.decoder.flush))
        return tail + _alone("applying stop strings", self.stops.flush)


def _output(event: TokenEvent, text: str) -> GenerationOutput:
    return GenerationOutput(event.token, text, None, event.logprob, event.top_logprobs, event.slo_s)


def _alone(action: str, fn, *args) -> str:
    """`fn(*args)`; a failure (of the detokenizer, of the stop strings) ends this request alone (the caller's `finally`
    aborts it in the engine)."""
    try:
        return fn(*args)
    except Exception as exc:
        raise EngineError(f"{action} failed: {type(exc).__name__}: {exc}") from exc
