"""Log lines: one per event, with the request's id on every line about a request."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator

import pytest

from trio_encode.logs import setup_logging
from trio_encode.settings import LogFormat


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("restore_root_logger")
def test_key_value_lines_carry_the_req_id_and_keep_tracebacks_on_one_line() -> None:
    stream = io.StringIO()
    setup_logging("INFO", "kv", stream)
    log = logging.getLogger("trio_encode.test")
    log.info("scope opened", extra={"req_id": "r-1"})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("send failed", extra={"req_id": "r 2"})
    log.debug("hidden")
    first, second = stream.getvalue().splitlines()
    assert 'msg="scope opened" req_id=r-1' in first
    assert 'req_id="r 2"' in second
    assert "exc=" in second
    assert "ValueError: boom" in second


@pytest.mark.usefixtures("restore_root_logger")
def test_json_lines_parse_one_per_event() -> None:
    stream = io.StringIO()
    setup_logging("DEBUG", "json", stream)
    logging.getLogger("trio_encode.test").warning("expired", extra={"req_id": "r"})
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert (record["level"], record["msg"], record["req_id"]) == ("WARNING", "expired", "r")


@pytest.mark.usefixtures("restore_root_logger")
@pytest.mark.parametrize("log_format", ["kv", "json"])
def test_timestamps_are_iso_8601_in_utc_in_both_formats(log_format: LogFormat) -> None:
    stream = io.StringIO()
    setup_logging("INFO", log_format, stream)
    record = logging.makeLogRecord({"msg": "at a known moment", "levelno": logging.INFO})
    record.levelname = "INFO"
    record.created = 1_796_000_000.25  # 2026-11-30T00:53:20.250Z
    logging.getLogger().handle(record)
    line = stream.getvalue().strip()
    stamp = json.loads(line)["ts"] if log_format == "json" else line.split()[0].removeprefix("ts=")
    assert stamp == "2026-11-30T00:53:20.250Z"


@pytest.mark.usefixtures("restore_root_logger")
def test_python_warnings_are_log_lines_too() -> None:
    logging.captureWarnings(False)  # pytest put its own hook back after an earlier test's
    stream = io.StringIO()
    setup_logging("INFO", "json", stream)
    try:  # what the warnings module calls to show one (pytest records them otherwise)
        warnings.showwarning(UserWarning("a library grumbles"), UserWarning, "lib.py", 1)
    finally:
        logging.captureWarnings(False)
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert (record["logger"], record["level"]) == ("py.warnings", "WARNING")
    assert "a library grumbles" in record["msg"]
