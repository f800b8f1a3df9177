"""A transfer engine that forwards every call to another: the base of test doubles that watch
or fail some calls (fault injection, the explorer's log, a test's counters) and pass the rest
through unchanged."""

from __future__ import annotations

import trio

from trio_encode.engine.base import TransferEngine, Write


class ForwardingEngine:
    """Forwards each :class:`~trio_encode.engine.base.TransferEngine` call to ``engine``; a
    subclass overrides the calls it watches and ends them with ``super()``."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine

    @property
    def session_id(self) -> str:
        return self.engine.session_id

    async def register(self, address: int, length: int) -> None:
        await self.engine.register(address, length)

    async def deregister(self, address: int) -> None:
        await self.engine.deregister(address)

    async def transfer(self, write: Write, *, submitted: trio.Event | None = None) -> None:
        await self.engine.transfer(write, submitted=submitted)

    def reading(self, address: int, length: int) -> bool:
        return self.engine.reading(address, length)

    async def settled(self, address: int, length: int) -> None:
        await self.engine.settled(address, length)
