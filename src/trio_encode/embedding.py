"""The embedding a request scope ships: a contiguous tensor and the facts about its memory."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import xxhash

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


@dataclass(frozen=True, eq=False)
class Embedding:
    """A ``(rows, dim)`` tensor whose bytes are sent as they lie in memory.

    The tensor must be contiguous on the CPU: the transfer engine reads ``nbytes`` bytes from
    ``address``. Holding an :class:`Embedding` keeps the memory alive; a request scope drops its
    reference only after it has deregistered the memory.
    """

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if self.tensor.dim() != 2:
            raise ValueError(f"an embedding is (rows, dim), got shape {tuple(self.tensor.shape)}")
        if not self.tensor.is_contiguous():
            raise ValueError("an embedding must be contiguous: the engine sends raw bytes")
        if self.tensor.device.type != "cpu":
            raise ValueError("an embedding must be in CPU memory")
        if self.tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"unsupported embedding dtype {self.tensor.dtype}")

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
        return _DTYPE_NAMES[self.tensor.dtype]

    @cached_property
    def checksum(self) -> str:
        """``xxh3-64:<hex>`` of the bytes as they lie in memory; computed on first use (it
        reads every byte: call it off the event loop) and remembered."""
        return checksum_of(self.tensor.view(torch.uint8).numpy().data)

    def copy(self) -> Embedding:
        """A private copy in fresh memory (used when the original's memory cannot be shared)."""
        return Embedding(self.tensor.clone(memory_format=torch.contiguous_format))


CHECKSUM_ALGORITHM = "xxh3-64"


def checksum_of(data: bytes | memoryview) -> str:
    """The checksum of raw bytes, in the ``algorithm:hex`` form the HTTP answers carry."""
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"
