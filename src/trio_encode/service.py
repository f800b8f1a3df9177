"""The encode service: owns the service nursery, the scope registry, the encoder and the engine.

The HTTP layer calls :meth:`EncodeService.encode` and :meth:`EncodeService.send` and maps what
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

from trio_encode.arena import Arena
from trio_encode.engine import EngineError, TransferEngine
from trio_encode.errors import InvalidInput, ShuttingDown
from trio_encode.observer import LifecycleObserver, NullObserver
from trio_encode.registrations import Lease, RegistrationLedger
from trio_encode.registry import ScopeRegistry
from trio_encode.request_types import EmbeddingMemory, EmbeddingShape, Receiver, SendReport

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


@dataclass(frozen=True)
class ServiceSettings:
    send_timeout: float = 180.0
    """Backstop deadline of a request scope, in seconds from its creation."""
    shutdown_grace: float = 30.0
    """How long shutdown lets live scopes finish before cancelling them."""
    remember_released: int = 100_000
    """How many ended req_ids are remembered (so late calls get 410, not a new scope)."""
    remember_seconds: float = 3600.0


@dataclass(frozen=True)
class EncodeReport:
    shape: EmbeddingShape
    receive_count: int


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
            images = await self.encoder.load_items(mm_items)
            if not images:
                raise InvalidInput("mm_items must name at least one image", req_id=req_id)

            async def run_encoder() -> EmbeddingMemory:
                return await self.encoder.encode(images)

            scope = await self.registry.open(
                req_id, receive_count=receive_count, encode=run_encoder
            )
        else:
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
                report = ShutdownReport(
                    finished=len(live) - len(remaining), cut_short=len(remaining)
                )
                log.info(
                    "shutdown: %d scopes finished, %d cut short", report.finished, report.cut_short
                )
                self.shutdown_report = report
                self._shutdown_done.set()
        return report
