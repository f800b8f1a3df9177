"""The vision path of a real VLM (Hugging Face format) from a local directory.

The model's skeleton is built on the meta device (no memory), then only its vision modules
and projector/merger are materialised and loaded from the safetensors files: the language
model's tensors are never read (a shard holding only them is never opened). The features come
from the model's own ``get_image_features``, on the model's own image processor's output, so
embeddings and token counts are the model's, with no rule restated here.

Images of any size share a forward: Qwen-VL packs every image's patches into one sequence
with their grids; Gemma 4's processor pads every image's patches to one length, so its images
stack; tiled and fixed-size models concatenate their tiles. The per-image split is the one
``get_image_features`` returns (or, for tiles, the processor's tile counts).

``transformers`` is imported only here and only when such a model is asked for.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors import safe_open

from trio_encode.embedding import TORCH_DTYPES
from trio_encode.encoder.backend import Prepared
from trio_encode.encoder.fingerprint import model_fingerprint, weights_digest
from trio_encode.encoder.images import open_image
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.errors import InvalidInput

log = logging.getLogger(__name__)

Features = Callable[[Any, Sequence[Prepared], torch.device], list[torch.Tensor]]


@dataclass(frozen=True)
class Family:
    """What differs between the supported VLMs."""

    modules: tuple[str, ...]
    """Paths (in the model class) of the vision modules and the projector: all that is loaded."""
    tokens_per_tile: Callable[[Any], int] | None
    """Tokens of one tile of pixels (None: a grid per image, Qwen-VL)."""
    features: Features
    """One forward of ``get_image_features`` -> one ``(tokens, hidden)`` tensor per image."""
    deepstack: bool = False
    """Whether each row carries the deepstack layers' features beside the merger's (Qwen3-VL
    and its MoE): ``hidden * (1 + len(deepstack_visual_indexes))`` columns."""
    images: bool = True
    """Whether the model takes images; one without (an audio model) has no image processor,
    and an image sent to it is refused."""
    part: str | None = None
    """The part of the checkpoint served, where it is not the whole (an Omni model's
    ``thinker``): its configuration is the whole's ``{part}_config``, its tensors' names in the
    checkpoint start ``{part}.``."""
    model_class: str | None = None
    """The transformers class built, where the configuration does not name it (a part)."""


def _qwen_features(model: Any, images: Sequence[Prepared], device: torch.device) -> list[Any]:
    pixels = torch.cat([image.pixels for image in images]).to(device)
    grids = torch.tensor([image.grid for image in images], dtype=torch.long, device=device)
    out = model.get_image_features(pixel_values=pixels, image_grid_thw=grids)
    return list(out.pooler_output)


def _qwen3_features(model: Any, images: Sequence[Prepared], device: torch.device) -> list[Any]:
    """Qwen3-VL: the merger's output, then each deepstack layer's features, side by side per
    token (``(tokens, hidden * (1 + layers))``), which is how SGLang's Qwen3-VL encoder hands
    them to its prefill (it splits the columns back there)."""
    pixels = torch.cat([image.pixels for image in images]).to(device)
    grids = torch.tensor([image.grid for image in images], dtype=torch.long, device=device)
    out = model.get_image_features(pixel_values=pixels, image_grid_thw=grids)
    per_layer = [list(layer) for layer in out.deepstack_features]
    return [
        torch.cat([main, *(layer[index] for layer in per_layer)], dim=-1)
        for index, main in enumerate(out.pooler_output)
    ]


def _gemma4_features(model: Any, images: Sequence[Prepared], device: torch.device) -> list[Any]:
    """Gemma 4: every image's patches (padded by its processor to one patch budget) and their
    positions in one forward; the model strips the padding and splits the rows per image."""
    packed = torch.cat([image.pixels for image in images]).to(device)
    pixels, positions = packed[..., :-2], packed[..., -2:].to(torch.long)
    out = model.get_image_features(pixel_values=pixels, image_position_ids=positions)
    return list(out.pooler_output)


def _tile_features(model: Any, images: Sequence[Prepared], device: torch.device) -> list[Any]:
    """Models whose images are tiles of one size: every tile of every image in one forward,
    each image's rows its tiles' tokens in order."""
    pixels = torch.cat([image.pixels for image in images]).to(device)
    out = model.get_image_features(pixel_values=pixels).pooler_output
    if isinstance(out, (list, tuple)):
        out = torch.stack(list(out))
    tiles = [int(image.pixels.shape[0]) for image in images]
    return [part.reshape(-1, part.shape[-1]) for part in torch.split(out, tiles)]


def _onevision_features(model: Any, images: Sequence[Prepared], device: torch.device) -> list[Any]:
    """LLaVA-OneVision: each image's tiles (padded to the batch's most, as its processor pads
    a batch) and its original size; the model unpads, adds its newline tokens and returns every
    image's features back to back, split here by each image's count."""
    most = max(int(image.pixels.shape[1]) for image in images)
    first = images[0].pixels
    pixels = first.new_zeros((len(images), most, *first.shape[2:]))
    for index, image in enumerate(images):
        pixels[index, : image.pixels.shape[1]] = image.pixels[0]
    sizes = torch.tensor([image.size for image in images], dtype=torch.long, device=device)
    out = model.get_image_features(pixel_values=pixels.to(device), image_sizes=sizes)
    features = out.pooler_output
    if isinstance(features, (list, tuple)):
        features = torch.cat(list(features))
    return list(torch.split(features, [image.tokens for image in images]))


def _no_images(model: Any, images: Sequence[Prepared], device: torch.device) -> list[Any]:
    raise InvalidInput(f"this model ({model.config.model_type}) takes no images")


def _llava_tokens(config: Any) -> int:
    vision = config.vision_config
    tokens = (int(vision.image_size) // int(vision.patch_size)) ** 2
    return tokens + (1 if config.vision_feature_select_strategy == "full" else 0)


def _gemma3_tokens(config: Any) -> int:
    return int(config.mm_tokens_per_image)


def _internvl_tokens(config: Any) -> int:
    vision = config.vision_config
    side = _first(vision.image_size) // _first(vision.patch_size)
    return int(side * side * config.downsample_ratio**2)


def _first(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


_QWEN = Family(("model.visual",), None, _qwen_features)
_DEEPSTACK = Family(("model.visual",), None, _qwen3_features, deepstack=True)
_PROJECTED = ("model.vision_tower", "model.multi_modal_projector")
FAMILIES: dict[str, Family] = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _DEEPSTACK,
    "qwen3_vl_moe": _DEEPSTACK,
    "qwen3_5": _QWEN,
    "qwen3_5_moe": _QWEN,
    "gemma4": Family(("model.vision_tower", "model.embed_vision"), None, _gemma4_features),
    "llava": Family(
        ("model.vision_tower", "model.multi_modal_projector"), _llava_tokens, _tile_features
    ),
    "gemma3": Family(
        ("model.vision_tower", "model.multi_modal_projector"), _gemma3_tokens, _tile_features
    ),
    "llava_onevision": Family((*_PROJECTED, "model.image_newline"), None, _onevision_features),
    "internvl": Family(
        ("model.vision_tower", "model.multi_modal_projector"), _internvl_tokens, _tile_features
    ),
    "qwen2_audio": Family(
        ("model.audio_tower", "model.multi_modal_projector"), None, _no_images, images=False
    ),
    "qwen2_5_omni": Family(
        ("model.audio_tower", "model.visual"),
        None,
        _qwen_features,
        part="thinker",
        model_class="Qwen2_5OmniThinkerForConditionalGeneration",
    ),
}
"""The VLMs served, by ``model_type``."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "serving a Hugging Face model (model) needs the 'transformers' package: "
            "pip install 'trio-encode[hf]'"
        ) from exc
    return transformers


class VLMVisionModel:
    """A VLM's vision path behind the interface the batcher uses (:class:`VisionModel`)."""

    def __init__(self, settings: EncoderSettings, config_json: dict[str, Any]) -> None:
        if settings.model is None:
            raise ValueError("VLMVisionModel needs settings.model")
        model_dir = settings.model
        transformers = _transformers()
        model_type = str(config_json["model_type"])
        self.model_type = model_type
        """The checkpoint's ``model_type`` (the whole model's where a part is served, whose
        own is :attr:`config`'s)."""
        self.family = FAMILIES[model_type]
        self.dtype = TORCH_DTYPES[settings.model_dtype]
        self.device = torch.device(settings.device)
        config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        if self.family.part is not None:
            config = getattr(config, f"{self.family.part}_config")
        self.model = _build_vision_only(transformers, config, model_dir, self.family, self.dtype)
        for path in self.family.modules:
            _to_device(self.model, path, self.device)
        self.config = config
        self.processor: Any = None
        if self.family.images:
            self.processor = transformers.AutoImageProcessor.from_pretrained(
                str(model_dir), local_files_only=True
            )
        text = config.get_text_config()
        self.hidden_size = int(text.hidden_size)
        if self.family.deepstack:
            self.hidden_size *= 1 + len(config.vision_config.deepstack_visual_indexes)
        vision = getattr(config, "vision_config", None)
        self._merge = int(getattr(vision, "spatial_merge_size", 1))
        self._per_tile = (
            self.family.tokens_per_tile(config) if self.family.tokens_per_tile else None
        )
        self.fixed_tokens: int | None = None
        if self._per_tile is not None and not _tiles_vary(self.processor):
            self.fixed_tokens = self._per_tile
        self.model_id = f"vlm({model_dir.resolve()},{model_type},{settings.model_dtype})"
        state = {
            name: tensor
            for name, tensor in self.model.state_dict().items()
            if _under(name, self.family.modules)
        }
        self._fingerprint = model_fingerprint(
            f"vlm-{model_type}",
            {"config": config_json, "processor": _processor_facts(self.processor, model_dir)},
            settings.model_dtype,
            weights_digest(state),
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def decode(self, data: bytes, *, max_pixels: int) -> Prepared:
        self._takes_images()
        return self.prepare(open_image(data, max_pixels=max_pixels))

    def _takes_images(self) -> None:
        if not self.family.images:
            raise InvalidInput(f"this model ({self.config.model_type}) takes no images")

    def prepare(self, image: Image.Image) -> Prepared:
        """An upright RGB image through the model's own image processor. Gemma 4's patch
        positions (``(x, y)``, -1 for padding) ride as the last two columns of its pixels
        (small integers, exact in float32): one tensor per image, as the batcher carries it."""
        self._takes_images()
        out = self.processor(images=[image], return_tensors="pt")
        pixels: torch.Tensor = out["pixel_values"].to(torch.float32).contiguous()
        if "image_position_ids" in out:
            positions = out["image_position_ids"].to(torch.float32)
            packed = torch.cat([pixels, positions], dim=-1).contiguous()
            return Prepared(packed, int(out["num_soft_tokens_per_image"][0]))
        if "image_sizes" in out and self._per_tile is None:
            height, width = (int(v) for v in out["image_sizes"][0])
            tokens = self._onevision_tokens(height, width, int(pixels.shape[-2]))
            return Prepared(pixels, tokens, size=(height, width))
        if self._per_tile is None:
            t, h, w = (int(v) for v in out["image_grid_thw"][0])
            return Prepared(pixels, t * h * w // self._merge**2, (t, h, w))
        if pixels.dim() == 3:
            pixels = pixels.unsqueeze(0)
        return Prepared(pixels, int(pixels.shape[0]) * self._per_tile)

    def _onevision_tokens(self, height: int, width: int, side: int) -> int:
        """The image tokens LLaVA-OneVision's own processor puts in a prompt for an image of
        this size (its counting code, run on this model's numbers)."""
        from types import SimpleNamespace

        counter = _transformers().LlavaOnevisionProcessor
        vision = self.config.vision_config
        facts = SimpleNamespace(
            image_processor=self.processor,
            num_image_tokens=(int(vision.image_size) // int(vision.patch_size)) ** 2,
            vision_aspect_ratio=self.config.vision_aspect_ratio,
        )
        facts._get_unpadded_features = partial(counter._get_unpadded_features, facts)
        return int(counter._get_number_of_features(facts, height, width, side, side))

    def encode(self, images: Sequence[Prepared]) -> list[torch.Tensor]:
        with torch.inference_mode():
            outs = self.family.features(self.model, images, self.device)
            return [out.to(self.dtype).contiguous() for out in outs]


def _processor_facts(processor: Any, model_dir: Path) -> dict[str, Any]:
    """What the model's preprocessing is configured by, for its fingerprint: its image
    processor's settings, or (a model without images) its saved feature extractor's."""
    if processor is not None:
        return dict(processor.to_dict())
    saved = model_dir / "preprocessor_config.json"
    return dict(json.loads(saved.read_text())) if saved.exists() else {}


def _tiles_vary(processor: Any) -> bool:
    """Whether the processor cuts an image into a number of tiles that depends on its size."""
    return bool(getattr(processor, "crop_to_patches", False)) or bool(
        getattr(processor, "do_pan_and_scan", False)
    )


def _build_vision_only(
    transformers: Any, config: Any, model_dir: Path, family: Family, dtype: torch.dtype
) -> Any:
    """The model class on the meta device, its vision modules loaded from the checkpoint and
    the rest (the language model) left without memory."""
    model_class = (
        getattr(transformers, family.model_class)
        if family.model_class
        else _model_class(transformers, config)
    )
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)
    state = _read_vision_tensors(model_dir, family.modules, model, family.part)
    model.load_state_dict(state, strict=False, assign=True)
    loaded = set(state)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in loaded:
            tensor._is_hf_initialized = True  # transformers' initialisers leave it alone
    for path in family.modules:
        if not _is_parameter(model, path):
            _materialise_buffers(model, path, loaded)
    model.eval().requires_grad_(False)
    return model


def _under(name: str, paths: Sequence[str]) -> bool:
    """Whether a parameter or buffer name is one of ``paths`` or lies inside one."""
    return any(name == path or name.startswith(f"{path}.") for path in paths)


def _is_parameter(model: Any, path: str) -> bool:
    """Whether ``path`` names a bare parameter (LLaVA-OneVision's ``image_newline``), not a
    module."""
    owner_path, _, leaf = path.rpartition(".")
    return leaf in model.get_submodule(owner_path)._parameters


def _to_device(model: Any, path: str, device: torch.device) -> None:
    """Move a module, or a bare parameter, to ``device``."""
    if _is_parameter(model, path):
        owner_path, _, leaf = path.rpartition(".")
        owner = model.get_submodule(owner_path)
        param = owner._parameters[leaf]
        owner._parameters[leaf] = torch.nn.Parameter(param.to(device), requires_grad=False)
    else:
        model.get_submodule(path).to(device)


def _model_class(transformers: Any, config: Any) -> Any:
    for name in getattr(config, "architectures", None) or ():
        model_class = getattr(transformers, name, None)
        if model_class is not None:
            return model_class
    return transformers.AutoModelForImageTextToText._model_mapping[type(config)]


def _read_vision_tensors(
    model_dir: Path, modules: tuple[str, ...], model: Any, part: str | None = None
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of ``modules`` (of ``part``, where the model is one part of
    the checkpoint's) under the model's own names, in the dtypes of the model's (meta)
    parameters; shards without any are never opened."""
    expected = dict(model.state_dict())
    wanted = {name for name in expected if _under(name, modules)}
    where = _weight_map(model_dir)
    by_shard: dict[str, list[tuple[str, str]]] = {}
    for stored, shard in where.items():
        name = _model_name(stored, wanted, part)
        if name is not None:
            by_shard.setdefault(shard, []).append((stored, name))
    state: dict[str, torch.Tensor] = {}
    for shard, names in sorted(by_shard.items()):
        with safe_open(str(model_dir / shard), framework="pt", device="cpu") as file:
            for stored, name in names:
                tensor = file.get_tensor(stored)
                target = expected[name]
                if tensor.is_floating_point():
                    tensor = tensor.to(target.dtype)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{model_dir / shard}: {stored} has shape {tuple(tensor.shape)}, the "
                        f"model's config wants {tuple(target.shape)}"
                    )
                state[name] = tensor
    persistent = {name for name in wanted if not _non_persistent(model, name)}
    missing = sorted(persistent - set(state))
    if missing:
        raise ValueError(
            f"{model_dir} lacks {len(missing)} vision tensors, e.g. {', '.join(missing[:3])}"
        )
    return state


def _model_name(stored: str, wanted: set[str], part: str | None = None) -> str | None:
    """A checkpoint key as the model names it: checkpoints keep the original layout
    (``visual.``, ``vision_tower.``...) where the model class nests it under ``model.``; a
    part's keys carry its name first (``thinker.audio_tower.``)."""
    if part is not None:
        if not stored.startswith(f"{part}."):
            return None
        stored = stored.removeprefix(f"{part}.")
    for name in (stored, f"model.{stored}"):
        if name in wanted:
            return name
    return None


def _weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file, from the index (sharded) or the one file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"cannot read {index}: {exc}") from exc
        return {str(k): str(v) for k, v in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{model_dir} holds no model.safetensors(.index.json)")
    with safe_open(str(single), framework="pt", device="cpu") as file:
        return {name: single.name for name in file.keys()}  # noqa: SIM118 - not a dict


def _non_persistent(model: Any, name: str) -> bool:
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path)
    return leaf in getattr(module, "_non_persistent_buffers_set", set())


def _materialise_buffers(model: Any, path: str, loaded: set[str]) -> None:
    """Give the module's buffers that no checkpoint holds (rotary frequencies and the like)
    memory, and let the model's own initialiser compute them, as ``from_pretrained`` does.
    Filled with a sentinel first (NaN, or the integer type's least value), so one that
    nothing computed is caught rather than served."""
    root = model.get_submodule(path)
    for module_name, module in root.named_modules(prefix=path):
        for name, buffer in list(module._buffers.items()):
            full = f"{module_name}.{name}"
            if buffer is not None and buffer.is_meta and full not in loaded:
                module._buffers[name] = torch.full(
                    buffer.shape, _sentinel(buffer.dtype), dtype=buffer.dtype
                )
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                raise ValueError(f"the checkpoint lacks {module_name}.{name}")
    # Each module is initialised by its nearest enclosing pretrained model (a tower nested in
    # the VLM, e.g. CLIP's, knows its own buffers), as from_pretrained does.
    owners = {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "_init_weights") and hasattr(module, "config")
    }
    for name, module in root.named_modules(prefix=path):
        owner = max(
            (o for o in owners if o == "" or name == o or name.startswith(f"{o}.")), key=len
        )
        owners[owner]._init_weights(module)
    for name, buffer in root.named_buffers(prefix=path):
        sentinel = _sentinel(buffer.dtype)
        unset = torch.isnan(buffer) if math.isnan(sentinel) else buffer == sentinel
        if bool(unset.any()):
            raise ValueError(f"nothing initialised the buffer {name}")


def _sentinel(dtype: torch.dtype) -> float:
    if dtype.is_floating_point:
        return math.nan
    if dtype == torch.bool:
        raise ValueError("a boolean buffer cannot be checked for initialisation")
    return float(torch.iinfo(dtype).min)
