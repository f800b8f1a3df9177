"""``trio-encode make-tiny-model FAMILY DIR``: a directory of every family the server serves,
made in a second and loaded by the server's own loader, so ``serve --model`` can be tried
without downloading weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

from trio_encode.cli import cli
from trio_encode.encoder import EncoderSettings, ImageEncoder
from trio_encode.testing.audio import write
from trio_encode.testing.images import mixed_jpegs
from trio_encode.testing.tiny_vlm import FAMILIES, family_named

WIDTH = {"qwen2_5_vl": 512, "qwen3_vl": 3 * 64, "qwen3_vl_moe": 3 * 64, "clip": 32, "siglip": 32}
"""Each family's embedding width: the language model's hidden size (64 unless named here);
Qwen3-VL's (and its MoE's) rows carry its two deepstack layers beside it; a bare tower's is
its own."""


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_tiny_model_of_each_family_is_served_from_its_directory(
    family: str, tmp_path: Path
) -> None:
    directory = tmp_path / "model"
    result = CliRunner().invoke(cli, ["make-tiny-model", family, str(directory)])
    assert result.exit_code == 0, result.output
    assert f"trio-encode serve --model {directory}" in result.output
    settings = EncoderSettings(model=directory, warmup=False, max_batch_wait=0.05)
    encoder = ImageEncoder.from_settings(settings)
    if "IMAGE" in encoder.modalities:
        items, modality = mixed_jpegs(2, [(64, 48), (40, 90)]), "IMAGE"
    else:  # an audio model
        items, modality = [write("wav", 16_000, 1.0), write("flac", 44_100, 2.5)], "AUDIO"
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        embedding = await encoder.encode(items, modality)
        nursery.cancel_scope.cancel()
    assert embedding.tensor.shape == (sum(embedding.image_lens), WIDTH.get(family, 64))
    assert len(embedding.image_lens) == 2
    assert all(rows > 0 for rows in embedding.image_lens)
    embedding.release()


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("Qwen2.5-VL", "qwen2_5_vl"),
        ("qwen2_vl", "qwen2_vl"),
        ("LLaVA-OneVision", "llava_onevision"),
        ("Gemma 3", "gemma3"),
        ("Gemma 4", "gemma4"),
        ("Qwen3.5", "qwen3_5"),
        ("Qwen3.5-MoE", "qwen3_5_moe"),
        ("Qwen3-VL-MoE", "qwen3_vl_moe"),
        ("internvl", "internvl"),
        ("SigLIP", "siglip"),
        ("qwen", None),
    ],
)
def test_a_family_is_known_by_its_model_type_or_its_name(name: str, family: str | None) -> None:
    assert family_named(name) == family


def test_every_served_vlm_family_has_a_tiny_model() -> None:
    from trio_encode.encoder.vlm import FAMILIES as SERVED

    assert set(SERVED) <= set(FAMILIES)


def test_an_unknown_family_is_refused_listing_the_families(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["make-tiny-model", "qwen", str(tmp_path / "m")])
    assert result.exit_code == 2
    assert all(model_type in result.output for model_type in FAMILIES)
    assert not (tmp_path / "m").exists()


def test_a_directory_that_holds_anything_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(cli, ["make-tiny-model", "llava", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not empty" in result.output
    assert (tmp_path / "config.json").read_text() == "{}"
