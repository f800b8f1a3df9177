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

from trio_encode.encoder import EncoderSettings, ImageEncoder, load_backend


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


def png(seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    array = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.parametrize(("kind", "tokens"), [("clip", 16), ("siglip", 16)])
def test_tiny_tower_loads_and_matches_transformers(kind: str, tokens: int, tmp_path: Path) -> None:
    reference = tiny_tower(kind, tmp_path)
    backend = load_backend(EncoderSettings(hf_model_dir=tmp_path))
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


def test_preprocessing_comes_from_the_model_directory(tmp_path: Path) -> None:
    tiny_tower("clip", tmp_path)
    assert load_backend(EncoderSettings(hf_model_dir=tmp_path)).preprocess.mean[0] == (
        pytest.approx(0.48145466)
    )
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.1, 0.2, 0.3], "image_std": 0.5, "do_center_crop": False})
    )
    preprocess = load_backend(EncoderSettings(hf_model_dir=tmp_path)).preprocess
    assert preprocess.mean == (0.1, 0.2, 0.3)
    assert preprocess.std == (0.5, 0.5, 0.5)
    assert not preprocess.center_crop


def test_feature_layer_and_dtype(tmp_path: Path) -> None:
    reference = tiny_tower("clip", tmp_path)
    settings = EncoderSettings(hf_model_dir=tmp_path, hf_feature_layer=-2, dtype="bfloat16")
    backend = load_backend(settings)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    out = backend.forward(pixels)
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        expected = reference(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    assert torch.allclose(out.float(), expected[:, 1:, :], atol=0.1)


def test_unsupported_model_type_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="holds a bert model; supported: clip"):
        load_backend(EncoderSettings(hf_model_dir=tmp_path))


async def test_image_encoder_serves_an_hf_tower(tmp_path: Path) -> None:
    tiny_tower("clip", tmp_path)
    encoder = ImageEncoder.from_settings(EncoderSettings(hf_model_dir=tmp_path, max_batch_wait=0.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        embedding = await encoder.encode([png(1), png(2)])
        nursery.cancel_scope.cancel()
    assert (embedding.rows, embedding.dim, embedding.dtype) == (32, 32, "float32")
    assert encoder.info.model_id.startswith("hf(")


def test_missing_transformers_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_tower("clip", tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'trio-encode\[hf\]'"):
        load_backend(EncoderSettings(hf_model_dir=tmp_path))
