"""Small models with random weights of every family the server serves, built from their configs
(nothing is downloaded) and saved with their image processors: what ``trio-encode
make-tiny-model`` writes, what ``trio-encode bench --vlm`` and the GPU checks serve. Their
embeddings mean nothing; their shapes, token counts, dynamic resolution, tiling and packing of
images of different sizes into one forward are each family's own (transformers' classes), so a
directory made here exercises ``serve --model`` exactly as a real checkpoint of that family
would, in seconds. Needs the ``hf`` extra."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

VLM_IMAGE_SIZES: tuple[tuple[int, int], ...] = ((224, 224), (336, 168), (140, 280), (448, 336))
"""The bench's mix of image sizes (width, height): square, wide, tall, large; with the
Qwen2.5-VL processor below they give 64, 72, 50 and 192 image tokens."""

FAMILIES: dict[str, str] = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "llava": "LLaVA 1.5",
    "llava_onevision": "LLaVA-OneVision",
    "gemma3": "Gemma 3",
    "internvl": "InternVL",
    "clip": "CLIP vision tower",
    "siglip": "SigLIP vision tower",
}
"""Every family :func:`save_tiny_model` makes, by its ``model_type``, with its name (InternVL
in transformers' format, as the ``-hf`` checkpoints; CLIP and SigLIP as bare towers)."""


def family_named(name: str) -> str | None:
    """The ``model_type`` a family is called by, from either spelling: ``qwen2_5_vl``,
    ``Qwen2.5-VL``, ``LLaVA-OneVision``, ``Gemma 3`` (case, spaces and punctuation are
    ignored); None for none."""
    wanted = _squashed(name)
    for model_type, title in FAMILIES.items():
        if wanted in (_squashed(model_type), _squashed(title)):
            return model_type
    return None


def _squashed(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def save_tiny_model(family: str, path: Path, *, seed: int = 0) -> Path:
    """Write the tiny model of ``family`` (a ``model_type`` of :data:`FAMILIES`) and its image
    processor into ``path``; returns ``path``. The language model of a VLM has one layer and
    is never loaded by the server."""
    if family not in FAMILIES:
        raise ValueError(f"no tiny model of {family!r}; families: {', '.join(FAMILIES)}")
    if family == "qwen2_5_vl":
        return save_tiny_qwen2_5_vl(path, seed=seed)
    import torch
    import transformers

    torch.manual_seed(seed)
    model, processor = _BUILDERS[family](transformers)
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    return path


def save_tiny_qwen2_5_vl(path: Path, *, seed: int = 0) -> Path:
    """Write the bench's model (a 4-layer vision tower of width 256 and its merger to a hidden
    size of 512; a one-layer language model, never loaded by the server) and its processor
    into ``path``; returns ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    text = {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "bos_token_id": 1002,  # within the vocabulary: transformers warns of one outside it
        "eos_token_id": 1003,
        "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12]},
    }
    vision = {
        "depth": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_heads": 4,
        "out_hidden_size": 512,
        "window_size": 112,
        "fullatt_block_indexes": [3],
    }
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=1000, video_token_id=1001
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(str(path))
    processor = transformers.Qwen2VLImageProcessor(
        min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 256
    )
    processor.save_pretrained(str(path))
    return path


_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "head_dim": 16,
    "bos_token_id": 2,  # within the vocabulary: transformers warns of one outside it
    "eos_token_id": 3,
}
"""A one-layer language model of hidden size 64: the embeddings' width, never loaded."""
_QWEN_IDS = {"image_token_id": 9, "video_token_id": 10}
_QWEN_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 256}
_PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
"""LLaVA-OneVision's anyres resolutions for a 28 px tile: up to 3 tiles beside the base one."""


def _mrope(*, interleaved: bool = False) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "mrope_section": [2, 2, 4]}
    rope["rope_theta"] = 10000.0
    if interleaved:
        rope["mrope_interleaved"] = True
    return rope


def _tower(**extra: Any) -> dict[str, Any]:
    """A two-layer, 32-wide CLIP, SigLIP or InternViT tower; ``extra`` names its kind, image
    and patch sizes."""
    return {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        **extra,
    }


def _qwen2_vl(t: Any) -> tuple[Any, Any]:
    vision = {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 64,
        "mlp_ratio": 2,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = t.Qwen2VLConfig(
        text_config={**_TEXT, "rope_parameters": _mrope()}, vision_config=vision, **_QWEN_IDS
    )
    return t.Qwen2VLForConditionalGeneration(config), t.Qwen2VLImageProcessor(**_QWEN_PIXELS)


def _qwen3_vl(t: Any) -> tuple[Any, Any]:
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
    }
    config = t.Qwen3VLConfig(
        text_config={**_TEXT, "rope_parameters": _mrope(interleaved=True)},
        vision_config=vision,
        **_QWEN_IDS,
    )
    processor = t.Qwen2VLImageProcessor(patch_size=16, min_pixels=64 * 64, max_pixels=32 * 32 * 256)
    return t.Qwen3VLForConditionalGeneration(config), processor


def _llava(t: Any) -> tuple[Any, Any]:
    config = t.LlavaConfig(
        text_config={"model_type": "llama", **_TEXT},
        vision_config=_tower(
            model_type="clip_vision_model", image_size=28, patch_size=7, projection_dim=32
        ),
        image_token_id=9,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    processor = t.CLIPImageProcessor(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    return t.LlavaForConditionalGeneration(config), processor


def _llava_onevision(t: Any) -> tuple[Any, Any]:
    config = t.LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **_TEXT},
        vision_config=_tower(
            model_type="siglip_vision_model", image_size=28, patch_size=7, vision_use_head=False
        ),
        image_token_index=9,
        image_grid_pinpoints=_PINPOINTS,
        vision_aspect_ratio="anyres_max_9",
    )
    processor = t.LlavaOnevisionImageProcessor(
        size={"height": 28, "width": 28}, image_grid_pinpoints=_PINPOINTS
    )
    return t.LlavaOnevisionForConditionalGeneration(config), processor


def _gemma3(t: Any) -> tuple[Any, Any]:
    config = t.Gemma3Config(
        text_config={"model_type": "gemma3_text", **_TEXT, "sliding_window": 16},
        vision_config=_tower(model_type="siglip_vision_model", image_size=32, patch_size=4),
        mm_tokens_per_image=16,
        image_token_id=11,
        boi_token_id=9,
        eoi_token_id=10,
    )
    processor = t.Gemma3ImageProcessor(size={"height": 32, "width": 32})
    return t.Gemma3ForConditionalGeneration(config), processor


def _internvl(t: Any) -> tuple[Any, Any]:
    config = t.InternVLConfig(
        text_config={"model_type": "qwen2", **_TEXT},
        vision_config=_tower(image_size=[32, 32], patch_size=[8, 8]),
        image_token_id=11,
        downsample_ratio=0.5,
    )
    processor = t.GotOcr2ImageProcessor(
        size={"height": 32, "width": 32}, crop_to_patches=True, max_patches=4
    )
    return t.InternVLForConditionalGeneration(config), processor


def _clip(t: Any) -> tuple[Any, Any]:
    config = t.CLIPVisionConfig(**_tower(image_size=32, patch_size=8))
    processor = t.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    return t.CLIPVisionModel(config), processor


def _siglip(t: Any) -> tuple[Any, Any]:
    config = t.SiglipVisionConfig(**_tower(image_size=32, patch_size=8))
    return t.SiglipVisionModel(config), t.SiglipImageProcessor(size={"height": 32, "width": 32})


_BUILDERS: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen3_vl": _qwen3_vl,
    "llava": _llava,
    "llava_onevision": _llava_onevision,
    "gemma3": _gemma3,
    "internvl": _internvl,
    "clip": _clip,
    "siglip": _siglip,
}
"""Each family's model (random weights, from its config) and image processor, given the
``transformers`` module; Qwen2.5-VL is :func:`save_tiny_qwen2_5_vl`."""
