"""Running the app under hypercorn's Trio worker, inside the service's lifetime.

Order matters. The service nursery is opened first and closed last, so every request scope
outlives every HTTP handler that joined it. Shutdown (a signal, or :meth:`RunningServer.stop`)
goes:

1. the service stops opening scopes (new ``/encode`` -> 503) but keeps serving live scopes, so
   sibling ranks can still ``/send`` during the grace period;
2. after the grace, scopes still live are cancelled (cut short); each waits for any transfer
   thread it runs, then deregisters and drops its embedding;
3. only then hypercorn stops listening and finishes the connections it holds;
4. the service nursery closes (the encoder's background work ends with it).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import trio
from hypercorn.config import Config, Sockets
from hypercorn.utils import wrap_app

from trio_encode.engine import TransferEngine
from trio_encode.engine.rdma_devices import check_rdma
from trio_encode.server import heap
from trio_encode.server.app import create_app
from trio_encode.server.connections import serve_connections
from trio_encode.server.listeners import WILDCARDS, listening_sockets
from trio_encode.server.loading import LoadingEncoder
from trio_encode.server.metrics import Metrics
from trio_encode.service import Encoder, EncodeService, ShutdownReport
from trio_encode.settings import ServerSettings
from trio_encode.sizes import format_size

if TYPE_CHECKING:
    from trio_encode.encoder import VisionModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class RunningServer:
    """A server that is accepting requests; what in-process callers (tests, the demo) need."""

    url: str
    """``http://host:port`` with the port actually bound (also when 0 was asked for)."""
    service: EncodeService
    metrics: Metrics
    _stop: trio.Event = field(default_factory=trio.Event)

    def stop(self) -> None:
        """Begin a graceful shutdown (what SIGINT/SIGTERM do); returns at once."""
        self._stop.set()


KEEP_ALIVE_SECONDS = 75.0
"""An idle keep-alive connection is closed after this long. Longer than the idle expiry of
the clients that call an encoder (httpx's is 5 s): a server that closes first races a client
reusing the connection, whose request then meets a reset. Bounded, so that clients holding
connections they no longer use cannot keep every descriptor."""


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _hypercorn_config(settings: ServerSettings) -> Config:
    config = Config()
    config.bind = [_bind(settings.host, settings.port)]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    # By the time hypercorn is asked to stop, every scope has ended, so a handler still
    # running is one finishing its answer: a few seconds is plenty.
    config.graceful_timeout = 5.0
    # A burst of connections (a tokenizer's fan-out, or a scan) waits in the kernel's queue
    # rather than being dropped into SYN retries a second later (hypercorn's default is 100;
    # the kernel caps it at net.core.somaxconn).
    config.backlog = 1024
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    return config


def listen(settings: ServerSettings) -> Sockets:
    """The server's listening sockets, bound now: a port already in use fails here, with
    ``OSError`` (``Address already in use``), before any engine or memory is set up."""
    config = _hypercorn_config(settings)
    try:
        sockets = config.create_sockets()
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot listen on {config.bind[0]}: {exc.strerror} (--host, --port)"
        ) from None
    try:
        for sock in sockets.insecure_sockets:
            sock.listen(config.backlog)
    except BaseException:
        for sock in sockets.insecure_sockets:
            sock.close()
        raise
    return sockets


async def serve(
    settings: ServerSettings,
    *,
    engine: TransferEngine,
    encoder: Encoder,
    metrics: Metrics | None = None,
    handle_signals: bool = False,
    sockets: Sockets | None = None,
    task_status: trio.TaskStatus[RunningServer] = trio.TASK_STATUS_IGNORED,
) -> ShutdownReport:
    """Serve until stopped; return how the live scopes ended.

    With ``nursery.start(serve, ...)`` the caller gets a :class:`RunningServer` once the socket
    is bound. ``handle_signals`` (main thread only) makes SIGINT and SIGTERM stop it gracefully.
    ``sockets``: bound already by :func:`listen` (else bound here, after the service started).
    """
    metrics = metrics if metrics is not None else Metrics()
    metrics.watch_arena(encoder.arena)
    async with EncodeService.running(
        engine=engine,
        encoder=metrics.timed(encoder),
        settings=settings.service,
        observer=metrics,
    ) as service:
        metrics.attach(service)
        warn_any_receiver(settings)
        app = create_app(service, metrics, settings)
        config = _hypercorn_config(settings)
        stop_listening = trio.Event()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                partial(
                    serve_connections,
                    wrap_app(app, config.wsgi_max_body_size, "asgi"),
                    config,
                    sockets if sockets is not None else listen(settings),
                    shutdown_trigger=stop_listening.wait,
                    connection_failed=metrics.connection_failed,
                )
            )
            running = RunningServer(binds[0], service, metrics)
            log.info("serving on %s (transfer engine %s)", running.url, engine.session_id)
            watching = trio.CancelScope()
            if handle_signals:
                nursery.start_soon(_stop_on_signal, running, watching)
            trimming = trio.CancelScope()
            if settings.heap_trim_seconds > 0:
                nursery.start_soon(_trim_heap, settings.heap_trim_seconds, trimming)
            task_status.started(running)
            await running._stop.wait()
            log.info(
                "shutting down: %d live scopes get %.1f s to finish",
                len(service.registry),
                settings.service.shutdown_grace,
            )
            report = await service.shutdown()
            watching.cancel()
            trimming.cancel()
            stop_listening.set()
    leaked = service.ledger.live_registrations
    log.info(
        "stopped: %d scopes finished, %d cut short, %d registrations left",
        report.finished,
        report.cut_short,
        leaked,
    )
    if leaked:
        log.error("%d registrations were still held at exit", leaked)
    return report


async def _trim_heap(seconds: float, trimming: trio.CancelScope) -> None:
    with trimming:
        await heap.trim_every(seconds)


async def _stop_on_signal(running: RunningServer, watching: trio.CancelScope) -> None:
    # The first signal starts a graceful shutdown; a second one (an impatient Ctrl-C) cuts its
    # grace period short. Either way every registration is released before the process exits.
    with watching, trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not running._stop.is_set():
                log.info("received %s: shutting down gracefully (again to cut it short)", name)
                running.stop()
            else:
                log.warning("received %s again: cutting the grace period short", name)
                running.service.end_grace()


@asynccontextmanager
async def open_server(
    settings: ServerSettings,
    *,
    engine: TransferEngine,
    encoder: Encoder,
    metrics: Metrics | None = None,
) -> AsyncIterator[RunningServer]:
    """Run a server for the body of an ``async with``; on exit stop it and wait until every
    scope has ended. The shutdown report is then in ``running.service.shutdown_report``."""
    async with trio.open_nursery() as nursery:
        running: RunningServer = await nursery.start(
            partial(serve, settings, engine=engine, encoder=encoder, metrics=metrics)
        )
        try:
            yield running
        finally:
            running.stop()


def warn_open_engine_ports(opened: set[tuple[str, int]]) -> None:
    """Log the transfer engine's ports that listen on every interface (Mooncake binds them so
    whatever its hostname says): reaching one is reaching the engine's registered memory."""
    open_ports = sorted(f"{address}:{port}" for address, port in opened if address in WILDCARDS)
    if open_ports:
        log.warning(
            "the transfer engine listens on %s: every interface, whatever engine_hostname "
            "says (Mooncake has no bind address). Whoever reaches these ports can read and "
            "write its registered memory: firewall them to the prefill ranks "
            "(docs/operations.md, Security)",
            ", ".join(open_ports),
        )


def warn_any_receiver(settings: ServerSettings) -> None:
    if settings.receiver_policy.any_host:
        log.warning(
            "allowed_receivers is '*': /send writes to any host a caller names. Only run so "
            "where the transfer engine's network reaches prefill ranks alone."
        )


async def run_server(settings: ServerSettings) -> ShutdownReport:
    """What ``trio-encode serve`` runs: a Mooncake engine, the server listening at once, the
    image encoder loading behind it (``/readyz`` is 503 until it is loaded), stopped gracefully
    by SIGINT or SIGTERM. Built from the parts below (:func:`listening`, :func:`start_engine`,
    :func:`run_listening`), which a drill composes with parts of its own."""
    with listening(settings) as sockets:
        engine = await start_engine(settings)
        return await run_listening(settings, sockets, engine, model_loader(settings))


@contextmanager
def listening(settings: ServerSettings) -> Iterator[Sockets]:
    """The server's sockets, bound and listening once what would fail after "serving on" has
    been checked (:func:`check_start`); closed on the way out."""
    check_start(settings)
    # The port next: one in use stops the start before the engine and the arena exist.
    sockets = listen(settings)
    bound = sockets.insecure_sockets[0].getsockname()
    log.info("starting", extra=startup_facts(settings, bind=_bind(*bound[:2])))
    try:
        yield sockets
    finally:
        for sock in sockets.insecure_sockets:
            sock.close()  # idempotent: hypercorn closes those it served on


async def start_engine(settings: ServerSettings) -> TransferEngine:
    """The Mooncake engine the settings describe, its open ports named in the log."""
    from trio_encode.engine.mooncake import MooncakeEngine

    if settings.malloc_arenas is not None and not heap.limit_arenas(settings.malloc_arenas):
        log.info("malloc arenas not limited (not glibc)")
    before = listening_sockets()
    engine = await MooncakeEngine.create(settings.engine)
    log.info("transfer engine ready at %s over %s", engine.session_id, settings.engine.protocol)
    warn_open_engine_ports(listening_sockets() - before)
    return engine


def model_loader(settings: ServerSettings) -> Callable[[], VisionModel]:
    """Loads the model the settings name (blocking: run in a worker thread)."""
    from trio_encode.encoder import load_backend

    return partial(load_backend, settings.encoder)


def check_start(settings: ServerSettings) -> None:
    """Refuse, before listening, what would otherwise fail after "serving on" or serve
    broken: RDMA asked for on a host without RDMA devices, and a model directory the loader
    would fail on (no weights, a truncated file, an unsupported model, a dtype it names that
    cannot be served). A :class:`ValueError` naming the flag."""
    check_rdma(settings.engine.protocol, settings.engine.device)
    model_dir = settings.encoder.model
    if model_dir is None:
        return
    from trio_encode.encoder.hf import check_model_dir
    from trio_encode.encoder.settings import config_dtype

    try:
        check_model_dir(model_dir)
    except ValueError as exc:
        raise ValueError(f"--model: {exc}") from None
    if settings.encoder.dtype == "auto":
        try:
            config_dtype(model_dir / "config.json")
        except ValueError as exc:
            raise ValueError(f"--dtype auto: {exc}") from None


def startup_facts(settings: ServerSettings, *, bind: str) -> dict[str, str]:
    """The settings an operator checks first, for the start-up line: which config file, model,
    device, dtype, protocol, arena, auth and address are in effect."""
    encoder = settings.encoder
    if encoder.model is not None:
        model = f"hf:{encoder.model}"
    else:
        model = f"built-in ViT {encoder.image_size}px w{encoder.width} d{encoder.depth}"
        model += f" ({encoder.weights})" if encoder.weights else " (seeded random weights)"
    facts = {
        "config": str(settings.config) if settings.config else "none",
        "model": model,
        "device": encoder.device,
        "dtype": encoder.model_dtype,
        "protocol": settings.engine.protocol,
        "arena": format_size(encoder.arena_bytes) if encoder.arena_bytes else "off",
        "auth": "on" if settings.token else "off",
        "bind": bind,
    }
    if settings.engine.protocol == "rdma":
        facts["rdma_device"] = settings.engine.device or "any"
    return facts


async def run_listening(
    settings: ServerSettings,
    sockets: Sockets,
    engine: TransferEngine,
    load_model: Callable[[], VisionModel],
) -> ShutdownReport:
    """Serve on ``sockets`` with ``engine`` until SIGINT or SIGTERM, the encoder built around
    ``load_model()`` loading behind the listening server."""
    from trio_encode.encoder import ImageEncoder, arena_for

    metrics = Metrics()
    store = None
    if settings.encoder.store_master is not None:
        from trio_encode.encoder.store import MooncakeEmbeddingStore

        store = MooncakeEmbeddingStore.from_settings(
            settings.encoder,
            hostname=settings.engine.hostname,
            protocol=settings.engine.protocol,
            device=settings.engine.device,
            observer=metrics,
        )

    arena = arena_for(settings.encoder)

    def load() -> Encoder:
        model = load_model()
        encoder = ImageEncoder(model, settings.encoder, observer=metrics, store=store, arena=arena)
        log.info("encoder loaded: %s", encoder.info.model_id)
        return encoder

    encoder = LoadingEncoder(load, arena=arena, warmup=settings.encoder.warmup)
    async with trio.open_nursery() as nursery:
        running: RunningServer = await nursery.start(
            partial(
                serve,
                settings,
                engine=engine,
                encoder=encoder,
                metrics=metrics,
                handle_signals=True,
                sockets=sockets,
            )
        )
        encoder.start_loading()
    report = running.service.shutdown_report
    assert report is not None  # serve() returns only after its shutdown
    return report
