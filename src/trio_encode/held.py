"""The memory live requests hold, counted once per memory range: what ``max_held_bytes``
is checked against on every ``/encode``."""

from __future__ import annotations

from trio_encode.request_types import EmbeddingMemory


class HeldMemory:
    """The memory live requests hold, as a running total (``max_held_bytes`` is checked on
    every ``/encode``: no pass over the live requests). Counted by memory range, not by
    request: a cached row that many requests send (or one request names many times) is one
    allocation, counted once while any of them holds it."""

    def __init__(self) -> None:
        self.nbytes = 0
        self._holders: dict[tuple[int, int], int] = {}  # (address, length) -> requests

    def take(self, embedding: EmbeddingMemory) -> list[tuple[int, int]]:
        """Count ``embedding``'s memory; returns what to give back."""
        ranges = list(dict.fromkeys(embedding.segments))
        for memory in ranges:
            holders = self._holders.get(memory, 0)
            if not holders:
                self.nbytes += memory[1]
            self._holders[memory] = holders + 1
        return ranges

    def give_back(self, ranges: list[tuple[int, int]]) -> None:
        for memory in ranges:
            holders = self._holders[memory] - 1
            if holders:
                self._holders[memory] = holders
            else:
                del self._holders[memory]
                self.nbytes -= memory[1]
