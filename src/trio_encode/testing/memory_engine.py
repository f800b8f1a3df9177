"""An in-memory :class:`TransferEngine` for deterministic tests on Trio's ``MockClock``.

It enforces Mooncake's rules, including the RDMA one that the TCP engine cannot show (a
transfer's source must lie inside a live local registration), and moves real bytes between
real addresses. It behaves like a worker-thread call without using threads: a cancelled
caller never starts a call, and a started call runs to completion (its virtual latency and any
gate run shielded), exactly as ``trio.to_thread.run_sync(abandon_on_cancel=False)`` behaves.

Tests steer it with scripted latencies, scripted failures and gates, and read back a history
of every call and a list of *violations*: deregistrations of memory that an in-flight transfer
was still reading from or writing into.

Capacity is modelled with the same limiters the Mooncake engine uses
(:class:`~trio_encode.engine.threads.EngineThreads`): a call first waits for a "thread" of its
pool, and a transfer first for slots of its receiver's, its host's and the engine's bounds. As
in the Mooncake engine a transfer holds its thread only while it submits (every segment
starts, and passes its gate); its latency and the wait for a peer that stops answering
(:meth:`InMemoryFabric.freeze`) hold the slots, not the thread. So starvation and isolation
are deterministic tests, and the same rule checks hold on both engines.

Timing of effects (each the conservative choice): a registration counts only once
``register`` has returned; a deregistration takes effect the moment ``deregister`` starts; a
transfer checks its ranges when it starts, checks again that they are still registered right
before it copies, and copies at its very end.
"""

from __future__ import annotations

import ctypes
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import trio

from trio_encode.engine.base import (
    ADDRESS_OVERLAPPED,
    INVALID_ADDRESS,
    TRANSFER_FAILED,
    EngineError,
    Write,
)
from trio_encode.engine.threads import EngineThreads, ThreadSettings
from trio_encode.testing.costs import CostModel

CallKind = Literal["register", "deregister", "transfer"]
CALL_KINDS: tuple[CallKind, ...] = ("register", "deregister", "transfer")

OK = 0


@dataclass
class CallRecord:
    """One engine call as it happened: what was asked, when it ran, and what it returned.

    ``code`` and ``end`` stay ``None`` while the call is in flight. For a transfer,
    ``session_id`` is the peer written to; for the other calls it is this engine's own.
    """

    seq: int
    kind: CallKind
    session_id: str
    address: int
    length: int | None
    remote_address: int | None
    start: float
    end: float | None = None
    code: int | None = None
    scripted: bool = False
    """Whether ``code`` is a failure scripted by :meth:`InMemoryEngine.fail_next`."""

    @property
    def done(self) -> bool:
        """Whether the call has returned."""
        return self.code is not None

    @property
    def ok(self) -> bool:
        """Whether the call has returned and succeeded."""
        return self.code == OK


@dataclass(eq=False)
class Registration:
    """A live registered range. Compared by identity, so a range deregistered and registered
    again mid-transfer is not mistaken for the one the transfer started with."""

    start: int
    length: int

    @property
    def end(self) -> int:
        """One past the last registered byte."""
        return self.start + self.length

    def covers(self, address: int, length: int) -> bool:
        """Whether ``[address, address + length)`` lies inside this one registration."""
        return self.start <= address and address + length <= self.end


LatencyScript = Callable[[CallRecord], float]


class Gate:
    """Holds every call of one kind at its start, like a worker thread that is stuck, until
    :meth:`open`. The waiting is shielded: cancelling a held call's caller does not free it."""

    def __init__(self, kind: CallKind) -> None:
        self.kind: CallKind = kind
        self.entered = trio.Event()
        """Set when the first call reaches the gate."""
        self.arrivals: list[CallRecord] = []
        self._opened = trio.Event()
        self._arrival = trio.Event()

    @property
    def is_open(self) -> bool:
        """Whether calls pass the gate."""
        return self._opened.is_set()

    @property
    def waiting(self) -> int:
        """How many calls are held at the gate now."""
        return 0 if self.is_open else sum(1 for call in self.arrivals if not call.done)

    def open(self) -> None:
        """Let held and future calls through."""
        self._opened.set()

    async def wait_arrivals(self, count: int = 1) -> None:
        """Wait until ``count`` calls in total have reached the gate."""
        while len(self.arrivals) < count:
            await self._arrival.wait()

    async def _pass(self, call: CallRecord) -> None:
        self.arrivals.append(call)
        self.entered.set()
        self._arrival.set()
        self._arrival = trio.Event()
        await self._opened.wait()


@dataclass
class _Script:
    """The scripted behaviour for one call kind."""

    default_latency: float
    latencies: deque[float] = field(default_factory=deque)
    latency_fn: LatencyScript | None = None
    failures: deque[int] = field(default_factory=deque)
    gate: Gate | None = None

    def next_latency(self, call: CallRecord) -> float:
        if self.latencies:
            return self.latencies.popleft()
        if self.latency_fn is not None:
            return self.latency_fn(call)
        return self.default_latency


@dataclass
class _Entry:
    """A call between its entry and its start, and the failure scripted for it."""

    failure: int | None
    started: bool = False


@dataclass
class _Submitted:
    """One segment of a transfer, submitted: its call, and the code it ends with unless its
    transfer runs (``flight``)."""

    call: CallRecord
    code: int | None
    flight: _InFlightTransfer | None
    local_address: int
    remote_address: int
    length: int


@dataclass
class _InFlightTransfer:
    """A transfer between its start and its end, and the registrations it holds."""

    call: CallRecord
    source: Registration
    destination: Registration
    receiver: InMemoryEngine


@dataclass(eq=False)
class _Abandoned:
    """A transfer into a frozen peer whose caller stopped waiting: it lands if the peer thaws
    before ``deadline`` (reading its source then), else fails."""

    flight: _InFlightTransfer
    local_address: int
    remote_address: int
    length: int
    deadline: float
    ended: trio.Event = field(default_factory=trio.Event)

    def reads(self, address: int, length: int) -> bool:
        return self.local_address < address + length and address < self.local_address + (
            self.length
        )


class InMemoryFabric:
    """The network the in-memory engines share: session ids to engines, and one list of the
    violations any of them saw."""

    def __init__(
        self, *, transfer_timeout: float = 30.0, progress_timeout: float | None = None
    ) -> None:
        self._engines: dict[str, InMemoryEngine] = {}
        self._numbers = itertools.count()
        self._frozen: dict[str, trio.Event] = {}
        self.transfer_timeout = transfer_timeout
        """How long a transfer into a frozen peer hangs before its caller gets -1 (the engine
        stops waiting, as Mooncake's engine does after ``transfer_timeout``)."""
        self.progress_timeout = progress_timeout
        """Seconds from its start after which a transfer into a frozen peer really fails
        (Mooncake's ``MC_TCP_PROGRESS_TIMEOUT_SEC``). Until then one its caller stopped
        waiting for still lands if the peer thaws, reading its source *then*. None: it fails
        when its caller stops waiting."""
        self.violations: list[str] = []

    def freeze(self, session_id: str) -> None:
        """The peer stops answering (a paused process, a wedged NIC): transfers into it hang
        until :meth:`thaw`, or fail with -1 after ``transfer_timeout``."""
        self._frozen.setdefault(session_id, trio.Event())

    def thaw(self, session_id: str) -> None:
        """The peer answers again; transfers held by :meth:`freeze` go on, and those whose
        callers stopped waiting land now (if ``progress_timeout`` has not passed)."""
        event = self._frozen.pop(session_id, None)
        if event is not None:
            event.set()
        for engine in self.engines:
            engine._land_abandoned(session_id)

    def engine(
        self,
        name: str | None = None,
        *,
        register_latency: float = 0.0,
        deregister_latency: float = 0.0,
        transfer_latency: float = 0.0,
        threads: ThreadSettings | None = None,
    ) -> InMemoryEngine:
        """Create an engine on this fabric, named ``NAME:PORT`` like a Mooncake session id."""
        number = next(self._numbers)
        session_id = f"{name if name is not None else f'mem-{number}'}:{number + 1}"
        engine = InMemoryEngine(
            self,
            session_id,
            register_latency=register_latency,
            deregister_latency=deregister_latency,
            transfer_latency=transfer_latency,
            threads=threads,
        )
        self._engines[session_id] = engine
        return engine

    def lookup(self, session_id: str) -> InMemoryEngine | None:
        """The engine reachable as ``session_id``, if any."""
        return self._engines.get(session_id)

    @property
    def engines(self) -> list[InMemoryEngine]:
        """The engines reachable now."""
        return list(self._engines.values())

    def _disconnect(self, engine: InMemoryEngine) -> None:
        if self._engines.get(engine.session_id) is engine:
            del self._engines[engine.session_id]


class InMemoryEngine:
    """A :class:`TransferEngine` on an :class:`InMemoryFabric`; create it with
    :meth:`InMemoryFabric.engine`."""

    def __init__(
        self,
        fabric: InMemoryFabric,
        session_id: str,
        *,
        register_latency: float = 0.0,
        deregister_latency: float = 0.0,
        transfer_latency: float = 0.0,
        threads: ThreadSettings | None = None,
    ) -> None:
        self.fabric = fabric
        self.threads = EngineThreads(threads)
        self._session_id = session_id
        self._registrations: dict[int, Registration] = {}
        self._scripts: dict[CallKind, _Script] = {
            "register": _Script(register_latency),
            "deregister": _Script(deregister_latency),
            "transfer": _Script(transfer_latency),
        }
        self._in_flight_transfers: list[_InFlightTransfer] = []
        self._abandoned: list[_Abandoned] = []
        self._link: trio.Lock | None = None
        self._seq = itertools.count()
        self.history: list[CallRecord] = []
        """Every call that started, in start order."""
        self.violations: list[str] = []
        """Violations this engine saw (also appended to ``fabric.violations``)."""

    # -- the TransferEngine interface -------------------------------------------------------

    @property
    def session_id(self) -> str:
        """This engine's name on the fabric."""
        return self._session_id

    async def register(self, address: int, length: int) -> None:
        """Register ``[address, address + length)`` once the call returns; -7 if it overlaps
        a live registration, -1 for an empty range."""
        await trio.lowlevel.checkpoint_if_cancelled()
        async with self._scripted("register") as failure, _thread(self.threads.control):
            call, scripted = self._begin(
                "register", self.session_id, address, length, None, failure
            )
            await self._run_shielded(call)
            code = scripted if scripted is not None else self._do_register(address, length)
        self._finish(call, code)

    async def deregister(self, address: int) -> None:
        """Release the registration starting at ``address`` as soon as the call starts (the
        worst case for a transfer still using it); -3 if none starts there."""
        await trio.lowlevel.checkpoint_if_cancelled()
        async with self._scripted("deregister") as failure, _thread(self.threads.control):
            live = self._registrations.get(address)
            length = live.length if live is not None else None
            call, scripted = self._begin(
                "deregister", self.session_id, address, length, None, failure
            )
            code = scripted if scripted is not None else self._do_deregister(address)
            await self._run_shielded(call)
        self._finish(call, code)

    async def transfer(self, write: Write, *, submitted: trio.Event | None = None) -> None:
        """Copy each of ``write``'s segments, back to back, into the receiving engine's memory:
        one recorded call per segment, in order, each copying at its end if both its ranges
        are still registered then.

        Waiting for the slots and a thread is cancellable; then ``submitted`` is set, and
        every segment starts (passing its gate) holding the thread, which is then released:
        their latencies and any wait for a frozen peer hold only the slots. All run, one after
        another, whatever happens to the caller (Mooncake has them all submitted); the first
        failure is raised after the last has ended. A caller cancelled while a segment hangs
        in a frozen peer stops waiting for it (and for the rest, which hang too): each stays
        :meth:`reading` until it lands or fails (``progress_timeout``), and the caller gets
        the cancellation."""
        await trio.lowlevel.checkpoint_if_cancelled()
        failure: EngineError | None = None
        stopped: trio.Cancelled | None = None
        session_id, remote_address = write.session_id, write.remote_address
        async with self._scripted("transfer") as first, self.threads.session_slot(session_id):
            async with _thread(self.threads.transfers):
                if submitted is not None:
                    submitted.set()
                started: list[_Submitted] = []
                offset = 0
                for index, (address, length) in enumerate(write.segments):
                    entry = first if index == 0 else self._entry("transfer")
                    started.append(
                        await self._submit_one(
                            entry, session_id, address, remote_address + offset, length
                        )
                    )
                    offset += length
            for one in started:
                try:
                    await self._await_one(one, stopped is None)
                except EngineError as exc:
                    failure = failure or exc
                except trio.Cancelled as exc:
                    stopped = exc  # the caller stopped waiting for a frozen peer
        if stopped is not None:
            raise stopped
        if failure is not None:
            raise failure

    async def _submit_one(
        self, entry: _Entry, session_id: str, local_address: int, remote_address: int, length: int
    ) -> _Submitted:
        """One segment's call starts: its ranges are checked and it passes its gate (holding
        the caller's thread, as a submission stuck in Mooncake would)."""
        call, scripted = self._begin(
            "transfer", session_id, local_address, length, remote_address, entry
        )
        flight: _InFlightTransfer | None = None
        code = scripted
        if code is None:
            code, flight = self._check_transfer(
                call, session_id, local_address, remote_address, length
            )
        if flight is not None:
            self._in_flight_transfers.append(flight)
        with trio.CancelScope(shield=True):
            await self._pass_gate(call)
        return _Submitted(call, code, flight, local_address, remote_address, length)

    async def _await_one(self, submitted: _Submitted, wait: bool = True) -> None:
        """One started segment's end, holding no thread: copy its bytes after its latency if
        both ranges are still registered then. Into a frozen peer it hangs until the transfer
        timeout, until the caller is cancelled (then it raises ``trio.Cancelled``), or not at
        all without ``wait``: its caller stopped waiting."""
        call, code, flight = submitted.call, submitted.code, submitted.flight
        session_id, local_address = call.session_id, submitted.local_address
        remote_address, length = submitted.remote_address, submitted.length
        abandoned = False
        try:
            with trio.CancelScope(shield=True):
                await self._take_latency(call)
            if flight is not None and not await self._peer_answers(session_id, wait):
                abandoned = self._abandon(flight, local_address, remote_address, length)
                code, flight = TRANSFER_FAILED, None
        except trio.Cancelled:
            assert flight is not None  # only the wait for a frozen peer is cancellable
            abandoned = self._abandon(flight, local_address, remote_address, length)
            call.code, call.end = TRANSFER_FAILED, trio.current_time()
            raise
        finally:
            if not abandoned:
                self._drop_in_flight(call)
        if flight is not None:
            code = self._complete_transfer(flight, local_address, remote_address, length)
        assert code is not None
        self._finish(call, code)

    def reading(self, address: int, length: int) -> bool:
        """Whether a transfer whose caller stopped waiting may still read the range."""
        self._expire_abandoned()
        return any(entry.reads(address, length) for entry in self._abandoned)

    async def settled(self, address: int, length: int) -> None:
        """Return once no transfer whose caller stopped waiting reads the range: its peer
        thawed (it landed) or its ``progress_timeout`` passed (it failed)."""
        while self.reading(address, length):
            entry = next(entry for entry in self._abandoned if entry.reads(address, length))
            with trio.move_on_at(entry.deadline):
                await entry.ended.wait()

    # -- scripting -----------------------------------------------------------------------------

    def script_latency(
        self, kind: CallKind, latencies: Iterable[float] | LatencyScript | None
    ) -> None:
        """Script the virtual latency of calls of ``kind``: a sequence is consumed one value
        per call (then the default applies again); a callable is asked for every call until
        replaced by ``None``."""
        script = self._scripts[kind]
        if latencies is None:
            script.latencies.clear()
            script.latency_fn = None
        elif callable(latencies):
            script.latency_fn = latencies
        else:
            script.latencies.extend(latencies)

    def apply_costs(self, model: CostModel) -> None:
        """Give every call the virtual latency ``model`` says, and make this engine's
        transfers queue for one link (so concurrent sends share its bandwidth)."""
        self.script_latency("register", lambda call: model.register.seconds(call.length or 0))
        self.script_latency("deregister", lambda call: model.deregister.seconds(call.length or 0))
        self.script_latency("transfer", lambda call: model.transfer.seconds(call.length or 0))
        self._link = trio.Lock()

    def fail_next(self, kind: CallKind, code: int = TRANSFER_FAILED, *, times: int = 1) -> None:
        """Make the next ``times`` calls of ``kind`` return ``code`` without effect, after
        their usual latency."""
        if code == OK:
            raise ValueError("a scripted failure needs a non-zero code")
        self._scripts[kind].failures.extend([code] * times)

    def gate(self, kind: CallKind) -> Gate:
        """Install a closed gate that holds every call of ``kind`` until it is opened."""
        gate = Gate(kind)
        self._scripts[kind].gate = gate
        return gate

    def close(self) -> None:
        """Leave the fabric, as a peer that died: transfers to or from this engine fail -1,
        also those already in flight when they reach their end."""
        self.fabric._disconnect(self)

    # -- inspection ----------------------------------------------------------------------------

    @property
    def live_registrations(self) -> dict[int, int]:
        """Start address -> length of every live registration."""
        return {start: reg.length for start, reg in sorted(self._registrations.items())}

    @property
    def in_flight(self) -> list[CallRecord]:
        """The calls that have started and not yet returned."""
        return [call for call in self.history if not call.done]

    def calls(self, kind: CallKind, *, ok: bool | None = None) -> list[CallRecord]:
        """The calls of ``kind`` so far; only the succeeded (``ok=True``) or failed ones
        (``ok=False``) if asked."""
        return [
            call
            for call in self.history
            if call.kind == kind and (ok is None or (call.done and call.ok == ok))
        ]

    def count(self, kind: CallKind, *, ok: bool | None = None) -> int:
        """How many calls of ``kind`` :meth:`calls` would list."""
        return len(self.calls(kind, ok=ok))

    # -- internals ---------------------------------------------------------------------------

    @asynccontextmanager
    async def _scripted(self, kind: CallKind) -> AsyncIterator[_Entry]:
        """The scripted failure of the call entering now, taken at its entry (before it waits
        for a thread), so a failure scripted for one caller is not consumed by another that
        got a thread first; a call that never starts (cancelled while waiting) gives it back."""
        failures = self._scripts[kind].failures
        entry = _Entry(failures.popleft() if failures else None)
        try:
            yield entry
        finally:
            if not entry.started and entry.failure is not None:
                failures.appendleft(entry.failure)

    def _begin(
        self,
        kind: CallKind,
        session_id: str,
        address: int,
        length: int | None,
        remote_address: int | None,
        entry: _Entry,
    ) -> tuple[CallRecord, int | None]:
        call = CallRecord(
            seq=next(self._seq),
            kind=kind,
            session_id=session_id,
            address=address,
            length=length,
            remote_address=remote_address,
            start=trio.current_time(),
        )
        call.scripted = entry.failure is not None
        self.history.append(call)
        entry.started = True
        return call, entry.failure

    def _entry(self, kind: CallKind) -> _Entry:
        """The scripted failure of a call that starts at once (no wait it could leave from)."""
        failures = self._scripts[kind].failures
        return _Entry(failures.popleft() if failures else None)

    async def _run_shielded(self, call: CallRecord) -> None:
        """The part of a call a thread would run: it cannot be cancelled once started."""
        with trio.CancelScope(shield=True):
            await self._pass_gate(call)
            await self._take_latency(call)

    async def _pass_gate(self, call: CallRecord) -> None:
        gate = self._scripts[call.kind].gate
        if gate is not None and not gate.is_open:
            await gate._pass(call)

    async def _take_latency(self, call: CallRecord) -> None:
        script = self._scripts[call.kind]
        if call.kind == "transfer" and self._link is not None:
            async with self._link:
                await trio.sleep(script.next_latency(call))
        else:
            await trio.sleep(script.next_latency(call))

    def _abandon(
        self, flight: _InFlightTransfer, local_address: int, remote_address: int, length: int
    ) -> bool:
        """The caller stops waiting for a transfer into a frozen peer; True if it may still
        land (it stays in flight, reading its source, until it lands or fails)."""
        progress = self.fabric.progress_timeout
        if progress is None or flight.call.start + progress <= trio.current_time():
            return False
        self._abandoned.append(
            _Abandoned(flight, local_address, remote_address, length, flight.call.start + progress)
        )
        return True

    def _land_abandoned(self, session_id: str) -> None:
        """``session_id`` thawed: its abandoned transfers land now, if still registered."""
        self._expire_abandoned()
        for entry in [e for e in self._abandoned if e.flight.call.session_id == session_id]:
            self._abandoned.remove(entry)
            self._drop_in_flight(entry.flight.call)
            self._complete_transfer(
                entry.flight, entry.local_address, entry.remote_address, entry.length
            )
            entry.ended.set()

    def _expire_abandoned(self) -> None:
        """Abandoned transfers past their ``progress_timeout`` have failed: they read no more."""
        now = trio.current_time()
        for entry in [e for e in self._abandoned if e.deadline <= now]:
            self._abandoned.remove(entry)
            self._drop_in_flight(entry.flight.call)
            entry.ended.set()

    def _drop_in_flight(self, call: CallRecord) -> None:
        for held in self._in_flight_transfers:
            if held.call is call:
                self._in_flight_transfers.remove(held)
                break

    async def _peer_answers(self, session_id: str, wait: bool = True) -> bool:
        """False if the peer is frozen and stays so past the transfer timeout (or at once
        without ``wait``). The wait is the one cancellable part of a started transfer: a
        cancelled caller stops waiting (``trio.Cancelled``)."""
        thawed = self.fabric._frozen.get(session_id)
        if thawed is None:
            return True
        if not wait:
            return False
        with trio.move_on_after(self.fabric.transfer_timeout):
            await thawed.wait()
            return True
        return False

    def _finish(self, call: CallRecord, code: int) -> None:
        call.code = code
        call.end = trio.current_time()
        if code == OK:
            return
        if call.kind == "transfer":
            raise EngineError(
                "transfer",
                code,
                address=call.address,
                remote_address=call.remote_address,
                length=call.length,
                session_id=call.session_id,
                detail=f"from {self.session_id}",
            )
        raise EngineError(
            call.kind, code, address=call.address, length=call.length, session_id=self.session_id
        )

    def _do_register(self, address: int, length: int) -> int:
        if length <= 0:
            return TRANSFER_FAILED  # Mooncake: "does not support zero length memory region"
        new = Registration(address, length)
        for reg in self._registrations.values():
            if reg.start < new.end and new.start < reg.end:
                return ADDRESS_OVERLAPPED
        self._registrations[address] = new
        return OK

    def _do_deregister(self, address: int) -> int:
        reg = self._registrations.pop(address, None)
        if reg is None:
            return INVALID_ADDRESS
        self._note_violations(reg)
        return OK

    def _note_violations(self, reg: Registration) -> None:
        """Record every in-flight transfer that still reads from or writes into ``reg``."""
        for flight in self._in_flight_transfers:
            if flight.source is reg:
                self._violation(reg, flight, "reads from")
        for engine in self.fabric.engines:
            for flight in engine._in_flight_transfers:
                if flight.destination is reg:
                    self._violation(reg, flight, "writes into")

    def _violation(self, reg: Registration, flight: _InFlightTransfer, verb: str) -> None:
        call = flight.call
        message = (
            f"{self.session_id}: deregister({reg.start:#x}, length {reg.length}) while "
            f"transfer #{call.seq} ({call.address:#x} -> {call.session_id} "
            f"{call.remote_address or 0:#x}, {call.length} bytes) still {verb} it"
        )
        self.violations.append(message)
        self.fabric.violations.append(message)

    def _find(self, address: int, length: int) -> Registration | None:
        for reg in self._registrations.values():
            if reg.covers(address, length):
                return reg
        return None

    def _check_transfer(
        self,
        call: CallRecord,
        session_id: str,
        local_address: int,
        remote_address: int,
        length: int,
    ) -> tuple[int, _InFlightTransfer | None]:
        """The checks at the start of a transfer; the code to return if they fail."""
        receiver = self.fabric.lookup(session_id)
        if receiver is None or self.fabric.lookup(self.session_id) is not self or length < 0:
            return TRANSFER_FAILED, None
        # The RDMA rule: the source must be registered (TCP Mooncake does not check it).
        source = self._find(local_address, length)
        destination = receiver._find(remote_address, length)
        if source is None or destination is None:
            return TRANSFER_FAILED, None
        return OK, _InFlightTransfer(call, source, destination, receiver)

    def _complete_transfer(
        self, flight: _InFlightTransfer, local_address: int, remote_address: int, length: int
    ) -> int:
        """Re-check that both ranges are still registered, then copy; else touch nothing."""
        receiver = flight.receiver
        still_live = (
            self._registrations.get(flight.source.start) is flight.source
            and receiver._registrations.get(flight.destination.start) is flight.destination
            and self.fabric.lookup(receiver.session_id) is receiver
            and self.fabric.lookup(self.session_id) is self
        )
        if not still_live:
            return TRANSFER_FAILED
        if length:
            ctypes.memmove(remote_address, local_address, length)
        return OK


@asynccontextmanager
async def _thread(limiter: trio.CapacityLimiter) -> AsyncIterator[None]:
    """Hold one "worker thread" of ``limiter`` for the body, as ``trio.to_thread.run_sync``
    does: waiting for it is cancellable, holding it is not a checkpoint."""
    token = object()
    await limiter.acquire_on_behalf_of(token)
    try:
        yield
    finally:
        limiter.release_on_behalf_of(token)
