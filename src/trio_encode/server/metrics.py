"""Prometheus metrics, fed by lifecycle events and by the HTTP layer.

The metrics live in their own :class:`CollectorRegistry` so that several servers in one process
(tests, the demo) never share or clash over counters. The two "live" gauges and the encoder's
queue depth are read from the service itself at scrape time rather than counted from events: a
registration the ledger lost track of would then still show, which is the leak this gauge
exists to reveal. Counters carry no ``*_created`` series: they double the exposition and no
dashboard of this server reads them.
"""

from __future__ import annotations

import ast
import functools
import inspect
import itertools
import platform
import textwrap
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast, overload, runtime_checkable

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

from trio_encode.logs import dropped_log_lines
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


_Kind = TypeVar("_Kind", Counter, Gauge, Histogram)


class _Metric(Generic[_Kind]):
    """One metric's declaration: its kind, label names and (histograms) buckets; its name,
    after the prefix, is the attribute it is declared as, and its help text that attribute's
    docstring (as a setting's is). On an :class:`Exposed` the attribute is that registry's
    instance, so a misspelt name fails under mypy."""

    def __init__(
        self, kind: type[_Kind], labels: tuple[str, ...] = (), *, buckets: tuple[float, ...] = ()
    ) -> None:
        self.kind: type[_Kind] = kind
        self.labels, self.buckets = labels, buckets
        self.name = ""

    def __set_name__(self, owner: type[Exposed], name: str) -> None:
        self.name = name

    @overload
    def __get__(self, exposed: None, owner: type[Exposed]) -> _Metric[_Kind]: ...
    @overload
    def __get__(self, exposed: Exposed, owner: type[Exposed]) -> _Kind: ...
    def __get__(self, exposed: Exposed | None, owner: type[Exposed]) -> _Metric[_Kind] | _Kind:
        if exposed is None:
            return self
        return cast(_Kind, exposed.__dict__[self.name])  # made by Exposed.__init__

    def make(self, help: str, registry: CollectorRegistry) -> _Kind:
        extra: dict[str, Any] = {"buckets": self.buckets} if self.kind is Histogram else {}
        made: _Kind = self.kind(
            METRIC_PREFIX + self.name, help, self.labels, registry=registry, **extra
        )
        return made


@functools.cache
def attribute_docstrings(cls: type) -> dict[str, str]:
    """The docstring under each attribute assigned in ``cls``'s body (a string literal right
    after the assignment), as one line."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body.body):
        match node, after:
            case (
                ast.Assign(targets=[ast.Name(id=name)]),
                ast.Expr(value=ast.Constant(value=str(doc))),
            ):
                docs[name] = " ".join(doc.split())
    return docs


class Exposed:
    """Every metric the server exposes (besides build_info and the process collectors), each
    declared once, grouped by what it watches (and exposed in this order). A counter declared
    without ``_total`` is exposed with it."""

    # HTTP answers.
    requests_total = _Metric(Counter, ("route", "status"))
    """Answered HTTP requests."""
    request_seconds = _Metric(Histogram, ("route",), buckets=_REQUEST_BUCKETS)
    """Time from a request's arrival to its answer, by route."""
    log_lines_dropped = _Metric(Gauge)
    """Log lines dropped since start because the log's reader was too slow or gone (read at
    scrape time; it only grows)."""
    background_task_failures = _Metric(Counter, ("kind",))
    """Background work of the service that raised (a request's end handling, failure
    messages and pushes), contained: the process and other requests go on; by kind."""
    connection_failures = _Metric(Counter, ("kind",))
    """Connections closed because their server task raised (contained: the process and the
    other connections go on), by the exceptions' class names."""

    # Request scopes.
    live_scopes = _Metric(Gauge)
    """Request scopes alive now."""
    scope_seconds = _Metric(Histogram, ("reason",), buckets=_SCOPE_BUCKETS)
    """A request scope's life, from its first /encode to its release, by how it ended."""
    scopes_closed = _Metric(Counter, ("reason",))
    """Scopes ended, by reason."""
    backstop_expiries = _Metric(Counter)
    """Scopes ended by their deadline."""
    scopes_split = _Metric(Counter)
    """Scopes ended by their deadline after serving some but not all receivers: a request split
    across encoders (or ranks that never sent)."""

    # Transfers and SGLang's completion messages.
    transfer_seconds = _Metric(Histogram, buckets=_TRANSFER_BUCKETS)
    """One transfer into a receiver."""
    transfer_bytes = _Metric(Counter)
    """Bytes written into receivers."""
    engine_errors = _Metric(Counter, ("call", "code"))
    """Transfer-engine calls that returned an error."""
    completion_messages = _Metric(Counter, ("kind", "result"))
    """SGLang completion messages pushed to prefill ranks, by kind (done, error) and result (sent,
    failed)."""

    # Memory registrations, and memory held for transfers the engine stopped waiting for.
    live_registrations = _Metric(Gauge)
    """Memory registrations held now."""
    registrations = _Metric(Counter)
    """Memory registrations made, the arena's left out (see arena_registrations)."""
    deregistrations = _Metric(Counter)
    """Memory registrations released, the arena's left out: equal to registrations_total once
    idle."""
    register_seconds = _Metric(Histogram, buckets=_REGISTER_BUCKETS)
    """One memory registration (pinning, on RDMA)."""
    deregister_seconds = _Metric(Histogram, buckets=_REGISTER_BUCKETS)
    """One memory deregistration."""
    quarantined_registrations = _Metric(Gauge)
    """Registrations whose deregistration failed; their memory is kept and the deregistration
    retried."""
    quarantined_bytes = _Metric(Gauge)
    """Bytes kept alive by quarantined registrations."""
    held_transfers = _Metric(Gauge)
    """Sends whose memory is held out of reuse because a transfer the engine stopped waiting for may
    still read it."""
    held_transfer_bytes = _Metric(Gauge)
    """Bytes held out of reuse for transfers the engine stopped waiting for."""
    held_transfer_oldest_seconds = _Metric(Gauge)
    """Age of the oldest such hold (0 when none)."""
    held_transfers_overdue = _Metric(Counter)
    """Holds that outlived the engine's bound: the engine never reported the transfer ended; the
    memory is kept, never reused."""

    # The arena.
    arena_registrations = _Metric(Gauge)
    """The arena's own registration: 1 while it is held (the server's whole life), never counted in
    registrations_total or deregistrations_total."""
    arena_bytes = _Metric(Gauge)
    """Size of the registered arena (0: none)."""
    arena_leased_bytes = _Metric(Gauge)
    """Arena bytes held by requests and forwards now."""
    arena_cached_bytes = _Metric(Gauge)
    """Arena bytes kept as the embedding cache (leased or not)."""
    arena_fallbacks = _Metric(Gauge)
    """Requests whose embedding did not fit in the arena and was registered on its own (a count
    since start)."""

    # The encoder (encode_seconds is timed here; the rest are its own events, EncoderObserver).
    encode_seconds = _Metric(Histogram, ("modality",), buckets=_ENCODE_BUCKETS)
    """One encoder run, by the part's modality (IMAGE, VIDEO, AUDIO)."""
    encoder_queue_images = _Metric(Gauge)
    """Images waiting for a forward pass now."""
    encoder_batch_size = _Metric(Histogram, buckets=(1, 2, 4, 8, 16, 32, 64))
    """Images per forward pass."""
    encoder_forward_seconds = _Metric(Histogram, buckets=_ENCODE_BUCKETS)
    """One forward pass over a batch."""
    encoder_forward_failures = _Metric(Counter)
    """Forward passes that raised."""
    encoder_queue_wait_seconds = _Metric(Histogram, buckets=_ENCODE_BUCKETS)
    """Time an image waited for its forward pass."""
    encoder_cache_hits = _Metric(Counter)
    """Cached images."""
    encoder_cache_misses = _Metric(Counter)
    """Images not in the cache."""
    encoder_cache_bytes = _Metric(Gauge)
    """Bytes of embeddings cached."""
    encoder_cache_entries = _Metric(Gauge)
    """Embeddings cached."""
    encoder_cache_poisoned = _Metric(Counter, ("source",))
    """Cached embeddings dropped because their bytes no longer matched the checksum recorded when
    they were written (memory changed behind the encoder's back), by where they were found
    (arena, cache, store)."""
    encoder_rejected_images = _Metric(Counter)
    """Images refused because the queue was full."""

    # The cluster-wide store's events (StoreObserver).
    store_connected = _Metric(Gauge)
    """1 while connected to the Mooncake Store master, else 0."""
    store_lookups = _Metric(Counter, ("result",))
    """Images looked up in the cluster-wide store, by result (hit, miss, error, timeout,
    unavailable, poisoned: read whole but not matching the checksum stored with it); all but hit
    run the forward locally."""
    store_puts = _Metric(Counter, ("result",))
    """Embeddings offered to the cluster-wide store, by result (stored, failed, timeout,
    dropped)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        for cls in reversed(type(self).__mro__[:-1]):  # Exposed, then what extends it
            helps = attribute_docstrings(cls)
            for declared in vars(cls).values():
                if isinstance(declared, _Metric):
                    if not helps.get(declared.name):
                        raise TypeError(f"metric {declared.name} is declared without a docstring")
                    self.__dict__[declared.name] = declared.make(helps[declared.name], registry)


class Metrics:
    """The server's metrics; the service's ``LifecycleObserver``, the encoder's
    ``EncoderObserver`` and the store's ``StoreObserver``. Each declared metric is an attribute
    of ``exposed``."""

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
        self.exposed = Exposed(r)
        self._queue_depth: QueueDepth | None = None
        self._connection_failures: dict[str, int] = {}
        self._answered: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.exposed.log_lines_dropped.set_function(dropped_log_lines)
        self.exposed.encoder_queue_images.set_function(
            lambda: self._queue_depth.queued_images if self._queue_depth is not None else 0
        )
        self._arena: Arena | None = None
        # Until attach() names a service, count the live ones from events.
        self._open_scopes = 0
        self._held_registrations = 0
        self.exposed.live_scopes.set_function(lambda: self._open_scopes)
        self.exposed.live_registrations.set_function(lambda: self._held_registrations)

    def attach(self, service: EncodeService) -> None:
        """Read the live gauges from ``service`` itself from now on."""
        self.exposed.live_scopes.set_function(lambda: len(service.registry))
        self.exposed.live_registrations.set_function(lambda: service.ledger.live_registrations)
        self.exposed.held_transfers.set_function(lambda: service.ledger.held)
        self.exposed.held_transfer_bytes.set_function(lambda: service.ledger.held_bytes)
        self.exposed.held_transfer_oldest_seconds.set_function(
            lambda: service.ledger.oldest_hold_seconds
        )
        arena = service.encoder.arena
        if arena is not None:
            self.exposed.arena_bytes.set(arena.nbytes)
            self.exposed.arena_leased_bytes.set_function(lambda: arena.leased_bytes)
            self.exposed.arena_cached_bytes.set_function(lambda: arena.cached_bytes)
            self.exposed.arena_fallbacks.set_function(lambda: arena.fallbacks)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def background_task_failed(self, kind: str) -> None:
        """Count a background task of the service that raised (contained)."""
        self.exposed.background_task_failures.labels(kind=kind).inc()

    def connection_failed(self, kind: str) -> int:
        """Count a connection whose server task failed; how many have, with this kind."""
        self._connection_failures[kind] = self._connection_failures.get(kind, 0) + 1
        self.exposed.connection_failures.labels(kind=kind).inc()
        return self._connection_failures[kind]

    def request_answered(self, route: str, status: int, seconds: float) -> None:
        # Each (route, status)'s series looked up once: a label look-up per answer cost more
        # than the count. Routes are the app's rules (or "other") and statuses a few codes.
        series = self._answered.get((route, status))
        if series is None:
            series = self._answered[route, status] = (
                self.exposed.requests_total.labels(route=route, status=str(status)),
                self.exposed.request_seconds.labels(route=route),
            )
        series[0].inc()
        series[1].observe(seconds)

    def timed(self, encoder: Encoder) -> Encoder:
        """``encoder`` with every run timed into ``encode_seconds``; its queue depth is read
        into ``encoder_queue_images`` when it can tell it."""
        if isinstance(encoder, QueueDepth):
            self._queue_depth = encoder
        return _TimedEncoder(encoder, self.exposed.encode_seconds)

    # -- LifecycleObserver --------------------------------------------------------------------

    def scope_opened(self, req_id: str) -> None:
        self._open_scopes += 1

    def scope_closed(self, req_id: str, reason: str, seconds: float) -> None:
        self._open_scopes -= 1
        self.exposed.scopes_closed.labels(reason=reason).inc()
        self.exposed.scope_seconds.labels(reason=reason).observe(seconds)

    def watch_arena(self, arena: Arena | None) -> None:
        """Count ``arena``'s own registration in ``arena_registrations``, apart from the
        per-request ones (so those are made and released in pairs)."""
        self._arena = arena

    def _is_arena(self, address: int) -> bool:
        return self._arena is not None and address == self._arena.address

    def registered(self, address: int, length: int) -> None:
        self._held_registrations += 1
        if self._is_arena(address):
            self.exposed.arena_registrations.set(1)
        else:
            self.exposed.registrations.inc()

    def deregistered(self, address: int) -> None:
        self._held_registrations -= 1
        if self._is_arena(address):
            self.exposed.arena_registrations.set(0)
        else:
            self.exposed.deregistrations.inc()

    def registration_timed(self, call: RegistrationCall, seconds: float) -> None:
        timed = (
            self.exposed.register_seconds if call == "register" else self.exposed.deregister_seconds
        )
        timed.observe(seconds)

    def transfer_finished(self, req_id: str, nbytes: int, seconds: float) -> None:
        self.exposed.transfer_bytes.inc(nbytes)
        self.exposed.transfer_seconds.observe(seconds)

    def engine_error(self, call: str, code: int) -> None:
        self.exposed.engine_errors.labels(call=call, code=str(code)).inc()

    def backstop_expired(self, req_id: str) -> None:
        self.exposed.backstop_expiries.inc()

    def split_expired(self, req_id: str, served: int, receive_count: int) -> None:
        self.exposed.scopes_split.inc()

    def quarantine_changed(self, regions: int, nbytes: int) -> None:
        self.exposed.quarantined_registrations.set(regions)
        self.exposed.quarantined_bytes.set(nbytes)

    def completion_pushed(self, kind: str, *, ok: bool) -> None:
        self.exposed.completion_messages.labels(kind=kind, result="sent" if ok else "failed").inc()

    def transfer_hold_overdue(self, nbytes: int) -> None:
        self.exposed.held_transfers_overdue.inc()

    # -- EncoderObserver ----------------------------------------------------------------------

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        self.exposed.encoder_batch_size.observe(images)
        self.exposed.encoder_forward_seconds.observe(forward_seconds)
        if not ok:
            self.exposed.encoder_forward_failures.inc()

    def queue_waited(self, seconds: float) -> None:
        self.exposed.encoder_queue_wait_seconds.observe(seconds)

    def cache_looked_up(self, hits: int, misses: int) -> None:
        self.exposed.encoder_cache_hits.inc(hits)
        self.exposed.encoder_cache_misses.inc(misses)

    def cache_size(self, nbytes: int, entries: int) -> None:
        self.exposed.encoder_cache_bytes.set(nbytes)
        self.exposed.encoder_cache_entries.set(entries)

    def rejected(self, images: int) -> None:
        self.exposed.encoder_rejected_images.inc(images)

    def cache_poisoned(self, images: int, source: str) -> None:
        self.exposed.encoder_cache_poisoned.labels(source=source).inc(images)

    # -- StoreObserver ------------------------------------------------------------------------

    def store_connected(self, connected: bool) -> None:
        self.exposed.store_connected.set(1 if connected else 0)

    def store_looked_up(self, result: str, images: int) -> None:
        self.exposed.store_lookups.labels(result=result).inc(images)
        if result == "poisoned":
            self.cache_poisoned(images, "store")

    def store_put(self, result: str) -> None:
        self.exposed.store_puts.labels(result=result).inc()


class _TimedEncoder(PassThroughEncoder):
    """Times each ``encode`` of ``inner`` (only runs that return are timed)."""

    def __init__(self, inner: Encoder, histogram: Histogram) -> None:
        super().__init__(inner)
        self._histogram = histogram

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> EmbeddingMemory:
        started = trio.current_time()
        embedding = await self._inner.encode(images, modality)
        self._histogram.labels(modality=modality).observe(trio.current_time() - started)
        return embedding
