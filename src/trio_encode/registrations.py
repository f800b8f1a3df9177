"""The registration ledger: at most one live registration for any byte, shared by leases.

Mooncake refuses a registration that overlaps a live one (-7), also a byte-identical one. Two
requests can legitimately send the same memory: an embedding-cache hit hands the same tensor to
both, and a batched forward hands out views of one output. So registrations are owned here, not
by requests: a request *leases* a registered region, the first lease registers it, and the last
lease to go deregisters it. Registration and deregistration run shielded: once the engine has
been asked, the ledger must learn the answer, or a registration would leak.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import trio

from trio_encode.engine import EngineError, TransferEngine
from trio_encode.observer import LifecycleObserver, NullObserver

log = logging.getLogger(__name__)

RegionState = Literal["registering", "live", "deregistering"]


class PartialOverlap(Exception):
    """The range overlaps a live region without lying inside it; it cannot be leased."""


@dataclass(eq=False)
class _Region:
    address: int
    length: int
    state: RegionState = "registering"
    leases: int = 0
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
    _region: _Region
    released: bool = False


class RegistrationLedger:
    """Registers memory with one engine so that no two live registrations overlap."""

    def __init__(self, engine: TransferEngine, observer: LifecycleObserver | None = None) -> None:
        self._engine = engine
        self._observer: LifecycleObserver = observer or NullObserver()
        self._regions: dict[int, _Region] = {}

    @property
    def live_registrations(self) -> int:
        """Regions registered with the engine now (registering and deregistering included)."""
        return len(self._regions)

    def regions(self) -> list[tuple[int, int, int]]:
        """``(address, length, leases)`` of every region, for diagnostics and tests."""
        return [(r.address, r.length, r.leases) for r in self._regions.values()]

    async def acquire(self, address: int, length: int) -> Lease:
        """Lease ``[address, address + length)``, registering it unless a live region covers it.

        Raises :class:`EngineError` if the engine refuses, :class:`PartialOverlap` if the range
        straddles a live region (the caller must send from other memory).
        """
        if length <= 0:
            raise ValueError("cannot register an empty range")
        while True:
            region = self._find_overlapping(address, length)
            if region is None:
                return await self._register(address, length)
            if region.state != "live":
                # Someone is registering or deregistering it right now: wait for the outcome
                # (bounded by one engine call) and look again.
                await region.settled.wait()
                continue
            if not region.contains(address, length):
                raise PartialOverlap(
                    f"range {address:#x}+{length} straddles the live registration "
                    f"{region.address:#x}+{region.length}"
                )
            region.leases += 1
            return Lease(address, length, region)

    async def release(self, lease: Lease) -> None:
        """Give a lease back; the last one deregisters. Call it shielded from cancellation.

        Raises :class:`EngineError` if the engine fails to deregister; the ledger forgets the
        region either way, since there is nothing left to retry against.
        """
        if lease.released:
            raise RuntimeError("lease released twice")
        lease.released = True
        region = lease._region
        region.leases -= 1
        if region.leases > 0:
            return
        region.state = "deregistering"
        try:
            await self._engine.deregister(region.address)
        except EngineError as exc:
            self._observer.engine_error(exc.call, exc.code)
            raise
        else:
            self._observer.deregistered(region.address)
        finally:
            del self._regions[region.address]
            region.settled.set()

    def _find_overlapping(self, address: int, length: int) -> _Region | None:
        for region in self._regions.values():
            if region.overlaps(address, length):
                return region
        return None

    async def _register(self, address: int, length: int) -> Lease:
        region = _Region(address, length)
        self._regions[address] = region
        try:
            with trio.CancelScope(shield=True):
                await self._engine.register(address, length)
        except BaseException as exc:
            del self._regions[address]
            region.settled.set()
            if isinstance(exc, EngineError):
                self._observer.engine_error(exc.call, exc.code)
            raise
        region.state = "live"
        region.leases = 1
        region.settled.set()
        self._observer.registered(address, length)
        return Lease(address, length, region)
