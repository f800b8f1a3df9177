"""A bounded memory of what happened to keys lately: ended requests, failed ones.

A late call (a pull, a retried ``/send``) should get the answer its request ended with, not a
fresh start; but what a server remembers of ended requests must not grow with the requests it
has served. Each memory here keeps at most ``limit`` entries, none older than ``seconds`` of
Trio time: remembering a key again moves it to the newest end, and the oldest entries go first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

K = TypeVar("K")
V = TypeVar("V")


class Recent(Generic[K, V]):
    """At most ``limit`` entries, each forgotten ``seconds`` after it was remembered.

    ``seconds`` may be a callable read at each use, for a window a setting holds."""

    def __init__(self, limit: int, seconds: float | Callable[[], float]) -> None:
        if limit < 0:
            raise ValueError("limit must not be negative")
        self.limit = limit
        self._seconds = seconds
        self._entries: OrderedDict[K, tuple[V, float]] = OrderedDict()

    @property
    def seconds(self) -> float:
        return self._seconds() if callable(self._seconds) else self._seconds

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, key: K, value: V) -> None:
        """Keep ``value`` for ``key`` from now, then forget what is past either bound."""
        now = trio.current_time()
        self._entries[key] = (value, now)
        self._entries.move_to_end(key)
        seconds = self.seconds
        while self._entries:
            _, at = next(iter(self._entries.values()))
            if len(self._entries) <= self.limit and now - at <= seconds:
                break
            self._entries.popitem(last=False)

    def get(self, key: K) -> V | None:
        """What was remembered for ``key``, or None if nothing or too long ago."""
        entry = self._entries.get(key)
        if entry is None or trio.current_time() - entry[1] > self.seconds:
            return None
        return entry[0]

    def forget(self, key: K) -> None:
        self._entries.pop(key, None)
