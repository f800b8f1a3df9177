"""Which encoders a client believes are up: marked down on failure, back up on a probe.

Sans-IO: the tracker holds state and reads the time from a clock function (Trio's clock by
default, so tests drive it with the mock clock); the HTTP probing lives in the fleet client.

An encoder that refused a connection or answered 503 is *down* for ``down_seconds``, doubled
on each further failure up to ``max_down_seconds``, so a dead encoder costs each client one
failed attempt per period rather than one per request. A successful probe (or request) brings
it back at once. Once its period is over an encoder is tried again by the next request that
ranks it first, so recovery needs no probe either. Down encoders are never dropped from a
ranking, only moved behind the ones that are up: if every encoder is down, requests still try.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio


@dataclass
class _Down:
    until: float
    period: float


class HealthTracker:
    """Up/down state per encoder URL."""

    def __init__(
        self,
        *,
        down_seconds: float = 2.0,
        max_down_seconds: float = 30.0,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        if down_seconds <= 0 or max_down_seconds < down_seconds:
            raise ValueError(
                f"need 0 < down_seconds <= max_down_seconds, got {down_seconds}, {max_down_seconds}"
            )
        self.down_seconds = down_seconds
        self.max_down_seconds = max_down_seconds
        self._clock = clock
        self._down: dict[str, _Down] = {}

    def is_up(self, encoder: str) -> bool:
        """Not marked down, or its down period is over."""
        down = self._down.get(encoder)
        return down is None or self._clock() >= down.until

    def mark_down(self, encoder: str) -> None:
        """A failed connection or a 503: keep requests away for a period, longer each time."""
        down = self._down.get(encoder)
        period = self.down_seconds if down is None else min(2 * down.period, self.max_down_seconds)
        self._down[encoder] = _Down(self._clock() + period, period)

    def mark_up(self, encoder: str) -> None:
        """A probe or a request succeeded: the encoder is back, its next failure starts over."""
        self._down.pop(encoder, None)

    def down(self) -> list[str]:
        """Encoders marked down and not yet back (the ones worth probing)."""
        now = self._clock()
        return sorted(encoder for encoder, down in self._down.items() if now < down.until)

    def order(self, ranked: Iterable[str]) -> list[str]:
        """``ranked`` with the encoders that are up first, each group in its ranked order."""
        ranked = list(ranked)
        return [e for e in ranked if self.is_up(e)] + [e for e in ranked if not self.is_up(e)]

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the state of encoders no longer in the list."""
        keep = set(keep)
        for encoder in [e for e in self._down if e not in keep]:
            del self._down[encoder]
