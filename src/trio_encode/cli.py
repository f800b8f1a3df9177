"""``trio-encode``: ``serve`` runs the encode server; ``demo`` proves a whole round trip.

Every setting is a flag and a ``TRIO_ENCODE_*`` environment variable (the flag wins; click's
order of precedence). Options come in groups, each a decorator, so a module that adds settings
(the encoder's, say) adds one group and one line in :func:`_settings`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import trio

from trio_encode.engine import EngineError
from trio_encode.engine.mooncake import MooncakeSettings
from trio_encode.logs import setup_logging
from trio_encode.settings import MiB, ServerSettings

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger(__name__)


def _option(*names: str, env: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(*names, envvar=f"TRIO_ENCODE_{env}", show_envvar=True, **kwargs)


def _group(*options: Callable[[F], F]) -> Callable[[F], F]:
    def apply(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


server_options = _group(
    _option(
        "--host", env="HOST", default="127.0.0.1", show_default=True, help="Address to listen on."
    ),
    _option(
        "--port",
        env="PORT",
        type=click.IntRange(0, 65535),
        default=8000,
        show_default=True,
        help="Port to listen on; 0 picks a free one and logs it.",
    ),
    _option(
        "--send-timeout",
        env="SEND_TIMEOUT",
        type=click.FloatRange(0, min_open=True),
        default=180.0,
        show_default=True,
        help="Seconds from a request's first /encode until its scope is ended whatever the "
        "clients do (the backstop): waiting calls get 504, its memory is released.",
    ),
    _option(
        "--shutdown-grace",
        env="SHUTDOWN_GRACE",
        type=click.FloatRange(0),
        default=30.0,
        show_default=True,
        help="On SIGINT/SIGTERM, seconds live requests may still finish (new ones get 503) "
        "before they are cut short.",
    ),
    _option(
        "--max-body-bytes",
        env="MAX_BODY_BYTES",
        type=click.IntRange(1),
        default=64 * MiB,
        show_default=True,
        help="Larger request bodies are refused with 413.",
    ),
    _option(
        "--token",
        env="TOKEN",
        default=None,
        help="Require 'Authorization: Bearer TOKEN' on /encode and /send "
        "(/health and /metrics stay open).",
    ),
    _option(
        "--media-dir",
        env="MEDIA_DIR",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        default=None,
        help="Also accept mm_items that are paths of image files inside this directory.",
    ),
)

engine_options = _group(
    _option(
        "--engine-protocol",
        env="ENGINE_PROTOCOL",
        default="tcp",
        show_default=True,
        help="Mooncake transport: tcp, or rdma where the NICs support it.",
    ),
    _option(
        "--engine-metadata-server",
        env="ENGINE_METADATA_SERVER",
        default="P2PHANDSHAKE",
        show_default=True,
        help="Mooncake metadata server; P2PHANDSHAKE needs none (peers exchange descriptors).",
    ),
    _option(
        "--engine-device",
        env="ENGINE_DEVICE",
        default="",
        help="RDMA device names for Mooncake (empty: let it choose; unused over tcp).",
    ),
    _option(
        "--engine-hostname",
        env="ENGINE_HOSTNAME",
        default="127.0.0.1",
        show_default=True,
        help="Address receivers reach this server's transfer engine at (its session_id host).",
    ),
)

logging_options = _group(
    _option(
        "--log-level",
        env="LOG_LEVEL",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        default="INFO",
        show_default=True,
        help="Least severe log lines shown.",
    ),
    _option(
        "--log-format",
        env="LOG_FORMAT",
        type=click.Choice(["kv", "json"]),
        default="kv",
        show_default=True,
        help="key=value lines for people, JSON lines for log shippers.",
    ),
)


def _settings(options: dict[str, Any]) -> ServerSettings:
    """Settings from the options of the groups above."""
    return ServerSettings(
        host=options["host"],
        port=options["port"],
        send_timeout=options["send_timeout"],
        shutdown_grace=options["shutdown_grace"],
        max_body_bytes=options["max_body_bytes"],
        token=options["token"] or None,
        media_dir=options["media_dir"],
        engine=MooncakeSettings(
            hostname=options["engine_hostname"],
            metadata_server=options["engine_metadata_server"],
            protocol=options["engine_protocol"],
            device_name=options["engine_device"],
        ),
        log_level=options["log_level"].upper(),
        log_format=options["log_format"],
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="trio-encode")
def cli() -> None:
    """Encode server for disaggregated multimodal LLM serving (Trio + Mooncake)."""


@cli.command()
@server_options
@engine_options
@logging_options
def serve(**options: Any) -> None:
    """Serve POST /encode, POST /send, GET /health and GET /metrics until SIGINT/SIGTERM."""
    settings = _settings(options)
    setup_logging(settings.log_level, settings.log_format)
    from trio_encode.server.serve import run_server

    report = _run(run_server, settings)
    click.echo(
        f"stopped: {report.finished} requests finished during shutdown, "
        f"{report.cut_short} cut short",
        err=True,
    )


@cli.command()
@click.option(
    "--requests", type=click.IntRange(1), default=8, show_default=True, help="Requests to run."
)
@click.option(
    "--images", type=click.IntRange(1), default=2, show_default=True, help="Images per request."
)
@click.option(
    "--tp", type=click.IntRange(1), default=4, show_default=True, help="Receiving prefill ranks."
)
@engine_options
@_option(
    "--log-level",
    env="LOG_LEVEL",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="WARNING",
    show_default=True,
    help="Least severe log lines shown.",
)
def demo(requests: int, images: int, tp: int, log_level: str, **engine: Any) -> None:
    """Start a server on a free port and TP receivers, run requests, check every byte.

    Each receiver owns its own Mooncake engine and one registered landing pool; every rank
    calls /encode and /send for every request concurrently. Exits non-zero if any check fails.
    The summary goes to stdout; Mooncake's own log lines go to stderr.
    """
    setup_logging(log_level.upper())
    settings = ServerSettings(
        port=0,
        engine=MooncakeSettings(
            hostname=engine["engine_hostname"],
            metadata_server=engine["engine_metadata_server"],
            protocol=engine["engine_protocol"],
            device_name=engine["engine_device"],
        ),
        shutdown_grace=5.0,
    )
    from trio_encode.server.demo import run_demo

    outcome = _run(run_demo, settings, requests, images, tp)
    click.echo(outcome.summary())
    if not outcome.ok:
        raise SystemExit(1)


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    """``trio.run`` with start-up failures reported as one line, not a traceback."""
    expected = (EngineError, RuntimeError, ValueError, OSError)
    try:
        return trio.run(fn, *args)
    except expected as exc:
        raise click.ClickException(str(exc)) from exc
    except ExceptionGroup as group:
        matched, rest = group.split(expected)
        if matched is None or rest is not None:
            raise
        raise click.ClickException("; ".join(str(e) for e in _leaves(matched))) from group


def _leaves(group: BaseExceptionGroup[Exception]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
