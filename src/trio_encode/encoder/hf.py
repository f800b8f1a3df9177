"""A real vision tower (CLIP or SigLIP, Hugging Face format) from a local directory.

``transformers`` is imported only here and only when such a model is asked for, so the server
runs without it. Nothing is ever downloaded: the directory must hold the config and weights.
Preprocessing (size, mean, std, crop) comes from the model's own files, not from guesses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from trio_encode.embedding import TORCH_DTYPES
from trio_encode.encoder.images import Preprocess
from trio_encode.encoder.settings import EncoderSettings

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)
# model_type -> (transformers class, whether the first token is a CLS token to drop, and the
# mean, std and centre-crop to use when the directory has no preprocessor_config.json).
_KINDS: dict[str, tuple[str, bool, tuple[float, ...], tuple[float, ...], bool]] = {
    "clip": ("CLIPVisionModel", True, _CLIP_MEAN, _CLIP_STD, True),
    "clip_vision_model": ("CLIPVisionModel", True, _CLIP_MEAN, _CLIP_STD, True),
    "siglip": ("SiglipVisionModel", False, _HALF, _HALF, False),
    "siglip_vision_model": ("SiglipVisionModel", False, _HALF, _HALF, False),
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "loading a Hugging Face vision tower (hf_model_dir) needs the 'transformers' "
            "package: pip install 'trio-encode[hf]'"
        ) from exc
    return transformers


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open() as file:
            data = json.load(file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _triple(values: Any, default: tuple[float, ...]) -> tuple[float, float, float]:
    seq = default if values is None else values
    if isinstance(seq, int | float):
        seq = (seq, seq, seq)
    a, b, c = (float(v) for v in seq)
    return (a, b, c)


class HFVisionBackend:
    """A CLIP/SigLIP vision model behind the forward interface the batcher uses: normalised
    pixels ``(B, 3, S, S)`` -> patch-token features ``(B, tokens, hidden)``."""

    def __init__(self, settings: EncoderSettings) -> None:
        if settings.hf_model_dir is None:
            raise ValueError("HFVisionBackend needs settings.hf_model_dir")
        model_dir = settings.hf_model_dir
        transformers = _transformers()
        config = _read_json(model_dir / "config.json")
        model_type = str(config.get("model_type", ""))
        if model_type not in _KINDS:
            supported = ", ".join(sorted(_KINDS))
            raise ValueError(
                f"{model_dir} holds a {model_type or 'untyped'} model; supported: {supported}"
            )
        class_name, has_cls, mean, std, crop = _KINDS[model_type]
        model_class = getattr(transformers, class_name)
        self.module = (
            model_class.from_pretrained(str(model_dir), local_files_only=True)
            .to(TORCH_DTYPES[settings.dtype])
            .eval()
            .requires_grad_(False)
        )
        vision = self.module.config
        self.dtype = TORCH_DTYPES[settings.dtype]
        self._drop_cls = has_cls
        self._feature_layer = settings.hf_feature_layer
        self.tokens_per_image = (int(vision.image_size) // int(vision.patch_size)) ** 2
        self.hidden_size = int(vision.hidden_size)
        self.preprocess = _preprocess(model_dir, int(vision.image_size), mean, std, crop)
        self.model_id = (
            f"hf({model_dir.resolve()},{model_type},layer={settings.hf_feature_layer},"
            f"{settings.dtype})"
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = self.module(
                pixel_values=pixels.to(self.dtype),
                output_hidden_states=self._feature_layer != -1,
            )
            if self._feature_layer == -1:
                features = out.last_hidden_state
            else:
                features = out.hidden_states[self._feature_layer]
            if self._drop_cls:
                features = features[:, 1:, :]
            result: torch.Tensor = features.contiguous()
            return result


def _preprocess(
    model_dir: Path,
    image_size: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    crop: bool,
) -> Preprocess:
    path = model_dir / "preprocessor_config.json"
    processor = _read_json(path) if path.exists() else {}
    return Preprocess(
        image_size=image_size,
        mean=_triple(processor.get("image_mean"), mean),
        std=_triple(processor.get("image_std"), std),
        center_crop=bool(processor.get("do_center_crop", crop)),
    )
