"""Cancel-anywhere and randomised-schedule exploration of the ``/encode`` and ``/send`` paths.

Why: the races this project exists to prevent hide at awaits nobody thought about. A
hand-written test forces one interleaving; this driver forces all of them. It runs the
service (:class:`~trio_encode.service.EncodeService`, the in-memory engine, an encoder whose
calls behave like worker threads) on Trio's mock clock with TP callers per request, then
either cancels one caller after *every* task step taken while its call is in flight (one run
per step: each of its checkpoints, in each state the rest of the system passes through while it
waits there), or draws latencies, arrivals, engine faults and cancellations from a seed. Every
run is judged against the lifecycle's invariants plus two that only show from outside: no
write into a receiver's buffer after that receiver was answered 200, and siblings of a
cancelled caller are unaffected.

Runs are reproducible: latencies come from per-kind random streams seeded by the schedule, and
Trio's order of ready tasks is a seeded shuffle (the hook Trio itself offers to Hypothesis).
A failing schedule prints as a ``Schedule(...)`` that replays it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import random
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import trio
import trio.testing
from trio._core import _run as _trio_run

from trio_encode.engine import TRANSFER_FAILED, EngineError, Write
from trio_encode.errors import RequestError, RequestReleased
from trio_encode.observer import NullObserver
from trio_encode.request_types import EmbeddingMemory, Receiver
from trio_encode.service import Encoder, EncodeService, PassThroughEncoder, ServiceSettings
from trio_encode.testing.forwarding import ForwardingEngine
from trio_encode.testing.memory_engine import (
    CALL_KINDS,
    CallKind,
    CallRecord,
    InMemoryEngine,
    InMemoryFabric,
)

Phase = Literal["load", "open", "wait", "register", "transfer", "release"]
PHASES: tuple[Phase, ...] = ("load", "open", "wait", "register", "transfer", "release")
"""Where a cancelled caller can be: loading its items, opening the scope, waiting (for the
encoder, a lock or a sibling), registering, transferring, or while memory is deregistered."""

LatencyKind = Literal["load", "encode", "register", "deregister", "transfer"]
LATENCY_KINDS: tuple[LatencyKind, ...] = ("load", "encode", "register", "deregister", "transfer")

SEND_TRIES = 3
"""How many times a caller sends before it accepts a 502 (an engine error) as final."""
SEND_TIMEOUT = 60.0
"""The scopes' backstop in explored runs: far beyond any drawn latency, so siblings that keep
calling are always served in time, yet short enough that abandoned scopes expire quickly."""
_HANG = 3600.0
"""Virtual seconds after which a run counts as hung (only a deadlock gets there)."""
_STEP_BUDGET = 20_000
"""Task steps after which a run counts as livelocked (a run takes a few hundred)."""


# -- what a run is made of -------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    """One TP rank's client for one request: ``/encode``, then ``/send`` into its buffer."""

    request: int
    rank: int
    arrive: float = 0.0
    """Virtual seconds after the start before its ``/encode``."""
    gap: float = 0.0
    """Virtual seconds between the ``/encode`` answer and the ``/send``."""
    cancel_after: float | None = None
    """Cancel its first attempt this many virtual seconds after it arrives (client gone)."""
    retries: bool = True
    """Whether a cancelled caller tries again (encode and send) at once, as a client would."""


@dataclass(frozen=True)
class Schedule:
    """Everything that decides a run; equal schedules give identical runs."""

    seed: int
    """The seed it was drawn from (see :func:`random_schedule`); replays it."""
    callers: tuple[Caller, ...]
    """Every rank's client of every request, in the order their tasks are started."""
    ranks: int
    """Receiving ranks per request (each request's ``receive_count``)."""
    requests: int = 1
    """Requests in the run, each with its own ``req_id``."""
    shared_image: bool = False
    """All requests encode the same image; the encoder hands them one embedding (a cache
    hit), so their scopes lease one registration."""
    max_latency: tuple[tuple[LatencyKind, float], ...] = tuple((k, 2.0) for k in LATENCY_KINDS)
    """Upper bound of each kind's virtual latency (0 makes those calls instantaneous)."""
    fault_rate: float = 0.0
    """Chance that an engine call (register, deregister, transfer) fails with Mooncake's -1,
    without effect; a deregistration fails at most once per address, as a transient error
    would. Callers answered 502 send again, up to :data:`SEND_TRIES` times."""
    victim: int | None = None
    """Index in :attr:`callers` of the caller cancelled at step :attr:`cancel_at`."""
    cancel_at: int | None = None
    """Cancel the victim's first attempt once this many task steps (of any task; a step is a
    task's run from one checkpoint to the next) have run since it started; ``None`` or 0
    only counts them."""

    def at_step(self, victim: int, step: int) -> Schedule:
        """The same schedule with caller ``victim`` cancelled after ``step`` steps."""
        return dataclasses.replace(self, victim=victim, cancel_at=step)

    def latency_bound(self, kind: LatencyKind) -> float:
        return dict(self.max_latency)[kind]


@dataclass
class Answer:
    """What one call was answered: 200, or an error's contract status and class."""

    caller: int
    attempt: int
    call: Literal["encode", "send"]
    status: int
    error: str = ""
    engine_call: str = ""
    """For a 502, the engine call that failed."""


@dataclass
class Outcome:
    """A judged run: what broke (empty if nothing), and what the driver saw."""

    schedule: Schedule
    failures: list[str] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    victim_steps: int = 0
    """Task steps run while the victim's first attempt ran (a cancelled attempt may take a
    few more steps to unwind, e.g. waiting for a worker-thread call)."""
    phase: Phase | None = None
    """Where the victim was when cancelled (``None`` if the step was never reached)."""

    @property
    def ok(self) -> bool:
        return not self.failures

    def describe(self) -> str:
        lines = [f"{self.schedule!r}", f"cancelled in phase {self.phase}"]
        lines += [f"  broke: {failure}" for failure in self.failures]
        lines += [f"  answer: {answer}" for answer in self.answers]
        return "\n".join(lines)


@dataclass(frozen=True)
class Workload:
    """The encoder under test and what it must produce: ``images[i]`` is request ``i``'s
    ``mm_items`` entry and ``expected[i]`` the bytes of its embedding, computed independently
    of the server."""

    make_encoder: Callable[[], Encoder]
    images: Sequence[str]
    expected: Sequence[bytes]

    def request_index(self, schedule: Schedule, request: int) -> int:
        return 0 if schedule.shared_image else request


# -- random schedules ------------------------------------------------------------------------


def random_schedule(
    seed: int,
    *,
    cancellations: bool = True,
    threads_take_time: bool = True,
    faults: bool = True,
) -> Schedule:
    """A schedule drawn from ``seed``: 1-4 ranks, 1-2 requests (sometimes sharing their image),
    random arrivals and gaps, and (with ``cancellations``) a random subset of callers cancelled
    after a random delay, most of them retrying.

    With ``threads_take_time=False`` the calls that run in worker threads (loading items,
    registering, deregistering) take no virtual time, so no cancellation lands inside one and
    no call waits for one to settle. With ``faults`` one engine call in ten fails.
    """
    rng = random.Random(seed)
    ranks = rng.randint(1, 4)
    requests = rng.randint(1, 2)
    callers = []
    for request in range(requests):
        for rank in range(ranks):
            cancelled = rng.random() < 0.3 and cancellations
            callers.append(
                Caller(
                    request,
                    rank,
                    arrive=rng.randint(0, 8) / 2,
                    gap=rng.choice([0.0, 0.0, 0.5, 1.0]),
                    cancel_after=rng.randint(0, 12) / 4 if cancelled else None,
                    retries=rng.random() < 0.8,
                )
            )
    rng.shuffle(callers)  # the order the callers' tasks are started in
    slow = 2.0 if threads_take_time else 0.0
    bounds: dict[LatencyKind, float] = {
        "load": slow,
        "encode": 2.0,
        "register": slow,
        "deregister": slow,
        "transfer": 2.0,
    }
    return Schedule(
        seed=seed,
        callers=tuple(callers),
        ranks=ranks,
        requests=requests,
        shared_image=requests > 1 and rng.random() < 0.5,
        max_latency=tuple(bounds.items()),
        fault_rate=0.1 if faults else 0.0,
    )


# -- deterministic scheduling ----------------------------------------------------------------


@contextlib.contextmanager
def seeded_scheduler(seed: int) -> Iterator[None]:
    """Make Trio's order of ready tasks a shuffle seeded by ``seed``.

    Trio shuffles each batch of ready tasks with a module-level ``random.Random`` and, when
    Hypothesis is loaded, sorts the batch first so the shuffle is reproducible. That is a
    private hook; it is used here because replaying a failing seed is worth more than keeping
    to the public API, and a Trio release that moves it makes this fail loudly, not silently.
    """
    state = _trio_run._r.getstate()
    namespace = vars(_trio_run)
    deterministic = namespace["_ALLOW_DETERMINISTIC_SCHEDULING"]
    namespace["_ALLOW_DETERMINISTIC_SCHEDULING"] = True
    _trio_run._r.seed(seed)
    try:
        yield
    finally:
        namespace["_ALLOW_DETERMINISTIC_SCHEDULING"] = deterministic
        _trio_run._r.setstate(state)


# -- the run ---------------------------------------------------------------------------------


class _Latencies:
    """One seeded stream of virtual latencies per kind, so that a cancellation that changes
    how many calls of one kind happen does not shift the latencies of the others."""

    def __init__(self, schedule: Schedule) -> None:
        self._bounds = dict(schedule.max_latency)
        self._streams = {kind: random.Random(f"{schedule.seed}:{kind}") for kind in LATENCY_KINDS}

    def next(self, kind: LatencyKind) -> float:
        bound = self._bounds[kind]
        stream = self._streams[kind]
        if bound <= 0 or stream.random() < 0.25:
            return 0.0
        # Quarter-second steps: ties between calls are common, and ties are where order races.
        return stream.randint(1, max(1, int(bound * 4))) / 4


class _ThreadLikeEncoder(PassThroughEncoder):
    """Wraps an encoder so its calls take seeded virtual time the way the real one's do.

    ``load_items`` runs in a worker thread in the real encoder, so here it is shielded: a
    cancelled caller still waits for it and sees the cancellation only at its next checkpoint.
    ``encode`` waits in a queue, which a cancelled caller leaves at once. With ``shared`` the
    same images get the same embedding object while any holder keeps it alive (a cache hit).
    """

    def __init__(self, inner: Encoder, latencies: _Latencies, *, shared: bool) -> None:
        super().__init__(inner)
        self._latencies = latencies
        self._shared = shared
        self._cache: weakref.WeakValueDictionary[tuple[bytes, ...], Any] = (
            weakref.WeakValueDictionary()
        )
        self.loading: set[trio.lowlevel.Task] = set()
        """Tasks inside ``load_items`` now."""
        self.loaded: set[trio.lowlevel.Task] = set()
        """Tasks whose ``load_items`` returned."""
        self.handed_out: list[tuple[weakref.ref[Any], int, int]] = []
        self.on_drop: Callable[[int, int], None] = lambda address, nbytes: None

    async def load_items(self, items: Sequence[str], modality: str = "IMAGE") -> list[bytes]:
        task = trio.lowlevel.current_task()
        await trio.lowlevel.checkpoint_if_cancelled()
        self.loading.add(task)
        try:
            with trio.CancelScope(shield=True):
                await trio.sleep(self._latencies.next("load"))
                images = await self._inner.load_items(items, modality)
            self.loaded.add(task)
            return images
        finally:
            self.loading.discard(task)

    async def encode(self, images: Sequence[bytes], modality: str = "IMAGE") -> EmbeddingMemory:
        await trio.sleep(self._latencies.next("encode"))
        key = tuple(images)
        if self._shared and key in self._cache:
            cached: EmbeddingMemory = self._cache[key]
            return cached
        embedding = await self._inner.encode(images, modality)
        weakref.finalize(embedding, self.on_drop, embedding.address, embedding.nbytes)
        self.handed_out.append((weakref.ref(embedding), embedding.address, embedding.nbytes))
        if self._shared:
            self._cache[key] = embedding
        return embedding


class _RecordingEngine(ForwardingEngine):
    """The service's engine: forwards to an in-memory engine, makes seeded calls fail (as
    Mooncake's -1, without effect), and appends every completed write to the run's ordered
    log, right when its bytes have landed."""

    def __init__(
        self, engine: InMemoryEngine, log: list[tuple[str, Receiver]], schedule: Schedule
    ) -> None:
        super().__init__(engine)
        self._memory = engine
        self._log = log
        self._rate = schedule.fault_rate
        self._streams = {
            kind: random.Random(f"{schedule.seed}:fault:{kind}") for kind in CALL_KINDS
        }
        self.failed_transfers: Counter[Receiver] = Counter()
        self.failed_registers = 0
        self._failed_deregistrations: set[int] = set()

    async def _maybe_fail(self, kind: CallKind) -> bool:
        # Decide only once the call is sure to start (a cancelled caller never starts one),
        # so the failure scripted here is the one this call consumes.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._rate <= 0 or self._streams[kind].random() >= self._rate:
            return False
        self._memory.fail_next(kind, TRANSFER_FAILED)
        return True

    async def register(self, address: int, length: int) -> None:
        if await self._maybe_fail("register"):
            self.failed_registers += 1
        await super().register(address, length)

    async def deregister(self, address: int) -> None:
        # A failed deregistration is transient: asked again, the engine releases the memory.
        if address not in self._failed_deregistrations and await self._maybe_fail("deregister"):
            self._failed_deregistrations.add(address)
        await super().deregister(address)

    async def transfer(self, write: Write, *, submitted: trio.Event | None = None) -> None:
        receiver = Receiver(write.session_id, write.remote_address)
        if await self._maybe_fail("transfer"):
            self.failed_transfers[receiver] += 1
        await super().transfer(write, submitted=submitted)
        self._log.append(("wrote", receiver))


class _StepCanceller(trio.abc.Instrument):
    """Counts the task steps (of any task) taken while the victim's first attempt runs, and
    cancels that attempt right after step ``cancel_at``. The victim is then parked at one of
    its checkpoints, and the rest of the system is wherever that step left it: so the runs
    for every step cancel the victim at each of its checkpoints, and at each one in every
    state the other tasks pass through while it waits there (its register, its transfer).

    It also ends a run that livelocks: tasks that keep checkpointing without ever blocking
    stop the mock clock (it jumps only when every task is blocked), so a spin would otherwise
    hang the explorer instead of failing it.
    """

    def __init__(self, cancel_at: int | None, probe: Callable[[], Phase]) -> None:
        self.cancel_at = cancel_at
        self.steps = 0
        self.phase: Phase | None = None
        self.livelocked = False
        self.run_scope: trio.CancelScope | None = None
        self._probe = probe
        self._task: trio.lowlevel.Task | None = None
        self._scope: trio.CancelScope | None = None
        self._total_steps = 0

    def arm(self, scope: trio.CancelScope) -> None:
        self._task = trio.lowlevel.current_task()
        self._scope = scope

    def disarm(self) -> None:
        self._scope = None

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self._total_steps += 1
        if self._total_steps > _STEP_BUDGET and not self.livelocked and self.run_scope:
            self.livelocked = True
            self.run_scope.cancel()
        if self._scope is None:
            return
        self.steps += 1
        if self.steps == self.cancel_at:
            self.phase = self._probe()
            self._scope.cancel()


@dataclass
class _CallerState:
    index: int
    caller: Caller
    req_id: str
    item: str
    receiver: Receiver
    call: Literal["encode", "send"] = "encode"
    cancelled: bool = False


class _Run:
    """One schedule's run: the service, the callers, and everything recorded for the judge."""

    def __init__(self, schedule: Schedule, workload: Workload) -> None:
        self.schedule = schedule
        self.workload = workload
        self.latencies = _Latencies(schedule)
        self.fabric = InMemoryFabric()
        self.sender = self.fabric.engine("encoder")
        for kind in ("register", "deregister", "transfer"):
            self.sender.script_latency(kind, self._engine_latency)
        self.log: list[tuple[str, Receiver]] = []
        self.engine = _RecordingEngine(self.sender, self.log, schedule)
        self.encoder = _ThreadLikeEncoder(
            workload.make_encoder(), self.latencies, shared=schedule.shared_image
        )
        self.encoder.on_drop = self._dropped
        self.nbytes = max(len(expected) for expected in workload.expected)
        self.buffers: dict[Receiver, Any] = {}
        self.ranks = [self.fabric.engine(f"rank{rank}") for rank in range(schedule.ranks)]
        self.states = [self._state(i, caller) for i, caller in enumerate(schedule.callers)]
        self.answers: list[Answer] = []
        self.failures: list[str] = []
        self.opened: dict[str, float] = {}
        self.closed: dict[str, float] = {}
        self.service: EncodeService | None = None
        victim = self.states[schedule.victim] if schedule.victim is not None else None
        self.victim = victim
        self.canceller = _StepCanceller(schedule.cancel_at, self._phase)

    def _state(self, index: int, caller: Caller) -> _CallerState:
        engine = self.ranks[caller.rank]
        buffer = ctypes.create_string_buffer(self.nbytes)
        receiver = Receiver(engine.session_id, ctypes.addressof(buffer))
        self.buffers[receiver] = buffer
        image = self.workload.images[self.workload.request_index(self.schedule, caller.request)]
        return _CallerState(index, caller, f"req{caller.request}", image, receiver)

    def _engine_latency(self, call: CallRecord) -> float:
        return self.latencies.next(call.kind)

    def _dropped(self, address: int, nbytes: int) -> None:
        # Invariant 3: memory is freed only once no registration covers any of it.
        for start, length in self.sender.live_registrations.items():
            if start < address + nbytes and address < start + length:
                self.failures.append(
                    f"embedding {address:#x}+{nbytes} freed while registered ({start:#x})"
                )

    def _phase(self) -> Phase:
        victim = self.victim
        assert victim is not None
        assert self.service is not None
        if victim.call == "encode":
            task = self.canceller._task
            if task in self.encoder.loading:
                return "load"
            if task in self.encoder.loaded:
                live = {scope.req_id: scope for scope in self.service.registry.scopes()}
                scope = live.get(victim.req_id)
                if scope is None or not scope.accepting:
                    return "open"
            return "wait"
        in_flight = self.sender.in_flight
        if any(call.kind == "register" for call in in_flight):
            return "register"
        if any(call.kind == "deregister" for call in in_flight):
            return "release"
        if any(
            call.kind == "transfer"
            and Receiver(call.session_id, call.remote_address or 0) == victim.receiver
            for call in in_flight
        ):
            return "transfer"
        return "wait"

    # -- the body ----------------------------------------------------------------------------

    async def main(self) -> None:
        for receiver, buffer in self.buffers.items():
            rank = self.fabric.lookup(receiver.session_id)
            assert rank is not None
            await rank.register(receiver.buffer_address, ctypes.sizeof(buffer))
        observer = _TimesObserver(self.opened, self.closed)
        settings = ServiceSettings(send_timeout=SEND_TIMEOUT, shutdown_grace=0.0)
        with trio.fail_after(_HANG), trio.CancelScope() as everything:
            self.canceller.run_scope = everything
            async with EncodeService.running(
                engine=self.engine, encoder=self.encoder, settings=settings, observer=observer
            ) as service:
                self.service = service
                async with trio.open_nursery() as nursery:
                    for state in self.states:
                        nursery.start_soon(self._caller, state)
                # Let every scope end by its own rules (at the latest its backstop), then look.
                await trio.sleep(SEND_TIMEOUT + 2 * self.schedule.latency_bound("transfer") + 1)
                if len(service.registry):
                    self.failures.append(
                        f"{len(service.registry)} scope(s) outlived their deadline"
                    )

    async def _caller(self, state: _CallerState) -> None:
        await trio.sleep(state.caller.arrive)
        with trio.CancelScope() as attempt:
            if state is self.victim:
                self.canceller.arm(attempt)
            elif state.caller.cancel_after is not None:
                attempt.deadline = trio.current_time() + state.caller.cancel_after
            try:
                await self._attempt(state, 0)
            finally:
                if state is self.victim:
                    self.canceller.disarm()
        state.cancelled = attempt.cancelled_caught
        if state.cancelled and state.caller.retries:
            await self._attempt(state, 1)

    async def _attempt(self, state: _CallerState, attempt: int) -> None:
        assert self.service is not None
        state.call = "encode"
        status = await self._answer(
            state,
            attempt,
            "encode",
            self.service.encode(state.req_id, [state.item], receive_count=self.schedule.ranks),
        )
        if status != 200:
            return
        await trio.sleep(state.caller.gap)
        state.call = "send"
        for _ in range(SEND_TRIES):
            status = await self._answer(
                state,
                attempt,
                "send",
                self.service.send(state.req_id, state.receiver, receive_count=self.schedule.ranks),
            )
            if status == 200:
                self.log.append(("answered", state.receiver))
            if status != 502:
                return

    async def _answer(
        self,
        state: _CallerState,
        attempt: int,
        call: Literal["encode", "send"],
        pending: Any,
    ) -> int:
        try:
            await pending
        except RequestError as exc:
            self.answers.append(Answer(state.index, attempt, call, exc.status, repr(exc)))
            return exc.status
        except EngineError as exc:
            self.answers.append(Answer(state.index, attempt, call, 502, repr(exc), exc.call))
            return 502
        self.answers.append(Answer(state.index, attempt, call, 200))
        return 200


class _TimesObserver(NullObserver):
    """Records when each scope opened and closed (for the deadline invariant)."""

    def __init__(self, opened: dict[str, float], closed: dict[str, float]) -> None:
        self._opened = opened
        self._closed = closed

    def scope_opened(self, req_id: str) -> None:
        self._opened[req_id] = trio.current_time()

    def scope_closed(self, req_id: str, reason: str, seconds: float) -> None:
        self._closed[req_id] = trio.current_time()


# -- the judge -------------------------------------------------------------------------------


def run_schedule(schedule: Schedule, workload: Workload) -> Outcome:
    """Run ``schedule`` on the mock clock and judge it against every invariant."""
    run = _Run(schedule, workload)
    clock = trio.testing.MockClock(autojump_threshold=0)
    with seeded_scheduler(schedule.seed):
        try:
            trio.run(run.main, clock=clock, instruments=[run.canceller])
        except BaseException as exc:  # a crash or hang is a finding, not a test error
            if isinstance(exc, KeyboardInterrupt):
                raise
            run.failures.append(f"the run raised {exc!r}")
    if run.canceller.livelocked:
        run.failures.append(f"livelock: {_STEP_BUDGET} task steps without the clock moving")
    outcome = Outcome(
        schedule,
        failures=run.failures,
        answers=run.answers,
        victim_steps=run.canceller.steps,
        phase=run.canceller.phase,
    )
    _judge(run, outcome)
    return outcome


def _judge(run: _Run, outcome: Outcome) -> None:
    failures = outcome.failures
    sender = run.sender
    failures += [f"engine violation: {v}" for v in run.fabric.violations]
    for call in sender.history:
        if call.done and not call.ok and not call.scripted:
            failures.append(f"{call.kind} failed with {call.code} (#{call.seq})")
    if sender.live_registrations:
        failures.append(f"registrations left: {sender.live_registrations}")
    if sender.count("register", ok=True) != sender.count("deregister", ok=True):
        failures.append("registrations and deregistrations do not pair up")
    for ref, address, nbytes in run.encoder.handed_out:
        if ref() is not None:
            failures.append(f"embedding {address:#x}+{nbytes} still held after the run")
    # Invariant 4: the deadline, plus the longest engine call already running then (a
    # transfer, or a registration), plus the release's own deregistration (retried once).
    latency = run.schedule.latency_bound
    bound = SEND_TIMEOUT + max(latency("transfer"), latency("register")) + 2 * latency("deregister")
    for req_id, opened in run.opened.items():
        closed = run.closed.get(req_id)
        if closed is None or closed - opened > bound:
            failures.append(f"{req_id} ended at {closed}, opened at {opened}: past its deadline")
    _judge_writes(run, failures)
    _judge_answers(run, failures)


def _judge_writes(run: _Run, failures: list[str]) -> None:
    """No write into a receiver's buffer after it was answered 200; only whole, right bytes."""
    answered: set[Receiver] = set()
    for event, receiver in run.log:
        if event == "answered":
            answered.add(receiver)
        elif receiver in answered:
            failures.append(f"write into {receiver} after its 200")
    for state in run.states:
        expected = run.workload.expected[
            run.workload.request_index(run.schedule, state.caller.request)
        ]
        landed = run.buffers[state.receiver].raw[: len(expected)]
        if landed not in (expected, bytes(len(expected))):
            failures.append(f"caller {state.index}: wrong bytes in {state.receiver}")


def _judge_answers(run: _Run, failures: list[str]) -> None:
    """Siblings are unaffected; a cancelled caller's retry is served (or told it is done);
    a 502 is answered only for an engine call that was made to fail."""
    register_faults = run.engine.failed_registers
    transfer_faults = Counter(run.engine.failed_transfers)
    for state in run.states:
        answers = [a for a in run.answers if a.caller == state.index]
        request = run.workload.request_index(run.schedule, state.caller.request)
        landed = (
            run.buffers[state.receiver].raw[: len(run.workload.expected[request])]
            == (run.workload.expected[request])
        )
        if not state.cancelled:
            final = [a for a in answers if a.attempt == 0]
        elif state.caller.retries:
            final = [a for a in answers if a.attempt == 1]
        else:
            continue
        role = "retry" if state.cancelled else "sibling"
        for answer in final:
            if answer.status == 200:
                continue
            if answer.status == 502 and answer.engine_call == "transfer":
                if transfer_faults[state.receiver] > 0:
                    transfer_faults[state.receiver] -= 1
                    continue
            elif answer.status == 502 and answer.engine_call == "register":
                if register_faults > 0:
                    register_faults -= 1
                    continue
            # 410 is right only for a retry whose first transfer already landed and counted.
            elif answer.status == RequestReleased.status and state.cancelled and landed:
                continue
            failures.append(
                f"caller {state.index} ({role}) got {answer.status} for {answer.call}: "
                f"{answer.error}"
            )
        sends = [a for a in final if a.call == "send"]
        if sends and sends[-1].status == 200 and not landed:
            failures.append(f"caller {state.index} was answered 200 but its bytes did not land")
        if final and final[-1].call == "encode" and final[-1].status == 200:
            failures.append(f"caller {state.index} got no answer to its send")


# -- sweeps ----------------------------------------------------------------------------------


def count_steps(schedule: Schedule, victim: int, workload: Workload) -> int:
    """How many task steps run while caller ``victim``'s first attempt runs uncancelled."""
    return run_schedule(schedule.at_step(victim, 0), workload).victim_steps


def cancel_everywhere(schedule: Schedule, victim: int, workload: Workload) -> list[Outcome]:
    """One run per task step taken while the victim's first attempt runs, cancelling the
    attempt right after that step. If the run without a cancellation already fails, that run
    alone (there is nothing to learn from cancelling a broken run)."""
    base = run_schedule(schedule.at_step(victim, 0), workload)
    if not base.ok:
        return [base]
    return [
        run_schedule(schedule.at_step(victim, step), workload)
        for step in range(1, base.victim_steps + 1)
    ]


def explore_seeds(
    seeds: Iterable[int],
    workload: Workload,
    *,
    cancellations: bool = True,
    threads_take_time: bool = True,
    faults: bool = True,
) -> list[Outcome]:
    """Run :func:`random_schedule` for each seed; the failing outcomes."""
    failing = []
    for seed in seeds:
        schedule = random_schedule(
            seed,
            cancellations=cancellations,
            threads_take_time=threads_take_time,
            faults=faults,
        )
        outcome = run_schedule(schedule, workload)
        if not outcome.ok:
            failing.append(outcome)
    return failing
