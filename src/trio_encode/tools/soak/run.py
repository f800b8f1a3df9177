"""``trio-encode soak``: thousands of requests against a real server while things go wrong.

A ``trio-encode serve`` child process (its engine failing a fraction of calls with
``--engine-faults``, ``MC_TRANSFER_TIMEOUT`` short), TP receiver processes each with its own
Mooncake engine, and this process acting as the ranks' HTTP clients: every request is
``/encode`` then ``/send`` from every rank, ``concurrency`` requests at a time. After a
warm-up, the faults come:

- vanished clients: a rank's ``/encode`` body cut off mid-way (then sent again), a rank that
  never sends after its ``/encode``, a ``/send`` abandoned after a few ms (then retried);
- a frozen rank: one receiver SIGSTOPped for ``freeze_seconds`` (its transfers hang in the
  server until the engine's timeout), while a probe times unrelated requests;
- a rank frozen past the deadline: another receiver SIGSTOPped mid-transfer until its requests'
  deadlines have passed (``send_timeout`` + 2 s), then resumed: what Mooncake still had in
  flight for it lands then, and must be its own requests' bytes;
- a dead rank: one receiver SIGKILLed, and a new one started in its place;
- (with ``first_contact_freeze``) a rank frozen at first contact: a new receiver takes rank 0's
  place and is SIGSTOPped before the server has ever reached it, while its calls go on, so the
  server's first transfer to it meets a frozen peer; meanwhile (``first_contact_sends``) many
  more requests each send to it at once, and a new, healthy receiver's first request is timed.

Then it checks, from ``/metrics`` and every receiver: every answer is one the contract allows
(a 200 whose bytes are the model's, byte for byte, and never written again after its answer;
or a documented error in the contract's shape), no slot ever holds a byte that its own request
did not send (a slot handed to a request must still hold the marker it was filled with when its
last request ended), no call outlived its request's deadline, no
scope and no registration is left once the deadlines have passed, the server's RSS stayed
within ``rss_tolerance`` of its level after the warm-up, the probe's median latency while
a rank was frozen stayed within ``probe_tolerance`` of its median just before, and while a rank
was frozen at first contact every probe, and the new receiver's first request, answered within
:data:`FIRST_CONTACT_BOUND`.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import httpx
import trio
from pydantic import BeforeValidator, Field, model_validator
from pydantic.dataclasses import dataclass as settings_dataclass

from trio_encode.declare import SETTINGS, in_group
from trio_encode.encoder import EncoderSettings
from trio_encode.settings import (
    ServerSettings,
    flags,
    model_fields,
    serve_flags,
    server_settings,
)
from trio_encode.testing.faults import DrillSettings, EngineFaults, FaultPlan
from trio_encode.testing.identity import SlotReading
from trio_encode.tools.soak.drill import Call, Rank, Slot, TaggedImages, describe, post
from trio_encode.tools.soak.receiver import ReceiverGone, ReceiverProcess, open_receiver
from trio_encode.tools.soak.server import ServerProcess, open_server_process

FIRST_CONTACT_BOUND = 2.0
"""Seconds an unrelated request's /encode + /send may take while a rank is frozen at first
contact."""

ALLOWED = {"/encode": {200, 410, 503, 504}, "/send": {200, 410, 502, 503, 504}}
"""What the contract lets each route answer in a soak (no bad input is sent, so no 400, and
no /send is made without its rank's /encode, so no 404). A 502 must name code -1."""


def _none_when_empty(value: Any) -> Any:
    return None if value == "" else value


OptionalFaults = Annotated[EngineFaults | None, BeforeValidator(_none_when_empty)]


soak_setting = in_group("soak")


@settings_dataclass(frozen=True, config=SETTINGS)
class SoakConfig:
    """What to run; the defaults are the full soak (several minutes on 2 cores). The fields
    declared with ``setting`` are flags of ``trio-encode soak``."""

    requests: int = soak_setting(5000, gt=0)
    """Requests to run."""
    tp: int = soak_setting(4, gt=0)
    """Receiving prefill ranks."""
    images: int = soak_setting(200, ge=2)
    """Recent images a request may repeat (so the embedding cache both hits and evicts), and photos
    a new image is drawn from."""
    concurrency: int = soak_setting(12, gt=0)
    """Requests in flight at once."""
    warmup: int = soak_setting(500, ge=0)
    """Requests before client faults start and the RSS level is taken (at most all but one)."""
    send_timeout: float = soak_setting(10.0, flags=("--soak-send-timeout",))
    """The server's --send-timeout during the soak."""
    engine_faults: OptionalFaults = soak_setting(
        FaultPlan(register=0.005, transfer=0.005, seed=1), flags=("--soak-engine-faults",)
    )
    """The server's --engine-faults during the soak ('' for none)."""
    vanish_rate: float = soak_setting(0.01, ge=0, le=0.3)
    """Per rank and request, the chance of each way a client vanishes (mid-body, after /encode,
    mid-/send)."""
    freeze_seconds: float = soak_setting(8.0, ge=0)
    """How long one rank is SIGSTOPped (0: never)."""
    kill: bool = soak_setting(True)
    """SIGKILL one rank."""
    first_contact_freeze: float = soak_setting(8.0, ge=0)
    """Seconds a new rank 0 stays SIGSTOPped from its start while its calls go on, so the server's
    first contact with it meets a frozen peer (0: never)."""
    first_contact_sends: int = soak_setting(48, ge=0)
    """While that rank is frozen, requests of one image that each send to it, all at once; then a
    new, healthy receiver's first /encode + /send is timed against the first-contact bound (0:
    none)."""
    freeze_past_deadline: bool = soak_setting(True)
    """SIGSTOP another rank mid-transfer until its requests' deadlines passed, then resume it."""
    two_image_share: float = Field(default=0.1, ge=0, le=1)
    """Share of requests with two images rather than one."""
    repeat_share: float = Field(default=0.75, ge=0, le=1)
    """After the warm-up, the share of images that repeat one of the last ``images`` new ones
    (a cache hit while it is cached); the others are new: a photo tagged with an identity of
    their own. Every image of the warm-up is new, so the cache is full (and evicting) by the
    time the RSS level is taken."""
    transfer_timeout: int = 2
    """``MC_TRANSFER_TIMEOUT`` for the server: a transfer into a frozen rank fails after about
    5 s with it (30 s without)."""
    rss_tolerance: float = 0.10
    probe_tolerance: float = 2.0
    probe_interval: float = 0.1
    encoder: EncoderSettings = Field(default_factory=EncoderSettings)
    server_env: tuple[tuple[str, str], ...] = ()
    """Extra environment for the server process."""
    seed: int = 0

    @model_validator(mode="after")
    def _server_starts(self) -> SoakConfig:
        self.server()  # refused here, before anything starts
        return self

    @property
    def warmup_requests(self) -> int:
        """Requests before the faults: ``warmup``, leaving at least one request after it."""
        return min(self.warmup, self.requests - 1)

    def server(self) -> ServerSettings:
        """The settings of the server process (its flags:
        :func:`~trio_encode.settings.serve_flags`)."""
        return server_settings(
            port=0,
            send_timeout=self.send_timeout,
            shutdown_grace=5,
            log_level="INFO",
            log_format="kv",
            encoder=self.encoder,
        )

    @property
    def deadline_bound(self) -> float:
        """The longest any call may take: the request's deadline, plus one transfer into a
        frozen rank that the scope must wait for, plus slack for a loaded machine."""
        return self.send_timeout + 5.0 * self.transfer_timeout + 5.0


@dataclass
class Counts:
    requests_done: int = 0
    vanished_mid_body: int = 0
    vanished_after_encode: int = 0
    vanished_mid_send: int = 0
    receivers_gone: int = 0
    foreign_slots: int = 0
    """Slots found holding bytes of another request (must stay 0)."""
    foreign_bytes: int = 0
    """Bytes of another request found in a slot (must stay 0)."""
    corrupt_bytes: int = 0
    """Bytes that were no request's, or a request's own bytes missing or out of place."""


@dataclass
class SoakResult:
    config: dict[str, Any]
    seconds: float
    statuses: dict[str, dict[str, int]]
    counts: Counts
    checked_bytes: int
    engine_errors: dict[str, float]
    backstop_expiries: float
    left_scopes: float
    left_registrations: float
    rss_after_warmup: int
    rss_max_after_warmup: int
    """The highest 10-s median RSS after the warm-up, outside the frozen rank's window."""
    rss_max_while_frozen: int
    """The highest 10-s median from the freeze (or the kill) until the deadlines of the
    requests that rank held up passed."""
    rss_peak_sample: int
    """The highest single RSS sample after the warm-up, for the record."""
    rss_after_drain: int
    rss_samples: list[tuple[float, int, int]]
    """(seconds since start, requests done, RSS bytes)."""
    probe_baseline_median: float
    probe_frozen_median: float
    probe_frozen_count: int
    probe_first_contact_max: float
    """The slowest probe while a rank was frozen at first contact (0 without that fault)."""
    new_rank_first_contact: float
    """Seconds of a new, healthy receiver's first request while many sends waited on the rank
    frozen at first contact (0 without that fault)."""
    frozen_new_rank_sends: int
    """/send calls of the ``first_contact_sends`` requests answered while their rank was frozen
    (each failed: a frozen rank is never reached)."""
    probe_samples: list[tuple[float, float]]
    """(seconds since start, latency) of every probe; the freeze is ``freeze_window``."""
    freeze_window: tuple[float, float] | None
    late_freeze_window: tuple[float, float] | None
    """When a rank was frozen past its requests' deadline (seconds since start)."""
    slowest_call: float
    violations: list[str]

    @property
    def rss_ratio(self) -> float:
        return self.rss_max_after_warmup / max(1, self.rss_after_warmup)

    @property
    def probe_ratio(self) -> float:
        return self.probe_frozen_median / max(1e-9, self.probe_baseline_median)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["rss_ratio"], data["probe_ratio"], data["ok"] = (
            self.rss_ratio,
            self.probe_ratio,
            self.ok,
        )
        return data

    def table(self) -> str:
        mib = 1 << 20
        c = self.counts
        lines = [
            f"trio-encode soak: {c.requests_done} requests x TP={self.config['tp']} in "
            f"{self.seconds:.0f} s ({self.checked_bytes / 1e9:.2f} GB checked byte for byte)",
            "",
            f"{'route':10}{'status':>8}{'answers':>10}",
        ]
        for route, by_status in sorted(self.statuses.items()):
            for status, count in sorted(by_status.items()):
                lines.append(f"{route:10}{status:>8}{count:>10}")
        errors = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(self.engine_errors.items()))
        lines += [
            "",
            f"faults: engine errors {{{errors}}}; vanished clients: mid-body "
            f"{c.vanished_mid_body}, after /encode {c.vanished_after_encode}, mid-/send "
            f"{c.vanished_mid_send}; backstop expiries {self.backstop_expiries:.0f}",
            f"deadline: slowest call {self.slowest_call:.2f} s",
            f"foreign bytes: {c.foreign_bytes} (bytes of another request, in {c.foreign_slots} "
            f"slots); other corruption: {c.corrupt_bytes} bytes"
            + (
                ""
                if self.late_freeze_window is None
                else f" (a rank was frozen past its deadline for "
                f"{self.late_freeze_window[1] - self.late_freeze_window[0]:.1f} s)"
            ),
            f"left after drain: {self.left_scopes:.0f} scopes, "
            f"{self.left_registrations:.0f} registrations",
            f"server RSS (10-s medians): {self.rss_after_warmup / mib:.0f} MiB after warm-up, "
            f"max {self.rss_max_after_warmup / mib:.0f} MiB after it ({self.rss_ratio:.3f}x; "
            f"{self.rss_max_while_frozen / mib:.0f} MiB while a frozen or dead rank's requests "
            "were held); "
            f"highest sample {self.rss_peak_sample / mib:.0f} MiB; "
            f"{self.rss_after_drain / mib:.0f} MiB after drain",
            f"probe while a rank was frozen: median {self.probe_frozen_median * 1000:.1f} ms "
            f"({self.probe_frozen_count} probes) vs {self.probe_baseline_median * 1000:.1f} ms "
            f"before ({self.probe_ratio:.2f}x)",
            f"probe while a rank was frozen at first contact: slowest "
            f"{self.probe_first_contact_max * 1000:.0f} ms (bound {FIRST_CONTACT_BOUND:g} s); "
            f"a new rank's first request {self.new_rank_first_contact * 1000:.0f} ms while "
            f"{self.frozen_new_rank_sends} sends to it were answered",
        ]
        lines += [f"VIOLATION: {v}" for v in self.violations[:50]]
        if len(self.violations) > 50:
            lines.append(f"... and {len(self.violations) - 50} more")
        lines.append("OK" if self.ok else "soak FAILED")
        return "\n".join(lines)


def server_environment(config: SoakConfig) -> dict[str, str]:
    """What the server's environment adds (its settings are its flags): the engine's timeout
    and ``server_env``."""
    return {"MC_TRANSFER_TIMEOUT": str(config.transfer_timeout), **dict(config.server_env)}


def server_arguments(config: SoakConfig) -> list[str]:
    """The server's command line (``drill-serve``'s): its settings, and the drill's."""
    drill = DrillSettings(engine_faults=config.engine_faults, stamp_embeddings=True)
    given = {name: getattr(drill, name) for name in model_fields(DrillSettings)}
    return serve_flags(config.server()) + flags({k: v for k, v in given.items() if v is not None})


RSS_WINDOW = 10.0
"""Seconds of RSS samples whose median is one reading of the level."""


def _rss_windows(samples: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """``(start, median RSS)`` of consecutive ``RSS_WINDOW``-second windows."""
    windows: list[tuple[float, int]] = []
    start: float | None = None
    current: list[int] = []
    for t, rss in samples:
        if start is None:
            start = t
        if t >= start + RSS_WINDOW:
            windows.append((start, int(statistics.median(current))))
            start, current = t, []
        current.append(rss)
    return windows


@dataclass(eq=False)
class _ManySends:
    """The requests of the many-sends fault, encoded, and the new receiver timed meanwhile."""

    healthy: Rank
    encoded: list[tuple[str, list[tuple[int, str]]]] = field(default_factory=list)
    """``(req_id, [(identity, data URI)])`` of each request encoded."""


class _Soak:
    def __init__(self, config: SoakConfig, workload: TaggedImages, server: ServerProcess) -> None:
        self.config = config
        self.workload = workload
        self.server = server
        self.random = random.Random(config.seed)
        self.calls: list[Call] = []
        self.violations: list[str] = []
        self.counts = Counts()
        self.checked_bytes = 0
        self.ranks: list[Rank] = []
        self.probe_samples: list[tuple[float, float]] = []
        self.rss_samples: list[tuple[float, int, int]] = []
        self.started = time.monotonic()
        self.warm_at: float | None = None
        self.freeze_window: tuple[float, float] | None = None
        self.late_freeze_window: tuple[float, float] | None = None
        self.first_contact_window: tuple[float, float] | None = None
        self.new_rank_first_contact = 0.0
        """Seconds of a new, healthy receiver's first request during that window."""
        self.frozen_new_rank_sends = 0
        """/send calls of those requests answered while that rank was frozen."""
        self.late_thawed = trio.Event()
        """Set once no rank is frozen past the deadline (the probe's freeze waits for it)."""
        self.killed_at: float | None = None
        self.finished: list[float] = []
        """When each request's calls (but a frozen rank's) were done."""
        self.pace = 0.0
        """Seconds between two requests' starts while a rank is frozen (0: no pacing)."""
        self.detached = 0
        self.session_ids: set[str] = set()
        """Every receiver's ``session_id`` so far."""
        self.all_done = trio.Event()
        """Rank flows of requests dispatched while their rank was frozen, still running."""
        self.owners: dict[int, str] = {}
        """Each identity an image was tagged with: the request and image it was new in."""
        self.recent: deque[tuple[int, str]] = deque(maxlen=config.images)
        """The last new images, ``(identity, data URI)``: what a repeat draws from."""

    def draw_images(self, req_id: str, count: int) -> list[tuple[int, str]]:
        """``count`` images for ``req_id``: repeats of recent ones (once warm), or new ones
        tagged with an identity of their own."""
        images = []
        for j in range(count):
            warm = self.warm_at is not None
            if warm and self.recent and self.random.random() < self.config.repeat_share:
                images.append(self.random.choice(self.recent))
                continue
            identity = len(self.owners) + 1
            self.owners[identity] = f"{req_id} image {j}"
            photo = self.random.randrange(len(self.workload.jpegs))
            image = (identity, self.workload.item(photo, identity))
            self.recent.append(image)
            images.append(image)
        return images

    def owner(self, identity: int) -> str:
        return self.owners.get(identity, f"an identity never sent ({identity})")

    def wrong_bytes(self, reading: SlotReading, what: str) -> None:
        """Count and report what a slot held that it should not have."""
        known = [f for f in reading.foreign if f.identity in self.owners]
        unknown = sum(f.nbytes for f in reading.foreign if f.identity not in self.owners)
        if known:
            self.counts.foreign_slots += 1
            self.counts.foreign_bytes += sum(f.nbytes for f in known)
        self.counts.corrupt_bytes += unknown + reading.corrupt + reading.missing + reading.own_late
        self.violations.append(f"{what}: {describe(reading, self.owner)}")

    # -- one request -------------------------------------------------------------------------

    async def request(self, http: httpx.AsyncClient, index: int, nursery: trio.Nursery) -> None:
        req_id = f"soak-{index}"
        two = self.random.random() < self.config.two_image_share
        images = self.draw_images(req_id, 2 if two else 1)
        faults = index >= self.config.warmup_requests
        async with trio.open_nursery() as ranks:
            for r in range(self.config.tp):
                vanish = self._draw_vanish() if faults else None
                flow = partial(self.rank_flow, http, req_id, images, r, vanish, nursery)
                if self.ranks[r].receiver.frozen and not self.ranks[r].calls_while_frozen:
                    # The others go on; this rank's calls come when it is back.
                    self.detached += 1
                    nursery.start_soon(self._detached, flow)
                else:
                    ranks.start_soon(flow)
        self.counts.requests_done += 1
        self.finished.append(time.monotonic())
        self._check_done()

    def _check_done(self) -> None:
        if self.counts.requests_done == self.config.requests and not self.detached:
            self.all_done.set()

    async def _detached(self, flow: Callable[[], Awaitable[None]]) -> None:
        try:
            await flow()
        finally:
            self.detached -= 1
            self._check_done()

    def _draw_vanish(self) -> str | None:
        draw = self.random.random()
        rate = self.config.vanish_rate
        for kind in ("mid_body", "after_encode", "mid_send"):
            if draw < rate:
                return kind
            draw -= rate
        return None

    async def rank_flow(
        self,
        http: httpx.AsyncClient,
        req_id: str,
        images: list[tuple[int, str]],
        r: int,
        vanish: str | None,
        nursery: trio.Nursery,
    ) -> None:
        rank = self.ranks[r]
        try:
            await self._rank_calls(http, req_id, images, rank, vanish, nursery)
        except ReceiverGone:
            self.counts.receivers_gone += 1  # killed: the rest of its calls never happen

    async def _rank_calls(
        self,
        http: httpx.AsyncClient,
        req_id: str,
        images: list[tuple[int, str]],
        rank: Rank,
        vanish: str | None,
        nursery: trio.Nursery,
    ) -> None:
        name = rank.name
        if not rank.calls_while_frozen:
            await rank.receiver.wait_thawed()  # a frozen rank makes no calls
        body = {
            "req_id": req_id,
            "mm_items": [item for _, item in images],
            "receive_count": self.config.tp,
        }
        if vanish == "mid_body":
            self.counts.vanished_mid_body += 1
            await self._cut_off_body(body)
        for attempt in range(6):
            encode, _ = await post(http, "/encode", body, rank=name)
            self._record(encode)
            if encode.status != 503 or attempt == 5:
                break
            await trio.sleep(0.05 * (attempt + 1))  # overloaded: back off and retry
        if encode.status != 200:
            return
        if vanish == "after_encode":
            self.counts.vanished_after_encode += 1
            return
        async with rank.slot(nursery) as slot:
            if await self._send_and_check(
                http, rank, slot, req_id, images, name, vanish=vanish == "mid_send"
            ):
                self.checked_bytes += len(images) * self.workload.bytes_per_image

    async def _send_and_check(
        self,
        http: httpx.AsyncClient,
        rank: Rank,
        slot: Slot,
        req_id: str,
        images: list[tuple[int, str]],
        who: str,
        *,
        vanish: bool = False,
    ) -> bool:
        """``/send`` into ``slot`` (again after a 502, at most 4 times; with ``vanish`` a call
        abandoned after a few ms first) and check what landed. A slot whose send failed is
        marked dirty. True when answered 200 with its images' stamped bytes."""
        # A frozen receiver answers no reading until it is thawed: a slot it never used (a rank
        # frozen at first contact) is sent to at once, and the reading after a 200 covers it.
        if slot.identities or not rank.receiver.frozen:
            before = await rank.clean(slot)
            if not before.clean:
                self.wrong_bytes(before, f"{req_id} {who}: its slot held, before its /send")
        identities = [identity for identity, _ in images]
        slot.identities = tuple(identities)  # what may land there from now on is this request's
        body = {"req_id": req_id, "session_id": rank.session_id, "buffer_address": slot.address}
        if vanish:
            self.counts.vanished_mid_send += 1
            with trio.move_on_after(self.random.uniform(0, 0.01)):
                await http.post("/send", json=body)
        for _ in range(4):
            send, _ = await post(http, "/send", body, rank=who)
            self._record(send)
            if send.status != 502:
                break
        if send.status != 200:
            slot.dirty = True
            return False
        landed = await rank.verify(slot, req_id, identities)
        if not landed.clean:
            self.wrong_bytes(landed, f"{req_id} {who}: answered 200, its slot held")
            return False
        return True

    async def _cut_off_body(self, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        host, port = self.server.url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            head = (
                f"POST /encode HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(raw)}\r\n\r\n"
            ).encode()
            await stream.send_all(head + raw[: self.random.randrange(len(raw))])

    def _record(self, call: Call) -> None:
        self.calls.append(call)
        allowed = ALLOWED[call.route]
        if call.status not in allowed:
            self.violations.append(
                f"{call.req_id} {call.rank} {call.route}: {call.status} {call.message[:120]}"
            )
        elif call.status != 200 and not call.shape_ok:
            self.violations.append(
                f"{call.req_id} {call.route}: error outside the contract's shape"
            )
        elif call.status == 502 and call.code != -1:
            self.violations.append(f"{call.req_id} {call.route}: 502 with code {call.code}")
        if call.seconds > self.config.deadline_bound:
            self.violations.append(
                f"{call.req_id} {call.route} took {call.seconds:.1f} s, past its deadline"
            )

    # -- alongside -----------------------------------------------------------------------------

    async def probe(self, http: httpx.AsyncClient, rank: Rank, nursery: trio.Nursery) -> None:
        """One unrelated request (receive_count 1, its own receiver) per interval, timed."""
        i = 0
        while True:
            req_id = f"probe-{i}"
            i += 1
            image = self.draw_images(req_id, 1)
            started = time.monotonic()
            encode, _ = await post(
                http,
                "/encode",
                {"req_id": req_id, "mm_items": [image[0][1]], "receive_count": 1},
                rank="probe",
            )
            self._record(encode)
            if encode.status == 200:
                async with rank.slot(nursery) as slot:
                    await self._send_and_check(http, rank, slot, req_id, image, "probe")
                self.probe_samples.append((started, time.monotonic() - started))
            await trio.sleep(self.config.probe_interval)

    async def sample_rss(self) -> None:
        while True:
            self.rss_samples.append(
                (time.monotonic() - self.started, self.counts.requests_done, self.server.rss())
            )
            await trio.sleep(0.5)

    async def freeze_past_deadline(self, r: int) -> None:
        """Freeze a rank while its sends are in flight, until its requests' deadlines have
        passed; then resume it (a transfer Mooncake still runs for it lands now)."""
        try:
            rank = self.ranks[r]
            start = time.monotonic()
            rank.receiver.freeze()
            await trio.sleep(self.config.send_timeout + 2.0)
            rank.receiver.thaw()
            self.late_freeze_window = (start, time.monotonic())
        finally:
            self.late_thawed.set()

    async def freeze_at_first_contact(
        self,
        rank: Rank,
        http: httpx.AsyncClient,
        nursery: trio.Nursery,
        many: _ManySends | None,
    ) -> None:
        """``rank`` is new and frozen: its calls go on until it is thawed, and with ``many``
        its requests' sends come at once (the freeze lasts its seconds from when they are all
        made)."""
        start = time.monotonic()
        async with trio.open_nursery() as faults:
            if many is not None:
                await faults.start(self.many_sends_to_frozen, rank, http, nursery, many)
            await trio.sleep(self.config.first_contact_freeze)
            rank.receiver.thaw()
            rank.calls_while_frozen = False
            thawed = time.monotonic()
            self.first_contact_window = (start, thawed)
            self.frozen_new_rank_sends = sum(
                call.route == "/send"
                and call.rank == "many"
                and call.started + call.seconds < thawed
                for call in self.calls
            )

    async def prepare_many_sends(
        self, http: httpx.AsyncClient, stack: AsyncExitStack
    ) -> _ManySends:
        """Before the rank frozen at first contact exists: ``first_contact_sends`` requests of
        one image encoded (a few at a time, so the encoder's queue is not what the probes
        then wait on) and a new, healthy receiver started."""
        part = self.workload.bytes_per_image
        healthy = Rank(
            await _fresh_receiver(stack, 4 * part, "new-healthy", self.session_ids),
            part,
            dirty_seconds=self.config.deadline_bound,
        )
        many = _ManySends(healthy)
        limit = trio.Semaphore(4)

        async def encode(k: int) -> None:
            req_id = f"many-{k}"
            images = self.draw_images(req_id, 1)
            body = {"req_id": req_id, "mm_items": [images[0][1]], "receive_count": 1}
            async with limit:
                call, _ = await post(http, "/encode", body, rank="many")
            self._record(call)
            if call.status == 200:
                many.encoded.append((req_id, images))

        async with trio.open_nursery() as encodes:
            for k in range(self.config.first_contact_sends):
                encodes.start_soon(encode, k)
        return many

    async def many_sends_to_frozen(
        self,
        rank: Rank,
        http: httpx.AsyncClient,
        nursery: trio.Nursery,
        many: _ManySends,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Each of ``many``'s requests sends to the frozen ``rank`` (again after a 502, as a
        rank retries), all at once (started once they are made); once they wait in the server,
        the new, healthy receiver's first request is timed: a frozen peer's first contact must
        take nothing another new receiver needs (its probes, their threads)."""
        part = self.workload.bytes_per_image

        async def send(req_id: str, images: list[tuple[int, str]]) -> None:
            async with rank.slot(nursery) as slot:
                if await self._send_and_check(http, rank, slot, req_id, images, "many"):
                    self.checked_bytes += part

        async with trio.open_nursery() as sends:
            for req_id, images in many.encoded:
                sends.start_soon(send, req_id, images)
            task_status.started()
            await trio.sleep(0.5)  # they wait in the server, on the frozen rank's first contact
            images = self.draw_images("new-healthy", 1)
            started = time.monotonic()
            body = {"req_id": "new-healthy", "mm_items": [images[0][1]], "receive_count": 1}
            call, _ = await post(http, "/encode", body, rank="new-healthy")
            self._record(call)
            served = False
            if call.status == 200:
                async with many.healthy.slot(nursery) as slot:
                    served = await self._send_and_check(
                        http, many.healthy, slot, "new-healthy", images, "new-healthy"
                    )
            self.new_rank_first_contact = time.monotonic() - started
            if served:
                self.checked_bytes += part
            else:
                self.violations.append(
                    "a new, healthy rank's first request failed while sends waited on a rank "
                    "frozen at first contact"
                )

    async def freeze(self, r: int) -> None:
        await self.late_thawed.wait()  # one frozen rank at a time: the probe compares
        rank = self.ranks[r]
        start = time.monotonic()
        # While it is frozen, requests start no faster than they finished just before, so the
        # probe sees the same load: the other ranks' calls go on, this rank's wait.
        span = 2 * self.config.freeze_seconds
        done = [t for t in self.finished if start - span <= t < start]
        self.pace = span / len(done) if done else 0.0
        rank.receiver.freeze()
        await trio.sleep(self.config.freeze_seconds)
        rank.receiver.thaw()
        self.pace = 0.0
        self.freeze_window = (start, time.monotonic())


async def run_soak(config: SoakConfig) -> SoakResult:
    """Run the soak described in the module's doc and check it."""
    workload = await trio.to_thread.run_sync(TaggedImages.build, config.encoder, config.images)
    part = workload.bytes_per_image
    images_per_slot = 2  # a request names one image or two
    slots = config.concurrency + 8
    async with AsyncExitStack() as stack:
        server = await stack.enter_async_context(
            open_server_process(
                server_arguments(config),
                env=server_environment(config),
                stop_timeout=30,
                command="drill-serve",
            )
        )
        soak = _Soak(config, workload, server)
        for r in range(config.tp):
            receiver = await stack.enter_async_context(
                open_receiver(slots * images_per_slot * part, name=f"rank{r}")
            )
            soak.ranks.append(
                Rank(receiver, part, images_per_slot, dirty_seconds=config.deadline_bound)
            )
            soak.session_ids.add(receiver.session_id)
        probe_receiver = await stack.enter_async_context(open_receiver(8 * part, name="probe"))
        soak.session_ids.add(probe_receiver.session_id)
        probe_rank = Rank(probe_receiver, part, dirty_seconds=config.deadline_bound)
        limits = httpx.Limits(max_connections=4 * config.concurrency * config.tp)
        http = await stack.enter_async_context(
            httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits)
        )
        async with trio.open_nursery() as background:
            background.start_soon(soak.sample_rss)
            await _drive(soak, http, background, stack, probe_rank)
            drained = await _drain(soak, http)
            background.cancel_scope.cancel()
        return _result(soak, drained)


async def _drive(
    soak: _Soak,
    http: httpx.AsyncClient,
    background: trio.Nursery,
    stack: AsyncExitStack,
    probe_rank: Rank,
) -> None:
    config = soak.config
    warmup = config.warmup_requests
    late_freeze_at = warmup + (config.requests - warmup) // 10
    first_contact_at = warmup + (config.requests - warmup) * 11 // 20
    freeze_at = warmup + (config.requests - warmup) * 2 // 5
    if not (config.freeze_past_deadline and config.tp > 2):
        soak.late_thawed.set()
    kill_at = warmup + (config.requests - warmup) * 7 // 10
    limiter = trio.Semaphore(config.concurrency)
    async with trio.open_nursery() as requests:
        requests.start_soon(soak.probe, http, probe_rank, background)
        next_start = 0.0
        for index in range(config.requests):
            await limiter.acquire()
            if soak.pace:
                await trio.sleep_until(next_start)
                next_start = max(next_start, trio.current_time()) + soak.pace
            if index == warmup:
                soak.warm_at = time.monotonic()
            if index == late_freeze_at and not soak.late_thawed.is_set():
                requests.start_soon(soak.freeze_past_deadline, 2)
            if index == freeze_at and config.freeze_seconds > 0:
                requests.start_soon(soak.freeze, 1 % config.tp)
            if index == first_contact_at and config.first_contact_freeze > 0:
                many = None
                if config.first_contact_sends:
                    many = await soak.prepare_many_sends(http, stack)
                first = soak.ranks[0]
                # Room for its share of the requests and the sends that pile up on it.
                slots = first.receiver.nbytes // first.slot_bytes + config.first_contact_sends
                receiver = await _fresh_receiver(
                    stack, slots * first.slot_bytes, f"{first.name}'", soak.session_ids
                )
                receiver.freeze()  # before the server has ever reached it
                fresh = Rank(
                    receiver,
                    first.part_bytes,
                    first.images_per_slot,
                    dirty_seconds=first.dirty_seconds,
                    calls_while_frozen=True,
                )
                soak.ranks[0] = fresh
                requests.start_soon(soak.freeze_at_first_contact, fresh, http, background, many)
            if index == kill_at and config.kill:
                victim = soak.ranks[-1]
                victim.kill()
                soak.killed_at = time.monotonic()
                receiver = await _fresh_receiver(
                    stack, victim.receiver.nbytes, f"{victim.name}'", soak.session_ids
                )
                soak.ranks[-1] = Rank(
                    receiver,
                    victim.part_bytes,
                    victim.images_per_slot,
                    dirty_seconds=victim.dirty_seconds,
                )

            async def one(index: int) -> None:
                try:
                    await soak.request(http, index, background)
                finally:
                    limiter.release()

            requests.start_soon(one, index)
        await soak.all_done.wait()
        requests.cancel_scope.cancel()  # the probe


async def _fresh_receiver(
    stack: AsyncExitStack, nbytes: int, name: str, used: set[str]
) -> ReceiverProcess:
    """A new receiver of ``nbytes`` (to replace a rank, say), on a ``session_id`` no earlier
    rank had.

    In one soak every transfer into a replacement rank failed with -1 for the rest of the run;
    the suspected cause is a new process on a dead one's port, whose old descriptor the
    server's engine still holds (see ``docs/operations.md``). The soak avoids it.
    """
    for attempt in range(5):
        receiver = await stack.enter_async_context(open_receiver(nbytes, name=f"{name}{attempt}"))
        if receiver.session_id not in used:
            used.add(receiver.session_id)
            return receiver
    raise RuntimeError("no fresh session_id for a replacement rank after 5 receivers")


async def _drain(soak: _Soak, http: httpx.AsyncClient) -> tuple[float, float, str]:
    """Wait until no scope and no registration but the arena's is live (every deadline has
    passed by then)."""
    from trio_encode.client import metric_value  # torch: not for --help

    text = ""
    with trio.move_on_after(soak.config.deadline_bound + 10):
        while True:
            text = (await http.get("/metrics")).text
            arena = metric_value(text, "arena_registrations")
            left = (
                metric_value(text, "live_scopes"),
                metric_value(text, "live_registrations") - arena,
            )
            if not any(left):
                break
            await trio.sleep(0.25)
    await trio.sleep(1.0)  # resting slots get their late-write checks
    return left[0], left[1], text


def _result(soak: _Soak, drained: tuple[float, float, str]) -> SoakResult:
    from trio_encode.client import metric_value  # torch: not for --help

    config = soak.config
    left_scopes, left_registrations, text = drained
    violations = list(soak.violations)
    for rank in soak.ranks:
        violations += [f"{late} {rank.name}: written after its 200" for late in rank.late_writes]
        for reading in rank.foreign_after:  # counted here; late_writes says where
            soak.counts.foreign_slots += 1
            soak.counts.foreign_bytes += reading.foreign_bytes
    if left_scopes or left_registrations:
        violations.append(f"after drain: {left_scopes:.0f} scopes, {left_registrations:.0f} regs")
    # RSS moves with the live data (queued images, embeddings of requests in flight) by tens
    # of MB from one second to the next; what must not happen is the level drifting up. So
    # the level is the median over a window, and every later window's median is bounded.
    warm_at = (soak.warm_at or soak.started) - soak.started
    # From a freeze or a kill until the deadlines of the requests that rank held up have
    # passed, the server holds more live embeddings by design: reported, not bounded. (A
    # window's median is kept out when the window starts in that span or overlaps its start.)
    held = []
    for window in (soak.freeze_window, soak.late_freeze_window, soak.first_contact_window):
        if window is not None:
            held.append(window)
    if soak.killed_at is not None:
        held.append((soak.killed_at, soak.killed_at))
    spans = [
        (start - soak.started - RSS_WINDOW, end - soak.started + config.deadline_bound)
        for start, end in held
    ]

    def holding(t: float) -> bool:
        return any(start < t < end for start, end in spans)

    windows = _rss_windows([(t, rss) for t, _, rss in soak.rss_samples if t >= warm_at])
    level = windows[0][1] if windows else 0
    steady = [rss for t, rss in windows[1:] if not holding(t)]
    peak = max(steady, default=level)
    peak_frozen = max((rss for t, rss in windows if holding(t)), default=0)
    if level and peak > level * (1 + config.rss_tolerance):
        violations.append(
            f"RSS rose to {peak / 2**20:.0f} MiB from {level / 2**20:.0f} MiB after warm-up"
        )
    baseline = frozen = 0.0
    frozen_count = 0
    if soak.freeze_window is not None:
        start, end = soak.freeze_window
        span = end - start
        before = [s for t, s in soak.probe_samples if start - 2 * span <= t < start]
        during = [s for t, s in soak.probe_samples if start <= t < end]
        baseline = statistics.median(before) if before else 0.0
        frozen = statistics.median(during) if during else 0.0
        frozen_count = len(during)
        if not during:
            violations.append("no probe answered while the rank was frozen")
        elif frozen > config.probe_tolerance * baseline:
            violations.append(
                f"probe median {frozen * 1000:.1f} ms while frozen vs {baseline * 1000:.1f} ms"
            )
    first_contact = [0.0]
    if soak.first_contact_window is not None:
        start, end = soak.first_contact_window
        first_contact = [s for t, s in soak.probe_samples if start <= t < end]
        if not first_contact:
            violations.append("no probe answered while a rank was frozen at first contact")
        slow = [s for s in first_contact if s > FIRST_CONTACT_BOUND]
        if soak.new_rank_first_contact > FIRST_CONTACT_BOUND:
            violations.append(
                f"a new rank's first request took {soak.new_rank_first_contact:.1f} s while "
                "sends waited on a rank frozen at first contact"
            )
        if slow:
            violations.append(
                f"{len(slow)} probes took over {FIRST_CONTACT_BOUND:g} s (up to {max(slow):.1f} "
                "s) while a rank was frozen at first contact"
            )
    unexpected = [line for line in soak.server.errors if "failed" not in line]
    violations += [f"server log: {line.strip()[:200]}" for line in unexpected[:10]]
    statuses: dict[str, dict[str, int]] = {}
    for call in soak.calls:
        by_status = statuses.setdefault(call.route, {})
        by_status[str(call.status)] = by_status.get(str(call.status), 0) + 1
    engine_errors = {}
    for call_name in ("register", "transfer", "deregister"):
        for code in ("-1", "-3", "-7"):
            value = metric_value(text, "engine_errors_total", call=call_name, code=code)
            if value:
                engine_errors[f"{call_name} {code}"] = value
    return SoakResult(
        config=_config_json(config),
        seconds=time.monotonic() - soak.started,
        statuses=statuses,
        counts=soak.counts,
        checked_bytes=soak.checked_bytes,
        engine_errors=engine_errors,
        backstop_expiries=metric_value(text, "backstop_expiries_total"),
        left_scopes=left_scopes,
        left_registrations=left_registrations,
        rss_after_warmup=level,
        rss_max_after_warmup=peak,
        rss_max_while_frozen=peak_frozen,
        rss_peak_sample=max((rss for t, _, rss in soak.rss_samples if t >= warm_at), default=0),
        rss_after_drain=soak.server.rss(),
        rss_samples=soak.rss_samples,
        probe_baseline_median=baseline,
        probe_frozen_median=frozen,
        probe_frozen_count=frozen_count,
        probe_first_contact_max=max(first_contact, default=0.0),
        new_rank_first_contact=soak.new_rank_first_contact,
        frozen_new_rank_sends=soak.frozen_new_rank_sends,
        probe_samples=[(t - soak.started, latency) for t, latency in soak.probe_samples],
        freeze_window=_since(soak.freeze_window, soak.started),
        late_freeze_window=_since(soak.late_freeze_window, soak.started),
        slowest_call=max((c.seconds for c in soak.calls), default=0.0),
        violations=violations,
    )


def _since(window: tuple[float, float] | None, started: float) -> tuple[float, float] | None:
    return None if window is None else (window[0] - started, window[1] - started)


def _config_json(config: SoakConfig) -> dict[str, Any]:
    data = asdict(config)
    data["encoder"] = {k: str(v) if isinstance(v, Path) else v for k, v in data["encoder"].items()}
    return data
