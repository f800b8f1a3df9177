"""Transfer engines: the interface the scopes use, and its Mooncake and in-memory builds."""

from trio_encode.engine.base import (
    ADDRESS_OVERLAPPED,
    INVALID_ADDRESS,
    TRANSFER_FAILED,
    EngineError,
    TransferEngine,
)

__all__ = [
    "ADDRESS_OVERLAPPED",
    "INVALID_ADDRESS",
    "TRANSFER_FAILED",
    "EngineError",
    "TransferEngine",
]
