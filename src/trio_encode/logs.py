"""Structured log lines: one event per line, ``key=value`` or JSON, with ``req_id`` when known.

Scopes and handlers log with ``extra={"req_id": ...}``; the formatters here put that id on
every line about a request, so ``grep req_id=abc`` tells one request's whole story. Times are
ISO-8601 in UTC with milliseconds (``2026-11-30T11:05:46.369Z``), in both formats, so lines
from several hosts sort and compare without knowing their time zones.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import re
import sys
import threading
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
    one format."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
    logging.captureWarnings(True)


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
    """
    try:
        if sys.stderr.fileno() != 2:
            return False
    except (AttributeError, OSError, ValueError):
        return False
    sys.stderr.flush()
    real = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
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
        if record.levelno >= handler.level:
            handler.handle(record)
