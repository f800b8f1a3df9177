"""Hostile audio clips: each small on the wire, each lying or costly where the decoder's limits
(the ``audio_*`` settings) must catch it. The FLACs are written byte by byte (:func:`flac`:
frames of one constant value per channel, the cheapest a FLAC can be); the rest start from
:func:`~trio_encode.testing.audio.write` and are edited:

- :func:`hours_flac`: 55 bytes of half a second whose STREAMINFO says three hours.
- :func:`long_claiming_flac`: 2 KB of 11 minutes at 16 kHz whose STREAMINFO says one second:
  over ``--audio-max-seconds`` (ten minutes) only once decoded.
- :func:`decode_bomb_flac`: 60 KB of 9 minutes 50 of 7.1 sound at 192 kHz, honest and within
  every limit but the CPU budget: its 906 million samples are decoded and mixed down to one
  channel at 16 kHz (about 2.4 CPU seconds on one core here). Bombs of different values are
  different clips, which the server does not join.
- :func:`garbage_wav`: a WAV's RIFF header and ``fmt`` chunk, then random bytes where its
  ``data`` chunk should be.
- :func:`garbage_mp3`: an MP3's first frame header, then random bytes.

Built once per process and cached.
"""

from __future__ import annotations

import struct
from functools import cache

import numpy as np

from trio_encode.testing.audio import write

BOMB_RATE = 192_000
BOMB_CHANNELS = 8
BOMB_SECONDS = 590.0
"""Ten seconds under the shipped ``--audio-max-seconds``."""
LONG_SECONDS = 660.0
BLOCK = 65_535
"""Samples a channel in each frame: the most FLAC allows, so the file is smallest."""

_RATE_CODES = {8_000: 0b0100, 16_000: 0b0101, 44_100: 0b1001, 48_000: 0b1010, 192_000: 0b0011}
"""FLAC's frame-header codes of the sampling rates used here."""


def _crc(data: bytes, poly: int, width: int) -> int:
    """FLAC's CRCs (MSB first, initial value 0): CRC-8 ``0x07`` of a frame header, CRC-16
    ``0x8005`` of a whole frame."""
    top, mask = 1 << (width - 1), (1 << width) - 1
    crc = 0
    for byte in data:
        crc ^= byte << (width - 8)
        for _ in range(8):
            crc = (crc << 1 ^ poly if crc & top else crc << 1) & mask
    return crc


def _utf8_number(number: int) -> bytes:
    """A frame number as FLAC codes it (UTF-8's scheme, up to 36 bits)."""
    if number < 0x80:
        return bytes([number])
    extra = 1
    while number >= 1 << (5 * extra + 6):
        extra += 1
    first = (0xFF00 >> (extra + 1)) & 0xFF | number >> (6 * extra)
    rest = [0x80 | (number >> (6 * i)) & 0x3F for i in reversed(range(extra))]
    return bytes([first, *rest])


def _frame(number: int, samples: int, rate: int, channels: int, value: int) -> bytes:
    """One fixed-block-size frame of ``samples`` a channel, every sample ``value`` (16 bits),
    each channel a constant subframe (three bytes)."""
    header = (
        b"\xff\xf8"  # sync code, fixed block size
        + bytes([0b0111 << 4 | _RATE_CODES[rate]])  # block size in 16 bits at the end
        + bytes([(channels - 1) << 4 | 0b100 << 1])  # independent channels, 16 bits a sample
        + _utf8_number(number)
        + struct.pack(">H", samples - 1)
    )
    header += bytes([_crc(header, 0x07, 8)])
    body = header + (b"\x00" + struct.pack(">h", value)) * channels
    return body + struct.pack(">H", _crc(body, 0x8005, 16))


def flac(rate: int, channels: int, seconds: float, *, declared: int, value: int = 0) -> bytes:
    """A FLAC of ``seconds`` at ``rate``, every sample of every channel ``value``, whose
    STREAMINFO declares ``declared`` samples (0: unknown)."""
    total = round(rate * seconds)
    info = (
        struct.pack(">HH", BLOCK, BLOCK)
        + bytes(6)  # frame sizes unknown
        + (rate << 44 | (channels - 1) << 41 | 15 << 36 | declared).to_bytes(8, "big")
        + bytes(16)  # no MD5
    )
    frames = []
    for number, start in enumerate(range(0, total, BLOCK)):
        frames.append(_frame(number, min(BLOCK, total - start), rate, channels, value))
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info + b"".join(frames)


@cache
def hours_flac() -> bytes:
    return flac(16_000, 1, 0.5, declared=3 * 3600 * 16_000, value=1000)


@cache
def long_claiming_flac() -> bytes:
    return flac(16_000, 1, LONG_SECONDS, declared=16_000, value=1000)


@cache
def decode_bomb_flac(value: int) -> bytes:
    return flac(
        BOMB_RATE,
        BOMB_CHANNELS,
        BOMB_SECONDS,
        declared=round(BOMB_RATE * BOMB_SECONDS),
        value=value,
    )


def _noise(size: int, seed: int) -> bytes:
    return bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8))


@cache
def garbage_wav() -> bytes:
    honest = write("wav", 16_000, 1.0)
    at = honest.index(b"data")
    return honest[:at] + _noise(len(honest) - at, seed=1)


@cache
def garbage_mp3() -> bytes:
    honest = write("mp3-bare", 16_000, 1.0)
    return honest[:4] + _noise(len(honest) - 4, seed=2)
