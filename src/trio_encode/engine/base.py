"""The async transfer-engine interface that request scopes are written against.

The interface is deliberately the smallest Mooncake offers: register a local range, deregister
it by start address, write bytes from local memory into a remote engine's registered memory.
Every failing call raises :class:`EngineError` with the engine's own return code, so no caller
can ignore a failure the way SGLang's encode server once ignored ``transfer_sync`` results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, replace
from typing import Literal, Protocol, runtime_checkable

import trio

# Mooncake's return codes that the rules below depend on (mooncake/transfer_engine error.h).
TRANSFER_FAILED = -1
INVALID_ADDRESS = -3
ADDRESS_OVERLAPPED = -7

EngineCall = Literal["initialize", "register", "deregister", "transfer"]

# What each of Mooncake's return codes means and what usually fixes it (its error.h, plus what
# the Python binding does with it), so an operator reading a 502 need not look it up.
ENGINE_CODE_MEANINGS: dict[int, str] = {
    TRANSFER_FAILED: (
        "invalid argument or failed transfer: the receiver's engine is unreachable, or the "
        "remote address is not inside a buffer the receiver registered"
    ),
    -2: "too many requests: the engine's transfer queue is full; retry later",
    INVALID_ADDRESS: "address not registered: no registration starts at this address",
    -4: "batch busy: the transfer batch still has work in flight",
    -6: "device not found: the configured RDMA device does not exist on this host",
    ADDRESS_OVERLAPPED: "address overlapped: the range overlaps a live registration",
    -101: "DNS failure: the peer's host name cannot be resolved",
    -102: "socket error: a connection to the peer could not be made or was lost",
    -103: "malformed JSON in the peer's handshake or metadata",
    -104: "the peer rejected the handshake",
    -200: "metadata error: the metadata server is unreachable or lacks the entry",
    -201: "endpoint error: the connection to the peer could not be set up",
    -202: "context error: the RDMA device context could not be set up",
    -203: "endpoint not found: the peer's endpoint is unknown",
    -204: "endpoint id mismatch: the peer restarted; its session is new",
    -300: "NUMA error: memory locality could not be determined",
    -301: "clock error",
    -302: "out of memory",
    -303: "not implemented by this engine or protocol",
}


def engine_code_meaning(code: int) -> str:
    """What Mooncake's return ``code`` means, in words an operator can act on."""
    return ENGINE_CODE_MEANINGS.get(code, "an error code this server does not know")


@dataclass(eq=False, repr=False)  # an exception: equal only to itself, shown by its message
class EngineError(Exception):
    """A transfer-engine call returned an error code.

    Carries the facts an operator needs: which call, the engine's return code, and the
    addresses and peer involved.
    """

    call: EngineCall
    code: int
    _: KW_ONLY
    address: int | None = None
    length: int | None = None
    session_id: str | None = None
    remote_address: int | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        super().__init__(self._describe())

    def fresh(self) -> EngineError:
        """The same error as a new exception, with no traceback and nothing chained: one for
        each caller to raise (see :meth:`trio_encode.errors.RequestError.fresh`)."""
        return replace(self)

    def _describe(self) -> str:
        parts = [f"transfer engine {self.call} failed with code {self.code}"]
        if self.session_id is not None:
            parts.append(f"session_id={self.session_id}")
        if self.address is not None:
            parts.append(f"address={self.address:#x}")
        if self.remote_address is not None:
            parts.append(f"remote_address={self.remote_address:#x}")
        if self.length is not None:
            parts.append(f"length={self.length}")
        if self.detail:
            parts.append(self.detail)
        return ", ".join(parts)


@dataclass(frozen=True)
class Write:
    """What one transfer call writes: ``segments`` (local address, length), back to back, into
    ``session_id``'s registered memory from ``remote_address`` on."""

    session_id: str
    segments: Sequence[tuple[int, int]]
    remote_address: int

    @property
    def nbytes(self) -> int:
        return sum(length for _, length in self.segments)

    def failed(self, code: int, detail: str) -> EngineError:
        """The :class:`EngineError` for this write failing with ``code``."""
        return EngineError(
            "transfer",
            code,
            address=self.segments[0][0] if self.segments else None,
            remote_address=self.remote_address,
            length=self.nbytes,
            session_id=self.session_id,
            detail=detail,
        )


@runtime_checkable
class TransferEngine(Protocol):
    """What a request scope needs from a transfer engine.

    Implementations must run blocking work so that a cancelled caller still waits for it to
    finish (a worker thread cannot be cancelled; abandoning it would let the caller free memory
    the thread still reads). Calls therefore either do not start or run to completion.
    """

    @property
    def session_id(self) -> str:
        """This engine's address (``host:port``) as peers name it."""
        ...

    async def register(self, address: int, length: int) -> None:
        """Register ``[address, address + length)`` for transfers; -7 if it overlaps a live one."""
        ...

    async def deregister(self, address: int) -> None:
        """Release the registration that starts at ``address``; -3 if there is none."""
        ...

    async def transfer(self, write: Write, *, submitted: trio.Event | None = None) -> None:
        """Do ``write`` as one call: every segment is in flight at once.

        Waiting for a thread (or a slot of the receiver's bound) is cancellable, and a
        caller cancelled then gets ``trio.Cancelled`` with nothing submitted. ``submitted`` is
        set the moment the call is bound to submit (no checkpoint lies between). From then on
        it returns when every segment has landed, or raises :class:`EngineError` when one
        failed or the engine stopped waiting (its own timeout); a caller cancelled then (its
        deadline, a shutdown) makes it stop waiting promptly and gets ``trio.Cancelled``,
        unless every segment had ended by then. A transfer it stopped waiting for may still
        read local memory: it stays :meth:`reading` until the engine reports it ended."""
        ...

    def reading(self, address: int, length: int) -> bool:
        """Whether a transfer this engine stopped waiting for may still read (or be about to
        read) any byte of ``[address, address + length)``: that memory must not be reused."""
        ...

    async def settled(self, address: int, length: int) -> None:
        """Return once :meth:`reading` is false for the range, asking the engine for the
        status of the transfers it stopped waiting for meanwhile."""
        ...
