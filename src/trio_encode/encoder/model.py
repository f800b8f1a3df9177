"""The built-in vision encoder: a small ViT and an MLP projector, needing no download.

It has the shape of a real VLM's encoder (patch tokens projected to the language model's
hidden size), so its embeddings are MB-scale like theirs and exercise the same memory paths.
Weights come from a seed (a private generator: the process's global RNG is never touched) or
from a safetensors file.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from trio_encode.embedding import TORCH_DTYPES
from trio_encode.encoder.fingerprint import model_fingerprint, weights_digest
from trio_encode.encoder.images import Preprocess
from trio_encode.encoder.settings import EncoderSettings

log = logging.getLogger(__name__)

_INIT_STD = 0.02


class _Block(nn.Module):
    """Pre-norm transformer block: self-attention then MLP, each with a residual."""

    def __init__(self, width: int, heads: int, mlp_width: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp_width)
        self.fc2 = nn.Linear(mlp_width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


class VisionEncoder(nn.Module):
    """Pixels ``(B, 3, S, S)`` -> embeddings ``(B, (S/P)^2, hidden_size)``.

    Patches are embedded with a matrix product rather than a strided convolution, so every
    layer is row-wise or a GEMM over ``B * tokens`` rows: an image's output does not depend
    on which batch it ran in.
    """

    def __init__(self, settings: EncoderSettings) -> None:
        super().__init__()
        self.patch_size = settings.patch_size
        self.tokens = (settings.image_size // settings.patch_size) ** 2
        width = settings.width
        self.patch_embed = nn.Linear(3 * settings.patch_size**2, width)
        self.pos_embed = nn.Parameter(torch.empty(1, self.tokens, width))
        mlp_width = round(width * settings.mlp_ratio)
        self.blocks = nn.ModuleList(
            _Block(width, settings.heads, mlp_width) for _ in range(settings.depth)
        )
        self.norm = nn.LayerNorm(width)
        self.projector = nn.Sequential(
            nn.Linear(width, settings.hidden_size),
            nn.GELU(),
            nn.Linear(settings.hidden_size, settings.hidden_size),
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = pixels.shape
        p = self.patch_size
        patches = (
            pixels.reshape(batch, channels, height // p, p, width // p, p)
            .permute(0, 2, 4, 1, 3, 5)
            .reshape(batch, self.tokens, channels * p * p)
        )
        x = self.patch_embed(patches) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.projector(self.norm(x))
        return out


def build_model(settings: EncoderSettings) -> VisionEncoder:
    """The model in eval mode and the configured dtype, weights from the file or the seed."""
    with torch.device("meta"):
        model = VisionEncoder(settings)
    model = model.to_empty(device="cpu")
    if settings.weights is not None:
        _load_weights(model, settings.weights)
    else:
        _init_weights(model, settings.seed)
    return model.to(TORCH_DTYPES[settings.model_dtype]).eval().requires_grad_(False)


def _init_weights(model: VisionEncoder, seed: int) -> None:
    # Drawn in float32 in a fixed order, so float32 and bfloat16 models share their weights.
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("bias"):
                param.zero_()
            elif ".norm" in name or name.startswith("norm"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, _INIT_STD, generator=generator)


def _load_weights(model: VisionEncoder, path: Path) -> None:
    try:
        state = load_file(str(path), device="cpu")
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read encoder weights {path}: {exc}") from exc
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"weights in {path} do not fit the configured model: {exc}") from exc


def save_weights(model: VisionEncoder, path: Path) -> None:
    """Write the weights as safetensors, loadable with ``EncoderSettings(weights=path)``."""
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(path))


def compile_forward(model: VisionEncoder) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model as TorchScript, or the eager module if it cannot be scripted.

    A scripted module runs its whole graph in C++ with the GIL released, so the forward no
    longer waits for the GIL between kernels while the event loop holds it. ``script`` (not
    ``trace``) keeps the batch size dynamic; it adds no fusion on CPU, so outputs stay
    bit-identical to eager (tests/test_encoder_model.py checks it).
    """
    try:
        with warnings.catch_warnings():
            # torch 2.x deprecates TorchScript in favour of torch.compile, which needs a
            # compiler at load time and still runs its glue under the GIL.
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted: Callable[[torch.Tensor], torch.Tensor] = torch.jit.script(model)
    except Exception as exc:  # any scripting failure falls back to eager
        log.warning("cannot script the built-in encoder, running it eagerly: %s", exc)
        return model
    return scripted


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class BuiltinBackend:
    """The built-in model behind the forward interface the batcher uses."""

    def __init__(self, settings: EncoderSettings) -> None:
        if settings.weights is None:
            log.warning(
                "the built-in ViT has random weights (seed %d): its embeddings are meaningless "
                "to any language model; serve a real one with --model DIR",
                settings.seed,
            )
        self.module = build_model(settings)
        self._run = compile_forward(self.module)
        self.dtype = TORCH_DTYPES[settings.model_dtype]
        self.tokens_per_image = self.module.tokens
        self.hidden_size = settings.hidden_size
        self.preprocess = Preprocess(image_size=settings.image_size)
        origin = (
            f"sha256={_file_digest(settings.weights)}"
            if settings.weights is not None
            else f"seed={settings.seed}"
        )
        self.model_id = (
            f"builtin-vit(image={settings.image_size},patch={settings.patch_size},"
            f"width={settings.width},depth={settings.depth},heads={settings.heads},"
            f"mlp={settings.mlp_ratio},hidden={settings.hidden_size},{settings.model_dtype},{origin})"
        )
        config = {
            "image_size": settings.image_size,
            "patch_size": settings.patch_size,
            "width": settings.width,
            "depth": settings.depth,
            "heads": settings.heads,
            "mlp_ratio": settings.mlp_ratio,
            "hidden_size": settings.hidden_size,
            "preprocess": asdict(self.preprocess),
        }
        self.fingerprint = model_fingerprint(
            "builtin-vit", config, settings.model_dtype, weights_digest(self.module)
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised float32 pixels ``(B, 3, S, S)`` -> contiguous ``(B, tokens, hidden)``."""
        with torch.inference_mode():
            out: torch.Tensor = self._run(pixels.to(self.dtype))
            return out.contiguous()
