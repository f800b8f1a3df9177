"""Byte sizes with units: ``64MiB`` in a flag, a variable or a file, an ``int`` in the code.

Binary units (``KiB``, ``MiB``, ``GiB``, ``TiB``) are powers of 1024 and decimal ones (``kB``,
``MB``, ``GB``, ``TB``) powers of 1000, as the IEC and SI define them; a plain number is bytes.
Sizes are shown back in the largest binary unit that divides them, so ``--help`` reads
``64MiB`` rather than ``67108864``.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = {
    "": 1,
    "b": 1,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(value: object) -> object:
    """``"64MiB"`` -> 67108864; an int (or anything not a string) is passed on unchanged for
    pydantic to check. A fraction of a byte is refused rather than rounded."""
    if not isinstance(value, str):
        return value
    match = _SIZE.fullmatch(value)
    unit = match[2].lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{value!r} is not a size: give bytes, or a number with one of the units "
            "KiB, MiB, GiB, TiB (1024-based) or kB, MB, GB, TB (1000-based), e.g. 64MiB"
        )
    scaled = float(match[1]) * _UNITS[unit] if "." in match[1] else int(match[1]) * _UNITS[unit]
    if scaled != int(scaled):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(scaled)


def format_size(nbytes: int) -> str:
    """67108864 -> ``"64MiB"``; sizes no binary unit divides stay plain bytes."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return str(nbytes)


ByteSize = Annotated[
    int,
    BeforeValidator(parse_size),
    PlainSerializer(format_size, return_type=str, when_used="json"),
    WithJsonSchema({"type": ["integer", "string"], "examples": ["64MiB"]}),
]
"""A count of bytes that also accepts a number with a unit (``"64MiB"``, ``"1.5GB"``)."""
