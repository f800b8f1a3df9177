"""The encode service: owns the service nursery, the scope registry, the encoder and the engine.

The HTTP layer calls :meth:`EncodeService.encode`, :meth:`EncodeService.pull` and
:meth:`EncodeService.send` and maps what
they return or raise; it never touches a scope's internals or a transfer. The service nursery is
opened by :func:`EncodeService.running` around the whole server's life, so request scopes
outlive the handlers that create them and end only by their own rules, or at shutdown.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import trio
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass

from trio_encode.arena import Arena
from trio_encode.arrivals import Arrivals
from trio_encode.declare import setting
from trio_encode.engine import EngineError, TransferEngine
from trio_encode.errors import EncodeNotArrived, InvalidInput, ShuttingDown
from trio_encode.ledger import Lease, RegistrationLedger
from trio_encode.observer import LifecycleObserver, NullObserver
from trio_encode.request_types import EmbeddingMemory, EmbeddingShape, Receiver, SendReport
from trio_encode.scopes import ScopeRegistry

log = logging.getLogger(__name__)


class Encoder(Protocol):
    """The encoder as the service uses it (``trio_encode.encoder`` provides the real one)."""

    @property
    def ready(self) -> bool: ...

    @property
    def arena(self) -> Arena | None:
        """The registered arena the encoder writes embeddings into; None: per-request
        registration only."""
        ...

    async def load_items(self, items: Sequence[str]) -> list[bytes]:
        """Check and load ``mm_items`` without decoding pixels; raise InvalidInput."""
        ...

    async def encode(self, images: Sequence[bytes]) -> EmbeddingMemory:
        """The embedding of ``images``; its ``checksum`` already computed off the event loop
        when that is costly (the real encoder does it in its worker thread)."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The encoder's long-lived work (batching), run in the service nursery."""
        ...


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ServiceSettings:
    """What the request scopes obey."""

    send_timeout: float = setting(
        180.0,
        group="server",
        gt=0,
        allow_inf_nan=False,
        help="Seconds from a request's first /encode until its scope is ended whatever the "
        "clients do (the backstop): waiting calls get 504, its memory is released.",
    )
    shutdown_grace: float = setting(
        30.0,
        group="server",
        ge=0,
        help="On SIGINT/SIGTERM, seconds live requests may still finish (new ones get 503) "
        "before they are cut short.",
    )
    remember_released: int = setting(
        100_000,
        group="server",
        ge=0,
        help="Ended req_ids remembered, so a late call gets 410 rather than a new scope.",
    )
    remember_seconds: float = setting(
        3600.0,
        group="server",
        ge=0,
        help="Seconds an ended req_id is remembered for (see remember_released).",
    )
    pull_timeout: float = setting(
        180.0,
        group="server",
        gt=0,
        help="Seconds a metadata pull (/scheduler_receive_meta_data) for a req_id that no "
        "/encode has named yet waits for one (then 504); once named, the request's own "
        "deadline bounds the wait.",
    )


@dataclass(frozen=True)
class EncodeReport:
    shape: EmbeddingShape
    receive_count: int | None
    """``None`` while no call has named the count yet."""


@dataclass(frozen=True)
class ShutdownReport:
    finished: int
    """Scopes that ended by their own rules during the grace period."""
    cut_short: int
    """Scopes still live when the grace period ran out, and cancelled."""


class EncodeService:
    """Serves ``/encode`` and ``/send``; create with :meth:`running`."""

    def __init__(
        self,
        *,
        nursery: trio.Nursery,
        engine: TransferEngine,
        encoder: Encoder,
        settings: ServiceSettings,
        observer: LifecycleObserver,
    ) -> None:
        self.engine = engine
        self.encoder = encoder
        self.settings = settings
        self.ledger = RegistrationLedger(engine, observer)
        self.registry = ScopeRegistry(
            nursery,
            engine=engine,
            ledger=self.ledger,
            send_timeout=settings.send_timeout,
            observer=observer,
            remember_released=settings.remember_released,
            remember_seconds=settings.remember_seconds,
        )
        self.shutdown_report: ShutdownReport | None = None
        self._grace = trio.CancelScope(deadline=math.inf)
        self._shutdown_done = trio.Event()
        self.arrivals = Arrivals()

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        *,
        engine: TransferEngine,
        encoder: Encoder,
        settings: ServiceSettings | None = None,
        observer: LifecycleObserver | None = None,
    ) -> AsyncIterator[EncodeService]:
        """Open the service nursery, start the encoder, and on exit shut down gracefully."""
        async with trio.open_nursery() as nursery:
            service = cls(
                nursery=nursery,
                engine=engine,
                encoder=encoder,
                settings=settings or ServiceSettings(),
                observer=observer or NullObserver(),
            )
            await nursery.start(service.ledger.run)
            arena_lease = await service._register_arena()
            try:
                await nursery.start(encoder.run)
                yield service
            finally:
                with trio.CancelScope(shield=True):
                    await service.shutdown()
                    if arena_lease is not None:
                        await service._release_arena(arena_lease)
                nursery.cancel_scope.cancel()

    @property
    def ready(self) -> bool:
        return self.encoder.ready and not self.registry.closed

    async def _register_arena(self) -> Lease | None:
        """Register the encoder's arena once, for the service's life. Its segments are then
        leased from this registration, so sending them registers nothing. A refusal stops the
        server from starting: an engine that cannot register the arena would fail every send."""
        arena = self.encoder.arena
        if arena is None:
            return None
        lease = await self.ledger.acquire(arena.address, arena.nbytes, owner=arena)
        log.info("arena of %d bytes registered at %#x", arena.nbytes, arena.address)
        return lease

    async def _release_arena(self, lease: Lease) -> None:
        """Deregister the arena once every scope has ended (shielded by the caller)."""
        try:
            await self.ledger.release(lease)
        except EngineError as exc:
            log.error("deregistering the arena failed: %s", exc)

    async def encode(
        self, req_id: str, mm_items: Sequence[str], *, receive_count: int | None
    ) -> EncodeReport:
        """Run the encoder once for ``req_id``; siblings share the run and its answer."""
        scope = self.registry.find_live(req_id)
        if scope is None:
            if self.registry.closed:
                raise ShuttingDown("the server is shutting down", req_id=req_id)
            # Check the input before a scope exists: bad input must leave nothing behind.
            try:
                images = await self.encoder.load_items(mm_items)
                if not images:
                    raise InvalidInput("mm_items must name at least one image", req_id=req_id)
            except InvalidInput as exc:
                # Pulls already waiting for this id learn why now, not at their timeout.
                self.arrivals.announce(req_id, error=exc)
                raise

            async def run_encoder() -> EmbeddingMemory:
                return await self.encoder.encode(images)

            scope = await self.registry.open(
                req_id, receive_count=receive_count, encode=run_encoder
            )
            self.arrivals.announce(req_id)
        else:
            scope.check_receive_count(receive_count)
        shape = await scope.wait_encoded()
        return EncodeReport(shape, scope.receive_count)

    async def pull(self, req_id: str, *, receive_count: int | None = None) -> EncodeReport:
        """Wait for ``req_id``'s encode to publish its shape, without starting one.

        A pull may come before any ``/encode`` names the id: it then waits for one up to
        ``pull_timeout``. Once the scope exists, the scope's own deadline bounds the wait.
        """
        scope = self.registry.find_live(req_id)
        if scope is None:
            if self.registry.closed:
                raise ShuttingDown("the server is shutting down", req_id=req_id)
            with trio.move_on_after(self.settings.pull_timeout) as waited:
                await self.arrivals.wait(req_id)
            if waited.cancelled_caught:
                raise EncodeNotArrived(
                    f"no /encode named this req_id within {self.settings.pull_timeout:g} s",
                    req_id=req_id,
                )
            scope = self.registry.find_live(req_id)
            if scope is None and self.registry.closed:  # woken by shutdown, not by an /encode
                raise ShuttingDown("the server is shutting down", req_id=req_id)
            scope = scope or self.registry.require_live(req_id)
        scope.check_receive_count(receive_count)
        shape = await scope.wait_encoded()
        return EncodeReport(shape, scope.receive_count)

    async def send(
        self,
        req_id: str,
        receiver: Receiver,
        *,
        receive_count: int | None = None,
    ) -> SendReport:
        """Transfer ``req_id``'s embedding into ``receiver``; returns once the bytes landed.

        A receiver that already got its bytes and asks again after the request completed (its
        answer was lost) gets the same answer, marked as a repeat, instead of 410.
        """
        repeat = self.registry.repeat_send(req_id, receiver)
        if repeat is not None:
            return repeat
        scope = self.registry.require_live(req_id)
        scope.check_receive_count(receive_count)
        return await scope.send(receiver)

    def end_grace(self) -> None:
        """Cut a running shutdown's grace period short: live scopes are cancelled now."""
        self._grace.cancel()

    async def shutdown(self) -> ShutdownReport:
        """Refuse new requests, let live scopes finish within the grace, cancel the rest.

        Returns once every scope has released its registration and embedding. Asking again
        while the grace runs (a second signal), or cancelling the caller, cuts the grace short
        instead of starting it over; the release still completes, shielded.
        """
        if self.registry.closed:
            self.end_grace()
            with trio.CancelScope(shield=True):
                await self._shutdown_done.wait()
            assert self.shutdown_report is not None
            return self.shutdown_report
        self.registry.closed = True
        self.arrivals.announce_all()
        live = self.registry.scopes()
        try:
            self._grace.deadline = trio.current_time() + self.settings.shutdown_grace
            with self._grace:
                for scope in live:
                    await scope.wait_ended()
        finally:
            with trio.CancelScope(shield=True):
                remaining = self.registry.scopes()
                for scope in remaining:
                    scope.cancel()
                for scope in remaining:
                    await scope.wait_ended()
                # Memory whose deregistration failed gets one more try before the engine goes.
                await self.ledger.retry_quarantined()
                report = ShutdownReport(
                    finished=len(live) - len(remaining), cut_short=len(remaining)
                )
                log.info(
                    "shutdown: %d scopes finished, %d cut short", report.finished, report.cut_short
                )
                self.shutdown_report = report
                self._shutdown_done.set()
        return report
