"""A video through the video paths whose processor resizes every frame to the tower's square,
one tile a frame: LLaVA-OneVision's and InternVL's. Tiny random-weight models built from their
configs (LLaVA-OneVision: a tower of 4 patches a side, pooled to 2 x 2 a frame, and one of 5,
pooled to 3 x 3 by rounding up; InternVL: 4 tokens a tile), with the video processor's
configuration inferred from the image processor's or saved as the checkpoints ship one, and
small videos of several lengths, frame rates and sizes (smaller and larger than the tower's
square).

Without torchvision: the rows are, to the bit in float32, the full model's own (LLaVA-OneVision's
``get_video_features``: its pooled frames, then its newline row; InternVL's
``get_image_features`` on the frames as tiles, as its processor hands them to the model) on the
same pixels, whatever the videos are batched with; the token count is the rule each processor
expands a prompt's video placeholder by, and the rows'; there is no grid and no metadata. With
torchvision (the ``video_processor`` marker, failing where torchvision is missing): the pixels
are the model's transformers video processor's on the chosen frames, and the token count is
the placeholders the model's processor puts in a prompt for the video.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as T

from support.video_frames import SYNTHETIC, digest, recorded
from trio_encode.encoder import EncoderSettings
from trio_encode.encoder.video import DecodedVideo, FrameSampling, decode_video
from trio_encode.encoder.vlm import VLMVisionModel
from trio_encode.encoder.vlm_video import (
    INTERNVL_PROCESSOR,
    ONEVISION_PROCESSOR,
    FixedSizeSettings,
    SquareFramesVideo,
    VideoPath,
    fixed_size_settings,
    processor_class,
)
from trio_encode.testing.tiny_vlm import tiny_parts
from trio_encode.testing.videos import write_video

# (frames, frame rate, width, height): a short clip, a longer one at a higher rate and an odd
# size, one of large frames, one smaller than the tower's square (enlarged).
CLIPS = ((8, 4, 80, 48), (31, 10, 100, 70), (5, 2, 960, 720), (12, 6, 16, 40))

_IMAGENET_MEAN = [0.485, 0.456, 0.406]
_IMAGENET_STD = [0.229, 0.224, 0.225]


def checkpoint_config(side: int, **extra: Any) -> dict[str, Any]:
    """A LLaVA-OneVision video processor configuration as the checkpoints ship one (SigLIP's
    mean and deviation), for a tower of ``side`` pixels."""
    return {
        "video_processor_type": ONEVISION_PROCESSOR,
        "size": {"height": side, "width": side},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 3,
        "do_center_crop": None,
        **extra,
    }


INTERNVL_CONFIG: dict[str, Any] = {
    "video_processor_type": INTERNVL_PROCESSOR,
    "size": {"height": 32, "width": 32},
    "image_mean": _IMAGENET_MEAN,
    "image_std": _IMAGENET_STD,
    "initial_shift": True,
    "do_sample_frames": False,
}
"""An InternVL video processor configuration as the ``-hf`` checkpoints ship one (ImageNet's
mean and deviation), for the tiny tower of 32 pixels."""


@dataclass(frozen=True)
class Variant:
    family: str
    side: int
    """The tower's square, in pixels."""
    frame_rows: int
    """Rows of one frame: LLaVA-OneVision's patches a side, pooled 2 x 2 (rounded up),
    squared; InternVL's tokens a tile."""
    video_config: dict[str, Any] | None
    """The video processor's saved configuration; None: the image processor's is read."""


VARIANTS = {
    "onevision": Variant("llava_onevision", 28, 4, None),
    "onevision+odd+config": Variant("llava_onevision", 35, 9, checkpoint_config(35)),
    "onevision+bilinear": Variant("llava_onevision", 28, 4, checkpoint_config(28, resample=2)),
    "internvl": Variant("internvl", 32, 4, None),
    "internvl+config": Variant("internvl", 32, 4, INTERNVL_CONFIG),
}
"""The tiny models, by name."""


@dataclass
class Tiny:
    name: str
    variant: Variant
    path: Path
    model_class: Any
    video: VideoPath
    """The model's video path, as the server would load it."""

    @property
    def onevision(self) -> bool:
        return self.variant.family == "llava_onevision"

    def reference_model(self) -> Any:
        return self.model_class.from_pretrained(str(self.path), dtype=torch.float32).eval()

    def reference(self, pixels: torch.Tensor) -> torch.Tensor:
        """The full model's own features (float32) for one video's frames, as its forward
        takes a video: LLaVA-OneVision's ``get_video_features``; InternVL's
        ``get_image_features`` on the frames, one tile each, rows frame after frame."""
        model = self.reference_model()
        with torch.inference_mode():
            if self.onevision:
                rows: torch.Tensor = model.get_video_features(
                    pixel_values_videos=pixels[None]
                ).pooler_output[0]
                return rows
            tiles = model.get_image_features(pixel_values=pixels).pooler_output
            return tiles.reshape(-1, tiles.shape[-1])


def save(path: Path, variant: Variant) -> Any:
    """The tiny model of ``variant`` saved in ``path`` with its image processor (and its
    video processor's configuration); its class."""
    torch.manual_seed(0)
    parts = tiny_parts(variant.family, T)
    if variant.family == "llava_onevision":
        parts.config.vision_config.image_size = variant.side
    parts.model_class(parts.config).save_pretrained(str(path))
    parts.image_processor.save_pretrained(str(path))
    if variant.video_config is not None:
        (path / "video_preprocessor_config.json").write_text(json.dumps(variant.video_config))
    return parts.model_class


def load(path: Path) -> VideoPath | None:
    vlm = VLMVisionModel(
        EncoderSettings(model=path, warmup=False),
        json.loads((path / "config.json").read_text()),
    )
    return VideoPath.for_model(vlm, path)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    name = str(request.param)
    variant = VARIANTS[name]
    path = tmp_path_factory.mktemp(name.replace("+", "_"))
    model_class = save(path, variant)
    video = load(path)
    assert video is not None
    return Tiny(name, variant, path, model_class, video)


def clip(count: int, rate: int, width: int, height: int) -> bytes:
    """An H.264 MP4 of ``count`` frames at ``rate`` frames a second."""
    return write_video(count, rate, width, height)


@pytest.mark.parametrize("shape", CLIPS, ids=lambda s: "x".join(map(str, s)))
def test_rows_are_the_models_own_get_video_features(tiny: Tiny, shape: tuple[int, ...]) -> None:
    decoded = decode_video(clip(*shape))
    prepared = tiny.video.prepare(decoded)
    (rows,) = tiny.video.features([prepared])
    side = tiny.variant.side
    assert prepared.pixels.shape == (len(decoded.indices), 3, side, side)
    expected = tiny.reference(prepared.pixels)
    assert rows.dtype == torch.float32
    assert rows.shape == expected.shape
    assert torch.equal(rows, expected)
    frames = len(decoded.indices) * tiny.variant.frame_rows
    assert rows.shape[1] == tiny.video.vlm.hidden_size
    if not tiny.onevision:  # each frame's tile, frame after frame
        assert prepared.tokens == frames == rows.shape[0]
        return
    # each frame's pooled tokens, then the model's newline row once
    assert prepared.tokens == frames + 1 == rows.shape[0]
    newline = tiny.reference_model().model.image_newline.detach()
    assert torch.equal(rows[-1], newline)
    assert not torch.equal(rows[-2], newline)


def test_a_videos_rows_do_not_depend_on_its_batch(tiny: Tiny) -> None:
    prepared = [tiny.video.prepare(decode_video(clip(*shape))) for shape in CLIPS]
    together = tiny.video.features(prepared)
    for video, rows in zip(prepared, together, strict=True):
        (alone,) = tiny.video.features([video])
        assert torch.equal(rows, alone)


def test_no_grid_and_no_metadata(tiny: Tiny) -> None:
    prepared = tiny.video.prepare(SYNTHETIC)
    assert prepared.grid is None
    assert prepared.size is None
    assert prepared.meta == ()


def test_the_frames_are_the_samplings(tmp_path: Path) -> None:
    """The server's sampling chooses the frames (here a fixed count, LLaVA-OneVision's own
    usage): every chosen frame is one frame of pooled rows, none dropped or repeated."""
    save(tmp_path, VARIANTS["onevision"])
    vlm = VLMVisionModel(
        EncoderSettings(model=tmp_path, warmup=False),
        json.loads((tmp_path / "config.json").read_text()),
    )
    eight = FrameSampling(fps=2.0, min_frames=8, max_frames=8)
    path = VideoPath.for_model(vlm, tmp_path, eight)
    assert path is not None
    decoded = decode_video(clip(31, 10, 100, 70), path.sampling)
    assert len(decoded.indices) == 8
    prepared = path.prepare(decoded)
    assert prepared.pixels.shape[0] == 8
    assert prepared.tokens == 8 * 4 + 1


def test_the_recipe_is_the_sampling_and_the_processor(tiny: Tiny) -> None:
    family = tiny.video.family
    assert isinstance(family, SquareFramesVideo)
    assert tiny.video.recipe == {
        "sampling": {"fps": 2.0, "min_frames": 4, "max_frames": 768},
        "processor": {
            "height": tiny.variant.side,
            "width": tiny.variant.side,
            "image_mean": family.settings.image_mean,
            "image_std": family.settings.image_std,
            "rescale_factor": 1 / 255,
            "do_resize": True,
            "do_rescale": True,
            "do_normalize": True,
            "resample": family.settings.resample,
        },
    }


def test_saved_keys_override_the_class_defaults() -> None:
    defaults = fixed_size_settings({})
    assert defaults == FixedSizeSettings()
    assert (defaults.height, defaults.width, defaults.resample) == (384, 384, 3)
    saved = fixed_size_settings(checkpoint_config(35, resample=2, do_rescale=False))
    assert (saved.height, saved.width) == (35, 35)
    assert saved.image_mean == saved.image_std == (0.5, 0.5, 0.5)
    assert (saved.resample, saved.do_rescale, saved.do_normalize) == (2, False, True)


@pytest.mark.parametrize(
    ("saved", "reason"),
    [
        ({"size": {"shortest_edge": 384}}, "size"),
        ({"size": {"height": 384}}, "size"),
        ({"do_center_crop": True, "crop_size": {"height": 28, "width": 28}}, "centre crop"),
        ({"resample": 1}, "resample"),
    ],
)
def test_a_processor_not_reproduced_is_named(saved: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        fixed_size_settings(saved)


@pytest.mark.parametrize(
    ("family", "config", "warning"),
    [
        ("llava_onevision", checkpoint_config(28, do_center_crop=True), "centre crop"),
        ("llava_onevision", checkpoint_config(56), "56x56 pixels .* tower takes 28x28"),
        ("llava_onevision", checkpoint_config(28, do_resize=False), "resize off"),
        ("internvl", {**INTERNVL_CONFIG, "size": {"height": 448, "width": 448}}, "takes 32x32"),
        ("llava_onevision", {"video_processor_type": "Qwen2VLVideoProcessor"}, "not one this"),
        ("internvl", {"video_processor_type": ONEVISION_PROCESSOR}, "not one this"),
    ],
    ids=["crop", "size", "no-resize", "internvl-size", "qwen", "onevision-for-internvl"],
)
def test_a_video_processor_not_reproduced_gives_no_video(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    family: str,
    config: dict[str, Any],
    warning: str,
) -> None:
    side = 28 if family == "llava_onevision" else 32
    save(tmp_path, Variant(family, side, 0, config))
    with caplog.at_level(logging.WARNING, logger="trio_encode.encoder.vlm_video"):
        assert load(tmp_path) is None
    assert any(re.search(warning, record.getMessage()) for record in caplog.records)


@pytest.mark.parametrize(
    ("model_type", "saved", "name"),
    [
        ("llava_onevision", {"video_processor_type": ONEVISION_PROCESSOR}, ONEVISION_PROCESSOR),
        (
            "llava_onevision",
            {"image_processor_type": "LlavaOnevisionImageProcessor"},
            ONEVISION_PROCESSOR,
        ),
        ("llava_onevision", {}, ONEVISION_PROCESSOR),
        # an image processor without a video namesake: the family's
        ("internvl", {"image_processor_type": "GotOcr2ImageProcessor"}, INTERNVL_PROCESSOR),
        ("internvl", {"video_processor_type": INTERNVL_PROCESSOR}, INTERNVL_PROCESSOR),
        # another family's path: not this model's
        ("llava_onevision", {"video_processor_type": "Qwen2VLVideoProcessor"}, None),
        ("llava_onevision", {"image_processor_type": "Qwen2VLImageProcessor"}, None),
        ("llava_onevision", {"video_processor_type": INTERNVL_PROCESSOR}, None),
        ("internvl", {"video_processor_type": ONEVISION_PROCESSOR}, None),
        ("llava_onevision", {"video_processor_type": "LlavaNextVideoVideoProcessor"}, None),
    ],
)
def test_the_processor_class_is_the_one_transformers_picks(
    model_type: str, saved: dict[str, Any], name: str | None
) -> None:
    assert processor_class(model_type, saved) == name


PIXELS = {
    "onevision": ("291a993987cc8f1d", "291a993987cc8f1d"),
    "onevision+odd+config": ("f0d272ee25912411", "f0d272ee25912411"),
    "onevision+bilinear": ("d7227a3b52a74cfa", "3a92da0e63dfcad2"),
    "internvl": ("f8ba3d9de3758403", "f8ba3d9de3758403"),
    "internvl+config": ("5f5bfc844d7804b1", "5f5bfc844d7804b1"),
}
"""The digest of each tiny model's pixels for :data:`SYNTHETIC`, as the model's transformers
video processor gave them (the torchvision tests hold them to it)."""


def test_pixels_are_the_processors_recorded_ones(tiny: Tiny) -> None:
    assert digest(tiny.video.prepare(SYNTHETIC).pixels) == recorded(PIXELS[tiny.name])


# --- against transformers' own processors (needs torchvision) ------------------------------


def processed(tiny: Tiny, decoded: DecodedVideo) -> torch.Tensor:
    """The model's transformers video processor's ``pixel_values_videos`` for the decoded
    frames (as they come from the decoder: ``(T, H, W, 3)`` uint8), one video."""
    import torchvision  # the point of these tests: they fail, not skip, without torchvision

    assert torchvision.__version__
    processor = T.AutoVideoProcessor.from_pretrained(str(tiny.path), local_files_only=True)
    assert type(processor).__name__ == FAMILY_CLASSES[tiny.variant.family]
    out = processor(videos=[decoded.frames], do_sample_frames=False, return_tensors="pt")
    pixels: torch.Tensor = out["pixel_values_videos"][0]
    return pixels


FAMILY_CLASSES = {"llava_onevision": ONEVISION_PROCESSOR, "internvl": INTERNVL_PROCESSOR}


@pytest.mark.video_processor
@pytest.mark.parametrize("shape", CLIPS, ids=lambda s: "x".join(map(str, s)))
def test_pixels_are_the_video_processors(tiny: Tiny, shape: tuple[int, ...]) -> None:
    decoded = decode_video(clip(*shape))
    expected = processed(tiny, decoded)
    prepared = tiny.video.prepare(decoded)
    assert expected.dtype == prepared.pixels.dtype == torch.float32
    assert torch.equal(expected, prepared.pixels)


@pytest.mark.video_processor
def test_the_recorded_pixels_are_the_processors(tiny: Tiny) -> None:
    assert digest(processed(tiny, SYNTHETIC)) == recorded(PIXELS[tiny.name])


def prompt_processor(tiny: Tiny) -> tuple[Any, int]:
    """The model's processor (image, video and a tiny tokenizer) and the token its prompt
    holds once per video row."""
    from support.vlms import tiny_tokenizer

    images = T.AutoImageProcessor.from_pretrained(str(tiny.path), local_files_only=True)
    videos = T.AutoVideoProcessor.from_pretrained(str(tiny.path), local_files_only=True)
    config = tiny.video.vlm.config
    if tiny.onevision:
        tokenizer = tiny_tokenizer({"image_token": "<image>", "video_token": "<video>"})
        patches = config.vision_config.image_size // config.vision_config.patch_size
        processor = T.LlavaOnevisionProcessor(
            images,
            tokenizer,
            videos,
            num_image_tokens=patches**2,  # as the checkpoints' processor_config.json says
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        )
        return processor, tokenizer.convert_tokens_to_ids("<video>")
    tokenizer = tiny_tokenizer(
        {
            "start_image_token": "<img>",
            "end_image_token": "</img>",
            "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>",
        }
    )
    processor = T.InternVLProcessor(images, tokenizer, videos, image_seq_length=4)
    return processor, tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>")


@pytest.mark.video_processor
@pytest.mark.parametrize("shape", CLIPS[:2], ids=lambda s: "x".join(map(str, s)))
def test_tokens_are_the_prompts_video_placeholders(tiny: Tiny, shape: tuple[int, ...]) -> None:
    decoded = decode_video(clip(*shape))
    processor, token_id = prompt_processor(tiny)
    out = processor(text="describe <video> this", videos=[decoded.frames], do_sample_frames=False)
    placeholders = sum(int(token == token_id) for token in out["input_ids"][0])
    assert placeholders == tiny.video.prepare(decoded).tokens


@pytest.mark.video_processor
def test_settings_are_the_video_processors(tiny: Tiny) -> None:
    processor = T.AutoVideoProcessor.from_pretrained(str(tiny.path), local_files_only=True)
    family = tiny.video.family
    assert isinstance(family, SquareFramesVideo)
    assert_same_settings(family.settings, processor)


@pytest.mark.video_processor
@pytest.mark.parametrize("name", [ONEVISION_PROCESSOR, INTERNVL_PROCESSOR])
def test_the_class_defaults_are_transformers(name: str) -> None:
    assert_same_settings(fixed_size_settings({}), getattr(T, name)())


def assert_same_settings(ours: FixedSizeSettings, processor: Any) -> None:
    """Our reading of a video processor's configuration equals the processor's own."""
    assert (ours.height, ours.width) == (processor.size.height, processor.size.width)
    assert ours.image_mean == tuple(processor.image_mean)
    assert ours.image_std == tuple(processor.image_std)
    assert ours.rescale_factor == processor.rescale_factor
    assert int(ours.resample) == int(processor.resample)
    assert (ours.do_resize, ours.do_rescale, ours.do_normalize) == (
        processor.do_resize,
        processor.do_rescale,
        processor.do_normalize,
    )
    assert not processor.do_center_crop
