"""The registration ledger: at most one live registration for any byte, shared by leases.

Mooncake refuses a registration that overlaps a live one (-7), also a byte-identical one. Two
requests can legitimately send the same memory: an embedding-cache hit hands the same tensor to
both, and a batched forward hands out views of one output. So registrations are owned here, not
by requests: a request *leases* a registered region, the first lease registers it, and the last
lease to go deregisters it. Registration and deregistration run shielded: once the engine has
been asked, the ledger must learn the answer, or a registration would leak.

A region holds its leases' owners (the objects that keep its bytes allocated) for as long as
it may be registered. If the engine refuses a deregistration for any reason but "nothing is
registered there" (-3), the region is *quarantined*: its memory stays alive, no new lease may
use it, and :meth:`RegistrationLedger.run` retries the deregistration until it succeeds. Freeing
memory the engine may still hold registered would let a later allocation be read or written
by a transfer that names the old registration.

A transfer the engine stopped waiting for (its timeout passed while Mooncake still had it in
flight: Mooncake has no cancel) may still read its source. Leases whose ranges it may read are
*held* when their holder lets go (:meth:`RegistrationLedger.keep_while_read`): the region stays
registered, the owners stay alive, and whatever the holder would have freed next (an arena
segment) stays out of reuse, until the engine reports the transfer ended; then they are
released as usual. A hold that outlives ``overdue_after`` is logged and counted, and kept.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import trio

from trio_encode.engine import INVALID_ADDRESS, EngineError, TransferEngine
from trio_encode.observer import LifecycleObserver, NullObserver, RegistrationCall

log = logging.getLogger(__name__)

RegionState = Literal["registering", "live", "deregistering", "quarantined"]

_KEPT_UNTIL_EXIT: list[object] = []
"""Holds no transfer's end released before shutdown: their regions, owners and segments stay
alive (and registered) until the process exits, whatever becomes of the ledger."""


class PartialOverlap(Exception):
    """The range overlaps a region it cannot share: one that straddles it, or one that is
    quarantined. The caller must send from other memory."""


@dataclass(eq=False)
class _Region:
    address: int
    length: int
    state: RegionState = "registering"
    leases: int = 0
    owners: list[object] = field(default_factory=list)
    """What keeps the bytes allocated while they may be registered."""
    settled: trio.Event = field(default_factory=trio.Event)

    @property
    def end(self) -> int:
        return self.address + self.length

    def overlaps(self, address: int, length: int) -> bool:
        return address < self.end and self.address < address + length

    def contains(self, address: int, length: int) -> bool:
        return self.address <= address and address + length <= self.end


@dataclass(eq=False)
class Lease:
    """A claim on a registered region; release it exactly once."""

    address: int
    length: int
    _region: _Region = field(repr=False)  # its owners: a logged lease prints no embedding
    _owner_id: int = 0
    """``id`` of the owner this lease added to its region (not the owner itself: a lease
    reachable from a logged traceback must not keep an embedding alive)."""
    released: bool = False


@dataclass(eq=False)
class _Held:
    """Leases let go while a transfer the engine stopped waiting for may read them."""

    leases: list[Lease]
    then: Callable[[], None]
    """What the holder would have done after releasing them (give arena segments back)."""
    since: float
    overdue: bool = False

    @property
    def nbytes(self) -> int:
        return sum(lease.length for lease in self.leases)


class RegistrationLedger:
    """Registers memory with one engine so that no two live registrations overlap."""

    def __init__(
        self,
        engine: TransferEngine,
        observer: LifecycleObserver | None = None,
        *,
        quarantine_retry: float = 5.0,
        overdue_after: float = 600.0,
    ) -> None:
        self._engine = engine
        self._observer: LifecycleObserver = observer or NullObserver()
        self._regions: dict[int, _Region] = {}
        self._quarantine_retry = quarantine_retry
        self._quarantine_changed = trio.Event()
        self._overdue_after = overdue_after
        self._held: list[_Held] = []
        self._holds_changed = trio.Event()
        self._settling: trio.Nursery | None = None

    @property
    def held(self) -> int:
        """Groups of leases held for transfers the engine stopped waiting for."""
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return sum(held.nbytes for held in self._held)

    @property
    def oldest_hold_seconds(self) -> float:
        """Age of the oldest hold (0 when none)."""
        if not self._held:
            return 0.0
        return trio.current_time() - min(held.since for held in self._held)

    @property
    def live_registrations(self) -> int:
        """Regions registered with the engine now (registering, deregistering and
        quarantined ones included)."""
        return len(self._regions)

    @property
    def quarantined(self) -> int:
        """Regions whose deregistration failed and is being retried."""
        return len(self._quarantined())

    @property
    def quarantined_bytes(self) -> int:
        return sum(r.length for r in self._quarantined())

    def regions(self) -> list[tuple[int, int, int]]:
        """``(address, length, leases)`` of every region, for diagnostics and tests."""
        return [(r.address, r.length, r.leases) for r in self._regions.values()]

    async def acquire(self, address: int, length: int, *, owner: object = None) -> Lease:
        """Lease ``[address, address + length)``, registering it unless a live region covers it.

        ``owner`` is kept alive while the region may be registered. Raises
        :class:`EngineError` if the engine refuses, :class:`PartialOverlap` if the range
        cannot share the region it overlaps (the caller must send from other memory).
        """
        if length <= 0:
            raise ValueError("cannot register an empty range")
        while True:
            region = self._find_overlapping(address, length)
            if region is None:
                return await self._register(address, length, owner)
            if region.state in ("registering", "deregistering"):
                # Someone is registering or deregistering it right now: wait for the outcome
                # (bounded by one engine call) and look again.
                await region.settled.wait()
                continue
            if region.state == "quarantined" or not region.contains(address, length):
                raise PartialOverlap(
                    f"range {address:#x}+{length} overlaps the {region.state} registration "
                    f"{region.address:#x}+{region.length}"
                )
            region.leases += 1
            region.owners.append(owner)
            return Lease(address, length, region, id(owner))

    async def release(self, lease: Lease) -> None:
        """Give a lease back; the last one deregisters. Call it shielded from cancellation.

        Raises :class:`EngineError` if the engine fails to deregister. The region is then
        forgotten if the engine holds nothing there (-3), and quarantined otherwise.
        """
        if lease.released:
            raise RuntimeError("lease released twice")
        lease.released = True
        region = lease._region
        region.leases -= 1
        if region.leases > 0:
            # The others' owners keep the bytes alive (they lie inside the region); keeping
            # this one too would grow a long-lived region's list with every lease.
            for index, owner in enumerate(region.owners):
                if id(owner) == lease._owner_id:
                    del region.owners[index]
                    break
            return
        region.state = "deregistering"
        region.settled = trio.Event()  # a fresh one: the old was set when registering ended
        try:
            await self._timed("deregister", self._engine.deregister(region.address))
        except EngineError as exc:
            self._observer.engine_error(exc.call, exc.code)
            if exc.code == INVALID_ADDRESS:
                self._forget(region)
            else:
                self._quarantine(region)
            raise
        except BaseException:
            self._quarantine(region)  # the engine's answer is unknown: assume still registered
            raise
        else:
            self._observer.deregistered(region.address)
            self._forget(region)

    async def retry_quarantined(self) -> None:
        """Try once more to deregister every quarantined region (shielded). A region being
        retried is "deregistering" meanwhile, so a concurrent retry (the periodic one and
        shutdown's) never asks the engine twice for the same region."""
        for region in self._quarantined():
            if region.state != "quarantined":
                continue  # another retry took it while this one waited on the engine
            region.state = "deregistering"
            region.settled = trio.Event()
            with trio.CancelScope(shield=True):
                try:
                    await self._timed("deregister", self._engine.deregister(region.address))
                except EngineError as exc:
                    self._observer.engine_error(exc.call, exc.code)
                    if exc.code != INVALID_ADDRESS:
                        log.warning(
                            "quarantined registration %#x+%d: deregister failed again: %s",
                            region.address,
                            region.length,
                            exc,
                        )
                        region.state = "quarantined"
                        region.settled.set()
                        continue
                else:
                    self._observer.deregistered(region.address)
            log.info("quarantined registration %#x released", region.address)
            self._forget(region)
        self._observer.quarantine_changed(self.quarantined, self.quarantined_bytes)

    def keep_while_read(self, leases: list[Lease], then: Callable[[], None]) -> bool:
        """If a transfer the engine stopped waiting for may still read any of ``leases``,
        hold them all (their regions stay registered, their owners alive) until it has
        ended, then release them and call ``then``; True if held. False: nothing reads
        them, the caller releases them now (no scheduler pass either way)."""
        if not any(self._engine.reading(lease.address, lease.length) for lease in leases):
            return False
        held = _Held(list(leases), then, trio.current_time())
        self._held.append(held)
        log.warning(
            "%d bytes held: a transfer the engine stopped waiting for may still read them",
            held.nbytes,
        )
        if self._settling is not None:
            self._settling.start_soon(self._settle, held)
        return True

    async def wait_for_holds(self) -> None:
        """Return once no lease is held for a transfer the engine stopped waiting for."""
        while self._held:
            await self._holds_changed.wait()

    def keep_until_exit(self) -> int:
        """At shutdown, after :meth:`wait_for_holds`: what is still held is logged and kept,
        registered and allocated, until the process exits (never deregistered, never given
        back: Mooncake may still read it). Returns the bytes kept."""
        nbytes = self.held_bytes
        if self._held:
            log.error(
                "%d bytes in %d holds still held at shutdown: transfers the engine stopped "
                "waiting for have not ended; their memory stays registered and allocated until "
                "the process exits",
                nbytes,
                len(self._held),
            )
            _KEPT_UNTIL_EXIT.extend(self._held)
        return nbytes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Retry quarantined deregistrations every ``quarantine_retry`` seconds while there are
        any, and release held leases once the transfers that may read them have ended; runs
        in the service nursery."""
        async with trio.open_nursery() as nursery:
            self._settling = nursery
            for held in self._held:
                nursery.start_soon(self._settle, held)
            task_status.started()
            while True:
                while not self._quarantined():
                    await self._quarantine_changed.wait()
                    self._quarantine_changed = trio.Event()
                await trio.sleep(self._quarantine_retry)
                await self.retry_quarantined()

    async def _settle(self, held: _Held) -> None:
        """Wait until no transfer the engine gave up on reads ``held``'s ranges, then release
        them (shielded, like every release) and do what their holder would have done."""
        with trio.move_on_after(self._overdue_after) as waited:
            for lease in held.leases:
                await self._engine.settled(lease.address, lease.length)
        if waited.cancelled_caught:
            held.overdue = True
            log.error(
                "%d bytes still held after %g s: the engine never reported the transfer "
                "reading them ended; they are never reused",
                held.nbytes,
                self._overdue_after,
            )
            self._observer.transfer_hold_overdue(held.nbytes)
            for lease in held.leases:
                await self._engine.settled(lease.address, lease.length)
        self._held.remove(held)
        self._holds_changed.set()
        self._holds_changed = trio.Event()
        log.info("%d held bytes released: the transfer reading them ended", held.nbytes)
        with trio.CancelScope(shield=True):
            try:
                for lease in held.leases:
                    try:
                        await self.release(lease)
                    except EngineError as exc:
                        log.error("deregister failed: %s", exc)
            finally:
                held.then()

    async def _timed(self, call: RegistrationCall, engine_call: Awaitable[None]) -> None:
        started = trio.current_time()
        try:
            await engine_call
        finally:
            self._observer.registration_timed(call, trio.current_time() - started)

    def _quarantined(self) -> list[_Region]:
        return [r for r in self._regions.values() if r.state == "quarantined"]

    def _find_overlapping(self, address: int, length: int) -> _Region | None:
        for region in self._regions.values():
            if region.overlaps(address, length):
                return region
        return None

    def _forget(self, region: _Region) -> None:
        del self._regions[region.address]
        region.owners.clear()
        region.settled.set()

    def _quarantine(self, region: _Region) -> None:
        region.state = "quarantined"
        region.settled.set()
        log.error(
            "registration %#x+%d quarantined: its memory is kept until a deregistration succeeds",
            region.address,
            region.length,
        )
        self._quarantine_changed.set()
        self._observer.quarantine_changed(self.quarantined, self.quarantined_bytes)

    async def _register(self, address: int, length: int, owner: object) -> Lease:
        region = _Region(address, length, owners=[owner])
        self._regions[address] = region
        try:
            with trio.CancelScope(shield=True):
                await self._timed("register", self._engine.register(address, length))
        except BaseException as exc:
            self._forget(region)
            if isinstance(exc, EngineError):
                self._observer.engine_error(exc.call, exc.code)
            raise
        region.state = "live"
        region.leases = 1
        region.settled.set()
        self._observer.registered(address, length)
        return Lease(address, length, region, id(owner))
