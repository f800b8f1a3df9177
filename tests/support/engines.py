"""Real Mooncake engines for the HTTP tests, and a transfer that takes real time in a thread.

Engines are made once per session: the Python binding cannot close one, and each owns sockets
and threads. A missing Mooncake makes the tests that use them fail, never skip.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from trio_encode.engine import EngineError
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings, write_segments

TP = 4
DEAD_SESSION = "127.0.0.1:1"


@dataclass(frozen=True)
class RankEngines:
    """One engine for the server and one for each of the ``TP`` prefill ranks."""

    server: MooncakeEngine
    ranks: tuple[MooncakeEngine, ...]


async def create_rank_engines() -> RankEngines:
    """The engines of :class:`RankEngines` (the ``rank_engines`` fixture of ``conftest.py``)."""
    settings = MooncakeSettings()
    server = await MooncakeEngine.create(settings)
    ranks = [await MooncakeEngine.create(settings) for _ in range(TP)]
    return RankEngines(server, tuple(ranks))


class DelayedTransferEngine:
    """A Mooncake engine whose transfers first sleep ``delay`` seconds in the *same* worker
    thread: a transfer that is really in flight, which no cancellation can interrupt."""

    def __init__(self, engine: MooncakeEngine, delay: float) -> None:
        self.engine = engine
        self.delay = delay

    @property
    def session_id(self) -> str:
        return self.engine.session_id

    async def register(self, address: int, length: int) -> None:
        await self.engine.register(address, length)

    async def deregister(self, address: int) -> None:
        await self.engine.deregister(address)

    async def transfer(
        self,
        session_id: str,
        segments: Sequence[tuple[int, int]],
        remote_address: int,
        *,
        submitted: trio.Event | None = None,
    ) -> None:
        def slow_write() -> int:
            time.sleep(self.delay)
            code, pending = write_segments(self.engine.raw, session_id, segments, remote_address)
            assert not pending, "these tests' transfers end within the engine's timeout"
            return code

        code = await trio.to_thread.run_sync(slow_write, abandon_on_cancel=False)
        self._check(code, session_id, remote_address)

    def reading(self, address: int, length: int) -> bool:
        return self.engine.reading(address, length)

    async def settled(self, address: int, length: int) -> None:
        await self.engine.settled(address, length)

    @staticmethod
    def _check(code: int, session_id: str, remote_address: int) -> None:
        if code != 0:
            raise EngineError(
                "transfer", code, session_id=session_id, remote_address=remote_address
            )
