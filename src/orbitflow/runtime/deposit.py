"""Token-Deposit (paper 4.2): decouple when a token is generated from when it is delivered.

Generated tokens enter a FIFO. While it is non-empty exactly one token leaves per SLO interval;
when it is empty the next token leaves as soon as it is generated; at finish the rest leaves at once.
So a token generated at g is due at max(g, due of the previous token + slo). The balance (how many paces the last
held token's due time lies ahead: about the tokens generated but not yet due) is the latency margin the planner may
spend.
"""

from __future__ import annotations

from collections import deque

# Delivery times are sums of float timestamps and SLO intervals: a gap within this of the SLO meets it.
SLO_TOLERANCE_S = 1e-9


# --deposit-guard-ms auto: the lesser of these (the delivery's jitter is absolute, but a fast model's SLO is short).
AUTO_GUARD_S = 0.005
AUTO_GUARD_FRACTION = 0.1


def guard_s(guard_ms: float | None, slo_s: float) -> float:
    """Seconds Token-Deposit paces under an SLO of ``slo_s`` for ``--deposit-guard-ms guard_ms`` (None: auto)."""
    if guard_ms is None:
        return min(AUTO_GUARD_S, AUTO_GUARD_FRACTION * slo_s)
    return guard_ms / 1000


def pace_s(guard_ms: float | None, slo_s: float) -> float:
    """The interval Token-Deposit paces a request of TBT SLO ``slo_s`` at, and the planner plans it for: the SLO less
    its guard. A ValueError naming --deposit-guard-ms when that leaves no pace (each caller says it its own way)."""
    guard = guard_s(guard_ms, slo_s)
    if guard >= slo_s:
        raise ValueError(f"an SLO of {1000 * slo_s:g} ms leaves no pace under --deposit-guard-ms ({1000 * guard:g} ms)")
    return slo_s - guard


class TokenDeposit:
    def __init__(self, slo_s: float, enabled: bool = True):
        self.slo_s = slo_s
        self.enabled = enabled
        self._queue: deque[tuple[int, float]] = deque()  # (token, due time) not yet delivered, in order
        self._last_due: float | None = None

    def push(self, token: int, generated_at: float) -> float:
        """Deposit a freshly generated token; returns when it is due for delivery."""
        if not self.enabled or self._last_due is None:
            due = generated_at
        else:
            due = max(generated_at, self._last_due + self.slo_s)
        self._last_due = due
        self._queue.append((token, due))
        return due

    def pop_due(self, now: float) -> list[tuple[int, float]]:
        """Tokens whose delivery time has come, with that time; they leave the deposit."""
        out = []
        while self._queue and self._queue[0][1] <= now:
            out.append(self._queue.popleft())
        return out

    def flush(self, now: float) -> list[tuple[int, float]]:
        """The request finished: everything left is delivered now, in one burst."""
        out = [(token, min(due, now)) for token, due in self._queue]
        self._queue.clear()
        return out

    def balance(self, now: float) -> float:
        """The margin the planner may spend at `now`, in paces: how far the last held token's due time lies ahead (0
        when nothing is held). The next token is late once it comes more than one pace after that due time, so a
        step of ``T`` seconds meets the SLO while ``balance + 1 - T / pace >= 0``: the planner's fluid model
        (plan/deposit.py) exactly. The count of held tokens said up to one pace more (a token held but due in 1 ms
        counted as a whole pace). Reads one float, so a router's what-if may ask from its own thread."""
        last = self._last_due
        return (last - now) / self.slo_s if last is not None and last > now else 0.0

    def __len__(self) -> int:
        return len(self._queue)
