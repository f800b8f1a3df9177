"""A Hugging Face vision tower from a local directory: a tiny random model, saved and loaded.

Needs ``transformers`` (the ``hf`` extra); without it these tests fail, they do not skip.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import trio
from PIL import Image

from support.models import fixed
from trio_encode.encoder import EncoderSettings, ImageEncoder, load_backend
from trio_encode.testing.images import noise_png


def tiny_tower(kind: str, directory: Path) -> Any:
    torch.manual_seed(0)
    shape: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    }
    model: Any
    if kind == "clip":
        model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**shape))
    else:
        model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**shape))
    model.save_pretrained(directory)
    return model.eval()


@pytest.mark.parametrize(("kind", "tokens"), [("clip", 16), ("siglip", 16)])
def test_tiny_tower_loads_and_matches_transformers(kind: str, tokens: int, tmp_path: Path) -> None:
    reference = tiny_tower(kind, tmp_path)
    backend = fixed(load_backend(EncoderSettings(model=tmp_path)))
    assert (backend.tokens_per_image, backend.hidden_size) == (tokens, 32)
    assert backend.preprocess.image_size == 32
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    out = backend.forward(pixels)
    assert out.shape == (2, tokens, 32)
    with torch.no_grad():
        expected = reference(pixel_values=pixels).last_hidden_state
    if kind == "clip":
        expected = expected[:, 1:, :]  # the CLS token is not an image token
    assert torch.allclose(out, expected, atol=1e-5)


def save_processor(kind: str, directory: Path) -> Any:
    """A processor unlike the defaults in every setting our old hand-made pipeline ignored:
    resampling, shortest edge, crop and rescale factor."""
    processor: Any
    if kind == "clip":
        processor = transformers.CLIPImageProcessor(
            size={"shortest_edge": 40},
            crop_size={"height": 32, "width": 32},
            resample=Image.Resampling.BILINEAR,
            rescale_factor=1 / 300,
            image_mean=[0.1, 0.2, 0.3],
            image_std=[0.4, 0.5, 0.6],
        )
    else:
        processor = transformers.SiglipImageProcessor(
            size={"height": 32, "width": 32},
            resample=Image.Resampling.NEAREST,
            rescale_factor=1 / 200,
        )
    processor.save_pretrained(directory)
    return processor


async def _encode(settings: EncoderSettings, images: list[bytes]) -> torch.Tensor:
    encoder = ImageEncoder.from_settings(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        embedding = await encoder.encode(images)
        nursery.cancel_scope.cancel()
    return embedding.tensor


@pytest.mark.parametrize("kind", ["clip", "siglip"])
async def test_embeddings_match_transformers_own_pipeline(kind: str, tmp_path: Path) -> None:
    model = tiny_tower(kind, tmp_path)
    processor = save_processor(kind, tmp_path)
    images = [noise_png(1, 70, 50), noise_png(2, 33, 90)]  # resizing, cropping, resampling

    ours = await _encode(EncoderSettings(model=tmp_path, max_batch_wait=0.0), images)

    pixels = processor(images=[Image.open(io.BytesIO(i)) for i in images], return_tensors="pt")
    with torch.no_grad():
        theirs = model(pixel_values=pixels["pixel_values"]).last_hidden_state
    if kind == "clip":
        theirs = theirs[:, 1:, :]
    assert ours.shape == (2 * 16, 32)
    assert torch.allclose(ours, theirs.reshape(-1, 32), atol=1e-5)


def test_a_model_saved_without_its_processor_gets_the_defaults_at_its_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiny_tower("clip", tmp_path)
    backend = fixed(load_backend(EncoderSettings(model=tmp_path)))
    assert "has no preprocessor_config.json" in caplog.text
    prepare = backend.preprocess.prepare
    assert prepare is not None
    expected = transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )(images=Image.open(io.BytesIO(noise_png(3, 70, 50))), return_tensors="pt")["pixel_values"][0]
    assert torch.equal(
        prepare(Image.open(io.BytesIO(noise_png(3, 70, 50))).convert("RGB")), expected
    )


def test_a_processor_whose_output_the_model_cannot_take_is_refused(tmp_path: Path) -> None:
    tiny_tower("clip", tmp_path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"makes \(3, 64, 64\) pixels; the model takes"):
        load_backend(EncoderSettings(model=tmp_path))


def test_feature_layer_and_dtype(tmp_path: Path) -> None:
    reference = tiny_tower("clip", tmp_path)
    settings = EncoderSettings(model=tmp_path, feature_layer=-2, dtype="bfloat16")
    backend = fixed(load_backend(settings))
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    out = backend.forward(pixels)
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        expected = reference(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    assert torch.allclose(out.float(), expected[:, 1:, :], atol=0.1)


def test_unsupported_model_type_is_refused(tmp_path: Path) -> None:
    from trio_encode.encoder.vlm import FAMILIES

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(
        ValueError,
        match="holds a bert model; supported model types: clip, clip_vision_model, gemma3, gemma4",
    ) as refused:
        load_backend(EncoderSettings(model=tmp_path))
    named = str(refused.value).rpartition(": ")[2].split(", ")
    assert set(FAMILIES) <= set(named)


async def test_image_encoder_serves_an_hf_tower(tmp_path: Path) -> None:
    tiny_tower("clip", tmp_path)
    encoder = ImageEncoder.from_settings(EncoderSettings(model=tmp_path, max_batch_wait=0.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        embedding = await encoder.encode([noise_png(1), noise_png(2)])
        nursery.cancel_scope.cancel()
    assert (embedding.rows, embedding.dim, embedding.dtype) == (32, 32, "float32")
    assert encoder.info.model_id.startswith("hf(")


def test_missing_transformers_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_tower("clip", tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'trio-encode\[hf\]'"):
        load_backend(EncoderSettings(model=tmp_path))
