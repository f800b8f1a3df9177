"""What a prefill rank needs: an HTTP client for /encode and /send (to one encoder, or to a
fleet with content-affinity routing and failover), and a landing pool."""

from trio_encode.client.fleet import EncoderList, FleetClient, FleetResult, NoEncoderAvailable
from trio_encode.client.health import HealthTracker
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
    "EncoderList",
    "EngineFailed",
    "FleetClient",
    "FleetResult",
    "HealthTracker",
    "LandingPool",
    "LandingSlot",
    "NoEncoderAvailable",
    "PoolExhausted",
    "RequestError",
    "RequestRejected",
    "SendResult",
    "TransferFailed",
    "UnexpectedResponse",
    "metric_value",
]
