"""What a prefill rank needs: an HTTP client for /encode and /send, and a landing pool."""

from trio_encode.client.http import (
    EncodeClient,
    EncodeResult,
    RequestRejected,
    SendResult,
    TransferFailed,
    UnexpectedResponse,
    metric_value,
)
from trio_encode.client.receiver import ChecksumMismatch, LandingPool, LandingSlot, PoolExhausted

__all__ = [
    "ChecksumMismatch",
    "EncodeClient",
    "EncodeResult",
    "LandingPool",
    "LandingSlot",
    "PoolExhausted",
    "RequestRejected",
    "SendResult",
    "TransferFailed",
    "UnexpectedResponse",
    "metric_value",
]
