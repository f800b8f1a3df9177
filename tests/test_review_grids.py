"""Over HTTP, a dynamic-resolution model's grids reach the prefill rank in SGLang's completion
message exactly as ``/encode`` answered them: per image, in order, with the embedding's shape.

SGLang's prefill rank builds an image's positions from the message's ``grid_dim`` (Qwen-VL's
M-RoPE counts tokens from ``[t, h, w]``), not from the ``/encode`` answer; a message whose grids
were dropped, reordered or reshaped would place one image's tokens on another's grid. The two
images here have different sizes, so their grids differ and their order shows.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import trio
import zmq
from PIL import Image

from support.engines import RankEngines
from support.harness import http_server, landing_pools
from support.sglang_pickle import EmbeddingData, Modality, safe_loads
from support.vlms import PHOTO_SIZES, PHOTOS, build
from trio_encode.encoder import EncoderSettings, ImageEncoder

PREFILL_HOST = "127.0.0.1"
TALL, WIDE = 1, 0
"""Indexes into :data:`PHOTOS`: a tall portrait (40x130) first, then a landscape (90x60)."""


def uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def next_message(pull: zmq.Socket[bytes]) -> EmbeddingData:
    """The next completion message on ``pull``, loaded as SGLang loads it."""
    with trio.fail_after(10):
        while True:
            try:
                message: EmbeddingData = safe_loads(pull.recv(zmq.NOBLOCK))
                return message
            except zmq.Again:
                await trio.sleep(0.005)


async def test_the_done_message_carries_the_encode_answers_grids_in_order_and_its_shape(
    tmp_path: Path, rank_engines: RankEngines
) -> None:
    tiny = build("qwen2_5_vl", tmp_path)
    photos = [PHOTOS[TALL], PHOTOS[WIDE]]
    assert PHOTO_SIZES[TALL] != PHOTO_SIZES[WIDE]
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in photos]
    processor_grids = tiny.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
    settings = EncoderSettings(model=tmp_path, max_batch_wait=0.05, arena_bytes=0, warmup=False)
    encoder = ImageEncoder.from_settings(settings)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = context.socket(zmq.PULL)
    try:
        port = pull.bind_to_random_port(f"tcp://{PREFILL_HOST}")
        async with (
            http_server(rank_engines.server, encoder=encoder) as harness,
            landing_pools(rank_engines, 1 << 20) as pools,
        ):
            client = harness.client
            with trio.fail_after(60):
                # SGLang's order: the tokenizer's /encode (no count), the rank's pull, its /send.
                encoded = await client.encode(
                    "rid_local_part_0",
                    [uri(data) for data in photos],
                    num_parts=1,
                    part_idx=0,
                    prefill_host=PREFILL_HOST,
                )
                pulled = await client.post(
                    "/scheduler_receive_meta_data", {"req_id": "rid_local_part_0", "part_idx": 0}
                )
                slot = pools[0].allocate(pulled["embedding_size"])
                send: dict[str, Any] = pulled | {
                    "prefill_host": PREFILL_HOST,
                    "embedding_port": port,
                    "session_id": pools[0].session_id,
                    "buffer_address": slot.address,
                    "receive_count": 1,
                }
                sent = await client.post("/send", send)
                message = await next_message(pull)
                await harness.settled()
    finally:
        pull.close(linger=0)
        context.term()

    grids = encoded.body["grid_dim"]
    # The answer's grids are the processor's, one per image, and they differ: order matters.
    assert grids == processor_grids.tolist()
    assert len(grids) == 2
    assert grids[0] != grids[1]
    assert pulled["grid_dim"] == grids
    assert sent["status"] == "ok"
    assert sent["grid_dim"] == grids

    assert message.error_msg is None
    assert message.error_code is None
    assert message.req_id == "rid_local_part_0"
    assert (message.num_parts, message.part_idx) == (1, 0)
    assert message.modality is Modality.IMAGE
    assert message.grid_dim == grids
    assert message.shape == [encoded.embedding_len, encoded.embedding_dim]
    # The rows the grids stand for (2x2 patches merge into one token) are the landed rows.
    merged = [t * h * w // 4 for t, h, w in message.grid_dim]
    assert encoded.body["embedding_lens"] == merged
    assert message.shape[0] == sum(merged)
    slot.verify(sent["embedding_size"], sent["checksum"])
