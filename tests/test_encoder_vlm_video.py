"""A video through a Qwen-VL model's own video path: tiny random-weight models of each family,
built from their configs, and small videos written here by PyAV (a gradient that moves with
the frame's index, so every frame differs) of several lengths, frame rates and sizes.

Without torchvision: the rows are, to the bit in float32, the full model's own
``get_video_features`` on the same ``pixel_values_videos`` and grid, the token count is the
grid's (``t*h*w / merge**2``, the rule the Qwen processors expand a prompt's video
placeholder by) and the rows', and the metadata is SGLang's. With torchvision (the
``video_processor`` marker, its own nox session, failing where torchvision is missing): the
``pixel_values_videos`` and grid are the model's transformers video processor's on the frames
SGLang's encoder hands it (its own torchvision resize first), and the token count is the
video placeholders the model's processor puts in a prompt.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers as T

from support.video_frames import SYNTHETIC, digest, pattern, recorded
from trio_encode.encoder import EncoderSettings
from trio_encode.encoder.video import (
    DecodedVideo,
    FrameSampling,
    decode_video,
    video_timestamps,
)
from trio_encode.encoder.vlm import VLMVisionModel
from trio_encode.encoder.vlm_video import (
    PROCESSOR_DEFAULTS,
    QwenVideo,
    VideoPath,
    VideoPixels,
    patchify,
    processor_class,
    processor_frame_size,
    processor_resize,
    processor_settings,
    sglang_frame_size,
    sglang_resize,
)
from trio_encode.errors import InvalidInput
from trio_encode.testing.tiny_vlm import tiny_parts
from trio_encode.testing.videos import write_video

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")

# (frames, frame rate, width, height): a short clip enlarged to SGLang's least pixels, a
# longer one at a higher rate and an odd size, one whose frames SGLang shrinks, a tall one.
CLIPS = ((8, 4, 80, 48), (31, 10, 100, 70), (5, 2, 960, 720), (12, 6, 48, 160))

QWEN3_VIDEO_CONFIG: dict[str, Any] = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "size": {"shortest_edge": 4096, "longest_edge": 32 * 32 * 200},
    "patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 1,  # not Qwen3-VL's key: its processor ignores it
}
"""A Qwen3-VL video processor configuration as the checkpoints ship one (beside the image
processor's), small enough for the tiny model."""


def clip(count: int, rate: int, width: int, height: int) -> bytes:
    """An H.264 MP4 of ``count`` frames at ``rate`` frames a second."""
    return write_video(count, rate, width, height)


@dataclass
class Tiny:
    name: str
    family: str
    path: Path
    model_class: Any
    video: VideoPath
    """The model's video path, as the server would load it."""

    def reference(self, pixels: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        """The full model's own ``get_video_features`` (float32), rows laid out as served."""
        model = self.model_class.from_pretrained(str(self.path), dtype=torch.float32).eval()
        grids = torch.tensor([grid], dtype=torch.long)
        with torch.inference_mode():
            out = model.get_video_features(pixel_values_videos=pixels, video_grid_thw=grids)
        rows = out.pooler_output[0]
        if getattr(out, "deepstack_features", None):
            rows = torch.cat([rows, *(layer[0] for layer in out.deepstack_features)], dim=-1)
        return rows


def build(
    family: str, path: Path, video_config: dict[str, Any] | None = None, name: str = ""
) -> Tiny:
    """The tiny model of ``family`` saved in ``path`` with its image processor (and
    ``video_config`` as its video processor's configuration), loaded vision-only."""
    torch.manual_seed(0)
    parts = tiny_parts(family, T)
    parts.model_class(parts.config).save_pretrained(str(path))
    parts.image_processor.save_pretrained(str(path))
    if video_config is not None:
        (path / "video_preprocessor_config.json").write_text(json.dumps(video_config))
    vlm = VLMVisionModel(
        EncoderSettings(model=path, warmup=False),
        json.loads((path / "config.json").read_text()),
    )
    video_path = VideoPath.for_model(vlm, path)
    assert video_path is not None
    return Tiny(name or family, family, path, parts.model_class, video_path)


@pytest.fixture(scope="module", params=[*FAMILIES, "qwen3_vl+video_config"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    name = str(request.param)
    family, _, extra = name.partition("+")
    config = QWEN3_VIDEO_CONFIG if extra else None
    return build(family, tmp_path_factory.mktemp(family), config, name)


@pytest.mark.parametrize("shape", CLIPS, ids=lambda s: "x".join(map(str, s)))
def test_rows_are_the_models_own_get_video_features(tiny: Tiny, shape: tuple[int, ...]) -> None:
    decoded = decode_video(clip(*shape))
    prepared = tiny.video.prepare(decoded)
    (rows,) = tiny.video.features([prepared])
    expected = tiny.reference(prepared.pixels, prepared.grid or ())
    assert rows.dtype == torch.float32
    assert rows.shape == expected.shape
    assert torch.equal(rows, expected)
    t, h, w = prepared.grid or ()
    assert t == -(-len(decoded.indices) // 2)  # pairs of frames, the last repeated if odd
    assert prepared.tokens == t * h * w // 4 == rows.shape[0]
    assert rows.shape[1] == tiny.video.vlm.hidden_size


def test_videos_of_different_sizes_share_a_forward(tiny: Tiny) -> None:
    prepared = [tiny.video.prepare(decode_video(clip(*shape))) for shape in CLIPS[:2]]
    together = tiny.video.features(prepared)
    for video, rows in zip(prepared, together, strict=True):
        (alone,) = tiny.video.features([video])
        assert torch.equal(rows, alone)


def test_metadata_is_sglangs(tiny: Tiny) -> None:
    decoded = decode_video(clip(31, 10, 100, 70))
    prepared = tiny.video.prepare(decoded)
    t = (prepared.grid or ())[0]
    if tiny.family == "qwen2_5_vl":
        assert prepared.second_per_grid_ts == 1.0  # 2 frames a patch / 2.0 frames a second
    else:
        assert prepared.second_per_grid_ts is None
    if tiny.family.startswith("qwen3"):
        stamps = video_timestamps(list(decoded.indices), decoded.fps, 2)
        assert prepared.video_timestamps == tuple(stamps)
        assert len(stamps) == t
    else:
        assert prepared.video_timestamps is None


def test_the_recipe_is_the_sampling_the_resize_bounds_and_the_processor(tiny: Tiny) -> None:
    family = tiny.video.family
    assert isinstance(family, QwenVideo)
    assert tiny.video.recipe == {
        "sampling": asdict(FrameSampling()),
        "pixels": asdict(VideoPixels()),
        "processor": asdict(family.settings),
    }


def test_second_per_grid_follows_the_sampling_rate(tmp_path: Path) -> None:
    tiny = build("qwen2_5_vl", tmp_path)
    slow = VideoPath.for_model(tiny.video.vlm, tmp_path, FrameSampling(fps=0.5, min_frames=2))
    assert slow is not None
    decoded = decode_video(clip(8, 4, 80, 48), FrameSampling(fps=0.5, min_frames=2))
    assert slow.prepare(decoded).second_per_grid_ts == 4.0


def test_families_without_a_video_path_here_get_none(tmp_path: Path) -> None:
    parts = tiny_parts("llava", T)
    parts.model_class(parts.config).save_pretrained(str(tmp_path))
    parts.image_processor.save_pretrained(str(tmp_path))
    vlm = VLMVisionModel(
        EncoderSettings(model=tmp_path, warmup=False),
        json.loads((tmp_path / "config.json").read_text()),
    )
    assert VideoPath.for_model(vlm, tmp_path) is None


# SGLang's rule, worked by hand: 48x80 is enlarged to at least 128*28*28 pixels
# (sqrt(100352/3840) = 5.11: 252x420); 720x1280 is shrunk to at most 768*28*28 pixels a frame
# (sqrt(921600/602112) = 1.24: 560x1008), or, at 768 frames, to 90316800*2/768 = 235200
# (1.98: 336x644); 28 px multiples throughout, whatever the model's patch.
@pytest.mark.parametrize(
    ("height", "width", "frames", "size"),
    [
        (48, 80, 4, (252, 420)),
        (720, 1280, 4, (560, 1008)),
        (720, 1280, 300, (560, 1008)),
        (720, 1280, 768, (336, 644)),
        (364, 644, 768, (364, 644)),
    ],
)
def test_sglangs_frame_size(height: int, width: int, frames: int, size: tuple[int, int]) -> None:
    assert sglang_frame_size(height, width, frames, VideoPixels()) == size


def test_sglangs_pixel_floor_bounds_the_longest_videos() -> None:
    # 90316800*2/1e6 frames is below 1.05 * the least pixels (105,369): that bound wins
    # (sqrt(921600/105369) = 2.96: 224x420, floored below the least pixels, as SGLang does)
    assert sglang_frame_size(720, 1280, 1_000_000, VideoPixels()) == (224, 420)


def test_a_frame_too_narrow_is_refused() -> None:
    with pytest.raises(InvalidInput, match="too narrow"):
        sglang_frame_size(2, 500, 4, VideoPixels())


def test_the_processors_own_rule_counts_frames_for_qwen3_only() -> None:
    qwen2 = processor_settings(
        "Qwen2VLVideoProcessor", {"size": {"shortest_edge": 3136, "longest_edge": 200704}}
    )
    qwen3 = processor_settings(
        "Qwen3VLVideoProcessor", {"size": {"shortest_edge": 4096, "longest_edge": 262144}}
    )
    # within Qwen2-VL's per-frame bound: unchanged at any frame count
    assert processor_frame_size(252, 420, 8, qwen2) == (252, 420)
    # Qwen3-VL's bound is over t x h x w: 8 frames of 256x416 are 851,968 > 262,144
    assert processor_frame_size(252, 420, 8, qwen3) == (128, 224)
    assert processor_frame_size(252, 420, 2, qwen3) == (256, 416)


def test_saved_keys_override_the_class_defaults() -> None:
    qwen2 = processor_settings(
        "Qwen2VLVideoProcessor",
        {"size": {"shortest_edge": 10, "longest_edge": 20}, "max_pixels": 99},
    )
    assert (qwen2.min_pixels, qwen2.max_pixels) == (10, 99)  # Qwen2-VL: max_pixels over size
    qwen3 = processor_settings("Qwen3VLVideoProcessor", QWEN3_VIDEO_CONFIG)
    assert (qwen3.min_pixels, qwen3.max_pixels) == (4096, 32 * 32 * 200)  # min_pixels ignored
    assert qwen3.image_mean == (0.5, 0.5, 0.5)
    defaults = processor_settings("Qwen3VLVideoProcessor", {})
    assert defaults.max_pixels == PROCESSOR_DEFAULTS["Qwen3VLVideoProcessor"]["max_pixels"]
    with pytest.raises(ValueError, match="resample"):
        processor_settings("Qwen2VLVideoProcessor", {"resample": 1})


@pytest.mark.parametrize(
    ("model_type", "saved", "name"),
    [
        # named by the video processor's own configuration
        ("qwen2_vl", {"video_processor_type": "Qwen3VLVideoProcessor"}, "Qwen3VLVideoProcessor"),
        # inferred from the image processor's (how a Qwen3-VL without its own file loads)
        ("qwen3_vl", {"image_processor_type": "Qwen2VLImageProcessor"}, "Qwen2VLVideoProcessor"),
        # an image processor without a video namesake: the family's
        ("qwen3_vl", {"image_processor_type": "NoSuchImageProcessor"}, "Qwen3VLVideoProcessor"),
        ("qwen3_5", {}, "Qwen3VLVideoProcessor"),
        # not reproduced here
        ("qwen2_vl", {"video_processor_type": "LlavaOnevisionVideoProcessor"}, None),
        ("qwen2_vl", {"auto_map": {"AutoVideoProcessor": "x.Y"}}, None),
        ("qwen3_vl", {"cap_pixels_per_frame": True}, None),
    ],
)
def test_the_processor_class_is_the_one_transformers_picks(
    model_type: str, saved: dict[str, Any], name: str | None
) -> None:
    assert processor_class(model_type, saved) == name


# What torchvision gave (see ``recorded``). Bilinear on uint8 runs on the uint8 frames only
# where the CPU has AVX2; elsewhere in float32, as torchvision does. The torchvision session
# holds these to torchvision itself.
RESIZES = {
    "sglang": ("7d520cda976f77b5", "7d520cda976f77b5"),
    "sglang_down": ("0807916ccae59664", "0807916ccae59664"),
    "bicubic": ("4fc946f8e5482557", "4fc946f8e5482557"),
    "bilinear": ("360aa7fd8b69e646", "5999ca330ef6266c"),
}


def resized(step: str) -> torch.Tensor:
    if step == "sglang":
        return sglang_resize(pattern(2, 13, 17), (28, 56))
    if step == "sglang_down":
        return sglang_resize(pattern(2, 100, 150), (56, 84))
    return processor_resize(pattern(2, 28, 56).unsqueeze(0), (32, 64), RESAMPLE[step])[0]


RESAMPLE = {"bicubic": 3, "bilinear": 2}


@pytest.mark.parametrize("step", RESIZES)
def test_each_resize_gives_torchvisions_bytes(step: str) -> None:
    assert digest(resized(step)) == recorded(RESIZES[step])


def test_patches_are_the_mergers_order_and_an_odd_last_frame_is_repeated() -> None:
    settings = processor_settings("Qwen2VLVideoProcessor", {"patch_size": 2})
    # frames 0..2 of 3 channels, 8x8: each value names its frame, channel, row and column
    t, c, y, x = np.meshgrid(np.arange(3), np.arange(3), np.arange(8), np.arange(8), indexing="ij")
    frames = torch.from_numpy((t * 1000 + c * 100 + y * 10 + x).astype(np.float32))
    patches, grid = patchify(frames, settings)
    assert grid == (2, 4, 4)
    assert patches.shape == (2 * 4 * 4, 3 * 2 * 2 * 2)
    # a patch is channels, then its two frames, then rows and columns of 2x2 pixels
    first = patches[0].reshape(3, 2, 2, 2)
    assert first[1, 1, 0, 1] == 1000 + 100 + 0 + 1
    # patches go by 2x2 blocks of patches (the merger's groups): the second is to the right
    assert patches[1].reshape(3, 2, 2, 2)[0, 0, 0, 0] == 2
    assert patches[2].reshape(3, 2, 2, 2)[0, 0, 0, 0] == 20  # then the one below the first
    assert patches[4].reshape(3, 2, 2, 2)[0, 0, 0, 0] == 4  # then the next group
    # the third frame is the last: it fills both frames of the second temporal patch
    last = patches[16].reshape(3, 2, 2, 2)
    assert last[0, 0, 0, 0] == last[0, 1, 0, 0] == 2000


PIXELS = {
    "qwen2_vl": ("1528ea044f24cb32", "1b5fec6f883f827d"),
    "qwen2_5_vl": ("1528ea044f24cb32", "1b5fec6f883f827d"),  # Qwen2-VL's processor
    "qwen3_vl": ("ac66107a3799e45c", "11e31cbd7851379a"),  # Qwen2-VL's, by its image one's
    "qwen3_vl+video_config": ("2f239c287e4be0a5", "8910693eca6c844b"),
    "qwen3_vl_moe": ("ac66107a3799e45c", "11e31cbd7851379a"),
    "qwen3_5": ("ac66107a3799e45c", "11e31cbd7851379a"),
    "qwen3_5_moe": ("ac66107a3799e45c", "11e31cbd7851379a"),
}
"""The digest of each tiny model's ``pixel_values_videos`` for :data:`SYNTHETIC`, as the
model's transformers video processor gave it (the torchvision session holds them to it)."""


def test_pixels_are_the_processors_recorded_ones(tiny: Tiny) -> None:
    assert digest(tiny.video.prepare(SYNTHETIC).pixels) == recorded(PIXELS[tiny.name])


# --- against transformers' own video processors (needs torchvision) -----------------------


def sglang_frames(decoded: DecodedVideo) -> torch.Tensor:
    """The frames SGLang's encoder hands the model's video processor: its own resize, by
    torchvision itself."""
    import torchvision.transforms.functional as tvf
    from torchvision.transforms import InterpolationMode

    video = torch.from_numpy(decoded.frames).permute(0, 3, 1, 2)
    size = sglang_frame_size(video.shape[2], video.shape[3], video.shape[0], VideoPixels())
    return tvf.resize(video, list(size), interpolation=InterpolationMode.BILINEAR)


def metadata(decoded: DecodedVideo) -> dict[str, Any]:
    return {
        "fps": decoded.fps,
        "duration": decoded.duration,
        "total_num_frames": decoded.total_frames,
        "frames_indices": np.array(decoded.indices),
        "video_backend": "torchvision",
    }


@pytest.mark.video_processor
@pytest.mark.parametrize("shape", CLIPS, ids=lambda s: "x".join(map(str, s)))
def test_pixels_and_grid_are_the_video_processors(tiny: Tiny, shape: tuple[int, ...]) -> None:
    import torchvision  # the point of this test: it fails, not skips, without torchvision

    assert torchvision.__version__
    decoded = decode_video(clip(*shape))
    processor = T.AutoVideoProcessor.from_pretrained(str(tiny.path), local_files_only=True)
    out = processor(
        videos=[sglang_frames(decoded)], do_sample_frames=False, video_metadata=[metadata(decoded)]
    )
    prepared = tiny.video.prepare(decoded)
    assert tuple(out["video_grid_thw"][0].tolist()) == prepared.grid
    assert out["pixel_values_videos"].dtype == prepared.pixels.dtype == torch.float32
    assert torch.equal(out["pixel_values_videos"], prepared.pixels)


def assert_same_settings(ours: Any, processor: Any) -> None:
    """Our reading of a video processor's configuration equals the processor's own."""
    assert (ours.min_pixels, ours.max_pixels) == (
        processor.size.shortest_edge,
        processor.size.longest_edge,
    )
    assert ours.image_mean == tuple(processor.image_mean)
    assert ours.image_std == tuple(processor.image_std)
    assert (ours.patch_size, ours.temporal_patch_size, ours.merge_size) == (
        processor.patch_size,
        processor.temporal_patch_size,
        processor.merge_size,
    )
    assert ours.rescale_factor == processor.rescale_factor
    assert int(ours.resample) == int(processor.resample)


@pytest.mark.video_processor
def test_settings_are_the_video_processors(tiny: Tiny) -> None:
    processor = T.AutoVideoProcessor.from_pretrained(str(tiny.path), local_files_only=True)
    assert isinstance(tiny.video.family, QwenVideo)
    ours = tiny.video.family.settings
    assert_same_settings(ours, processor)


@pytest.mark.video_processor
def test_tokens_are_the_prompts_video_placeholders(tiny: Tiny) -> None:
    from support.vlms import QWEN_TOKENS, tiny_tokenizer

    decoded = decode_video(clip(31, 10, 100, 70))
    video_processor = T.AutoVideoProcessor.from_pretrained(str(tiny.path), local_files_only=True)
    image_processor = T.AutoImageProcessor.from_pretrained(str(tiny.path), local_files_only=True)
    tokenizer = tiny_tokenizer(QWEN_TOKENS)
    processor_class = {
        "qwen2_vl": T.Qwen2VLProcessor,
        "qwen2_5_vl": T.Qwen2_5_VLProcessor,
        "qwen3_vl": T.Qwen3VLProcessor,
        "qwen3_vl_moe": T.Qwen3VLProcessor,
        "qwen3_5": T.Qwen3VLProcessor,
        "qwen3_5_moe": T.Qwen3VLProcessor,
    }[tiny.family]
    processor = processor_class(image_processor, tokenizer, video_processor)
    out = processor(
        text="describe <|video_pad|> this",
        videos=[sglang_frames(decoded)],
        do_sample_frames=False,
        video_metadata=[metadata(decoded)],
    )
    video_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    placeholders = sum(int(token == video_id) for token in out["input_ids"][0])
    assert placeholders == tiny.video.prepare(decoded).tokens


@pytest.mark.video_processor
@pytest.mark.parametrize("step", RESIZES)
def test_the_recorded_resizes_are_torchvisions(step: str) -> None:
    import torchvision.transforms.functional as tvf
    import torchvision.transforms.v2.functional as tv2
    from torchvision.transforms import InterpolationMode

    if step == "sglang":
        expected = tvf.resize(pattern(2, 13, 17), [28, 56], InterpolationMode.BILINEAR)
    elif step == "sglang_down":
        expected = tvf.resize(pattern(2, 100, 150), [56, 84], InterpolationMode.BILINEAR)
    else:
        mode = InterpolationMode.BICUBIC if step == "bicubic" else InterpolationMode.BILINEAR
        frames = pattern(2, 28, 56).unsqueeze(0)
        expected = tv2.resize(frames, [32, 64], interpolation=mode, antialias=True)[0]
    assert torch.equal(resized(step), expected)
    assert digest(expected) == recorded(RESIZES[step])


@pytest.mark.video_processor
def test_the_recorded_pixels_are_the_processors(tiny: Tiny) -> None:
    processor = T.AutoVideoProcessor.from_pretrained(str(tiny.path), local_files_only=True)
    out = processor(
        videos=[sglang_frames(SYNTHETIC)],
        do_sample_frames=False,
        video_metadata=[metadata(SYNTHETIC)],
    )
    assert digest(out["pixel_values_videos"]) == recorded(PIXELS[tiny.name])


@pytest.mark.video_processor
@pytest.mark.parametrize("name", PROCESSOR_DEFAULTS)
def test_the_class_defaults_are_transformers(name: str) -> None:
    processor = getattr(T, name)()
    ours = processor_settings(name, {})
    assert_same_settings(ours, processor)
    assert (ours.do_resize, ours.do_rescale, ours.do_normalize) == (
        processor.do_resize,
        processor.do_rescale,
        processor.do_normalize,
    )


def test_sglangs_resize_of_a_long_video_is_each_frames_own() -> None:
    """The frames are resized a few at a time (memory); every frame comes out as it would
    alone, the last ones of an uneven count too."""
    frames = torch.from_numpy(
        np.random.default_rng(7).integers(0, 256, (19, 3, 40, 56), dtype=np.uint8)
    )
    together = sglang_resize(frames, (30, 44))
    assert together.shape == (19, 3, 30, 44)
    for index in range(19):
        assert torch.equal(together[index], sglang_resize(frames[index : index + 1], (30, 44))[0])
