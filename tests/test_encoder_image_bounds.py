"""A decode's cost is bounded before it is paid: each hostile file (thousands of JPEG scans, a
million PNG chunks, thousands of frames) is crafted here and refused from its structure in
well under a second, while ordinary images decode to the same pixels as Pillow alone gives."""

from __future__ import annotations

import io
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageFile, ImageOps, PngImagePlugin

from trio_encode.encoder import images
from trio_encode.encoder.image_scan import (
    GIF_BLOCKS_FLOOR,
    GIF_BYTES_PER_BLOCK,
    MAX_ANIMATION_PIXELS,
    MAX_CHUNKS,
    MAX_FRAMES,
    MAX_JPEG_SCAN_PIXELS,
    MAX_JPEG_SCANS,
    MAX_JPEG_STRAY_BYTES,
    PNG_DATA_BYTES_PER_CHUNK,
    PNG_DATA_CHUNKS_FLOOR,
    ImageTooComplex,
)
from trio_encode.encoder.images import Preprocess, decode_image, image_pixels, open_image
from trio_encode.errors import InvalidInput

PRE = Preprocess(image_size=16)
MAX_PIXELS = 40_000_000  # the server's default
QUICK = 0.5  # seconds: a refusal costs the walk, never a decode


# -- crafting ------------------------------------------------------------------------------


def saved(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise(width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    """Random pixels: every decoding mistake shows (a flat image would hide most)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def colours(count: int, side: int = 16) -> list[Image.Image]:
    return [
        Image.new("RGB", (side, side), (255 * (n % 2), 80, 255 * (1 - n % 2))) for n in range(count)
    ]


def png_chunk(kind: bytes, body: bytes = b"") -> bytes:
    crc = zlib.crc32(kind + body) & 0xFFFFFFFF
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def png_chunks(data: bytes) -> list[tuple[bytes, int, int]]:
    """(type, start, end) of each chunk of a PNG."""
    found, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack_from(">I", data, pos)
        found.append((data[pos + 4 : pos + 8], pos, pos + 12 + length))
        pos += 12 + length
    return found


def before_first(data: bytes, kind: bytes, extra: bytes) -> bytes:
    """``extra`` inserted in a PNG just before its first chunk of ``kind``."""
    at = next(start for found, start, _ in png_chunks(data) if found == kind)
    return data[:at] + extra + data[at:]


def jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(marker code, start, end) of each JPEG segment after SOI; a scan's entropy-coded data
    belongs to its SOS segment."""
    found, pos = [], 2
    while pos < len(data):
        code = data[pos + 1]
        if code == 0xD9:
            found.append((code, pos, pos + 2))
            break
        end = pos + 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if code == 0xDA:
            while not (data[end] == 0xFF and data[end + 1] not in (0, *range(0xD0, 0xD8))):
                end += 1
        found.append((code, pos, end))
        pos = end
    return found


def scans_of(data: bytes) -> int:
    return sum(code == 0xDA for code, _, _ in jpeg_segments(data))


def progressive(image: Image.Image | None = None) -> bytes:
    return saved(image or noise(), "JPEG", progressive=True, quality=90)


def flat_progressive() -> bytes:
    """Its scans are nearly empty (one run of zero coefficients), as in a hostile file."""
    return progressive(Image.new("RGB", (64, 64), (90, 180, 165)))


def with_extra_scans(data: bytes, count: int) -> bytes:
    """The JPEG with its smallest scan repeated ``count`` more times. libjpeg decodes such a
    file (warning of a bogus progression), passing over every block once per scan."""
    segments = jpeg_segments(data)
    scans = [(end - start, start, end) for code, start, end in segments if code == 0xDA]
    _, start, end = min(scans)
    eoi = segments[-1][1]
    return data[:eoi] + data[start:end] * count + data[eoi:]


def with_total_scans(data: bytes, total: int) -> bytes:
    return with_extra_scans(data, total - scans_of(data))


def with_segments(data: bytes, count: int) -> bytes:
    """The JPEG with ``count`` empty comment segments after SOI."""
    return data[:2] + b"\xff\xfe\x00\x02" * count + data[2:]


def with_declared_size(data: bytes, width: int, height: int) -> bytes:
    """The JPEG with its frame header (SOF) claiming ``width`` x ``height``."""
    _, start, _ = next(s for s in jpeg_segments(data) if s[0] in (0xC0, 0xC1, 0xC2))
    return data[: start + 5] + struct.pack(">HH", height, width) + data[start + 9 :]


def riff(body: bytes) -> bytes:
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body


def riff_chunks(data: bytes) -> list[tuple[bytes, int, int]]:
    found, pos = [], 12
    while pos + 8 <= len(data):
        kind, size = struct.unpack_from("<4sI", data, pos)
        found.append((kind, pos, pos + 8 + size + (size & 1)))
        pos += 8 + size + (size & 1)
    return found


def animated(fmt: str, frames: int, side: int = 16) -> bytes:
    """A two-frame animation from Pillow, its last frame repeated up to ``frames``."""
    extra = {"lossless": True} if fmt == "WEBP" else {}
    first, *rest = colours(2, side)
    data = saved(first, fmt, save_all=True, append_images=rest, **extra)
    if fmt == "WEBP":
        anmf = [(start, end) for kind, start, end in riff_chunks(data) if kind == b"ANMF"]
        (_, first_end), (start, end) = anmf
        return riff(data[12:first_end] + data[start:end] * (frames - 1))
    if fmt == "GIF":
        last = data.rindex(b"\x21\xf9\x04")  # the last frame's graphic control extension
        return data[:last] + data[last:-1] * (frames - 1) + b"\x3b"
    # APNG: the last frame's fcTL and fdAT, repeated (sequence numbers are never read).
    chunks = png_chunks(data)
    start = [s for kind, s, _ in chunks if kind == b"fcTL"][-1]
    end = chunks[-1][1]
    return data[:end] + data[start:end] * (frames - 2) + data[end:]


def gif_canvas(data: bytes, width: int, height: int) -> bytes:
    return data[:6] + struct.pack("<HH", width, height) + data[10:]


def webp_canvas(data: bytes, width: int, height: int) -> bytes:
    at = data.index(b"VP8X") + 8 + 4
    size = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return data[:at] + size + data[at + 6 :]


def refused_quickly(data: bytes, match: str, *, max_pixels: int = MAX_PIXELS) -> None:
    """Both the header read of ``/encode`` (image_pixels) and the decode refuse ``data``
    with :class:`ImageTooComplex`, each in well under a second."""
    for attempt in (
        lambda: image_pixels(data, max_pixels=max_pixels),
        lambda: decode_image(data, PRE, max_pixels=max_pixels),
    ):
        start = time.perf_counter()
        with pytest.raises(ImageTooComplex, match=match) as refused:
            attempt()
        assert time.perf_counter() - start < QUICK
        assert isinstance(refused.value, InvalidInput)
        assert refused.value.status == 400
        assert refused.value.kind == "invalid_input"


def decodes(data: bytes, *, max_pixels: int = MAX_PIXELS) -> None:
    assert decode_image(data, PRE, max_pixels=max_pixels).shape == (3, 16, 16)


# -- ordinary images: the pixels Pillow alone gives ----------------------------------------


def _pillow_rgb(data: bytes, draft: int | None) -> np.ndarray[Any, Any]:
    """What the decode was before the pre-scan and the budget: Pillow directly."""
    with Image.open(io.BytesIO(data)) as image:
        if draft is not None:
            image.draft("RGB", (draft, draft))
        ImageOps.exif_transpose(image, in_place=True)
        return np.asarray(image.convert("RGB"))


def _with_text() -> bytes:
    info = PngImagePlugin.PngInfo()
    for n in range(50):
        info.add_text(f"key{n}", "value " * 20, zip=n % 2 == 1)
    return saved(noise(), "PNG", pnginfo=info)


def _exif_rotated_with_big_icc() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    # An ICC profile over 64 KiB is split across several APP2 segments.
    return saved(noise(), "JPEG", exif=exif, icc_profile=bytes(200_000), progressive=True)


def _mpo() -> bytes:
    return saved(noise(seed=1), "MPO", save_all=True, append_images=[noise(seed=2)])


ORDINARY: dict[str, Callable[[], bytes]] = {
    "jpeg-baseline": lambda: saved(noise(), "JPEG", quality=90),
    "jpeg-progressive": lambda: progressive(),
    "jpeg-progressive-optimised": lambda: saved(noise(), "JPEG", progressive=True, optimize=True),
    "jpeg-progressive-grey": lambda: progressive(noise().convert("L")),
    "jpeg-cmyk": lambda: saved(noise().convert("CMYK"), "JPEG"),
    "jpeg-exif-rotated-big-icc": _exif_rotated_with_big_icc,
    "jpeg-mpo-first-picture": _mpo,
    "png": lambda: saved(noise(), "PNG"),
    "png-with-text": _with_text,
    "png-grey-16-bit": lambda: saved(noise().convert("I;16"), "PNG"),
    "png-palette": lambda: saved(noise().convert("P"), "PNG"),
    "apng-first-frame": lambda: animated("PNG", 3),
    "webp-lossy": lambda: saved(noise(), "WEBP"),
    "webp-lossless": lambda: saved(noise(), "WEBP", lossless=True),
    "webp-animated-first-frame": lambda: animated("WEBP", 3),
    "gif": lambda: saved(noise(), "GIF"),
    "gif-animated-first-frame": lambda: animated("GIF", 3),
    "bmp": lambda: saved(noise(), "BMP"),
}


@pytest.mark.parametrize("draft", [None, 16])
@pytest.mark.parametrize("name", list(ORDINARY))
def test_ordinary_images_decode_to_the_pixels_pillow_alone_gives(
    name: str, draft: int | None
) -> None:
    data = ORDINARY[name]()
    pixels = np.asarray(open_image(data, max_pixels=MAX_PIXELS, draft=draft))
    assert np.array_equal(pixels, _pillow_rgb(data, draft))


def test_an_animation_decodes_to_its_first_frame() -> None:
    for fmt in ("GIF", "WEBP", "PNG"):
        first = open_image(animated(fmt, MAX_FRAMES), max_pixels=MAX_PIXELS)
        assert first.getpixel((0, 0)) == (0, 80, 255), fmt


# -- JPEG ----------------------------------------------------------------------------------


def test_a_jpeg_of_thousands_of_scans_is_refused_before_decoding() -> None:
    hostile = with_extra_scans(flat_progressive(), 2_000)
    assert len(hostile) < 100_000
    refused_quickly(hostile, f"more than {MAX_JPEG_SCANS} JPEG scans")


def test_the_scan_bound_is_exact() -> None:
    decodes(with_total_scans(progressive(), MAX_JPEG_SCANS))
    refused_quickly(
        with_total_scans(progressive(), MAX_JPEG_SCANS + 1), f"limit is {MAX_JPEG_SCANS}$"
    )


def test_many_scans_of_a_big_jpeg_are_refused_by_scans_times_pixels() -> None:
    """A pass over 25 MP is ~10 ms: 90 of them (under the scan count) are refused."""
    scans = 90
    big = with_declared_size(with_total_scans(progressive(), scans), 5_000, 5_000)
    assert scans * 25_000_000 > MAX_JPEG_SCAN_PIXELS
    refused_quickly(big, f"JPEG of 25000000 pixels .* limit is {MAX_JPEG_SCAN_PIXELS} pixels")


def test_a_jpeg_of_thousands_of_segments_is_refused() -> None:
    base = saved(noise(), "JPEG")
    own = len(jpeg_segments(base)) - 1  # EOI is not counted
    decodes(with_segments(base, MAX_CHUNKS - own))
    refused_quickly(with_segments(base, MAX_CHUNKS - own + 1), f"more than {MAX_CHUNKS} JPEG")
    refused_quickly(with_segments(base, 1_000_000), "JPEG marker segments")


def test_padding_between_jpeg_segments_is_bounded() -> None:
    """0xFF fill before a marker is legal, but Pillow steps over each byte in Python."""
    base = saved(noise(), "JPEG")
    decodes(base[:2] + b"\xff" * MAX_JPEG_STRAY_BYTES + base[2:])
    refused_quickly(base[:2] + b"\xff" * (MAX_JPEG_STRAY_BYTES + 1) + base[2:], "padding")
    refused_quickly(base[:2] + b"\x00" * 10_000_000 + base[2:], "stray")


class Ticking:
    """Clocks for the budget that move one second per read of the image's bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads = -1  # the reader's own first look at the clock is no read
        monkeypatch.setattr(images, "_wall_clock", self.wall)
        monkeypatch.setattr(images, "_cpu_clock", lambda: float(self.reads))

    def wall(self) -> float:
        self.reads += 1
        return float(self.reads)

    def reads_of(self, call: Callable[[], object]) -> int:
        self.reads = -1
        call()
        return self.reads


def test_the_decode_reads_a_jpeg_one_scan_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads stop at each scan, so a long progressive decode is checked between its scans
    (one libjpeg call would run them all), and stopped there once over its budget."""
    data = with_total_scans(progressive(), 60)
    clocks = Ticking(monkeypatch)
    header = clocks.reads_of(lambda: image_pixels(data, max_pixels=MAX_PIXELS, budget_s=1e6))
    decode = clocks.reads_of(lambda: decode_image(data, PRE, max_pixels=MAX_PIXELS, budget_s=1e6))
    assert decode - header >= 60
    with pytest.raises(ImageTooComplex, match=rf"took more than {header + 30} s of CPU time"):
        decode_image(data, PRE, max_pixels=MAX_PIXELS, budget_s=header + 30)


def test_a_decode_past_its_budget_is_stopped_and_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    data = saved(noise(), "PNG")
    decodes(data)
    opened: list[Image.Image] = []
    real_open = Image.open

    def tracking(*args: Any, **kwargs: Any) -> Image.Image:
        opened.append(real_open(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(Image, "open", tracking)
    clocks = Ticking(monkeypatch)
    header = clocks.reads_of(lambda: image_pixels(data, max_pixels=MAX_PIXELS, budget_s=1e6))
    opened.clear()
    with pytest.raises(ImageTooComplex, match=r"took more than \d+ s of CPU time") as refused:
        decode_image(data, PRE, max_pixels=MAX_PIXELS, budget_s=header + 1)
    assert refused.value.status == 400
    # Stopped in the decode (the header was read), and the image is closed: nothing is left.
    (image,) = opened
    assert image.size == (64, 48)
    assert isinstance(image, ImageFile.ImageFile)
    assert image.fp is None
    with pytest.raises(ImageTooComplex, match=r"took more than 5 s of CPU time"):
        decode_image(data, PRE, max_pixels=MAX_PIXELS)  # the default budget


# -- PNG -----------------------------------------------------------------------------------


def test_a_png_of_a_million_empty_chunks_is_refused_before_decoding() -> None:
    base = saved(noise(), "PNG")
    for kind in (b"tEXt", b"prIv"):  # known and unknown ancillary chunks
        refused_quickly(
            before_first(base, b"IDAT", png_chunk(kind) * 1_000_000),
            f"more than {MAX_CHUNKS} PNG chunks besides its image data",
        )
    # After the image data too: Pillow walks those once the pixels are read.
    refused_quickly(
        before_first(base, b"IEND", png_chunk(b"tEXt") * 1_000_000), "PNG chunks besides"
    )


def test_the_png_chunk_bound_is_exact() -> None:
    base = saved(noise(), "PNG")
    own = sum(kind != b"IDAT" for kind, _, _ in png_chunks(base))
    decodes(before_first(base, b"IDAT", png_chunk(b"tEXt") * (MAX_CHUNKS - own)))
    refused_quickly(
        before_first(base, b"IDAT", png_chunk(b"tEXt") * (MAX_CHUNKS - own + 1)),
        f"limit is {MAX_CHUNKS}$",
    )


def test_empty_idat_chunks_are_bounded_by_the_declared_size() -> None:
    small = saved(noise(8, 8), "PNG")  # 8 rows of 25 bytes: the floor alone
    assert sum(kind == b"IDAT" for kind, _, _ in png_chunks(small)) == 1
    decodes(before_first(small, b"IDAT", png_chunk(b"IDAT") * (PNG_DATA_CHUNKS_FLOOR - 1)))
    refused_quickly(
        before_first(small, b"IDAT", png_chunk(b"IDAT") * PNG_DATA_CHUNKS_FLOOR),
        f"more than {PNG_DATA_CHUNKS_FLOOR} PNG image data chunks",
    )
    refused_quickly(
        before_first(small, b"IDAT", png_chunk(b"IDAT") * 1_000_000), "PNG image data chunks"
    )
    # A bigger image may have more: one per PNG_DATA_BYTES_PER_CHUNK of its raw rows.
    big = saved(noise(512, 512), "PNG")
    own = sum(kind == b"IDAT" for kind, _, _ in png_chunks(big))
    limit = PNG_DATA_CHUNKS_FLOOR + 512 * (1 + 512 * 3) // PNG_DATA_BYTES_PER_CHUNK
    assert limit > PNG_DATA_CHUNKS_FLOOR + 100
    decodes(before_first(big, b"IDAT", png_chunk(b"IDAT") * (limit - own)))
    refused_quickly(
        before_first(big, b"IDAT", png_chunk(b"IDAT") * (limit - own + 1)), f"limit is {limit}$"
    )


def test_an_apng_of_thousands_of_frames_is_refused() -> None:
    refused_quickly(animated("PNG", 2_000), f"more than {MAX_FRAMES} APNG frames")
    two = animated("PNG", 2)
    actl = next(start for kind, start, _ in png_chunks(two) if kind == b"acTL")
    body = struct.pack(">II", MAX_FRAMES + 1, 0)
    declared = two[:actl] + png_chunk(b"acTL", body) + two[actl + 20 :]
    refused_quickly(declared, f"declares {MAX_FRAMES + 1} APNG frames")


# -- GIF and WebP --------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "name"), [("GIF", "GIF"), ("WEBP", "WebP")])
def test_an_animation_of_thousands_of_frames_is_refused(fmt: str, name: str) -> None:
    hostile = animated(fmt, 2_000)
    assert len(hostile) < 150_000
    refused_quickly(hostile, f"more than {MAX_FRAMES} {name} frames")
    decodes(animated(fmt, MAX_FRAMES))
    refused_quickly(animated(fmt, MAX_FRAMES + 1), f"limit is {MAX_FRAMES}$")


@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_frames_times_pixels_is_bounded(fmt: str) -> None:
    """100 frames on a 4000 x 4000 canvas: each frame is under the pixel limit, all of them
    together are over what compositing them may cost."""
    canvas = gif_canvas if fmt == "GIF" else webp_canvas
    hostile = canvas(animated(fmt, 100), 4_000, 4_000)
    assert MAX_ANIMATION_PIXELS < 100 * 4_000 * 4_000
    refused_quickly(hostile, f"100 frames of 4000x4000 .* limit is {MAX_ANIMATION_PIXELS}")
    decodes(canvas(animated(fmt, 2), 4_000, 4_000))


def test_gif_blocks_are_bounded_by_the_file_size() -> None:
    """Pillow walks the blocks before the first image one read at a time, in Python: empty
    comment extensions, or stray bytes it steps over."""
    base = saved(noise(), "GIF")
    at = 13 + (3 << ((base[10] & 7) + 1))  # after the header and the global palette
    decodes(base[:at] + b"\x21\xfe\x00" * 5_000 + base[at:])
    comments = base[:at] + b"\x21\xfe\x00" * 200_000 + base[at:]
    limit = GIF_BLOCKS_FLOOR + len(comments) // GIF_BYTES_PER_BLOCK
    refused_quickly(comments, f"more than {limit} GIF blocks")
    refused_quickly(base[:at] + b"\x00" * 1_000_000 + base[at:], "GIF blocks")
    # A big real GIF has more sub-blocks than the floor (one per 255 bytes), and passes.
    pixels = np.random.default_rng(0).integers(0, 256, (1_500, 1_500), dtype=np.uint8)
    big = saved(Image.fromarray(pixels, "L"), "GIF")
    assert len(big) // 255 > GIF_BLOCKS_FLOOR
    decodes(big)


def test_webp_chunks_are_bounded() -> None:
    data = animated("WEBP", 2)
    own = sum(kind != b"ANMF" for kind, _, _ in riff_chunks(data))
    at = next(start for kind, start, _ in riff_chunks(data) if kind == b"ANMF")

    def with_unknown(count: int) -> bytes:
        return riff(data[12:at] + b"UNKN\0\0\0\0" * count + data[at:])

    decodes(with_unknown(MAX_CHUNKS - own))
    refused_quickly(with_unknown(MAX_CHUNKS - own + 1), f"more than {MAX_CHUNKS} WebP chunks")


def test_a_webp_canvas_over_the_pixel_limit_is_refused_before_pillow_opens_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libwebp allocates the canvas when Pillow opens the file, before any size check."""
    data = webp_canvas(animated("WEBP", 2), 10_000, 5_000)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("Pillow opened an image the pre-scan should have refused")

    monkeypatch.setattr(Image, "open", never)
    with pytest.raises(InvalidInput, match=r"declares 10000x5000 pixels; the limit is 40000000"):
        decode_image(data, PRE, max_pixels=MAX_PIXELS)
