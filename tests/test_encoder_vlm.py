"""A VLM's vision path served from a directory: tiny random-weight models of every family,
built from their configs (nothing downloaded), against transformers' own answers.

For each family the embedding of a request with images of several sizes and aspect ratios is
byte-for-byte the full model's ``get_image_features`` (float32, bfloat16 and float16: equal,
no tolerance; LLaVA-OneVision in float16 within 1e-4), each image's row count is the number
of image tokens the model's processor puts in a prompt for it, and Qwen-VL images report the
processor's grid.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
import trio
from PIL import Image

from support.engines import RankEngines
from support.harness import http_server, landing_pools
from support.vlms import FAMILIES, PHOTOS, TinyVLM, build
from trio_encode.embedding import ArenaEmbedding
from trio_encode.encoder import EncoderSettings, ImageEncoder, load_backend
from trio_encode.encoder.vlm import VLMVisionModel
from trio_encode.testing.images import mixed_jpegs
from trio_encode.testing.tiny_vlm import VLM_IMAGE_SIZES, save_tiny_qwen2_5_vl


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyVLM:
    family = str(request.param)
    return build(family, tmp_path_factory.mktemp(family))


async def encode(settings: EncoderSettings, images: list[bytes]) -> torch.Tensor | ArenaEmbedding:
    encoder = ImageEncoder.from_settings(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        embedding = await encoder.encode(images)
        nursery.cancel_scope.cancel()
    return embedding  # type: ignore[return-value]


def settings_for(path: Path, **changes: object) -> EncoderSettings:
    values: dict[str, object] = {
        "model": path,
        "max_batch_wait": 0.05,
        "max_batch_size": len(PHOTOS),
        "arena_bytes": 8 << 20,
        "warmup": False,
    }
    return EncoderSettings(**(values | changes))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
async def test_served_bytes_equal_transformers_and_counts_equal_the_prompt(
    tiny: TinyVLM, dtype: str
) -> None:
    embedding = await encode(settings_for(tiny.path, dtype=dtype), PHOTOS)
    assert isinstance(embedding, ArenaEmbedding)  # images of different sizes share the arena
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in PHOTOS]
    expected = tiny.reference(images, getattr(torch, dtype))
    served = embedding.tensor
    assert served.dtype == expected.dtype
    if (tiny.family, dtype) == ("llava_onevision", "float16"):
        # The one inexact case seen: float16 on CPU, a few ulps (7.6e-6 measured).
        assert torch.allclose(served, expected, rtol=0, atol=1e-4)
    else:
        assert torch.equal(served, expected)
    assert list(embedding.image_lens) == [tiny.prompt_tokens(image) for image in images]
    if tiny.family.startswith("qwen"):
        grids = tiny.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        assert list(embedding.grids) == [tuple(int(v) for v in g) for g in grids]
    else:
        assert all(grid is None for grid in embedding.grids)
    if tiny.family.startswith("qwen") or tiny.family == "gemma4":
        assert len(set(embedding.image_lens)) > 1  # the sizes really differ
    embedding.release()


def _vision_tensor(name: str, modules: tuple[str, ...]) -> bool:
    """Whether a checkpoint tensor (original ``visual.`` or nested ``model.visual.`` layout)
    lies in one of the family's vision modules."""
    return any(
        name.startswith(f"{path}.") or f"model.{name}".startswith(f"{path}.") for path in modules
    )


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5_moe", "gemma4"])
def test_the_language_models_weights_are_never_read(tmp_path: Path, family: str) -> None:
    """Every shard that holds only language-model tensors is overwritten with garbage or
    deleted: the vision path still loads and gives the same embeddings."""
    build(family, tmp_path)
    settings = settings_for(tmp_path)
    before = load_backend(settings)
    assert isinstance(before, VLMVisionModel)
    prepared = [before.decode(data, max_pixels=10**7) for data in PHOTOS]
    expected = torch.cat(before.encode(prepared))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shards: dict[str, set[str]] = {}
    for name, shard in index.items():
        shards.setdefault(shard, set()).add(name)
    modules = before.family.modules
    language_only = sorted(
        shard
        for shard, names in shards.items()
        if not any(_vision_tensor(n, modules) for n in names)
    )
    assert len(language_only) >= 2, "the tiny model must have language-only shards"
    for number, shard in enumerate(language_only):
        if number % 2:
            (tmp_path / shard).unlink()
        else:
            (tmp_path / shard).write_bytes(b"\xff" * 4096)
    after = load_backend(settings)
    assert torch.equal(torch.cat(after.encode(prepared)), expected)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5_moe", "gemma4"])
def test_the_language_model_stays_without_memory(tmp_path: Path, family: str) -> None:
    build(family, tmp_path)
    model = load_backend(settings_for(tmp_path))
    assert isinstance(model, VLMVisionModel)
    language = model.model.get_submodule("model.language_model")
    assert all(param.is_meta for param in language.parameters())
    for path in model.family.modules:
        assert not any(param.is_meta for param in model.model.get_submodule(path).parameters())


def test_a_missing_vision_tensor_is_named(tmp_path: Path) -> None:
    build("qwen2_5_vl", tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["visual.merger.mlp.0.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"lacks 1 vision tensors, e\.g\. model\.visual\.merger\.mlp\.0"
    ):
        load_backend(settings_for(tmp_path))


def test_flags_of_the_built_in_model_are_refused_with_a_model_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hidden_size applies only to the built-in ViT"):
        EncoderSettings(model=tmp_path, hidden_size=3584)
    with pytest.raises(ValueError, match="image_size, hidden_size apply only"):
        EncoderSettings(model=tmp_path, hidden_size=3584, image_size=448)


def test_feature_layer_is_refused_for_a_vlm(tmp_path: Path) -> None:
    build("llava", tmp_path)
    with pytest.raises(ValueError, match="feature_layer does not apply to a llava model"):
        load_backend(settings_for(tmp_path, feature_layer=-2))


def test_the_bench_models_mix_of_sizes_gives_different_token_counts(tmp_path: Path) -> None:
    save_tiny_qwen2_5_vl(tmp_path)
    model = load_backend(EncoderSettings(model=tmp_path))
    jpegs = mixed_jpegs(len(VLM_IMAGE_SIZES), VLM_IMAGE_SIZES)
    prepared = [model.decode(jpeg, max_pixels=10**7) for jpeg in jpegs]
    assert [image.tokens for image in prepared] == [64, 72, 50, 192]
    assert [image.grid for image in prepared] == [
        (1, 16, 16),
        (1, 12, 24),
        (1, 20, 10),
        (1, 24, 32),
    ]
    assert [Image.open(io.BytesIO(j)).size for j in jpegs] == list(VLM_IMAGE_SIZES)


async def test_over_http_the_answer_and_the_landed_bytes_are_the_models(
    tmp_path: Path, rank_engines: RankEngines
) -> None:
    """The real server and a real Mooncake receiver: ``/encode`` answers each image's rows and
    grid, and ``/send`` lands transformers' own features, byte for byte."""
    tiny = build("qwen2_5_vl", tmp_path)
    encoder = ImageEncoder.from_settings(settings_for(tmp_path, max_batch_wait=0.2))
    uris = ["data:image/png;base64," + base64.b64encode(data).decode() for data in PHOTOS]
    images = [Image.open(io.BytesIO(data)).convert("RGB") for data in PHOTOS]
    expected = tiny.reference(images, torch.float32)
    async with (
        http_server(rank_engines.server, encoder=encoder) as harness,
        landing_pools(rank_engines, expected.numel() * 4 + 4096) as pools,
    ):
        with trio.fail_after(60):
            encoded = await harness.client.encode("vlm", uris, receive_count=1)
            slot = pools[0].allocate(encoded.embedding_size)
            await harness.client.send("vlm", pools[0].session_id, slot.address)
            await harness.settled()
        grids = tiny.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        assert encoded.body["embedding_lens"] == [tiny.prompt_tokens(image) for image in images]
        assert encoded.body["grid_dim"] == grids.tolist()
        assert (encoded.embedding_len, encoded.embedding_dim) == tuple(expected.shape)
        assert torch.equal(slot.read(*expected.shape, "float32"), expected)
