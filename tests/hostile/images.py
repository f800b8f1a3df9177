"""Hostile images, crafted byte by byte: each is small on the wire and costs a naive decoder
far more than its size (the costs measured with Pillow alone, on one core):

- :func:`scan_bomb_jpeg`: 20 KB. A progressive JPEG declaring 6000x6000 pixels (under the
  default ``--max-image-pixels``) and then 2,000 scans that carry no entropy-coded data:
  libjpeg walks every block of the image once per scan, 2,000 passes over 562,500 blocks
  (about 4 s, even at the 1/8 scale of ``draft``, and a 72 MB coefficient buffer).
- :func:`chunk_flood_png`: 12 MB. A 32x32 PNG with 1,000,000 empty private chunks (each with a
  valid CRC) between its header and its pixels, which Pillow reads one by one, in Python, to
  reach a pixel (about 2 s under the GIL).
- :func:`many_frames_webp`: 100 KB. An animated WebP of 2,000 tiny frames on a 6000x6000 canvas
  (the container written here, each frame's bitstream Pillow's): decoding its first frame
  fills the whole canvas (about 0.9 s and 550 MB).

Built once per process and cached.
"""

from __future__ import annotations

import io
import struct
import zlib
from functools import cache

from PIL import Image

JPEG_SIDE = 6000
JPEG_SCANS = 2000
PNG_CHUNKS = 1_000_000
WEBP_FRAMES = 2000
WEBP_CANVAS = 6000


def _marker(code: int, payload: bytes) -> bytes:
    """A JPEG marker segment: ``FF code``, its length (counting itself), its payload."""
    return bytes((0xFF, code)) + struct.pack(">H", len(payload) + 2) + payload


@cache
def scan_bomb_jpeg(side: int = JPEG_SIDE, scans: int = JPEG_SCANS) -> bytes:
    """A greyscale progressive JPEG of ``side`` x ``side`` with ``scans`` empty scans."""
    quant = _marker(0xDB, bytes([0x00]) + bytes([1] * 64))  # table 0, 8-bit, all ones
    frame = _marker(0xC2, struct.pack(">BHHB", 8, side, side, 1) + bytes([1, 0x11, 0]))
    # One Huffman code (length 1, symbol 0) for DC table 0 and AC table 0.
    one_code = bytes([1] + [0] * 15) + bytes([0])
    huffman = _marker(0xC4, bytes([0x00]) + one_code + bytes([0x10]) + one_code)
    first = _marker(0xDA, bytes([1, 1, 0x00, 0, 0, 0x00]))  # DC first scan, nothing coded
    again = _marker(0xDA, bytes([1, 1, 0x00, 1, 63, 0x00]))  # AC first scan, nothing coded
    body = first + again * (scans - 1)
    return b"\xff\xd8" + quant + frame + huffman + body + b"\xff\xd9"


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


@cache
def chunk_flood_png(chunks: int = PNG_CHUNKS, side: int = 32) -> bytes:
    """A ``side`` x ``side`` grey PNG whose pixels come after ``chunks`` empty ``feRr`` chunks
    (ancillary, private, safe to copy: a decoder must skip them, CRC checked)."""
    header = _png_chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
    rows = b"".join(b"\x00" + bytes([128]) * side for _ in range(side))
    pixels = _png_chunk(b"IDAT", zlib.compress(rows))
    flood = _png_chunk(b"feRr", b"") * chunks
    return b"\x89PNG\r\n\x1a\n" + header + flood + pixels + _png_chunk(b"IEND", b"")


def _riff_chunk(kind: bytes, payload: bytes) -> bytes:
    pad = b"\x00" if len(payload) % 2 else b""
    return kind + struct.pack("<I", len(payload)) + payload + pad


def _u24(value: int) -> bytes:
    return struct.pack("<I", value)[:3]


@cache
def _lossless_frame(side: int) -> bytes:
    """The ``VP8L`` chunk of a ``side`` x ``side`` lossless WebP, as Pillow writes it."""
    out = io.BytesIO()
    Image.new("RGB", (side, side), (40, 90, 140)).save(
        out, format="WEBP", lossless=True, quality=0, method=0
    )
    data = out.getvalue()
    start = data.index(b"VP8L")
    return data[start:]


@cache
def many_frames_webp(frames: int = WEBP_FRAMES, canvas: int = WEBP_CANVAS, side: int = 32) -> bytes:
    """An animated WebP: a ``canvas`` x ``canvas`` canvas and ``frames`` lossless frames of
    ``side`` x ``side`` at its corner (the container written here; the frame's bitstream is
    Pillow's)."""
    header = _riff_chunk(b"VP8X", bytes([0x02, 0, 0, 0]) + _u24(canvas - 1) + _u24(canvas - 1))
    animation = _riff_chunk(b"ANIM", bytes([0, 0, 0, 0]) + struct.pack("<H", 0))
    frame = _riff_chunk(
        b"ANMF",
        _u24(0)
        + _u24(0)
        + _u24(side - 1)
        + _u24(side - 1)
        + _u24(10)
        + bytes([0])
        + _lossless_frame(side),
    )
    body = b"WEBP" + header + animation + frame * frames
    return b"RIFF" + struct.pack("<I", len(body)) + body
