"""Time source for everything below the server: wall clock when serving, virtual when simulating."""

from __future__ import annotations

import time


class WallClock:
    virtual = False

    def now(self) -> float:
        return time.perf_counter()

    def advance(self, seconds: float) -> None:
        """Real time advances by itself; executors that measure wall time need not call this."""

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class VirtualClock:
    virtual = True

    def __init__(self, start: float = 0.0):
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)

    def sleep_until(self, t: float) -> None:
        self._now = max(self._now, t)
