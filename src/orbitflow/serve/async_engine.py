"""Bridge between the single-threaded engine loop and asyncio request handlers.

The engine steps on a thread of its own; its TokenEvents are handed to the event loop and queued per
request. `generate` releases each token to its consumer no earlier than the token's Token-Deposit due
time, except that a finish event releases everything still held at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from orbitflow.model.tokenizer import IncrementalDecoder
from orbitflow.runtime.engine import Engine, TokenEvent
from orbitflow.runtime.sampling import SamplingParams

log = logging.getLogger("orbitflow.serve")

_IDLE_WAIT_S = 0.05  # how long the engine thread sleeps between checks for work or shutdown


class EngineError(RuntimeError):
    """The engine ended a request with an error (a failed step, out of memory, ...)."""


@dataclass
class GenerationOutput:
    token_id: int | None  # None on the final item, which only carries the finish reason and held-back text
    text_delta: str
    finish_reason: str | None  # "stop" | "length" on the final item


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
        engine.listeners.append(self._on_event)

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

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
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
        self, request_id: str, prompt_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[GenerationOutput]:
        """Tokens as they become due, then one final item with the finish reason.

        Raises RequestRejected (before anything is yielded) when the request can never be served, and
        EngineError when the engine ends it with an error. Closing or cancelling the iterator early aborts
        the request in the engine.
        """
        if not self.running:
            raise EngineError("the engine is not running")
        stream = _Stream()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            self.engine.add_request(request_id, prompt_ids, sampling)
            decoder = IncrementalDecoder(self.tokenizer)
            clock = self.engine.clock
            held: deque[TokenEvent] = deque()
            while True:
                final = None
                while stream.events:
                    event = stream.events.popleft()
                    if event.finished:
                        final = event
                    else:
                        held.append(event)
                if final is not None:
                    finished = True
                    for event in held:  # finish flushes the deposit: everything left goes now
                        yield GenerationOutput(event.token, decoder.push(event.token), None)
                    if final.finish_reason == "error":
                        raise EngineError(final.error or "the engine failed this request")
                    yield GenerationOutput(None, decoder.flush(), final.finish_reason)
                    return
                if held and held[0].due_s <= clock.now():
                    event = held.popleft()
                    yield GenerationOutput(event.token, decoder.push(event.token), None)
                    continue
                stream.wakeup.clear()
                delay = held[0].due_s - clock.now() if held else None
                try:
                    await asyncio.wait_for(stream.wakeup.wait(), delay)
                except TimeoutError:
                    pass  # the oldest held token is due
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)  # disconnect, cancellation or rejection: free its blocks
