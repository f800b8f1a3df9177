"""SGLang's ``VIDEO`` parts through the encoder the service uses: from a video's bytes to the
embedding, its grids and metadata, and the completion message its prefill rank gets.

A tiny random-weight Qwen2.5-VL (whose parts carry ``second_per_grid_ts``) and Qwen3-VL (whose
parts carry ``video_timestamps``) serve small videos written by PyAV. Each part's rows are, to
the bit, the model's video path run on the frames SGLang's rule selects; videos and images of
concurrent requests share a forward and each still gets its own rows; a model without a video
path refuses a video part before loading a byte of it.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
import trio

from support.lifecycle_rig import landing_on
from support.sglang_pickle import Modality, safe_loads
from test_completion_notices import ScriptedPusher
from test_encoder_vlm_video import clip
from trio_encode.completion import Endpoint
from trio_encode.embedding import Embedding, RowsEmbedding
from trio_encode.encoder import EncoderSettings, ImageEncoder
from trio_encode.encoder.video import decode_video
from trio_encode.encoder.vlm_video import VideoPath
from trio_encode.errors import InvalidInput
from trio_encode.request_types import EmbeddingMemory, EmbeddingShape
from trio_encode.service import EncodeService, Notify, ServiceSettings
from trio_encode.testing.images import noise_uri
from trio_encode.testing.memory_engine import InMemoryFabric
from trio_encode.testing.tiny_vlm import save_tiny_model

SHORT = clip(8, 4, 80, 48)
LONGER = clip(13, 6, 100, 70)


def uri(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = str(request.param)
    return save_tiny_model(family, tmp_path_factory.mktemp(family))


@asynccontextmanager
async def running(model_dir: Path, **settings: object) -> AsyncIterator[ImageEncoder]:
    encoder = ImageEncoder.from_settings(
        EncoderSettings(model=model_dir, warmup=False, **settings)  # type: ignore[arg-type]
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        yield encoder
        nursery.cancel_scope.cancel()


def reference(path: VideoPath, data: bytes) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The rows and grid of one video by the model's video path alone."""
    prepared = path.prepare(decode_video(data, path.sampling))
    (rows,) = path.features([prepared])
    assert prepared.grid is not None
    return rows, tuple(prepared.grid)


def split(embedding: EmbeddingMemory) -> list[torch.Tensor]:
    assert isinstance(embedding, Embedding | RowsEmbedding)
    return list(torch.split(embedding.tensor, list(embedding.image_lens)))


async def test_a_part_of_videos_is_the_models_video_path_to_the_bit(model_dir: Path) -> None:
    async with running(model_dir) as encoder:
        assert encoder.modalities == {"IMAGE", "VIDEO"}
        path = encoder.batcher.video
        assert path is not None
        items = await encoder.load_items([uri(SHORT), uri(LONGER)], "VIDEO")
        assert items == [SHORT, LONGER]
        embedding = await encoder.encode(items, "VIDEO")
        again = await encoder.encode(items, "VIDEO")  # never served rows without their metadata
    assert again.media == embedding.media
    assert tuple(again.grids) == tuple(embedding.grids)
    expected = [reference(path, SHORT), reference(path, LONGER)]
    for got, (rows, _) in zip(split(embedding), expected, strict=True):
        assert torch.equal(got, rows)
    assert tuple(embedding.grids) == tuple(grid for _, grid in expected)
    media = embedding.media
    assert media.modality == "VIDEO"
    prepared = [path.prepare(decode_video(data, path.sampling)) for data in (SHORT, LONGER)]
    if path.model_type == "qwen2_5_vl":
        assert media.meta == (
            ("second_per_grid_ts", [video.second_per_grid_ts for video in prepared]),
        )
    else:
        assert media.meta == (
            ("video_timestamps", [list(video.video_timestamps or ()) for video in prepared]),
        )


async def test_a_video_and_an_image_of_concurrent_requests_share_a_forward(
    model_dir: Path,
) -> None:
    image = noise_uri(3)
    async with running(model_dir, max_batch_wait=0.5) as encoder:
        path = encoder.batcher.video
        assert path is not None
        got: dict[str, EmbeddingMemory] = {}

        async def encode(name: str, item: str, modality: str) -> None:
            items = await encoder.load_items([item], modality)
            got[name] = await encoder.encode(items, modality)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(encode, "video", uri(SHORT), "VIDEO")
            nursery.start_soon(encode, "image", image, "IMAGE")
        alone = await encoder.encode(await encoder.load_items([image]), "IMAGE")
    rows, grid = reference(path, SHORT)
    assert torch.equal(split(got["video"])[0], rows)
    assert tuple(got["video"].grids) == (grid,)
    assert torch.equal(split(got["image"])[0], split(alone)[0])
    assert got["image"].media.modality == "IMAGE"


async def test_a_videos_frames_follow_the_sampling_settings(model_dir: Path) -> None:
    """``--video-fps`` chooses the frames as SGLang's ``fps`` does: 2 s of video at 2 frames a
    second is 4 frames (2 temporal patches), at 4 frames a second 8 (4 patches)."""
    async with running(model_dir) as encoder:
        one = await encoder.encode([SHORT], "VIDEO")
    async with running(model_dir, video_fps=4.0) as slower:
        other = await slower.encode([SHORT], "VIDEO")
    assert [grid[0] for grid in one.grids if grid] == [2]
    assert [grid[0] for grid in other.grids if grid] == [4]


async def test_a_model_without_a_video_path_refuses_a_video_part_before_loading_it() -> None:
    encoder = ImageEncoder.from_settings(EncoderSettings(warmup=False))
    assert encoder.modalities == {"IMAGE"}
    with pytest.raises(InvalidInput, match=r"'VIDEO' is not served by this model \(it serves"):
        await encoder.load_items(["https://example.invalid/never-fetched.mp4"], "VIDEO")


async def test_a_video_that_is_not_one_is_a_400_naming_its_item(model_dir: Path) -> None:
    async with running(model_dir) as encoder:
        with pytest.raises(InvalidInput, match=r"^mm_items\[1\]: unsupported video type"):
            await encoder.load_items([uri(SHORT), noise_uri(1)], "VIDEO")
        with pytest.raises(InvalidInput, match=r"mm_items\[0\]"):
            await encoder.encode([b"\x00\x00\x00\x18ftypmp42 not a video"], "VIDEO")


async def test_a_video_parts_rank_is_told_its_modality_grid_and_metadata(model_dir: Path) -> None:
    """What SGLang's prefill rebuilds a video part from: ``Modality.VIDEO``, the
    ``video_grid_thw`` and the family's metadata, in the completion message of its ``/send``."""
    fabric = InMemoryFabric()
    pusher = ScriptedPusher()
    rank = Endpoint("127.0.0.1", 41000)
    encoder = ImageEncoder.from_settings(EncoderSettings(model=model_dir, warmup=False))
    async with EncodeService.running(
        engine=fabric.engine("encoder"),
        encoder=encoder,
        settings=ServiceSettings(),
        pusher=pusher,
    ) as service:
        landing = await landing_on(fabric, "rank0", nbytes=1 << 22)
        report = await service.encode(
            "v_local_part_0", [uri(SHORT)], receive_count=1, modality="VIDEO"
        )
        sent = await service.send("v_local_part_0", landing.receiver, notify=Notify(rank))
    assert sent.shape == report.shape
    (message,) = pusher.to(rank, "done")
    loaded = safe_loads(message)
    assert loaded.modality is Modality.VIDEO
    assert loaded.grid_dim == [list(grid) for grid in report.shape.grids if grid is not None]
    for name, value in report.shape.media.meta:
        assert getattr(loaded, name) == value
    assert report.shape.media.meta  # each family here sends one kind of metadata


async def test_the_http_answers_of_a_video_part_carry_its_metadata(model_dir: Path) -> None:
    """``/encode`` (and so a rank's pull and ``/send``) names the family's metadata beside
    ``grid_dim``; an image part's answers have none of it."""
    from trio_encode.server.schemas import EncodeRequest, encode_answer
    from trio_encode.service import EncodeReport

    async with running(model_dir) as encoder:
        embedding = await encoder.encode([SHORT], "VIDEO")
        image = await encoder.encode(await encoder.load_items([noise_uri(2)]), "IMAGE")
    for part, modality in ((embedding, "VIDEO"), (image, "IMAGE")):
        shape = EmbeddingShape(
            part.rows,
            part.dim,
            part.nbytes,
            part.dtype,
            part.checksum,
            tuple(part.grids),
            tuple(part.image_lens),
            part.media,
        )
        body = EncodeRequest(req_id="r", mm_items=["x"], modality=modality)
        answer = encode_answer(body, EncodeReport(shape, 1))
        meta = {"second_per_grid_ts", "video_timestamps"} & set(answer)
        assert {name: answer[name] for name in meta} == dict(part.media.meta)
        assert bool(meta) == (modality == "VIDEO")


async def test_encoder_runs_are_timed_by_modality(model_dir: Path) -> None:
    from trio_encode.server.metrics import Metrics

    metrics = Metrics()
    async with running(model_dir) as encoder:
        timed = metrics.timed(encoder)
        await timed.encode([SHORT], "VIDEO")
        await timed.encode(await encoder.load_items([noise_uri(4)]), "IMAGE")
    for modality in ("VIDEO", "IMAGE"):
        count = metrics.registry.get_sample_value(
            "trio_encode_encode_seconds_count", {"modality": modality}
        )
        assert count == 1, modality
