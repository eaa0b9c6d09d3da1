"""Where a plan is solved ahead of its step, off the engine's critical path: a planner process or a thread.

A thread shares the engine's GIL. The searches run in compiled kernels without it, but gathering their inputs and
building the plan (horizons, windows, the plan itself) is Python, and the engine's step is a long run of short torch
calls, each of which must take the GIL back. Measured with
benchmarks/planner.py --sections engine (SmolLM2-135M shape, 4 requests, batches of 4 requests x 32 layers
solved back to back, each a round trip from a thread of the engine's process): on a 16-core H100 machine a
planner thread slowed decode steps by +402% on the GPU and +178% on the CPU, a planner process by +2.3% and
+0.1% (both with the ProcessPoolExecutor below). On this project's 2-core CPU machine
(docs/results/planner_engine_cpu2.md, 100 interleaved rounds, paired by round) a planner thread solving back to back
costs +62% at 4 x 32 (2026-12-04, 1068 solves/s; +72% at 762 solves/s before the searches ran in one kernel call each),
a planner process solving on its own without round trips +0.7% (+0.2% at 16 x 80).

The planner process (:class:`PlannerProcess`) is one spawned process on a pipe (spawn: no fork of a process
running torch threads), started with the engine and its compiled planner loaded then, not at the first solve.
A round trip costs the engine's process one pickle and one write per solve, and the read of the reply by
whichever thread asks for the plan: no helper thread. It replaced a one-worker ProcessPoolExecutor, whose
queue feeder and manager threads both wake in the engine's process per solve: on 2 cores, in three interleaved
runs at ~380-500 round trips/s from a thread of the engine's process, +6.6% to +9.2% for the pipe against
+14.2% to +16.2% for the pool (with empty replies the pipe still cost +12%: the wake-ups, not the pickles). The
engine itself makes at most one round trip per step (below). The planning context is sent again only when the
controller has replaced it (it never mutates it), and a plan crosses as its placement's bits.

A simulated engine solves ahead on its virtual clock instead (:class:`ClockedPlanner`): the solve runs at once,
and its plan is ready once the clock has moved on by the solve's charged seconds (after the solves submitted before
it: one planner, one solve at a time), so the controller's rules (start early enough, run the old plan on inside
its window, wait past it) run as in the engine. What it leaves out is the planner's own cost to the steps beside it
(a thread's share of the GIL, a process's round trip), which benchmarks/planner.py --sections engine measures.

``auto`` picks the process where there are cores to spare (4 or more) and the thread otherwise: starting a process per
engine (about 1 s of CPU and 190 MB) costs more than it saves in short runs and tests, which solve once per expiry,
not back to back. In the engine's own pattern (one solve in flight, due at the step that reads it: a solve per step at
4 x 32) both cost little on 2 cores, the process less: a planner thread +1.9% [+0.1%, +3.1%] at 4 x 32 and +0.9% at 16
x 80, a planner process +0.5% [-0.7%, +1.9%] and +1.3% (100 rounds paired, 2026-12-04). At 4 x 32 about half of a
solve's wall time still holds the GIL (0.29 of 0.51 ms, benchmarks/planner.py --sections gil), so the thread's cost is
that share. How small the share must be for a thread solving back to back to cost the engine only what its CPU does
(benchmarks/planner.py --sections gil_share, a synthetic thread, 20 rounds paired, 2026-12-07; share measured alone):
53% held +50%, 27% +22%, 13% +8%, 5% +5%, 2% +5%, and 0% (the CPU alone) +3%, the last three within each other's
intervals. A solve would have to hold the GIL for about 5% of its time: some 10 us of Python beside its 180 us of
kernels at 4 x 32. Handing the GIL back sooner does not help: with ``sys.setswitchinterval`` at 5000, 1000, 100, 20 or
5 us a planner thread solving back to back cost +69% to +76% (benchmarks/planner.py --sections gil_switch, 2026-12-08;
+64% to +104% over four runs, with no trend in the interval): the step's median grew by some 32-39 us (32-50 us over
the four runs) for each of the 2175 aten calls its torch calls dispatch, each torch call giving the GIL up and taking
it back. The other side of it is the step's grain: a synthetic step doing the same products in 2176, 272 or 34 torch
calls lost +91%, +19% and +4% beside that thread, and the 2176 products made in 34 calls of a TorchScript function
(which runs them without the GIL) +6% (--sections gil_grain, 2026-12-08; over four runs the 272 and 34 rows spanned
+19% to +35% and +4% to +10%). The two levers together: that TorchScript step beside a synthetic thread holding the
GIL 5% of its time lost +2.2% [+0.5%, +5.2%] (the eager 2176-call step +5.2%): a step of a few dozen GIL-free calls
and a planner with some 10 us of Python per solve would put a thread solving back to back near 3%. A server runs long,
so ``orbitflow serve`` starts the process on any core count (its ``--background-planner`` default); so should a caller
that solves back to back from the engine's process (a library user's loop; the engine never does).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

from orbitflow.config import BACKGROUND_PLANNER_CHOICES
from orbitflow.plan import Plan, PlanRequest, warm_up
from orbitflow.policies.base import PlanContext, Policy

log = logging.getLogger(__name__)


def resolve_mode(mode: str | bool) -> str:
    """``process``, ``thread`` or ``off`` for a configured mode (True/False: thread/off, for callers that
    only say whether to solve ahead)."""
    if isinstance(mode, bool):
        return "thread" if mode else "off"
    if mode not in BACKGROUND_PLANNER_CHOICES:
        raise ValueError(f"--background-planner must be one of {', '.join(BACKGROUND_PLANNER_CHOICES)}, got {mode!r}")
    if mode == "auto":
        return "process" if (os.cpu_count() or 1) >= 4 else "thread"
    return mode


def _timed_plan(policy: Policy, requests: list[PlanRequest], ctx: PlanContext) -> tuple[Plan, float]:
    start = time.perf_counter()
    plan = policy.plan(requests, ctx)
    return plan, time.perf_counter() - start


def _planner_main(conn, policy: Policy) -> None:
    """The planner process: solve each ``(seq, requests, ctx or None)`` it reads (None: the last context sent)
    and write back ``(seq, ok, pickled (plan, seconds) or exception)``; exit when the engine's end of the pipe
    closes. The reply's value is pickled here, so a value that will not pickle becomes an error the engine can
    read, and one that will not unpickle fails only its own future there."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it closes the pipe
    warm_up()
    ctx = None
    try:
        conn.send_bytes(b"")  # ready
        while True:
            seq, requests, new_ctx = pickle.loads(conn.recv_bytes())
            ctx = new_ctx if new_ctx is not None else ctx
            try:
                ok, value = True, _timed_plan(policy, requests, ctx)
            except Exception as exc:  # the engine raises it from result(); the process lives on
                ok, value = False, exc
            try:
                payload = pickle.dumps(value)
            except Exception as exc:
                ok, payload = False, pickle.dumps(RuntimeError(f"planner process: {value!r} does not pickle: {exc}"))
            conn.send_bytes(pickle.dumps((seq, ok, payload)))
    except (EOFError, OSError):  # the engine closed its end
        return


class PlannerProcess:
    """A planner process on a pipe (module docstring): :meth:`submit` returns a future whose ``result()`` reads
    the reply. Replies come back in order; one that nobody asks for (a solve whose batch changed) is read on the
    way to a later one, or by the next :meth:`submit`, so unread replies never fill the pipe. One thread writes
    and one reads at a time (two locks: a submit never waits for a solve). A dead process raises
    ``BrokenProcessPool`` from :meth:`submit` and from ``result()``."""

    def __init__(self, policy: Policy):
        mp = multiprocessing.get_context("spawn")  # no fork of a process running torch threads
        self._conn, child = mp.Pipe()
        self._proc = mp.Process(target=_planner_main, args=(child, policy), name="orbitflow-planner", daemon=True)
        self._proc.start()
        child.close()  # the child's end lives in the child only: its death ends our reads with EOFError
        self._send_lock = threading.Lock()
        self._recv_lock = threading.RLock()  # reentrant: a done-callback may ask for another plan
        self._seq = 0
        self._waiting: dict[int, Future] = {}
        self._ctx_sent: PlanContext | None = None  # held, so that identity means "unchanged"
        self._finalizer = weakref.finalize(self, _close_pipe, self._conn, self._proc)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def submit(self, requests: list[PlanRequest], ctx: PlanContext) -> Future:
        self._drain()
        with self._send_lock:
            self._seq += 1
            future = _PipeFuture(self, self._seq)
            future.set_running_or_notify_cancel()  # running: cancel() says False, as for an executor's running task
            send_ctx = None
            if ctx is not self._ctx_sent:  # the controller replaces its context (after every adopted plan)
                # a read-only mapping does not pickle; the process's copy is its own
                send_ctx = replace(ctx, previous=dict(ctx.previous)) if ctx.previous is not None else ctx
            try:
                blob = pickle.dumps((self._seq, list(requests), send_ctx))
            except Exception as exc:  # inputs that do not pickle fail this solve only
                future.set_exception(exc)
                return future
            self._waiting[self._seq] = future  # before the write: a reader may get the reply at once
            try:
                self._conn.send_bytes(blob)
            except (OSError, EOFError) as exc:
                self._waiting.pop(self._seq, None)
                raise BrokenProcessPool(f"the planner process is gone: {exc}") from exc
            self._ctx_sent = ctx
            return future

    def _drain(self) -> None:
        """Replies nobody asked for yet, off the pipe and into their futures (unless a thread is reading), so that
        the process never blocks writing them."""
        if not self._recv_lock.acquire(blocking=False):
            return
        try:
            while self._waiting and self._conn.poll(0):
                self._read_one(None)
        except OSError as exc:
            raise BrokenProcessPool(f"the planner process is gone: {exc}") from exc
        finally:
            self._recv_lock.release()

    def _read_until(self, seq: int, timeout: float | None) -> None:
        """Read replies until ``seq``'s has arrived (``timeout`` seconds at most: TimeoutError)."""
        end = None if timeout is None else time.monotonic() + timeout
        if not self._recv_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise TimeoutError(f"no plan from the planner process within {timeout} s")
        try:
            while seq in self._waiting:
                self._read_one(end)
        finally:
            self._recv_lock.release()

    def _read_one(self, end: float | None) -> None:
        """Read one message (by monotonic time ``end``, else TimeoutError) and hand it to its future; the
        process's death fails every future still waiting."""
        left = None if end is None else max(0.0, end - time.monotonic())
        blob = None
        try:
            if left is None or self._conn.poll(left):
                blob = self._conn.recv_bytes()
        except (EOFError, OSError) as exc:
            broken = BrokenProcessPool(f"the planner process died: {exc!r}")
            while self._waiting:
                self._waiting.popitem()[1].set_exception(broken)
            return
        if blob is None:  # outside the try: TimeoutError is an OSError
            raise TimeoutError("no plan from the planner process in time")
        if not blob:  # "ready"
            return
        seq, ok, payload = pickle.loads(blob)
        try:
            value = pickle.loads(payload)
        except Exception as exc:  # this reply only: the pipe is still in step
            ok, value = False, RuntimeError(f"the planner process's reply could not be read: {exc!r}")
        fut = self._waiting.pop(seq, None)
        if fut is not None:
            (fut.set_result if ok else fut.set_exception)(value)

    def close(self) -> None:
        self._finalizer()


def _close_pipe(conn, proc) -> None:
    """Close the engine's end (an idle process then exits on its own; one in a solve is killed: it has nothing
    to save) and reap the process."""
    conn.close()
    proc.join(timeout=0.2)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)


class _PipeFuture(Future):
    """A future whose ``result()`` / ``exception()`` read the pipe until its reply arrives, and whose ``done()`` takes
    the replies already there off it without waiting (no thread resolves it otherwise: ``concurrent.futures.wait``
    does not see it finish). Without the poll, the controller saw a solve ahead as running for good: the old plan ran
    on to the end of its window and the solve was thrown away."""

    def __init__(self, owner: PlannerProcess, seq: int):
        super().__init__()
        self._owner, self._seq = owner, seq

    def done(self) -> bool:
        if not super().done():
            try:
                self._owner._drain()
            except BrokenProcessPool as exc:  # the pipe failed under the poll: this solve will never be answered
                if not super().done():
                    self.set_exception(exc)
        return super().done()

    def result(self, timeout: float | None = None):
        if not self.done():
            self._owner._read_until(self._seq, timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None):
        if not self.done():
            self._owner._read_until(self._seq, timeout)
        return super().exception(timeout=0)


class BackgroundPlanner:
    """Solves ``policy.plan(requests, ctx)`` on a planner thread or in a planner process."""

    def __init__(self, policy: Policy, mode: str | bool = "auto"):
        self.policy = policy
        self.mode = resolve_mode(mode)
        if self.mode == "off":
            raise ValueError("BackgroundPlanner: mode 'off' solves nothing in the background; build none")
        self._pool = self._start()

    def _start(self) -> ThreadPoolExecutor | PlannerProcess:
        if self.mode == "process":
            try:
                return PlannerProcess(self.policy)
            except Exception as exc:  # noqa: BLE001 - e.g. a library user's policy that does not pickle
                log.warning("the planner process did not start (%s: %s); solving ahead on a planner thread",
                            type(exc).__name__, exc)
                self.mode = "thread"
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbitflow-planner")

    def submit(self, requests: list[PlanRequest], ctx: PlanContext) -> Future:
        """A future of ``(plan, solve seconds)``; ``ctx`` is the snapshot the solve sees."""
        if self.mode == "thread":
            return self._pool.submit(_timed_plan, self.policy, requests, ctx)
        return self._pool.submit(requests, ctx)

    def fall_back_to_thread(self) -> None:
        """After the planner process died: warn once and solve on a thread from now on."""
        log.warning("the planner process failed; solving ahead on a planner thread from now on")
        self.close()
        self.mode = "thread"
        self._pool = self._start()

    def restart(self) -> None:
        """After a solve that never came back (hung, or a stopped process): a fresh planner of the same mode. A
        process is killed; a thread cannot be, and is left to finish its solve on its own, unread (the interpreter
        waits for it at exit, as for every executor thread)."""
        self.close()
        self._pool = self._start()

    def close(self) -> None:
        if isinstance(self._pool, ThreadPoolExecutor):
            self._pool.shutdown(wait=False, cancel_futures=True)
        else:
            self._pool.close()


class _ClockedFuture(Future):
    """A solve's result that is ready once the virtual clock reaches ``ready_at``; asking for it earlier waits,
    which on a virtual clock means moving the clock there (the step that asks holds the rest of the solve)."""

    def __init__(self, value: tuple[Plan, float], clock, ready_at: float):
        super().__init__()
        self._value, self._clock, self._ready_at = value, clock, ready_at

    def done(self) -> bool:
        return self._clock.now() + 1e-12 >= self._ready_at

    def result(self, timeout: float | None = None):
        """Wait on the clock until the solve is ready, or ``timeout`` seconds of it (then TimeoutError, as a
        planner that has not answered raises in the engine)."""
        left = max(0.0, self._ready_at - self._clock.now())
        if timeout is not None and left > timeout:
            self._clock.advance(timeout)
            raise TimeoutError(f"the solve ahead is charged {left:.3f} s more than the {timeout:g} s waited")
        self._clock.advance(left)
        return self._value


class ClockedPlanner:
    """The background planner of a simulated engine: :meth:`submit` solves at once (wall time measured) and
    returns a future that is done once the virtual ``clock`` has moved on by ``solve_time(wall seconds)``, the
    seconds the solve is charged (``orbitflow simulate --solver-time``), counted from when the planner is free:
    like the engine's one planner thread or process, it solves one request at a time, so a solve queues behind
    one still running (a solve the controller dropped runs to its end there too). The steps that run meanwhile
    hide it."""

    mode = "clock"  # as BackgroundPlanner.mode says where its solves run

    def __init__(self, policy: Policy, clock, solve_time):
        self.policy, self._clock, self._solve_time = policy, clock, solve_time
        self._free_at = -math.inf  # when the solve submitted last is done, on the clock

    def submit(self, requests: list[PlanRequest], ctx: PlanContext) -> Future:
        """A future of ``(plan, solve seconds)``, as :meth:`BackgroundPlanner.submit`'s."""
        try:
            plan, wall_s = _timed_plan(self.policy, requests, ctx)
        except Exception as exc:  # the engine's planner thread would hand the error to whoever asks
            future = Future()
            future.set_exception(exc)
            return future
        self._free_at = max(self._clock.now(), self._free_at) + float(self._solve_time(wall_s))
        return _ClockedFuture((plan, wall_s), self._clock, self._free_at)

    def fall_back_to_thread(self) -> None:
        """Nothing to fall back from: no process is involved."""

    def restart(self) -> None:
        """A fresh planner, free now: the solve given up on no longer holds it."""
        self._free_at = -math.inf

    def close(self) -> None:
        """Nothing to stop."""
