"""Structured log lines: one event per line, ``key=value`` or JSON, with ``req_id`` when known.

Scopes and handlers log with ``extra={"req_id": ...}``; the formatters here put that id on
every line about a request, so ``grep req_id=abc`` tells one request's whole story. Times are
ISO-8601 in UTC with milliseconds (``2026-11-30T11:05:46.369Z``), in both formats, so lines
from several hosts sort and compare without knowing their time zones. Lines leave through
:class:`SinkHandler`, so a log reader that stops reading or goes away costs log lines, never the
server.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import re
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO, Any

from trio_encode.settings import LogFormat

# Attributes every LogRecord has; anything else was passed with ``extra=`` and is logged.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "ts": _iso8601(record.created),
        "level": record.levelname,
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in record.__dict__.items():
        if key not in _STANDARD and not key.startswith("_"):
            fields[key] = value
    return fields


class KeyValueFormatter(logging.Formatter):
    """``ts=... level=INFO logger=... msg="..." req_id=...``: readable and greppable."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [f"{key}={_quote(value)}" for key, value in _fields(record).items()]
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return json.dumps(fields, default=str)


def _iso8601(created: float) -> str:
    moment = datetime.fromtimestamp(created, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _quote(value: object) -> str:
    """``value`` bare when it is plain printable text, else as a JSON string: control
    characters (CR, ESC, NUL), line and paragraph separators and non-ASCII all escaped, so a
    client's ``req_id`` can neither split a line nor send a terminal escape."""
    text = str(value)
    if text and text.isascii() and text.isprintable() and not any(c in text for c in ' "='):
        return text
    return json.dumps(text)


def setup_logging(
    level: str | int = "INFO", log_format: LogFormat = "kv", stream: IO[str] | None = None
) -> None:
    """Send every log line (ours, hypercorn's, Python's warnings) to ``stream`` (stderr) in
    one format, through a :class:`SinkHandler`: a reader that stops reading or goes away costs
    log lines, never the server."""
    handler = SinkHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
    logging.captureWarnings(True)


_QUEUE_CHARS = 4 * 1024 * 1024
"""Formatted text held for a slow reader (about 4 MiB) before lines are dropped."""
_FLUSH_WAIT = 1.0
"""Longest a flush (at exit, or before the stream changes) waits for a reader not reading."""
_LINGER = 0.005
"""Seconds a woken writer waits before it takes the queued lines, so that the lines of a busy
server go a few milliseconds' worth at a time: a writer that took each line as it came was
woken once per line, a thread hand-over that cost the event loop a fifth of a probe's CPU."""
_IDLE_EXIT = 10.0
"""Seconds a writer thread waits with nothing to write before it ends (the next line starts
another), so a handler that was replaced does not keep a thread."""

_pump_thread = threading.local()
"""``active`` is set in the thread that drains the captured stderr: it must never write there."""


class SinkHandler(logging.Handler):
    """Writes log lines to a stream that a reader elsewhere may stop reading, or close.

    The stream is usually a pipe to a log shipper, ``head`` or a terminal, and logging happens
    on the event loop's thread. A plain :class:`logging.StreamHandler` lets that reader stop
    the server: a write into a full pipe blocks the loop (holding the handler's lock, which
    every other logging thread then waits on), and a write into a closed one makes logging
    print a traceback to stderr; with :func:`capture_native_stderr` that is the pipe whose own
    pump thread must log it, which then fails and prints again until the pump blocks writing
    into the pipe it alone drains. Here a line costs the loop no write at all:

    * a stream with a file descriptor is written by a thread of this handler, with
      :func:`os.write` in chunks of whole lines of at most ``PIPE_BUF`` bytes (so other writers
      of the descriptor, glog, cannot cut a line); ``emit`` only formats and queues, and drops
      the line when about ``capacity`` characters already wait;
    * a write that fails drops its lines; a broken pipe is final: the descriptor is pointed at
      ``/dev/null`` (so nobody else writing there, ``print`` or glog, fails either) and every
      later line is dropped at once;
    * once lines flow again after drops, a line says how many were lost; :attr:`dropped` counts
      them all;
    * a stream without a descriptor (``io.StringIO``) cannot wait on another process: it is
      written in place, with the same drop-on-error rule.

    A failed write never reaches :meth:`handleError`; only a record that cannot be formatted
    does (a bug in a log call), and not from the pump thread.
    """

    def __init__(self, stream: IO[str], capacity: int = _QUEUE_CHARS) -> None:
        super().__init__()
        self.dropped = 0
        """Lines not written since this handler was made: the sink was full, failing or gone."""
        self._capacity = capacity
        self._wake = threading.Condition()
        self._pending: deque[str] = deque()
        self._pending_chars = 0
        self._unreported = 0
        self._writing = False
        self._broken = False
        self._closed = False
        self._writer: threading.Thread | None = None
        self._stream = stream
        self._fd = _descriptor(stream)

    @property
    def stream(self) -> IO[str]:
        """Where the lines go (what :class:`logging.StreamHandler` calls it too)."""
        return self._stream

    def set_stream(self, stream: IO[str]) -> None:
        """Write to ``stream`` from now on, after what is queued for the old one."""
        self.flush()
        with self._wake:
            self._stream, self._fd, self._broken = stream, _descriptor(stream), False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:
            self.handleError(record)
            return
        with self._wake:
            if self._broken or self._closed:
                self._drop(1)
            elif self._fd is None:
                self._write_in_place(line)
            elif self._pending_chars + len(line) > self._capacity:
                self._drop(1)
            else:
                self._pending.append(line)
                self._pending_chars += len(line)
                if self._writer is None:
                    self._writer = threading.Thread(
                        target=self._write_queued, name="log-writer", daemon=True
                    )
                    self._writer.start()
                elif len(self._pending) == 1 and not self._writing:
                    # Only an idle writer needs waking: a busy one takes this line with the
                    # rest (a wake per line cost the event loop a thread hand-over per line).
                    self._wake.notify_all()

    def handleError(self, record: logging.LogRecord) -> None:
        """Logging's report of a record that cannot be formatted goes to stderr: from the pump
        thread that is the pipe it alone drains, so there the record is only counted."""
        if getattr(_pump_thread, "active", False):
            with self._wake:
                self.dropped += 1  # not the reader's doing: the next line does not blame it
            return
        super().handleError(record)

    def flush(self) -> None:
        """Wait until the queued lines are written, at most ``_FLUSH_WAIT`` seconds."""
        deadline = time.monotonic() + _FLUSH_WAIT
        with self._wake:
            while self._pending or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._wake.wait(left)

    def close(self) -> None:
        """Drop whatever comes after (logging calls this at exit, after :meth:`flush`)."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        super().close()

    def _drop(self, lines: int) -> None:
        self.dropped += lines
        self._unreported += lines

    def _notice(self) -> str:
        """The line that says how many lines were lost (``_wake`` held)."""
        record = logging.makeLogRecord(
            {
                "name": __name__,
                "levelno": logging.WARNING,
                "levelname": "WARNING",
                "msg": "%d log lines dropped: the log reader was too slow, or gone",
                "args": (self._unreported,),
            }
        )
        return self.format(record) + "\n"

    def _write_in_place(self, line: str) -> None:
        text = self._notice() + line if self._unreported else line
        try:
            self._stream.write(text)
            self._stream.flush()
        except BrokenPipeError:
            self._broken = True
            self._drop(1)
        except (OSError, ValueError):
            self._drop(1)
        else:
            self._unreported = 0

    def _write_queued(self) -> None:
        """The writer thread: wait a moment for more lines, take everything queued, write it,
        count what failed."""
        while True:
            with self._wake:
                if not self._pending and not self._closed:
                    self._wake.wait(_IDLE_EXIT)
                if not self._pending:
                    self._writer = None
                    return
                # Lines that come meanwhile find a queue that is not empty: no wake for them.
            _linger()
            with self._wake:
                lines = list(self._pending)
                self._pending.clear()
                self._pending_chars = 0
                notice = self._unreported
                if notice:
                    lines.insert(0, self._notice())
                fd, encoding, self._writing = self._fd, _encoding(self._stream), True
            written = fd is not None and not self._broken and self._write_fd(fd, lines, encoding)
            with self._wake:
                self._writing = False
                if written:
                    self._unreported -= notice
                else:
                    self._drop(len(lines) - (1 if notice else 0))
                self._wake.notify_all()

    def _write_fd(self, fd: int, lines: list[str], encoding: str) -> bool:
        try:
            for chunk in _chunks(lines, encoding):
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(fd, view) :]
                    except BlockingIOError:  # someone made the descriptor non-blocking
                        select.select([], [fd], [])
        except BrokenPipeError:
            with self._wake:
                if fd == self._fd and not self._broken:
                    self._broken = True
                    _to_devnull(fd)
            return False
        except OSError:
            return False
        return True


def _linger() -> None:
    """The writer's pause before it takes a batch (a function, so a test can hold it)."""
    time.sleep(_LINGER)


def _descriptor(stream: object) -> int | None:
    """``stream``'s file descriptor, or None when it has none (``io.StringIO``)."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None
    return fd if isinstance(fd, int) else None


def _encoding(stream: IO[str]) -> str:
    return getattr(stream, "encoding", None) or "utf-8"


def _chunks(lines: list[str], encoding: str) -> Iterator[bytes]:
    """``lines`` encoded, joined into chunks of whole lines of at most ``PIPE_BUF`` bytes (a
    longer line alone): a pipe writes each such chunk in one piece, whoever else writes."""
    chunk = bytearray()
    for line in lines:
        data = line.encode(encoding, "backslashreplace")
        if chunk and len(chunk) + len(data) > select.PIPE_BUF:
            yield bytes(chunk)
            chunk.clear()
        chunk += data
    if chunk:
        yield bytes(chunk)


def _to_devnull(fd: int) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def dropped_log_lines() -> int:
    """Log lines the root logger's handlers could not write (a reader too slow, or gone)."""
    return sum(h.dropped for h in logging.getLogger().handlers if isinstance(h, SinkHandler))


_GLOG = re.compile(r"([IWEF])(\d{4} \d\d:\d\d:\d\d\.\d+)\s+(\d+) ([^\]\s]+)\] ?(.*)")
"""A glog line (Mooncake's): severity, date and time, thread, ``file:line``, message."""
_GLOG_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


def capture_native_stderr() -> bool:
    """Make every line written to this process's stderr a log line in the configured format.

    Mooncake logs through glog straight to file descriptor 2, and libraries print there too
    (progress bars, ``print(file=sys.stderr)``), bypassing :mod:`logging`. Here descriptor 2
    becomes a pipe that a thread reads line by line: a glog line becomes a record of logger
    ``mooncake`` at its own severity (with its ``source`` file and line), any other line a
    record of logger ``stderr``, shown whatever the level (it was always shown). The log
    handlers write to the real stderr instead. At exit the pipe is drained before the process
    ends. Returns False (nothing done) when stderr is not descriptor 2 (under a test runner).

    The pump only formats and queues (:class:`SinkHandler`), so it never waits on the real
    stderr's reader, and nothing it does writes to descriptor 2: a line it wrote there would
    come back to it as a new line, or block it on the pipe it alone drains.
    """
    try:
        if sys.stderr.fileno() != 2:
            return False
    except (AttributeError, OSError, ValueError):
        return False
    sys.stderr.flush()
    real = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, SinkHandler):
            handler.set_stream(real)
        elif isinstance(handler, logging.StreamHandler):
            handler.setStream(real)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    pump = threading.Thread(target=_pump, args=(read_end,), name="stderr-pump", daemon=True)
    pump.start()

    def restore() -> None:
        gc.collect()  # native objects still unreachable log as they go (an engine's farewell)
        sys.stderr.flush()
        os.dup2(real.fileno(), 2)  # the pipe's last writer goes: the pump reads to its end
        pump.join(timeout=5)

    atexit.register(restore)
    return True


def _pump(read_end: int) -> None:
    _pump_thread.active = True
    with os.fdopen(read_end, "rb") as pipe:
        for raw in pipe:
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line.strip():
                _emit(line)


def _emit(line: str) -> None:
    match = _GLOG.fullmatch(line)
    if match is None:
        logger, level, extra = logging.getLogger("stderr"), logging.INFO, {}
    else:
        severity, _, thread, source, line = match.groups()
        logger, level = logging.getLogger("mooncake"), _GLOG_LEVELS[severity]
        extra = {"source": source, "native_thread": int(thread)}
        if not logger.isEnabledFor(level):
            return
    record = logger.makeRecord(logger.name, level, "", 0, line, (), None, extra=extra)
    for handler in logging.getLogger().handlers:
        if record.levelno < handler.level or _descriptor(getattr(handler, "stream", None)) == 2:
            continue  # a handler added since writes to the captured pipe: this line, forever
        try:
            handler.handle(record)
        except Exception:  # a handler's filter failed: that line is lost, not the pump
            continue
