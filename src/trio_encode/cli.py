"""``trio-encode``: ``serve`` runs the encode server; ``demo`` proves a whole round trip;
``bench`` measures the served paths against their raw parts; ``soak`` runs thousands of
requests against a server process while ranks freeze and die and clients vanish.

Every setting is a flag and a ``TRIO_ENCODE_*`` environment variable (the flag wins; click's
order of precedence). Options come in groups, each a decorator, so a module that adds settings
adds one group and one line in :func:`_settings`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import trio

from trio_encode.encoder.settings import EncoderSettings
from trio_encode.engine import EngineError
from trio_encode.engine.faults import FaultPlan
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
        "--malloc-arenas",
        env="MALLOC_ARENAS",
        type=click.IntRange(1),
        default=2,
        show_default=True,
        help="glibc malloc arenas for the server process; more let RSS climb far above the "
        "memory actually held.",
    ),
    _option(
        "--heap-trim-seconds",
        env="HEAP_TRIM_SECONDS",
        type=click.FloatRange(0),
        default=1.0,
        show_default=True,
        help="How often free heap pages are returned to the system (0: never).",
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


def _fault_plan(ctx: click.Context, param: click.Parameter, value: str | None) -> FaultPlan | None:
    if not value:
        return None
    try:
        return FaultPlan.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


fault_options = _group(
    _option(
        "--engine-faults",
        env="ENGINE_FAULTS",
        default=None,
        callback=_fault_plan,
        metavar="PLAN",
        help="Drills only: fail a fraction of transfer-engine calls with Mooncake's own codes, "
        "e.g. 'register=0.01,transfer=0.02,deregister=0.001,seed=7' (or one rate for all). "
        "Off by default; never in production.",
    ),
)

_ENCODER = EncoderSettings()  # the defaults shown in --help are the dataclass's own

encoder_options = _group(
    _option(
        "--image-size",
        env="IMAGE_SIZE",
        type=click.IntRange(1),
        default=_ENCODER.image_size,
        show_default=True,
        help="Built-in ViT: side in pixels every image is resized to; a multiple of "
        "--patch-size. Ignored with --hf-model-dir (the model's config decides).",
    ),
    _option(
        "--patch-size",
        env="PATCH_SIZE",
        type=click.IntRange(1),
        default=_ENCODER.patch_size,
        show_default=True,
        help="Built-in ViT: patch side; tokens per image = (image-size / patch-size)^2.",
    ),
    _option(
        "--width",
        env="WIDTH",
        type=click.IntRange(1),
        default=_ENCODER.width,
        show_default=True,
        help="Built-in ViT: transformer width (a multiple of --heads).",
    ),
    _option(
        "--depth",
        env="DEPTH",
        type=click.IntRange(1),
        default=_ENCODER.depth,
        show_default=True,
        help="Built-in ViT: transformer layers.",
    ),
    _option(
        "--heads",
        env="HEADS",
        type=click.IntRange(1),
        default=_ENCODER.heads,
        show_default=True,
        help="Built-in ViT: attention heads.",
    ),
    _option(
        "--mlp-ratio",
        env="MLP_RATIO",
        type=click.FloatRange(0, min_open=True),
        default=_ENCODER.mlp_ratio,
        show_default=True,
        help="Built-in ViT: MLP width as a multiple of --width.",
    ),
    _option(
        "--hidden-size",
        env="HIDDEN_SIZE",
        type=click.IntRange(1),
        default=_ENCODER.hidden_size,
        show_default=True,
        help="The language model's hidden size: the width of every embedding row sent to "
        "prefill ranks (the projector's output).",
    ),
    _option(
        "--dtype",
        env="DTYPE",
        type=click.Choice(["float32", "bfloat16"]),
        default=_ENCODER.dtype,
        show_default=True,
        help="Dtype of the model and of the embeddings sent; bfloat16 halves the bytes moved.",
    ),
    _option(
        "--seed",
        env="SEED",
        type=int,
        default=_ENCODER.seed,
        show_default=True,
        help="Built-in ViT: seed its random weights are drawn from (unless --weights is "
        "given); servers with the same seed produce the same embeddings.",
    ),
    _option(
        "--weights",
        env="WEIGHTS",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="Built-in ViT: a safetensors file of its weights (saved by "
        "trio_encode.encoder.model.save_weights) instead of seeded random ones.",
    ),
    _option(
        "--hf-model-dir",
        env="HF_MODEL_DIR",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        default=None,
        help="Serve a local CLIP or SigLIP vision tower in Hugging Face format instead of the "
        "built-in ViT (needs the 'hf' extra; nothing is downloaded).",
    ),
    _option(
        "--hf-feature-layer",
        env="HF_FEATURE_LAYER",
        type=int,
        default=_ENCODER.hf_feature_layer,
        show_default=True,
        help="With --hf-model-dir: hidden layer whose states are returned (-1 the last; "
        "LLaVA uses -2).",
    ),
    _option(
        "--max-batch-size",
        env="MAX_BATCH_SIZE",
        type=click.IntRange(1),
        default=_ENCODER.max_batch_size,
        show_default=True,
        help="Images per forward pass, gathered across concurrent requests.",
    ),
    _option(
        "--max-batch-wait",
        env="MAX_BATCH_WAIT",
        type=click.FloatRange(0),
        default=_ENCODER.max_batch_wait,
        show_default=True,
        help="Seconds the oldest queued image may wait for others to fill its batch: "
        "latency traded for throughput.",
    ),
    _option(
        "--queue-size",
        env="QUEUE_SIZE",
        type=click.IntRange(1),
        default=_ENCODER.queue_size,
        show_default=True,
        help="Images that may wait for (or be decoded for) a forward pass; more get 503, so "
        "a burst is refused quickly instead of timing out. Also the most images per request.",
    ),
    _option(
        "--cache-bytes",
        env="CACHE_BYTES",
        type=click.IntRange(0),
        default=_ENCODER.cache_bytes,
        show_default=True,
        help="Bytes of embeddings kept for repeated images (keyed by content); 0 disables "
        "the cache.",
    ),
    _option(
        "--max-image-bytes",
        env="MAX_IMAGE_BYTES",
        type=click.IntRange(1),
        default=_ENCODER.max_image_bytes,
        show_default=True,
        help="Encoded size of one image; larger ones get 400.",
    ),
    _option(
        "--max-image-pixels",
        env="MAX_IMAGE_PIXELS",
        type=click.IntRange(1),
        default=_ENCODER.max_image_pixels,
        show_default=True,
        help="Width x height of one image, checked before decoding (decompression bombs); "
        "larger ones get 400.",
    ),
    _option(
        "--torch-threads",
        env="TORCH_THREADS",
        type=click.IntRange(1),
        default=None,
        help="torch.set_num_threads for the forward pass (default: torch's own, one per "
        "core). Lower it to leave cores to image decoding and the event loop.",
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


def _encoder_settings(options: dict[str, Any]) -> EncoderSettings:
    """Encoder settings from :data:`encoder_options`; a combination the encoder refuses (an
    image size that is not a multiple of the patch size, say) is a usage error."""
    try:
        return EncoderSettings(
            image_size=options["image_size"],
            patch_size=options["patch_size"],
            width=options["width"],
            depth=options["depth"],
            heads=options["heads"],
            mlp_ratio=options["mlp_ratio"],
            hidden_size=options["hidden_size"],
            dtype=options["dtype"],
            seed=options["seed"],
            weights=options["weights"],
            hf_model_dir=options["hf_model_dir"],
            hf_feature_layer=options["hf_feature_layer"],
            max_batch_size=options["max_batch_size"],
            max_batch_wait=options["max_batch_wait"],
            queue_size=options["queue_size"],
            cache_bytes=options["cache_bytes"],
            max_image_bytes=options["max_image_bytes"],
            max_image_pixels=options["max_image_pixels"],
            torch_threads=options["torch_threads"],
        )
    except ValueError as exc:
        raise click.UsageError(f"encoder settings: {exc}") from exc


def _engine_settings(options: dict[str, Any]) -> MooncakeSettings:
    return MooncakeSettings(
        hostname=options["engine_hostname"],
        metadata_server=options["engine_metadata_server"],
        protocol=options["engine_protocol"],
        device_name=options["engine_device"],
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
        malloc_arenas=options["malloc_arenas"],
        heap_trim_seconds=options["heap_trim_seconds"],
        engine=_engine_settings(options),
        engine_faults=options["engine_faults"],
        encoder=_encoder_settings(options),
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
@fault_options
@encoder_options
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
@encoder_options
@_option(
    "--log-level",
    env="LOG_LEVEL",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="WARNING",
    show_default=True,
    help="Least severe log lines shown.",
)
def demo(requests: int, images: int, tp: int, log_level: str, **options: Any) -> None:
    """Start a server on a free port and TP receivers, run requests, check every byte.

    Each receiver owns its own Mooncake engine and one registered landing pool; every rank
    calls /encode and /send for every request concurrently. Exits non-zero if any check fails.
    The summary goes to stdout; Mooncake's own log lines go to stderr.
    """
    setup_logging(log_level.upper())
    settings = ServerSettings(
        port=0,
        engine=_engine_settings(options),
        encoder=_encoder_settings(options),
        shutdown_grace=5.0,
    )
    from trio_encode.server.demo import run_demo

    outcome = _run(run_demo, settings, requests, images, tp)
    click.echo(outcome.summary())
    if not outcome.ok:
        raise SystemExit(1)


def _image_counts(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise click.BadParameter("give positive image counts separated by commas, e.g. 1,4")
    return counts


@cli.command()
@click.option(
    "--tp",
    type=click.IntRange(1),
    default=4,
    show_default=True,
    help="Receiving prefill ranks, each with its own engine: the concurrency of both "
    "transfer sides.",
)
@click.option(
    "--transfer-images",
    default="1,4",
    show_default=True,
    callback=_image_counts,
    help="One transfer row per count: a transfer is that many images' embeddings.",
)
@click.option(
    "--transfer-requests",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="req_ids per round and row; every rank sends each one.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    help="HTTP clients calling /encode then /send in a loop, each with its own image.",
)
@click.option(
    "--served-seconds",
    type=click.FloatRange(0, min_open=True),
    default=60.0,
    show_default=True,
    help="Measured /encode time, over all rounds.",
)
@click.option(
    "--raw-seconds",
    type=click.FloatRange(0, min_open=True),
    default=15.0,
    show_default=True,
    help="Measured raw forward time, over all rounds.",
)
@click.option(
    "--settle-seconds",
    type=click.FloatRange(0),
    default=1.0,
    show_default=True,
    help="Per served round, time the clients get to fill the pipeline before the clock.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="Raw and served phases alternate this many times and are pooled.",
)
@click.option(
    "--load-nice",
    type=click.IntRange(0, 19),
    default=0,
    show_default=True,
    help="Niceness added to the process running the encoder rows' clients.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead.")
@engine_options
@encoder_options
def bench(
    tp: int,
    transfer_images: tuple[int, ...],
    transfer_requests: int,
    concurrency: int,
    served_seconds: float,
    raw_seconds: float,
    settle_seconds: float,
    rounds: int,
    load_nice: int,
    as_json: bool,
    **options: Any,
) -> None:
    """Measure the served paths against their raw parts, side by side, in one run.

    Transfers: Mooncake transfer() vs /send of the same bytes (TP ranks at once, encoding
    excluded). Encoder: the model's forward at B = --max-batch-size vs /encode over HTTP with
    distinct images (the cache is always off). A probe polls /health meanwhile; the peak RSS
    is reported. The defaults take about 2-3 minutes on 2 cores; run it on an idle machine.
    """
    setup_logging("WARNING")
    from trio_encode.bench.server import BenchConfig, run_bench

    try:
        config = BenchConfig(
            encoder=_encoder_settings(options),
            engine=_engine_settings(options),
            tp=tp,
            transfer_images=transfer_images,
            transfer_requests=transfer_requests,
            concurrency=concurrency,
            served_seconds=served_seconds,
            raw_seconds=raw_seconds,
            settle_seconds=settle_seconds,
            rounds=rounds,
            load_nice=load_nice,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    result = _run(run_bench, config)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        click.echo(result.table())


@cli.command()
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
@encoder_options
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
    from trio_encode.soak.run import SoakConfig, run_soak

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
            encoder=_encoder_settings(options),
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
