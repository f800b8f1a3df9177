"""The embedding a request scope ships, and the facts about its memory.

Two shapes, differing in how many pieces the bytes lie in: :class:`Embedding`, one
contiguous tensor (registered per request when sent), and :class:`RowsEmbedding`, a request's
images' tensors in order, sent as they lie (each registered once, however often it repeats; a
row inside the registered arena is covered by the arena's registration, and its segment's
lease is held until the embedding is released). :class:`ArenaEmbedding` is the latter with
every row in the arena: nothing to register, nothing to concatenate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import xxhash

from trio_encode.arena import Segment
from trio_encode.request_types import IMAGES, Grid, Media, check_grids

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
    media: Media = IMAGES
    """Which modality the rows are, and the metadata beside them."""

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
            self.tensor.clone(memory_format=torch.contiguous_format),
            self.grids,
            self.lens,
            self.media,
        )

    def release(self) -> None:
        """Nothing to give back: dropping the last reference frees the tensor."""


class RowsEmbedding:
    """A request's images' ``(rows, dim)`` tensors, in order, sent one after another as they
    lie: never concatenated, so a request naming one cached image 64 times costs 64
    ``(address, length)`` pairs, not 64 copies of its rows."""

    def __init__(
        self,
        rows: Sequence[torch.Tensor],
        grids: Sequence[Grid | None] = (),
        *,
        leases: Sequence[Segment] = (),
        media: Media = IMAGES,
    ) -> None:
        if not rows:
            raise ValueError("an embedding needs at least one row tensor")
        self._parts = [Embedding(row) for row in rows]  # each checked: 2-D, contiguous, CPU
        if len({(part.dim, part.dtype) for part in self._parts}) != 1:
            raise ValueError("every tensor must have the same dim and dtype")
        self.views = [part.tensor for part in self._parts]
        """Each image's ``(rows, dim)`` tensor, in order (one may repeat)."""
        self.grids = check_grids(grids)
        """Per image, the grid its model used (None for a fixed-grid model)."""
        self._leases = list(leases)
        """Arena segments some rows lie in, one lease each, given back by :meth:`release`."""
        self.media = media
        """Which modality the rows are, and the metadata beside them."""

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [(part.address, part.nbytes) for part in self._parts]

    @property
    def address(self) -> int:
        return self._parts[0].address

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self._parts)

    @property
    def rows(self) -> int:
        return sum(self.image_lens)

    @property
    def dim(self) -> int:
        return self._parts[0].dim

    @property
    def dtype(self) -> str:
        return self._parts[0].dtype

    @property
    def image_lens(self) -> tuple[int, ...]:
        """Rows of each image, in order."""
        return tuple(part.rows for part in self._parts)

    @cached_property
    def checksum(self) -> str:
        """The checksum of the rows' bytes one after another, as a receiver holds them
        (reads every byte: call it off the event loop first)."""
        digest = xxhash.xxh3_64()
        for view in self.views:
            digest.update(view.view(torch.uint8).numpy().data)
        return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"

    @property
    def tensor(self) -> torch.Tensor:
        """The rows as one contiguous tensor, like :attr:`Embedding.tensor` (here a copy: the
        rows lie apart)."""
        return torch.cat(self.views, dim=0)

    def copy(self) -> Embedding:
        """The same bytes in one fresh tensor (outside the arena)."""
        return Embedding(self.tensor, self.grids, self.image_lens, self.media)

    def release(self) -> None:
        """Give back the arena leases of rows that lie in the arena, once (on the event loop,
        after every transfer that reads them); other rows are freed with the last reference."""
        leases, self._leases = self._leases, []
        for segment in leases:
            segment.arena.release(segment)


class ArenaEmbedding(RowsEmbedding):
    """A :class:`RowsEmbedding` whose every row is a view of an arena segment, given as
    ``(segment, view)`` pairs in order (one may repeat). It holds one lease on each listed
    segment, given back by :meth:`release` (on the event loop, after the scope has stopped
    every transfer that reads them)."""

    def __init__(
        self,
        parts: Sequence[tuple[Segment, torch.Tensor]],
        grids: Sequence[Grid | None] = (),
        media: Media = IMAGES,
    ) -> None:
        for segment, view in parts:
            start = view.data_ptr() - segment.address
            if not 0 <= start <= segment.nbytes - view.numel() * view.element_size():
                raise ValueError("a row must lie in its segment")
        super().__init__(
            [view for _, view in parts],
            grids,
            leases=[segment for segment, _ in parts],
            media=media,
        )


CHECKSUM_ALGORITHM = "xxh3-64"


def checksum_of(data: bytes | memoryview) -> str:
    """The checksum of raw bytes, in the ``algorithm:hex`` form the HTTP answers carry."""
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


def tensor_checksum(tensor: torch.Tensor) -> str:
    """:func:`checksum_of` a contiguous CPU tensor's bytes as they lie (reads every byte)."""
    return checksum_of(tensor.view(torch.uint8).numpy().data)
