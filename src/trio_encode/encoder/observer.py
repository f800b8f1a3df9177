"""Encoder events for metrics, without the encoder knowing about Prometheus."""

from __future__ import annotations

from typing import Protocol


class EncoderObserver(Protocol):
    """Receives the encoder's events; the server's metrics implement it. Called on the event
    loop, so implementations must be quick and must not block."""

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        """One forward pass ran over ``images`` images (``ok`` False: the model raised)."""

    def queue_waited(self, seconds: float) -> None:
        """One image waited this long between queueing and its forward pass."""

    def cache_looked_up(self, hits: int, misses: int) -> None:
        """One request's images were looked up in the cache."""

    def cache_size(self, nbytes: int, entries: int) -> None:
        """The cache's size after it changed."""

    def rejected(self, images: int) -> None:
        """A request was refused because the queue was full (Overloaded)."""

    def cache_poisoned(self, images: int, source: str) -> None:
        """Cached embeddings whose bytes no longer matched their checksum were dropped;
        ``source``: ``arena`` or ``cache`` (the store's count as its lookups' ``poisoned``)."""


class NullEncoderObserver:
    """Ignores every event."""

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        pass

    def queue_waited(self, seconds: float) -> None:
        pass

    def cache_looked_up(self, hits: int, misses: int) -> None:
        pass

    def cache_size(self, nbytes: int, entries: int) -> None:
        pass

    def rejected(self, images: int) -> None:
        pass

    def cache_poisoned(self, images: int, source: str) -> None:
        pass
