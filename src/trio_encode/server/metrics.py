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
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

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
from trio_encode.service import PassThroughEncoder

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


class _Declared(NamedTuple):
    """One metric: its name after the prefix, its kind, help text and label names."""

    name: str
    kind: type[Counter] | type[Gauge] | type[Histogram]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()  # histograms only


# Every metric the server exposes (besides build_info and the process collectors), in
# exposition order. A counter declared without ``_total`` is exposed with it.
_DECLARED = (
    _Declared("requests_total", Counter, "Answered HTTP requests.", ("route", "status")),
    _Declared(
        "request_seconds",
        Histogram,
        "Time from a request's arrival to its answer, by route.",
        ("route",),
        _REQUEST_BUCKETS,
    ),
    _Declared(
        "scope_seconds",
        Histogram,
        "A request scope's life, from its first /encode to its release, by how it ended.",
        ("reason",),
        _SCOPE_BUCKETS,
    ),
    _Declared("encoder_queue_images", Gauge, "Images waiting for a forward pass now."),
    _Declared("encode_seconds", Histogram, "One encoder run.", (), _ENCODE_BUCKETS),
    _Declared(
        "transfer_seconds", Histogram, "One transfer into a receiver.", (), _TRANSFER_BUCKETS
    ),
    _Declared("transfer_bytes", Counter, "Bytes written into receivers."),
    _Declared("live_scopes", Gauge, "Request scopes alive now."),
    _Declared("live_registrations", Gauge, "Memory registrations held now."),
    _Declared(
        "arena_registrations",
        Gauge,
        "The arena's own registration: 1 while it is held (the server's whole life), "
        "never counted in registrations_total or deregistrations_total.",
    ),
    _Declared(
        "registrations",
        Counter,
        "Memory registrations made, the arena's left out (see arena_registrations).",
    ),
    _Declared(
        "quarantined_registrations",
        Gauge,
        "Registrations whose deregistration failed; their memory is kept and the "
        "deregistration retried.",
    ),
    _Declared("quarantined_bytes", Gauge, "Bytes kept alive by quarantined registrations."),
    _Declared(
        "held_transfers",
        Gauge,
        "Sends whose memory is held out of reuse because a transfer the engine stopped "
        "waiting for may still read it.",
    ),
    _Declared(
        "held_transfer_bytes",
        Gauge,
        "Bytes held out of reuse for transfers the engine stopped waiting for.",
    ),
    _Declared("held_transfer_oldest_seconds", Gauge, "Age of the oldest such hold (0 when none)."),
    _Declared(
        "held_transfers_overdue",
        Counter,
        "Holds that outlived the engine's bound: the engine never reported the transfer "
        "ended; the memory is kept, never reused.",
    ),
    _Declared(
        "deregistrations",
        Counter,
        "Memory registrations released, the arena's left out: equal to "
        "registrations_total once idle.",
    ),
    _Declared(
        "register_seconds",
        Histogram,
        "One memory registration (pinning, on RDMA).",
        (),
        _REGISTER_BUCKETS,
    ),
    _Declared("deregister_seconds", Histogram, "One memory deregistration.", (), _REGISTER_BUCKETS),
    _Declared("arena_bytes", Gauge, "Size of the registered arena (0: none)."),
    _Declared("arena_leased_bytes", Gauge, "Arena bytes held by requests and forwards now."),
    _Declared(
        "arena_cached_bytes", Gauge, "Arena bytes kept as the embedding cache (leased or not)."
    ),
    _Declared(
        "arena_fallbacks",
        Gauge,
        "Requests whose embedding did not fit in the arena and was registered on its own "
        "(a count since start).",
    ),
    _Declared("backstop_expiries", Counter, "Scopes ended by their deadline."),
    _Declared(
        "scopes_split",
        Counter,
        "Scopes ended by their deadline after serving some but not all receivers: a "
        "request split across encoders (or ranks that never sent).",
    ),
    _Declared("scopes_closed", Counter, "Scopes ended, by reason.", ("reason",)),
    _Declared(
        "engine_errors", Counter, "Transfer-engine calls that returned an error.", ("call", "code")
    ),
    _Declared(
        "completion_messages",
        Counter,
        "SGLang completion messages pushed to prefill ranks, by kind (done, error) and "
        "result (sent, failed).",
        ("kind", "result"),
    ),
    # The encoder's own events (EncoderObserver).
    _Declared(
        "encoder_batch_size", Histogram, "Images per forward pass.", (), (1, 2, 4, 8, 16, 32, 64)
    ),
    _Declared(
        "encoder_forward_seconds", Histogram, "One forward pass over a batch.", (), _ENCODE_BUCKETS
    ),
    _Declared("encoder_forward_failures", Counter, "Forward passes that raised."),
    _Declared(
        "encoder_queue_wait_seconds",
        Histogram,
        "Time an image waited for its forward pass.",
        (),
        _ENCODE_BUCKETS,
    ),
    _Declared("encoder_cache_hits", Counter, "Cached images."),
    _Declared("encoder_cache_misses", Counter, "Images not in the cache."),
    _Declared("encoder_cache_bytes", Gauge, "Bytes of embeddings cached."),
    _Declared("encoder_cache_entries", Gauge, "Embeddings cached."),
    _Declared(
        "encoder_cache_poisoned",
        Counter,
        "Cached embeddings dropped because their bytes no longer matched the checksum "
        "recorded when they were written (memory changed behind the encoder's back).",
    ),
    _Declared("encoder_rejected_images", Counter, "Images refused because the queue was full."),
    # The cluster-wide store's events (StoreObserver).
    _Declared("store_connected", Gauge, "1 while connected to the Mooncake Store master, else 0."),
    _Declared(
        "store_lookups",
        Counter,
        "Images looked up in the cluster-wide store, by result (hit, miss, error, timeout, "
        "unavailable); all but hit run the forward locally.",
        ("result",),
    ),
    _Declared(
        "store_puts",
        Counter,
        "Embeddings offered to the cluster-wide store, by result (stored, failed, timeout, "
        "dropped).",
        ("result",),
    ),
)


class Metrics:
    """The server's metrics; the service's ``LifecycleObserver``, the encoder's
    ``EncoderObserver`` and the store's ``StoreObserver``. Each declared metric is found by
    its name in ``counter``, ``gauge`` or ``histogram``, by its kind."""

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
        self.counter: dict[str, Counter] = {}
        self.gauge: dict[str, Gauge] = {}
        self.histogram: dict[str, Histogram] = {}
        for d in _DECLARED:
            full = METRIC_PREFIX + d.name
            if d.kind is Histogram:
                self.histogram[d.name] = Histogram(
                    full, d.help, d.labels, buckets=d.buckets, registry=r
                )
            elif d.kind is Gauge:
                self.gauge[d.name] = Gauge(full, d.help, d.labels, registry=r)
            else:
                self.counter[d.name] = Counter(full, d.help, d.labels, registry=r)
        self._queue_depth: QueueDepth | None = None
        self.gauge["encoder_queue_images"].set_function(
            lambda: self._queue_depth.queued_images if self._queue_depth is not None else 0
        )
        self._arena: Arena | None = None
        # Until attach() names a service, count the live ones from events.
        self._open_scopes = 0
        self._held_registrations = 0
        self.gauge["live_scopes"].set_function(lambda: self._open_scopes)
        self.gauge["live_registrations"].set_function(lambda: self._held_registrations)

    def attach(self, service: EncodeService) -> None:
        """Read the live gauges from ``service`` itself from now on."""
        self.gauge["live_scopes"].set_function(lambda: len(service.registry))
        self.gauge["live_registrations"].set_function(lambda: service.ledger.live_registrations)
        self.gauge["held_transfers"].set_function(lambda: service.ledger.held)
        self.gauge["held_transfer_bytes"].set_function(lambda: service.ledger.held_bytes)
        self.gauge["held_transfer_oldest_seconds"].set_function(
            lambda: service.ledger.oldest_hold_seconds
        )
        arena = service.encoder.arena
        if arena is not None:
            self.gauge["arena_bytes"].set(arena.nbytes)
            self.gauge["arena_leased_bytes"].set_function(lambda: arena.leased_bytes)
            self.gauge["arena_cached_bytes"].set_function(lambda: arena.cached_bytes)
            self.gauge["arena_fallbacks"].set_function(lambda: arena.fallbacks)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def request_answered(self, route: str, status: int, seconds: float) -> None:
        self.counter["requests_total"].labels(route=route, status=str(status)).inc()
        self.histogram["request_seconds"].labels(route=route).observe(seconds)

    def timed(self, encoder: Encoder) -> Encoder:
        """``encoder`` with every run timed into ``encode_seconds``; its queue depth is read
        into ``encoder_queue_images`` when it can tell it."""
        if isinstance(encoder, QueueDepth):
            self._queue_depth = encoder
        return _TimedEncoder(encoder, self.histogram["encode_seconds"])

    # -- LifecycleObserver --------------------------------------------------------------------

    def scope_opened(self, req_id: str) -> None:
        self._open_scopes += 1

    def scope_closed(self, req_id: str, reason: str, seconds: float) -> None:
        self._open_scopes -= 1
        self.counter["scopes_closed"].labels(reason=reason).inc()
        self.histogram["scope_seconds"].labels(reason=reason).observe(seconds)

    def watch_arena(self, arena: Arena | None) -> None:
        """Count ``arena``'s own registration in ``arena_registrations``, apart from the
        per-request ones (so those are made and released in pairs)."""
        self._arena = arena

    def _is_arena(self, address: int) -> bool:
        return self._arena is not None and address == self._arena.address

    def registered(self, address: int, length: int) -> None:
        self._held_registrations += 1
        if self._is_arena(address):
            self.gauge["arena_registrations"].set(1)
        else:
            self.counter["registrations"].inc()

    def deregistered(self, address: int) -> None:
        self._held_registrations -= 1
        if self._is_arena(address):
            self.gauge["arena_registrations"].set(0)
        else:
            self.counter["deregistrations"].inc()

    def registration_timed(self, call: RegistrationCall, seconds: float) -> None:
        self.histogram[f"{call}_seconds"].observe(seconds)

    def transfer_finished(self, req_id: str, nbytes: int, seconds: float) -> None:
        self.counter["transfer_bytes"].inc(nbytes)
        self.histogram["transfer_seconds"].observe(seconds)

    def engine_error(self, call: str, code: int) -> None:
        self.counter["engine_errors"].labels(call=call, code=str(code)).inc()

    def backstop_expired(self, req_id: str) -> None:
        self.counter["backstop_expiries"].inc()

    def split_expired(self, req_id: str, served: int, receive_count: int) -> None:
        self.counter["scopes_split"].inc()

    def quarantine_changed(self, regions: int, nbytes: int) -> None:
        self.gauge["quarantined_registrations"].set(regions)
        self.gauge["quarantined_bytes"].set(nbytes)

    def completion_pushed(self, kind: str, *, ok: bool) -> None:
        self.counter["completion_messages"].labels(
            kind=kind, result="sent" if ok else "failed"
        ).inc()

    def transfer_hold_overdue(self, nbytes: int) -> None:
        self.counter["held_transfers_overdue"].inc()

    # -- EncoderObserver ----------------------------------------------------------------------

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        self.histogram["encoder_batch_size"].observe(images)
        self.histogram["encoder_forward_seconds"].observe(forward_seconds)
        if not ok:
            self.counter["encoder_forward_failures"].inc()

    def queue_waited(self, seconds: float) -> None:
        self.histogram["encoder_queue_wait_seconds"].observe(seconds)

    def cache_looked_up(self, hits: int, misses: int) -> None:
        self.counter["encoder_cache_hits"].inc(hits)
        self.counter["encoder_cache_misses"].inc(misses)

    def cache_size(self, nbytes: int, entries: int) -> None:
        self.gauge["encoder_cache_bytes"].set(nbytes)
        self.gauge["encoder_cache_entries"].set(entries)

    def rejected(self, images: int) -> None:
        self.counter["encoder_rejected_images"].inc(images)

    def cache_poisoned(self, images: int) -> None:
        self.counter["encoder_cache_poisoned"].inc(images)

    # -- StoreObserver ------------------------------------------------------------------------

    def store_connected(self, connected: bool) -> None:
        self.gauge["store_connected"].set(1 if connected else 0)

    def store_looked_up(self, result: str, images: int) -> None:
        self.counter["store_lookups"].labels(result=result).inc(images)

    def store_put(self, result: str) -> None:
        self.counter["store_puts"].labels(result=result).inc()


class _TimedEncoder(PassThroughEncoder):
    """Times each ``encode`` of ``inner`` (only runs that return are timed)."""

    def __init__(self, inner: Encoder, histogram: Histogram) -> None:
        super().__init__(inner)
        self._histogram = histogram

    async def encode(self, images: Sequence[bytes]) -> EmbeddingMemory:
        started = trio.current_time()
        embedding = await self._inner.encode(images)
        self._histogram.observe(trio.current_time() - started)
        return embedding
