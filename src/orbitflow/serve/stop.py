"""Stop strings over streamed text: the output ends before the first stop string it contains.

Text that could be the start of a stop string is held back until it is known not to be one, so a
stream never shows characters that the final text would truncate away.
"""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._text = ""
        self._sent = 0  # characters of _text already released
        self.stopped = False

    def push(self, delta: str) -> str:
        """Add generated text; returns what may be released now. Sets `stopped` once a stop string shows."""
        if self.stopped:
            return ""
        search_from = max(0, len(self._text) - self._holdback)
        self._text += delta
        hits = [i for s in self.stop if (i := self._text.find(s, search_from)) >= 0]
        if hits:
            self.stopped = True
            return self._release(min(hits))
        return self._release(len(self._text) - self._holdback)

    def flush(self) -> str:
        """The stream ended without a stop string: release everything held back."""
        return "" if self.stopped else self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out = self._text[self._sent:end]
        self._sent = end
        return out
