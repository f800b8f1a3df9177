"""The :class:`TransferEngine` over Mooncake's ``mooncake.engine.TransferEngine``.

Every Mooncake call blocks, so each runs in a Trio worker thread. The threads are never
abandoned (:func:`~trio_encode.engine.threads.run_in_thread`, and ``abandon_on_cancel=False``
where ``trio.to_thread`` is used): a thread cannot be stopped, and a caller that walked away
from a running transfer could free or deregister memory the thread is still reading. A
cancelled caller therefore waits for its call to finish, and sees the cancellation at its next
checkpoint.

Transfers do not use the binding's ``transfer_sync_write`` (nor ``batch_transfer_sync_write``):
both wait for completion by calling ``getTransferStatus`` in a loop with no pause, so every
transfer in flight keeps a core busy doing nothing. With several ranks' sends in flight those
spinning threads take the cores from the threads that move the bytes (Mooncake's TCP workers,
and on a shared host the receivers), and the longer the transfers, the longer they spin. So a
transfer is submitted (``transfer_submit_write``) and its status polled with pauses that grow
with the time already waited: at most about 1/8 more latency, and no spinning.

A transfer holds a worker thread only while it submits; the wait for its terminal status
holds none. One :class:`BatchPoller` per engine asks Mooncake about every batch in flight and
wakes each waiting send when its batches end (or its deadline passes, or its caller stops
waiting), so a frozen receiver holds its own sends' slots and memory, never threads others
need (see :mod:`trio_encode.engine.threads` for the bounds that remain).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Annotated, Any, Literal, TypeVar

import outcome
import trio
from pydantic import AfterValidator
from pydantic.dataclasses import dataclass as settings_dataclass

from trio_encode.declare import SETTINGS, in_group
from trio_encode.engine.base import TRANSFER_FAILED, EngineError, Write, engine_code_meaning
from trio_encode.engine.threads import (
    EngineThreads,
    ThreadSettings,
    host_of,
    run_in_thread,
    start_in_thread,
)

log = logging.getLogger(__name__)

_INSTALL_HINT = (
    "the Mooncake transfer engine is not usable: {error}. Install it with "
    "`pip install 'trio-encode[mooncake]'` (or `trio-encode[mooncake-cuda]` on CUDA hosts); "
    "it also needs the system library libibverbs.so.1, even for TCP "
    "(Debian/Ubuntu: `apt-get install -y libibverbs1`)."
)


_FIRST_POLL = 20e-6
"""Seconds before the first status check after a submission."""
_MAX_POLL = 1e-3
"""Longest pause between two status checks: bounds the latency added to a long transfer."""


def transfer_timeout(length: int) -> float:
    """Seconds a transfer of ``length`` bytes may take before it counts as failed: Mooncake's
    own rule (``MC_TRANSFER_TIMEOUT`` seconds, default 30 and at least 5, plus 1 ns a byte)."""
    configured = os.environ.get("MC_TRANSFER_TIMEOUT")
    seconds = max(5, int(configured)) if configured else 30
    return seconds + length * 1e-9


DONE = 1
"""``transfer_check_status``: the batch completed (Mooncake has freed it)."""
FAILED = -1
"""``transfer_check_status``: the batch failed (freed too). Any other answer (0 running, -2
past Mooncake's own timeout but not ended) means the batch may still read its source."""

C = TypeVar("C", bound=Callable[[], int])


def _check_once(checks: Sequence[C]) -> tuple[list[C], int]:
    """Ask each check once: those that have not ended, and :data:`FAILED` if any failed
    (else 0)."""
    still: list[C] = []
    code = 0
    for check in checks:
        status = check()
        if status == FAILED:
            code = FAILED
        elif status != DONE:
            still.append(check)
    return still, code


def wait_until_done(
    checks: Sequence[C],
    timeout: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    stop: threading.Event | None = None,
) -> tuple[int, list[C]]:
    """In a worker thread: wait for submitted transfers until each has ended, ``timeout``
    passed or ``stop`` is set (the caller's deadline or a shutdown: within one pause);
    ``(code, pending)``: 0 or the first failure's code (-1 when the wait timed out or
    stopped), and the transfers that had not ended (empty unless it timed out or stopped).

    Each check returns Mooncake's ``transfer_check_status`` answer; only :data:`DONE` and
    :data:`FAILED` end a transfer (Mooncake then frees the batch, so an ended check is never
    asked again). The pause between rounds is an eighth of the time waited so far (between
    ``_FIRST_POLL`` and ``_MAX_POLL``). A pending transfer may still read the caller's memory:
    the caller must keep it out of reuse until the transfer ends.
    """
    pending = list(checks)
    code = 0
    start = clock()
    pause = _FIRST_POLL
    while True:
        pending, failed = _check_once(pending)
        code = code or failed
        if not pending:
            return code, []
        waited = clock() - start
        if waited > timeout or (stop is not None and stop.is_set()):
            return code or TRANSFER_FAILED, pending
        sleep(pause)
        pause = min(_MAX_POLL, max(_FIRST_POLL, waited / 8))


def _submitted(batch_id: int) -> bool:
    """Whether ``transfer_submit_write`` accepted the transfer (it answers 0 or -1 when the
    peer cannot be reached or the request is refused, else an opaque batch id)."""
    return 0 < batch_id < 1 << 63


@dataclass(eq=False)
class Batch:
    """One submitted segment: its batch id and the local range it reads until it ends."""

    raw: Any
    batch_id: int
    address: int
    length: int

    def __call__(self) -> int:
        return int(self.raw.transfer_check_status(self.batch_id))

    def reads(self, address: int, length: int) -> bool:
        return self.address < address + length and address < self.address + self.length


def submit_segments(
    raw: Any, write: Write, stop: threading.Event | None = None
) -> tuple[int, list[Batch], int]:
    """In a worker thread: submit ``write``'s segments, one after another; ``(code, batches,
    nbytes)``: -1 if a submission was refused or ``stop`` was set first (no later segment is
    submitted, and a refused one, which has no batch, is never asked about), the batches
    submitted, and the bytes their deadline counts (:func:`transfer_timeout`)."""
    batches: list[Batch] = []
    code = 0
    offset = 0
    for address, length in write.segments:
        if stop is not None and stop.is_set():
            code = TRANSFER_FAILED  # the caller's end came: submit no more
            break
        batch_id = int(
            raw.transfer_submit_write(
                write.session_id, address, write.remote_address + offset, length
            )
        )
        offset += length
        if not _submitted(batch_id):
            code = TRANSFER_FAILED
            break
        batches.append(Batch(raw, batch_id, address, length))
    return code, batches, offset


def write_segments(
    raw: Any, write: Write, stop: threading.Event | None = None
) -> tuple[int, list[Batch]]:
    """In one worker thread: do ``write`` (:func:`submit_segments`) and wait for it
    (:func:`wait_until_done`); ``(code, pending)``, code the first failure's. Every segment is
    submitted before any is waited for, so they travel together. For callers that have a
    thread to spend (test doubles); the engine itself waits in its :class:`BatchPoller`."""
    code, batches, nbytes = submit_segments(raw, write, stop)
    # Wait for what was submitted even after a failure: it may still be reading our memory.
    waited, pending = wait_until_done(batches, transfer_timeout(nbytes), stop=stop)
    return code or waited, pending


Landed = tuple[int, list[Batch]]
"""A flight's end as its caller sees it: ``(code, pending)``, as :func:`wait_until_done`."""


@dataclass(eq=False)
class _Flight:
    """One transfer call's submitted batches. From :meth:`BatchPoller.add` until the poller
    hands it back (once: every batch ended, its deadline passed, or ``stop`` was set) only the
    poller's thread asks Mooncake about them, so an ended batch (freed by Mooncake) is never
    asked about again; then the caller owns what is still pending."""

    batches: list[Batch]
    timeout: float
    """Seconds from the hand-over to the poller after which the caller stops waiting."""
    stop: threading.Event
    """Set when the caller stops waiting (cancelled): the poller hands the flight back at its
    next round."""
    token: trio.lowlevel.TrioToken
    code: int = 0
    start: float = 0.0
    due: float = 0.0
    pause: float = _FIRST_POLL
    result: outcome.Outcome[Landed] | None = None
    """Trio's thread only: the poller's answer, once given."""
    task: trio.lowlevel.Task | None = None
    """Trio's thread only: the caller, while it waits for the answer."""

    def submitted(self, result: outcome.Outcome[bool]) -> None:
        """In Trio's thread: its submission ended; the answer too unless the batches went to
        the poller (True), which answers once they end."""
        if isinstance(result, outcome.Error):  # the binding's own: nothing went to the poller
            self.land(outcome.Error(result.error))
        elif not result.unwrap():
            self.land(outcome.Value((self.code, [])))  # nothing was submitted

    def land(self, result: outcome.Outcome[Landed]) -> None:
        """In Trio's thread: the flight's answer; wakes the caller if it waits already."""
        self.result = result
        task, self.task = self.task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def landed(self, wake: Callable[[], None]) -> Landed:
        """The poller's answer. The wait holds no thread and is not a checkpoint a cancelled
        caller leaves from: cancelled, the caller sets ``stop``, ``wake``s the poller and gets
        its answer within a round (what is still pending is then the caller's to keep)."""
        if self.result is None:
            self.task = trio.lowlevel.current_task()

            def abort(_: Any) -> trio.lowlevel.Abort:
                self.stop.set()
                wake()
                return trio.lowlevel.Abort.FAILED

            await trio.lowlevel.wait_task_rescheduled(abort)
        assert self.result is not None
        return self.result.unwrap()


def _land_all(landed: list[tuple[_Flight, outcome.Outcome[Landed]]]) -> None:
    for flight, result in landed:
        flight.land(result)


class BatchPoller:
    """The one place an engine waits for its batches in flight: a thread that asks Mooncake
    about each batch with pauses that grow as :func:`wait_until_done`'s do (an eighth of the
    time that flight has waited, between ``_FIRST_POLL`` and ``_MAX_POLL``), and hands each
    flight back to its caller's Trio run as soon as it ends.

    Why one dedicated thread, not a Trio task: a check is cheap (~0.6 us of CPU, measured),
    but a Trio task's sleep rounds up to the event loop's millisecond (epoll's unit; a 20 us
    ``trio.sleep`` took ~1.3 ms, ``time.sleep`` ~0.1 ms), far too late a first check for a
    transfer of a few hundred microseconds, and every round would take a turn of the event
    loop. The thread's pauses are timed in microseconds and cost the loop nothing, and
    ``transfer_check_status`` is not blocked by the engine's mutex (a submission stalled in a
    handshake never stalls the polls). It also serves every Trio run that uses the engine
    (tests run many). Idle (nothing in flight) it sleeps until a flight arrives: no spinning.
    It makes the checks and pauses a sleeping thread per transfer made, plus its own wake-up
    when a flight finds it idle; transfers in flight together share its wake-ups.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Guards changes to ``_flights``, which are copies: the poller reads it unlocked."""
        self._flights: tuple[_Flight, ...] = ()
        self._signal = threading.Lock()
        """Released (once, however often signalled) when a flight arrives or a caller stops
        waiting; the poller sleeps acquiring it, so its pauses cost what ``time.sleep``'s do."""
        self._signal.acquire()
        self._wake_at = -math.inf
        """When the poller's sleep ends (inf: idle; -inf: awake, it looks at ``_flights``
        again before sleeping): a flight due later needs no wake-up of its own."""
        self._thread: threading.Thread | None = None
        self.rounds = 0
        """Rounds of checks so far (each a wake-up of the poller with a flight due)."""

    @property
    def in_flight(self) -> int:
        """Flights in the poller's care now."""
        return len(self._flights)

    def add(self, flight: _Flight) -> None:
        """Any thread: take ``flight`` into the poller's care; its first check comes after
        ``_FIRST_POLL``."""
        now = time.monotonic()
        flight.start, flight.due = now, now + _FIRST_POLL
        with self._lock:
            self._flights = (*self._flights, flight)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="mooncake-batch-poller", daemon=True
                )
                self._thread.start()
        if flight.due < self._wake_at:
            self.wake()

    def wake(self) -> None:
        """Any thread: a flight arrived, or one's ``stop`` was set: look again now."""
        with contextlib.suppress(RuntimeError):  # already signalled
            self._signal.release()

    def _run(self) -> None:
        signal = self._signal
        while True:
            self._wake_at = -math.inf
            flights = self._flights
            now = time.monotonic()
            next_due = math.inf
            checked = False
            ended: list[tuple[_Flight, outcome.Outcome[Landed]]] = []
            for flight in flights:
                if flight.due <= now or flight.stop.is_set():
                    checked = True
                    result = self._check(flight, now)
                    if result is not None:
                        ended.append((flight, result))
                        continue
                next_due = min(next_due, flight.due)
            self.rounds += checked
            if ended:
                left = self._hand_back(ended)
                if len(left) != len(flights) - len(ended):
                    continue  # flights arrived during the round
                flights = left
            self._wake_at = next_due
            if self._flights is not flights:
                continue  # a flight arrived: look at it before sleeping
            if next_due == math.inf:
                signal.acquire()  # idle: sleep until a flight arrives
            else:
                pause = next_due - time.monotonic()
                if pause > 0:
                    signal.acquire(timeout=pause)

    def _hand_back(
        self, ended: list[tuple[_Flight, outcome.Outcome[Landed]]]
    ) -> tuple[_Flight, ...]:
        """Out of the poller's care, then to each flight's Trio run (one wake-up per run);
        the flights left in its care."""
        with self._lock:
            gone = {id(flight) for flight, _ in ended}
            left = self._flights = tuple(f for f in self._flights if id(f) not in gone)
        by_run: dict[trio.lowlevel.TrioToken, list[tuple[_Flight, outcome.Outcome[Landed]]]]
        by_run = {}
        for flight, result in ended:
            by_run.setdefault(flight.token, []).append((flight, result))
        for token, landed in by_run.items():
            try:
                token.run_sync_soon(_land_all, landed)
            except trio.RunFinishedError:  # its run ended without waiting (interrupted)
                log.warning("%d transfers ended after their Trio run", len(landed))
        return left

    @staticmethod
    def _check(flight: _Flight, now: float) -> outcome.Outcome[Landed] | None:
        """Ask about ``flight``'s batches once (the round began at ``now``): its answer if it
        ended (or must be handed back), else None and its next due time."""
        try:
            flight.batches, failed = _check_once(flight.batches)
        except Exception as error:  # the binding's own error: the caller gets it
            return outcome.Error(error)
        flight.code = flight.code or failed
        if not flight.batches:
            return outcome.Value((flight.code, []))
        waited = now - flight.start
        if waited > flight.timeout or flight.stop.is_set():
            return outcome.Value((flight.code or TRANSFER_FAILED, flight.batches))
        flight.due = now + flight.pause
        flight.pause = min(_MAX_POLL, max(_FIRST_POLL, waited / 8))
        return None


def _poll(batches: Sequence[Sequence[Batch]]) -> list[tuple[list[Batch], int]]:
    """In a worker thread: each group's batches that have not ended, and its first failure's
    code (0 if none failed)."""
    return [_check_once(group) for group in batches]


@dataclass(eq=False)
class _Abandoned:
    """Batches of one transfer whose caller stopped waiting (its timeout) before they ended."""

    session_id: str
    batches: list[Batch]
    since: float
    code: int = 0

    def reads(self, address: int, length: int) -> bool:
        return any(batch.reads(address, length) for batch in self.batches)


@dataclass(eq=False)
class _Probe:
    """The one first-contact probe of a receiver: every send to it that arrives while the probe
    runs waits for this one's answer rather than starting its own thread."""

    session_id: str
    deadline: float
    """Trio time after which its thread counts as abandoned (its first waiters gave up)."""
    answered: trio.Event
    code: int | None = None
    """``send_probe``'s answer; None until it returns (or the probe never got a thread)."""
    running: bool = False
    """Whether its thread runs now (it holds a slot of its host's probe bound until it ends)."""

    @property
    def host(self) -> str:
        return host_of(self.session_id)

    def abandoned(self, now: float) -> bool:
        """Its thread still runs past the deadline: a paused receiver's handshake read."""
        return self.running and now >= self.deadline


P2P_HANDSHAKE = "P2PHANDSHAKE"
"""The metadata server setting under which peers exchange descriptors by a handshake."""
_PROBE_THREADS = 16
"""Probes of new receivers at once; a probe into a paused peer may hold its thread ~60 s."""
_UNBOUNDED = trio.CapacityLimiter(math.inf)
"""For probe threads, whose tokens (host's and pool's) the probe task takes itself."""
PROBES_PER_HOST = 4
"""Probe threads one receiver host may hold, those abandoned at their deadline included: a
paused node keeps at most this many of the :data:`_PROBE_THREADS` (each ~60 s), so the first
send to a receiver on another host never waits for a probe thread. Below the pool's size;
only four nodes paused at once, each with four new receivers stuck, could still use the pool up."""

_SETTLE_FIRST_POLL = 0.05
"""Seconds before asking again about a transfer the engine stopped waiting for."""
_SETTLE_MAX_POLL = 1.0


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


PROGRESS_MARGIN = 5
"""Seconds by which the default progress timeout stays below the request's ``send_timeout``."""


def default_progress_timeout(send_timeout: float) -> int:
    """``MC_TCP_PROGRESS_TIMEOUT_SEC`` when none is set: a stalled transfer fails a few
    seconds before its request's deadline (whole seconds, at least 1: Mooncake's unit)."""
    return max(1, math.ceil(send_timeout) - PROGRESS_MARGIN)


engine_setting = in_group("engine")


@settings_dataclass(frozen=True, config=SETTINGS)
class MooncakeSettings:
    """Arguments of Mooncake's ``initialize``, and its log level; the defaults suit TCP on
    loopback with no metadata server (peers exchange descriptors directly, ``P2PHANDSHAKE``).

    As flags, variables and config keys these are named ``engine_<field>``.
    """

    protocol: Literal["tcp", "rdma"] = engine_setting("tcp")
    """Mooncake transport: tcp, or rdma where the NICs support it."""
    metadata_server: str = engine_setting(P2P_HANDSHAKE)
    """Mooncake metadata server: P2PHANDSHAKE needs none (peers exchange descriptors, and a new
    receiver is probed first, see first_contact_timeout), or the URL of one, e.g.
    http://HOST:PORT/metadata for mooncake_http_metadata_server (receivers must use the same)."""
    first_contact_timeout: float = engine_setting(2.0, gt=0)
    """With P2PHANDSHAKE, seconds a receiver never sent to before may take to answer a probe before
    its first transfer; one that does not (a paused process) fails that send, instead of stalling
    every transfer of the engine for ~60 s in Mooncake's handshake. Sends to a receiver share its
    one probe, and a paused host holds at most 4 of the 16 probe threads."""
    device: str = engine_setting("")
    """RDMA device names for Mooncake (empty: let it choose; unused over tcp)."""
    hostname: str = engine_setting("127.0.0.1")
    """Address receivers reach this server's transfer engine at (its session_id host)."""
    log_level: EngineLogLevel = engine_setting("ERROR")
    """Least severe of Mooncake's own log lines shown (TRACE, INFO, WARNING, ERROR); exported as
    MC_LOG_LEVEL, replacing any value there, before Mooncake first loads in the process."""
    progress_timeout: int | None = engine_setting(None, ge=1)
    """Seconds a TCP transfer may make no progress before Mooncake fails it (exported as
    MC_TCP_PROGRESS_TIMEOUT_SEC): the bound on how long the memory of a transfer this server stopped
    waiting for stays quarantined. Default: send_timeout minus 5 (at least 1); it must be below
    send_timeout."""
    transfer_threads: int = engine_setting(ThreadSettings.transfer_threads, ge=1)
    """Worker threads that submit transfers, across all receivers (a transfer holds one only while
    it submits; one poller thread waits for every transfer in flight)."""
    control_threads: int = engine_setting(ThreadSettings.control_threads, ge=1)
    """Worker threads for register and deregister calls, kept apart so that releasing memory never
    waits behind transfers."""
    sends_per_session: int = engine_setting(ThreadSettings.sends_per_session, ge=1)
    """Transfers in flight to any one receiver engine: a rank that stops answering parks at most
    this many until Mooncake's own timeout fails them."""

    sends_per_host: int = engine_setting(ThreadSettings.sends_per_host, ge=1)
    """Transfers in flight to all receiver engines on one host: a node whose ranks all stop
    answering (a frozen TP node) parks at most this many."""
    transfers_in_flight: int = engine_setting(ThreadSettings.transfers_in_flight, ge=1)
    """Transfers in flight across all receivers: bounds the memory sends to frozen receivers pin.
    One client's /send calls in flight (max_sends_per_client) may be at most half of it."""

    @property
    def threads(self) -> ThreadSettings:
        """The thread pools' sizes (see :mod:`trio_encode.engine.threads`)."""
        return ThreadSettings(
            self.transfer_threads,
            self.control_threads,
            self.sends_per_session,
            self.sends_per_host,
            self.transfers_in_flight,
        )


class MooncakeEngine:
    """A Mooncake transfer engine behind the async :class:`TransferEngine` interface.

    Build it with :meth:`create`; the constructor wraps an already initialised raw engine.
    """

    def __init__(self, raw: Any, settings: MooncakeSettings) -> None:
        self.raw = raw
        """The underlying ``mooncake.engine.TransferEngine``, for what this interface omits
        (reads, batch calls, topology)."""
        self.settings = settings
        """The settings this engine was initialised with."""
        # With P2P handshakes peers name an engine by host and RPC port; with a metadata
        # server, by the name it registered there (the hostname it was initialised with).
        if settings.metadata_server == P2P_HANDSHAKE:
            self._session_id = f"{settings.hostname}:{raw.get_rpc_port()}"
        else:
            self._session_id = settings.hostname
        self.threads = EngineThreads(settings.threads)
        self.poller = BatchPoller()
        """Where every transfer in flight is waited for (no thread per transfer)."""
        self._abandoned: list[_Abandoned] = []
        self._polling = trio.Lock()
        self._contacted: set[str] = set()
        """Receivers a transfer reached: Mooncake has their descriptor, no handshake is due."""
        self._probe_threads = trio.CapacityLimiter(_PROBE_THREADS)
        self._probing: dict[str, _Probe] = {}
        """The probe of each receiver whose probe thread has not returned yet (at most one)."""
        self._probe_hosts: dict[str, trio.CapacityLimiter] = {}
        """Each host's bound on probe threads, while one of its probes runs or waits."""
        self.probes_started = 0
        """Probe threads started so far (``send_probe`` calls)."""

    @classmethod
    async def create(cls, settings: MooncakeSettings | None = None) -> MooncakeEngine:
        """Create and initialise an engine in a worker thread (initialisation opens sockets
        and may probe devices, which blocks)."""
        settings = settings if settings is not None else MooncakeSettings()
        engine_class = _load_mooncake_engine_class(settings.log_level)
        if settings.progress_timeout is not None:
            # Read by Mooncake's TCP transport when it watches a transfer's progress.
            os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(settings.progress_timeout)
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
        """The name peers use to transfer into this engine: ``hostname:rpc_port`` with P2P
        handshakes, the hostname with a metadata server."""
        return self._session_id

    async def register(self, address: int, length: int) -> None:
        """Register ``[address, address + length)``; -7 if it overlaps a live registration."""
        code = await run_in_thread(
            partial(self.raw.register_memory, address, length), self.threads.control
        )
        if code != 0:
            raise EngineError(
                "register", int(code), address=address, length=length, session_id=self.session_id
            )

    async def deregister(self, address: int) -> None:
        """Release the registration starting at ``address``; -3 if none starts there."""
        code = await run_in_thread(
            partial(self.raw.unregister_memory, address), self.threads.control
        )
        if code != 0:
            raise EngineError("deregister", int(code), address=address, session_id=self.session_id)

    async def transfer(self, write: Write, *, submitted: trio.Event | None = None) -> None:
        """Write ``write``'s segments, in order and back to back, and wait until every byte
        has landed. All are submitted before any is awaited, so a multi-image embedding
        needs no concatenation. Waits for the receiver's, its host's and the engine's slots
        and then a submission thread first (see :mod:`trio_encode.engine.threads`); a caller
        cancelled while waiting submits nothing. ``submitted`` is set as the thread starts.
        The thread only submits; the :class:`BatchPoller` waits, and the slots are held until
        it answers.

        If the wait times out (``transfer_timeout``) while submissions still run, or the
        caller is cancelled meanwhile (its deadline, a shutdown: the poller stops waiting
        within a poll's pause, ~1 ms, and the caller gets ``trio.Cancelled``), the source
        ranges stay :meth:`reading` until Mooncake reports every one ended."""
        session_id, segments = write.session_id, list(write.segments)
        if session_id not in self._contacted:
            await self._first_contact(session_id)
        stop = threading.Event()
        flight = _Flight([], 0.0, stop, trio.lowlevel.current_trio_token())
        async with self.threads.session_slot(session_id):
            # The caller waits once: for the poller's answer, or the submission's when it
            # sent the poller nothing (the thread's end releases its token on the side).
            await start_in_thread(
                partial(self._submit, replace(write, segments=segments), flight),
                self.threads.transfers,
                starting=None if submitted is None else submitted.set,
                done=flight.submitted,
            )
            code, pending = await flight.landed(self.poller.wake)
        detail = f"from {self.session_id}" + (
            f", {len(segments)} segments" if len(segments) > 1 else ""
        )
        if pending:
            self._abandoned.append(_Abandoned(session_id, pending, time.monotonic()))
            detail += (
                f"; stopped waiting with {len(pending)} still in flight: their memory is "
                "kept until Mooncake ends them"
            )
        if stop.is_set() and (pending or code != 0):
            await trio.lowlevel.checkpoint()  # the caller's cancellation, not an engine error
        if code != 0:
            raise write.failed(int(code), detail)
        self._contacted.add(session_id)

    def _submit(self, write: Write, flight: _Flight) -> bool:
        """In a worker thread: submit ``write`` and hand its batches to the poller (False if
        none was submitted); the thread returns at once, the poller waits."""
        code, batches, nbytes = submit_segments(self.raw, write, flight.stop)
        flight.code = code
        if not batches:
            return False
        flight.batches, flight.timeout = batches, transfer_timeout(nbytes)
        self.poller.add(flight)
        return True

    async def _first_contact(self, session_id: str) -> None:
        """Probe a receiver no transfer has reached yet, with a deadline, before Mooncake's
        first transfer to it does its handshake.

        That handshake runs under a lock every transfer call of the engine takes, and its read
        waits up to ~60 s for a peer that accepted the connection but does not answer (a
        paused process): every other receiver's sends would wait as long. The probe
        (``send_probe``) takes no such lock; a probe thread that overruns the deadline is left
        to finish on its own (it touches none of our memory) and the send fails, nothing
        submitted. A peer that freezes between the probe and the handshake still stalls the
        engine (a window of a millisecond). With a metadata server there is no handshake.

        A paused receiver must not use up the probe threads: a receiver has at most one probe
        thread at a time, and every send to it that arrives while that thread runs (before or
        after its deadline) waits for its answer, each for at most ``first_contact_timeout``
        and within its own cancellation; once the thread returns, the next send probes anew (a
        failure is not remembered). One host's probe threads, abandoned ones included, are
        capped at :data:`PROBES_PER_HOST`: once all are abandoned, a send to a new receiver of
        that host fails at once, and other hosts keep the rest of the pool.
        """
        if self.settings.metadata_server != P2P_HANDSHAKE:
            return
        timeout = self.settings.first_contact_timeout
        now = trio.current_time()
        probe = self._probing.get(session_id)
        if probe is None:
            host = host_of(session_id)
            stuck = sum(p.abandoned(now) for p in self._probing.values() if p.host == host)
            if stuck >= PROBES_PER_HOST:
                raise self._probe_failed(
                    session_id,
                    f"its host has {stuck} first-contact probes that did not answer (a paused "
                    "node?) and is probed no further until one returns; nothing was sent",
                )
            probe = _Probe(session_id, now + timeout, trio.Event())
            self._probing[session_id] = probe
            trio.lowlevel.spawn_system_task(self._run_probe, probe)
        # Each waiter keeps its own deadline: one that joins a probe abandoned earlier (a
        # paused peer) still gets its answer if the peer resumes within it.
        with trio.move_on_at(now + timeout):
            await probe.answered.wait()
        if probe.code == 0:
            return
        if probe.code is None:
            raise self._probe_failed(
                session_id,
                f"the receiver did not answer a first-contact probe within {timeout:g} s "
                "(paused or overloaded?); nothing was sent",
            )
        # The send fails as a transfer to that peer would (-1); the probe's code says why.
        raise self._probe_failed(
            session_id,
            f"its first-contact probe failed with {probe.code} "
            f"({engine_code_meaning(probe.code)}); nothing was sent",
        )

    @staticmethod
    def _probe_failed(session_id: str, detail: str) -> EngineError:
        return EngineError("transfer", TRANSFER_FAILED, session_id=session_id, detail=detail)

    async def _run_probe(self, probe: _Probe) -> None:
        """A system task (no caller's cancellation ends it): take a slot of the probe's host
        and a probe thread before its deadline, run ``send_probe`` and publish its answer,
        holding both until the thread returns, however long after the deadline. Never raises
        (a system task's exception would end the run)."""
        host = probe.host
        bound = self._probe_hosts.get(host)
        if bound is None:
            bound = self._probe_hosts[host] = trio.CapacityLimiter(PROBES_PER_HOST)
        held: list[trio.CapacityLimiter] = []
        try:
            with trio.move_on_at(probe.deadline):
                for limiter in (bound, self._probe_threads):
                    await limiter.acquire()
                    held.append(limiter)
            if len(held) == 2:
                probe.running = True
                self.probes_started += 1
                # The tokens are held here, so the thread needs none; abandoned only when
                # the run ends (callers stop waiting at the deadline, not this task).
                probe.code = int(
                    await trio.to_thread.run_sync(
                        self.raw.send_probe,
                        probe.session_id,
                        abandon_on_cancel=True,
                        limiter=_UNBOUNDED,
                    )
                )
        except Exception as error:  # the binding's own error: the probe failed
            log.warning("first-contact probe of %s raised %r", probe.session_id, error)
            probe.code = TRANSFER_FAILED
        finally:
            probe.running = False
            for limiter in held:
                limiter.release()
            probe.answered.set()
            if self._probing.get(probe.session_id) is probe:
                del self._probing[probe.session_id]
            stats = bound.statistics()
            if stats.borrowed_tokens == 0 and stats.tasks_waiting == 0:
                self._probe_hosts.pop(host, None)

    def reading(self, address: int, length: int) -> bool:
        """Whether a transfer this engine stopped waiting for may still read the range."""
        return any(abandoned.reads(address, length) for abandoned in self._abandoned)

    async def settled(self, address: int, length: int) -> None:
        """Return once no transfer this engine stopped waiting for reads the range, asking
        Mooncake about them with pauses that grow to a second. One caller asks at a time: a
        batch that has ended is freed by Mooncake and must never be asked about again."""
        pause = _SETTLE_FIRST_POLL
        while self.reading(address, length):
            async with self._polling:
                entries = list(self._abandoned)
                answers = await run_in_thread(
                    partial(_poll, [entry.batches for entry in entries]), self.threads.control
                )
                for entry, (still, code) in zip(entries, answers, strict=True):
                    entry.batches = still
                    entry.code = entry.code or code
                    if not still:
                        self._abandoned.remove(entry)
                        log.info(
                            "a transfer to %s that was given up on ended (code %d) %.1f s "
                            "later: its memory may be reused",
                            entry.session_id,
                            entry.code,
                            time.monotonic() - entry.since,
                        )
            if not self.reading(address, length):
                return
            await trio.sleep(pause)
            pause = min(_SETTLE_MAX_POLL, pause * 2)
