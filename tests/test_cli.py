"""``trio-encode``: settings from flags and ``TRIO_ENCODE_*`` variables, a real ``serve``
stopped by SIGTERM, and the demo."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from support.cli_process import read_until_serving, run_demo, serving, wait_ready
from trio_encode.cli import cli
from trio_encode.declare import GROUPS, sections
from trio_encode.encoder import EncoderSettings
from trio_encode.server.serve import startup_facts
from trio_encode.settings import ServerSettings, child_environment, serve_flags
from trio_encode.testing.faults import FaultPlan, FaultyEngine
from trio_encode.tools.fleet_demo import FleetDemoConfig
from trio_encode.tools.soak.run import SoakConfig, server_arguments, server_environment

SETTINGS = {
    "--host": "TRIO_ENCODE_HOST",
    "--port": "TRIO_ENCODE_PORT",
    "--send-timeout": "TRIO_ENCODE_SEND_TIMEOUT",
    "--shutdown-grace": "TRIO_ENCODE_SHUTDOWN_GRACE",
    "--max-body-bytes": "TRIO_ENCODE_MAX_BODY_BYTES",
    "--token": "TRIO_ENCODE_TOKEN",
    "--media-dir": "TRIO_ENCODE_MEDIA_DIR",
    "--malloc-arenas": "TRIO_ENCODE_MALLOC_ARENAS",
    "--heap-trim-seconds": "TRIO_ENCODE_HEAP_TRIM_SECONDS",
    "--engine-protocol": "TRIO_ENCODE_ENGINE_PROTOCOL",
    "--engine-metadata-server": "TRIO_ENCODE_ENGINE_METADATA_SERVER",
    "--engine-device": "TRIO_ENCODE_ENGINE_DEVICE",
    "--engine-hostname": "TRIO_ENCODE_ENGINE_HOSTNAME",
    "--engine-log-level": "TRIO_ENCODE_ENGINE_LOG_LEVEL",
    "--access-log": "TRIO_ENCODE_ACCESS_LOG",
    "--log-format": "TRIO_ENCODE_LOG_FORMAT",
    "--config": "TRIO_ENCODE_CONFIG",
    "--remember-released": "TRIO_ENCODE_REMEMBER_RELEASED",
    "--remember-seconds": "TRIO_ENCODE_REMEMBER_SECONDS",
    "--warmup": "TRIO_ENCODE_WARMUP",
    "--log-level": "TRIO_ENCODE_LOG_LEVEL",
    "--image-size": "TRIO_ENCODE_IMAGE_SIZE",
    "--patch-size": "TRIO_ENCODE_PATCH_SIZE",
    "--width": "TRIO_ENCODE_WIDTH",
    "--depth": "TRIO_ENCODE_DEPTH",
    "--heads": "TRIO_ENCODE_HEADS",
    "--mlp-ratio": "TRIO_ENCODE_MLP_RATIO",
    "--hidden-size": "TRIO_ENCODE_HIDDEN_SIZE",
    "--dtype": "TRIO_ENCODE_DTYPE",
    "--seed": "TRIO_ENCODE_SEED",
    "--weights": "TRIO_ENCODE_WEIGHTS",
    "--device": "TRIO_ENCODE_DEVICE",
    "--model": "TRIO_ENCODE_MODEL",
    "--feature-layer": "TRIO_ENCODE_FEATURE_LAYER",
    "--max-batch-size": "TRIO_ENCODE_MAX_BATCH_SIZE",
    "--max-batch-tokens": "TRIO_ENCODE_MAX_BATCH_TOKENS",
    "--max-batch-wait": "TRIO_ENCODE_MAX_BATCH_WAIT",
    "--queue-size": "TRIO_ENCODE_QUEUE_SIZE",
    "--cache-bytes": "TRIO_ENCODE_CACHE_BYTES",
    "--max-image-bytes": "TRIO_ENCODE_MAX_IMAGE_BYTES",
    "--max-image-pixels": "TRIO_ENCODE_MAX_IMAGE_PIXELS",
    "--torch-threads": "TRIO_ENCODE_TORCH_THREADS",
    "--pull-timeout": "TRIO_ENCODE_PULL_TIMEOUT",
    "--remote-fetch": "TRIO_ENCODE_REMOTE_FETCH",
    "--remote-hosts": "TRIO_ENCODE_REMOTE_HOSTS",
    "--remote-private-networks": "TRIO_ENCODE_REMOTE_PRIVATE_NETWORKS",
    "--engine-transfer-threads": "TRIO_ENCODE_ENGINE_TRANSFER_THREADS",
    "--engine-control-threads": "TRIO_ENCODE_ENGINE_CONTROL_THREADS",
    "--engine-sends-per-session": "TRIO_ENCODE_ENGINE_SENDS_PER_SESSION",
    "--remote-timeout": "TRIO_ENCODE_REMOTE_TIMEOUT",
    "--remote-max-redirects": "TRIO_ENCODE_REMOTE_MAX_REDIRECTS",
    "--store-master": "TRIO_ENCODE_STORE_MASTER",
    "--store-segment-bytes": "TRIO_ENCODE_STORE_SEGMENT_BYTES",
    "--store-buffer-bytes": "TRIO_ENCODE_STORE_BUFFER_BYTES",
    "--store-wait": "TRIO_ENCODE_STORE_WAIT",
}


def test_serve_help_names_every_setting_and_its_variable() -> None:
    result = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for flag, variable in SETTINGS.items():
        assert flag in result.output
        assert variable in result.output


_IMPORTS_AFTER = """
import json, sys
from click.testing import CliRunner
from trio_encode.cli import cli
from trio_encode.declare import GROUPS, sections
heavy = ("torch", "transformers", "PIL", "numpy", "httpx", "quart", "hypercorn", "mooncake")
seen = {}
for args in (["--version"], ["--help"], ["serve", "--help"], ["bench", "--help"],
             ["make-tiny-model", "--help"], ["serve", "--prot", "1"], ["serve", "--port", "x"]):
    result = CliRunner().invoke(cli, args)
    seen[" ".join(args)] = [result.exit_code] + sorted(
        name for name in (*heavy, "pydantic", "trio") if name in sys.modules
    )
print(json.dumps(seen))
"""


def test_help_version_and_a_mistyped_flag_import_no_torch() -> None:
    """``--help`` and ``--version`` import no settings model, no torch, no server; a
    command's ``--help`` or a refused flag imports its settings models but nothing heavy
    (measured: --version 5.0 s -> 0.2 s). One fresh process, the commands in turn, so each
    line shows what that command and those before it imported."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS_AFTER],
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(done.stdout)
    assert seen["--version"] == [0]
    assert seen["--help"] == [0]
    for args, code in [
        ("serve --help", 0),
        ("bench --help", 0),
        ("make-tiny-model --help", 0),
        ("serve --prot 1", 2),
        ("serve --port x", 2),
    ]:
        assert seen[args] == [code, "pydantic", "trio"], args


def _sections(command: str) -> list[str]:
    result = CliRunner().invoke(cli, [command, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return re.findall(r"^([A-Z][a-z]+):$", result.output, flags=re.MULTILINE)


def test_a_tool_s_own_help_section_comes_before_the_product_s() -> None:
    """A tool names its own section where its settings are declared (the product's
    ``GROUPS`` knows none of them); ``--help`` shows it right after the plain options."""
    assert "soak" not in GROUPS
    assert _sections("soak") == ["Options", "Soak", "Server", "Model"]
    assert _sections("bench") == ["Options", "Bench", *(g.capitalize() for g in GROUPS[:-1])]
    assert _sections("serve") == ["Options", *(g.capitalize() for g in GROUPS)]
    assert sections(["cache", "extra", "server", "own", "extra"]) == [
        "extra",
        "own",
        "server",
        "cache",
    ]


def test_the_command_list_names_every_command() -> None:
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name in ("serve", "demo", "fleet", "bench", "soak", "make-tiny-model"):
        assert f"  {name} " in result.output, name


def test_the_flag_wins_over_the_variable_and_the_variable_over_the_default(
    captured: list[ServerSettings],
) -> None:
    env = {
        "TRIO_ENCODE_PORT": "9001",
        "TRIO_ENCODE_SEND_TIMEOUT": "2.5",
        "TRIO_ENCODE_ENGINE_PROTOCOL": "rdma",
    }
    result = CliRunner().invoke(cli, ["serve", "--port", "9002"], env=env)
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert settings.port == 9002  # flag
    assert settings.service.send_timeout == 2.5  # variable
    assert settings.engine.protocol == "rdma"
    assert settings.host == "127.0.0.1"  # default
    assert settings.engine.metadata_server == "P2PHANDSHAKE"
    assert (settings.access_log, settings.engine.log_level) == (True, "ERROR")  # defaults
    assert (settings.malloc_arenas, settings.heap_trim_seconds) == (2, 1.0)
    assert "0 cut short" in result.output


def test_access_log_and_engine_log_level_read_flags_and_variables(
    captured: list[ServerSettings],
) -> None:
    env = {"TRIO_ENCODE_ENGINE_LOG_LEVEL": "warning"}
    result = CliRunner().invoke(cli, ["serve", "--no-access-log"], env=env)
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert (settings.access_log, settings.engine.log_level) == (False, "WARNING")


def test_encoder_flags_beat_variables_which_beat_the_defaults(
    captured: list[ServerSettings],
) -> None:
    env = {
        "TRIO_ENCODE_MAX_BATCH_SIZE": "4",
        "TRIO_ENCODE_DTYPE": "bfloat16",
        "TRIO_ENCODE_CACHE_BYTES": "0",
        "TRIO_ENCODE_TORCH_THREADS": "3",
    }
    args = ["serve", "--max-batch-size", "16", "--max-batch-wait", "0.02", "--depth", "2"]
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exit_code == 0, result.output
    (settings,) = captured
    encoder = settings.encoder
    assert encoder.max_batch_size == 16  # flag over variable
    assert encoder.max_batch_wait == 0.02  # flag
    assert encoder.depth == 2
    assert encoder.dtype == "bfloat16"  # variable
    assert encoder.cache_bytes == 0
    assert encoder.torch_threads == 3
    assert encoder.image_size == EncoderSettings().image_size  # default
    assert encoder.queue_size == EncoderSettings().queue_size
    assert encoder.model is None


def test_sglang_settings_from_flags_and_variables(captured: list[ServerSettings]) -> None:
    """Remote fetching is off unless asked for; its lists are comma-separated in a flag or a
    variable."""
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 0, result.output
    assert captured[-1].encoder.remote_fetch is False
    assert captured[-1].service.pull_timeout == 180.0
    env = {"TRIO_ENCODE_REMOTE_PRIVATE_NETWORKS": "10.0.0.0/8, fd00::/8"}
    args = ["serve", "--remote-fetch", "--remote-hosts", "a.example,b.example"]
    args += ["--pull-timeout", "30", "--remote-timeout", "2", "--remote-max-redirects", "0"]
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exit_code == 0, result.output
    settings = captured[-1]
    assert settings.service.pull_timeout == 30.0
    encoder = settings.encoder
    assert encoder.remote_fetch is True
    assert encoder.remote_hosts == ("a.example", "b.example")
    assert encoder.remote_private_networks == ("10.0.0.0/8", "fd00::/8")
    assert (encoder.remote_timeout, encoder.remote_max_redirects) == (2.0, 0)
    result = CliRunner().invoke(cli, ["serve", "--remote-private-networks", "nonsense"])
    assert result.exit_code == 2
    assert "does not appear to be an IPv4 or IPv6 network" in result.output


def test_store_flags_reach_the_encoder_settings(captured: list[ServerSettings]) -> None:
    env = {"TRIO_ENCODE_STORE_MASTER": "10.0.0.1:50051", "TRIO_ENCODE_STORE_WAIT": "0.5"}
    args = ["serve", "--store-segment-bytes", "1024", "--store-wait", "0.1"]
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exit_code == 0, result.output
    (settings,) = captured
    assert settings.encoder.store_master == "10.0.0.1:50051"
    assert settings.encoder.store_segment_bytes == 1024
    assert settings.encoder.store_wait == 0.1
    assert settings.encoder.store_buffer_bytes == EncoderSettings().store_buffer_bytes
    bad = CliRunner().invoke(cli, ["serve", "--store-master", "nohost"])
    assert bad.exit_code == 2
    assert "HOST:PORT" in bad.output


def test_encoder_settings_that_do_not_fit_together_are_a_usage_error(
    captured: list[ServerSettings],
) -> None:
    result = CliRunner().invoke(cli, ["serve", "--image-size", "100", "--patch-size", "16"])
    assert result.exit_code == 2
    # Named as typed: the flags, not the settings' names.
    assert "--image-size 100 is not a multiple of --patch-size 16" in result.output
    assert "Traceback" not in result.output
    assert not captured


def test_engine_faults_are_a_drill_s_never_serve_s(
    captured: list[ServerSettings], drills: list[Any]
) -> None:
    refused = CliRunner().invoke(cli, ["serve", "--engine-faults", "transfer=0.1"])
    assert refused.exit_code == 2
    assert "No such option '--engine-faults'" in refused.output
    assert CliRunner().invoke(cli, ["drill-serve"]).exit_code == 0
    plan = ["--engine-faults", "register=0.01,transfer=0.02,seed=3"]
    assert CliRunner().invoke(cli, ["drill-serve", *plan]).exit_code == 0
    engine: Any = object()  # the wrapper only holds it
    off, on = (drill.wrap(engine) for drill in drills)
    assert off is engine
    assert isinstance(on, FaultyEngine)
    assert on.plan == FaultPlan(register=0.01, transfer=0.02, seed=3)
    refused = CliRunner().invoke(cli, ["drill-serve", "--engine-faults", "transfer=3"])
    assert refused.exit_code == 2
    assert "not in [0, 1]" in refused.output
    assert len(captured) == 2


@pytest.mark.parametrize(
    ("command", "args", "reason"),
    [
        ("soak", ["--requests", "0"], "--requests"),
        ("soak", ["--soak-engine-faults", "transfer=2"], "not in [0, 1]"),
        ("soak", ["--engine-faults", "transfer=2"], "not in [0, 1]"),
        ("soak", ["--vanish-rate", "0.5"], "--vanish-rate"),
        ("soak", ["--images", "1"], "--images"),
        ("soak", ["--send-timeout", "0"], "--send-timeout: Input should be greater than 0"),
        ("soak", ["--soak-send-timeout", "inf"], "--send-timeout: Input should be a finite"),
        ("fleet", ["--encoders", "0"], "--encoders"),
        ("fleet", ["--route-by", "rank"], "--route-by"),
        ("serve", ["--send-timeout", "inf"], "--send-timeout"),
    ],
)
def test_tools_refuse_bad_options_before_starting_anything(
    command: str, args: list[str], reason: str, captured: list[ServerSettings]
) -> None:
    result = CliRunner().invoke(cli, [command, *args])
    assert result.exit_code == 2, result.output
    assert reason in result.output
    assert "Traceback" not in result.output
    assert not captured


def _served_with(
    flags: list[str], captured: list[ServerSettings], command: str = "serve"
) -> ServerSettings:
    result = CliRunner().invoke(cli, [command, *flags], env={"TRIO_ENCODE_DEPTH": "3"})
    assert result.exit_code == 0, result.output
    return captured.pop()


def test_child_servers_get_exactly_the_settings_their_tool_declares(
    captured: list[ServerSettings],
) -> None:
    """The soak's and the fleet's servers get their settings as flags made from the settings
    they declare; no variable of this process leaks into them."""
    tiny = EncoderSettings(depth=1, warmup=False, torch_threads=1, cache_bytes=1 << 20)
    soak = SoakConfig(send_timeout=4.0, encoder=tiny)
    assert _served_with(server_arguments(soak), captured, "drill-serve") == soak.server()
    assert "--engine-faults" in server_arguments(soak)
    assert "--engine-faults" not in server_arguments(SoakConfig(engine_faults=""))
    assert server_environment(soak)["MC_TRANSFER_TIMEOUT"] == str(soak.transfer_timeout)
    fleet = FleetDemoConfig(encoder=tiny)
    server = fleet.server(port=0, store_master="127.0.0.1:1")
    assert _served_with(serve_flags(server), captured) == server
    assert server.service.send_timeout == fleet.send_timeout
    assert server.encoder.depth == 1  # the model, not the variable's 3


def test_a_child_server_inherits_no_settings_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_ENCODE_TOKEN", "would lock the tool's own clients out")
    monkeypatch.setenv("PYTHONPATH", "kept")
    env = child_environment({"MC_TRANSFER_TIMEOUT": "2"})
    assert "TRIO_ENCODE_TOKEN" not in env
    assert (env["PYTHONPATH"], env["MC_TRANSFER_TIMEOUT"]) == ("kept", "2")


def test_a_tool_declared_setting_the_server_refuses_is_refused_when_declared() -> None:
    with pytest.raises(ValidationError, match="--send-timeout"):
        FleetDemoConfig(send_timeout=math.inf)
    with pytest.raises(ValidationError, match="--send-timeout"):
        SoakConfig(send_timeout=0)


def test_a_bad_setting_is_refused_with_the_reason(captured: list[ServerSettings]) -> None:
    result = CliRunner().invoke(cli, ["serve", "--send-timeout", "0"])
    assert result.exit_code == 2
    assert "--send-timeout" in result.output
    assert not captured


def test_a_mistyped_engine_protocol_is_refused_naming_the_choices(
    captured: list[ServerSettings],
) -> None:
    result = CliRunner().invoke(cli, ["serve", "--engine-protocol", "rmda"])
    assert result.exit_code == 2
    assert "--engine-protocol" in result.output
    assert "'tcp' or 'rdma'" in result.output
    assert not captured
    assert CliRunner().invoke(cli, ["serve", "--engine-protocol", "rdma"]).exit_code == 0


def test_serve_on_port_0_logs_its_port_quiets_mooncake_and_stops_cleanly_on_sigterm() -> None:
    lines: list[str] = []
    with serving("--port", "0", "--shutdown-grace", "1", TRIO_ENCODE_LOG_FORMAT="kv") as process:
        url = read_until_serving(process, lines)
        drain = threading.Thread(target=lambda: lines.extend(process.stderr or []), daemon=True)
        drain.start()
        wait_ready(url)
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        drain.join(timeout=5)
    output = "".join(lines)
    assert "received SIGTERM" in output
    assert "0 cut short" in output
    assert not re.search(r"^[IW]\d{4} ", output, re.MULTILINE), "Mooncake's INFO lines show"


TINY_FLAGS = ("--depth", "1", "--width", "64", "--heads", "2", "--image-size", "64")
TINY_FLAGS += ("--patch-size", "8", "--torch-threads", "1", "--shutdown-grace", "0")


def test_with_json_logs_every_line_on_stderr_is_json_mooncake_s_included() -> None:
    """Mooncake's own glog lines (let through at INFO here), Python's warnings, the start-up
    line with the settings in effect and the final "stopped" line: all JSON."""
    lines: list[str] = []
    with serving(
        *("--port", "0", "--log-format", "json", "--engine-log-level", "INFO", *TINY_FLAGS),
        PYTHONWARNINGS="always",
    ) as process:
        url = read_until_serving(process, lines)
        assert json.loads(lines[-1])["msg"].split()[2] == url
        drain = threading.Thread(target=lambda: lines.extend(process.stderr or []), daemon=True)
        drain.start()
        wait_ready(url)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        drain.join(timeout=5)
    records = [json.loads(line) for line in lines if line.strip()]  # each line parses
    loggers = {record["logger"] for record in records}
    assert "mooncake" in loggers, loggers
    (start,) = [r for r in records if r["msg"] == "starting"]
    assert start["protocol"] == "tcp"
    assert start["auth"] == "off"
    assert start["config"] == "none"
    assert start["model"].startswith("built-in ViT 64px")
    assert (start["dtype"], start["device"]) == ("float32", "cpu")
    assert start["bind"] == url.removeprefix("http://")
    assert start["arena"].endswith("iB")
    assert any(r["msg"].startswith("stopped: 0 requests") for r in records)


def test_the_start_up_line_names_the_config_file_and_auth(tmp_path: Path) -> None:
    config = tmp_path / "trio-encode.toml"
    config.write_text('api_key = "s3cret"\nengine_protocol = "rdma"\n')
    settings = ServerSettings(config=config)
    facts = startup_facts(settings, bind="127.0.0.1:9")
    assert (facts["config"], facts["auth"], facts["protocol"]) == (str(config), "on", "rdma")
    assert facts["rdma_device"] == "any"
    assert "s3cret" not in str(facts)
    assert startup_facts(ServerSettings.exactly(arena_bytes=0), bind="x")["arena"] == "off"


def test_demo_moves_and_checks_every_byte() -> None:
    result, rows = run_demo("--requests", "3", "--images", "1")
    assert "OK: every byte checked" in result.stdout
    assert rows["requests x ranks"] == "3 x 4"
    assert rows["copies equal to the model's output"] == "12"
    # The arena is registered once for the server's life; no request registers anything.
    assert rows["the arena, registered once"] == "yes"
    assert rows["requests outside the arena"] == "0"
    assert rows["registrations made by requests"] == "0"  # the arena's is counted apart
    assert rows["registrations released by requests"] == "0"
    assert rows["registrations live at the end"] == "0"
    # Every step, teardown included, says what it waits for.
    assert "waiting for every scope to release its registration" in result.stderr
    assert "stopping the server and closing the landing pools" in result.stderr


def test_demo_without_the_arena_registers_each_image_once() -> None:
    """Without the arena each image's row is sent as it lies (never concatenated), so each is
    registered once: 3 requests of 2 images, 6 registrations."""
    result, rows = run_demo("--requests", "3", "--arena-bytes", "0")
    assert "OK: every byte checked" in result.stdout
    assert rows["registrations made by requests"] == "6"
    assert rows["registrations released by requests"] == "6"
    assert rows["registrations live at the end"] == "0"


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_shows_no_docstring_markup(command: str) -> None:
    """Help text comes from docstrings; the reStructuredText they carry for the docs site
    must not reach a terminal."""
    result = CliRunner().invoke(cli, [command, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    for markup in ("``", ":func:", ":mod:", ":class:", ":meth:"):
        assert markup not in result.output, f"{command} --help shows {markup!r}"
