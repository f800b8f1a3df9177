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
import re
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import trio
from pydantic.dataclasses import dataclass as pydantic_dataclass

from trio_encode.arena import Arena
from trio_encode.arrivals import Arrivals
from trio_encode.completion import CompletionMessage, CompletionPusher, Endpoint
from trio_encode.declare import SETTINGS, in_group
from trio_encode.engine import EngineError, TransferEngine
from trio_encode.errors import (
    CompletionFailed,
    EncodeNotArrived,
    InvalidInput,
    Overloaded,
    ReceiverHostMismatch,
    RequestError,
)
from trio_encode.ledger import Lease, RegistrationLedger
from trio_encode.observer import LifecycleObserver, NullObserver
from trio_encode.receivers import receiver_host, same_host
from trio_encode.request_types import (
    EmbeddingMemory,
    EmbeddingShape,
    Receiver,
    SendReport,
    grid_dim,
)
from trio_encode.scope import Failure, RequestScope
from trio_encode.scopes import ScopeRegistry
from trio_encode.sizes import ByteSize, GiB

log = logging.getLogger(__name__)


class _HeldMemory:
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


class PassThroughEncoder:
    """Passes every call to ``inner``: the base of wrappers that change only some calls."""

    def __init__(self, inner: Encoder) -> None:
        self._inner = inner

    @property
    def ready(self) -> bool:
        return self._inner.ready

    @property
    def arena(self) -> Arena | None:
        return self._inner.arena

    async def load_items(self, items: Sequence[str]) -> list[bytes]:
        return await self._inner.load_items(items)

    async def encode(self, images: Sequence[bytes]) -> EmbeddingMemory:
        return await self._inner.encode(images)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self._inner.run(task_status=task_status)


server_setting = in_group("server")


@pydantic_dataclass(frozen=True, config=SETTINGS)
class ServiceSettings:
    """What the request scopes obey."""

    send_timeout: float = server_setting(180.0, gt=0, allow_inf_nan=False)
    """Seconds from a request's first /encode until its scope is ended whatever the clients do (the
    backstop): waiting calls get 504, its memory is released."""
    shutdown_grace: float = server_setting(30.0, ge=0)
    """On SIGINT/SIGTERM, seconds live requests may still finish (new ones get 503) before they are
    cut short."""
    remember_released: int = server_setting(100_000, ge=0)
    """Ended req_ids remembered, so a late call gets 410 rather than a new scope."""
    remember_seconds: float = server_setting(3600.0, ge=0)
    """Seconds an ended req_id is remembered for (see remember_released)."""
    pull_timeout: float = server_setting(180.0, gt=0)
    """Seconds a metadata pull (/scheduler_receive_meta_data) for a req_id that no /encode has named
    yet waits for one (then 504); once named, the request's own deadline bounds the wait."""
    max_live_scopes: int = server_setting(4096, gt=0)
    """Requests alive at once (encoded, not yet sent to every receiver); a new /encode past it gets
    503, so clients that never /send cannot pile scopes up to the backstop."""
    max_held_bytes: ByteSize = server_setting(2 * GiB, gt=0)
    """Embedding bytes the live requests may hold together (a cached row several share counts once);
    a new /encode past it gets 503 until sends complete."""
    receivers_match_prefill_host: bool = server_setting(True)
    """When an /encode names prefill_host (SGLang's does), its /send calls must name receivers on
    that host (403 otherwise); turn off for tensor-parallel ranks spread over several hosts."""
    completion_messages: bool = server_setting(True)
    """Push SGLang's completion message to the ZMQ endpoint (prefill_host, embedding_port) a /send
    names once its bytes landed, and the error to those an /encode names when it fails: SGLang's
    prefill completes a part only on it."""
    completion_timeout: float = server_setting(5.0, gt=0)
    """Seconds a completion message may take to reach its prefill rank; past it, that /send gets 502
    (completion_failed)."""


@dataclass(frozen=True)
class EncodeReport:
    shape: EmbeddingShape
    receive_count: int | None
    """``None`` while no call has named the count yet."""


@dataclass(frozen=True)
class Part:
    """Where a request sits in SGLang's split of a prefill request (one part per encode
    server, ids ``{rid}_local_part_{i}``), and the prefill ranks its ``/encode`` named."""

    num_parts: int = 1
    part_idx: int = 0
    endpoints: tuple[Endpoint, ...] = ()

    @staticmethod
    def family(req_id: str, part: Part) -> str | None:
        """The request's id without its part suffix, when it is a part of several: siblings
        share it. None for a whole request."""
        match = _PART_ID.match(req_id)
        if part.num_parts < 2 or match is None or int(match.group(2)) != part.part_idx:
            return None
        return match.group(1)


@dataclass(frozen=True)
class Notify:
    """Where a ``/send`` wants SGLang's completion message: the prefill rank's socket, and the
    part of the request the send carries (used when its ``/encode`` named none)."""

    endpoint: Endpoint
    part_idx: int = 0


_PART_ID = re.compile(r"^(.*)_local_part_([0-9]+)$")
_FAMILY = "parts of\0"  # keys of failed families, apart from req_ids

REMEMBER_FAILURES = 10_000
"""Failed requests (and families of parts) remembered for their late pulls, at most."""


@dataclass
class _Live:
    """What the service keeps beside a live scope: its part, and the endpoints named."""

    part: Part
    endpoints: set[Endpoint]


@dataclass(frozen=True)
class ShutdownReport:
    finished: int
    """Scopes that ended by their own rules during the grace period."""
    cut_short: int
    """Scopes still live when the grace period ran out, and cancelled."""
    held_bytes: int = 0
    """Memory still held at exit for transfers the engine stopped waiting for and Mooncake had
    not ended (kept registered and allocated until the process exits)."""


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
        # Held memory comes back within the engine's progress timeout (below send_timeout)
        # per wave of a frozen peer's transfers; twice send_timeout is past any of that.
        self.ledger = RegistrationLedger(engine, observer, overdue_after=2 * settings.send_timeout)
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
        self._prefill_hosts: weakref.WeakKeyDictionary[RequestScope, str] = (
            weakref.WeakKeyDictionary()
        )
        """``prefill_host`` of each live request whose /encode named one."""
        self._nursery = nursery
        self._held = _HeldMemory()
        self.completions = (
            CompletionPusher(timeout=settings.completion_timeout, observer=observer)
            if settings.completion_messages
            else None
        )
        """Pushes SGLang's completion messages; None when they are turned off."""
        self._live: dict[str, _Live] = {}
        self._failures: OrderedDict[str, tuple[Failure, float]] = OrderedDict()
        """Recent failures by req_id (or part family), with when. A pull arriving after its
        request failed gets the failure at once, also where the scope left no tombstone (bad
        input, after which a corrected /encode may reuse the id and clears the entry)."""

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        *,
        engine: TransferEngine,
        encoder: Encoder,
        settings: ServiceSettings = ServiceSettings(),
        observer: LifecycleObserver | None = None,
    ) -> AsyncIterator[EncodeService]:
        """Open the service nursery, start the encoder, and on exit shut down gracefully."""
        async with trio.open_nursery() as nursery:
            service = cls(
                nursery=nursery,
                engine=engine,
                encoder=encoder,
                settings=settings,
                observer=observer or NullObserver(),
            )
            await nursery.start(service.ledger.run)
            if service.completions is not None:
                await nursery.start(service.completions.run)
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

    @property
    def held_bytes(self) -> int:
        """Embedding bytes the live scopes hold, each memory range once however many requests
        share it (those still encoding count when encoded)."""
        return self._held.nbytes

    def _admit(self, req_id: str) -> None:
        """Refuse a new request at a capacity limit (503): before any item is loaded."""
        limits = self.settings
        if len(self.registry) >= limits.max_live_scopes:
            raise Overloaded(
                f"{len(self.registry)} requests are alive, the most this server holds "
                "(max_live_scopes); retry when some have been sent",
                req_id=req_id,
            )
        if self.held_bytes >= limits.max_held_bytes:
            raise Overloaded(
                f"live requests hold {self.held_bytes} embedding bytes, the most this server "
                "holds (max_held_bytes); retry when some have been sent",
                req_id=req_id,
            )

    async def encode(
        self,
        req_id: str,
        mm_items: Sequence[str],
        *,
        receive_count: int | None,
        part: Part | None = None,
        prefill_host: str | None = None,
    ) -> EncodeReport:
        """Run the encoder once for ``req_id``; siblings share the run and its answer.

        ``part``: where the request sits among its prefill request's parts, and the prefill
        ranks to tell if the encode fails. ``prefill_host``: the host every receiver of the
        request must be on (when ``receivers_match_prefill_host``).
        """
        part = part or Part()
        scope = self.registry.find_live(req_id)
        if scope is None:
            self.registry.refuse_if_closed(req_id)
            self._raise_if_family_failed(req_id, part)
            self._admit(req_id)
            # Check the input before a scope exists: bad input must leave nothing behind.
            try:
                images = await self.encoder.load_items(mm_items)
                if not images:
                    raise InvalidInput("mm_items must name at least one image", req_id=req_id)
            except InvalidInput as exc:
                # Pulls already waiting for this id learn why now, not at their timeout.
                self.arrivals.announce(req_id, error=exc)
                self._failed(req_id, part, set(part.endpoints), Failure.of(exc))
                raise

            taken: list[tuple[int, int]] = []

            async def run_encoder() -> EmbeddingMemory:
                embedding = await self.encoder.encode(images)
                taken.extend(self._held.take(embedding))  # the scope keeps it from here
                return embedding

            scope = await self.registry.open(
                req_id, receive_count=receive_count, encode=run_encoder
            )
            self._nursery.start_soon(self._give_back_when_ended, scope, taken)
            if prefill_host is not None and self.settings.receivers_match_prefill_host:
                self._prefill_hosts[scope] = prefill_host
            if req_id not in self._live:
                self._failures.pop(req_id, None)  # a corrected retry of a bad request
                live = self._live[req_id] = _Live(part, set(part.endpoints))
                self._nursery.start_soon(self._follow, scope, live)
            self.arrivals.announce(req_id)
        else:
            scope.check_receive_count(receive_count)
        known = self._live.get(req_id)
        if known is not None:
            known.endpoints.update(part.endpoints)
        shape = await scope.wait_encoded()
        return EncodeReport(shape, scope.receive_count)

    async def _give_back_when_ended(
        self, scope: RequestScope, taken: list[tuple[int, int]]
    ) -> None:
        """Beside each scope: what its embedding took from :attr:`held_bytes` goes back when
        the scope has released it."""
        try:
            await scope.wait_ended()
        finally:
            self._held.give_back(taken)

    def _check_prefill_host(self, scope: RequestScope, receiver: Receiver) -> None:
        prefill_host = self._prefill_hosts.get(scope)
        host = receiver_host(receiver.session_id)
        if prefill_host is not None and not same_host(host, prefill_host):
            raise ReceiverHostMismatch(
                f"receiver host {host!r} is not this request's prefill_host {prefill_host!r}",
                req_id=scope.req_id,
            )

    async def _follow(self, scope: RequestScope, live: _Live) -> None:
        """Beside each scope: when its encode fails, tell every prefill rank named so far and
        end its sibling parts here; forget it when it ends."""
        try:
            try:
                await scope.wait_encoded()
            except RequestError as exc:
                failure = scope.failure or Failure.of(exc)
                self._failed(scope.req_id, live.part, live.endpoints, failure)
            await scope.wait_ended()
        finally:
            if self._live.get(scope.req_id) is live:
                del self._live[scope.req_id]

    def _failed(
        self,
        req_id: str,
        part: Part,
        endpoints: set[Endpoint],
        failure: Failure,
    ) -> None:
        """``req_id`` failed: remember why for its late pulls, push the error to each rank
        named, and end its sibling parts on this server (their ranks will never send them)."""
        self._remember_failure(req_id, failure)
        for endpoint in endpoints:
            self._push_error(endpoint, req_id, part, failure)
        family = Part.family(req_id, part)
        if family is None:
            return
        sibling_failure = Failure(
            failure.error_type, f"part {part.part_idx} of this request failed: {failure.message}"
        )
        self._remember_failure(_FAMILY + family, sibling_failure)
        for index in range(part.num_parts):
            sibling = f"{family}_local_part_{index}"
            if sibling == req_id:
                continue
            self.arrivals.announce(sibling, error=sibling_failure.error(sibling))
            scope = self.registry.live(sibling)
            if scope is not None:
                scope.abandon(sibling_failure)

    def _remember_failure(self, key: str, failure: Failure) -> None:
        now = trio.current_time()
        self._failures[key] = (failure, now)
        self._failures.move_to_end(key)
        while self._failures:
            _, at = next(iter(self._failures.values()))
            if len(self._failures) <= REMEMBER_FAILURES and now - at <= self.settings.pull_timeout:
                break
            self._failures.popitem(last=False)

    def _recent_failure(self, key: str) -> Failure | None:
        entry = self._failures.get(key)
        if entry is None or trio.current_time() - entry[1] > self.settings.pull_timeout:
            return None
        return entry[0]

    def _raise_if_failed(self, req_id: str, part: Part | None = None) -> None:
        """A call for a request that failed recently (no live scope) gets its error now."""
        own = self._recent_failure(req_id)
        if own is not None:
            raise own.error(req_id)
        self._raise_if_family_failed(req_id, part)

    def _raise_if_family_failed(self, req_id: str, part: Part | None) -> None:
        match = _PART_ID.match(req_id)
        if match is None or (part is not None and Part.family(req_id, part) is None):
            return
        sibling = self._recent_failure(_FAMILY + match.group(1))
        if sibling is not None:
            raise sibling.error(req_id)

    def _push_error(self, endpoint: Endpoint, req_id: str, part: Part, failure: Failure) -> None:
        """Tell one prefill rank that this part failed, in the background (best effort)."""
        if self.completions is None or self.registry.closed:
            return
        message = CompletionMessage.failed(
            req_id, part.num_parts, part.part_idx, failure.message, failure.error_type.status
        )
        self._nursery.start_soon(self._push_quietly, endpoint, message)

    async def _push_quietly(self, endpoint: Endpoint, message: CompletionMessage) -> None:
        assert self.completions is not None
        try:
            await self.completions.push(endpoint, message.to_bytes(), kind="error")
        except CompletionFailed as exc:
            log.warning("error message not delivered: %s", exc, extra={"req_id": message.req_id})

    async def pull(self, req_id: str, *, receive_count: int | None = None) -> EncodeReport:
        """Wait for ``req_id``'s encode to publish its shape, without starting one.

        A pull may come before any ``/encode`` names the id: it then waits for one up to
        ``pull_timeout``. Once the scope exists, the scope's own deadline bounds the wait.
        """
        scope = self.registry.find_live(req_id)
        if scope is None:
            self.registry.refuse_if_closed(req_id)
            self._raise_if_failed(req_id)
            with trio.move_on_after(self.settings.pull_timeout) as waited:
                await self.arrivals.wait(req_id)
            if waited.cancelled_caught:
                raise EncodeNotArrived(
                    f"no /encode named this req_id within {self.settings.pull_timeout:g} s",
                    req_id=req_id,
                )
            scope = self.registry.find_live(req_id)
            if scope is None:  # woken by shutdown, not by an /encode
                self.registry.refuse_if_closed(req_id)
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
        notify: Notify | None = None,
    ) -> SendReport:
        """Transfer ``req_id``'s embedding into ``receiver``; returns once the bytes landed
        and, when ``notify`` names a prefill rank, once that rank has SGLang's completion
        message (:class:`CompletionFailed` if it cannot be delivered).

        The message goes before the 200: SGLang's rank fails a request at once on a non-200
        ``/send``, while a 200 without the message leaves it waiting for its own timeout. A
        repeat (a receiver already served, whose answer was lost) moves nothing and pushes
        nothing: a second message for a part fails SGLang's request as a duplicate.
        A send for a request that failed pushes the failure to ``notify`` too.

        The receiver's host must be the ``prefill_host`` its ``/encode`` named, if it named one
        (and ``receivers_match_prefill_host`` is on); which hosts may receive at all is the HTTP
        layer's check (``allowed_receivers``), where session ids from outside come in.
        """
        repeat = self.registry.repeat_send(req_id, receiver)
        if repeat is not None:
            return repeat
        live = self._live.get(req_id)  # taken now: the scope may end before the push
        asked = Part(notify.part_idx + 1, notify.part_idx) if notify is not None else Part()
        part = live.part if live is not None else asked
        try:
            scope = self.registry.find_live(req_id)
            if scope is None:
                self._raise_if_failed(req_id)
                scope = self.registry.require_live(req_id)
            self._check_prefill_host(scope, receiver)
            scope.check_receive_count(receive_count)
            report = await scope.send(receiver)
        except RequestError as exc:
            if notify is not None:
                self._push_error(notify.endpoint, req_id, part, Failure.of(exc))
            raise
        if notify is not None and self.completions is not None and not report.repeat:
            shape = report.shape
            message = CompletionMessage(
                req_id,
                part.num_parts,
                part.part_idx,
                grid_dim=grid_dim(shape.grids),
                shape=(shape.rows, shape.dim),
                dtype=shape.dtype,
            )
            try:
                await self.completions.push(notify.endpoint, message.to_bytes(), kind="done")
            except CompletionFailed as exc:
                exc.req_id = req_id
                log.error("%s", exc.message, extra={"req_id": req_id})
                raise
        return report

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
                # Transfers the scopes stopped waiting for end within the engine's progress
                # timeout (below send_timeout): their memory is released then; what is still
                # held after that is kept until the process exits.
                with trio.move_on_after(self.settings.send_timeout):
                    await self.ledger.wait_for_holds()
                report = ShutdownReport(
                    finished=len(live) - len(remaining),
                    cut_short=len(remaining),
                    held_bytes=self.ledger.keep_until_exit(),
                )
                log.info(
                    "shutdown: %d scopes finished, %d cut short, %d bytes still held",
                    report.finished,
                    report.cut_short,
                    report.held_bytes,
                )
                self.shutdown_report = report
                self._shutdown_done.set()
        return report
