"""Where a plan is solved one step ahead, off the engine's critical path: a planner process or a thread.

A thread shares the engine's GIL. Most of a solve's set-up (window, seeds, feasibility, expiry) is Python, and
the engine's step is a long run of short torch calls, each of which must take the GIL back. Measured on a
16-core H100 machine (benchmarks/planner.py --sections engine, SmolLM2-135M shape, 4 requests, batches of
4 requests x 32 layers solved back to back): a planner thread slowed decode steps by +402% on the GPU and
+178% on the CPU; a planner process solving the same batches, +2.3% and +0.1% (a thread that burns a core
without the GIL: +3.0% and +1.5%). A round trip per solve (pickling the batch and the plan) costs the
engine's process something too: at ~300 solves/s, +8% to +20%; the engine makes one per expiry. On this
project's 2-core CPU machine (docs/results.md): thread +114-116%, process +12-16% at ~400 solves/s, a busy process
without round trips -1.8% to +0.5%.
The process is started (spawn: no fork of a process running torch threads) and its compiled planner loaded
when the engine starts, not at the first solve.

``auto`` picks the process where there are cores to spare (4 or more) and the thread otherwise: starting a
process per engine costs more than it saves in short runs and tests, which solve once per expiry, not back to
back. An engine on 2 cores that re-plans often should say ``--background-planner process`` (the numbers above).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import replace

from orbitflow.config import BACKGROUND_PLANNER_CHOICES
from orbitflow.plan import Plan, PlanRequest, warm_up
from orbitflow.policies.base import PlanContext, Policy

log = logging.getLogger(__name__)

_worker_policy: Policy | None = None  # the planner process's own copy of the engine's policy


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


def _init_worker(policy: Policy) -> None:
    global _worker_policy
    _worker_policy = policy
    warm_up()


def _timed_plan(policy: Policy, requests: list[PlanRequest], ctx: PlanContext) -> tuple[Plan, float]:
    start = time.perf_counter()
    plan = policy.plan(requests, ctx)
    return plan, time.perf_counter() - start


def _solve_in_worker(requests: list[PlanRequest], ctx: PlanContext) -> tuple[Plan, float]:
    return _timed_plan(_worker_policy, requests, ctx)


class BackgroundPlanner:
    """Solves ``policy.plan(requests, ctx)`` on a planner thread or in a planner process."""

    def __init__(self, policy: Policy, mode: str | bool = "auto"):
        self.policy = policy
        self.mode = resolve_mode(mode)
        if self.mode == "off":
            raise ValueError("BackgroundPlanner: mode 'off' solves nothing in the background; build none")
        self._pool = self._start()

    def _start(self):
        if self.mode == "thread":
            return ThreadPoolExecutor(max_workers=1, thread_name_prefix="orbitflow-planner")
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(self.policy,))
        pool.submit(time.perf_counter)  # start the process (and load the compiled planner) now
        return pool

    def submit(self, requests: list[PlanRequest], ctx: PlanContext) -> Future:
        """A future of ``(plan, solve seconds)``; ``ctx`` is the snapshot the solve sees."""
        if self.mode == "thread":
            return self._pool.submit(_timed_plan, self.policy, requests, ctx)
        if ctx.previous is not None:  # a read-only mapping does not pickle; the process's copy is its own
            ctx = replace(ctx, previous=dict(ctx.previous))
        return self._pool.submit(_solve_in_worker, requests, ctx)

    def fall_back_to_thread(self) -> None:
        """After the planner process died: warn once and solve on a thread from now on."""
        log.warning("the planner process failed; solving ahead on a planner thread from now on")
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.mode = "thread"
        self._pool = self._start()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
