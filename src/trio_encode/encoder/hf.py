"""A Hugging Face model from a local directory: a VLM's vision path, or a CLIP/SigLIP tower.

:func:`load_hf_model` reads the directory's ``config.json`` and picks: a VLM family goes to
:mod:`trio_encode.encoder.vlm`; a bare CLIP or SigLIP tower is served here, whole.

``transformers`` is imported only here and only when such a model is asked for, so the server
runs without it. Nothing is ever downloaded: the directory must hold the config and weights.
Images are preprocessed by ``transformers``' own image processor for the model, read from the
directory's ``preprocessor_config.json``: resampling, shortest edge, crop, rescale factor, mean
and std are then exactly those the model was trained with, and no rule is restated here.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import KW_ONLY, asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from trio_encode.embedding import TORCH_DTYPES
from trio_encode.encoder.backend import FixedShape, VisionModel
from trio_encode.encoder.fingerprint import model_fingerprint, weights_digest
from trio_encode.encoder.images import Preprocess
from trio_encode.encoder.settings import EncoderSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Kind:
    """What differs between the supported towers."""

    model_class: str
    processor_class: str
    """The processor for a directory without ``preprocessor_config.json``."""
    _: KW_ONLY
    drops_cls: bool
    """Whether the first output token is a CLS token (not an image token) to drop."""
    crops: bool
    """Whether that processor resizes the short side and centre-crops (else: to a square)."""


_CLIP = _Kind("CLIPVisionModel", "CLIPImageProcessor", drops_cls=True, crops=True)
_SIGLIP = _Kind("SiglipVisionModel", "SiglipImageProcessor", drops_cls=False, crops=False)
_KINDS = {
    "clip": _CLIP,
    "clip_vision_model": _CLIP,
    "siglip": _SIGLIP,
    "siglip_vision_model": _SIGLIP,
}
_PROCESSOR_CONFIG = "preprocessor_config.json"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "serving a Hugging Face model (model) needs the 'transformers' "
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


class HFVisionBackend:
    """A CLIP/SigLIP vision model behind the forward interface the batcher uses: normalised
    pixels ``(B, 3, S, S)`` -> patch-token features ``(B, tokens, hidden)``."""

    def __init__(self, settings: EncoderSettings) -> None:
        if settings.model is None:
            raise ValueError("HFVisionBackend needs settings.model")
        model_dir = settings.model
        transformers = _transformers()
        config = _read_json(model_dir / "config.json")
        model_type = str(config.get("model_type", ""))
        kind = _KINDS[model_type]
        model_class = getattr(transformers, kind.model_class)
        self.module = (
            model_class.from_pretrained(str(model_dir), local_files_only=True)
            .to(TORCH_DTYPES[settings.model_dtype])
            .eval()
            .requires_grad_(False)
        )
        vision = self.module.config
        self.dtype = TORCH_DTYPES[settings.model_dtype]
        self._drop_cls = kind.drops_cls
        self._feature_layer = settings.feature_layer
        self.tokens_per_image = (int(vision.image_size) // int(vision.patch_size)) ** 2
        self.hidden_size = int(vision.hidden_size)
        side = int(vision.image_size)
        prepare = _ProcessorPrepare(_image_processor(transformers, model_dir, kind, side))
        _check_output_size(prepare, side, model_dir)
        self.preprocess = Preprocess(image_size=side, prepare=prepare)
        self.model_id = (
            f"hf({model_dir.resolve()},{model_type},layer={settings.feature_layer},"
            f"{settings.model_dtype})"
        )
        shape = {
            "config": config,
            "feature_layer": settings.feature_layer,
            "preprocess": asdict(self.preprocess),
        }
        self.fingerprint = model_fingerprint(
            f"hf-{model_type}", shape, settings.model_dtype, weights_digest(self.module)
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


def load_hf_model(settings: EncoderSettings) -> VisionModel:
    """The model in ``settings.model``: a VLM's vision path, or a CLIP/SigLIP tower. An
    unsupported model type, or a setting it does not use, is refused naming what would do."""
    if settings.model is None:
        raise ValueError("load_hf_model needs settings.model")
    from trio_encode.encoder.vlm import FAMILIES, VLMVisionModel

    _transformers()  # a missing extra is named before anything else
    config = _read_json(settings.model / "config.json")
    model_type = str(config.get("model_type", ""))
    if model_type in FAMILIES:
        if settings.feature_layer != -1:
            raise ValueError(
                f"feature_layer does not apply to a {model_type} model: its config names the "
                "layer its projector reads"
            )
        return VLMVisionModel(settings, config)
    if model_type in _KINDS:
        if settings.device != "cpu":
            raise ValueError(
                f"device {settings.device}: a bare {model_type} tower runs on the cpu only; "
                "serve a VLM directory to run on a GPU"
            )
        return FixedShape(HFVisionBackend(settings))
    raise _unsupported(settings.model, model_type)


def _unsupported(model_dir: Path, model_type: str) -> ValueError:
    from trio_encode.encoder.vlm import FAMILIES

    supported = ", ".join(sorted([*FAMILIES, *_KINDS]))
    return ValueError(
        f"{model_dir} holds a {model_type or 'untyped'} model; supported model types: {supported}"
    )


_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
"""A model's weights, in one file; sharded, ``NAME.index.json`` lists the files."""


def check_model_dir(model_dir: Path) -> None:
    """Refuse, at start and in a second, a model directory that :func:`load_hf_model` would
    fail on later: no readable ``config.json``, an unsupported ``model_type``, no weights (a
    config-only download), a shard its index lists but the directory lacks, or a safetensors
    file shorter than its own header says (an interrupted download). Reads headers only; a
    missing extra is named first, as loading would (found, not imported: that takes seconds)."""
    from trio_encode.encoder.vlm import FAMILIES

    if importlib.util.find_spec("transformers") is None:
        _transformers()
    config = _read_json(model_dir / "config.json")
    model_type = str(config.get("model_type", ""))
    if model_type not in FAMILIES and model_type not in _KINDS:
        raise _unsupported(model_dir, model_type)
    files: list[Path] = []
    for name in _WEIGHTS:
        index = model_dir / f"{name}.index.json"
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map")
            files += [model_dir / str(shard) for shard in sorted(set(weight_map.values()))]
        elif (model_dir / name).exists():
            files.append(model_dir / name)
    if not files:
        raise ValueError(
            f"{model_dir} has a config but no weights (neither of {', '.join(_WEIGHTS)}, nor "
            "their .index.json with its shards): download the whole model, not its config only"
        )
    for file in files:
        if not file.is_file():
            raise ValueError(f"{file} is missing (its index lists it): an incomplete download?")
        if file.suffix == ".safetensors":
            _check_safetensors(file)


def _check_safetensors(path: Path) -> None:
    """The file holds its header and every byte the header says its tensors span."""
    size = path.stat().st_size
    with path.open("rb") as file:
        head = file.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise ValueError(f"{path} is not a safetensors file (truncated or corrupt)")
        try:
            header = json.loads(file.read(length))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has an unreadable safetensors header (truncated or corrupt)")
    ends = [
        int(entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        raise ValueError(
            f"{path} is {size} bytes; its header describes {needed}: truncated (an "
            "interrupted download?)"
        )


def _image_processor(transformers: Any, model_dir: Path, kind: _Kind, image_size: int) -> Any:
    """The model's own image processor; for a directory without one (a model saved without
    its processor), the model type's processor at its defaults, sized to the model."""
    if (model_dir / _PROCESSOR_CONFIG).exists():
        return transformers.AutoImageProcessor.from_pretrained(
            str(model_dir), local_files_only=True
        )
    log.warning(
        "%s has no %s: preprocessing with %s's defaults at %d px",
        model_dir,
        _PROCESSOR_CONFIG,
        kind.processor_class,
        image_size,
    )
    processor_class = getattr(transformers, kind.processor_class)
    if kind.crops:
        return processor_class(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        )
    return processor_class(size={"height": image_size, "width": image_size})


class _ProcessorPrepare:
    """An upright RGB image -> ``(3, S, S)`` float32 pixels, by a transformers processor."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, image: Image.Image) -> torch.Tensor:
        pixels: torch.Tensor = self.processor(images=image, return_tensors="pt")["pixel_values"]
        return pixels[0].to(torch.float32).contiguous()


def _check_output_size(prepare: _ProcessorPrepare, side: int, model_dir: Path) -> None:
    """A processor whose output the model cannot take is refused at load, not per request."""
    shape = tuple(prepare(Image.new("RGB", (side + 7, side + 3))).shape)
    if shape != (3, side, side):
        raise ValueError(
            f"{model_dir / _PROCESSOR_CONFIG} makes {shape} pixels; the model takes "
            f"(3, {side}, {side})"
        )
