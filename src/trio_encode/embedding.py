"""The embedding a request scope ships, and the facts about its memory.

Three shapes: :class:`Embedding`, one contiguous tensor (registered per request when sent);
:class:`RowsEmbedding`, a request's images' tensors in order (each registered once, however
often it repeats, and sent as it lies); and :class:`ArenaEmbedding`, the request's images'
segments of the registered arena, sent as they lie (no registration, no concatenation).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import xxhash

from trio_encode.arena import Segment
from trio_encode.request_types import Grid, check_grids

DTYPE_NAMES: dict[torch.dtype, str] = {  # the one table of embedding dtypes and their names
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True, eq=False)
class Embedding:
    """A ``(rows, dim)`` tensor whose bytes are sent as they lie in memory.

    The tensor must be contiguous on the CPU: the transfer engine reads ``nbytes`` bytes from
    ``address``. Holding an :class:`Embedding` keeps the memory alive; a request scope drops its
    reference only after it has deregistered the memory.
    """

    tensor: torch.Tensor
    grids: tuple[Grid | None, ...] = field(default=())
    """Per image, the grid its model used (None for a fixed-grid model); empty: not reported."""
    lens: tuple[int, ...] | None = None
    """Rows of each image, in order (None: not reported, one image of every row)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "grids", check_grids(self.grids))
        if self.tensor.dim() != 2:
            raise ValueError(f"an embedding is (rows, dim), got shape {tuple(self.tensor.shape)}")
        if not self.tensor.is_contiguous():
            raise ValueError("an embedding must be contiguous: the engine sends raw bytes")
        if self.tensor.device.type != "cpu":
            raise ValueError("an embedding must be in CPU memory")
        if self.tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"unsupported embedding dtype {self.tensor.dtype}")
        if self.lens is not None and sum(self.lens) != self.tensor.shape[0]:
            raise ValueError(f"image lengths {self.lens} do not add up to {self.rows} rows")

    @property
    def image_lens(self) -> tuple[int, ...]:
        """Rows of each image, in order."""
        return self.lens if self.lens is not None else (self.rows,)

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel() * self.tensor.element_size())

    @property
    def rows(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def dim(self) -> int:
        return int(self.tensor.shape[1])

    @property
    def dtype(self) -> str:
        return DTYPE_NAMES[self.tensor.dtype]

    @cached_property
    def checksum(self) -> str:
        """``xxh3-64:<hex>`` of the bytes as they lie in memory; computed on first use (it
        reads every byte: call it off the event loop) and remembered."""
        return tensor_checksum(self.tensor)

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [(self.address, self.nbytes)]

    def copy(self) -> Embedding:
        """A private copy in fresh memory (used when the original's memory cannot be shared)."""
        return Embedding(
            self.tensor.clone(memory_format=torch.contiguous_format), self.grids, self.lens
        )

    def release(self) -> None:
        """Nothing to give back: dropping the last reference frees the tensor."""


class _Pieces:
    """An embedding as pieces, one per image, sent one after another as they lie: what
    :class:`RowsEmbedding` and :class:`ArenaEmbedding` share. Each says where its pieces lie
    (``segments``) and what their bytes are (``_piece_bytes``)."""

    views: list[torch.Tensor]
    """Each piece's ``(rows, dim)`` tensor, in order (one may repeat)."""
    grids: tuple[Grid | None, ...]
    """Per image, the grid its model used (None for a fixed-grid model)."""

    @property
    def segments(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def _piece_bytes(self) -> Iterator[memoryview]:
        raise NotImplementedError

    @property
    def address(self) -> int:
        return self.segments[0][0]

    @property
    def nbytes(self) -> int:
        return sum(nbytes for _, nbytes in self.segments)

    @property
    def rows(self) -> int:
        return sum(self.image_lens)

    @property
    def dim(self) -> int:
        return int(self.views[0].shape[1])

    @property
    def dtype(self) -> str:
        return DTYPE_NAMES[self.views[0].dtype]

    @property
    def image_lens(self) -> tuple[int, ...]:
        """Rows of each image (piece), in order."""
        return tuple(int(view.shape[0]) for view in self.views)

    @cached_property
    def checksum(self) -> str:
        """The checksum of the pieces' bytes one after another, as a receiver holds them
        (reads every byte: call it off the event loop first)."""
        digest = xxhash.xxh3_64()
        for piece in self._piece_bytes():
            digest.update(piece)
        return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"

    @property
    def tensor(self) -> torch.Tensor:
        """The rows as one contiguous tensor, like :attr:`Embedding.tensor` (here a copy: the
        pieces lie apart)."""
        return torch.cat(self.views, dim=0)

    def copy(self) -> Embedding:
        """The same bytes in one fresh tensor (outside the arena)."""
        return Embedding(self.tensor, self.grids, self.image_lens)


class RowsEmbedding(_Pieces):
    """A request's images' ``(rows, dim)`` tensors, in order, sent one after another as they
    lie: never concatenated, so a request naming one cached image 64 times costs 64
    ``(address, length)`` pairs, not 64 copies of its rows. Each distinct tensor is registered
    once (a row inside the registered arena is covered by the arena's registration)."""

    def __init__(
        self,
        rows: Sequence[torch.Tensor],
        grids: Sequence[Grid | None] = (),
        *,
        leases: Sequence[Segment] = (),
    ) -> None:
        if not rows:
            raise ValueError("an embedding needs at least one row tensor")
        self._parts = [Embedding(row) for row in rows]  # each checked: 2-D, contiguous, CPU
        if len({(part.dim, part.dtype) for part in self._parts}) != 1:
            raise ValueError("every tensor must have the same dim and dtype")
        self.views = [part.tensor for part in self._parts]
        self.grids = check_grids(grids)
        self._leases = list(leases)
        """Arena segments some rows lie in, one lease each, given back by :meth:`release`."""

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [(part.address, part.nbytes) for part in self._parts]

    def _piece_bytes(self) -> Iterator[memoryview]:
        for view in self.views:
            yield view.view(torch.uint8).numpy().data

    def release(self) -> None:
        """Give back the arena leases of rows that lie in the arena, once (on the event loop,
        after every transfer that reads them); other rows are freed with the last reference."""
        leases, self._leases = self._leases, []
        for segment in leases:
            segment.arena.release(segment)


class ArenaEmbedding(_Pieces):
    """A request's embedding as its images' arena segments, in order (one may repeat).

    Holds one lease on each listed segment, given back by :meth:`release` (on the event loop,
    after the scope has stopped every transfer that reads them). ``views`` are views of the
    segments' bytes, for callers that want tensors.
    """

    def __init__(
        self, parts: Sequence[tuple[Segment, torch.Tensor]], grids: Sequence[Grid | None] = ()
    ) -> None:
        if not parts:
            raise ValueError("an embedding needs at least one segment")
        first = parts[0][1]
        if any(row.dim() != 2 or row.shape[1] != first.shape[1] for _, row in parts):
            raise ValueError("every segment must hold (rows, dim) of the same dim")
        self._segments = [segment for segment, _ in parts]
        self.views = [row for _, row in parts]
        self.grids = check_grids(grids)
        self._released = False

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [(segment.address, segment.nbytes) for segment in self._segments]

    def _piece_bytes(self) -> Iterator[memoryview]:
        for segment in self._segments:
            yield segment.buffer

    def release(self) -> None:
        """Give the segments' leases back to the arena, once."""
        if self._released:
            return
        self._released = True
        for segment in self._segments:
            segment.arena.release(segment)


CHECKSUM_ALGORITHM = "xxh3-64"


def checksum_of(data: bytes | memoryview) -> str:
    """The checksum of raw bytes, in the ``algorithm:hex`` form the HTTP answers carry."""
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


def tensor_checksum(tensor: torch.Tensor) -> str:
    """:func:`checksum_of` a contiguous CPU tensor's bytes as they lie (reads every byte)."""
    return checksum_of(tensor.view(torch.uint8).numpy().data)
