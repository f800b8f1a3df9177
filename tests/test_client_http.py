"""The HTTP client maps every contract error to a typed exception with the facts in it."""

from __future__ import annotations

import pytest
import torch

from support.engines import DEAD_SESSION, RankEngines
from support.harness import http_server, landing_pools
from trio_encode.client import EncodeClient, EngineFailed, RequestRejected
from trio_encode.errors import (
    InvalidInput,
    ReceiveCountConflict,
    TooLarge,
    Unauthorized,
    UnknownRequest,
)
from trio_encode.testing.images import image_uri
from trio_encode.testing.stand_in_encoder import embedding_size

ITEM = image_uri(b"client image")


async def test_errors_come_back_typed_with_status_message_and_req_id(
    rank_engines: RankEngines,
) -> None:
    stray = torch.zeros(embedding_size(1), dtype=torch.uint8)
    async with (
        http_server(rank_engines.server, max_body_bytes=4096, shutdown_grace=0.1) as harness,
        landing_pools(rank_engines, 2 * embedding_size(1)) as pools,
    ):
        client = harness.client
        with pytest.raises(InvalidInput) as bad:
            await client.encode("c", ["not an image"])
        assert (bad.value.status, bad.value.req_id) == (400, "c")  # type: ignore[attr-defined]
        with pytest.raises(UnknownRequest):
            await client.send("nobody", pools[0].session_id, pools[0].address)
        with pytest.raises(TooLarge) as too_big:
            await client.encode("c", [image_uri(b"x" * 8192)])
        assert (too_big.value.status, too_big.value.kind) == (413, "too_large")

        encoded = await client.encode("c", [ITEM], receive_count=1, prefill_host="localhost")
        assert encoded.body["prefill_host"] == "localhost"
        with pytest.raises(ReceiveCountConflict):
            await client.send("c", pools[0].session_id, pools[0].address, receive_count=2)
        for session_id, address in (
            (DEAD_SESSION, pools[0].address),
            (pools[0].session_id, stray.data_ptr()),
        ):
            with pytest.raises(EngineFailed) as failed:
                await client.send("c", session_id, address)
            error = failed.value
            assert (error.engine_call, error.engine_code, error.req_id) == ("transfer", -1, "c")
            assert error.engine_meaning is not None
        sent = await client.send("c", pools[0].session_id, pools[0].address)
        assert sent.receivers_done == 1
        await harness.settled()
        text = await harness.metrics()
        assert 'trio_encode_engine_errors_total{call="transfer",code="-1"} 2.0' in text

        async with EncodeClient(harness.running.url, token="unneeded") as other:
            assert await other.health()


async def test_a_token_the_server_does_not_share_is_rejected(rank_engines: RankEngines) -> None:
    async with http_server(rank_engines.server, token="right") as harness:
        async with EncodeClient(harness.running.url, token="wrong") as client:
            with pytest.raises(Unauthorized) as rejected:
                await client.encode("t", [ITEM])
        assert isinstance(rejected.value, RequestRejected)
        assert (rejected.value.status, rejected.value.kind) == (401, "unauthorized")
