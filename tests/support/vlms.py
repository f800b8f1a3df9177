"""Tiny random-weight VLMs of each served family, built from their configs and saved to a
directory with their image processor (nothing downloaded), and what transformers itself says
about them: the full model's ``get_image_features`` and the processor's prompt token counts."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers as T
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

PHOTO_SIZES = [(90, 60), (40, 130), (200, 200), (57, 57)]
"""Landscape, tall portrait, large square, odd square: different token counts per image."""


def photo(seed: int, size: tuple[int, int]) -> bytes:
    """A PNG of ``size`` random pixels, the same for the same ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    array = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


PHOTOS = [photo(seed, size) for seed, size in enumerate(PHOTO_SIZES)]
"""One photo of each of :data:`PHOTO_SIZES`."""

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "head_dim": 16,
}
"""A one-layer language model: the part that is never loaded."""


def tiny_tokenizer(specials: dict[str, str]) -> Any:
    """A word-level tokenizer that knows the model's image tokens as single tokens."""
    words = ["<unk>", "<pad>", "<bos>", "<eos>", "describe", "this", "image", "\n", "Frame1:"]
    vocab = {word: i for i, word in enumerate([*words, *dict.fromkeys(specials.values())])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        extra_special_tokens=specials,
    )


@dataclass
class TinyVLM:
    """A saved tiny VLM and transformers' own answers about it."""

    family: str
    path: Path
    model_class: Any
    image_processor: Any
    processor: Any
    image_text: str
    """The placeholder a prompt holds for one image (the processor expands it)."""
    image_token_id: int
    """The token the expanded prompt holds once per image embedding row."""
    gather: Callable[[Any, Any], list[torch.Tensor]]
    """Full model and the processor's output for a list of images -> per-image features."""

    def reference(self, images: list[Image.Image], dtype: torch.dtype) -> torch.Tensor:
        """The request's embedding as transformers computes it: the full model loaded with
        ``from_pretrained``, its ``get_image_features`` on the processor's output."""
        model = self.model_class.from_pretrained(str(self.path), dtype=dtype).eval()
        inputs = self.image_processor(images=images, return_tensors="pt")
        with torch.inference_mode():
            features = self.gather(model, inputs)
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in features]).to(dtype)

    def prompt_tokens(self, image: Image.Image) -> int:
        """Image tokens the model's processor puts in a prompt for ``image``."""
        out = self.processor(text=f"describe {self.image_text} this", images=[image])
        return sum(int(token == self.image_token_id) for token in out["input_ids"][0])


def _qwen_gather(model: Any, inputs: Any) -> list[torch.Tensor]:
    out = model.get_image_features(
        pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
    )
    return list(out.pooler_output)


def _qwen3_gather(model: Any, inputs: Any) -> list[torch.Tensor]:
    out = model.get_image_features(
        pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
    )
    layers = [list(layer) for layer in out.deepstack_features]
    return [
        torch.cat([main, *(layer[i] for layer in layers)], dim=-1)
        for i, main in enumerate(out.pooler_output)
    ]


def _plain_gather(model: Any, inputs: Any) -> list[torch.Tensor]:
    out = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    return list(out)


PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
"""LLaVA-OneVision's anyres resolutions for a 28 px tile: up to 3 tiles beside the base one."""


def _onevision_gather(model: Any, inputs: Any) -> list[torch.Tensor]:
    out = model.get_image_features(
        pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]
    ).pooler_output
    return [out] if isinstance(out, torch.Tensor) else list(out)


def _qwen_vision(**extra: Any) -> dict[str, Any]:
    return {
        "depth": 2,
        "hidden_size": 32,
        "embed_dim": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **extra,
    }


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


QWEN_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 48}
"""Small images: 4 to 48 merged tokens each."""
QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
QWEN_IDS = {"image_token_id": 9, "video_token_id": 10}


def build(family: str, path: Path, seed: int = 0) -> TinyVLM:
    """The tiny model of ``family``, saved in ``path`` with its image processor, the language
    model's weights in shards of their own (``max_shard_size``) as well as shared ones."""
    torch.manual_seed(seed)
    if family == "qwen2_vl":
        config = T.Qwen2VLConfig(
            text_config={**TEXT, "rope_parameters": _mrope()},
            vision_config=_qwen_vision(embed_dim=32, mlp_ratio=2, hidden_size=64),
            **QWEN_IDS,
        )
        image_processor = T.Qwen2VLImageProcessor(**QWEN_PIXELS)
        tokens, model_class = QWEN_TOKENS, T.Qwen2VLForConditionalGeneration
        processor_class, gather, text = T.Qwen2VLProcessor, _qwen_gather, "<|image_pad|>"
    elif family == "qwen2_5_vl":
        config = T.Qwen2_5_VLConfig(
            text_config={**TEXT, "rope_parameters": _mrope()},
            vision_config=_qwen_vision(
                out_hidden_size=64, window_size=56, fullatt_block_indexes=[1]
            ),
            **QWEN_IDS,
        )
        image_processor = T.Qwen2VLImageProcessor(**QWEN_PIXELS)
        tokens, model_class = QWEN_TOKENS, T.Qwen2_5_VLForConditionalGeneration
        processor_class, gather, text = T.Qwen2_5_VLProcessor, _qwen_gather, "<|image_pad|>"
    elif family == "qwen3_vl":
        config = T.Qwen3VLConfig(
            text_config={**TEXT, "rope_parameters": _mrope(interleaved=True)},
            vision_config={
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
            },
            **QWEN_IDS,
        )
        image_processor = T.Qwen2VLImageProcessor(
            patch_size=16, min_pixels=64 * 64, max_pixels=32 * 32 * 48
        )
        tokens, model_class = QWEN_TOKENS, T.Qwen3VLForConditionalGeneration
        processor_class, gather, text = T.Qwen3VLProcessor, _qwen3_gather, "<|image_pad|>"
    elif family == "llava":
        config = T.LlavaConfig(
            text_config={"model_type": "llama", **TEXT},
            vision_config=_tower(
                model_type="clip_vision_model", image_size=28, patch_size=7, projection_dim=32
            ),
            image_token_id=9,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        )
        image_processor = T.CLIPImageProcessor(
            size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
        )
        tokens, model_class = {"image_token": "<image>"}, T.LlavaForConditionalGeneration
        processor_class, gather, text = T.LlavaProcessor, _plain_gather, "<image>"
    elif family == "llava_onevision":
        config = T.LlavaOnevisionConfig(
            text_config={"model_type": "qwen2", **TEXT},
            vision_config=_tower(
                model_type="siglip_vision_model", image_size=28, patch_size=7, vision_use_head=False
            ),
            image_token_index=9,
            image_grid_pinpoints=PINPOINTS,
            vision_aspect_ratio="anyres_max_9",
        )
        image_processor = T.LlavaOnevisionImageProcessor(
            size={"height": 28, "width": 28}, image_grid_pinpoints=PINPOINTS
        )
        tokens, model_class = {"image_token": "<image>"}, T.LlavaOnevisionForConditionalGeneration
        processor_class, gather, text = T.LlavaOnevisionProcessor, _onevision_gather, "<image>"
    elif family == "gemma3":
        config = T.Gemma3Config(
            text_config={"model_type": "gemma3_text", **TEXT, "sliding_window": 16},
            vision_config=_tower(model_type="siglip_vision_model", image_size=32, patch_size=4),
            mm_tokens_per_image=16,
            image_token_id=11,
            boi_token_id=9,
            eoi_token_id=10,
        )
        image_processor = T.Gemma3ImageProcessor(size={"height": 32, "width": 32})
        tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
        tokens |= {"image_token": "<image_soft_token>"}
        model_class = T.Gemma3ForConditionalGeneration
        processor_class, gather, text = T.Gemma3Processor, _plain_gather, "<start_of_image>"
    elif family == "internvl":
        config = T.InternVLConfig(
            text_config={"model_type": "qwen2", **TEXT},
            vision_config=_tower(image_size=[32, 32], patch_size=[8, 8]),
            image_token_id=11,
            downsample_ratio=0.5,
        )
        image_processor = T.GotOcr2ImageProcessor(
            size={"height": 32, "width": 32}, crop_to_patches=True, max_patches=4
        )
        tokens = {"start_image_token": "<img>", "end_image_token": "</img>"}
        tokens |= {"context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
        model_class = T.InternVLForConditionalGeneration
        processor_class, gather, text = T.InternVLProcessor, _plain_gather, "<IMG_CONTEXT>"
    else:
        raise ValueError(family)
    model = model_class(config).eval()
    model.save_pretrained(str(path), max_shard_size="40KB")
    image_processor.save_pretrained(str(path))
    tokenizer = tiny_tokenizer(tokens)
    processor = _processor(processor_class, family, image_processor, tokenizer)
    token_id = int(tokenizer.convert_tokens_to_ids(_expanded_token(family, tokens)))
    return TinyVLM(family, path, model_class, image_processor, processor, text, token_id, gather)


def _expanded_token(family: str, tokens: dict[str, str]) -> str:
    if family == "internvl":
        return tokens["context_image_token"]
    return tokens["image_token"]


def _without_video(processor_class: Any) -> Any:
    """The processor class taking no video processor: transformers' video processors need
    torchvision (not installed here), and only the image half is used."""

    class ImagesOnly(processor_class):  # type: ignore[misc,valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly


def _processor(processor_class: Any, family: str, image_processor: Any, tokenizer: Any) -> Any:
    if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        return _without_video(processor_class)(image_processor, tokenizer, None)
    if family == "llava":
        return processor_class(
            image_processor,
            tokenizer,
            patch_size=7,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # CLIP's CLS token, as LLaVA 1.5 ships it
        )
    if family == "gemma3":
        return processor_class(image_processor, tokenizer, image_seq_length=16)
    if family == "llava_onevision":
        return _without_video(processor_class)(
            image_processor,
            tokenizer,
            None,
            num_image_tokens=16,
            vision_feature_select_strategy="full",
            vision_aspect_ratio="anyres_max_9",
        )
    if family == "internvl":
        return _without_video(processor_class)(image_processor, tokenizer, None, image_seq_length=4)
    raise ValueError(family)


def _mrope(*, interleaved: bool = False) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "mrope_section": [2, 2, 4]}
    rope["rope_theta"] = 10000.0
    if interleaved:
        rope["mrope_interleaved"] = True
    return rope


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_onevision", "gemma3", "internvl")
