"""The :class:`TransferEngine` over Mooncake's ``mooncake.engine.TransferEngine``.

Every Mooncake call blocks, so each runs in a Trio worker thread. The threads are never
abandoned (``abandon_on_cancel=False``, Trio's default, spelled out at each call): a thread
cannot be stopped, and a caller that walked away from a running transfer could free or
deregister memory the thread is still reading. A cancelled caller therefore waits for its call
to finish, and sees the cancellation at its next checkpoint.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import trio

from trio_encode.engine.base import EngineError
from trio_encode.engine.threads import EngineThreads, ThreadSettings

log = logging.getLogger(__name__)

ENGINE_LOG_LEVELS = ("INFO", "WARNING", "ERROR")
"""The levels Mooncake's ``MC_LOG_LEVEL`` understands (it ignores any other value)."""
_INSTALL_HINT = (
    "the Mooncake transfer engine is not usable: {error}. Install it with "
    "`pip install 'trio-encode[mooncake]'` (or `trio-encode[mooncake-cuda]` on CUDA hosts); "
    "it also needs the system library libibverbs.so.1, even for TCP "
    "(Debian/Ubuntu: `apt-get install -y libibverbs1`)."
)


def set_engine_log_level(level: str) -> None:
    """Make Mooncake log only at ``level`` and above (its ``MC_LOG_LEVEL``).

    Mooncake reads the variable once, when its module is imported, so this must run before
    the first engine is created; afterwards it cannot take effect, and says so.
    """
    level = level.upper()
    if level not in ENGINE_LOG_LEVELS:
        raise ValueError(
            f"engine log level must be one of {', '.join(ENGINE_LOG_LEVELS)}, got {level!r}"
        )
    if "mooncake.engine" in sys.modules and os.environ.get("MC_LOG_LEVEL") != level:
        log.warning("Mooncake is already loaded: its log level stays as it was, not %s", level)
    os.environ["MC_LOG_LEVEL"] = level


def _load_mooncake_engine_class() -> Any:
    """Import Mooncake only when an engine is created, so the rest of the package (and the
    in-memory engine) works on hosts without it; a failure names the fix."""
    try:
        module = importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as error:  # OSError: a shared library that will not load
        raise RuntimeError(_INSTALL_HINT.format(error=error)) from error
    return module.TransferEngine


@dataclass(frozen=True)
class MooncakeSettings:
    """Arguments of Mooncake's ``initialize``; the defaults suit TCP on loopback with no
    metadata server (peers exchange descriptors directly, ``P2PHANDSHAKE``)."""

    hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    threads: ThreadSettings = field(default_factory=ThreadSettings)
    """Worker threads for transfers and for (de)registration, and the bound per receiver."""


class MooncakeEngine:
    """A Mooncake transfer engine behind the async :class:`TransferEngine` interface.

    Build it with :meth:`create`; the constructor wraps an already initialised raw engine.
    """

    def __init__(self, raw: Any, settings: MooncakeSettings) -> None:
        self._raw = raw
        self._settings = settings
        self._session_id = f"{settings.hostname}:{raw.get_rpc_port()}"
        self.threads = EngineThreads(settings.threads)

    @classmethod
    async def create(cls, settings: MooncakeSettings | None = None) -> MooncakeEngine:
        """Create and initialise an engine in a worker thread (initialisation opens sockets
        and may probe devices, which blocks)."""
        settings = settings if settings is not None else MooncakeSettings()
        engine_class = _load_mooncake_engine_class()
        raw = engine_class()
        code = await trio.to_thread.run_sync(
            raw.initialize,
            settings.hostname,
            settings.metadata_server,
            settings.protocol,
            settings.device_name,
            abandon_on_cancel=False,
        )
        if code != 0:
            raise EngineError(
                "initialize",
                int(code),
                detail=(
                    f"hostname={settings.hostname} metadata_server={settings.metadata_server} "
                    f"protocol={settings.protocol} device_name={settings.device_name!r}"
                ),
            )
        return cls(raw, settings)

    @property
    def session_id(self) -> str:
        """``hostname:rpc_port``: the name peers use to transfer into this engine."""
        return self._session_id

    @property
    def settings(self) -> MooncakeSettings:
        """The settings this engine was initialised with."""
        return self._settings

    @property
    def raw(self) -> Any:
        """The underlying ``mooncake.engine.TransferEngine``, for what this interface omits
        (reads, batch calls, topology)."""
        return self._raw

    async def register(self, address: int, length: int) -> None:
        """Register ``[address, address + length)``; -7 if it overlaps a live registration."""
        code = await trio.to_thread.run_sync(
            self._raw.register_memory,
            address,
            length,
            abandon_on_cancel=False,
            limiter=self.threads.control,
        )
        if code != 0:
            raise EngineError(
                "register", int(code), address=address, length=length, session_id=self.session_id
            )

    async def deregister(self, address: int) -> None:
        """Release the registration starting at ``address``; -3 if none starts there."""
        code = await trio.to_thread.run_sync(
            self._raw.unregister_memory,
            address,
            abandon_on_cancel=False,
            limiter=self.threads.control,
        )
        if code != 0:
            raise EngineError("deregister", int(code), address=address, session_id=self.session_id)

    async def transfer(
        self, session_id: str, local_address: int, remote_address: int, length: int
    ) -> None:
        """Write ``length`` bytes into ``session_id``'s registered memory and wait until they
        have landed (``transfer_sync_write``). Waits for a thread of the transfer pool and a
        slot of ``session_id``'s own bound first (see :mod:`trio_encode.engine.threads`)."""
        async with self.threads.session_slot(session_id):
            code = await trio.to_thread.run_sync(
                self._raw.transfer_sync_write,
                session_id,
                local_address,
                remote_address,
                length,
                abandon_on_cancel=False,
                limiter=self.threads.transfers,
            )
        if code != 0:
            raise EngineError(
                "transfer",
                int(code),
                address=local_address,
                remote_address=remote_address,
                length=length,
                session_id=session_id,
                detail=f"from {self.session_id}",
            )
