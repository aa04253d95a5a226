"""Per-rank event recording on the aligned job clock; rank 0 gathers and writes the events."""
from __future__ import annotations

import contextlib
from typing import Callable

from .schema import NOT_A_SWITCH


class Recorder:
    def __init__(self, rank: int, clock: Callable[[], float]):
        self.rank, self.clock = rank, clock
        self._events: list[dict] = []

    @contextlib.contextmanager
    def span(self, iteration: int, name: str, role: str, critical: int = NOT_A_SWITCH, **attrs):
        """Time the body; the yielded dict takes `tokens`, `bytes` and attrs set inside it."""
        event = {"iteration": iteration, "rank": self.rank, "role": role, "name": name,
                 "critical": critical, "tokens": 0, "bytes": 0, "attrs": dict(attrs)}
        event["start"] = self.clock()
        try:
            yield event
        finally:
            event["end"] = self.clock()
            self._events.append(event)

    def record(self, iteration: int, name: str, role: str, start: float, end: float, tokens: int = 0,
               **attrs) -> None:
        """An event that was timed by the caller (e.g. one of several steps of a loop it does not own)."""
        self._events.append({"iteration": iteration, "rank": self.rank, "role": role, "name": name,
                             "critical": NOT_A_SWITCH, "tokens": tokens, "bytes": 0, "attrs": dict(attrs),
                             "start": start, "end": end})

    def add(self, event: dict) -> None:
        self._events.append(event)

    def take(self) -> list[dict]:
        """Events recorded since the last call."""
        events, self._events = self._events, []
        return events

