"""Shared fixtures: real buffers, in-memory fabrics, and real Mooncake engines.

Real Mooncake engines are created once per session (each owns sockets and threads, and the
Python binding has no way to close one); every test that uses them must leave no registration
behind, which :func:`engine_pair` guarantees for the registrations made through it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import trio_encode.server.serve
import trio_encode.tools.drill_serve
from support.engines import RankEngines, create_rank_engines
from trio_encode.engine import TransferEngine
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings
from trio_encode.service import ShutdownReport
from trio_encode.settings import ENV_PREFIX, ServerSettings
from trio_encode.testing.forwarding import ForwardingEngine
from trio_encode.testing.memory_engine import InMemoryFabric

# A session id nobody listens on: port 1 on loopback is never a Mooncake engine.
DEAD_MOONCAKE_SESSION = "127.0.0.1:1"
DEAD_MEMORY_SESSION = "mem-dead:1"


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ServerSettings`` reads ``TRIO_ENCODE_*`` variables; one set in the shell that runs
    the tests must not change what the tests configure."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("explore", "schedule exploration (tests/test_explore.py)")
    group.addoption(
        "--explore-seed",
        type=int,
        default=_env_int("TRIO_ENCODE_EXPLORE_SEED"),
        help="replay only this seed of the random schedules (env TRIO_ENCODE_EXPLORE_SEED)",
    )
    group.addoption(
        "--explore-count",
        type=int,
        default=_env_int("TRIO_ENCODE_EXPLORE_COUNT") or 300,
        help="how many random schedules each exploring test runs (default 300)",
    )
    parser.addoption(
        "--gpu",
        action="store_true",
        help="also run tests/gpu (needs cuda:0; nox -s gpu); never part of the default run",
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/gpu needs a CUDA device: collected only with ``--gpu``."""
    if collection_path.name == "gpu" and collection_path.parent.name == "tests":
        return None if config.getoption("--gpu") else True
    return None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


class BufferPool:
    """Allocates real CPU memory (uint8 tensors) and keeps it alive until the test ends, so
    no registered address can be freed under an engine."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []

    def zeros(self, length: int) -> torch.Tensor:
        """A zero-filled buffer of ``length`` bytes."""
        tensor = torch.zeros(length, dtype=torch.uint8)
        self._tensors.append(tensor)
        return tensor

    def pattern(self, length: int, seed: int = 1) -> torch.Tensor:
        """A buffer whose bytes differ from their neighbours and from zero, so a misplaced or
        partial copy shows."""
        values = (torch.arange(length, dtype=torch.int64) * 7 + seed) % 251 + 1
        tensor = values.to(torch.uint8)
        self._tensors.append(tensor)
        return tensor

    def release(self) -> None:
        self._tensors.clear()


@pytest.fixture
def buffers() -> Iterator[BufferPool]:
    """Real memory for transfers, freed only after the test and its engine fixtures end."""
    pool = BufferPool()
    yield pool
    pool.release()


@pytest.fixture
def fabric() -> InMemoryFabric:
    """A fresh in-memory network for in-memory engines."""
    return InMemoryFabric()


@pytest.fixture(scope="session")
def mooncake_engines() -> tuple[MooncakeEngine, MooncakeEngine]:
    """Two real Mooncake engines over TCP on loopback (P2PHANDSHAKE, no metadata server).

    Created with :meth:`MooncakeEngine.create` in a short ``trio.run`` of its own, since
    pytest-trio fixtures cannot outlive one test. A missing Mooncake makes every test that
    uses this fixture fail (error), never skip.
    """
    settings = MooncakeSettings()
    return (
        trio.run(MooncakeEngine.create, settings),
        trio.run(MooncakeEngine.create, settings),
    )


class TrackingEngine(ForwardingEngine):
    """Forwards every call to an engine unchanged and remembers the registrations that are
    still live, so a fixture can remove them after the test (shared engines stay clean)."""

    def __init__(self, engine: TransferEngine) -> None:
        super().__init__(engine)
        self.live: set[int] = set()

    async def register(self, address: int, length: int) -> None:
        await super().register(address, length)
        self.live.add(address)

    async def deregister(self, address: int) -> None:
        await super().deregister(address)
        self.live.discard(address)

    async def cleanup(self) -> None:
        for address in sorted(self.live):
            await self.engine.deregister(address)
        self.live.clear()


@dataclass(frozen=True)
class EnginePair:
    """A sender and a receiver that can reach each other, and a session id that is dead."""

    kind: str
    sender: TrackingEngine
    receiver: TrackingEngine
    dead_session_id: str


@pytest.fixture(params=["mooncake", "memory"])
def _engine_pair_engines(
    request: pytest.FixtureRequest,
) -> tuple[str, TransferEngine, TransferEngine, str]:
    # Sync, so that creating the session's Mooncake engines (a trio.run of their own) happens
    # before the test's own trio.run starts.
    if request.param == "mooncake":
        sender, receiver = request.getfixturevalue("mooncake_engines")
        return "mooncake", sender, receiver, DEAD_MOONCAKE_SESSION
    memory = InMemoryFabric()
    return "memory", memory.engine("sender"), memory.engine("receiver"), DEAD_MEMORY_SESSION


@pytest.fixture
async def engine_pair(
    _engine_pair_engines: tuple[str, TransferEngine, TransferEngine, str], buffers: BufferPool
) -> AsyncIterator[EnginePair]:
    """The same rule checks against the real Mooncake engine and the in-memory one.

    Registrations the test leaves are removed afterwards; this depends on ``buffers`` so the
    memory is freed only after that.
    """
    kind, sender, receiver, dead_session_id = _engine_pair_engines
    pair = EnginePair(kind, TrackingEngine(sender), TrackingEngine(receiver), dead_session_id)
    yield pair
    await pair.sender.cleanup()
    await pair.receiver.cleanup()


@pytest.fixture(scope="session")
def rank_engines() -> RankEngines:
    """Mooncake engines for a server and ``TP`` ranks, made once per session in a ``trio.run``
    of their own (trio fixtures cannot outlive one test)."""
    return trio.run(create_rank_engines)


@pytest.fixture
def drills() -> list[Any]:
    """The drills the ``captured`` fake drill server was given, in order."""
    return []


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch, drills: list[Any]) -> list[ServerSettings]:
    """Replaces the server (and the drill server) with one that records its settings (and
    its drill, in ``drills``) and stops at once."""
    seen: list[ServerSettings] = []

    async def fake_run_server(settings: ServerSettings) -> ShutdownReport:
        seen.append(settings)
        return ShutdownReport(finished=0, cut_short=0)

    async def fake_run_drill_server(settings: ServerSettings, drill: Any) -> ShutdownReport:
        drills.append(drill)
        return await fake_run_server(settings)

    monkeypatch.setattr(trio_encode.tools.drill_serve, "run_drill_server", fake_run_drill_server)
    monkeypatch.setattr(trio_encode.server.serve, "run_server", fake_run_server)
    return seen
