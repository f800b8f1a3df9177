"""A video through Qwen2.5-Omni's thinker: the tiny Qwen2.5-Omni of ``make-tiny-model`` (laid
out as its checkpoints are: the whole model's config, the thinker's tensors under
``thinker.``, one ``preprocessor_config.json`` for its image processor and its audio feature
extractor, no video processor file of its own), as saved and with the Qwen2.5-Omni-7B
checkpoint's ``preprocessor_config.json`` in its place, and small videos written by PyAV of
several lengths, frame rates and sizes.

SGLang's encoder treats an Omni video as a Qwen2.5-VL one: its own resize, then the video
processor transformers gives the checkpoint (Qwen2-VL's, configured by that shared file), and
``second_per_grid_ts``. Without torchvision: the rows are, to the bit in float32, transformers'
thinker's own ``get_video_features`` on the same ``pixel_values_videos`` and grid, the token
count is the grid's (``t*h*w / merge**2``) and the rows', and the metadata is SGLang's. With
torchvision (the ``video_processor`` marker, failing where torchvision is missing): the pixels
and grid are the checkpoint's transformers video processor's on the frames SGLang's encoder
hands it, and the token count is the video placeholders the Omni processor puts in a prompt.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T
import trio
from safetensors.torch import load_file

from support.video_frames import SYNTHETIC, digest, recorded
from test_encoder_vlm_video import assert_same_settings, clip, metadata, sglang_frames
from trio_encode.embedding import Embedding, RowsEmbedding
from trio_encode.encoder import EncoderSettings, ImageEncoder
from trio_encode.encoder.video import FrameSampling, decode_video
from trio_encode.encoder.vlm import VLMVisionModel
from trio_encode.encoder.vlm_video import (
    QwenVideo,
    VideoPath,
    VideoPixels,
    processor_class,
    processor_settings,
)
from trio_encode.request_types import EmbeddingMemory
from trio_encode.testing.audio import write
from trio_encode.testing.images import noise_uri
from trio_encode.testing.tiny_vlm import OMNI_CHECKPOINT_NAMES, save_tiny_model

# (frames, frame rate, width, height): a short clip enlarged to SGLang's least pixels, a
# longer one at a higher rate and an odd size, one whose frames SGLang shrinks (and the tiny
# checkpoint's processor again), a tall one.
CLIPS = ((8, 4, 80, 48), (31, 10, 100, 70), (5, 2, 960, 720), (12, 6, 48, 160))

OMNI_7B_PREPROCESSOR: dict[str, Any] = {
    "chunk_length": 300,
    "dither": 0.0,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "max_pixels": 12845056,
    "merge_size": 2,
    "min_pixels": 3136,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "patch_size": 14,
    "processor_class": "Qwen2_5OmniProcessor",
    "return_attention_mask": True,
    "sampling_rate": 16000,
    "temporal_patch_size": 2,
}
"""Qwen2.5-Omni-7B's ``preprocessor_config.json``: its only video processor configuration."""

CONFIGS: dict[str, dict[str, Any] | None] = {"tiny": None, "omni_7b": OMNI_7B_PREPROCESSOR}
"""The preprocessor configurations tried: ``make-tiny-model``'s own (frames of at most 256
merged tokens) and the 7B checkpoint's."""

BOUNDS = {"tiny": (28 * 28 * 4, 28 * 28 * 256), "omni_7b": (3136, 12845056)}
"""Each configuration's pixel bounds of a frame, as its video processor reads them."""


@dataclass
class TinyOmni:
    name: str
    path: Path
    video: VideoPath
    """The thinker's video path, as the server would load it."""

    def thinker(self) -> Any:
        """transformers' own thinker with the saved weights (float32)."""
        config = T.AutoConfig.from_pretrained(str(self.path))
        thinker = T.Qwen2_5OmniThinkerForConditionalGeneration(config.thinker_config).eval()
        stored = load_file(str(self.path / "model.safetensors"))
        state = {}
        for ours, theirs in OMNI_CHECKPOINT_NAMES:
            state.update(
                {
                    ours + k.removeprefix(theirs): v
                    for k, v in stored.items()
                    if k.startswith(theirs)
                }
            )
        thinker.load_state_dict(state, strict=True)
        return thinker


def build(name: str, path: Path) -> TinyOmni:
    save_tiny_model("qwen2_5_omni", path)
    preprocessor = CONFIGS[name]
    if preprocessor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    vlm = VLMVisionModel(
        EncoderSettings(model=path, warmup=False), json.loads((path / "config.json").read_text())
    )
    video = VideoPath.for_model(vlm, path)
    assert video is not None
    return TinyOmni(name, path, video)


@pytest.fixture(scope="module", params=list(CONFIGS))
def omni(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyOmni:
    name = str(request.param)
    return build(name, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def thinker(omni: TinyOmni) -> Any:
    return omni.thinker()


@pytest.mark.parametrize("shape", CLIPS, ids=lambda s: "x".join(map(str, s)))
def test_rows_are_the_thinkers_own_get_video_features(
    omni: TinyOmni, thinker: Any, shape: tuple[int, ...]
) -> None:
    decoded = decode_video(clip(*shape))
    prepared = omni.video.prepare(decoded)
    (rows,) = omni.video.features([prepared])
    assert prepared.grid is not None
    grids = torch.tensor([prepared.grid], dtype=torch.long)
    with torch.inference_mode():
        out = thinker.get_video_features(pixel_values_videos=prepared.pixels, video_grid_thw=grids)
    expected = out.pooler_output[0]
    assert rows.dtype == torch.float32
    assert rows.shape == expected.shape
    assert torch.equal(rows, expected)
    t, h, w = prepared.grid
    assert t == -(-len(decoded.indices) // 2)  # pairs of frames, the last repeated if odd
    assert prepared.tokens == t * h * w // 4 == rows.shape[0]
    assert rows.shape[1] == omni.video.vlm.hidden_size == 64


def test_videos_of_different_sizes_share_a_forward(omni: TinyOmni) -> None:
    prepared = [omni.video.prepare(decode_video(clip(*shape))) for shape in CLIPS[:3]]
    together = omni.video.features(prepared)
    for video, rows in zip(prepared, together, strict=True):
        (alone,) = omni.video.features([video])
        assert torch.equal(rows, alone)


def test_the_metadata_is_second_per_grid_ts_as_sglangs_encoder_reports_it(omni: TinyOmni) -> None:
    """SGLang's encoder gives a ``qwen2_5_omni`` video Qwen2.5-VL's ``second_per_grid_ts``:
    the video processor's temporal patch over the sampling's frame rate."""
    prepared = omni.video.prepare(decode_video(clip(31, 10, 100, 70)))
    assert prepared.second_per_grid_ts == 1.0  # 2 frames a patch / 2.0 frames a second
    assert prepared.video_timestamps is None
    assert prepared.meta == (("second_per_grid_ts", 1.0),)
    sampling = FrameSampling(fps=0.5, min_frames=2)
    slow = VideoPath.for_model(omni.video.vlm, omni.path, sampling)
    assert slow is not None
    assert slow.prepare(decode_video(clip(8, 4, 80, 48), sampling)).second_per_grid_ts == 4.0


def test_the_video_processor_is_qwen2_vls_as_the_shared_file_configures_it(
    omni: TinyOmni,
) -> None:
    family = omni.video.family
    assert isinstance(family, QwenVideo)
    assert omni.video.model_type == family.model_type == "qwen2_5_omni"
    saved = json.loads((omni.path / "preprocessor_config.json").read_text())
    assert processor_class("qwen2_5_omni", saved) == "Qwen2VLVideoProcessor"
    assert family.settings == processor_settings("Qwen2VLVideoProcessor", saved)
    assert (family.settings.min_pixels, family.settings.max_pixels) == BOUNDS[omni.name]
    vision = omni.video.vlm.config.vision_config  # the thinker's
    assert family.merge == vision.spatial_merge_size == 2
    assert omni.video.recipe == {
        "sampling": asdict(FrameSampling()),
        "pixels": asdict(VideoPixels()),
        "processor": asdict(family.settings),
    }


@pytest.mark.parametrize(
    ("saved", "name"),
    [
        ({}, "Qwen2VLVideoProcessor"),  # the family's, as transformers maps qwen2_5_omni
        (OMNI_7B_PREPROCESSOR, "Qwen2VLVideoProcessor"),  # the image processor's namesake
        # a checkpoint with a video processor file of its own
        ({"video_processor_type": "Qwen2VLVideoProcessor"}, "Qwen2VLVideoProcessor"),
        ({"video_processor_type": "LlavaOnevisionVideoProcessor"}, None),
    ],
)
def test_the_omni_processor_class_is_the_one_transformers_picks(
    saved: dict[str, Any], name: str | None
) -> None:
    assert processor_class("qwen2_5_omni", saved) == name


PIXELS = {
    "tiny": ("1528ea044f24cb32", "1b5fec6f883f827d"),
    "omni_7b": ("1528ea044f24cb32", "1b5fec6f883f827d"),
}
"""The digest of each configuration's ``pixel_values_videos`` for :data:`SYNTHETIC`, as the
checkpoint's transformers video processor gave it (the torchvision session holds them to it):
Qwen2-VL's processor, as for the tiny Qwen2-VL, whose digests these are too (SGLang's frames
of it lie within every one of these configurations' bounds)."""


def test_pixels_are_the_processors_recorded_ones(omni: TinyOmni) -> None:
    assert digest(omni.video.prepare(SYNTHETIC).pixels) == recorded(PIXELS[omni.name])


# --- through the encoder -----------------------------------------------------------------


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("qwen2_5_omni", tmp_path_factory.mktemp("qwen2_5_omni"))


@asynccontextmanager
async def running(model_dir: Path) -> AsyncIterator[ImageEncoder]:
    encoder = ImageEncoder.from_settings(EncoderSettings(model=model_dir, warmup=False))
    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        yield encoder
        nursery.cancel_scope.cancel()


def split(embedding: EmbeddingMemory) -> list[torch.Tensor]:
    assert isinstance(embedding, Embedding | RowsEmbedding)
    return list(torch.split(embedding.tensor, list(embedding.image_lens)))


async def test_the_encoder_serves_omni_videos_beside_images_and_audio(omni_dir: Path) -> None:
    """A VIDEO part of two clips gets the thinker's video path's rows, grids and
    ``second_per_grid_ts``; its images and audio are still served."""
    videos = [clip(8, 4, 80, 48), clip(13, 6, 100, 70)]
    async with running(omni_dir) as encoder:
        assert encoder.modalities == {"IMAGE", "VIDEO", "AUDIO"}
        assert encoder.recipes["VIDEO"]
        path = encoder.batcher.video
        assert path is not None
        uris = ["data:video/mp4;base64," + base64.b64encode(data).decode() for data in videos]
        items = await encoder.load_items(uris, "VIDEO")
        assert items == videos
        embedding = await encoder.encode(items, "VIDEO")
        image = await encoder.encode(await encoder.load_items([noise_uri(5)]), "IMAGE")
        audio = await encoder.encode([write("wav", 16_000, 1.0)], "AUDIO")
    prepared = [path.prepare(decode_video(data, path.sampling)) for data in videos]
    for got, video in zip(split(embedding), prepared, strict=True):
        (rows,) = path.features([video])
        assert torch.equal(got, rows)
        assert got.shape == (video.tokens, 64)
    assert tuple(embedding.grids) == tuple(video.grid for video in prepared)
    assert embedding.media.modality == "VIDEO"
    assert embedding.media.meta == (("second_per_grid_ts", [1.0, 1.0]),)
    assert image.media.modality == "IMAGE"
    assert audio.media.modality == "AUDIO"
    assert image.image_lens[0] > 0
    assert audio.image_lens[0] > 0


# --- against transformers' own processors (needs torchvision) -----------------------------


def video_processor(omni: TinyOmni) -> Any:
    """The video processor transformers gives the checkpoint (SGLang's encoder loads it so)."""
    return T.AutoVideoProcessor.from_pretrained(str(omni.path), local_files_only=True)


@pytest.mark.video_processor
@pytest.mark.parametrize("shape", CLIPS, ids=lambda s: "x".join(map(str, s)))
def test_pixels_and_grid_are_the_video_processors(omni: TinyOmni, shape: tuple[int, ...]) -> None:
    import torchvision  # the point of this test: it fails, not skips, without torchvision

    assert torchvision.__version__
    decoded = decode_video(clip(*shape))
    processor = video_processor(omni)
    assert type(processor).__name__ == "Qwen2VLVideoProcessor"
    out = processor(
        videos=[sglang_frames(decoded)], do_sample_frames=False, video_metadata=[metadata(decoded)]
    )
    prepared = omni.video.prepare(decoded)
    assert tuple(out["video_grid_thw"][0].tolist()) == prepared.grid
    assert out["pixel_values_videos"].dtype == prepared.pixels.dtype == torch.float32
    assert torch.equal(out["pixel_values_videos"], prepared.pixels)


@pytest.mark.video_processor
def test_settings_are_the_video_processors(omni: TinyOmni) -> None:
    family = omni.video.family
    assert isinstance(family, QwenVideo)
    assert_same_settings(family.settings, video_processor(omni))


@pytest.mark.video_processor
def test_the_recorded_pixels_are_the_processors(omni: TinyOmni) -> None:
    out = video_processor(omni)(
        videos=[sglang_frames(SYNTHETIC)],
        do_sample_frames=False,
        video_metadata=[metadata(SYNTHETIC)],
    )
    assert digest(out["pixel_values_videos"]) == recorded(PIXELS[omni.name])


@pytest.mark.video_processor
@pytest.mark.parametrize("shape", CLIPS, ids=lambda s: "x".join(map(str, s)))
def test_tokens_are_the_omni_processors_video_placeholders(
    omni: TinyOmni, shape: tuple[int, ...]
) -> None:
    """The Omni processor's placeholders and ``video_second_per_grid`` for the frames SGLang's
    encoder chooses. The processor passes its own class's frame bounds (128·28² to 768·28²
    pixels) to the video processor over the checkpoint's, which SGLang's encoder, calling the
    video processor alone, keeps: given the checkpoint's bounds, its count is ours. The 7B's
    bounds hold SGLang's frames unchanged either way (they lie within both)."""
    from support.vlms import tiny_tokenizer
    from test_encoder_vlm_audio import OMNI_TOKENS

    decoded = decode_video(clip(*shape))
    tokenizer = tiny_tokenizer(OMNI_TOKENS)
    videos = video_processor(omni)
    processor = T.Qwen2_5OmniProcessor(
        image_processor=T.AutoImageProcessor.from_pretrained(str(omni.path)),
        video_processor=videos,
        feature_extractor=T.WhisperFeatureExtractor.from_pretrained(str(omni.path)),
        tokenizer=tokenizer,
    )
    video_id = tokenizer.convert_tokens_to_ids(OMNI_TOKENS["video_token"])
    prepared = omni.video.prepare(decoded)
    own_bounds = {
        "shortest_edge": videos.size.shortest_edge,
        "longest_edge": videos.size.longest_edge,
    }
    kwargs: list[dict[str, Any]] = [{"videos_kwargs": {"size": own_bounds}}]
    if omni.name == "omni_7b":
        kwargs.append({})  # the processor's own bounds
    for extra in kwargs:
        out = processor(
            text=f"describe {OMNI_TOKENS['video_token']} this",
            videos=[sglang_frames(decoded)],
            do_sample_frames=False,
            video_metadata=[metadata(decoded)],
            **extra,
        )
        placeholders = sum(int(token == video_id) for token in out["input_ids"][0])
        assert placeholders == prepared.tokens
        assert out["video_second_per_grid"] == [prepared.second_per_grid_ts]
