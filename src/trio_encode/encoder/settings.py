"""Every knob of the encoder in one frozen value, checked once when it is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DType = Literal["float32", "bfloat16"]

MiB = 1 << 20


@dataclass(frozen=True)
class EncoderSettings:
    """Model shape, batching, cache and input limits.

    The defaults give a small built-in ViT (196 tokens of 2048 floats, 1.6 MB per image) that
    needs no download, so a fresh checkout can serve and be tested.
    """

    # The built-in model (ignored when ``hf_model_dir`` is set).
    image_size: int = 224
    patch_size: int = 16
    width: int = 384
    depth: int = 6
    heads: int = 6
    mlp_ratio: float = 4.0
    hidden_size: int = 2048
    """The language model's hidden size: the projector's output width."""
    dtype: DType = "float32"
    seed: int = 0
    """Weights are drawn from this seed unless ``weights`` is given."""
    weights: Path | None = None
    """A safetensors file saved by :func:`trio_encode.encoder.model.save_weights`."""

    # A real vision tower instead of the built-in one.
    hf_model_dir: Path | None = None
    """A local CLIP or SigLIP vision model in Hugging Face format (needs ``transformers``)."""
    hf_feature_layer: int = -1
    """Which hidden layer to return (-1 the last; LLaVA uses -2)."""

    # Batching.
    max_batch_size: int = 8
    """Images per forward pass."""
    max_batch_wait: float = 0.005
    """Seconds the oldest queued image waits for others to fill its batch."""
    queue_size: int = 64
    """Images waiting for a forward pass (or being decoded for one); beyond it: Overloaded."""
    torch_threads: int | None = None
    """``torch.set_num_threads`` at load; ``None`` leaves torch's default."""
    warmup: bool = True
    """Run one forward before reporting ready, so the first request pays no start-up cost."""

    # Cache and arena.
    cache_bytes: int = 256 * MiB
    """Bytes of embeddings kept for repeated images; 0 disables the cache. With an arena,
    the cache lives in it and this bounds the bytes it may keep."""
    arena_bytes: int = 512 * MiB
    """Size of the registered arena that embeddings are written into, registered once for the
    process's life so sends register nothing; 0 turns it off (every request registers its
    own embedding). Pages are touched only as segments are written (over RDMA, registration
    pins all of it)."""

    # Input limits.
    max_image_bytes: int = 20 * MiB
    """Encoded bytes of one image."""
    max_image_pixels: int = 40_000_000
    """Width x height of one image, checked before decoding (decompression bombs)."""
    media_dir: Path | None = None
    """When set, ``mm_items`` may also name files inside this directory (and nowhere else)."""

    def __post_init__(self) -> None:
        positive = {
            "image_size": self.image_size,
            "patch_size": self.patch_size,
            "width": self.width,
            "depth": self.depth,
            "heads": self.heads,
            "hidden_size": self.hidden_size,
            "max_batch_size": self.max_batch_size,
            "queue_size": self.queue_size,
            "max_image_bytes": self.max_image_bytes,
            "max_image_pixels": self.max_image_pixels,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}"
            )
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be positive, got {self.mlp_ratio}")
        if self.max_batch_wait < 0:
            raise ValueError(f"max_batch_wait must be >= 0, got {self.max_batch_wait}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")
        if self.arena_bytes < 0:
            raise ValueError(f"arena_bytes must be >= 0, got {self.arena_bytes}")
        if self.torch_threads is not None and self.torch_threads <= 0:
            raise ValueError(f"torch_threads must be positive, got {self.torch_threads}")
