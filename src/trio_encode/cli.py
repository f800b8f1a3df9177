"""``trio-encode``: ``serve`` runs the encode server; ``demo`` proves a whole round trip;
``bench`` measures the served paths against their raw parts; ``soak`` runs thousands of
requests against a server process while ranks freeze and die and clients vanish;
``make-tiny-model`` saves a small random-weight model to try ``serve --model`` with;
``receive`` runs a Mooncake receiver to try ``/send`` by hand.

No setting is declared here: each command's options are generated from its settings models
(:mod:`trio_encode.options`), so the commands only build their settings and run. Nothing heavy
is imported at the top: the models' modules load when a command's options are first needed,
and torch, the server and the tools when a command runs, so ``--help`` and ``--version``
answer in a fraction of a second.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from trio_encode import __version__
from trio_encode.options import (
    MODEL_GROUPS,
    SERVE_GROUPS,
    GroupedCommand,
    build,
    given,
    load_settings,
    model_options,
    server_options,
)
from trio_encode.testing.costs import MODELS
from trio_encode.testing.tiny_vlm import FAMILIES, family_named

if TYPE_CHECKING:
    from trio_encode.service import ShutdownReport
    from trio_encode.settings import ServerSettings
    from trio_encode.testing.faults import DrillSettings
    from trio_encode.tools.bench.settings import BenchConfig
    from trio_encode.tools.demo import DemoSettings
    from trio_encode.tools.fleet_demo import FleetDemoConfig
    from trio_encode.tools.receive import ReceiveSettings
    from trio_encode.tools.soak.run import SoakConfig


def _drill_settings() -> type[DrillSettings]:
    from trio_encode.testing.faults import DrillSettings

    return DrillSettings


def _demo_settings() -> type[DemoSettings]:
    from trio_encode.tools.demo import DemoSettings

    return DemoSettings


def _bench_config() -> type[BenchConfig]:
    from trio_encode.tools.bench.settings import BenchConfig

    return BenchConfig


def _fleet_config() -> type[FleetDemoConfig]:
    from trio_encode.tools.fleet_demo import FleetDemoConfig

    return FleetDemoConfig


def _receive_settings() -> type[ReceiveSettings]:
    from trio_encode.tools.receive import ReceiveSettings

    return ReceiveSettings


def _soak_config() -> type[SoakConfig]:
    from trio_encode.tools.soak.run import SoakConfig

    return SoakConfig


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", package_name="trio-encode")
def cli() -> None:
    """Encode server for disaggregated multimodal LLM serving (Trio + Mooncake)."""


@cli.command(cls=GroupedCommand)
@server_options(*SERVE_GROUPS)
def serve(**options: Any) -> None:
    """Serve POST /encode, POST /send, GET /health and GET /metrics until SIGINT/SIGTERM."""
    settings = _serve_settings(options)
    from trio_encode.server.serve import run_server

    _stopped(_run(run_server, settings))


@cli.command("drill-serve", cls=GroupedCommand)
@server_options(*SERVE_GROUPS)
@model_options(_drill_settings)
def drill_serve(**options: Any) -> None:
    """Serve as serve does, with a drill's faults: engine calls failing with Mooncake's codes,
    embeddings that name their images. For soaks and fault drills; never for production."""
    from trio_encode.settings import model_fields

    model = _drill_settings()
    own = given(options, model_fields(model))
    drill: DrillSettings = build(model, own)
    settings = _serve_settings({name: value for name, value in options.items() if name not in own})
    from trio_encode.tools.drill_serve import run_drill_server

    _stopped(_run(run_drill_server, settings, drill))


def _serve_settings(options: dict[str, Any]) -> ServerSettings:
    """The server's settings from its options, and logging set up as they say."""
    from trio_encode.logs import capture_native_stderr, setup_logging

    settings = load_settings(given(options, set(options)))
    setup_logging(settings.log_level, settings.log_format)
    if settings.log_format == "json":
        capture_native_stderr()  # Mooncake's glog lines and this command's own lines too
    return settings


def _stopped(report: ShutdownReport) -> None:
    # A log line, not an echo: the log's sink never blocks the exit on a reader gone or stuck.
    logging.getLogger("trio_encode.cli").info(
        "stopped: %d requests finished during shutdown, %d cut short%s",
        report.finished,
        report.cut_short,
        f", {report.held_bytes} bytes held for Mooncake until exit" if report.held_bytes else "",
    )


@cli.command(cls=GroupedCommand)
@model_options(_demo_settings)
@server_options(*MODEL_GROUPS)
def demo(**options: Any) -> None:
    """Start a server on a free port and TP receivers, run requests, check every byte.

    Each receiver owns its own Mooncake engine and one registered landing pool; every rank
    calls /encode and /send for every request concurrently. Shows progress while it runs and
    a table at the end (on stdout); exits non-zero if any check fails.
    """
    from trio_encode.logs import setup_logging
    from trio_encode.settings import model_fields

    model = _demo_settings()
    own = given(options, model_fields(model))
    config: DemoSettings = build(model, own)
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
@model_options(_bench_config)
@click.option(
    "--cost-model",
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
    sends through an asyncio (FastAPI/uvicorn) model of SGLang's /send after its race fix,
    per embedding size and TP, ranks and clients in a separate process. Encoder: the model's
    forward at B = --max-batch-size vs /encode over HTTP with distinct images. A probe polls
    /health meanwhile. The defaults take several minutes on 2 cores; run it on an idle machine.
    With --cost-model, nothing is measured: a cost model runs in virtual time instead.
    """
    from trio_encode.logs import setup_logging
    from trio_encode.settings import model_fields

    setup_logging("WARNING")
    model = _bench_config()
    own = given(options, model_fields(model))
    settings = load_settings(given(options, set(options) - set(own)))
    config: BenchConfig = build(model, own, encoder=settings.encoder, engine=settings.engine)
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


@cli.command(cls=GroupedCommand)
@model_options(_fleet_config)
def fleet(**options: Any) -> None:
    """Start a Mooncake master, ENCODERS encode servers and RANKS prefill ranks on loopback;
    run requests with repeated images, kill one encoder half-way, print what happened.

    Every rank must be served (failing over) and every copy of an image must be the same
    bytes; exits non-zero otherwise. Servers' logs go to a temporary directory.
    """
    from trio_encode.logs import setup_logging

    setup_logging("ERROR")
    config: FleetDemoConfig = build(_fleet_config(), given(options))
    from trio_encode.tools.fleet_demo import run_fleet_demo

    outcome = _run(run_fleet_demo, config)
    click.echo(outcome.table())
    if not outcome.ok:
        raise SystemExit(1)


@cli.command(cls=GroupedCommand)
@model_options(_soak_config)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the result, with every RSS sample, to this file.",
)
@server_options("model")
def soak(json_path: Path | None, **options: Any) -> None:
    """Run thousands of requests against a real server while ranks freeze and die, clients
    vanish and the engine fails calls; check every answer, byte, deadline and leak.

    The server (trio-encode serve) and every receiver run in processes of their own. Prints
    a table; exits non-zero if any check failed. Several minutes with the defaults.
    """
    from trio_encode.logs import setup_logging
    from trio_encode.settings import model_fields

    setup_logging("WARNING")
    model = _soak_config()
    own = given(options, model_fields(model))
    settings = load_settings(given(options, set(options) - set(own)))
    config: SoakConfig = build(model, own, encoder=settings.encoder)
    from trio_encode.tools.soak.run import run_soak

    result = _run(run_soak, config)
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_json(), indent=2))
    click.echo(result.table())
    if not result.ok:
        raise SystemExit(1)


@cli.command(cls=GroupedCommand)
@model_options(_receive_settings)
@server_options("engine")
def receive(**options: Any) -> None:
    """Run a Mooncake receiver from a shell, to try /send by hand: one registered buffer.

    Prints its session_id, buffer address and length, with curl lines for /encode and /send
    against --server; then, for each landing, its length and the checksum of its bytes (the
    form of the checksum in the /encode and /send answers). Ctrl-C stops it.
    """
    from trio_encode.logs import setup_logging
    from trio_encode.settings import model_fields

    setup_logging("WARNING")
    model = _receive_settings()
    own = given(options, model_fields(model))
    config: ReceiveSettings = build(model, own)
    settings = load_settings(given(options, set(options) - set(own)))
    from trio_encode.tools.receive import run_receive

    _run(run_receive, settings.engine, config)
    # As the demo: leave without the engine's destructor, which logs an error about the
    # buffer it no longer holds and takes a second; the receiver deregistered it already.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@cli.command(
    "make-tiny-model",
    epilog="FAMILY is a model_type or a family's name: "
    + ", ".join(f"{model_type} ({title})" for model_type, title in FAMILIES.items())
    + ".",
)
@click.argument("family")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the weights.")
def make_tiny_model(family: str, directory: Path, seed: int) -> None:
    """Save a small model of FAMILY with random weights, and its image processor, into DIR, to
    try `serve --model DIR` (and the bench, the GPU path...) without downloading weights.

    Its embeddings mean nothing; its shapes, token counts, resolution handling and tiling are
    the family's own (transformers' classes, built from a config). DIR is created; one that
    holds anything is refused. Needs the hf extra.
    """
    model_type = family_named(family)
    if model_type is None:
        raise click.BadParameter(
            f"{family!r} is no family; choose from: {', '.join(FAMILIES)}", param_hint="FAMILY"
        )
    if directory.exists() and any(directory.iterdir()):
        raise click.BadParameter(f"{directory} is not empty", param_hint="DIR")
    try:
        import transformers
    except ImportError:
        raise click.ClickException(
            "make-tiny-model needs transformers: pip install 'trio-encode[hf]'"
        ) from None
    from trio_encode.testing.tiny_vlm import save_tiny_model

    quiet: Any = transformers.logging  # its progress bars and notes are not this command's
    quiet.set_verbosity_error()
    quiet.disable_progress_bar()
    directory.mkdir(parents=True, exist_ok=True)
    save_tiny_model(model_type, directory, seed=seed)
    click.echo(
        f"saved a tiny {FAMILIES[model_type]} ({model_type}, random weights: its embeddings "
        f"mean nothing) into {directory}\nserve it: trio-encode serve --model {directory}"
    )


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    """``trio.run`` with start-up failures (a missing extra, a port in use, an engine that
    will not start) reported as one line, not a traceback, and an interrupt (Ctrl-C, also one
    that arrives wrapped in an exception group) as click's "Aborted!"."""
    import trio

    from trio_encode.engine import EngineError

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
