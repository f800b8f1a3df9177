"""Real Mooncake engines for the HTTP tests, and a transfer that takes real time in a thread.

Engines are made once per session: the Python binding cannot close one, and each owns sockets
and threads. A missing Mooncake makes the tests that use them fail, never skip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import trio

from trio_encode.engine import Write
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings, write_segments
from trio_encode.testing.forwarding import ForwardingEngine

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


class DelayedTransferEngine(ForwardingEngine):
    """A Mooncake engine whose transfers first sleep ``delay`` seconds in the *same* worker
    thread: a transfer that is really in flight, which no cancellation can interrupt."""

    def __init__(self, engine: MooncakeEngine, delay: float) -> None:
        super().__init__(engine)
        self.raw = engine.raw
        self.delay = delay

    async def transfer(self, write: Write, *, submitted: trio.Event | None = None) -> None:
        def slow_write() -> int:
            time.sleep(self.delay)
            code, pending = write_segments(self.raw, write)
            assert not pending, "these tests' transfers end within the engine's timeout"
            return code

        code = await trio.to_thread.run_sync(slow_write, abandon_on_cancel=False)
        if code != 0:
            raise write.failed(code, "in a delayed transfer")
