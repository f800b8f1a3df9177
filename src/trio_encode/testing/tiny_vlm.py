"""Small models with random weights of every family the server serves, built from their configs
(nothing is downloaded) and saved with their image processors: what ``trio-encode
make-tiny-model`` writes, what ``trio-encode bench --vlm`` and the GPU checks serve. Their
embeddings mean nothing; their shapes, token counts, dynamic resolution, tiling and packing of
images of different sizes into one forward are each family's own (transformers' classes), so a
directory made here exercises ``serve --model`` exactly as a real checkpoint of that family
would, in seconds. Needs the ``hf`` extra."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

VLM_IMAGE_SIZES: tuple[tuple[int, int], ...] = ((224, 224), (336, 168), (140, 280), (448, 336))
"""The bench's mix of image sizes (width, height): square, wide, tall, large; with the
Qwen2.5-VL processor below they give 64, 72, 50 and 192 image tokens."""

FAMILIES: dict[str, str] = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL-MoE",
    "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE",
    "llava": "LLaVA 1.5",
    "llava_onevision": "LLaVA-OneVision",
    "gemma3": "Gemma 3",
    "gemma4": "Gemma 4",
    "internvl": "InternVL",
    "clip": "CLIP vision tower",
    "siglip": "SigLIP vision tower",
    "qwen2_audio": "Qwen2-Audio",
    "qwen2_5_omni": "Qwen2.5-Omni",
}
"""Every family :func:`save_tiny_model` makes, by its ``model_type``, with its name (InternVL
in transformers' format, as the ``-hf`` checkpoints; CLIP and SigLIP as bare towers;
Qwen2-Audio takes no images)."""


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
    if family == "qwen2_audio":
        return save_tiny_qwen2_audio(path, seed=seed)
    if family == "qwen2_5_omni":
        return save_tiny_qwen2_5_omni(path, seed=seed)
    import torch
    import transformers

    torch.manual_seed(seed)
    parts = tiny_parts(family, transformers)
    parts.model_class(parts.config).save_pretrained(str(path))
    parts.image_processor.save_pretrained(str(path))
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


_AUDIO_TOWER: dict[str, Any] = {
    "d_model": 32,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 48,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
}
"""A two-layer, 32-wide Whisper-style audio encoder of 128 mel bins (Qwen2-Audio's and
Qwen2.5-Omni's), with its full 30 s window of positions."""
AUDIO_IDS: dict[str, int] = {
    "audio_token_id": 11,
    "audio_bos_token_id": 12,
    "audio_eos_token_id": 13,
}
"""The audio models' token ids (within :data:`TINY_TEXT`'s vocabulary)."""


def save_tiny_qwen2_audio(
    path: Path, *, seed: int = 0, audio_token_id: int = AUDIO_IDS["audio_token_id"]
) -> Path:
    """Write a tiny Qwen2-Audio (its audio encoder, projector and a one-layer language model
    of :data:`TINY_TEXT`) and its Whisper feature extractor into ``path``; returns ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2AudioConfig(
        audio_config={"model_type": "qwen2_audio_encoder", **_AUDIO_TOWER},
        text_config={"model_type": "qwen2", **TINY_TEXT, **TEXT_TOKEN_IDS},
        audio_token_index=audio_token_id,
    )
    transformers.Qwen2AudioForConditionalGeneration(config).save_pretrained(str(path))
    extractor: Any = transformers.WhisperFeatureExtractor
    extractor(feature_size=128).save_pretrained(str(path))
    return path


OMNI_CHECKPOINT_NAMES: tuple[tuple[str, str], ...] = (
    ("model.audio_tower.", "thinker.audio_tower."),
    ("model.visual.", "thinker.visual."),
    ("model.language_model.", "thinker.model."),
    ("lm_head.", "thinker.lm_head."),
)
"""The thinker's tensors as transformers names them, and as Qwen2.5-Omni's checkpoints do."""


def save_tiny_qwen2_5_omni(
    path: Path, *, seed: int = 0, token_ids: dict[str, int] | None = None
) -> Path:
    """Write a tiny Qwen2.5-Omni as its checkpoints are laid out into ``path``; returns
    ``path``: the whole model's config (its talker and token2wav at their defaults: never
    built, no tensors), the thinker's tensors under ``thinker.`` in the original layout, and
    one ``preprocessor_config.json`` for both its image processor and its Whisper feature
    extractor (a 300 s window). ``token_ids`` overrides the thinker's token ids (its
    ``*_token_index`` and ``*_token_id`` keys)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    thinker: dict[str, Any] = {
        "audio_config": {**_AUDIO_TOWER, "n_window": 50, "output_dim": TINY_TEXT["hidden_size"]},
        "vision_config": {
            **_QWEN_VISION,
            "hidden_size": 32,
            "intermediate_size": 48,
            "out_hidden_size": TINY_TEXT["hidden_size"],
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        "text_config": {**TINY_TEXT, **TEXT_TOKEN_IDS, "rope_parameters": mrope()},
        "audio_token_index": AUDIO_IDS["audio_token_id"],
        "audio_start_token_id": AUDIO_IDS["audio_bos_token_id"],
        "audio_end_token_id": AUDIO_IDS["audio_eos_token_id"],
        "image_token_index": QWEN_IDS["image_token_id"],
        "video_token_index": QWEN_IDS["video_token_id"],
        "vision_start_token_id": 14,
        "vision_end_token_id": 15,
        **(token_ids or {}),
    }
    config = transformers.Qwen2_5OmniConfig(thinker_config=thinker)
    config.architectures = ["Qwen2_5OmniModel"]
    torch.manual_seed(seed)
    thinker_config: Any = config.thinker_config
    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration(thinker_config)
    tensors = {}
    for name, tensor in model.state_dict().items():
        ours, theirs = next(pair for pair in OMNI_CHECKPOINT_NAMES if name.startswith(pair[0]))
        tensors[theirs + name.removeprefix(ours)] = tensor.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(config.to_json_string())
    images = transformers.Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 256)
    whisper: Any = transformers.WhisperFeatureExtractor
    extractor = whisper(feature_size=128, chunk_length=300, return_attention_mask=True)
    saved = {**images.to_dict(), **extractor.to_dict(), "processor_class": "Qwen2_5OmniProcessor"}
    (path / "preprocessor_config.json").write_text(json.dumps(saved, indent=2))
    return path


TINY_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "head_dim": 16,
}
"""A one-layer language model of hidden size 64: the embeddings' width, never loaded."""
TEXT_TOKEN_IDS: dict[str, Any] = {"bos_token_id": 2, "eos_token_id": 3}
"""Begin and end tokens within the vocabulary (transformers warns of ones outside it): part of
:func:`tiny_parts`' language model unless ``text`` says otherwise."""
QWEN_IDS: dict[str, Any] = {"image_token_id": 9, "video_token_id": 10}
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
"""LLaVA-OneVision's anyres resolutions for a 28 px tile: up to 3 tiles beside the base one."""


@dataclass(frozen=True)
class TinyParts:
    """A tiny model of one family before it exists: its class, its config (random weights come
    from ``model_class(config)``) and its image processor."""

    model_class: Any
    config: Any
    image_processor: Any


def tiny_parts(
    family: str,
    t: Any,
    *,
    text: dict[str, Any] | None = None,
    max_image_tokens: int = 256,
    vision: dict[str, Any] | None = None,
) -> TinyParts:
    """The tiny model of ``family`` (a ``model_type`` of :data:`FAMILIES`; ``qwen2_5_vl`` is a
    two-layer one, not the bench's :func:`save_tiny_qwen2_5_vl`), given the ``transformers``
    module. ``text`` is its language model's config (:data:`TINY_TEXT` with
    :data:`TEXT_TOKEN_IDS` by default); ``max_image_tokens`` and ``vision`` are for the Qwen
    families only: the most merged tokens their processor gives one image, and keys added to
    their vision config."""
    if family not in _PARTS:
        raise ValueError(f"no tiny model of {family!r}; families: {', '.join(_PARTS)}")
    text = {**TINY_TEXT, **TEXT_TOKEN_IDS} if text is None else text
    return _PARTS[family](t, text, max_image_tokens, vision or {})


def mrope(*, interleaved: bool = False) -> dict[str, Any]:
    """The rope parameters of a tiny Qwen language model (sections of its head of 16)."""
    rope: dict[str, Any] = {"rope_type": "default", "mrope_section": [2, 2, 4]}
    rope["rope_theta"] = 10000.0
    if interleaved:
        rope["mrope_interleaved"] = True
    return rope


def tower(**extra: Any) -> dict[str, Any]:
    """A two-layer, 32-wide CLIP, SigLIP or InternViT tower; ``extra`` names its kind, image
    and patch sizes."""
    return {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        **extra,
    }


_QWEN_VISION: dict[str, Any] = {
    "depth": 2,
    "num_heads": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
"""What every tiny Qwen vision tower shares: two layers of two heads, 14 px patches (16 for
Qwen3-VL and the families after it), merged 2x2."""
_QWEN3_5_TOWER: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "patch_size": 16,
    "out_hidden_size": 64,
    "num_position_embeddings": 64,
}
"""Qwen3.5's tower: Qwen3-VL's without its deepstack layers."""
_QWEN3_TOWER: dict[str, Any] = {**_QWEN3_5_TOWER, "deepstack_visual_indexes": [0, 1]}
"""Qwen3-VL's (and Qwen3-VL-MoE's) tower: two deepstack layers."""
_QWEN_TOWERS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_vl": ("Qwen2VL", {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2}),
    "qwen2_5_vl": (
        "Qwen2_5_VL",
        {
            "hidden_size": 32,
            "embed_dim": 32,
            "intermediate_size": 48,
            "out_hidden_size": 64,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
    ),
    "qwen3_vl": ("Qwen3VL", _QWEN3_TOWER),
    "qwen3_vl_moe": ("Qwen3VLMoe", _QWEN3_TOWER),
    "qwen3_5": ("Qwen3_5", _QWEN3_5_TOWER),
    "qwen3_5_moe": ("Qwen3_5Moe", _QWEN3_5_TOWER),
}
"""Each Qwen family's transformers class prefix and its vision tower beyond
:data:`_QWEN_VISION`."""
_MOE_TEXT: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
_LINEAR_TEXT: dict[str, Any] = {
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_QWEN_TEXT: dict[str, dict[str, Any]] = {
    "qwen3_vl_moe": _MOE_TEXT,
    "qwen3_5": _LINEAR_TEXT,
    "qwen3_5_moe": {**_LINEAR_TEXT, **_MOE_TEXT, "shared_expert_intermediate_size": 32},
}
"""Keys the language models of the newer Qwen families need beyond :data:`TINY_TEXT`: four
experts, two a token (the MoE ones); small linear-attention heads (Qwen3.5's layer)."""
_INTERLEAVED = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
"""The Qwen families whose language model's multimodal rope is interleaved."""


def _qwen(
    family: str, t: Any, text: dict[str, Any], tokens: int, vision: dict[str, Any]
) -> TinyParts:
    prefix, tower_config = _QWEN_TOWERS[family]
    tower_config = {**_QWEN_VISION, **tower_config}
    rope = mrope(interleaved=family in _INTERLEAVED)
    config = getattr(t, f"{prefix}Config")(
        text_config={**text, **_QWEN_TEXT.get(family, {}), "rope_parameters": rope},
        vision_config={**tower_config, **vision},
        **QWEN_IDS,
    )
    patch = int(tower_config["patch_size"])
    merged = 2 * patch  # at least 4 merged tokens an image, at most ``tokens``
    processor = t.Qwen2VLImageProcessor(
        patch_size=patch, min_pixels=merged * merged * 4, max_pixels=merged * merged * tokens
    )
    return TinyParts(getattr(t, f"{prefix}ForConditionalGeneration"), config, processor)


def _llava(t: Any, text: dict[str, Any], _tokens: int, _vision: dict[str, Any]) -> TinyParts:
    config = t.LlavaConfig(
        text_config={"model_type": "llama", **text},
        vision_config=tower(
            model_type="clip_vision_model", image_size=28, patch_size=7, projection_dim=32
        ),
        image_token_id=9,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    processor = t.CLIPImageProcessor(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    return TinyParts(t.LlavaForConditionalGeneration, config, processor)


def _llava_onevision(
    t: Any, text: dict[str, Any], _tokens: int, _vision: dict[str, Any]
) -> TinyParts:
    config = t.LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **text},
        vision_config=tower(
            model_type="siglip_vision_model", image_size=28, patch_size=7, vision_use_head=False
        ),
        image_token_index=9,
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio="anyres_max_9",
    )
    processor = t.LlavaOnevisionImageProcessor(
        size={"height": 28, "width": 28}, image_grid_pinpoints=PINPOINTS
    )
    return TinyParts(t.LlavaOnevisionForConditionalGeneration, config, processor)


def _gemma3(t: Any, text: dict[str, Any], _tokens: int, _vision: dict[str, Any]) -> TinyParts:
    config = t.Gemma3Config(
        text_config={"model_type": "gemma3_text", **text, "sliding_window": 16},
        vision_config=tower(model_type="siglip_vision_model", image_size=32, patch_size=4),
        mm_tokens_per_image=16,
        image_token_id=11,
        boi_token_id=9,
        eoi_token_id=10,
    )
    processor = t.Gemma3ImageProcessor(size={"height": 32, "width": 32})
    return TinyParts(t.Gemma3ForConditionalGeneration, config, processor)


_GEMMA4_PROCESSOR: dict[str, Any] = {
    "patch_size": 4,
    "max_soft_tokens": 70,
    "pooling_kernel_size": 3,
}
"""The tiny Gemma 4's image processor: 4 px patches pooled 3x3, at most 70 tokens an image (its
processor's least budget), so an image is resized to about 100x100 px, aspect kept."""


def _gemma4(t: Any, text: dict[str, Any], _tokens: int, _vision: dict[str, Any]) -> TinyParts:
    vision = {
        **tower(num_key_value_heads=2, head_dim=16),
        "patch_size": _GEMMA4_PROCESSOR["patch_size"],
        "pooling_kernel_size": _GEMMA4_PROCESSOR["pooling_kernel_size"],
        "position_embedding_size": 256,
        "standardize": True,
        "use_clipped_linears": True,
    }
    config = t.Gemma4Config(
        text_config={
            **text,
            "vocab_size_per_layer_input": text["vocab_size"],
            "hidden_size_per_layer_input": 8,
            "sliding_window": 16,
            "layer_types": ["full_attention"],
        },
        vision_config=vision,
        audio_config=None,
        boi_token_id=9,
        eoi_token_id=10,
        image_token_id=11,
        video_token_id=12,
        audio_token_id=13,
        boa_token_id=14,
        eoa_token_index=15,
    )
    processor = t.Gemma4ImageProcessorPil(**_GEMMA4_PROCESSOR)
    return TinyParts(t.Gemma4ForConditionalGeneration, config, processor)


def _internvl(t: Any, text: dict[str, Any], _tokens: int, _vision: dict[str, Any]) -> TinyParts:
    config = t.InternVLConfig(
        text_config={"model_type": "qwen2", **text},
        vision_config=tower(image_size=[32, 32], patch_size=[8, 8]),
        image_token_id=11,
        downsample_ratio=0.5,
    )
    processor = t.GotOcr2ImageProcessor(
        size={"height": 32, "width": 32}, crop_to_patches=True, max_patches=4
    )
    return TinyParts(t.InternVLForConditionalGeneration, config, processor)


def _clip(t: Any, _text: dict[str, Any], _tokens: int, _vision: dict[str, Any]) -> TinyParts:
    config = t.CLIPVisionConfig(**tower(image_size=32, patch_size=8))
    processor = t.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    return TinyParts(t.CLIPVisionModel, config, processor)


def _siglip(t: Any, _text: dict[str, Any], _tokens: int, _vision: dict[str, Any]) -> TinyParts:
    config = t.SiglipVisionConfig(**tower(image_size=32, patch_size=8))
    processor = t.SiglipImageProcessor(size={"height": 32, "width": 32})
    return TinyParts(t.SiglipVisionModel, config, processor)


_PARTS: dict[str, Callable[[Any, dict[str, Any], int, dict[str, Any]], TinyParts]] = {
    **{family: partial(_qwen, family) for family in _QWEN_TOWERS},
    "llava": _llava,
    "llava_onevision": _llava_onevision,
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "internvl": _internvl,
    "clip": _clip,
    "siglip": _siglip,
}
"""Each family's tiny parts, given the ``transformers`` module, the language model's config,
a Qwen processor's most tokens an image and keys added to the vision config."""
