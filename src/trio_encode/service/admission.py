"""Whether a new request may cost this server anything: refused (503) at a capacity limit
before any of its items is loaded."""

from __future__ import annotations

from trio_encode.errors import Overloaded
from trio_encode.scopes import ScopeRegistry
from trio_encode.service.settings import ServiceSettings


def admit(req_id: str, registry: ScopeRegistry, limits: ServiceSettings) -> None:
    """Raise :class:`Overloaded` when the live requests are as many, or hold as many
    embedding bytes, as the server holds."""
    if len(registry) >= limits.max_live_scopes:
        raise Overloaded(
            f"{len(registry)} requests are alive, the most this server holds "
            "(max_live_scopes); retry when some have been sent",
            req_id=req_id,
        )
    held = registry.held.nbytes
    if held >= limits.max_held_bytes:
        raise Overloaded(
            f"live requests hold {held} embedding bytes, the most this server "
            "holds (max_held_bytes); retry when some have been sent",
            req_id=req_id,
        )
