"""AsyncEngine against a scripted fake engine: Token-Deposit pacing, finish flush, abort on cancel."""

import asyncio
import threading
import time

import pytest

from orbitflow.runtime.engine import TokenEvent
from orbitflow.runtime.sampling import SamplingParams
from orbitflow.serve.async_engine import AsyncEngine, EngineError
from orbitflow.serve.stop import StopStringFilter


class LetterTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


class Clock:
    def now(self) -> float:
        return time.perf_counter()


class ScriptedEngine:
    """Emits a fixed script of (delay_s, TokenEvent factory) from its own thread when a request is added."""

    def __init__(self, script):
        self.script = script
        self.clock = Clock()
        self.listeners = []
        self.aborted: list[str] = []
        self.finished: list[tuple] = []  # finish(request_id, reason) calls, with when

    def has_work(self) -> bool:
        return False

    def wait_for_work(self, timeout=None) -> None:
        time.sleep(timeout or 0.01)

    def step(self) -> None:
        pass

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def finish(self, request_id: str, reason: str) -> None:
        self.finished.append((request_id, reason, time.perf_counter()))

    def keep_finished(self, count: int) -> None:
        self.kept = count  # its own `finished` is the test's record of finish() calls, not the engine's

    def add_request(self, request_id, prompt_ids, sampling):
        start = self.clock.now()

        def play():
            for delay, make in self.script:
                time.sleep(delay)
                for listener in self.listeners:
                    listener(make(request_id, start))

        threading.Thread(target=play, daemon=True).start()


def token(i: int, due_after: float):
    return lambda rid, start: TokenEvent(rid, i, time.perf_counter(), start + due_after, slo_s=0.05)


def finish(reason="length", error=None):
    def make(rid, start):
        now = time.perf_counter()
        return TokenEvent(rid, None, now, now, finished=True, finish_reason=reason, error=error)
    return make


async def consume(engine: AsyncEngine, limit: int | None = None):
    out = []
    gen = engine.generate("r1", [1], SamplingParams())
    async for item in gen:
        out.append((time.perf_counter(), item))
        if limit is not None and len(out) == limit:
            await gen.aclose()
            break
    return out


@pytest.fixture
def run():
    engines = []

    def _run(script, limit=None):
        fake = ScriptedEngine(script)
        engine = AsyncEngine(fake, LetterTokenizer())
        engines.append(engine)
        engine.start()
        start = time.perf_counter()
        return fake, start, asyncio.run(consume(engine, limit))

    yield _run
    for engine in engines:
        engine.shutdown()


def test_tokens_wait_for_their_due_time_and_finish_flushes(run):
    # Three tokens generated at once, due at +0.15, +1.2, +1.5; the request finishes at +0.35 (the due times lie far
    # past the finish, so a loaded machine's late wake-ups cannot pass for a release at the due time).
    script = [(0.0, token(0, 0.15)), (0.0, token(1, 1.2)), (0.0, token(2, 1.5)), (0.35, finish())]
    fake, start, out = run(script)
    times = [t - start for t, _ in out]
    assert [item.text_delta for _, item in out] == ["a", "b", "c", ""]
    assert [item.finish_reason for _, item in out] == [None, None, None, "length"]
    assert [item.slo_s for _, item in out] == [0.05, 0.05, 0.05, None]  # the request's SLO, for the server's stopwatch
    assert times[0] >= 0.15  # held until due
    assert 0.3 <= times[1] < 1.1 and times[2] < 1.1  # released by the finish, before their due time
    assert fake.aborted == []


def test_closing_the_stream_aborts_the_request(run):
    script = [(0.0, token(0, 0.0)), (0.05, token(1, 0.05)), (5.0, finish())]
    fake, _, out = run(script, limit=1)
    assert len(out) == 1 and fake.aborted == ["r1"]


def test_engine_error_raises(run):
    with pytest.raises(EngineError, match="boom"):
        run([(0.0, token(0, 0.0)), (0.01, finish("error", "boom"))])


def test_a_stop_string_stops_the_engine_when_generated_not_when_delivered():
    """Token-Deposit holds tokens back; a stop string is looked for as the text is generated, so the engine stops the
    request at once (reason "stop") instead of decoding on until the stop string's due time, and tokens generated
    after it are never delivered; those before it go out with the stop, as at an end-of-sequence token. Tokens
    'a b c d e' are generated at once, due 0.2 s apart; 'bc' is the stop."""
    script = [(0.0, token(i, 0.2 * (i + 1))) for i in range(5)] + [(0.5, finish("stop"))]
    fake = ScriptedEngine(script)
    engine = AsyncEngine(fake, LetterTokenizer())
    engine.start()
    try:
        start = time.perf_counter()

        async def collect():
            return [item async for item in engine.generate("r1", [1], SamplingParams(), stop=["bc"])]

        out = asyncio.run(collect())
    finally:
        engine.shutdown()
    assert [(rid, reason) for rid, reason, _ in fake.finished] == [("r1", "stop")]
    # as soon as 'c' was generated (~0 s), not at its due time (0.6 s) nor at the script's own finish (0.5 s)
    assert fake.finished[0][2] - start < 0.45
    # the text ends before the stop string ('b' is held back until 'c' shows it is one); its tokens are delivered
    assert "".join(item.text_delta for item in out) == "a" and out[-1].finish_reason == "stop"
    assert [item.token_id for item in out] == [0, 1, 2, None] and fake.aborted == []


def test_stop_string_filter_holds_back_and_truncates():
    f = StopStringFilter(["STOP"])
    out = [f.push(piece) for piece in ["hello S", "T", "OP and more"]]
    assert "".join(out) == "hello " and f.stopped
    g = StopStringFilter(["STOP"])
    assert "".join([g.push("ST"), g.push("ay"), g.flush()]) == "STay" and not g.stopped


class BrokenTokenizer(LetterTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        if 13 in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return super().decode(ids)


def test_a_detokenizer_failure_ends_that_request_alone():
    fake = ScriptedEngine([(0.0, token(0, 0.0)), (0.01, token(13, 0.0)), (5.0, finish())])
    engine = AsyncEngine(fake, BrokenTokenizer())
    engine.start()
    try:
        with pytest.raises(EngineError, match="detokenizing failed"):
            asyncio.run(consume(engine))
        assert fake.aborted == ["r1"]  # the engine is told at once, so its blocks go back
        assert engine.running  # and the loop goes on for everyone else
    finally:
        engine.shutdown()


def test_a_request_failed_by_the_server_while_entering_the_engine_is_aborted_after_it():
    """`_fail_all` (a step that raised below the engine's own handling) aborts every stream it knows, and a stream
    is known just before its request enters the engine's inbox: that abort can go first, and the engine ignores an
    abort of a request it does not have yet. The request then ran to its max_tokens with nobody listening; now its
    stream aborts it again once the error reached it."""
    log: list[tuple[str, str]] = []

    class RacingEngine(ScriptedEngine):
        def abort(self, request_id):
            log.append(("abort", request_id))

        def add_request(self, request_id, prompt_ids, sampling):
            engine._fail_all("injected")  # on the engine thread, between the stream's registration and this add
            log.append(("add", request_id))

    fake = RacingEngine([])
    engine = AsyncEngine(fake, LetterTokenizer())
    engine.start()
    try:
        with pytest.raises(EngineError, match="injected"):
            asyncio.run(consume(engine))
        assert log[0] == ("abort", "r1") and log.index(("add", "r1")) < len(log) - 1 and log[-1] == ("abort", "r1")
        assert engine.running
    finally:
        engine.shutdown()
