"""The built-in model: deterministic from its seed, batch-invariant, saved and loaded exactly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from support.models import fixed
from trio_encode.embedding import TORCH_DTYPES
from trio_encode.encoder.loader import load_backend
from trio_encode.encoder.model import (
    BuiltinBackend,
    build_model,
    compile_forward,
    save_weights,
)
from trio_encode.encoder.settings import EncoderSettings

TINY = EncoderSettings(
    image_size=32, patch_size=8, width=32, depth=2, heads=2, hidden_size=64, warmup=False
)


def pixels(batch: int, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 32, 32, generator=generator)


def test_output_shape_dtype_and_default_sizes() -> None:
    backend = BuiltinBackend(TINY)
    out = backend.forward(pixels(3))
    assert out.shape == (3, 16, 64)
    assert out.dtype == torch.float32
    assert out.is_contiguous()
    assert backend.tokens_per_image == 16
    default = EncoderSettings()
    assert (default.image_size // default.patch_size) ** 2 * default.hidden_size * 4 > 1 << 20


def test_weights_come_from_the_seed_without_touching_global_rng() -> None:
    state = torch.random.get_rng_state()
    a = BuiltinBackend(TINY).forward(pixels(2))
    assert torch.equal(state, torch.random.get_rng_state())
    b = BuiltinBackend(TINY).forward(pixels(2))
    c = BuiltinBackend(replace(TINY, seed=1)).forward(pixels(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_an_image_gives_the_same_bytes_in_any_batch_position_and_size() -> None:
    backend = BuiltinBackend(TINY)
    batch = pixels(5)
    full = backend.forward(batch)
    for size in (1, 2, 3, 5):
        out = backend.forward(batch[:size])
        for i in range(size):
            assert torch.equal(out[i], full[i])
    reversed_out = backend.forward(batch.flip(0))
    for i in range(5):
        assert torch.equal(reversed_out[4 - i], full[i])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_scripted_forward_matches_eager_bit_for_bit_at_every_batch_size(dtype: str) -> None:
    # TorchScript's executor re-profiles and re-specialises over the first calls and on new
    # shapes: every call, in any order of sizes, must still give eager's exact bytes.
    settings = replace(TINY, dtype=dtype)
    backend = BuiltinBackend(settings)
    assert isinstance(backend._run, torch.jit.ScriptModule)
    eager = build_model(settings)
    batch = pixels(6).to(TORCH_DTYPES[dtype])
    with torch.inference_mode():
        expected = eager(batch)
    for size in (6, 1, 6, 3, 6, 2, 5, 1, 6, 4, 6, 6):
        assert torch.equal(backend.forward(batch[:size].float()), expected[:size])


def test_an_unscriptable_model_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(model: object) -> object:
        raise RuntimeError("not scriptable")

    monkeypatch.setattr(torch.jit, "script", refuse)
    model = build_model(TINY)
    assert compile_forward(model) is model
    backend = BuiltinBackend(TINY)
    assert backend._run is backend.module
    assert torch.equal(backend.forward(pixels(2)), BuiltinBackend(TINY).forward(pixels(2)))


def test_safetensors_round_trip_gives_identical_outputs(tmp_path: Path) -> None:
    original = BuiltinBackend(replace(TINY, seed=3))
    path = tmp_path / "encoder.safetensors"
    save_weights(original.module, path)
    loaded = fixed(load_backend(replace(TINY, seed=99, weights=path)))
    assert torch.equal(original.forward(pixels(2)), loaded.forward(pixels(2)))
    assert "sha256=" in loaded.model_id
    assert loaded.model_id != original.model_id


def test_weights_for_another_shape_are_refused_clearly(tmp_path: Path) -> None:
    path = tmp_path / "encoder.safetensors"
    save_weights(BuiltinBackend(TINY).module, path)
    with pytest.raises(ValueError, match="do not fit the configured model"):
        BuiltinBackend(replace(TINY, width=64, weights=path))
    with pytest.raises(ValueError, match="cannot read encoder weights"):
        BuiltinBackend(replace(TINY, weights=tmp_path / "missing.safetensors"))


def test_bfloat16_model_is_close_to_float32() -> None:
    f32 = BuiltinBackend(TINY).forward(pixels(2))
    backend = BuiltinBackend(replace(TINY, dtype="bfloat16"))
    bf16 = backend.forward(pixels(2))
    assert bf16.dtype == torch.bfloat16
    assert bf16.shape == f32.shape
    assert torch.isfinite(bf16.float()).all()
    assert torch.allclose(bf16.float(), f32, atol=0.05, rtol=0.05)
    assert torch.equal(backend.forward(pixels(2)), bf16)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"image_size": 30}, "not a multiple of patch_size"),
        ({"width": 33}, "not divisible by heads"),
        (
            {"dtype": "float64"},
            r"dtype\s+Input should be 'float32', 'bfloat16', 'float16' or 'auto'",
        ),
        ({"max_batch_size": 0}, r"max_batch_size\s+Input should be greater than 0"),
        ({"cache_bytes": -1}, r"cache_bytes\s+Input should be greater than or equal to 0"),
    ],
)
def test_settings_are_checked(change: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        replace(TINY, **change)  # type: ignore[arg-type]


def test_random_weights_are_announced_at_load(caplog: pytest.LogCaptureFixture) -> None:
    BuiltinBackend(TINY)
    assert "random weights (seed 0): its embeddings are meaningless" in caplog.text
