"""Transfer engines: the interface the scopes use, and its Mooncake build (the in-memory one
for tests is :mod:`trio_encode.testing.memory_engine`)."""

from trio_encode.engine.base import (
    ADDRESS_OVERLAPPED,
    ENGINE_CODE_MEANINGS,
    INVALID_ADDRESS,
    TRANSFER_FAILED,
    EngineError,
    TransferEngine,
    Write,
    engine_code_meaning,
)

__all__ = [
    "ADDRESS_OVERLAPPED",
    "ENGINE_CODE_MEANINGS",
    "INVALID_ADDRESS",
    "TRANSFER_FAILED",
    "EngineError",
    "TransferEngine",
    "Write",
    "engine_code_meaning",
]
