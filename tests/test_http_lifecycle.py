"""Clients that misbehave and a server that stops, over HTTP with real Mooncake engines.

These run on the real clock: transfers run in real worker threads.
"""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import torch
import trio

from support.engines import TP, DelayedTransferEngine, RankEngines
from support.harness import Harness, http_server, landing_pools
from trio_encode.client import EncodeClient, LandingSlot
from trio_encode.errors import RequestReleased, ScopeExpired
from trio_encode.service import ShutdownReport
from trio_encode.testing.images import image_uri
from trio_encode.testing.stand_in_encoder import StandInEncoder, embedding_size, expected_embedding

IMAGE = b"a cat" * 100
SIZE = embedding_size(1)


async def _wait_for(harness: Harness, name: str, value: float, within: float = 5.0) -> None:
    with trio.fail_after(within):
        while await harness.value(name) != value:  # noqa: ASYNC110  (polling the server)
            await trio.sleep(0.02)


def _landed_intact(slot: LandingSlot, image: bytes = IMAGE) -> bool:
    expected = expected_embedding([image])
    return torch.equal(slot.read(*expected.shape, "float32"), expected)


def _untouched(slot: LandingSlot) -> bool:
    return not slot.raw().any().item()


async def test_client_disconnecting_mid_transfer_the_transfer_completes_and_counts(
    rank_engines: RankEngines,
) -> None:
    engine = DelayedTransferEngine(rank_engines.server, delay=0.5)
    async with http_server(engine) as harness, landing_pools(rank_engines, 4 * SIZE) as pools:
        await harness.client.encode("gone", [image_uri(IMAGE)], receive_count=2)
        slot = pools[0].allocate(SIZE)
        with trio.move_on_after(0.15) as waited:
            async with EncodeClient(harness.running.url) as impatient:
                await impatient.send("gone", pools[0].session_id, slot.address)
        assert waited.cancelled_caught  # the client hung up while its transfer ran

        await _wait_for(harness, "transfer_bytes_total", SIZE)
        assert _landed_intact(slot)
        other = pools[1].allocate(SIZE)
        sent = await harness.client.send("gone", pools[1].session_id, other.address)
        assert sent.receivers_done == 2  # the hung-up rank's transfer counted
        assert _landed_intact(other)
        text = await harness.settled()
        assert "trio_encode_registrations_total 1.0" in text


async def test_client_disconnecting_before_its_transfer_started_it_never_happens(
    rank_engines: RankEngines,
) -> None:
    encoder = StandInEncoder(slow_seconds=0.6)
    slow_image = b"SLOW" + IMAGE
    async with (
        http_server(rank_engines.server, encoder) as harness,
        landing_pools(rank_engines, 4 * SIZE) as pools,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(
            partial(harness.client.encode, "early", [image_uri(slow_image)], receive_count=2)
        )
        await _wait_for(harness, "live_scopes", 1)
        slot = pools[0].allocate(SIZE)
        with trio.move_on_after(0.2) as waited:
            async with EncodeClient(harness.running.url) as impatient:
                await impatient.send("early", pools[0].session_id, slot.address)
        assert waited.cancelled_caught  # hung up while the encode still ran

        other = pools[1].allocate(SIZE)
        sent = await harness.client.send("early", pools[1].session_id, other.address)
        assert sent.receivers_done == 1  # the withdrawn send neither ran nor counted
        assert _untouched(slot)
        assert await harness.value("transfer_bytes_total") == SIZE
        retried = await harness.client.send("early", pools[0].session_id, slot.address)
        assert retried.receivers_done == 2
        assert _landed_intact(slot, slow_image)
        await harness.settled()


async def test_a_receiver_that_never_calls_is_ended_by_the_backstop(
    rank_engines: RankEngines,
) -> None:
    encoder = StandInEncoder(slow_seconds=30)
    async with (
        http_server(rank_engines.server, encoder, send_timeout=1.5) as harness,
        landing_pools(rank_engines, 4 * SIZE) as pools,
    ):
        # "lonely": 3 of 4 ranks send; the 4th never calls.
        for rank in range(TP - 1):
            await harness.client.encode("lonely", [image_uri(IMAGE)], receive_count=TP)
            slot = pools[rank].allocate(SIZE)
            sent = await harness.client.send("lonely", pools[rank].session_id, slot.address)
            assert sent.receivers_done == rank + 1

        # "stuck": the encode outlives the deadline; every waiting rank gets 504.
        answers: list[BaseException] = []

        async def encode_rank() -> None:
            try:
                await harness.client.encode("stuck", [image_uri(b"SLOW")], receive_count=TP)
            except ScopeExpired as exc:
                answers.append(exc)

        async def send_rank(rank: int) -> None:
            slot = pools[rank].allocate(SIZE)
            try:
                await harness.client.send("stuck", pools[rank].session_id, slot.address)
            except ScopeExpired as exc:
                answers.append(exc)

        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(encode_rank)
                await _wait_for(harness, "live_scopes", 2)
                nursery.start_soon(encode_rank)
                nursery.start_soon(send_rank, 2)
                nursery.start_soon(send_rank, 3)
        assert len(answers) == 4
        assert all(exc.status == 504 for exc in answers)  # type: ignore[attr-defined]

        text = await harness.settled()
        assert "trio_encode_backstop_expiries_total 2.0" in text
        assert "trio_encode_registrations_total 1.0" in text
        assert "trio_encode_deregistrations_total 1.0" in text
        late = pools[3].allocate(SIZE)
        for call in (
            harness.client.send("lonely", pools[3].session_id, late.address),
            harness.client.encode("stuck", [image_uri(b"SLOW")]),
        ):
            with pytest.raises(RequestReleased) as late_answer:  # not resurrected
                await call
            assert late_answer.value.status == 410  # type: ignore[attr-defined]


async def test_shutdown_with_transfers_in_flight_releases_everything(
    rank_engines: RankEngines,
) -> None:
    engine = DelayedTransferEngine(rank_engines.server, delay=2.0)
    requests = 3
    slots: dict[tuple[int, int], LandingSlot] = {}
    async with landing_pools(rank_engines, requests * SIZE + 4096) as pools:
        async with http_server(engine, shutdown_grace=0.5) as harness:
            encoded = trio.Event()

            async def rank(req: int, r: int) -> None:
                items = [image_uri(IMAGE + bytes([req]))]
                await harness.client.encode(f"inflight-{req}", items, receive_count=TP)
                slots[req, r] = pools[r].allocate(SIZE)
                if len(slots) == requests * TP:
                    encoded.set()
                await harness.client.send(
                    f"inflight-{req}", pools[r].session_id, slots[req, r].address
                )

            async with trio.open_nursery() as nursery:
                for req in range(requests):
                    for r in range(TP):
                        nursery.start_soon(rank, req, r)
                with trio.fail_after(30):  # every /encode answered, however loaded the host
                    await encoded.wait()
                await trio.sleep(0.5)  # every transfer is now sleeping in its thread (2 s)
                harness.running.stop()
                await trio.sleep(0.1)
                async with httpx.AsyncClient(base_url=harness.running.url) as http:
                    assert (await http.get("/health")).status_code == 503
                    refused = await http.post(
                        "/encode", json={"req_id": "new", "mm_items": [image_uri(IMAGE)]}
                    )
                    assert refused.status_code == 503
                    assert "shutting down" in refused.json()["message"]
            service = harness.running.service

        assert service.shutdown_report == ShutdownReport(finished=0, cut_short=requests)
        assert service.ledger.live_registrations == 0
        assert len(service.registry) == 0
        text = harness.running.metrics.render().decode()
        assert f"trio_encode_registrations_total {requests}.0" in text
        assert f"trio_encode_deregistrations_total {requests}.0" in text
        # Every transfer that was in flight finished before its memory was released.
        for req in range(requests):
            for r in range(TP):
                assert _landed_intact(slots[req, r], IMAGE + bytes([req]))
