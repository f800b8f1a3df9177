"""Fixtures of the hostile suite: the server, the reference model, and an honest prefill
rank for each case.

The server is started with :data:`~hostile.rig.SERVER_FLAGS` and shared by every module (the
cases leave nothing behind that another could trip on); a module that defines
``SERVER_ARGS`` (a tuple of flags) gets a server of its own with them. A case that finds its
server dead or hung (an earlier case killed it) gets a fresh one, so one crash fails one case.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from hostile.rig import Honest, Reference, Server, ServerPool
from support.engines import RankEngines
from trio_encode.client import EncodeClient, LandingPool


@pytest.fixture(scope="package")
def shared_pool() -> Iterator[ServerPool]:
    """The server of every module that asks for no flags of its own (starts cost seconds)."""
    pool = ServerPool()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def server_pool(request: pytest.FixtureRequest) -> Iterator[ServerPool]:
    """The shared pool, or one of the module's own if it defines ``SERVER_ARGS``."""
    extra = getattr(request.module, "SERVER_ARGS", None)
    if extra is None:
        yield request.getfixturevalue("shared_pool")
        return
    pool = ServerPool(*extra)
    yield pool
    pool.close()


@pytest.fixture
def server(server_pool: ServerPool) -> Server:
    """This module's ``trio-encode serve``, alive."""
    return server_pool.get()


@pytest.fixture(scope="session")
def reference() -> Reference:
    """The served model, run directly: what an honest rank's bytes must be."""
    return Reference()


@pytest.fixture
async def honest(
    server: Server, rank_engines: RankEngines, reference: Reference
) -> AsyncIterator[Honest]:
    """A prefill rank with its own Mooncake engine and registered landing pool, talking to
    this module's server; one round trip before the case (so the server's first-request
    costs are paid before the watch takes its baseline)."""
    async with (
        EncodeClient(server.url, timeout=60) as client,
        LandingPool.open(rank_engines.ranks[0], 1 << 20) as pool,
    ):
        rank = Honest(client, pool, reference)
        await rank.round_trip(within=30)
        yield rank
