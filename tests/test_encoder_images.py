"""Image loading and decoding: every bad input is an InvalidInput a person can act on."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from trio_encode.encoder.images import Preprocess, decode_image, load_item
from trio_encode.errors import InvalidInput
from trio_encode.testing.images import image_uri, solid_image

MAX_BYTES = 1 << 20
PRE = Preprocess(image_size=16)


def encoded(size: tuple[int, int] = (20, 12), fmt: str = "PNG") -> bytes:
    return solid_image(*size, (90, 180, 165), fmt)


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` pixels (a decompression bomb's
    calling card: a few bytes on the wire, gigabytes once decoded)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


def test_png_and_jpeg_data_uris_decode_to_normalised_pixels() -> None:
    for fmt, media_type in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
        data = load_item(image_uri(encoded(fmt=fmt), media_type), max_bytes=MAX_BYTES)
        pixels = decode_image(data, PRE, max_pixels=10_000)
        assert pixels.shape == (3, 16, 16)
        assert pixels.dtype == torch.float32
        assert pixels.min() >= -1.0
        assert pixels.max() <= 1.0


def test_grayscale_and_alpha_images_become_rgb() -> None:
    for mode in ("L", "RGBA", "P"):
        buffer = io.BytesIO()
        Image.new(mode, (8, 8)).save(buffer, format="PNG")
        assert decode_image(buffer.getvalue(), PRE, max_pixels=100).shape == (3, 16, 16)


def test_exif_orientation_is_applied() -> None:
    """A phone photo stored sideways with an EXIF Orientation tag is seen upright."""
    sideways = Image.new("RGB", (16, 8), (0, 0, 0))
    sideways.paste((255, 255, 255), (0, 0, 8, 8))  # white on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    tagged, upright = io.BytesIO(), io.BytesIO()
    sideways.save(tagged, format="PNG", exif=exif)
    sideways.transpose(Image.Transpose.ROTATE_270).save(upright, format="PNG")
    seen = decode_image(tagged.getvalue(), PRE, max_pixels=10_000)
    assert torch.equal(seen, decode_image(upright.getvalue(), PRE, max_pixels=10_000))
    assert not torch.equal(seen, decode_image(_untagged(sideways), PRE, max_pixels=10_000))


def _untagged(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_center_crop_keeps_the_middle() -> None:
    image = Image.new("RGB", (48, 16), (0, 0, 0))
    image.paste((255, 255, 255), (16, 0, 32, 16))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    crop = Preprocess(image_size=16, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), center_crop=True)
    pixels = decode_image(buffer.getvalue(), crop, max_pixels=10_000)
    assert torch.allclose(pixels, torch.ones_like(pixels))


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ("data:image/png;base64,%%%not-base64%%%", "base64"),
        ("data:image/png;base64,aGVsbG8=", "not a PNG, JPEG, WebP, GIF or BMP image"),
        ("data:image/tiff;base64,SUkqAA==", "unsupported image type 'image/tiff'"),
        ("data:image/gif;base64,R0lGODlh", "not a PNG, JPEG, WebP, GIF or BMP image"),
        ("data:text/plain;base64,aGVsbG8=", "unsupported image type"),
        ("data:image/png,rawbytes", "base64-encoded"),
        ("data:image/png;base64", "malformed data URI"),
        ("data:image/png;base64,", "empty"),
        ("https://example.com/cat.png", "file paths are not accepted"),
        ("/etc/passwd", "file paths are not accepted"),
    ],
)
def test_bad_items_are_invalid_input(item: str, words: str) -> None:
    def load_and_decode() -> None:
        decode_image(load_item(item, max_bytes=MAX_BYTES), PRE, max_pixels=10_000)

    with pytest.raises(InvalidInput, match=words):
        load_and_decode()


def test_a_tiff_disguised_as_png_is_refused() -> None:
    """Only the decoders of the supported formats ever run, whatever the URI claims."""
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="TIFF")
    data = load_item(image_uri(buffer.getvalue()), max_bytes=MAX_BYTES)
    with pytest.raises(InvalidInput, match="not a PNG, JPEG, WebP, GIF or BMP image"):
        decode_image(data, PRE, max_pixels=10_000)


@pytest.mark.parametrize(
    ("fmt", "media_type"), [("WEBP", "image/webp"), ("GIF", "image/gif"), ("BMP", "image/bmp")]
)
def test_webp_gif_and_bmp_decode_like_png(fmt: str, media_type: str) -> None:
    # Flat colours survive every one of these codecs (GIF's palette, lossy WebP) unchanged.
    image = Image.new("RGB", (20, 12), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 10, 12))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    data = load_item(image_uri(buffer.getvalue(), media_type), max_bytes=MAX_BYTES)
    assert torch.equal(
        decode_image(data, PRE, max_pixels=10_000),
        decode_image(_untagged(image), PRE, max_pixels=10_000),
    )
    with pytest.raises(InvalidInput, match=r"declares 20x12 pixels; the limit is 200"):
        decode_image(data, PRE, max_pixels=200)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_an_animation_contributes_its_first_frame(fmt: str) -> None:
    frames = [Image.new("RGB", (16, 16), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    extra = {"lossless": True} if fmt == "WEBP" else {}
    frames[0].save(buffer, format=fmt, save_all=True, append_images=frames[1:], **extra)
    pixels = decode_image(buffer.getvalue(), PRE, max_pixels=10_000)
    assert torch.equal(pixels, decode_image(_untagged(frames[0]), PRE, max_pixels=10_000))


def test_too_many_bytes_is_refused_before_decoding() -> None:
    data = encoded((64, 64))
    with pytest.raises(InvalidInput, match="limit is 100 bytes"):
        load_item(image_uri(data), max_bytes=100)


def test_pixel_limit_is_checked_from_the_header() -> None:
    data = encoded((200, 100))
    with pytest.raises(InvalidInput, match=r"declares 200x100 pixels; the limit is 10000"):
        decode_image(data, PRE, max_pixels=10_000)


def test_decompression_bomb_is_invalid_input_not_an_allocation() -> None:
    # 100k x 100k x 3 bytes would be 30 GB; the file is under 100 bytes.
    bomb = png_declaring(100_000, 100_000)
    assert len(bomb) < 100
    data = load_item(image_uri(bomb), max_bytes=MAX_BYTES)
    with pytest.raises(InvalidInput, match="pixels"):
        decode_image(data, PRE, max_pixels=40_000_000)
    # Even past Pillow's own bomb limit, with our limit set higher.
    with pytest.raises(InvalidInput, match="pixels"):
        decode_image(bomb, PRE, max_pixels=10**12)


def test_truncated_image_is_invalid_input() -> None:
    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 60).convert("RGB").save(buffer, format="JPEG")
    data = buffer.getvalue()
    with pytest.raises(InvalidInput, match="corrupt or truncated"):
        decode_image(data[: len(data) // 2], PRE, max_pixels=10_000)


def test_media_dir_files_load_only_from_inside(tmp_path: Path) -> None:
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    (media / "sub" / "cat.png").write_bytes(encoded())
    (tmp_path / "secret.png").write_bytes(encoded())
    (media / "link.png").symlink_to(tmp_path / "secret.png")
    (media / "notes.txt").write_text("hello")
    (media / "dir.png").mkdir()

    assert load_item("sub/cat.png", max_bytes=MAX_BYTES, media_dir=media) == encoded()
    assert load_item(str(media / "sub" / "cat.png"), max_bytes=MAX_BYTES, media_dir=media)
    # A path outside (which exists) and a missing one get the same answer: a client cannot
    # probe which files exist on the host.
    messages = set()
    for unusable in (
        "../secret.png",
        str(tmp_path / "secret.png"),
        "link.png",
        "sub/../../secret.png",
        "missing.png",
        "../missing.png",
        "dir.png",
    ):
        with pytest.raises(InvalidInput, match="no readable image file") as refused:
            load_item(unusable, max_bytes=MAX_BYTES, media_dir=media)
        messages.add(refused.value.message.replace(repr(unusable), "ITEM"))
    assert len(messages) == 1, messages
    with pytest.raises(InvalidInput, match=r"must end in one of \.bmp, \.gif, \.jpeg"):
        load_item("notes.txt", max_bytes=MAX_BYTES, media_dir=media)
    with pytest.raises(InvalidInput, match="limit is 10 bytes"):
        load_item("sub/cat.png", max_bytes=10, media_dir=media)
