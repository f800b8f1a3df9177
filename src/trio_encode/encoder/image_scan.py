"""A structural pre-scan of an image's bytes, run before any decoder sees them.

A decoder's cost follows a file's structure, not only its bytes or pixels: libjpeg passes
over every block of the image once per progressive scan, and Pillow walks JPEG segments, PNG
chunks and GIF blocks one at a time in Python. So a 28 KB JPEG of 2,000 empty scans, or a PNG
of a million empty chunks, passes every byte and pixel limit and still holds a decode thread
for tens of seconds. This walk counts those structures (C-speed searches and index
arithmetic, stopping at the first bound passed, so its own work is bounded and linear in the
bytes) and refuses such a file before Pillow opens it.

It only counts: whatever it does not recognise is left for Pillow to refuse, and a truncated
or malformed file ends the walk early (the decoder then fails on it, cheaply). Every bound is
far above what an encoder writes, so real images never meet one.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from trio_encode.errors import InvalidInput

MAX_CHUNKS = 1_000
"""Metadata pieces of one image: JPEG marker segments, PNG chunks other than image data and
frame control, WebP chunks other than frames. Real files have about ten to thirty (tables,
colour profile in up to a few dozen pieces, EXIF, XMP, text); Pillow parses each in Python."""

MAX_JPEG_SCANS = 100
"""Scans of one JPEG. libjpeg's progressive script writes 10 (6 for greyscale), mozjpeg's
optimised ones a few more, a baseline file one per component at most. Each scan is a pass over
every block of the image: 2,000 empty ones held a decode thread for 23 s at 36 MP (11.5 ms a
pass). A hundred is five to ten times any encoder's output; big images get fewer (below)."""

MAX_JPEG_SCAN_PIXELS = 2_000_000_000
"""Scans x pixels of one JPEG (the size its frame header declares): 50 scans at the default
40 MP pixel limit (about 0.6 s of passes at 11.5 ms each), still several times what encoders
write; ``MAX_JPEG_SCANS`` only for images up to 20 MP."""

MAX_JPEG_STRAY_BYTES = 4_096
"""Fill bytes (0xFF padding) and stray bytes between JPEG segments. Legal but rare (a few at
most); Pillow's header parser steps over each with a Python loop iteration."""

PNG_DATA_CHUNKS_FLOOR = 10_000
PNG_DATA_BYTES_PER_CHUNK = 4_096
"""IDAT and fdAT chunks of one PNG: at most ``PNG_DATA_CHUNKS_FLOOR`` plus one per
``PNG_DATA_BYTES_PER_CHUNK`` bytes of the image's declared decompressed size. libpng cuts its
data into 8 KiB chunks (and compressed data is no larger than the raw), so a 20 MiB file has
about 2,600; the declared-size term lets an encoder that flushes per row of a big image pass.
Empty data chunks are legal, and Pillow walks each in Python."""

GIF_BLOCKS_FLOOR = 10_000
GIF_BYTES_PER_BLOCK = 128
"""Blocks of one GIF (extensions, image descriptors, sub-blocks, stray bytes): at most
``GIF_BLOCKS_FLOOR`` plus one per ``GIF_BYTES_PER_BLOCK`` bytes of the file. Encoders fill
every sub-block to its 255 bytes, so a real GIF has about one per 255 bytes plus a few per
frame; Pillow walks the blocks before the first image in Python, one read each."""

MAX_FRAMES = 1_000
"""Frames of one animation (GIF, WebP, APNG), declared or counted. Only the first frame is
ever decoded (nothing here calls Pillow's ``n_frames`` or ``seek``, which walk or decode every
frame), but libwebp indexes every frame when Pillow opens a WebP, and the frames are the
walk's own work; a thousand is over half a minute at 30 frames a second."""

MAX_ANIMATION_PIXELS = 1_000_000_000
"""Frames x canvas pixels of one animation: the work of compositing every frame, should any
path ever do it (Pillow's ``seek`` decodes each frame before the one asked for). A thousand
frames of 1 MP, or 25 at the default 40 MP pixel limit."""


class ImageTooComplex(InvalidInput):
    """An image's structure (scans, chunks, blocks, frames) is over a bound of this module, or
    its decode ran past its time budget: refused, with the bound named (400)."""


@dataclass(frozen=True)
class Layout:
    """What the walk learned that the decode uses."""

    size: tuple[int, int] | None = None
    """The canvas the container declares (PNG, GIF, WebP), so the pixel limit is checked
    before Pillow allocates anything (its WebP decoder allocates the canvas on open); None
    where the walk does not read it (JPEG, BMP)."""
    scan_starts: tuple[int, ...] = ()
    """JPEG: the offset of every start-of-scan marker, where the decode's reads stop so that
    its time budget is checked between scans."""


def scan(data: bytes, *, max_pixels: int) -> Layout:
    """Walk the structure of a JPEG, PNG, GIF or WebP file, raising :class:`ImageTooComplex`
    at the first bound passed. A declared canvas over ``max_pixels`` ends the walk early (its
    caller refuses it from :attr:`Layout.size`). Other bytes get an empty :class:`Layout`."""
    if data.startswith(b"\xff\xd8"):
        return _jpeg(data)
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return _png(data, max_pixels)
    if data.startswith((b"GIF87a", b"GIF89a")):
        return _gif(data, max_pixels)
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return _webp(data, max_pixels)
    return Layout()


def _over(what: str, limit: int) -> ImageTooComplex:
    return ImageTooComplex(f"the image has more than {limit} {what}; the limit is {limit}")


# A marker inside entropy-coded data: 0xFF, then neither a stuffed zero, a restart marker nor
# more fill. Two fixed bytes, so a search never backtracks over long runs of 0xFF.
_MARKER_AFTER_SCAN = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
_FILL = re.compile(rb"\xff+")
_STANDALONE = frozenset({0x01, 0xD8, *range(0xD0, 0xD8)})  # TEM, SOI, RSTn: no length
# SOF0-15, which declare the frame's size; 0xC4 (DHT), 0xC8 (JPG) and 0xCC (DAC) do not.
_START_OF_FRAME = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg(data: bytes) -> Layout:
    """Count segments, scans and stray bytes up to the first EOI (what libjpeg decodes;
    anything after it, such as an MPO's other pictures, is never decoded)."""
    end = len(data)
    pos = 2
    segments = stray = pixels = 0
    starts: list[int] = []
    while pos < end:
        # Up to the marker's code: stray bytes, then 0xFF and any fill 0xFFs before the code.
        found = data.find(b"\xff", pos)
        if found < 0:
            stray += end - pos
            code_at = end
        else:
            run = _FILL.match(data, found)
            assert run is not None  # data[found] is 0xFF
            code_at = run.end()
            stray += code_at - pos - 1
        if stray > MAX_JPEG_STRAY_BYTES:
            raise _over("stray or padding bytes between its JPEG segments", MAX_JPEG_STRAY_BYTES)
        if code_at >= end:
            break
        code, pos = data[code_at], code_at + 1
        if code == 0x00:  # not a marker: Pillow and libjpeg skip it
            stray += 2
            continue
        if code == 0xD9:  # EOI
            break
        segments += 1
        if segments > MAX_CHUNKS:
            raise _over("JPEG marker segments", MAX_CHUNKS)
        if code in _STANDALONE:
            continue
        if pos + 2 > end:
            break
        length = int.from_bytes(data[pos : pos + 2], "big")
        if code in _START_OF_FRAME and pos + 7 <= end:
            height, width = struct.unpack_from(">HH", data, pos + 3)
            pixels = max(pixels, width * height)
        if code != 0xDA:
            pos += length
            continue
        starts.append(code_at - 1)
        if len(starts) > MAX_JPEG_SCANS:
            raise _over("JPEG scans (each a pass over every pixel)", MAX_JPEG_SCANS)
        if len(starts) * pixels > MAX_JPEG_SCAN_PIXELS:
            raise ImageTooComplex(
                f"the image is a JPEG of {pixels} pixels with at least {len(starts)} scans, each "
                f"a pass over every pixel; the limit is {MAX_JPEG_SCAN_PIXELS} pixels over all "
                "scans"
            )
        after = _MARKER_AFTER_SCAN.search(data, pos + length)
        if after is None:
            break
        pos = after.start()
    return Layout(scan_starts=tuple(starts))


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type
_PNG_CHUNK = struct.Struct(">I4s")


def _png(data: bytes, max_pixels: int) -> Layout:
    """Count chunks to IEND: metadata, image data (IDAT, and fdAT of later APNG frames) and
    frames (fcTL, and the count acTL declares)."""
    end = len(data)
    pos = 8
    chunks = data_chunks = frames = declared = raw = 0
    size: tuple[int, int] | None = None
    while pos + 8 <= end:
        length, kind = _PNG_CHUNK.unpack_from(data, pos)
        if kind in (b"IDAT", b"fdAT"):
            data_chunks += 1
            limit = PNG_DATA_CHUNKS_FLOOR + raw // PNG_DATA_BYTES_PER_CHUNK
            if data_chunks > limit:
                raise _over("PNG image data chunks (IDAT, fdAT) for its size", limit)
        elif kind == b"fcTL":
            frames += 1
            if frames > MAX_FRAMES:
                raise _over("APNG frames", MAX_FRAMES)
        else:
            chunks += 1
            if chunks > MAX_CHUNKS:
                raise _over("PNG chunks besides its image data", MAX_CHUNKS)
            if kind == b"IHDR" and length >= 13 and pos + 21 <= end:
                width, height, depth, colour = struct.unpack_from(">IIBB", data, pos + 8)
                size = (width, height)
                if width * height > max_pixels:
                    return Layout(size=size)
                bits = width * depth * _PNG_CHANNELS.get(colour, 4)
                raw = height * (1 + (bits + 7) // 8)
            elif kind == b"acTL" and length >= 8 and pos + 12 <= end:
                declared = int.from_bytes(data[pos + 8 : pos + 12], "big")
                if declared > MAX_FRAMES:
                    raise ImageTooComplex(
                        f"the image declares {declared} APNG frames; the limit is {MAX_FRAMES}"
                    )
            elif kind == b"IEND":
                break
        pos += 12 + length
    _check_animation(max(frames, declared), size)
    return Layout(size=size)


def _gif(data: bytes, max_pixels: int) -> Layout:
    """Count blocks and frames to the trailer, stepping over every sub-block."""
    end = len(data)
    if end < 13:
        return Layout()
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    if width * height > max_pixels:
        return Layout(size=(width, height))
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    limit = GIF_BLOCKS_FLOOR + end // GIF_BYTES_PER_BLOCK
    blocks = frames = 0
    while pos < end:
        introducer = data[pos]
        if introducer == 0x3B:  # trailer
            break
        blocks += 1
        if blocks > limit:
            raise _over("GIF blocks for its size", limit)
        if introducer == 0x21:  # extension: label, then sub-blocks
            pos += 2
        elif introducer == 0x2C:  # image descriptor, local palette, LZW code size, sub-blocks
            frames += 1
            if frames > MAX_FRAMES:
                raise _over("GIF frames", MAX_FRAMES)
            if pos + 10 > end:
                break
            local = data[pos + 9]
            pos += 11 + (3 << ((local & 7) + 1) if local & 0x80 else 0)
        else:  # a stray byte, which Pillow steps over one at a time
            pos += 1
            continue
        while pos < end:
            length = data[pos]
            pos += 1 + length
            if not length:
                break
            blocks += 1
            if blocks > limit:
                raise _over("GIF blocks for its size", limit)
    _check_animation(frames, (width, height))
    return Layout(size=(width, height))


_RIFF_CHUNK = struct.Struct("<4sI")


def _webp(data: bytes, max_pixels: int) -> Layout:
    """Count the RIFF chunks (frames are ANMF) and read the canvas: VP8X's, or a still
    image's own."""
    end = len(data)
    pos = 12
    chunks = frames = 0
    size: tuple[int, int] | None = None
    while pos + 8 <= end:
        kind, length = _RIFF_CHUNK.unpack_from(data, pos)
        body = pos + 8
        if kind == b"ANMF":
            frames += 1
            if frames > MAX_FRAMES:
                raise _over("WebP frames", MAX_FRAMES)
        else:
            chunks += 1
            if chunks > MAX_CHUNKS:
                raise _over("WebP chunks besides its frames", MAX_CHUNKS)
            if size is None:
                size = _webp_size(data, kind, body, length)
                if size is not None and size[0] * size[1] > max_pixels:
                    return Layout(size=size)
        pos = body + length + (length & 1)
    _check_animation(frames, size)
    return Layout(size=size)


def _webp_size(data: bytes, kind: bytes, body: int, length: int) -> tuple[int, int] | None:
    """The canvas a VP8X chunk declares, or the size in a still VP8/VP8L bitstream's header."""
    if body + length > len(data):
        return None
    if kind == b"VP8X" and length >= 10:
        width = int.from_bytes(data[body + 4 : body + 7], "little") + 1
        height = int.from_bytes(data[body + 7 : body + 10], "little") + 1
        return width, height
    if kind == b"VP8 " and length >= 10 and data[body + 3 : body + 6] == b"\x9d\x01\x2a":
        width, height = struct.unpack_from("<HH", data, body + 6)
        return width & 0x3FFF, height & 0x3FFF
    if kind == b"VP8L" and length >= 5 and data[body] == 0x2F:
        bits = int.from_bytes(data[body + 1 : body + 5], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _check_animation(frames: int, size: tuple[int, int] | None) -> None:
    if frames <= 1 or size is None:
        return
    total = frames * size[0] * size[1]
    if total > MAX_ANIMATION_PIXELS:
        raise ImageTooComplex(
            f"the image is an animation of {frames} frames of {size[0]}x{size[1]} pixels, "
            f"{total} in all; the limit is {MAX_ANIMATION_PIXELS} pixels over all frames"
        )
