"""Test images: seeded, so every run sends the same bytes, and distinct per seed.

The kinds a test or a tool needs: noise (every image different, nothing to compress, the
model's output differs for each), a solid colour (tiny, the same pixels everywhere), photo-like
JPEGs (the size and decoding cost of real traffic), and a data URI to carry any of them in
``mm_items``.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def noise_png(seed: int, width: int = 32, height: int | None = None) -> bytes:
    """A ``width`` x ``height`` (square by default) PNG of random pixels, different per seed."""
    shape = (width if height is None else height, width, 3)
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return _encoded(Image.fromarray(pixels), "PNG")


def noise_pngs(count: int, *, side: int = 16, seed: int = 0) -> list[bytes]:
    """``count`` different ``side`` x ``side`` noise PNGs."""
    return [noise_png(seed * 1_000_003 + n, side) for n in range(count)]


def solid_image(
    width: int, height: int, colour: tuple[int, int, int] = (10, 20, 30), fmt: str = "PNG"
) -> bytes:
    """One colour, in any format Pillow writes (``PNG``, ``JPEG``, ``WEBP``...)."""
    return _encoded(Image.new("RGB", (width, height), colour), fmt)


def natural_jpegs(count: int, side: int, seed: int = 0, quality: int = 92) -> list[bytes]:
    """``count`` different ``side`` x ``side`` JPEGs that compress like photos.

    Random noise does not compress (a 224x224 noise PNG is ~150 kB) and costs the server
    more to receive and decode than a photo (~10-30 kB at that size). These are a smooth
    two-colour gradient, a few blurred ellipses and rectangles, and mild Gaussian noise
    (sigma 6), as JPEG at quality 92.
    """
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0.0, 1.0, side, dtype=np.float32)
    images = []
    for _ in range(count):
        start, end = rng.uniform(0, 255, (2, 3)).astype(np.float32)
        angle = rng.uniform(0, 2 * np.pi)
        t = np.clip(
            0.5 + (np.cos(angle) * (ramp[None, :] - 0.5) + np.sin(angle) * (ramp[:, None] - 0.5)),
            0.0,
            1.0,
        )
        base = start + (end - start) * t[..., None]
        picture = Image.fromarray(base.astype(np.uint8))
        draw = ImageDraw.Draw(picture)
        for _ in range(int(rng.integers(3, 7))):
            x0, y0 = rng.uniform(0, side * 0.8, 2)
            w, h = rng.uniform(side * 0.1, side * 0.5, 2)
            fill = tuple(int(c) for c in rng.integers(0, 256, 3))
            box = (x0, y0, min(side, x0 + w), min(side, y0 + h))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
        picture = picture.filter(ImageFilter.GaussianBlur(1.5))
        noisy = np.asarray(picture, dtype=np.float32) + rng.normal(0, 6, (side, side, 3))
        clipped = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
        images.append(_encoded(clipped, "JPEG", quality=quality))
    return images


def image_uri(payload: bytes | str, media_type: str = "image/png") -> str:
    """A data URI carrying ``payload``, as ``mm_items`` takes it."""
    data = payload.encode() if isinstance(payload, str) else payload
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def noise_uri(seed: int, width: int = 32, height: int | None = None) -> str:
    """:func:`noise_png` as a data URI."""
    return image_uri(noise_png(seed, width, height))


def _encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def mixed_jpegs(
    count: int, sizes: Sequence[tuple[int, int]], seed: int = 0, quality: int = 92
) -> list[bytes]:
    """``count`` photo-like JPEGs (:func:`natural_jpegs`) cycling through ``sizes`` (width,
    height): a mix of sizes and aspect ratios, for models whose token count follows the size."""
    images = []
    for index in range(count):
        width, height = sizes[index % len(sizes)]
        square = natural_jpegs(1, max(width, height), seed * 100_003 + index, quality)[0]
        with Image.open(io.BytesIO(square)) as picture:
            cropped = picture.convert("RGB").crop((0, 0, width, height))
        images.append(_encoded(cropped, "JPEG", quality=quality))
    return images
