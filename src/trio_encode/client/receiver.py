"""The receiving side of a transfer: one registered landing pool per prefill rank.

Registering memory is slow on RDMA (pages are pinned), so a rank registers one large pool once
and hands out slots from it, rather than registering a buffer per request. A slot is the
``buffer_address`` a rank names in ``/send``; once the answer arrives its bytes have landed and
can be read back as a tensor. Release the slot when done with it.

A slot whose ``/send`` did not answer 200 (an error, a timeout, a dropped connection) is not
released but quarantined (:meth:`LandingSlot.quarantine`): the server may still have a transfer
of that request in flight into it (Mooncake cannot cancel one), and bytes already in the
kernel's socket buffers can land even after that transfer failed. The pool keeps its range out
of use for ``stale_seconds`` (the bound ``docs/api.md`` states), so no later request lands
where they may still arrive. :meth:`LandingSlot.verify` stays the check before any use.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch
import trio

from trio_encode.arena import FreeRanges
from trio_encode.embedding import TORCH_DTYPES, checksum_of
from trio_encode.engine import TransferEngine

_ALIGN = 64  # cache-line aligned slots: no two slots share a line the engine writes

STALE_SECONDS = 360.0
"""How long a slot whose ``/send`` failed stays out of use by default: the server's default
``--send-timeout`` (180 s: a send it has not withdrawn may start its transfer until then) plus
its default ``--engine-progress-timeout`` (175 s: how long a stalled transfer may go on before
Mooncake fails it), plus 5 s for bytes still in socket buffers. Servers with other settings
need ``send_timeout + progress_timeout + 5``."""


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

    def quarantine(self) -> None:
        """Give the slot up after a ``/send`` into it failed (an error answer, a timeout, a
        dropped connection): bytes of that request may still land in it, so the pool keeps its
        range out of use for its ``stale_seconds`` before handing it out again. Once; later
        calls (and a later :meth:`release`) are ignored."""
        if not self.released:
            self.released = True
            self.pool._quarantine(self.offset, self.nbytes)

    def _check(self) -> None:
        if self.released:
            raise RuntimeError("the slot was released")


class LandingPool:
    """A registered ``uint8`` tensor on one engine, carved into slots (first fit)."""

    def __init__(
        self,
        engine: TransferEngine,
        tensor: torch.Tensor,
        *,
        stale_seconds: float = STALE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stale_seconds < 0:
            raise ValueError("stale_seconds must be >= 0")
        self.engine = engine
        self.tensor = tensor
        self.stale_seconds = stale_seconds
        """Seconds a quarantined slot stays out of use (:data:`STALE_SECONDS` by default)."""
        self._clock = clock
        self._free_ranges = FreeRanges(tensor.numel())
        self._quarantined: list[tuple[float, int, int]] = []  # (usable again at, offset, length)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        engine: TransferEngine,
        nbytes: int,
        *,
        stale_seconds: float = STALE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> AsyncIterator[LandingPool]:
        """Allocate and register ``nbytes`` of zeroed memory on ``engine``; deregister on exit
        (the memory stays alive until then, so no transfer can land in freed memory)."""
        if nbytes <= 0:
            raise ValueError("a landing pool needs a positive size")
        tensor = torch.zeros(nbytes, dtype=torch.uint8)
        pool = cls(engine, tensor, stale_seconds=stale_seconds, clock=clock)
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
        """Bytes free for new slots now (quarantined ranges whose time has come included)."""
        self._reclaim()
        return self._free_ranges.total

    @property
    def quarantined_bytes(self) -> int:
        """Bytes of quarantined slots still out of use."""
        self._reclaim()
        return sum(length for _, _, length in self._quarantined)

    def allocate(self, nbytes: int) -> LandingSlot:
        """A slot of at least ``nbytes`` bytes; :class:`PoolExhausted` if none is free (a
        quarantined range is not, until its ``stale_seconds`` have passed)."""
        if nbytes <= 0:
            raise ValueError("a slot needs a positive size")
        self._reclaim()
        size = -(-nbytes // _ALIGN) * _ALIGN
        offset = self._free_ranges.take(size)
        if offset is not None:
            return LandingSlot(self, offset, size)
        raise PoolExhausted(
            f"no free {size}-byte range in the landing pool ({self.free_bytes} bytes free, "
            f"{self.quarantined_bytes} quarantined after failed sends)"
        )

    def _quarantine(self, offset: int, length: int) -> None:
        self._quarantined.append((self._clock() + self.stale_seconds, offset, length))

    def _reclaim(self) -> None:
        """Free the quarantined ranges whose time has passed."""
        if not self._quarantined:
            return
        now = self._clock()
        due = [entry for entry in self._quarantined if entry[0] <= now]
        if due:
            self._quarantined = [entry for entry in self._quarantined if entry[0] > now]
            for _, offset, length in due:
                self._free(offset, length)

    def _free(self, offset: int, length: int) -> None:
        self._free_ranges.give(offset, length)
