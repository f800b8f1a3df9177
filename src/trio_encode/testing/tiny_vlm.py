"""A small Qwen2.5-VL-shaped model with random weights, built from its config (nothing is
downloaded) and saved with its image processor: what ``trio-encode bench --vlm`` and the GPU
checks serve. Its embeddings mean nothing; its shapes, dynamic resolution and packing of
images of different sizes into one forward are Qwen2.5-VL's own (transformers' classes).
Needs the ``hf`` extra."""

from __future__ import annotations

from pathlib import Path

import torch

VLM_IMAGE_SIZES: tuple[tuple[int, int], ...] = ((224, 224), (336, 168), (140, 280), (448, 336))
"""The bench's mix of image sizes (width, height): square, wide, tall, large; with the
processor below they give 64, 72, 50 and 192 image tokens."""


def save_tiny_qwen2_5_vl(path: Path, *, seed: int = 0) -> Path:
    """Write the model (a 4-layer vision tower of width 256 and its merger to a hidden size of
    512; a one-layer language model, never loaded by the server) and its processor into
    ``path``; returns ``path``."""
    import transformers

    torch.manual_seed(seed)
    text = {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
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
