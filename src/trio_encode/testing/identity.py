"""Bytes that say whose they are: the soak's embeddings, and how a receiver reads them.

A drill tags each image it sends with an *identity* (:func:`tag`: a trailer after the encoded
image, which ``StampedModel`` (``trio_encode.testing.stamped_model``) strips before the real
model decodes it). The stamped model overwrites that image's embedding so that every 8-byte
word, little-endian, is ``identity << 32 | word index`` (:func:`words`). A receiver can then
read any range of its buffer word by word (:func:`read_slot`) and tell its own bytes in place
from bytes of another image (which identity, which word: so which request, which offset),
from its own bytes out of place, and from anything else.

Only numpy here: the soak's receiver processes import this, not torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAGIC = b"\x00trio-encode-identity:"
"""Starts an image's identity trailer."""
WORD = 8
MAX_IDENTITY = 1 << 31
"""Identities are 1 to this (exclusive): never 0 (a zeroed buffer), never a marker byte run."""
MARKER = 0xA5
"""What a receiver fills a range with once its request has ended (a run of it is no stamp)."""
_BLANK = (0, int.from_bytes(bytes([MARKER]) * WORD, "little"))


def tag(image: bytes, identity: int) -> bytes:
    """``image`` carrying ``identity`` (image decoders ignore what follows the image)."""
    if not 0 < identity < MAX_IDENTITY:
        raise ValueError(f"identity {identity} is outside 1..{MAX_IDENTITY - 1}")
    return image + MAGIC + identity.to_bytes(4, "little")


def untag(data: bytes) -> tuple[bytes, int | None]:
    """``(image, identity)`` of tagged bytes; ``(data, None)`` when they carry none."""
    end = len(data) - len(MAGIC) - 4
    if end < 0 or data[end : end + len(MAGIC)] != MAGIC:
        return data, None
    return data[:end], int.from_bytes(data[end + len(MAGIC) :], "little")


def words(identity: int, count: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """The ``count`` words of an embedding stamped with ``identity``."""
    index = np.arange(count, dtype=np.uint64)
    return index | np.uint64(identity << 32)


@dataclass(frozen=True)
class Foreign:
    """Bytes of another image found in a range: whose, how many, and where first."""

    identity: int
    nbytes: int
    offset: int
    """Where the first such word lies, from the start of the range read."""
    word: int
    """Its index in that image's embedding (so its byte offset there is ``8 * word``)."""


@dataclass
class SlotReading:
    """What one range of a receiver's buffer holds, word by word."""

    parts_ok: list[bool] = field(default_factory=list)
    """Per expected image: every word of its embedding is in place."""
    foreign: list[Foreign] = field(default_factory=list)
    """Stamped bytes of images that are not this range's own."""
    own_late: int = 0
    """Bytes of the range's own (known) images where none were expected any more."""
    missing: int = 0
    """Bytes of an expected image still blank (never written)."""
    corrupt: int = 0
    """Bytes that are none of these (not a stamp, or an own stamp out of place)."""

    @property
    def foreign_bytes(self) -> int:
        return sum(f.nbytes for f in self.foreign)

    @property
    def clean(self) -> bool:
        """Nothing but what was expected: own parts in place, the rest blank."""
        return (
            all(self.parts_ok)
            and not self.foreign
            and not (self.own_late or self.missing or self.corrupt)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "parts_ok": self.parts_ok,
            "foreign": [[f.identity, f.nbytes, f.offset, f.word] for f in self.foreign],
            "own_late": self.own_late,
            "missing": self.missing,
            "corrupt": self.corrupt,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SlotReading:
        return cls(
            [bool(ok) for ok in data["parts_ok"]],
            [Foreign(*(int(v) for v in f)) for f in data["foreign"]],
            int(data["own_late"]),
            int(data["missing"]),
            int(data["corrupt"]),
        )


def read_slot(
    buffer: np.ndarray[Any, np.dtype[np.uint8]],
    part: int,
    expected: Sequence[int] = (),
    known: Sequence[int] = (),
) -> SlotReading:
    """Read ``buffer`` (a whole number of words): images ``expected`` must lie in place, one
    ``part`` bytes each from its start, and the rest be blank (zero, or :data:`MARKER`).
    Stamps of ``known`` identities elsewhere are the range's own late bytes; stamps of any
    other identity are foreign, grouped by identity."""
    if len(buffer) % WORD or part % WORD:
        raise ValueError("a slot is read in whole 8-byte words")
    w = buffer.view("<u8")
    per_image = part // WORD
    placed = np.zeros(len(w), dtype=bool)
    reading = SlotReading()
    for i, identity in enumerate(expected):
        span = slice(i * per_image, (i + 1) * per_image)
        ok = w[span] == words(identity, per_image)[: len(w[span])]
        placed[span] = ok
        reading.parts_ok.append(bool(ok.all()) and len(ok) == per_image)
    blank = np.isin(w, np.array(_BLANK, dtype=np.uint64))
    expected_span = np.zeros(len(w), dtype=bool)
    expected_span[: len(expected) * per_image] = True
    identities = (w >> np.uint64(32)).astype(np.int64)
    index = (w & np.uint64(0xFFFFFFFF)).astype(np.int64)
    stamp = (identities > 0) & (identities < MAX_IDENTITY) & (index < per_image) & ~blank
    own = np.isin(identities, np.array(list(expected) + list(known), dtype=np.int64)) & stamp
    other = stamp & ~own & ~placed
    reading.missing = WORD * int((blank & expected_span).sum())
    reading.own_late = WORD * int((own & ~placed & ~expected_span).sum())
    reading.corrupt = WORD * int((~placed & ~blank & ~other & ~(own & ~expected_span)).sum())
    if other.any():
        at = np.flatnonzero(other)
        found, first, counts = np.unique(identities[at], return_index=True, return_counts=True)
        for identity, i, count in zip(found, first, counts, strict=True):
            reading.foreign.append(
                Foreign(int(identity), WORD * int(count), WORD * int(at[i]), int(index[at[i]]))
            )
    return reading
