"""Structured log lines: one event per line, ``key=value`` or JSON, with ``req_id`` when known.

Scopes and handlers log with ``extra={"req_id": ...}``; the formatters here put that id on
every line about a request, so ``grep req_id=abc`` tells one request's whole story. Times are
ISO-8601 in UTC with milliseconds (``2026-11-30T11:05:46.369Z``), in both formats, so lines
from several hosts sort and compare without knowing their time zones.
"""

from __future__ import annotations

import json
import logging
import sys
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
    text = str(value)
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    return json.dumps(text)


def setup_logging(
    level: str | int = "INFO", log_format: LogFormat = "kv", stream: IO[str] | None = None
) -> None:
    """Send every log line (ours, hypercorn's) to ``stream`` (stderr) in one format."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
