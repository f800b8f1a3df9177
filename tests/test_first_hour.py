"""A deployment's first hour: what an operator meets before the first request.

A "ready" line once the warm-up is done; a model directory or RDMA that cannot work refused
before "serving on", naming the flag; ``--dtype auto``; errors naming what the user typed;
``--help`` without torch; progress that stays whole off a terminal.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from support.cli_process import operator_env, serving
from trio_encode.cli import cli
from trio_encode.encoder.settings import EncoderSettings, config_dtype
from trio_encode.engine.rdma_devices import check_rdma, rdma_devices
from trio_encode.server.serve import check_start
from trio_encode.settings import ServerSettings
from trio_encode.testing.images import noise_uri

# -- ready -----------------------------------------------------------------------------------


def test_the_ready_line_comes_after_serving_on_and_the_first_request_after_it_is_served() -> None:
    """Not polling /readyz: the line alone must be enough to send at once. Logged before the
    warm-up, the request right after it would find the model not ready (503)."""
    with serving("--port", "0", "--shutdown-grace", "1") as process:
        assert process.stderr is not None
        lines: list[str] = []
        url = None
        for line in process.stderr:
            lines.append(line)
            if "serving on" in line:
                url = line.split("serving on ", 1)[1].split()[0]
            if "ready: model loaded and warmed up" in line:
                break
        else:
            raise AssertionError("no ready line:\n" + "".join(lines))
        assert url is not None, "the ready line came before 'serving on'"
        seconds = []
        with httpx.Client(timeout=60) as client:
            for n in range(5):
                body = {"req_id": f"r{n}", "mm_items": [noise_uri(n, 224)], "receive_count": 1}
                started = time.perf_counter()
                answer = client.post(url + "/encode", json=body)
                seconds.append(time.perf_counter() - started)
                assert answer.status_code == 200, answer.text
        # Generous (the machine is shared): the first is not the slow one by a start-up cost.
        later = sorted(seconds[1:])[1]
        assert seconds[0] < max(4 * later, later + 2.0), seconds


# -- model directories -----------------------------------------------------------------------


def _safetensors(path: Path, nbytes: int, *, cut: int = 0) -> None:
    """A safetensors file of one uint8 tensor of ``nbytes``, missing its last ``cut`` bytes."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}})
    data = struct.pack("<Q", len(header)) + header.encode() + bytes(nbytes)
    path.write_bytes(data[: len(data) - cut])


def _model_dir(path: Path, **config: object) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", **config}))
    return path


def test_a_model_directory_the_loader_would_fail_on_is_refused_before_listening(
    tmp_path: Path,
) -> None:
    whole = _model_dir(tmp_path / "whole")
    _safetensors(whole / "model.safetensors", 64)
    check_start(ServerSettings.exactly(model=whole))

    config_only = _model_dir(tmp_path / "config-only")
    with pytest.raises(ValueError, match=r"^--model: .*config-only has a config but no weights"):
        check_start(ServerSettings.exactly(model=config_only))

    cut = _model_dir(tmp_path / "cut")
    _safetensors(cut / "model.safetensors", 64, cut=10)
    with pytest.raises(ValueError, match=r"model.safetensors is \d+ bytes; its header .* trunc"):
        check_start(ServerSettings.exactly(model=cut))

    shards = _model_dir(tmp_path / "shards")
    _safetensors(shards / "model-1.safetensors", 8)
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (shards / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model-2.safetensors is missing \(its index lists it\)"):
        check_start(ServerSettings.exactly(model=shards))

    unknown = _model_dir(tmp_path / "unknown", model_type="bert")
    _safetensors(unknown / "model.safetensors", 8)
    with pytest.raises(ValueError, match="holds a bert model; supported model types: "):
        check_start(ServerSettings.exactly(model=unknown))

    no_config = tmp_path / "empty"
    no_config.mkdir()
    with pytest.raises(ValueError, match=r"cannot read .*config.json"):
        check_start(ServerSettings.exactly(model=no_config))


def _serve_fails(*args: str) -> str:
    """``serve ARGS`` must exit non-zero before it says "serving on"; returns its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "trio_encode", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=operator_env(),
    )
    assert result.returncode != 0, result.stderr
    assert "serving on" not in result.stderr
    assert "starting" not in result.stderr
    return result.stderr


def test_serve_refuses_a_config_only_model_directory_at_start(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model")
    err = _serve_fails("--model", str(model))
    assert f"Error: --model: {model} has a config but no weights" in err
    assert "Traceback" not in err


# -- RDMA ------------------------------------------------------------------------------------


def test_rdma_is_refused_without_devices_and_named_devices_must_exist(tmp_path: Path) -> None:
    assert rdma_devices(tmp_path / "absent") == []
    check_rdma("tcp", "", root=tmp_path / "absent")  # TCP needs none
    with pytest.raises(ValueError, match=r"^--engine-protocol rdma: this host has no RDMA dev"):
        check_rdma("rdma", "", root=tmp_path / "absent")
    (tmp_path / "mlx5_0").mkdir()
    (tmp_path / "mlx5_1").mkdir()
    assert rdma_devices(tmp_path) == ["mlx5_0", "mlx5_1"]
    check_rdma("rdma", "", root=tmp_path)
    check_rdma("rdma", "mlx5_1, mlx5_0", root=tmp_path)
    with pytest.raises(ValueError, match=r"^--engine-device mlx5_0,mlx5_9: no RDMA device mlx5_9"):
        check_rdma("rdma", "mlx5_0,mlx5_9", root=tmp_path)


def test_serve_refuses_rdma_it_cannot_use_before_listening() -> None:
    """A device no host has: refused here whether or not this host has RDMA."""
    err = _serve_fails("--engine-protocol", "rdma", "--engine-device", "no_such_rdma_dev")
    assert "Error: --engine-" in err
    assert "RDMA device" in err


# -- dtype auto ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ({"torch_dtype": "bfloat16"}, "bfloat16"),
        ({"dtype": "float16"}, "float16"),
        ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"),
        ({}, "float32"),
    ],
)
def test_dtype_auto_is_the_model_directory_s_own(
    tmp_path: Path, config: dict[str, object], dtype: str
) -> None:
    model = _model_dir(tmp_path / "m", **config)
    assert EncoderSettings(model=model).dtype == "auto"
    assert EncoderSettings(model=model).model_dtype == dtype
    assert EncoderSettings(model=model, dtype="float32").model_dtype == "float32"  # explicit
    assert EncoderSettings().model_dtype == "float32"  # the built-in ViT


def test_dtype_auto_refuses_a_dtype_it_cannot_serve_naming_the_flag(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", torch_dtype="float64")
    _safetensors(model / "model.safetensors", 8)
    with pytest.raises(ValueError, match="names dtype 'float64', which is not served"):
        config_dtype(model / "config.json")
    with pytest.raises(ValueError, match=r"^--dtype auto: .* names dtype 'float64'"):
        check_start(ServerSettings.exactly(model=model))
    check_start(ServerSettings.exactly(model=model, dtype="bfloat16"))


def test_a_tiny_vlm_saved_in_bfloat16_loads_in_bfloat16_with_dtype_auto(tmp_path: Path) -> None:
    import torch

    from trio_encode.encoder import load_backend
    from trio_encode.testing.tiny_vlm import save_tiny_model

    model = save_tiny_model("qwen2_vl", tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(config))
    assert load_backend(EncoderSettings(model=model)).dtype == torch.bfloat16
    assert load_backend(EncoderSettings(model=model, dtype="float32")).dtype == torch.float32


# -- errors name what the user typed ---------------------------------------------------------


def test_an_error_names_the_flag_or_the_variable_the_value_came_from() -> None:
    bad = "10.0.0.0/33"
    flag = CliRunner().invoke(cli, ["serve", "--allowed-receivers", bad])
    assert flag.exit_code == 2
    assert f"invalid --allowed-receivers: '{bad}' is not a CIDR" in flag.output
    assert "allowed_receivers" not in flag.output
    env = CliRunner().invoke(cli, ["serve"], env={"TRIO_ENCODE_ALLOWED_RECEIVERS": bad})
    assert env.exit_code == 2
    assert f"invalid TRIO_ENCODE_ALLOWED_RECEIVERS: '{bad}' is not a CIDR" in env.output
    assert "--allowed-receivers" not in env.output


def test_a_rule_between_settings_names_each_as_typed(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    both = CliRunner().invoke(cli, ["serve", "--token", "x", "--token-file", str(secret)])
    assert "give --token or --token-file, not both" in both.output
    mixed = CliRunner().invoke(
        cli, ["serve", "--token-file", str(secret)], env={"TRIO_ENCODE_TOKEN": "x"}
    )
    assert "give TRIO_ENCODE_TOKEN or --token-file, not both" in mixed.output
    model = _model_dir(tmp_path / "m")
    builtin = CliRunner().invoke(cli, ["serve", "--model", str(model), "--width", "64"])
    assert f"--width applies only to the built-in ViT, not to --model {model}" in builtin.output


# -- --help without torch --------------------------------------------------------------------

_HELP_WITHOUT_TORCH = """
import sys
from click.testing import CliRunner
from trio_encode.cli import cli
result = CliRunner().invoke(cli, [sys.argv[1], "--help"])
assert result.exit_code == 0, result.output
print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
"""


@pytest.mark.parametrize(
    "command",
    [
        "serve",
        "demo",
        "fleet",
        "bench",
        "receive",
        "make-tiny-model",
        "drill-serve",
        "soak",
    ],
)
def test_help_imports_no_torch(command: str) -> None:
    """What makes ``--help`` take seconds is torch; measured by what is imported, not by a
    clock the shared machine would make flaky."""
    result = subprocess.run(
        [sys.executable, "-c", _HELP_WITHOUT_TORCH, command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_fleet_s_route_by_choices_are_the_client_s() -> None:
    """Restated in the fleet's settings so that they import no torch; they must not drift."""
    import typing

    from trio_encode.client.fleet import RouteBy
    from trio_encode.tools.fleet_demo import RouteBy as FleetRouteBy

    assert typing.get_args(FleetRouteBy) == typing.get_args(RouteBy)


# -- progress off a terminal -----------------------------------------------------------------

_STEPS = """
from trio_encode.tools.progress import Steps
long = "starting 3 encoders (each loads its model, then joins the store) " * 2
with Steps(True) as steps:
    with steps.step(long, 3) as one:
        for _ in range(3):
            one()
    steps.finish(steps.begin("killed encoder 127.0.0.1:45678 half-way"))
"""


def test_progress_off_a_terminal_is_whole_plain_lines() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _STEPS], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    long = "starting 3 encoders (each loads its model, then joins the store) " * 2
    lines = result.stderr.splitlines()
    assert lines[0] == f"{long} ..."
    assert lines[1].startswith(f"done: {long} (3/3, ")
    assert lines[1].endswith(" s)")
    assert lines[2] == "killed encoder 127.0.0.1:45678 half-way ..."
    assert lines[3].startswith("done: killed encoder 127.0.0.1:45678 half-way (")
    assert len(lines) == 4
    assert "\x1b" not in result.stderr
