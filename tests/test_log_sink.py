"""A log reader that goes away or stops reading costs log lines, never the server.

Operators pipe stderr to a shipper (``--log-format json``), ``head`` or a terminal; none of
them may stop the event loop, the shutdown on SIGTERM, or the stderr pump that turns native
lines into records. The first tests hold the handler to that directly (a real pipe closed or
never read, a stream whose writes fail); the last ones start ``trio-encode serve`` with its
stderr a pipe that the test closes, or stops reading, after the first lines.
"""

from __future__ import annotations

import fcntl
import io
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client import generate_latest

from support.cli_process import read_until_serving, serving
from trio_encode import logs
from trio_encode.logs import SinkHandler, setup_logging
from trio_encode.server.metrics import Metrics
from trio_encode.settings import LogFormat
from trio_encode.testing.images import noise_uri


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def stderr_text(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """What logging would print to stderr about its own failures (``--- Logging error ---``)."""
    text = io.StringIO()
    monkeypatch.setattr("sys.stderr", text)
    return text


def _finishes(work: Callable[[], None], within: float = 5.0) -> bool:
    """Whether ``work`` returns within ``within`` seconds (a thread; left behind if stuck)."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(within)
    return not thread.is_alive()


def _lines(log: logging.Logger, count: int, padding: str = "") -> Callable[[], None]:
    """A function that logs ``line N PADDING`` for N up to ``count``."""

    def log_them() -> None:
        for n in range(count):
            log.info("line %d %s", n, padding)

    return log_them


def _read_until(fd: int, end: bytes, within: float = 10.0) -> bytes:
    """Read ``fd`` until ``end`` has been read (or ``within`` seconds passed)."""
    data = bytearray()
    deadline = time.monotonic() + within
    while end not in data and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1)[0]:
            data += os.read(fd, 65536)
    return bytes(data)


def test_a_closed_pipe_drops_lines_without_a_traceback_and_stops_failing(
    root_logger: logging.Logger, stderr_text: io.StringIO
) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write would be EPIPE
    with os.fdopen(write_end, "w") as stream:
        setup_logging("INFO", "kv", stream)
        (handler,) = root_logger.handlers
        log = logging.getLogger("trio_encode.test")
        assert _finishes(_lines(log, 5))
        handler.flush()
        assert isinstance(handler, SinkHandler)
        assert handler.dropped == 5
        assert stderr_text.getvalue() == ""  # no "--- Logging error ---", no traceback
        # The dead pipe is now /dev/null: anyone else writing the descriptor succeeds too.
        assert os.write(write_end, b"late native line\n") == len(b"late native line\n")
        assert os.fstat(write_end).st_rdev == os.stat(os.devnull).st_rdev


class _FailingStream(io.StringIO):
    """A stream without a descriptor whose writes raise ``error`` while it is set."""

    def __init__(self, error: OSError | None) -> None:
        super().__init__()
        self.error = error
        self.attempts = 0

    def write(self, text: str) -> int:
        self.attempts += 1
        if self.error is not None:
            raise self.error
        return super().write(text)


@pytest.mark.usefixtures("root_logger")
def test_a_stream_whose_write_raises_broken_pipe_is_counted_and_never_written_again(
    stderr_text: io.StringIO,
) -> None:
    stream = _FailingStream(BrokenPipeError(32, "Broken pipe"))
    setup_logging("INFO", "json", stream)
    log = logging.getLogger("trio_encode.test")
    for n in range(3):
        log.warning("line %d", n)
    assert logs.dropped_log_lines() == 3
    assert stream.attempts == 1  # a broken pipe does not come back: no write after the first
    assert stderr_text.getvalue() == ""
    # and the operator sees them on /metrics
    exposition = generate_latest(Metrics().registry).decode()
    assert "trio_encode_log_lines_dropped 3.0" in exposition


@pytest.mark.usefixtures("root_logger")
def test_a_write_that_would_block_drops_the_line_and_the_next_line_says_so(
    stderr_text: io.StringIO,
) -> None:
    stream = _FailingStream(BlockingIOError(11, "Resource temporarily unavailable"))
    setup_logging("INFO", "kv", stream)
    log = logging.getLogger("trio_encode.test")
    log.info("lost 1")
    log.info("lost 2")
    stream.error = None  # the reader caught up
    log.info("kept")
    assert logs.dropped_log_lines() == 2
    notice, kept = stream.getvalue().splitlines()
    assert 'msg="2 log lines dropped' in notice
    assert "msg=kept" in kept
    assert stderr_text.getvalue() == ""


@pytest.mark.usefixtures("root_logger")
def test_a_full_pipe_never_blocks_the_logging_thread_and_a_slow_reader_loses_nothing() -> None:
    read_end, write_end = os.pipe()  # 64 KiB: the 2,000 lines below are about 300 KiB
    stream = os.fdopen(write_end, "w")
    try:
        setup_logging("INFO", "kv", stream)
        log = logging.getLogger("trio_encode.test")
        finished = _finishes(_lines(log, 2000, "x" * 100))
        text = _read_until(read_end, b"line 1999 ").decode()  # the reader wakes up
        assert finished, "logging waited for a reader that was not reading"
        numbers = [int(line.split()[4]) for line in text.splitlines()]
        assert numbers == list(range(2000))
    finally:
        stream.close()
        os.close(read_end)


def test_a_stuck_reader_costs_the_lines_over_capacity_and_they_are_counted() -> None:
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    handler = SinkHandler(stream, capacity=20_000)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.Logger("sink-test")
    log.addHandler(handler)
    try:
        finished = _finishes(_lines(log, 2000, "x" * 100))
        assert finished
        assert handler.dropped > 0  # 64 KiB in the pipe, about 20 kB queued: the rest dropped
        dropped = handler.dropped
        read: list[bytes] = []
        reader = threading.Thread(target=lambda: read.append(_read_until(read_end, b"the end")))
        reader.start()  # the reader wakes up
        handler.flush()  # everything queued is now in the pipe: the next line is not dropped
        log.info("the end")
        reader.join(10)
        lines = read[0].decode().splitlines()
        assert lines[-1] == "the end"
        notices = [line for line in lines if "log lines dropped" in line]
        kept = [line for line in lines if line.startswith("line ")]
        assert handler.dropped == dropped
        assert len(kept) + dropped == 2000
        assert sum(int(line.split()[0]) for line in notices) == dropped  # each loss was told
    finally:
        stream.close()
        os.close(read_end)


class _Descriptor2Stream(io.StringIO):
    """A stream that says it is descriptor 2: after capture, the pump's own pipe."""

    def fileno(self) -> int:
        return 2


class _PoisonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if "poison" in record.getMessage():
            raise RuntimeError("this line cannot be formatted")
        return super().format(record)


def test_the_pump_never_writes_to_the_descriptor_it_drains(
    root_logger: logging.Logger, stderr_text: io.StringIO
) -> None:
    sink = io.StringIO()
    handler = SinkHandler(sink)
    handler.setFormatter(_PoisonFormatter("%(message)s"))
    back_into_the_pipe = _Descriptor2Stream()
    root_logger.handlers[:] = [handler, logging.StreamHandler(back_into_the_pipe)]
    read_end, write_end = os.pipe()
    pump = threading.Thread(target=logs._pump, args=(read_end,), daemon=True)
    pump.start()
    os.write(write_end, b"poison\nplain line\n")
    os.close(write_end)
    pump.join(5)
    assert not pump.is_alive()
    assert back_into_the_pipe.getvalue() == ""  # it would come back as a line, forever
    assert stderr_text.getvalue() == ""  # no traceback for the poisoned line either
    assert sink.getvalue() == "plain line\n"
    assert handler.dropped == 1


# A real ``trio-encode serve``.


def _ready(url: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if httpx.get(url + "/readyz", timeout=1).status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not become ready")


@pytest.mark.parametrize(
    ("log_format", "stop"),
    [("kv", signal.SIGTERM), ("json", signal.SIGTERM), ("json", signal.SIGINT)],
    ids=["kv-SIGTERM", "json-SIGTERM", "json-SIGINT"],
)
def test_a_closed_log_pipe_costs_log_lines_never_the_server(
    log_format: LogFormat, stop: signal.Signals
) -> None:
    with serving("--port", "0", "--shutdown-grace", "0", "--log-format", log_format) as process:
        url = read_until_serving(process, [])
        assert process.stderr is not None
        process.stderr.close()  # `| head -4` has had its lines
        assert httpx.get(url + "/livez", timeout=1).status_code == 200
        _ready(url)
        body = {"req_id": "after-head", "mm_items": [noise_uri(1)], "receive_count": 1}
        assert httpx.post(url + "/encode", json=body, timeout=10).status_code == 200
        for _ in range(5):
            assert httpx.get(url + "/livez", timeout=1).status_code == 200
        process.send_signal(stop)  # a graceful stop, whose lines are lost too
        assert process.wait(timeout=10) == 0


@pytest.mark.parametrize("log_format", ["kv", "json"])
def test_a_log_reader_that_stops_reading_does_not_stop_the_server(log_format: LogFormat) -> None:
    with serving("--port", "0", "--shutdown-grace", "0", "--log-format", log_format) as process:
        assert process.stderr is not None
        fcntl.fcntl(process.stderr.fileno(), fcntl.F_SETPIPE_SZ, 4096)  # full after ~20 lines
        url = read_until_serving(process, [])
        for _ in range(60):  # each one logs an access line the reader does not read
            assert httpx.get(url + "/livez", timeout=1).status_code == 200
        resumed: list[str] = []
        reader = threading.Thread(target=lambda: resumed.extend(process.stderr or []))
        reader.start()  # the reader comes back: nothing was lost, and SIGTERM still works
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        reader.join(5)
    answered = [line for line in resumed if "/livez" in line and "answered" in line]
    assert len(answered) >= 60


def test_a_woken_writer_lingers_so_lines_arriving_meanwhile_go_in_one_write_and_one_wake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A writer that took each line as it came was woken once per line, a thread hand-over
    that cost a busy server's event loop a fifth of a probe's CPU. Woken, the writer waits a
    moment (held here by a gate): the lines that come meanwhile wake nobody and are written
    together, in order."""
    lingering, release = threading.Event(), threading.Event()

    def held() -> None:
        lingering.set()
        release.wait(10)

    monkeypatch.setattr(logs, "_linger", held)
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    handler = SinkHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    writes: list[int] = []
    write_fd = handler._write_fd

    def counted(fd: int, lines: list[str], encoding: str) -> bool:
        writes.append(len(lines))
        return write_fd(fd, lines, encoding)

    monkeypatch.setattr(handler, "_write_fd", counted)
    wakes = 0
    notify_all = handler._wake.notify_all

    def counted_notify() -> None:
        nonlocal wakes
        wakes += 1
        notify_all()

    monkeypatch.setattr(handler._wake, "notify_all", counted_notify)
    log = logging.Logger("sink-linger-test")
    log.addHandler(handler)
    try:
        log.info("line 0")
        assert lingering.wait(10)
        for n in range(1, 50):
            log.info("line %d", n)
            time.sleep(0.001)  # a writer that did not linger would take each line by itself
        assert wakes == 0  # the writer was started, not woken; the lines since woke nobody
        release.set()
        handler.flush()
        assert writes == [50]
        text = _read_until(read_end, b"line 49\n").decode()
        assert text.splitlines() == [f"line {n}" for n in range(50)]
    finally:
        release.set()
        handler.close()
        stream.close()
        os.close(read_end)
