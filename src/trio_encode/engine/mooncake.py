"""The :class:`TransferEngine` over Mooncake's ``mooncake.engine.TransferEngine``.

Every Mooncake call blocks, so each runs in a Trio worker thread. The threads are never
abandoned (``abandon_on_cancel=False``, Trio's default, spelled out at each call): a thread
cannot be stopped, and a caller that walked away from a running transfer could free or
deregister memory the thread is still reading. A cancelled caller therefore waits for its call
to finish, and sees the cancellation at its next checkpoint.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Annotated, Any

import trio
from pydantic import AfterValidator, ConfigDict
from pydantic.dataclasses import dataclass

from trio_encode.declare import setting
from trio_encode.engine.base import EngineError
from trio_encode.engine.threads import EngineThreads, ThreadSettings

_INSTALL_HINT = (
    "the Mooncake transfer engine is not usable: {error}. Install it with "
    "`pip install 'trio-encode[mooncake]'` (or `trio-encode[mooncake-cuda]` on CUDA hosts); "
    "it also needs the system library libibverbs.so.1, even for TCP "
    "(Debian/Ubuntu: `apt-get install -y libibverbs1`)."
)


def _load_mooncake_engine_class(log_level: str) -> Any:
    """Import Mooncake only when an engine is created, so the rest of the package (and the
    in-memory engine) works on hosts without it; a failure names the fix.

    Mooncake reads ``MC_LOG_LEVEL`` once, when its module loads, so the level is exported
    just before the first import and later engines in the process share it.
    """
    if "mooncake.engine" not in sys.modules:
        os.environ["MC_LOG_LEVEL"] = log_level
    try:
        module = importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as error:  # OSError: a shared library that will not load
        raise RuntimeError(_INSTALL_HINT.format(error=error)) from error
    return module.TransferEngine


_ENGINE_LOG_LEVELS = ("TRACE", "INFO", "WARNING", "ERROR")


def _engine_log_level(level: str) -> str:
    if level.upper() not in _ENGINE_LOG_LEVELS:
        raise ValueError(f"{level!r} is not one of {', '.join(_ENGINE_LOG_LEVELS)}")
    return level.upper()


EngineLogLevel = Annotated[str, AfterValidator(_engine_log_level)]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class MooncakeSettings:
    """Arguments of Mooncake's ``initialize``, and its log level; the defaults suit TCP on
    loopback with no metadata server (peers exchange descriptors directly, ``P2PHANDSHAKE``).

    As flags, variables and config keys these are named ``engine_<field>``.
    """

    protocol: str = setting(
        "tcp", group="engine", help="Mooncake transport: tcp, or rdma where the NICs support it."
    )
    metadata_server: str = setting(
        "P2PHANDSHAKE",
        group="engine",
        help="Mooncake metadata server; P2PHANDSHAKE needs none (peers exchange descriptors).",
    )
    device: str = setting(
        "",
        group="engine",
        help="RDMA device names for Mooncake (empty: let it choose; unused over tcp).",
    )
    hostname: str = setting(
        "127.0.0.1",
        group="engine",
        help="Address receivers reach this server's transfer engine at (its session_id host).",
    )
    log_level: EngineLogLevel = setting(
        "ERROR",
        group="engine",
        help="Least severe of Mooncake's own log lines shown (TRACE, INFO, WARNING, ERROR); "
        "exported as MC_LOG_LEVEL, replacing any value there, before Mooncake first loads in "
        "the process.",
    )
    transfer_threads: int = setting(
        ThreadSettings.transfer_threads,
        group="engine",
        ge=1,
        help="Worker threads for transfers across all receivers.",
    )
    control_threads: int = setting(
        ThreadSettings.control_threads,
        group="engine",
        ge=1,
        help="Worker threads for register and deregister calls, kept apart so that releasing "
        "memory never waits behind transfers.",
    )
    sends_per_session: int = setting(
        ThreadSettings.sends_per_session,
        group="engine",
        ge=1,
        help="Transfers in flight to any one receiver engine: a rank that stops answering holds "
        "at most this many threads until Mooncake's own timeout fails them.",
    )

    @property
    def threads(self) -> ThreadSettings:
        """The thread pools' sizes (see :mod:`trio_encode.engine.threads`)."""
        return ThreadSettings(self.transfer_threads, self.control_threads, self.sends_per_session)


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
        engine_class = _load_mooncake_engine_class(settings.log_level)
        raw = engine_class()
        code = await trio.to_thread.run_sync(
            raw.initialize,
            settings.hostname,
            settings.metadata_server,
            settings.protocol,
            settings.device,
            abandon_on_cancel=False,
        )
        if code != 0:
            raise EngineError(
                "initialize",
                int(code),
                detail=(
                    f"hostname={settings.hostname} metadata_server={settings.metadata_server} "
                    f"protocol={settings.protocol} device={settings.device!r}"
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
