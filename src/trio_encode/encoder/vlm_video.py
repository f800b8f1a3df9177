"""A video through a VLM's own video path: from decoded frames to the rows, the grid and the
metadata its prefill reads. Each family's path is one strategy (:class:`QwenVideo`,
:class:`OnevisionVideo`, :class:`InternvlVideo`) behind :class:`VideoPath`.

**Qwen-VL.** SGLang's encode server gives a Qwen-VL video two resizes before the model sees
it. Its own (``preprocess_video``) bounds each frame's pixels by :class:`VideoPixels` and
resizes the frames, as uint8, with torchvision's bilinear, antialiased tensor resize (computed
in float32, rounded back to uint8). Then the model's transformers video processor resizes them
again by its own rule (Qwen2-VL's per-frame ``smart_resize``, or Qwen3-VL's, which counts the
frames too), with torchvision's bicubic antialiased resize, which on a CPU tensor runs on the
uint8 frames directly; then rescales and normalises them in one step and cuts them into
patches of ``temporal_patch_size`` frames. Both run on the CPU there (SGLang's encoder decodes
videos on the CPU). The rows come from the model's own ``get_video_features``, laid out as for
images (Qwen3-VL's deepstack layers beside the merger's output per token). What SGLang's
prefill reads beside them is computed as its encoder computes it: ``second_per_grid_ts`` for
Qwen2.5-VL and ``video_timestamps`` for Qwen3-VL and the families after it.

**Qwen2.5-Omni** (its thinker) is a Qwen-VL family here: SGLang's encoder treats its videos as
Qwen2.5-VL's (the same resize, then the video processor transformers gives the checkpoint,
Qwen2-VL's, configured by the ``preprocessor_config.json`` its image processor and audio
feature extractor share, and ``second_per_grid_ts``); the rows are the thinker's
``get_video_features``, its merge size the thinker's ``vision_config``'s.

**LLaVA-OneVision and InternVL.** SGLang 0.5.23's encode server has no video path for them
(it refuses both architectures for encoder disaggregation, and its encoder's video loading
serves only the Qwen-VL and GLM families); its colocated server hands the whole video to the
model's transformers processor. Here the frames are the ones the server's sampling settings
choose (the same rule and defaults as for Qwen-VL; a fixed, even count of frames spread
evenly, these models' own usage, is ``min_frames = max_frames``), with no resize before the
model's own video processor, which resizes every frame to the tower's square (bicubic,
antialiased, as checkpoints configure it), rescales and normalises
(:class:`SquareFramesVideo`). LLaVA-OneVision's rows are its ``get_video_features``: each
frame's tokens pooled 2 x 2 (bilinear), frame after frame, then the model's newline row once
per video, as its forward scatters them into the prompt's video tokens. InternVL's are its
``get_image_features`` on the frames as tiles, frame after frame, as its processor hands a
video to the model (its prompt holds one image's context tokens per frame). One forward a
video; no grid and no metadata.

transformers' video processors import torchvision, whose index wheels do not load with the
CPU build of torch, so each step is done here with the torch calls torchvision makes
(``torch.nn.functional.interpolate``), in the same order and dtypes: the tests hold the result
equal, to the bit, to the processor's own output where torchvision is installed.

Use: :meth:`VideoPath.for_model` once per model (None for a model without this path);
:meth:`VideoPath.prepare` in a decode thread (CPU work, no model); :meth:`VideoPath.features`
in the model's thread (Qwen-VL: one forward for any number of videos).
"""

from __future__ import annotations

import logging
import math
import platform
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from trio_encode.encoder.backend import Prepared
from trio_encode.encoder.video import (
    FRAME_FACTOR,
    DecodedVideo,
    FrameSampling,
    second_per_grid_ts,
    video_timestamps,
)
from trio_encode.encoder.vlm import VLMVisionModel
from trio_encode.errors import InvalidInput

log = logging.getLogger(__name__)

MAX_RATIO = 200
"""The longest side over the shortest beyond which both resize rules refuse a frame."""


@dataclass(frozen=True)
class VideoPixels:
    """SGLang's bounds on a Qwen-VL video frame's pixels before the model's processor sees it
    (its encoder's ``vision_config.video`` keys of the same names), and its defaults."""

    min_pixels: int = 128 * 28 * 28
    """Frames smaller than this are enlarged to about this many pixels."""
    max_pixels: int = 768 * 28 * 28
    """Frames larger than this are shrunk to about this many pixels..."""
    total_pixels: int = int(128000 * 28 * 28 * 0.9)
    """...or to an even share of this over the video's frames, taken in pairs, if smaller
    (never below 1.05 x ``min_pixels``)."""
    factor: int = 28
    """Both sides are made multiples of this, whatever the model's patch (SGLang calls its
    resize with its default for every Qwen-VL family)."""


@dataclass(frozen=True)
class ProcessorSettings:
    """What a model's transformers video processor does to frames, read from its saved
    configuration over its class's defaults (:data:`PROCESSOR_DEFAULTS`)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_resize: bool
    do_rescale: bool
    do_normalize: bool
    resample: int
    """PIL's number for the filter: 2 bilinear, 3 bicubic (the only two supported here)."""
    counts_frames: bool
    """Qwen3-VL's rule: the pixel bounds are over all the frames (``t x h x w``), not one."""


_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)
_QWEN2_PROCESSOR: dict[str, Any] = {
    "min_pixels": 128 * 28 * 28,
    "max_pixels": 768 * 28 * 28,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": _CLIP_MEAN,
    "image_std": _CLIP_STD,
    "rescale_factor": 1 / 255,
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "resample": 3,
    "counts_frames": False,
}
_QWEN3_PROCESSOR: dict[str, Any] = {
    **_QWEN2_PROCESSOR,
    "min_pixels": 128 * 32 * 32,
    "max_pixels": 32 * 32 * 768,
    "patch_size": 16,
    "image_mean": _HALF,
    "image_std": _HALF,
    "counts_frames": True,
}
PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen2VLVideoProcessor": _QWEN2_PROCESSOR,
    "Qwen3VLVideoProcessor": _QWEN3_PROCESSOR,
}
"""The Qwen-VL video processors reproduced here, by class name, with their defaults."""
ONEVISION_PROCESSOR = "LlavaOnevisionVideoProcessor"
INTERNVL_PROCESSOR = "InternVLVideoProcessor"
FAMILY_PROCESSORS: dict[str, str] = {
    "qwen2_vl": "Qwen2VLVideoProcessor",
    "qwen2_5_vl": "Qwen2VLVideoProcessor",
    "qwen2_5_omni": "Qwen2VLVideoProcessor",
    "qwen3_vl": "Qwen3VLVideoProcessor",
    "qwen3_vl_moe": "Qwen3VLVideoProcessor",
    "qwen3_5": "Qwen3VLVideoProcessor",
    "qwen3_5_moe": "Qwen3VLVideoProcessor",
    "llava_onevision": ONEVISION_PROCESSOR,
    "internvl": INTERNVL_PROCESSOR,
}
"""The families with a video path here, by the checkpoint's ``model_type``, with the video
processor transformers gives each when its saved configuration names none."""


@dataclass(frozen=True)
class FixedSizeSettings:
    """What LLaVA-OneVision's and InternVL's transformers video processors do to frames: their
    classes' defaults (the same for both), overridden by the saved configuration
    (:func:`fixed_size_settings`)."""

    height: int = 384
    width: int = 384
    """Every frame is resized to ``height x width``, whatever its aspect."""
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3
    """PIL's number for the filter: 2 bilinear, 3 bicubic (the only two supported here)."""


_SECONDS_PER_GRID = frozenset({"qwen2_5_vl", "qwen2_5_omni"})
"""Families whose prefill reads ``second_per_grid_ts``."""
_TIMESTAMPS = frozenset({"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})
"""Families whose prefill reads ``video_timestamps``."""


def processor_class(model_type: str, saved: Mapping[str, Any]) -> str | None:
    """The video processor class transformers' ``AutoVideoProcessor`` picks for a model of
    ``model_type`` with the saved configuration ``saved``: the one it names, else the image
    processor's namesake, else the family's; None for remote code, a class not reproduced
    here for this family's path or one configured to cap each frame's pixels by the video's
    length."""
    if "auto_map" in saved or saved.get("cap_pixels_per_frame"):
        return None  # remote code; or a per-frame cap (transformers' next default) not done here
    named = saved.get("video_processor_type")
    if named is None:
        image = str(saved.get("image_processor_type") or "")
        inferred = image.replace("ImageProcessor", "VideoProcessor")
        if image and _transformers_has(inferred):
            named = inferred
    family = FAMILY_PROCESSORS.get(model_type)
    named = named or family
    if family is None or named not in VIDEO_PROCESSORS:
        return None
    return named if VIDEO_PROCESSORS[named] is VIDEO_PROCESSORS[family] else None


def _transformers_has(name: str) -> bool:
    """Whether transformers has a video processor class of this name."""
    import transformers
    from transformers.models.auto import video_processing_auto

    # model_type -> {backend: class name}, with the names transformers adds beyond its own
    mapping: Mapping[str, Mapping[str, str | None] | None]
    mapping = vars(video_processing_auto)["VIDEO_PROCESSOR_MAPPING_NAMES"]
    named = any(name in backends.values() for backends in mapping.values() if backends)
    return named or hasattr(transformers, name)


def processor_settings(class_name: str, saved: Mapping[str, Any]) -> ProcessorSettings:
    """The video processor ``class_name`` as the saved configuration ``saved`` makes it:
    keys of the configuration override the class's defaults; Qwen2-VL's processor also takes
    ``min_pixels`` / ``max_pixels`` over ``size``, Qwen3-VL's only ``size``."""
    values = dict(PROCESSOR_DEFAULTS[class_name])
    for key in values.keys() - {"min_pixels", "max_pixels", "counts_frames"}:
        if saved.get(key) is not None:
            values[key] = saved[key]
    size = saved.get("size") or {}
    if size.get("shortest_edge"):
        values["min_pixels"] = size["shortest_edge"]
    if size.get("longest_edge"):
        values["max_pixels"] = size["longest_edge"]
    if not values["counts_frames"]:
        for key in ("min_pixels", "max_pixels"):
            if saved.get(key) is not None:
                values[key] = saved[key]
    values["image_mean"] = tuple(float(v) for v in values["image_mean"])
    values["image_std"] = tuple(float(v) for v in values["image_std"])
    if int(values["resample"]) not in (2, 3):
        raise ValueError(
            f"the video processor's resample filter {values['resample']} is not supported "
            "(bilinear, 2, or bicubic, 3)"
        )
    return ProcessorSettings(**values)


def fixed_size_settings(saved: Mapping[str, Any]) -> FixedSizeSettings:
    """LLaVA-OneVision's or InternVL's video processor as the saved configuration ``saved``
    makes it (keys of the configuration over the class's defaults). Raises
    :class:`ValueError` naming what is not reproduced here: a size other than ``height`` and
    ``width``, a centre crop or a filter other than bilinear or bicubic."""
    size = {key: value for key, value in (saved.get("size") or {}).items() if value}
    if size and set(size) != {"height", "width"}:
        raise ValueError(f"a size of {size} (only height and width are reproduced)")
    if saved.get("do_center_crop"):
        raise ValueError("a centre crop")
    values: dict[str, Any] = {key: int(value) for key, value in size.items()}
    for key in ("rescale_factor", "do_resize", "do_rescale", "do_normalize", "resample"):
        if saved.get(key) is not None:
            values[key] = saved[key]
    for key in ("image_mean", "image_std"):
        if saved.get(key) is not None:
            values[key] = tuple(float(v) for v in saved[key])
    settings = replace(FixedSizeSettings(), **values)
    if int(settings.resample) not in (2, 3):
        raise ValueError(f"the resample filter {settings.resample} (bilinear, 2, or bicubic, 3)")
    return settings


def sglang_frame_size(height: int, width: int, frames: int, pixels: VideoPixels) -> tuple[int, int]:
    """The size SGLang's encoder resizes ``frames`` frames of ``height`` x ``width`` to
    before the model's processor: the per-frame bound of :class:`VideoPixels`, then Qwen-VL's
    ``smart_resize`` by ``pixels.factor``, as SGLang writes it."""
    most = max(
        min(pixels.max_pixels, pixels.total_pixels / frames * FRAME_FACTOR),
        int(pixels.min_pixels * 1.05),
    )
    factor = pixels.factor
    _check_ratio(height, width)
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > most:
        beta = math.sqrt(height * width / most)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < pixels.min_pixels:
        beta = math.sqrt(pixels.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar <= 0 or w_bar <= 0:
        raise InvalidInput(f"a video of {width}x{height} pixels cannot be resized for the model")
    return h_bar, w_bar


def processor_frame_size(
    height: int, width: int, frames: int, settings: ProcessorSettings
) -> tuple[int, int]:
    """The size the model's video processor resizes the frames to: Qwen2-VL's per-frame
    ``smart_resize``, or Qwen3-VL's over all the frames (:attr:`ProcessorSettings.counts_frames`),
    by ``patch_size x merge_size``."""
    factor = settings.patch_size * settings.merge_size
    least, most = settings.min_pixels, settings.max_pixels
    if settings.counts_frames:
        temporal = settings.temporal_patch_size
        if frames < temporal:
            raise InvalidInput(f"a video needs at least {temporal} frames; it has {frames}")
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        count, t_bar = frames, round(frames / temporal) * temporal
    else:
        count, t_bar = 1, 1
    _check_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if t_bar * h_bar * w_bar > most:
        beta = math.sqrt(count * height * width / most)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < least:
        beta = math.sqrt(least / (count * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _check_ratio(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise InvalidInput(
            f"a video of {width}x{height} pixels is too narrow: the longest side may be at "
            f"most {MAX_RATIO} times the shortest"
        )


RESIZE_FRAMES = 8
"""Frames resized in float32 at once by :func:`sglang_resize`."""


def sglang_resize(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``(T, C, H, W)`` uint8 frames resized as SGLang's encoder does
    (torchvision's ``transforms.functional.resize``, bilinear, antialiased, on a uint8
    tensor): computed in float32, rounded half to even, back to uint8; unchanged at the same
    size."""
    if tuple(frames.shape[-2:]) == size:
        return frames
    # A few frames at a time: each frame is resized alone whatever its batch, and the float32
    # copies of a whole video would be eight times its uint8 frames.
    out = torch.empty((*frames.shape[:-2], *size), dtype=torch.uint8)
    for start in range(0, frames.shape[0], RESIZE_FRAMES):
        chunk = F.interpolate(
            frames[start : start + RESIZE_FRAMES].to(torch.float32),
            size=list(size),
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )
        out[start : start + RESIZE_FRAMES] = torch.round(chunk).to(torch.uint8)
    return out


def processor_resize(frames: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """``(..., C, H, W)`` uint8 frames on the CPU resized as transformers' video processors do
    (torchvision's ``transforms.v2.functional.resize``, antialiased): bicubic always, and
    bilinear where the CPU has AVX2 or is an ARM one, on the uint8 frames themselves (torch's
    own uint8 kernels); bilinear elsewhere in float32, rounded back to uint8. Unchanged at the
    same size."""
    height, width = frames.shape[-2:]
    if (height, width) == size:
        return frames
    shape = frames.shape
    flat = frames.reshape(-1, *shape[-3:])
    if flat.shape[0] == 1 and flat.is_contiguous(memory_format=torch.channels_last):
        strides = list(flat.stride())
        strides[0] = flat.numel()
        flat = flat.as_strided(tuple(flat.shape), strides)
    mode = "bicubic" if resample == 3 else "bilinear"
    if mode == "bicubic" or native_uint8_bilinear():
        out = F.interpolate(flat, size=list(size), mode=mode, align_corners=False, antialias=True)
    else:
        out = F.interpolate(
            flat.to(torch.float32), size=list(size), mode=mode, align_corners=False, antialias=True
        )
        out = out.round_().to(torch.uint8)
    return out.reshape(*shape[:-2], *size)


def native_uint8_bilinear() -> bool:
    """Whether torchvision resizes uint8 images bilinearly without a float copy here."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in (
        "aarch64",
        "arm64",
    )


def normalize(
    frames: torch.Tensor, settings: ProcessorSettings | FixedSizeSettings
) -> torch.Tensor:
    """Rescale and normalise as transformers' processors do: both in one step (the mean and
    standard deviation scaled by ``1 / rescale_factor`` in float32, then
    ``(x - mean) / std``), or whichever of the two is on."""
    if settings.do_rescale and settings.do_normalize:
        mean = torch.tensor(settings.image_mean) * (1.0 / settings.rescale_factor)
        std = torch.tensor(settings.image_std) * (1.0 / settings.rescale_factor)
    elif settings.do_normalize:
        mean = torch.tensor(settings.image_mean)
        std = torch.tensor(settings.image_std)
    elif settings.do_rescale:
        return frames * settings.rescale_factor
    else:
        return frames
    out = frames.to(torch.float32)
    if out is frames:
        out = out.clone()
    return out.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


def patchify(frames: torch.Tensor, settings: ProcessorSettings) -> tuple[torch.Tensor, Grid3]:
    """``(T, C, H, W)`` frames as Qwen-VL's ``pixel_values_videos``: the last frame repeated
    to a multiple of ``temporal_patch_size``, then ``(t*h*w, C*tp*p*p)`` patches in the
    merger's order, and the grid ``(t, h, w)``."""
    temporal, patch, merge = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    count, channels, height, width = frames.shape
    if pad := -count % temporal:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)))
        count += pad
    t, h, w = count // temporal, height // patch, width // patch
    patches = frames.reshape(
        t, temporal, channels, h // merge, merge, patch, w // merge, merge, patch
    ).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, channels * temporal * patch * patch), (t, h, w)


Grid3 = tuple[int, int, int]


@dataclass(frozen=True, eq=False)
class PreparedVideo(Prepared):
    """One video as the model takes it (``pixels``: its ``pixel_values_videos``, Qwen-VL's
    patches or the ``(T, C, S, S)`` frames of :class:`SquareFramesVideo`; ``grid``: Qwen-VL's
    ``video_grid_thw``, else None; ``tokens``: its rows) and the metadata SGLang's prefill
    reads."""

    second_per_grid_ts: float | None = None
    """Seconds per temporal patch (Qwen2.5-VL, Qwen2.5-Omni), else None."""
    video_timestamps: tuple[float, ...] | None = None
    """Seconds of each temporal patch (Qwen3-VL and after), else None."""

    @property
    def meta(self) -> tuple[tuple[str, float | list[float]], ...]:
        """What the model's family sends SGLang's prefill beside the rows, by name."""
        meta: list[tuple[str, float | list[float]]] = []
        if self.video_timestamps is not None:
            meta.append(("video_timestamps", list(self.video_timestamps)))
        if self.second_per_grid_ts is not None:
            meta.append(("second_per_grid_ts", self.second_per_grid_ts))
        return tuple(meta)


class FamilyVideo(Protocol):
    """What differs between the families' video paths (a :class:`VideoPath` holds one)."""

    @property
    def recipe(self) -> dict[str, Any]:
        """The settings beyond the model that :meth:`prepare` turns frames into the model's
        input by (part of a video's key)."""
        ...

    def prepare(self, decoded: DecodedVideo) -> PreparedVideo:
        """The decoded frames as the model takes them, with their token count and metadata.
        CPU work only; safe to run in several threads at once."""
        ...

    def features(self, vlm: VLMVisionModel, videos: Sequence[PreparedVideo]) -> list[torch.Tensor]:
        """``vlm``'s own features of ``videos`` (called in inference mode): each video's rows
        as the model's forward puts them in the prompt's video tokens."""
        ...


class QwenVideo:
    """A Qwen-VL model's video path: SGLang's frame resize and the model's own video
    processor (:meth:`prepare`), and its ``get_video_features`` (:meth:`features`)."""

    def __init__(
        self,
        model_type: str,
        settings: ProcessorSettings,
        sampling: FrameSampling,
        pixels: VideoPixels,
        merge: int,
    ) -> None:
        self.model_type = model_type
        self.settings = settings
        self.sampling = sampling
        """The server's frame sampling: Qwen2.5-VL's ``second_per_grid_ts`` follows its rate."""
        self.pixels = pixels
        self.merge = merge
        """The vision config's ``spatial_merge_size``: patches per token along each side."""

    @classmethod
    def load(
        cls,
        vlm: VLMVisionModel,
        name: str,
        saved: Mapping[str, Any],
        sampling: FrameSampling,
        pixels: VideoPixels,
    ) -> QwenVideo:
        """The path of ``vlm`` with the video processor ``name`` configured by ``saved``."""
        merge = int(vlm.config.vision_config.spatial_merge_size)
        settings = processor_settings(name, saved)
        return cls(vlm.model_type, settings, sampling, pixels, merge)

    @property
    def recipe(self) -> dict[str, Any]:
        return {"pixels": asdict(self.pixels), "processor": asdict(self.settings)}

    def prepare(self, decoded: DecodedVideo) -> PreparedVideo:
        frames = torch.from_numpy(np.ascontiguousarray(decoded.frames)).permute(0, 3, 1, 2)
        count, _, height, width = frames.shape
        frames = sglang_resize(frames, sglang_frame_size(height, width, count, self.pixels))
        settings = self.settings
        if settings.do_resize:
            height, width = frames.shape[-2:]
            size = processor_frame_size(height, width, count, settings)
            frames = processor_resize(frames.unsqueeze(0), size, settings.resample)[0]
        pixels, grid = patchify(normalize(frames.unsqueeze(0), settings)[0], settings)
        t, h, w = grid
        seconds: float | None = None
        stamps: tuple[float, ...] | None = None
        if self.model_type in _SECONDS_PER_GRID:
            seconds = second_per_grid_ts(self.sampling, settings.temporal_patch_size)
        if self.model_type in _TIMESTAMPS:
            stamps = tuple(video_timestamps(list(decoded.indices), decoded.fps, self.merge))
        return PreparedVideo(
            pixels.contiguous(),
            t * h * w // self.merge**2,
            grid,
            second_per_grid_ts=seconds,
            video_timestamps=stamps,
        )

    def features(self, vlm: VLMVisionModel, videos: Sequence[PreparedVideo]) -> list[torch.Tensor]:
        """Every video's patches packed in one sequence with their grids; each video's rows
        laid out as its images' (Qwen3-VL: the merger's output, then each deepstack layer's,
        side by side)."""
        device = vlm.device
        pixels = torch.cat([video.pixels for video in videos]).to(device)
        grids = torch.tensor([video.grid for video in videos], dtype=torch.long, device=device)
        out = vlm.model.get_video_features(pixel_values_videos=pixels, video_grid_thw=grids)
        rows: list[torch.Tensor] = list(out.pooler_output)
        if vlm.family.deepstack:
            layers = [list(layer) for layer in out.deepstack_features]
            rows = [
                torch.cat([main, *(layer[index] for layer in layers)], dim=-1)
                for index, main in enumerate(rows)
            ]
        return rows


class SquareFramesVideo:
    """A video path whose video processor resizes every frame to the tower's square (one
    tile a frame), then rescales and normalises (:class:`FixedSizeSettings`): the frames as
    the model's ``pixel_values_videos``, ``(T, C, S, S)``, and ``frame_tokens`` rows a frame,
    plus :attr:`trailing_rows` a video."""

    trailing_rows = 0
    """Rows the model appends once per video, after its frames'."""

    def __init__(self, settings: FixedSizeSettings, frame_tokens: int) -> None:
        self.settings = settings
        self.frame_tokens = frame_tokens
        """Rows of one frame."""

    @staticmethod
    def read_settings(
        vlm: VLMVisionModel, name: str, saved: Mapping[str, Any]
    ) -> FixedSizeSettings | None:
        """The video processor ``name`` as ``saved`` configures it; None (with a warning)
        for a configuration not reproduced here or frames of another size than the tower
        takes (the model would refuse them)."""
        side = _first(vlm.config.vision_config.image_size)
        try:
            settings = fixed_size_settings(saved)
        except ValueError as exc:
            log.warning("the video processor (%s) has %s, not reproduced here; no video", name, exc)
            return None
        if not settings.do_resize or (settings.height, settings.width) != (side, side):
            log.warning(
                "%s gives frames of %sx%s pixels (resize %s); the model's tower takes %dx%d; "
                "no video",
                name,
                settings.width,
                settings.height,
                "on" if settings.do_resize else "off",
                side,
                side,
            )
            return None
        return settings

    @property
    def recipe(self) -> dict[str, Any]:
        return {"processor": asdict(self.settings)}

    def prepare(self, decoded: DecodedVideo) -> PreparedVideo:
        frames = torch.from_numpy(np.ascontiguousarray(decoded.frames)).permute(0, 3, 1, 2)
        settings = self.settings
        size = (settings.height, settings.width)
        frames = processor_resize(frames.unsqueeze(0), size, settings.resample)[0]
        pixels = normalize(frames.unsqueeze(0), settings)[0]
        tokens = len(frames) * self.frame_tokens + self.trailing_rows
        return PreparedVideo(pixels.contiguous(), tokens)


class OnevisionVideo(SquareFramesVideo):
    """A LLaVA-OneVision model's video path: its own video processor on the chosen frames
    (:meth:`prepare`), and its ``get_video_features`` (:meth:`features`): each frame's tokens
    pooled 2 x 2, then the model's newline row."""

    trailing_rows = 1

    @classmethod
    def load(
        cls,
        vlm: VLMVisionModel,
        name: str,
        saved: Mapping[str, Any],
        sampling: FrameSampling,
        pixels: VideoPixels,
    ) -> OnevisionVideo | None:
        """The path of ``vlm`` with its video processor configured by ``saved``; None where
        :meth:`read_settings` refuses it. A frame's rows: the tower's patches a side, halved
        (rounded up) by the model's 2 x 2 pooling, squared."""
        settings = cls.read_settings(vlm, name, saved)
        if settings is None:
            return None
        vision = vlm.config.vision_config
        patches = int(vision.image_size) // int(vision.patch_size)
        return cls(settings, math.ceil(patches / 2) ** 2)

    def features(self, vlm: VLMVisionModel, videos: Sequence[PreparedVideo]) -> list[torch.Tensor]:
        """One forward a video, its frames the tower's batch: a video's rows are then the
        model's for that video alone, whatever it is batched with (the tower's kernels round
        differently with the number of frames they are given, so frames of several videos in
        one forward would not be)."""
        return [
            vlm.model.get_video_features(
                pixel_values_videos=video.pixels.unsqueeze(0).to(vlm.device)
            ).pooler_output[0]
            for video in videos
        ]


class InternvlVideo(SquareFramesVideo):
    """An InternVL model's video path: its own video processor on the chosen frames
    (:meth:`prepare`), each frame one tile of ``get_image_features`` (:meth:`features`), as
    its processor hands a video's frames to the model (and puts one image's context tokens
    in the prompt for each frame)."""

    @classmethod
    def load(
        cls,
        vlm: VLMVisionModel,
        name: str,
        saved: Mapping[str, Any],
        sampling: FrameSampling,
        pixels: VideoPixels,
    ) -> InternvlVideo | None:
        """The path of ``vlm`` with its video processor configured by ``saved``; None where
        :meth:`read_settings` refuses it. A frame's rows: one tile's (the image path's)."""
        settings = cls.read_settings(vlm, name, saved)
        per_tile = vlm.family.tokens_per_tile
        assert per_tile is not None  # InternVL's family counts a tile's tokens
        return None if settings is None else cls(settings, per_tile(vlm.config))

    def features(self, vlm: VLMVisionModel, videos: Sequence[PreparedVideo]) -> list[torch.Tensor]:
        """One forward a video, its frames the tower's batch (see
        :meth:`OnevisionVideo.features`): its frames' rows, frame after frame."""
        rows = []
        for video in videos:
            out = vlm.model.get_image_features(pixel_values=video.pixels.to(vlm.device))
            rows.append(out.pooler_output.reshape(-1, out.pooler_output.shape[-1]))
        return rows


def _first(value: Any) -> int:
    """A size given as one number or as ``[height, width]`` (InternVL's), as one number."""
    return int(value[0] if isinstance(value, (list, tuple)) else value)


VIDEO_PROCESSORS: dict[str, type[QwenVideo] | type[OnevisionVideo] | type[InternvlVideo]] = {
    "Qwen2VLVideoProcessor": QwenVideo,
    "Qwen3VLVideoProcessor": QwenVideo,
    ONEVISION_PROCESSOR: OnevisionVideo,
    INTERNVL_PROCESSOR: InternvlVideo,
}
"""The transformers video processors reproduced here, by class name, with the path each
belongs to: a family takes the classes of its own processor's path."""


class VideoPath:
    """A VLM's video path: its family's (:class:`FamilyVideo`) and the server's frame
    sampling, which chooses the frames :meth:`prepare` is given."""

    def __init__(self, vlm: VLMVisionModel, family: FamilyVideo, sampling: FrameSampling) -> None:
        self.vlm = vlm
        self.model_type = vlm.model_type
        self.family = family
        self.sampling = sampling

    @classmethod
    def for_model(
        cls,
        vlm: VLMVisionModel,
        model_dir: Path,
        sampling: FrameSampling | None = None,
        pixels: VideoPixels | None = None,
    ) -> VideoPath | None:
        """The video path of the model loaded from ``model_dir``, or None for a family
        without one here. Its video processor's configuration is read as transformers reads
        it (``processor_config.json``'s ``video_processor``, else
        ``video_preprocessor_config.json``, else the image processor's), without loading the
        processor class (which needs torchvision)."""
        model_type = vlm.model_type
        if model_type not in FAMILY_PROCESSORS:
            return None
        from transformers.video_processing_utils import VideoProcessorMixin

        saved, _ = VideoProcessorMixin.get_video_processor_dict(
            str(model_dir), local_files_only=True
        )
        name = processor_class(model_type, saved)
        if name is None:
            log.warning(
                "%s: its video processor (%s) is not one this server reproduces; no video",
                model_dir,
                saved.get("video_processor_type") or saved.get("auto_map"),
            )
            return None
        sampling = sampling or FrameSampling()
        family = VIDEO_PROCESSORS[name].load(vlm, name, saved, sampling, pixels or VideoPixels())
        return None if family is None else cls(vlm, family, sampling)

    @property
    def recipe(self) -> dict[str, Any]:
        """Everything beyond the model that turns a video's bytes into the model's input:
        the frame sampling and the family's settings (:attr:`FamilyVideo.recipe`). The same
        bytes with another recipe are other rows."""
        return {"sampling": asdict(self.sampling), **self.family.recipe}

    def prepare(self, decoded: DecodedVideo) -> PreparedVideo:
        """The frames the server's sampling chose, as the model takes them, with their token
        count and metadata. CPU work only; safe to run in several threads at once."""
        return self.family.prepare(decoded)

    def features(self, videos: Sequence[PreparedVideo]) -> list[torch.Tensor]:
        """The model's own features of ``videos`` (its family's forwards): one
        ``(tokens, hidden)`` tensor each, in the model's dtype."""
        vlm = self.vlm
        with torch.inference_mode():
            rows = self.family.features(vlm, videos)
            return [row.to(vlm.dtype).contiguous() for row in rows]
