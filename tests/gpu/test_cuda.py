"""GPU checks (``nox -s gpu``, on ``cuda:0``; never part of the default run): a tiny
Qwen2.5-VL served on the GPU gives exactly transformers' own ``get_image_features`` on the same
device, and its rows reach host memory through the pinned arena."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import transformers as T
import trio
from PIL import Image

from support.vlms import PHOTOS, build
from trio_encode.embedding import ArenaEmbedding
from trio_encode.encoder import EncoderSettings, ImageEncoder


def test_cuda_is_there() -> None:
    assert torch.cuda.is_available(), "nox -s gpu needs a CUDA device (cuda:0)"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_served_on_cuda_equals_transformers_on_cuda(tmp_path: Path, dtype: str) -> None:
    tiny = build("qwen2_5_vl", tmp_path)
    settings = EncoderSettings(
        model=tmp_path, dtype=dtype, device="cuda:0", arena_bytes=8 << 20, max_batch_wait=0.05
    )
    encoder = ImageEncoder.from_settings(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        embedding = await encoder.encode(PHOTOS)
        nursery.cancel_scope.cancel()
    assert isinstance(embedding, ArenaEmbedding)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in PHOTOS]
    model = tiny.model_class.from_pretrained(str(tmp_path), dtype=getattr(torch, dtype))
    model = model.to("cuda:0").eval()
    inputs = T.Qwen2VLImageProcessor.from_pretrained(str(tmp_path))(
        images=images, return_tensors="pt"
    ).to("cuda:0")
    with torch.inference_mode():
        features = model.get_image_features(
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
        ).pooler_output
    expected = torch.cat(list(features)).cpu()
    assert torch.equal(embedding.tensor, expected)
    embedding.release()
