"""``trio-encode``: ``serve`` runs the encode server; ``demo`` proves a whole round trip;
``bench`` measures the served paths against their raw parts; ``soak`` runs thousands of
requests against a server process while ranks freeze and die and clients vanish.

No option is declared here: each is generated from a settings field (its type, default, bounds
and help), so a setting added to a model is a flag at once. ``serve`` reads flags, then
``TRIO_ENCODE_*`` variables, then the ``--config`` TOML file, then the defaults (see
:mod:`trio_encode.settings`); ``--help`` lists the settings by group.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import typing
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import click
import trio
from click.core import ParameterSource
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import SettingsError

from trio_encode import __version__
from trio_encode.declare import GROUPS, Group
from trio_encode.engine import EngineError
from trio_encode.logs import setup_logging
from trio_encode.settings import ServerSettings, Setting, catalog, describe_error, model_fields
from trio_encode.sizes import format_size, parse_size
from trio_encode.testing.costs import MODELS
from trio_encode.testing.faults import DrillSettings
from trio_encode.tools.bench.settings import BenchConfig
from trio_encode.tools.demo import DemoSettings

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger(__name__)

SERVE_GROUPS: tuple[Group, ...] = ("server", "engine", "model", "batching", "cache", "logging")
"""Every group of the server's settings: what `serve` accepts."""
MODEL_GROUPS: tuple[Group, ...] = ("engine", "model", "batching", "cache")
"""The groups a command that loads the model but serves no clients of its own accepts."""


class SettingOption(click.Option):
    """An option made from a setting; it remembers its ``--help`` group."""

    def __init__(self, entry: Setting) -> None:
        info = entry.info
        decls = [entry.name, entry.flag, *entry.aliases]
        if _is_bool(info):
            decls = [entry.name, f"{entry.flag}/--no-{entry.flag[2:]}"]
        notes = [f"env: {entry.env}"] if entry.env else []
        default = _shown_default(info)
        if default is not None:
            notes.append(f"default: {default}")
        help_text = info.description or ""
        if notes:
            help_text += f"  [{'; '.join(notes)}]"
        super().__init__(
            decls,
            default=None,
            is_flag=_is_bool(info) or None,
            metavar=None if _is_bool(info) else _metavar(info),
            help=help_text,
        )
        self.group: Group = entry.group


class GroupedCommand(click.Command):
    """A command whose ``--help`` lists its setting options under their groups."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            title: str = param.group if isinstance(param, SettingOption) else "options"
            sections.setdefault(title, []).append(record)
        for title in ("options", *GROUPS):
            if title in sections:
                with formatter.section(title.capitalize()):
                    formatter.write_dl(sections[title])


def _is_bool(info: FieldInfo) -> bool:
    return info.annotation is bool


def _metavar(info: FieldInfo) -> str:
    annotation = info.annotation
    choices = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()
    if choices:
        return "[" + "|".join(str(choice) for choice in choices) + "]"
    if any(getattr(meta, "func", None) is parse_size for meta in info.metadata):
        return "SIZE"
    members = {_bare(member) for member in typing.get_args(annotation)} or {annotation}
    for kind, name in ((int, "INTEGER"), (float, "FLOAT"), (Path, "PATH")):
        if kind in members:
            return name
    if typing.get_origin(annotation) is tuple:
        return "N,N,..."
    return "TEXT"


def _bare(annotation: Any) -> Any:
    """``Annotated[Path, ...]`` -> ``Path``."""
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation


def _shown_default(info: FieldInfo) -> str | None:
    value = info.get_default(call_default_factory=True)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if any(getattr(meta, "func", None) is parse_size for meta in info.metadata):
        return format_size(value)
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    return str(value)


def setting_options(entries: Iterable[Setting]) -> Callable[[F], F]:
    """Add an option for each setting to a command (in order, in their groups)."""

    def apply(command: F) -> F:
        params = getattr(command, "__click_params__", [])
        params.extend(reversed([SettingOption(entry) for entry in entries]))
        command.__click_params__ = params  # type: ignore[attr-defined]
        return command

    return apply


def server_options(*groups: Group) -> Callable[[F], F]:
    """The options of the server settings in ``groups``, plus ``--config``."""
    return setting_options(
        entry for entry in catalog() if entry.group in groups or entry.name == "config"
    )


def model_options(model: type[Any]) -> Callable[[F], F]:
    """Flags (no variables) for the declared settings of a command's own model (the demo's,
    the bench's); its fields without a group (nested settings) are not options."""
    entries = [
        Setting(name, None, name, info, env=None)
        for name, info in model_fields(model).items()
        if isinstance(info.json_schema_extra, dict) and "group" in info.json_schema_extra
    ]
    return setting_options(entries)


def given(options: dict[str, Any], names: Iterable[str] | None = None) -> dict[str, Any]:
    """The options the command line actually set (so variables, the config file and the
    defaults decide the rest), limited to ``names`` when given."""
    ctx = click.get_current_context()
    wanted = set(options) if names is None else set(names)
    return {
        name: value
        for name, value in options.items()
        if name in wanted and ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    }


def load_settings(flags: dict[str, Any], **overrides: Any) -> ServerSettings:
    """The server settings (flags over variables over the config file over defaults), with
    ``overrides`` on top; a value any of them got wrong is a usage error naming where it is
    set."""
    try:
        return ServerSettings(**{**flags, **overrides})
    except ValidationError as error:
        raise click.UsageError(_validation_message(error, describe_error)) from error
    except SettingsError as error:
        raise click.UsageError(str(error)) from error


def build(model: Callable[..., Any], flags: dict[str, Any], **values: Any) -> Any:
    """A command's own model from its flags; a refused value is a usage error."""
    try:
        return model(**values, **flags)
    except ValidationError as error:
        message = _validation_message(
            error, lambda loc: "--" + str(loc[0]).replace("_", "-") if loc else "settings"
        )
        raise click.UsageError(message) from error


def _validation_message(
    error: ValidationError, where: Callable[[tuple[int | str, ...]], str]
) -> str:
    lines = []
    for problem in error.errors():
        message = problem["msg"].removeprefix("Value error, ")
        lines.append(f"invalid {where(problem['loc'])}: {message}")
    return "\n".join(lines)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", package_name="trio-encode")
def cli() -> None:
    """Encode server for disaggregated multimodal LLM serving (Trio + Mooncake)."""


@cli.command(cls=GroupedCommand)
@server_options(*SERVE_GROUPS)
@model_options(DrillSettings)
def serve(**options: Any) -> None:
    """Serve POST /encode, POST /send, GET /health and GET /metrics until SIGINT/SIGTERM."""
    own = given(options, model_fields(DrillSettings))
    drill: DrillSettings = build(DrillSettings, own)
    settings = load_settings(given(options, set(options) - set(own)))
    setup_logging(settings.log_level, settings.log_format)
    from trio_encode.server.serve import run_server

    report = _run(partial(run_server, wrap_engine=drill.wrap), settings)
    click.echo(
        f"stopped: {report.finished} requests finished during shutdown, "
        f"{report.cut_short} cut short",
        err=True,
    )


@cli.command(cls=GroupedCommand)
@model_options(DemoSettings)
@server_options(*MODEL_GROUPS)
def demo(**options: Any) -> None:
    """Start a server on a free port and TP receivers, run requests, check every byte.

    Each receiver owns its own Mooncake engine and one registered landing pool; every rank
    calls /encode and /send for every request concurrently. Shows progress while it runs and
    a table at the end (on stdout); exits non-zero if any check fails.
    """
    own = given(options, model_fields(DemoSettings))
    config: DemoSettings = build(DemoSettings, own)
    setup_logging(config.log_level)
    settings = load_settings(given(options, set(options) - set(own)), port=0)
    from trio_encode.tools.demo import run_demo

    outcome = _run(run_demo, settings, config)
    # Leave without destructors: each Mooncake engine takes about a second to stop its
    # threads, and the demo's five would be seconds of silence after the verdict. The OS
    # closes their sockets; everything the demo printed is flushed first.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if outcome.ok else 1)


@cli.command(cls=GroupedCommand)
@model_options(BenchConfig)
@click.option(
    "--model",
    "cost_model",
    type=click.Choice(sorted(MODELS)),
    default=None,
    help="Instead of measuring, run the arena and per-request registration through the "
    "request lifecycle on the in-memory engine with this cost model, in virtual time, and "
    "print requests/s per path (a model, not a measurement).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead.")
@server_options(*MODEL_GROUPS)
def bench(cost_model: str | None, as_json: bool, **options: Any) -> None:
    """Measure the served paths against their raw parts and an asyncio peer, in one run.

    /send: raw Mooncake transfers vs /send of the same bytes (arena on and off) vs the same
    sends through an asyncio (FastAPI/uvicorn) model of the seed's fixed path, per embedding
    size and TP, ranks and clients in a separate process. Encoder: the model's forward at
    B = --max-batch-size vs /encode over HTTP with distinct images. A probe polls /health
    meanwhile. The defaults take several minutes on 2 cores; run it on an idle machine.
    With --model, nothing is measured: a cost model runs in virtual time instead.
    """
    setup_logging("WARNING")
    own = given(options, model_fields(BenchConfig))
    settings = load_settings(given(options, set(options) - set(own)))
    config: BenchConfig = build(BenchConfig, own, encoder=settings.encoder, engine=settings.engine)
    if cost_model is not None:
        from trio_encode.tools.bench.rdma_model import run_model

        modelled = run_model(MODELS[cost_model], list(config.sizes), config.tps)
        if as_json:
            click.echo(json.dumps(modelled.to_json(), indent=2))
        else:
            click.echo(modelled.table())
        return
    from trio_encode.tools.bench.run import run_bench

    result = _run(run_bench, config)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2, default=str))
    else:
        click.echo(result.table())


@cli.command()
@click.option(
    "--encoders", type=click.IntRange(1), default=3, show_default=True, help="Encode servers."
)
@click.option(
    "--ranks", type=click.IntRange(1), default=4, show_default=True, help="TP prefill ranks."
)
@click.option(
    "--requests", type=click.IntRange(1), default=48, show_default=True, help="Requests to run."
)
@click.option(
    "--distinct",
    type=click.IntRange(1),
    default=12,
    show_default=True,
    help="Distinct images the requests draw from (each is asked for repeatedly).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1),
    default=4,
    show_default=True,
    help="Requests in flight at once.",
)
@click.option(
    "--kill/--no-kill",
    default=True,
    show_default=True,
    help="Kill one encoder once half of the requests are done.",
)
@click.option(
    "--store/--no-store",
    default=True,
    show_default=True,
    help="Start a mooncake_master and share embeddings through Mooncake Store.",
)
@click.option(
    "--route-by",
    type=click.Choice(["content", "request"]),
    default="content",
    show_default=True,
    help="content: the images pick the encoder; request: the req_id does (no affinity, "
    "for comparison).",
)
def fleet(
    encoders: int,
    ranks: int,
    requests: int,
    distinct: int,
    concurrency: int,
    kill: bool,
    store: bool,
    route_by: str,
) -> None:
    """Start a Mooncake master, ENCODERS encode servers and RANKS prefill ranks on loopback;
    run requests with repeated images, kill one encoder half-way, print what happened.

    Every rank must be served (failing over) and every copy of an image must be the same
    bytes; exits non-zero otherwise. Servers' logs go to a temporary directory.
    """
    setup_logging("ERROR")
    from trio_encode.tools.fleet_demo import FleetDemoConfig, run_fleet_demo

    config = FleetDemoConfig(
        encoders=encoders,
        ranks=ranks,
        requests=requests,
        distinct=distinct,
        concurrency=concurrency,
        kill=kill,
        store=store,
        route_by="content" if route_by == "content" else "request",
    )
    outcome = _run(run_fleet_demo, config)
    click.echo(outcome.table())
    if not outcome.ok:
        raise SystemExit(1)


@cli.command(cls=GroupedCommand)
@click.option(
    "--requests", type=click.IntRange(1), default=5000, show_default=True, help="Requests to run."
)
@click.option(
    "--tp", type=click.IntRange(1), default=4, show_default=True, help="Receiving prefill ranks."
)
@click.option(
    "--images",
    type=click.IntRange(2),
    default=200,
    show_default=True,
    help="Distinct images the requests draw from.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1),
    default=12,
    show_default=True,
    help="Requests in flight at once.",
)
@click.option(
    "--warmup",
    type=click.IntRange(0),
    default=500,
    show_default=True,
    help="Requests before client faults start and the RSS level is taken.",
)
@click.option(
    "--soak-send-timeout",
    "send_timeout",
    type=click.FloatRange(0, min_open=True),
    default=10.0,
    show_default=True,
    help="The server's --send-timeout during the soak.",
)
@click.option(
    "--soak-engine-faults",
    "engine_faults",
    default="register=0.005,transfer=0.005,seed=1",
    show_default=True,
    help="The server's --engine-faults during the soak ('' for none).",
)
@click.option(
    "--vanish-rate",
    type=click.FloatRange(0, 0.3),
    default=0.01,
    show_default=True,
    help="Per rank and request, the chance of each way a client vanishes.",
)
@click.option(
    "--freeze-seconds",
    type=click.FloatRange(0),
    default=8.0,
    show_default=True,
    help="How long one rank is SIGSTOPped (0: never).",
)
@click.option("--kill/--no-kill", default=True, show_default=True, help="SIGKILL one rank.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the result, with every RSS sample, to this file.",
)
@server_options("model")
def soak(
    requests: int,
    tp: int,
    images: int,
    concurrency: int,
    warmup: int,
    send_timeout: float,
    engine_faults: str,
    vanish_rate: float,
    freeze_seconds: float,
    kill: bool,
    json_path: Path | None,
    **options: Any,
) -> None:
    """Run thousands of requests against a real server while ranks freeze and die, clients
    vanish and the engine fails calls; check every answer, byte, deadline and leak.

    The server (``trio-encode serve``) and every receiver run in processes of their own. Prints
    a table; exits non-zero if any check failed. Several minutes with the defaults.
    """
    setup_logging("WARNING")
    from trio_encode.testing.faults import FaultPlan
    from trio_encode.tools.soak.run import SoakConfig, run_soak

    settings = load_settings(given(options))
    try:
        if engine_faults:
            FaultPlan.parse(engine_faults)  # refused here, not by the server it starts
        config = SoakConfig(
            requests=requests,
            tp=tp,
            images=images,
            concurrency=concurrency,
            warmup=min(warmup, requests - 1),
            send_timeout=send_timeout,
            engine_faults=engine_faults,
            vanish_rate=vanish_rate,
            freeze_seconds=freeze_seconds,
            kill=kill,
            encoder=settings.encoder,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    result = _run(run_soak, config)
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_json(), indent=2))
    click.echo(result.table())
    if not result.ok:
        raise SystemExit(1)


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    """``trio.run`` with start-up failures (a missing extra, a port in use, an engine that
    will not start) reported as one line, not a traceback, and an interrupt (Ctrl-C, also one
    that arrives wrapped in an exception group) as click's "Aborted!"."""
    expected = (EngineError, RuntimeError, ValueError, OSError, ImportError)
    try:
        return trio.run(fn, *args)
    except KeyboardInterrupt:
        raise click.Abort() from None
    except expected as exc:
        raise click.ClickException(str(exc)) from exc
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is not None:
            raise click.Abort() from None
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
    cli(prog_name="trio-encode")


if __name__ == "__main__":
    main()
