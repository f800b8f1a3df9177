"""What a prefill rank needs: an HTTP client for /encode and /send, and a landing pool."""

from trio_encode.client.http import (
    EncodeClient,
    EncodeResult,
    SendResult,
    TransferFailed,
    UnexpectedResponse,
    metric_value,
)
from trio_encode.client.receiver import ChecksumMismatch, LandingPool, LandingSlot, PoolExhausted
from trio_encode.errors import EngineFailed, RequestError, RequestRejected

__all__ = [
    "ChecksumMismatch",
    "EncodeClient",
    "EncodeResult",
    "EngineFailed",
    "LandingPool",
    "LandingSlot",
    "PoolExhausted",
    "RequestError",
    "RequestRejected",
    "SendResult",
    "TransferFailed",
    "UnexpectedResponse",
    "metric_value",
]
