"""What the request scopes and the service obey, declared once (``serve``'s options and
environment variables are generated from it)."""

from __future__ import annotations

from pydantic.dataclasses import dataclass as pydantic_dataclass

from trio_encode.declare import SETTINGS, in_group
from trio_encode.sizes import ByteSize, GiB

server_setting = in_group("server")


@pydantic_dataclass(frozen=True, config=SETTINGS)
class ServiceSettings:
    """What the request scopes obey."""

    send_timeout: float = server_setting(180.0, gt=0, allow_inf_nan=False)
    """Seconds from a request's first /encode until its scope is ended whatever the clients do (the
    backstop): waiting calls get 504, its memory is released."""
    shutdown_grace: float = server_setting(30.0, ge=0)
    """On SIGINT/SIGTERM, seconds live requests may still finish (new ones get 503) before they are
    cut short."""
    remember_released: int = server_setting(100_000, ge=0)
    """Ended req_ids remembered, so a late call gets 410 rather than a new scope."""
    remember_seconds: float = server_setting(3600.0, ge=0)
    """Seconds an ended req_id is remembered for (see remember_released)."""
    pull_timeout: float = server_setting(180.0, gt=0)
    """Seconds a metadata pull (/scheduler_receive_meta_data) for a req_id that no /encode has named
    yet waits for one (then 504); once named, the request's own deadline bounds the wait."""
    max_live_scopes: int = server_setting(4096, gt=0)
    """Requests alive at once (encoded, not yet sent to every receiver); a new /encode past it gets
    503, so clients that never /send cannot pile scopes up to the backstop."""
    max_held_bytes: ByteSize = server_setting(2 * GiB, gt=0)
    """Embedding bytes the live requests may hold together (a cached row several share counts once);
    a new /encode past it gets 503 until sends complete."""
    receivers_match_prefill_host: bool = server_setting(True)
    """When an /encode names prefill_host (SGLang's does), its /send calls must name receivers on
    that host (403 otherwise); turn off for tensor-parallel ranks spread over several hosts."""
    completion_messages: bool = server_setting(True)
    """Push SGLang's completion message to the ZMQ endpoint (prefill_host, embedding_port) a /send
    names once its bytes landed, and the error to those an /encode names when it fails: SGLang's
    prefill completes a part only on it."""
    completion_timeout: float = server_setting(5.0, gt=0)
    """Seconds a completion message may take to reach its prefill rank; past it, that /send gets 502
    (completion_failed)."""
