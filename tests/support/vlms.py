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

from trio_encode.testing.tiny_vlm import TINY_TEXT, tiny_parts

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


def _gemma4_gather(model: Any, inputs: Any) -> list[torch.Tensor]:
    out = model.get_image_features(
        pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"]
    )
    return list(out.pooler_output)


def _plain_gather(model: Any, inputs: Any) -> list[torch.Tensor]:
    out = model.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
    return list(out)


def _onevision_gather(model: Any, inputs: Any) -> list[torch.Tensor]:
    out = model.get_image_features(
        pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"]
    ).pooler_output
    return [out] if isinstance(out, torch.Tensor) else list(out)


QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
_TESTS_PARTS: dict[str, Any] = {
    "text": TINY_TEXT,  # no begin and end token ids: transformers' defaults
    "max_image_tokens": 48,  # small images: 4 to 48 merged tokens each
}
"""How the tests' tiny models differ from ``trio-encode make-tiny-model``'s (and, for
Qwen2.5-VL, from the bench's): made by :func:`tiny_parts` with these."""
_TESTS_VISION: dict[str, dict[str, Any]] = {"qwen2_vl": {"intermediate_size": 48}}
"""Keys in the tests' vision configs only (unused by the tower, kept so the models stay as
they were)."""

_GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
_GEMMA4_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
_INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>"}
_TALK: dict[str, tuple[dict[str, str], Any, Callable[[Any, Any], list[torch.Tensor]], str]] = {
    "qwen2_vl": (QWEN_TOKENS, T.Qwen2VLProcessor, _qwen_gather, "<|image_pad|>"),
    "qwen2_5_vl": (QWEN_TOKENS, T.Qwen2_5_VLProcessor, _qwen_gather, "<|image_pad|>"),
    "qwen3_vl": (QWEN_TOKENS, T.Qwen3VLProcessor, _qwen3_gather, "<|image_pad|>"),
    "qwen3_vl_moe": (QWEN_TOKENS, T.Qwen3VLProcessor, _qwen3_gather, "<|image_pad|>"),
    "qwen3_5": (QWEN_TOKENS, T.Qwen3VLProcessor, _qwen_gather, "<|image_pad|>"),
    "qwen3_5_moe": (QWEN_TOKENS, T.Qwen3VLProcessor, _qwen_gather, "<|image_pad|>"),
    "llava": ({"image_token": "<image>"}, T.LlavaProcessor, _plain_gather, "<image>"),
    "llava_onevision": (
        {"image_token": "<image>"},
        T.LlavaOnevisionProcessor,
        _onevision_gather,
        "<image>",
    ),
    "gemma3": (
        {**_GEMMA3_TOKENS, "image_token": "<image_soft_token>"},
        T.Gemma3Processor,
        _plain_gather,
        "<start_of_image>",
    ),
    "gemma4": (_GEMMA4_TOKENS, T.Gemma4Processor, _gemma4_gather, "<|image|>"),
    "internvl": (
        {**_INTERNVL_TOKENS, "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"},
        T.InternVLProcessor,
        _plain_gather,
        "<IMG_CONTEXT>",
    ),
}
"""What only the tests need of each family: its tokenizer's image tokens, processor class,
gather function and a prompt's image placeholder."""


def build(family: str, path: Path, seed: int = 0) -> TinyVLM:
    """The tiny model of ``family``, saved in ``path`` with its image processor, the language
    model's weights in shards of their own (``max_shard_size``) as well as shared ones."""
    if family not in _TALK:
        raise ValueError(family)
    torch.manual_seed(seed)
    parts = tiny_parts(family, T, vision=_TESTS_VISION.get(family), **_TESTS_PARTS)
    tokens, processor_class, gather, text = _TALK[family]
    model = parts.model_class(parts.config).eval()
    model.save_pretrained(str(path), max_shard_size="40KB")
    image_processor = parts.image_processor
    image_processor.save_pretrained(str(path))
    tokenizer = tiny_tokenizer(tokens)
    processor = _processor(processor_class, family, image_processor, tokenizer)
    token_id = int(tokenizer.convert_tokens_to_ids(_expanded_token(family, tokens)))
    return TinyVLM(
        family, path, parts.model_class, image_processor, processor, text, token_id, gather
    )


def _expanded_token(family: str, tokens: dict[str, str]) -> str:
    if family == "internvl":
        return tokens["context_image_token"]
    return tokens["image_token"]


def _without_video(processor_class: Any) -> Any:
    """The processor class taking no video processor: transformers' video processors need
    torchvision (not installed here), and only the image half is used (nor, for Gemma 4, an
    audio feature extractor)."""

    class ImagesOnly(processor_class):  # type: ignore[misc,valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name in ("video_processor", "feature_extractor"):
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly


def _processor(processor_class: Any, family: str, image_processor: Any, tokenizer: Any) -> Any:
    if family.startswith("qwen"):
        return _without_video(processor_class)(image_processor, tokenizer, None)
    if family == "gemma4":
        return _without_video(processor_class)(None, image_processor, tokenizer, None)
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


FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "llava",
    "llava_onevision",
    "gemma3",
    "gemma4",
    "internvl",
)
