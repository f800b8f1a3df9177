"""What every hostile case needs: a real ``trio-encode serve`` child, a watch on it while the
attack runs (``/livez`` timed from a thread of its own, resident memory sampled), an honest
prefill rank whose ``/encode`` + ``/send`` land checked bytes in its own registered memory,
and raw sockets for the attacks that no HTTP client would send.

The server is started with :func:`support.cli_process.serving` (the command an operator runs),
its log drained continuously by a thread (a full stderr pipe would stall its event loop) and
kept for the failure report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import re
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import h11
import trio
import xxhash
import zmq

from support.cli_process import read_until_serving, serving, wait_ready
from trio_encode.client import EncodeClient, LandingPool
from trio_encode.encoder import EncoderSettings, load_backend
from trio_encode.encoder.backend import VisionModel
from trio_encode.settings import ServerSettings, serve_flags
from trio_encode.testing.images import image_uri, noise_png

MiB = 1 << 20
_RAISED = re.compile(r'\b([A-Za-z0-9_.]*(?:Error|Exception|Exit)): ([^\n\\"]*)')
T = TypeVar("T")

ENCODER = EncoderSettings(
    image_size=32,
    patch_size=16,
    width=32,
    heads=1,
    depth=1,
    hidden_size=1024,
    torch_threads=1,
    max_batch_wait=0.0,
)
"""A built-in ViT small enough to start in a second: 4 rows of 1024 floats per image."""
SERVER_FLAGS = (*serve_flags(ServerSettings.exactly(encoder=ENCODER)), "--shutdown-grace", "0")
"""Every other setting is the operator's default: the limits under attack are the shipped ones."""

LIVEZ_BOUND = 0.5
"""Seconds within which every ``/livez`` asked on the watch's keep-alive connection must be
answered while an attack runs. An idle server answers in about a millisecond, a busy one in
tens; a stalled event loop shows as seconds, or never."""
LIVEZ_GIVE_UP = 5.0
"""A probe not answered within this counts as no answer at all (also the bound for a fresh
connection's ``/livez``: the kernel's accept queue and SYN retries are in that one)."""
HONEST_BOUND = 2.0
"""Seconds an honest rank's ``/encode`` + ``/send`` may take while an attack runs (tens of ms
on an idle server)."""


def serving_flags(*extra: str) -> tuple[str, ...]:
    return ("--port", "0", *SERVER_FLAGS, *extra)


class Server:
    """A running ``trio-encode serve`` child on loopback."""

    def __init__(self, process: subprocess.Popen[str], url: str, lines: list[str]) -> None:
        self.process = process
        self.url = url
        self.port = int(url.rsplit(":", 1)[1])
        self.lines = lines
        """Every line it logged so far (appended by the drain thread)."""
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def dies_within(self, seconds: float) -> bool:
        """Whether it exits within ``seconds`` (a crash takes a moment to finish)."""
        try:
            self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def rss(self) -> int:
        """Resident set size in bytes (``VmRSS``); 0 once the process has gone."""
        try:
            with open(f"/proc/{self.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def mark(self) -> int:
        """A position in the log, for :meth:`logged_since`."""
        return len(self.lines)

    def logged_since(self, mark: int, *, access: bool = False) -> list[str]:
        """The lines logged since ``mark``; access-log lines only with ``access``."""
        lines = self.lines[mark:]
        return lines if access else [line for line in lines if "trio_encode.access" not in line]

    def report(self, last: int = 15) -> str:
        """What a failure shows: the exit status, the exceptions its log names, its last
        lines (each cut to 300 characters)."""
        status = "alive" if self.alive() else f"EXITED with {self.process.returncode}"
        text = "".join(self.lines)
        raised = dict.fromkeys(m[0] + ": " + m[1][:160] for m in _RAISED.findall(text))
        tail = [line[:300] for line in self.lines if "trio_encode.access" not in line][-last:]
        return (
            f"server pid {self.pid} {status}; exceptions in its log: {list(raised)[-6:]}\n"
            f"--- log tail ---\n{''.join(tail)}"
        )

    def assert_alive(self) -> None:
        assert self.alive(), self.report()


@contextlib.contextmanager
def running_server(*extra: str) -> Iterator[Server]:
    """``trio-encode serve`` with :data:`SERVER_FLAGS` and ``extra``, ready to serve."""
    lines: list[str] = []
    with serving(*serving_flags(*extra)) as process:
        url = read_until_serving(process, lines)
        server = Server(process, url, lines)
        wait_ready(url)
        yield server


class ServerPool:
    """One server shared by a module's cases; a case finding it dead or hung (an earlier case
    killed it, or stalled its event loop) gets a fresh one, so one crash fails one case, not
    every case after it."""

    def __init__(self, *extra: str) -> None:
        self.extra = extra
        self._stack = contextlib.ExitStack()
        self._server: Server | None = None

    def get(self) -> Server:
        if self._server is None or livez_once(self._server.port, timeout=2.0) is None:
            self._stack.close()
            self._stack = contextlib.ExitStack()
            self._server = self._stack.enter_context(running_server(*self.extra))
        return self._server

    def close(self) -> None:
        self._stack.close()


# -- watching the server while an attack runs ------------------------------------------------


def livez_once(port: int, timeout: float = LIVEZ_GIVE_UP) -> float | None:
    """Seconds a fresh connection's ``GET /livez`` took to answer 200 (``None``: no answer)."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"GET /livez HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
    except OSError:
        return None
    if not answer.startswith(b"HTTP/1.1 200"):
        return None
    return time.monotonic() - started


class LivezConnection:
    """A keep-alive connection that asks ``GET /livez`` again and again: its answer time is
    the event loop's, without the kernel's accept queue in it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None

    def ask(self, timeout: float = LIVEZ_GIVE_UP) -> float | None:
        """Seconds to a 200 (reconnecting once if the server closed the connection)."""
        started = time.monotonic()
        for _ in range(2):
            try:
                if self.sock is None:
                    self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
                self.sock.settimeout(max(0.01, timeout - (time.monotonic() - started)))
                self.sock.sendall(b"GET /livez HTTP/1.1\r\nHost: probe\r\n\r\n")
                if self._read_answer():
                    return time.monotonic() - started
                return None
            except TimeoutError:
                self.close()
                return None
            except (ConnectionError, _Closed):
                self.close()  # closed while idle: once more on a fresh connection
            except OSError:
                self.close()
                return None
        return None

    def _read_answer(self) -> bool:
        assert self.sock is not None
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise _Closed
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        match = re.search(rb"(?i)content-length: *(\d+)", head)
        length = int(match[1]) if match else 0
        while len(body) < length:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise _Closed
            body += chunk
        return head.startswith(b"HTTP/1.1 200")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class _Closed(Exception):
    pass


@dataclass
class Watch:
    """While the ``with`` body runs: ``/livez`` asked every ``interval`` seconds from a thread
    of its own over a keep-alive connection (each answer timed: the event loop's latency),
    every tenth time also on a fresh connection (is it still accepting?), and the server's RSS
    sampled each time.

    :meth:`verify` then asserts the bounds: the process alive; every keep-alive probe answered
    within ``livez_bound``; every fresh connection answered (within :data:`LIVEZ_GIVE_UP`); RSS
    never more than ``rss_bound`` bytes above where it started."""

    server: Server
    rss_bound: int
    livez_bound: float = LIVEZ_BOUND
    interval: float = 0.05
    latencies: list[float] = field(default_factory=list)
    fresh: list[float] = field(default_factory=list)
    unanswered: int = 0
    baseline: int = 0
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        self.baseline = self.peak = self.server.rss()
        self._thread = threading.Thread(target=self._probe, daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _probe(self) -> None:
        connection = LivezConnection(self.server.port)
        try:
            for count in itertools.count():
                if self._stop.is_set():
                    return
                seconds = connection.ask()
                if seconds is None:
                    self.unanswered += 1
                else:
                    self.latencies.append(seconds)
                if count % 10 == 0:
                    seconds = livez_once(self.server.port)
                    if seconds is None:
                        self.unanswered += 1
                    else:
                        self.fresh.append(seconds)
                self.peak = max(self.peak, self.server.rss())
                self._stop.wait(self.interval)
        finally:
            connection.close()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def summary(self) -> str:
        slowest = sorted(self.latencies)[-3:]
        return (
            f"{len(self.latencies)} /livez answered, {self.unanswered} unanswered, slowest "
            f"{[round(s, 3) for s in slowest]} s (fresh connections: {len(self.fresh)}, "
            f"slowest {max(self.fresh, default=0):.3f} s); RSS {self.baseline / MiB:.0f} MiB -> "
            f"peak {self.peak / MiB:.0f} MiB (+{self.growth / MiB:.0f}, "
            f"bound {self.rss_bound / MiB:.0f})"
        )

    def verify(self) -> None:
        self.server.assert_alive()
        assert self.latencies, "the watch never probed"
        assert self.unanswered == 0, (
            f"/livez went unanswered: {self.summary()}\n{self.server.report()}"
        )
        slowest = max(self.latencies)
        assert slowest < self.livez_bound, (
            f"/livez took {slowest:.3f} s (bound {self.livez_bound} s): {self.summary()}"
        )
        assert self.growth < self.rss_bound, f"RSS grew too much: {self.summary()}"


# -- an honest prefill rank ------------------------------------------------------------------


class Reference:
    """The served model run directly in this process: what must land for each image."""

    def __init__(self) -> None:
        # The server's settings but torch's own thread count: load_backend would otherwise set
        # this whole test process to one thread.
        self.model: VisionModel = load_backend(dataclasses.replace(ENCODER, torch_threads=None))
        self._seeds = itertools.count(1)

    def fresh_png(self) -> bytes:
        """A 32x32 noise PNG never sent before (so no cache answers it)."""
        return noise_png(1_000_000 + next(self._seeds) * 7919 + time.monotonic_ns() % 7919)

    def digest(self, png: bytes) -> int:
        import torch

        image = self.model.decode(png, max_pixels=ENCODER.max_image_pixels)
        with torch.inference_mode():
            row = self.model.encode([image])[0].to("cpu").contiguous()
        return xxhash.xxh3_64_intdigest(row.view(torch.uint8).flatten().numpy().data)


_honest_ids = itertools.count()


@dataclass
class Honest:
    """A prefill rank: an ``EncodeClient`` and a landing pool on its own Mooncake engine."""

    client: EncodeClient
    pool: LandingPool
    reference: Reference
    round_trips: list[float] = field(default_factory=list)

    async def round_trip(
        self,
        *,
        within: float = HONEST_BOUND,
        notify: Pull | None = None,
        retry_overloaded: float = 0.0,
    ) -> float:
        """One fresh image's ``/encode`` and ``/send`` (``receive_count`` 1); the landed bytes
        must be the model's own output for it, the whole within ``within`` seconds. With
        ``notify``, the ``/send`` names that ZMQ endpoint and its done message must arrive.
        ``retry_overloaded``: for this many seconds a 503 ``overloaded`` is retried after its
        ``Retry-After``, as the contract allows (the time spent waiting is not counted)."""
        from trio_encode.client import ChecksumMismatch
        from trio_encode.errors import Overloaded

        png = self.reference.fresh_png()
        expected = self.reference.digest(png)
        req_id = f"honest-{next(_honest_ids)}-{time.monotonic_ns()}"
        deadline = time.monotonic() + retry_overloaded
        while True:
            started = time.monotonic()
            try:
                elapsed = await self._round_trip(req_id, png, expected, notify)
            except Overloaded as exc:
                if time.monotonic() > deadline:
                    raise
                await trio.sleep(exc.retry_after or 1)
                req_id += "-again"
                continue
            except ChecksumMismatch as exc:
                raise AssertionError(f"an honest rank's bytes are wrong: {exc}") from None
            break
        assert elapsed < within, (
            f"an honest /encode + /send took {elapsed:.2f} s (bound {within} s)"
        )
        self.round_trips.append(time.monotonic() - started)
        return elapsed

    async def _round_trip(
        self, req_id: str, png: bytes, expected: int, notify: Pull | None
    ) -> float:
        started = time.monotonic()
        extra: dict[str, Any] = {}
        if notify is not None:
            extra = {"prefill_host": "127.0.0.1"}
        with trio.fail_after(10):
            encoded = await self.client.encode(req_id, [image_uri(png)], receive_count=1, **extra)
        slot = self.pool.allocate(encoded.embedding_size)
        try:
            body: dict[str, Any] = {
                "req_id": req_id,
                "session_id": self.pool.session_id,
                "buffer_address": slot.address,
                **extra,
            }
            if notify is not None:
                body["embedding_port"] = notify.port
            with trio.fail_after(10):
                answer = await self.client.post("/send", body)
            elapsed = time.monotonic() - started
            assert answer["status"] == "ok", answer
            assert answer["checksum"] == encoded.checksum, answer
            slot.verify(answer["embedding_size"], answer["checksum"])
            landed = xxhash.xxh3_64_intdigest(slot.raw()[: answer["embedding_size"]].numpy().data)
            assert landed == expected, "the landed bytes are not the model's output for the image"
            if notify is not None:
                message = await notify.receive(within=5.0)
                assert message.req_id == req_id, vars(message)
                assert message.error_msg is None, vars(message)
        finally:
            slot.release()
        return elapsed


async def withstand(
    server: Server,
    honest: Honest,
    attack: Callable[[], Awaitable[T]],
    *,
    rss_bound: int,
    livez_bound: float = LIVEZ_BOUND,
    honest_within: float = HONEST_BOUND,
    retry_overloaded: float = 0.0,
) -> tuple[T, Watch]:
    """Run ``attack`` under a :class:`Watch`, with the honest rank doing round trips beside it
    all along and once more after it; then the watch's bounds are checked. Returns what the
    attack returned, and the watch. A server that died shows as its log, not as the honest
    rank's connection error."""
    result: list[T] = []
    with Watch(server, rss_bound, livez_bound) as watch:
        try:
            async with trio.open_nursery() as nursery:
                attacked = trio.Event()

                async def beside() -> None:
                    while not attacked.is_set():
                        await honest.round_trip(
                            within=honest_within, retry_overloaded=retry_overloaded
                        )
                        await trio.sleep(0.1)

                nursery.start_soon(beside)
                result.append(await attack())
                attacked.set()
            await honest.round_trip(within=honest_within, retry_overloaded=retry_overloaded)
        except Exception as exc:
            watched = f"the watch until then: {watch.summary()}"
            if server.dies_within(2.0):
                raise AssertionError(
                    f"the server died under the attack ({watched}):\n{server.report()}"
                ) from None
            if livez_once(server.port, timeout=2.0) is None:
                raise AssertionError(
                    f"the server no longer answers /livez (its event loop is stuck): {exc!r}; "
                    f"{watched}\n{server.report()}"
                ) from exc
            exc.add_note(watched)
            raise
    watch.verify()
    return result[0], watch


# -- ZMQ: a prefill rank's completion socket -------------------------------------------------


class Pull:
    """A prefill rank's ZMQ PULL socket on loopback, as SGLang binds one. Close it (or use it
    as a context manager): a ZMQ context left to the garbage collector blocks in ``term()``."""

    def __init__(self) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")

    async def receive(self, *, within: float) -> Any:
        """The next completion message, loaded as SGLang loads it."""
        from support.sglang_pickle import safe_loads

        with trio.fail_after(within):
            while True:
                try:
                    return safe_loads(self.socket.recv(zmq.NOBLOCK))
                except zmq.Again:
                    await trio.sleep(0.005)

    async def nothing_arrives(self, *, within: float) -> None:
        with trio.move_on_after(within):
            while True:
                try:
                    frame = self.socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    await trio.sleep(0.01)
                    continue
                raise AssertionError(f"a message arrived: {frame[:200]!r}")

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.destroy(linger=0)

    def __enter__(self) -> Pull:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def closed_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports nobody listens on (bound, then closed)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# -- raw HTTP ---------------------------------------------------------------------------------


def request_head(
    method: str,
    path: str,
    *,
    content_length: int | None = None,
    headers: Sequence[tuple[str, str]] = (),
    content_type: str = "application/json",
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: hostile"]
    if content_length is not None:
        lines += [f"Content-Type: {content_type}", f"Content-Length: {content_length}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def parse_answers(raw: bytes) -> list[Answer]:
    """The complete HTTP/1.1 answers at the start of ``raw``, in order."""
    answers = []
    while raw:
        parser = h11.Connection(h11.CLIENT)
        parser.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        parser.send(h11.EndOfMessage())
        parser.receive_data(raw)
        parser.receive_data(b"")
        status, body = 0, b""
        try:
            while True:
                event = parser.next_event()
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    answers.append(Answer(status, body))
                    break
                elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                    return answers
        except h11.RemoteProtocolError:
            return answers
        raw = parser.trailing_data[0]
    return answers


@dataclass
class Exchange:
    """What one raw connection got back."""

    raw: bytes = b""
    refused: bool = False
    """The connection could not even be made."""
    timed_out: bool = False
    """The server neither answered in full nor closed within the time allowed."""

    @property
    def answers(self) -> list[Answer]:
        return parse_answers(self.raw)


async def connect(port: int, *, source: str | None = None) -> trio.SocketStream:
    """A TCP connection to the server, from ``source`` (another loopback address) if given."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    try:
        if source is not None:
            await sock.bind((source, 0))
        await sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def reset(stream: trio.SocketStream) -> None:
    """Close with an RST (``SO_LINGER`` 0), as a crashed client's kernel does."""
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()


async def read_all(
    stream: trio.SocketStream, into: Exchange, *, within: float, answers: int | None = None
) -> None:
    """Everything the server sends until it closes (or resets), or until ``answers`` complete
    answers have arrived, for up to ``within`` s."""
    with trio.move_on_after(within) as scope:
        while answers is None or len(into.answers) < answers:
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
            if not data:
                return
            into.raw += data
    into.timed_out = scope.cancelled_caught


async def exchange(
    port: int,
    *parts: bytes,
    end: str = "half-close",
    read_for: float = 10.0,
    pause: float = 0.0,
    source: str | None = None,
    answers: int | None = None,
) -> Exchange:
    """Send ``parts`` (``pause`` s apart), then ``end`` the sending side: ``half-close``
    (``shutdown(SHUT_WR)``) and read until the server closes; ``reset`` (RST, nothing read);
    ``close`` (FIN both ways, nothing read); ``keep`` (read until ``answers`` answers have
    arrived or the server closes, for at most ``read_for`` s, then close)."""
    result = Exchange()
    try:
        stream = await connect(port, source=source)
    except OSError:
        result.refused = True
        return result
    try:
        for index, part in enumerate(parts):
            if index and pause:
                await trio.sleep(pause)
            await stream.send_all(part)
        if end == "reset":
            await reset(stream)
            return result
        if end == "close":
            return result
        if end == "half-close":
            await stream.send_eof()
        await read_all(stream, result, within=read_for, answers=answers)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        await stream.aclose()
    return result


ERROR_KINDS = frozenset(
    {
        "invalid_input",
        "unauthorized",
        "receiver_not_allowed",
        "receiver_host_mismatch",
        "unknown_request",
        "no_route",
        "method_not_allowed",
        "conflict",
        "released",
        "request_timeout",
        "too_large",
        "media_too_large",
        "unsupported_media_type",
        "headers_too_large",
        "encode_failed",
        "internal",
        "engine_failed",
        "completion_failed",
        "overloaded",
        "not_ready",
        "shutting_down",
        "expired",
        "not_arrived",
    }
)
"""Every ``error`` kind of docs/api.md's table."""


def contract_error(status: int, data: Any) -> str | None:
    """What is wrong with an error answer's status and JSON body against the contract's shape
    (``None``: nothing)."""
    if not 400 <= status < 600:
        return f"status {status} is not an error"
    if not isinstance(data, dict):
        return f"the body is not a JSON object: {data!r:.200}"
    if data.get("status") != "error":
        return f"'status' is {data.get('status')!r}"
    if data.get("error") not in ERROR_KINDS:
        return f"'error' is {data.get('error')!r}, not a kind of the contract"
    if not isinstance(data.get("message"), str):
        return "no 'message'"
    if not (data.get("req_id") is None or isinstance(data.get("req_id"), str)):
        return f"'req_id' is {data.get('req_id')!r}"
    if re.search(r"Traceback|0x[0-9a-f]{8,}", data["message"]):
        return f"the message shows internals: {data['message'][:200]!r}"
    return None
