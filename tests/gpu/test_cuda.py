"""GPU checks (``nox -s gpu``, on ``cuda:0`` or the ``--gpu-device`` given): a tiny Qwen2.5-VL
served on the device gives exactly transformers' own ``get_image_features`` on the same device,
and its rows reach host memory through the (on a GPU, pinned) arena. The normal suite runs them
on the cpu (``tests/test_gpu_steps.py``), so a lent GPU changes only the device."""

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


def test_the_device_is_there(device: str) -> None:
    where = torch.device(device)
    if where.type == "cuda":
        assert torch.cuda.is_available(), f"nox -s gpu needs a CUDA device ({device})"
        assert (where.index or 0) < torch.cuda.device_count(), f"no {device} here"
    else:
        assert where.type == "cpu", f"{device}: the GPU checks run on cuda:N or (rehearsed) cpu"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_served_on_the_device_equals_transformers_on_it(
    tmp_path: Path, dtype: str, device: str
) -> None:
    tiny = build("qwen2_5_vl", tmp_path)
    settings = EncoderSettings(
        model=tmp_path, dtype=dtype, device=device, arena_bytes=8 << 20, max_batch_wait=0.05
    )
    encoder = ImageEncoder.from_settings(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        embedding = await encoder.encode(PHOTOS)
        nursery.cancel_scope.cancel()
    assert isinstance(embedding, ArenaEmbedding)
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in PHOTOS]
    model = tiny.model_class.from_pretrained(str(tmp_path), dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    inputs = T.Qwen2VLImageProcessor.from_pretrained(str(tmp_path))(
        images=images, return_tensors="pt"
    ).to(device)
    with torch.inference_mode():
        features = model.get_image_features(
            pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
        ).pooler_output
    expected = torch.cat(list(features)).cpu()
    assert torch.equal(embedding.tensor, expected)
    embedding.release()
