"""A fleet over real processes: a ``mooncake_master``, encode servers started with
``trio-encode serve --store-master``, real ranks with their own engines, every byte checked.

The processes are shared by the tests of this module, which run in order: the last ones kill
an encoder and then the master.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from support.cluster import EncoderProcess, Master, start_encoders, start_master
from support.engines import RankEngines
from support.harness import landing_pools
from trio_encode.client import EncodeClient, FleetClient, LandingPool
from trio_encode.client.ranking import content_digest, rank
from trio_encode.testing.images import noise_uri

EMBEDDING = 64 * 1024 * 4  # the tiny model's float32 embedding of one image


@dataclass
class Cluster:
    master: Master
    a: EncoderProcess
    b: EncoderProcess
    bf16: EncoderProcess
    """Same model in bfloat16: a different fingerprint."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs: Path = tmp_path_factory.mktemp("cluster")
    master = start_master(logs)
    encoders: list[EncoderProcess] = []
    try:
        encoders = start_encoders(logs, [], [], ["--dtype", "bfloat16"], store=master)
        yield Cluster(master, *encoders)
    finally:
        for encoder in encoders:
            encoder.stop()
        master.stop()


async def _encode_and_send(url: str, req_id: str, item: str, pool: LandingPool) -> bytes:
    """One rank's /encode + /send through ``url``; the bytes that landed (checksum verified)."""
    async with EncodeClient(url) as client:
        encoded = await client.encode(req_id, [item], receive_count=1)
        slot = pool.allocate(encoded.embedding_size)
        try:
            await client.send(req_id, pool.session_id, slot.address)
            slot.verify(encoded.embedding_size, encoded.checksum)
            return bytes(slot.raw()[: encoded.embedding_size].numpy())
        finally:
            slot.release()


async def _until(check: Callable[[], bool], within: float = 10.0) -> None:
    """Poll ``check`` (a blocking metrics read, so in a thread) until it holds."""
    with trio.fail_after(within):
        while True:
            if await trio.to_thread.run_sync(check):
                return
            await trio.sleep(0.05)


async def test_an_image_encoded_by_one_encoder_is_served_by_another_without_a_forward(
    cluster: Cluster, rank_engines: RankEngines
) -> None:
    item = noise_uri(1, 64)
    async with landing_pools(rank_engines, 2 * EMBEDDING) as pools:
        first = await _encode_and_send(cluster.a.url, "store-a", item, pools[0])
        assert cluster.a.forwards() == 1
        await _until(lambda: cluster.a.metric("store_puts_total", result="stored") == 1)

        second = await _encode_and_send(cluster.b.url, "store-b", item, pools[1])
        assert second == first
        assert cluster.b.forwards() == 0
        assert cluster.b.metric("store_lookups_total", result="hit") == 1
        # A hit is kept in the local cache too: asked again, B does not go to the store.
        again = await _encode_and_send(cluster.b.url, "store-b2", item, pools[1])
        assert again == first
        assert cluster.b.metric("encoder_cache_hits_total") == 1
        assert cluster.b.metric("store_lookups_total", result="hit") == 1


async def test_a_different_model_never_hits_anothers_entries(
    cluster: Cluster, rank_engines: RankEngines
) -> None:
    item = noise_uri(1, 64)  # stored by the float32 encoders in the test before
    async with landing_pools(rank_engines, EMBEDDING) as pools:
        landed = await _encode_and_send(cluster.bf16.url, "store-bf16", item, pools[0])
    assert len(landed) == EMBEDDING // 2
    assert cluster.bf16.forwards() == 1
    assert cluster.bf16.metric("store_lookups_total", result="hit") == 0
    assert cluster.bf16.metric("store_lookups_total", result="miss") == 1


async def test_killing_an_encoder_mid_run_loses_no_request(
    cluster: Cluster, rank_engines: RankEngines
) -> None:
    urls = [cluster.a.url, cluster.b.url]
    # Two images that rank the encoder to be killed first, two that rank the survivor first.
    images: list[str] = []
    for wanted in (cluster.b.url, cluster.a.url):
        seeds = (
            s
            for s in range(100, 400)
            if rank(urls, content_digest([noise_uri(s, 64)]))[0] == wanted
        )
        images += [noise_uri(next(seeds), 64), noise_uri(next(seeds), 64)]
    tp = len(rank_engines.ranks)
    requests = 8
    landed: dict[int, set[bytes]] = {i: set() for i in range(len(images))}
    # Room for a slot quarantined by a send the kill cut off, beside the one in use.
    async with landing_pools(rank_engines, 2 * EMBEDDING + 64) as pools:
        clients = [FleetClient(urls) for _ in range(tp)]

        async def rank_request(req: int, r: int) -> None:
            result = await clients[r].encode_and_send(
                f"failover-{req}", [images[req % len(images)]], pool=pools[r], receive_count=tp
            )
            slot = result.slot
            try:
                slot.verify(result.encoded.embedding_size, result.encoded.checksum)
                landed[req % len(images)].add(bytes(slot.raw()[:EMBEDDING].numpy()))
            finally:
                slot.release()

        for req in range(requests):
            if req == requests // 2:
                cluster.b.kill()
            async with trio.open_nursery() as nursery:
                for r in range(tp):
                    nursery.start_soon(rank_request, req, r)
        for client in clients:
            await client.aclose()
    # Every rank of every request was served, and an image's bytes are the same everywhere.
    assert all(len(copies) == 1 for copies in landed.values()), landed.keys()
    assert sum(client.stats.failovers for client in clients) >= tp
    assert sum(client.stats.served.get(cluster.a.url, 0) for client in clients) >= tp * 6


async def test_with_the_master_down_requests_still_succeed_and_say_so(
    cluster: Cluster, rank_engines: RankEngines
) -> None:
    cluster.master.stop()
    results = ("hit", "miss", "error", "timeout", "unavailable")

    def lookups() -> dict[str, float]:
        return {r: cluster.a.metric("store_lookups_total", result=r) for r in results}

    before, forwards = lookups(), cluster.a.forwards()
    async with landing_pools(rank_engines, EMBEDDING) as pools:
        with trio.fail_after(5):
            await _encode_and_send(cluster.a.url, "no-master", noise_uri(999, 64), pools[0])
    assert cluster.a.forwards() == forwards + 1
    after = lookups()
    # The read fails at once (error) or, on a loaded machine, outlasts the wait (timeout).
    change = {r: after[r] - before[r] for r in results if after[r] != before[r]}
    assert list(change.values()) == [1], change
    assert next(iter(change)) in ("error", "timeout"), change
