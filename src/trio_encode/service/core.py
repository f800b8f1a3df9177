"""The encode service itself: admission, the one encode per request, pulls, sends, what a
request's failure ends and tells, and shutdown. See :mod:`trio_encode.service`."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial

import trio

from trio_encode.arrivals import Arrivals
from trio_encode.completion import (
    Pusher,
)
from trio_encode.engine import EngineError, TransferEngine
from trio_encode.errors import (
    EncodeNotArrived,
    InvalidInput,
    ReceiverHostMismatch,
    RequestError,
)
from trio_encode.ledger import Lease, RegistrationLedger
from trio_encode.observer import LifecycleObserver, NullObserver, TaskFaults
from trio_encode.receivers import receiver_host, same_host
from trio_encode.request_state import Call, Ended, Failure, refusal
from trio_encode.request_types import EmbeddingShape, Encode, Receiver, SendReport
from trio_encode.scopes import ScopeRegistry
from trio_encode.service.admission import admit
from trio_encode.service.encoder_api import Encoder
from trio_encode.service.messages import RankMessages
from trio_encode.service.parts import UNKNOWN_CLIENT, Notify, Part, family_of
from trio_encode.service.requests import RequestRecord, Requests, check_room
from trio_encode.service.settings import ServiceSettings

log = logging.getLogger(__name__)


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
        pusher: Pusher | None = None,
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
        self.arrivals = Arrivals(group=family_of)
        self.faults = TaskFaults(observer)
        """The failures of background tasks, contained (logged and counted by kind)."""
        self.messages: RankMessages | None = None
        """What requests tell their prefill ranks; None when completion messages are off."""
        if settings.completion_messages:
            self.messages = RankMessages(
                timeout=settings.completion_timeout,
                observer=observer,
                faults=self.faults,
                closed=self.registry.is_closed,
                pusher=pusher,
            )
        self.requests = Requests(self._pull_timeout)
        """What is kept beside each request: its part, bound endpoints, prefill host."""

    @classmethod
    @asynccontextmanager
    async def running(
        cls,
        *,
        engine: TransferEngine,
        encoder: Encoder,
        settings: ServiceSettings = ServiceSettings(),
        observer: LifecycleObserver | None = None,
        pusher: Pusher | None = None,
    ) -> AsyncIterator[EncodeService]:
        """Open the service nursery, start the encoder, and on exit shut down gracefully.

        ``pusher``: delivers completion messages (default: a :class:`CompletionPusher`)."""
        async with trio.open_nursery() as nursery:
            service = cls(
                nursery=nursery,
                engine=engine,
                encoder=encoder,
                settings=settings,
                observer=observer or NullObserver(),
                pusher=pusher,
            )
            await nursery.start(service.ledger.run)
            if service.messages is not None:
                await service.messages.start(nursery)
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
        return self.registry.held.nbytes

    async def encode(
        self,
        req_id: str,
        mm_items: Sequence[str],
        *,
        receive_count: int | None,
        part: Part | None = None,
        prefill_host: str | None = None,
        client: str | None = None,
        modality: str = "IMAGE",
    ) -> EncodeReport:
        """Run the encoder once for ``req_id``; siblings share the run and its answer.

        ``modality``: SGLang's name of what ``mm_items`` are (``IMAGE`` or ``VIDEO``: one
        part holds one modality).

        ``part``: where the request sits among its prefill request's parts, and the prefill
        ranks to tell if the encode fails (at most ``MAX_ENDPOINTS`` per request over all
        its calls; past it, :class:`InvalidInput` and nothing changes). ``prefill_host``: the
        host every receiver of the request must be on (when ``receivers_match_prefill_host``).
        ``client``: the caller's address, which failure pushes to those ranks are charged to.
        """
        part = part or Part()
        named = dict.fromkeys(part.endpoints, client or UNKNOWN_CLIENT)
        check_room(req_id, {}, named)
        scope = self.registry.live(req_id)
        if scope is None:
            self._late("encode", req_id, part=part)
            admit(req_id, self.registry, self.settings)
            # Check the input before a scope exists: bad input must leave nothing behind.
            try:
                items = await self.encoder.load_items(mm_items, modality)
            except InvalidInput as exc:
                # Pulls already waiting for this id learn why now, not at their timeout.
                self.arrivals.announce(req_id, error=exc)
                failure = Failure.of(exc)
                self.registry.refused(req_id, failure)
                refused = RequestRecord(req_id, part, named)
                self._failed(refused, failure)
                self.requests.ended(refused)
                raise
            if self.registry.live(req_id) is None:  # no checkpoint until open() creates it
                if not self.settings.receivers_match_prefill_host:
                    prefill_host = None
                opening = RequestRecord(req_id, part, named, prefill_host=prefill_host)
                encode = partial(self.encoder.encode, items, modality)
                return await self._open(opening, receive_count, encode)
            scope = self.registry.require_live(req_id)  # a sibling opened it meanwhile
        record = self.requests.live(req_id)
        if record is not None:
            check_room(req_id, record.endpoints, named)
        scope.check_receive_count(receive_count)
        if record is not None:
            record.endpoints.update((e, c) for e, c in named.items() if e not in record.endpoints)
        shape = await scope.wait_encoded()
        return EncodeReport(shape, scope.receive_count)

    async def _open(
        self, record: RequestRecord, receive_count: int | None, encode: Encode
    ) -> EncodeReport:
        """Open the request's scope and what the service keeps beside it: its record, in
        place before the scope so that siblings joining at once bind their endpoints to it,
        and forgotten as live when the scope has ended (:meth:`_ended`)."""
        req_id = record.req_id
        self.requests.track(record)
        try:
            scope = await self.registry.open(
                req_id,
                receive_count=receive_count,
                encode=encode,
                on_end=partial(self._ended, record),
            )
        except BaseException:
            self.requests.untrack(record)
            raise
        self.arrivals.announce(req_id)
        shape = await scope.wait_encoded()
        return EncodeReport(shape, scope.receive_count)

    def _pull_timeout(self) -> float:
        return self.settings.pull_timeout

    def _ended(self, record: RequestRecord, ended: Ended) -> None:
        """The request's scope has released everything. If it never served its embedding
        (its encode failed, it expired or was ended first), tell its prefill ranks and end its
        sibling parts here; then forget it as live, keeping its endpoints a while for late
        sends. Runs in the registry's task for the scope: a bug here is logged and counted,
        never raised into the service nursery."""
        try:
            if ended.shape is None:
                ending = replace(ended, gone=False)  # why it ended, not that it is released
                self._failed(record, ended.failure or Failure.of(refusal(record.req_id, ending)))
        except Exception as exc:
            self.faults.record("failure", exc)
        finally:
            self.requests.untrack(record)
            self.requests.ended(record)

    def _failed(self, record: RequestRecord, failure: Failure) -> None:
        """The request failed: remember why for its late pulls, tell the ranks bound to it,
        and end its sibling parts on this server (their ranks will never send them).

        The siblings are those that exist here (live requests and waiting pulls of the same
        family, found through their indexes): the work is theirs, never the number of parts
        a client claims. A family already failed has had its siblings ended once."""
        req_id, part = record.req_id, record.part
        if self.messages is not None:
            self.messages.tell(record, failure)
        family = Part.family(req_id, part)
        if family is None or self.requests.family_failure(req_id, part) is not None:
            return
        sibling_failure = Failure(
            failure.error_type, f"part {part.part_idx} of this request failed: {failure.message}"
        )
        self.requests.family_failed(family, sibling_failure)
        members = self.requests.family_members(family)
        for sibling in self.requests.siblings(family, req_id, part, members):
            scope = self.registry.live(sibling)
            if scope is not None:
                scope.abandon(sibling_failure)
        waiting = self.arrivals.waiting_in(family)
        for sibling in self.requests.siblings(family, req_id, part, waiting):
            self.arrivals.announce(sibling, error=sibling_failure.error(sibling))

    def _late(
        self,
        call: Call,
        req_id: str,
        *,
        part: Part | None = None,
        receiver: Receiver | None = None,
    ) -> SendReport | None:
        """What ``call`` gets for ``req_id`` with no live scope
        (:func:`~trio_encode.request_state.answer` decides): raises its error, returns a
        served receiver's answer again, or None to go on."""
        return self.registry.answer(
            call,
            req_id,
            receiver=receiver,
            family_failure=self.requests.family_failure(req_id, part),
        )

    async def pull(self, req_id: str, *, receive_count: int | None = None) -> EncodeReport:
        """Wait for ``req_id``'s encode to publish its shape, without starting one.

        A pull may come before any ``/encode`` names the id: it then waits for one up to
        ``pull_timeout``. Once the scope exists, the scope's own deadline bounds the wait.
        """
        scope = self.registry.live(req_id)
        if scope is None:
            self._late("pull", req_id)
            with trio.move_on_after(self.settings.pull_timeout) as waited:
                await self.arrivals.wait(req_id)
            if waited.cancelled_caught:
                raise EncodeNotArrived(
                    f"no /encode named this req_id within {self.settings.pull_timeout:g} s",
                    req_id=req_id,
                )
            scope = self.registry.live(req_id)
            if scope is None:  # woken by shutdown or a failure, not by an /encode
                self._late("pull", req_id)
                scope = self.registry.require_live(req_id)
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
        client: str | None = None,
    ) -> SendReport:
        """Transfer ``req_id``'s embedding into ``receiver``; returns once the bytes landed
        and, when ``notify`` names a prefill rank, once that rank has SGLang's completion
        message (:class:`CompletionFailed` if it cannot be delivered).

        The message goes before the 200: SGLang's rank fails a request at once on a non-200
        ``/send``, while a 200 without the message leaves it waiting for its own timeout. A
        repeat (a receiver already served, whose answer was lost) moves nothing and pushes
        nothing: a second message for a part fails SGLang's request as a duplicate.

        A send the request admits binds ``notify``'s endpoint to it (room permitting). A
        send that fails pushes its error to ``notify`` only when the request is one this
        server holds or remembers and that endpoint is bound to it (a failure is never pushed
        for an unknown request, nor to an endpoint its request never named); ``client`` (the
        caller's address) is charged for that push.

        The receiver's host must be the ``prefill_host`` its ``/encode`` named, if it named one
        (and ``receivers_match_prefill_host`` is on); which hosts may receive at all is the HTTP
        layer's check (``allowed_receivers``), where session ids from outside come in.
        """
        client = client or UNKNOWN_CLIENT
        record = self.requests.live(req_id)  # taken now: the scope may end before the push
        try:
            scope = self.registry.live(req_id)
            if scope is None:
                repeat = self._late("send", req_id, receiver=receiver)
                assert repeat is not None  # a send with no live scope gets an answer or raises
                return repeat
            if record is not None:
                self._check_prefill_host(record, receiver)
            scope.check_receive_count(receive_count)
            if notify is not None and record is not None:
                record.bind(notify.endpoint, client)
            report = await scope.send(receiver)
        except RequestError as exc:
            known = record or self.requests.record(req_id)
            if notify is not None and known is not None and self.messages is not None:
                self.messages.tell(known, Failure.of(exc), only=notify.endpoint, client=client)
            raise
        if notify is not None and self.messages is not None and not report.repeat:
            await self.messages.done(req_id, record, notify, report)
        return report

    @staticmethod
    def _check_prefill_host(record: RequestRecord, receiver: Receiver) -> None:
        prefill_host = record.prefill_host
        if prefill_host is None:
            return
        host = receiver_host(receiver.session_id)
        if not same_host(host, prefill_host):
            raise ReceiverHostMismatch(
                f"receiver host {host!r} is not this request's prefill_host {prefill_host!r}",
                req_id=record.req_id,
            )

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
