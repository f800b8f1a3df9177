"""A video through a Qwen-VL model's own video path: from decoded frames to the rows, the grid
and the metadata SGLang's prefill reads.

SGLang's encode server gives a Qwen-VL video two resizes before the model sees it. Its own
(``preprocess_video``) bounds each frame's pixels by :class:`VideoPixels` and resizes the
frames, as uint8, with torchvision's bilinear, antialiased tensor resize (computed in float32,
rounded back to uint8). Then the model's transformers video processor resizes them again by its
own rule (Qwen2-VL's per-frame ``smart_resize``, or Qwen3-VL's, which counts the frames too),
with torchvision's bicubic antialiased resize, which on a CPU tensor runs on the uint8 frames
directly; then rescales and normalises them in one step and cuts them into patches of
``temporal_patch_size`` frames. Both run on the CPU there (SGLang's encoder decodes videos on
the CPU). transformers' video processors import torchvision, whose index wheels do not load
with the CPU build of torch, so each step is done here with the torch calls torchvision makes
(``torch.nn.functional.interpolate``), in the same order and dtypes: the tests hold the result
equal, to the bit, to the processor's own output where torchvision is installed.

The rows come from the model's own ``get_video_features``, laid out as for images (Qwen3-VL's
deepstack layers beside the merger's output per token). What SGLang's prefill reads beside
them is computed as its encoder computes it: ``second_per_grid_ts`` for Qwen2.5-VL and
``video_timestamps`` for Qwen3-VL and the families after it.

Use: :meth:`VideoPath.for_model` once per model (None for a model without this path);
:meth:`VideoPath.prepare` in a decode thread (CPU work, no model); :meth:`VideoPath.features`
in the model's thread (one forward for any number of videos).
"""

from __future__ import annotations

import logging
import math
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
"""The transformers video processors reproduced here, by class name, with their defaults."""
FAMILY_PROCESSORS: dict[str, str] = {
    "qwen2_vl": "Qwen2VLVideoProcessor",
    "qwen2_5_vl": "Qwen2VLVideoProcessor",
    "qwen3_vl": "Qwen3VLVideoProcessor",
    "qwen3_vl_moe": "Qwen3VLVideoProcessor",
    "qwen3_5": "Qwen3VLVideoProcessor",
    "qwen3_5_moe": "Qwen3VLVideoProcessor",
}
"""The families with a video path here, by ``model_type``, with the video processor
transformers gives each when its saved configuration names none."""

_SECONDS_PER_GRID = frozenset({"qwen2_5_vl"})
"""Families whose prefill reads ``second_per_grid_ts``."""
_TIMESTAMPS = frozenset({"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})
"""Families whose prefill reads ``video_timestamps``."""


def processor_class(model_type: str, saved: Mapping[str, Any]) -> str | None:
    """The video processor class transformers' ``AutoVideoProcessor`` picks for a model of
    ``model_type`` with the saved configuration ``saved``: the one it names, else the image
    processor's namesake, else the family's; None for remote code, a class not reproduced
    here or one configured to cap each frame's pixels by the video's length."""
    if "auto_map" in saved or saved.get("cap_pixels_per_frame"):
        return None  # remote code; or a per-frame cap (transformers' next default) not done here
    named = saved.get("video_processor_type")
    if named is None:
        image = str(saved.get("image_processor_type") or "")
        inferred = image.replace("ImageProcessor", "VideoProcessor")
        if image and _transformers_has(inferred):
            named = inferred
    named = named or FAMILY_PROCESSORS.get(model_type)
    return named if named in PROCESSOR_DEFAULTS else None


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


def sglang_resize(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``(T, C, H, W)`` uint8 frames resized as SGLang's encoder does
    (torchvision's ``transforms.functional.resize``, bilinear, antialiased, on a uint8
    tensor): computed in float32, rounded half to even, back to uint8; unchanged at the same
    size."""
    if tuple(frames.shape[-2:]) == size:
        return frames
    out = F.interpolate(
        frames.to(torch.float32),
        size=list(size),
        mode="bilinear",
        align_corners=False,
        antialias=True,
    )
    return torch.round(out).to(torch.uint8)


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


def normalize(frames: torch.Tensor, settings: ProcessorSettings) -> torch.Tensor:
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
    """One video as the model takes it (``pixels``: its ``pixel_values_videos``; ``grid``: its
    ``video_grid_thw``; ``tokens``: its rows) and the metadata SGLang's prefill reads."""

    second_per_grid_ts: float | None = None
    """Seconds per temporal patch (Qwen2.5-VL), else None."""
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


class VideoPath:
    """A Qwen-VL model's video path: SGLang's frame resize and the model's own video
    processor (:meth:`prepare`), and its ``get_video_features`` (:meth:`features`)."""

    def __init__(
        self,
        vlm: VLMVisionModel,
        model_type: str,
        settings: ProcessorSettings,
        sampling: FrameSampling,
        pixels: VideoPixels,
    ) -> None:
        self.vlm = vlm
        self.model_type = model_type
        self.settings = settings
        self.sampling = sampling
        self.pixels = pixels
        self._merge = int(vlm.config.vision_config.spatial_merge_size)

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
        model_type = str(vlm.config.model_type)
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
        settings = processor_settings(name, saved)
        return cls(vlm, model_type, settings, sampling or FrameSampling(), pixels or VideoPixels())

    def prepare(self, decoded: DecodedVideo) -> PreparedVideo:
        """The frames SGLang's rule chose, as the model takes them, with their token count
        and metadata. CPU work only; safe to run in several threads at once."""
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
            stamps = tuple(video_timestamps(list(decoded.indices), decoded.fps, self._merge))
        return PreparedVideo(
            pixels.contiguous(),
            t * h * w // self._merge**2,
            grid,
            second_per_grid_ts=seconds,
            video_timestamps=stamps,
        )

    def features(self, videos: Sequence[PreparedVideo]) -> list[torch.Tensor]:
        """One forward of the model's ``get_video_features`` over ``videos``: one
        ``(tokens, hidden)`` tensor each, in the model's dtype, laid out as its images' rows
        (Qwen3-VL: the merger's output, then each deepstack layer's, side by side)."""
        vlm = self.vlm
        device = vlm.device
        with torch.inference_mode():
            pixels = torch.cat([video.pixels for video in videos]).to(device)
            grids = torch.tensor([video.grid for video in videos], dtype=torch.long, device=device)
            out = vlm.model.get_video_features(pixel_values_videos=pixels, video_grid_thw=grids)
            rows = list(out.pooler_output)
            if vlm.family.deepstack:
                layers = [list(layer) for layer in out.deepstack_features]
                rows = [
                    torch.cat([main, *(layer[index] for layer in layers)], dim=-1)
                    for index, main in enumerate(rows)
                ]
            return [row.to(vlm.dtype).contiguous() for row in rows]
