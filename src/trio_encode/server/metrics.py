"""Prometheus metrics, fed by lifecycle events and by the HTTP layer.

The metrics live in their own :class:`CollectorRegistry` so that several servers in one process
(tests, the demo) never share or clash over counters. The two "live" gauges and the encoder's
queue depth are read from the service itself at scrape time rather than counted from events: a
registration the ledger lost track of would then still show, which is the leak this gauge
exists to reveal. Counters carry no ``*_created`` series: they double the exposition and no
dashboard of this server reads them.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import trio
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from trio_encode.observer import METRIC_PREFIX, RegistrationCall

if TYPE_CHECKING:
    from trio_encode.arena import Arena
    from trio_encode.request_types import EmbeddingMemory
    from trio_encode.service import Encoder, EncodeService


# Encoder runs take tens of ms to seconds; transfers of MB-scale embeddings, ms; an HTTP answer
# from a fraction of a ms (probes) to a whole request's life (a /send waiting for its encode);
# a scope from one encode and transfer to its backstop deadline (minutes).
_ENCODE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30)
_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SCOPE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180, 600)

disable_created_metrics()  # type: ignore[no-untyped-call]

# Distributions whose version build_info reports, by the name it reports them under. Mooncake
# ships as one of two distributions that provide the same module.
_VERSIONED = {
    "version": ("trio-encode",),
    "torch": ("torch",),
    "mooncake": ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"),
}


def build_versions() -> dict[str, str]:
    """The versions ``trio_encode_build_info`` reports; ``none`` for what is not installed."""
    versions = {"python": platform.python_version()}
    for label, distributions in _VERSIONED.items():
        versions[label] = "none"
        for name in distributions:
            try:
                versions[label] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    return versions


@runtime_checkable
class QueueDepth(Protocol):
    """An encoder that can say how many images wait for a forward pass."""

    @property
    def queued_images(self) -> int: ...


# Registering CPU memory over TCP takes microseconds; pinning MBs for RDMA, milliseconds.
_REGISTER_BUCKETS = (1e-6, 1e-5, 1e-4, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1)


class Metrics:
    """The server's metrics; the service's ``LifecycleObserver``, the encoder's
    ``EncoderObserver`` and the store's ``StoreObserver``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        PlatformCollector(registry=r)
        Info(METRIC_PREFIX + "build", "Versions of this server and its engines.", registry=r).info(
            build_versions()
        )
        self.requests = Counter(
            METRIC_PREFIX + "requests_total",
            "Answered HTTP requests.",
            ["route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            METRIC_PREFIX + "request_seconds",
            "Time from a request's arrival to its answer, by route.",
            ["route"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.scope_seconds = Histogram(
            METRIC_PREFIX + "scope_seconds",
            "A request scope's life, from its first /encode to its release, by how it ended.",
            ["reason"],
            buckets=_SCOPE_BUCKETS,
            registry=r,
        )
        self.encoder_queue = Gauge(
            METRIC_PREFIX + "encoder_queue_images",
            "Images waiting for a forward pass now.",
            registry=r,
        )
        self._queue_depth: QueueDepth | None = None
        self.encoder_queue.set_function(
            lambda: self._queue_depth.queued_images if self._queue_depth is not None else 0
        )
        self.encode_seconds = Histogram(
            METRIC_PREFIX + "encode_seconds",
            "One encoder run.",
            buckets=_ENCODE_BUCKETS,
            registry=r,
        )
        self.transfer_seconds = Histogram(
            METRIC_PREFIX + "transfer_seconds",
            "One transfer into a receiver.",
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            METRIC_PREFIX + "transfer_bytes", "Bytes written into receivers.", registry=r
        )
        self.live_scopes = Gauge(
            METRIC_PREFIX + "live_scopes", "Request scopes alive now.", registry=r
        )
        self.live_registrations = Gauge(
            METRIC_PREFIX + "live_registrations", "Memory registrations held now.", registry=r
        )
        self.arena_registrations = Gauge(
            METRIC_PREFIX + "arena_registrations",
            "The arena's own registration: 1 while it is held (the server's whole life), "
            "never counted in registrations_total or deregistrations_total.",
            registry=r,
        )
        self.registrations = Counter(
            METRIC_PREFIX + "registrations",
            "Memory registrations made, the arena's left out (see arena_registrations).",
            registry=r,
        )
        self.quarantined_registrations = Gauge(
            METRIC_PREFIX + "quarantined_registrations",
            "Registrations whose deregistration failed; their memory is kept and the "
            "deregistration retried.",
            registry=r,
        )
        self.quarantined_bytes = Gauge(
            METRIC_PREFIX + "quarantined_bytes",
            "Bytes kept alive by quarantined registrations.",
            registry=r,
        )
        self.held_transfers = Gauge(
            METRIC_PREFIX + "held_transfers",
            "Sends whose memory is held out of reuse because a transfer the engine stopped "
            "waiting for may still read it.",
            registry=r,
        )
        self.held_transfer_bytes = Gauge(
            METRIC_PREFIX + "held_transfer_bytes",
            "Bytes held out of reuse for transfers the engine stopped waiting for.",
            registry=r,
        )
        self.held_transfer_oldest_seconds = Gauge(
            METRIC_PREFIX + "held_transfer_oldest_seconds",
            "Age of the oldest such hold (0 when none).",
            registry=r,
        )
        self.held_transfers_overdue = Counter(
            METRIC_PREFIX + "held_transfers_overdue",
            "Holds that outlived the engine's bound: the engine never reported the transfer "
            "ended; the memory is kept, never reused.",
            registry=r,
        )
        self.deregistrations = Counter(
            METRIC_PREFIX + "deregistrations",
            "Memory registrations released, the arena's left out: equal to "
            "registrations_total once idle.",
            registry=r,
        )
        self.register_seconds = Histogram(
            METRIC_PREFIX + "register_seconds",
            "One memory registration (pinning, on RDMA).",
            buckets=_REGISTER_BUCKETS,
            registry=r,
        )
        self.deregister_seconds = Histogram(
            METRIC_PREFIX + "deregister_seconds",
            "One memory deregistration.",
            buckets=_REGISTER_BUCKETS,
            registry=r,
        )
        self.arena_bytes = Gauge(
            METRIC_PREFIX + "arena_bytes", "Size of the registered arena (0: none).", registry=r
        )
        self.arena_leased_bytes = Gauge(
            METRIC_PREFIX + "arena_leased_bytes",
            "Arena bytes held by requests and forwards now.",
            registry=r,
        )
        self.arena_cached_bytes = Gauge(
            METRIC_PREFIX + "arena_cached_bytes",
            "Arena bytes kept as the embedding cache (leased or not).",
            registry=r,
        )
        self.arena_fallbacks = Gauge(
            METRIC_PREFIX + "arena_fallbacks",
            "Requests whose embedding did not fit in the arena and was registered on its own "
            "(a count since start).",
            registry=r,
        )
        self.backstop_expiries = Counter(
            METRIC_PREFIX + "backstop_expiries", "Scopes ended by their deadline.", registry=r
        )
        self.scopes_split = Counter(
            METRIC_PREFIX + "scopes_split",
            "Scopes ended by their deadline after serving some but not all receivers: a "
            "request split across encoders (or ranks that never sent).",
            registry=r,
        )
        self.scopes_closed = Counter(
            METRIC_PREFIX + "scopes_closed", "Scopes ended, by reason.", ["reason"], registry=r
        )
        self.engine_errors = Counter(
            METRIC_PREFIX + "engine_errors",
            "Transfer-engine calls that returned an error.",
            ["call", "code"],
            registry=r,
        )
        self.completion_messages = Counter(
            METRIC_PREFIX + "completion_messages",
            "SGLang completion messages pushed to prefill ranks, by kind (done, error) and "
            "result (sent, failed).",
            ["kind", "result"],
            registry=r,
        )
        self._arena: Arena | None = None
        # Until attach() names a service, count the live ones from events.
        self._open_scopes = 0
        self._held_registrations = 0
        self.live_scopes.set_function(lambda: self._open_scopes)
        self.live_registrations.set_function(lambda: self._held_registrations)
        # The encoder's own events (EncoderObserver).
        self.batch_size = Histogram(
            METRIC_PREFIX + "encoder_batch_size",
            "Images per forward pass.",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.forward_seconds = Histogram(
            METRIC_PREFIX + "encoder_forward_seconds",
            "One forward pass over a batch.",
            buckets=_ENCODE_BUCKETS,
            registry=r,
        )
        self.forward_failures = Counter(
            METRIC_PREFIX + "encoder_forward_failures", "Forward passes that raised.", registry=r
        )
        self.queue_wait_seconds = Histogram(
            METRIC_PREFIX + "encoder_queue_wait_seconds",
            "Time an image waited for its forward pass.",
            buckets=_ENCODE_BUCKETS,
            registry=r,
        )
        self.cache_hits = Counter(
            METRIC_PREFIX + "encoder_cache_hits", "Cached images.", registry=r
        )
        self.cache_misses = Counter(
            METRIC_PREFIX + "encoder_cache_misses", "Images not in the cache.", registry=r
        )
        self.cache_bytes = Gauge(
            METRIC_PREFIX + "encoder_cache_bytes", "Bytes of embeddings cached.", registry=r
        )
        self.cache_entries = Gauge(
            METRIC_PREFIX + "encoder_cache_entries", "Embeddings cached.", registry=r
        )
        self.cache_poisoned_images = Counter(
            METRIC_PREFIX + "encoder_cache_poisoned",
            "Cached embeddings dropped because their bytes no longer matched the checksum "
            "recorded when they were written (memory changed behind the encoder's back).",
            registry=r,
        )
        self.encoder_rejected = Counter(
            METRIC_PREFIX + "encoder_rejected_images",
            "Images refused because the queue was full.",
            registry=r,
        )

        # The cluster-wide store's events (StoreObserver).
        self.store_up = Gauge(
            METRIC_PREFIX + "store_connected",
            "1 while connected to the Mooncake Store master, else 0.",
            registry=r,
        )
        self.store_lookups = Counter(
            METRIC_PREFIX + "store_lookups",
            "Images looked up in the cluster-wide store, by result (hit, miss, error, timeout, "
            "unavailable); all but hit run the forward locally.",
            ["result"],
            registry=r,
        )
        self.store_puts = Counter(
            METRIC_PREFIX + "store_puts",
            "Embeddings offered to the cluster-wide store, by result (stored, failed, timeout, "
            "dropped).",
            ["result"],
            registry=r,
        )

    def attach(self, service: EncodeService) -> None:
        """Read the live gauges from ``service`` itself from now on."""
        self.live_scopes.set_function(lambda: len(service.registry))
        self.live_registrations.set_function(lambda: service.ledger.live_registrations)
        self.held_transfers.set_function(lambda: service.ledger.held)
        self.held_transfer_bytes.set_function(lambda: service.ledger.held_bytes)
        self.held_transfer_oldest_seconds.set_function(lambda: service.ledger.oldest_hold_seconds)
        arena = service.encoder.arena
        if arena is not None:
            self.arena_bytes.set(arena.nbytes)
            self.arena_leased_bytes.set_function(lambda: arena.leased_bytes)
            self.arena_cached_bytes.set_function(lambda: arena.cached_bytes)
            self.arena_fallbacks.set_function(lambda: arena.fallbacks)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def request_answered(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.request_seconds.labels(route=route).observe(seconds)

    def timed(self, encoder: Encoder) -> Encoder:
        """``encoder`` with every run timed into ``encode_seconds``; its queue depth is read
        into ``encoder_queue_images`` when it can tell it."""
        if isinstance(encoder, QueueDepth):
            self._queue_depth = encoder
        return _TimedEncoder(encoder, self.encode_seconds)

    # -- LifecycleObserver --------------------------------------------------------------------

    def scope_opened(self, req_id: str) -> None:
        self._open_scopes += 1

    def scope_closed(self, req_id: str, reason: str, seconds: float) -> None:
        self._open_scopes -= 1
        self.scopes_closed.labels(reason=reason).inc()
        self.scope_seconds.labels(reason=reason).observe(seconds)

    def watch_arena(self, arena: Arena | None) -> None:
        """Count ``arena``'s own registration in ``arena_registrations``, apart from the
        per-request ones (so those are made and released in pairs)."""
        self._arena = arena

    def _is_arena(self, address: int) -> bool:
        return self._arena is not None and address == self._arena.address

    def registered(self, address: int, length: int) -> None:
        self._held_registrations += 1
        if self._is_arena(address):
            self.arena_registrations.set(1)
        else:
            self.registrations.inc()

    def deregistered(self, address: int) -> None:
        self._held_registrations -= 1
        if self._is_arena(address):
            self.arena_registrations.set(0)
        else:
            self.deregistrations.inc()

    def registration_timed(self, call: RegistrationCall, seconds: float) -> None:
        histogram = self.register_seconds if call == "register" else self.deregister_seconds
        histogram.observe(seconds)

    def transfer_finished(self, req_id: str, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.inc(nbytes)
        self.transfer_seconds.observe(seconds)

    def engine_error(self, call: str, code: int) -> None:
        self.engine_errors.labels(call=call, code=str(code)).inc()

    def backstop_expired(self, req_id: str) -> None:
        self.backstop_expiries.inc()

    def split_expired(self, req_id: str, served: int, receive_count: int) -> None:
        self.scopes_split.inc()

    def quarantine_changed(self, regions: int, nbytes: int) -> None:
        self.quarantined_registrations.set(regions)
        self.quarantined_bytes.set(nbytes)

    def completion_pushed(self, kind: str, *, ok: bool) -> None:
        self.completion_messages.labels(kind=kind, result="sent" if ok else "failed").inc()

    def transfer_hold_overdue(self, nbytes: int) -> None:
        self.held_transfers_overdue.inc()

    # -- EncoderObserver ----------------------------------------------------------------------

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        self.batch_size.observe(images)
        self.forward_seconds.observe(forward_seconds)
        if not ok:
            self.forward_failures.inc()

    def queue_waited(self, seconds: float) -> None:
        self.queue_wait_seconds.observe(seconds)

    def cache_looked_up(self, hits: int, misses: int) -> None:
        self.cache_hits.inc(hits)
        self.cache_misses.inc(misses)

    def cache_size(self, nbytes: int, entries: int) -> None:
        self.cache_bytes.set(nbytes)
        self.cache_entries.set(entries)

    def rejected(self, images: int) -> None:
        self.encoder_rejected.inc(images)

    def cache_poisoned(self, images: int) -> None:
        self.cache_poisoned_images.inc(images)

    # -- StoreObserver ------------------------------------------------------------------------

    def store_connected(self, connected: bool) -> None:
        self.store_up.set(1 if connected else 0)

    def store_looked_up(self, result: str, images: int) -> None:
        self.store_lookups.labels(result=result).inc(images)

    def store_put(self, result: str) -> None:
        self.store_puts.labels(result=result).inc()


class _TimedEncoder:
    """Delegates to an encoder and times each ``encode`` (only runs that return are timed)."""

    def __init__(self, encoder: Encoder, histogram: Histogram) -> None:
        self._encoder = encoder
        self._histogram = histogram

    @property
    def ready(self) -> bool:
        return self._encoder.ready

    @property
    def arena(self) -> Arena | None:
        return self._encoder.arena

    async def load_items(self, items: Sequence[str]) -> list[bytes]:
        return await self._encoder.load_items(items)

    async def encode(self, images: Sequence[bytes]) -> EmbeddingMemory:
        started = trio.current_time()
        embedding = await self._encoder.encode(images)
        self._histogram.observe(trio.current_time() - started)
        return embedding

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self._encoder.run(task_status=task_status)
