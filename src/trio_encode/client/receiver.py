"""The receiving side of a transfer: one registered landing pool per prefill rank.

Registering memory is slow on RDMA (pages are pinned), so a rank registers one large pool once
and hands out slots from it, rather than registering a buffer per request. A slot is the
``buffer_address`` a rank names in ``/send``; once the answer arrives its bytes have landed and
can be read back as a tensor. Release the slot when done with it.
"""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
import trio

from trio_encode.embedding import TORCH_DTYPES, checksum_of
from trio_encode.engine import TransferEngine

_ALIGN = 64  # cache-line aligned slots: no two slots share a line the engine writes


class PoolExhausted(Exception):
    """No free range in the pool is large enough; release slots or use a larger pool."""


class ChecksumMismatch(Exception):
    """The bytes that landed are not the bytes the server encoded."""


@dataclass(eq=False)
class LandingSlot:
    """``nbytes`` bytes of the pool at ``address``; valid until :meth:`release`."""

    pool: LandingPool
    offset: int
    nbytes: int
    released: bool = field(default=False)

    @property
    def address(self) -> int:
        """The ``buffer_address`` to name in ``/send``."""
        return self.pool.address + self.offset

    def raw(self) -> torch.Tensor:
        """The slot's bytes, as a view into the pool (no copy)."""
        self._check()
        return self.pool.tensor[self.offset : self.offset + self.nbytes]

    def read(self, rows: int, dim: int, dtype: str) -> torch.Tensor:
        """A copy of the landed embedding as a ``(rows, dim)`` tensor of ``dtype``."""
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}")
        item = TORCH_DTYPES[dtype].itemsize
        if rows * dim * item > self.nbytes:
            raise ValueError(f"{rows}x{dim} {dtype} does not fit in a {self.nbytes}-byte slot")
        data = self.raw()[: rows * dim * item]
        return data.view(TORCH_DTYPES[dtype]).reshape(rows, dim).clone()

    def verify(self, nbytes: int, checksum: str) -> None:
        """Check that the first ``nbytes`` bytes are those the server encoded: ``checksum``
        is the ``checksum`` field of its ``/encode`` or ``/send`` answer.

        Raises :class:`ChecksumMismatch` if not. Reads every byte (about 10 GB/s).
        """
        if nbytes > self.nbytes:
            raise ValueError(f"{nbytes} bytes do not fit in a {self.nbytes}-byte slot")
        landed = checksum_of(self.raw()[:nbytes].numpy().data)
        if landed != checksum:
            raise ChecksumMismatch(
                f"the {nbytes} bytes at {self.address:#x} hash to {landed}, the server sent "
                f"{checksum}"
            )

    def release(self) -> None:
        """Give the range back to the pool (once; later calls are ignored)."""
        if not self.released:
            self.released = True
            self.pool._free(self.offset, self.nbytes)

    def _check(self) -> None:
        if self.released:
            raise RuntimeError("the slot was released")


class LandingPool:
    """A registered ``uint8`` tensor on one engine, carved into slots (first fit)."""

    def __init__(self, engine: TransferEngine, tensor: torch.Tensor) -> None:
        self.engine = engine
        self.tensor = tensor
        self._free_ranges: list[tuple[int, int]] = [(0, tensor.numel())]  # (offset, length)

    @classmethod
    @asynccontextmanager
    async def open(cls, engine: TransferEngine, nbytes: int) -> AsyncIterator[LandingPool]:
        """Allocate and register ``nbytes`` of zeroed memory on ``engine``; deregister on exit
        (the memory stays alive until then, so no transfer can land in freed memory)."""
        if nbytes <= 0:
            raise ValueError("a landing pool needs a positive size")
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        pool = cls(engine, tensor)
        await engine.register(pool.address, nbytes)
        try:
            yield pool
        finally:
            # Shielded: a cancelled owner must still give the registration back.
            with trio.CancelScope(shield=True):
                await engine.deregister(pool.address)

    @property
    def session_id(self) -> str:
        """The ``session_id`` to name in ``/send``."""
        return self.engine.session_id

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free_ranges)

    def allocate(self, nbytes: int) -> LandingSlot:
        """A slot of at least ``nbytes`` bytes; :class:`PoolExhausted` if none is free."""
        if nbytes <= 0:
            raise ValueError("a slot needs a positive size")
        size = -(-nbytes // _ALIGN) * _ALIGN
        for index, (offset, length) in enumerate(self._free_ranges):
            if length >= size:
                if length == size:
                    del self._free_ranges[index]
                else:
                    self._free_ranges[index] = (offset + size, length - size)
                return LandingSlot(self, offset, size)
        raise PoolExhausted(
            f"no free {size}-byte range in the landing pool ({self.free_bytes} bytes free)"
        )

    def _free(self, offset: int, length: int) -> None:
        index = bisect.bisect(self._free_ranges, (offset, length))
        self._free_ranges.insert(index, (offset, length))
        # Merge with the neighbours so large slots stay possible.
        merged: list[tuple[int, int]] = []
        for start, size in self._free_ranges:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free_ranges = merged
