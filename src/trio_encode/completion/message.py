"""SGLang's completion message, written as pickle bytes by this package (no SGLang import).

On SGLang's Mooncake path a prefill rank completes a part of a request only when a message
arrives on its ZMQ PULL socket (``tcp://{prefill_host}:{embedding_port}``, fields of each
``/send``): SGLang's own encoder pushes, after each rank's transfer, its ``EmbeddingData``
without the tensor. The rank loads it with SGLang's ``safe_pickle_loads``, an unpickler that
resolves only an exact list of ``(module, name)`` globals and refuses every other one. These
bytes name these globals, all on that list (SGLang 0.5.23):

- ``sglang.srt.disaggregation.encoder.receiver.EmbeddingData``, the object, rebuilt as pickle
  rebuilds a plain instance (``__new__`` without arguments, then its ``__dict__``);
- ``sglang.srt.multimodal.modality.Modality``, called with the member's value (``IMAGE`` 1,
  ``VIDEO`` 2, ``AUDIO`` 3: its ``auto()`` members in that order);
- ``torch.<dtype>`` (``torch.bfloat16``...), the embedding's dtype, as ``pickle`` writes one;
- ``torch.LongTensor``, called with a list of ints: an audio part's grid, its clips' lengths
  (SGLang's receiver calls ``.flatten()`` on it, which a list lacks).

The ``__dict__`` holds what ``EmbeddingData.copy_without_embedding()`` leaves, in its order:
``req_id`` (the part's id), ``num_parts``, ``part_idx``, ``grid_dim``, ``modality``,
``embedding`` (None), ``send_time`` (None), ``dtype``, ``shape`` (``[rows, dim]``),
``_mr_ptr`` (None), ``error_msg``, ``error_code``, then the part's extra metadata, as SGLang's
encoder passes it as keyword arguments (a video's ``video_timestamps`` and
``second_per_grid_ts``, which SGLang's ``MultiModalEmbeddingData`` copies per part and chains
as lists). An error message has no grid, dtype or shape (None) and a message and an HTTP status
instead. Other values are only None, ints, floats, strings and lists, so nothing else needs
allowing.
Protocol 2 opcodes, no memo: the smallest subset every unpickler since Python 2.3 reads.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

EMBEDDING_DATA = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.multimodal.modality", "Modality")
LONG_TENSOR = ("torch", "LongTensor")
MODALITIES = {"IMAGE": 1, "VIDEO": 2, "AUDIO": 3}
"""``Modality[name].value`` by name: the enum's ``auto()`` members in order."""
META = frozenset({"video_timestamps", "second_per_grid_ts"})
"""The extra metadata a part may carry (SGLang's general video metadata)."""
DTYPES = frozenset({"float32", "bfloat16", "float16"})
"""Embedding dtypes, by their ``torch`` attribute names."""


Value = None | bool | int | float | str | Sequence["Value"]


@dataclass(frozen=True)
class CompletionMessage:
    """One part's outcome for one prefill rank: its bytes landed, or why it never will."""

    req_id: str
    num_parts: int
    part_idx: int
    grid_dim: Sequence[Sequence[int]] | None = None
    shape: tuple[int, int] | None = None
    dtype: str | None = None
    error_msg: str | None = None
    error_code: int | None = None
    modality: str = "IMAGE"
    """SGLang's ``Modality`` member name: which grid list the prefill files the part under."""
    meta: tuple[tuple[str, float | list[float] | list[list[float]]], ...] = ()
    """Extra metadata of the part (names in :data:`META`), in the order SGLang writes it."""

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"no SGLang modality is named {self.modality!r}")
        unknown = {name for name, _ in self.meta} - META
        if unknown:
            raise ValueError(f"no part metadata is named {sorted(unknown)}")
        if not 0 <= self.part_idx < self.num_parts:
            raise ValueError(f"part_idx {self.part_idx} is not in [0, {self.num_parts})")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"no torch dtype is named {self.dtype!r}")
        if (self.error_msg is None) == (self.shape is None):
            raise ValueError("a message has a shape (done) or an error_msg (failed), not both")

    @classmethod
    def failed(
        cls, req_id: str, num_parts: int, part_idx: int, message: str, code: int
    ) -> CompletionMessage:
        return cls(req_id, num_parts, part_idx, error_msg=message, error_code=code)

    def to_bytes(self) -> bytes:
        """The pickle SGLang's ``safe_pickle_loads`` turns into its ``EmbeddingData``."""
        grid = None if self.grid_dim is None else [list(g) for g in self.grid_dim]
        out = bytearray(b"\x80\x02")  # PROTO 2
        _global(out, *EMBEDDING_DATA)
        out += b")\x81}("  # EMPTY_TUPLE NEWOBJ EMPTY_DICT MARK
        head: tuple[tuple[str, Value], ...] = (
            ("req_id", self.req_id),
            ("num_parts", self.num_parts),
            ("part_idx", self.part_idx),
        )
        for key, value in head:
            _value(out, key)
            _value(out, value)
        _value(out, "grid_dim")
        if grid is not None and self.modality == "AUDIO":
            # SGLang's receiver flattens an audio part's grid with ``.flatten()``: a tensor,
            # its clips' lengths in a row, as its own encoder sends them.
            _global(out, *LONG_TENSOR)
            _value(out, [length for row in grid for length in row])
            out += b"\x85R"  # TUPLE1 REDUCE: torch.LongTensor(lengths)
        else:
            _value(out, grid)
        _value(out, "modality")
        _global(out, *MODALITY)
        _value(out, MODALITIES[self.modality])
        out += b"\x85R"  # TUPLE1 REDUCE: Modality(value)
        _value(out, "embedding")
        _value(out, None)
        _value(out, "send_time")
        _value(out, None)
        _value(out, "dtype")
        if self.dtype is None:
            _value(out, None)
        else:
            _global(out, "torch", self.dtype)
        tail: tuple[tuple[str, Value], ...] = (
            ("shape", None if self.shape is None else list(self.shape)),
            ("_mr_ptr", None),
            ("error_msg", self.error_msg),
            ("error_code", self.error_code),
            *self.meta,
        )
        for key, value in tail:
            _value(out, key)
            _value(out, value)
        out += b"ub."  # SETITEMS BUILD STOP
        return bytes(out)


def _global(out: bytearray, module: str, name: str) -> None:
    if "\n" in module + name:
        raise ValueError("a global's name has no newline")
    out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _value(out: bytearray, value: Value) -> None:
    if value is None:
        out += b"N"
    elif value is True:
        out += b"\x88"
    elif value is False:
        out += b"\x89"
    elif isinstance(value, int):
        if -(2**31) <= value < 2**31:
            out += b"J" + struct.pack("<i", value)  # BININT
        else:
            raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            if len(raw) > 255:
                raise ValueError("integer too large for a message")
            out += b"\x8a" + bytes([len(raw)]) + raw  # LONG1
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)  # BINFLOAT
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out += b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE
    elif isinstance(value, list | tuple):
        out += b"]"  # EMPTY_LIST
        if value:
            out += b"("  # MARK
            for item in value:
                _value(out, item)
            out += b"e"  # APPENDS
    else:
        raise TypeError(f"a message holds no {type(value).__name__}")
