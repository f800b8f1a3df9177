"""One source of settings: every setting is declared once and read from flags, then
``TRIO_ENCODE_*`` variables, then the ``--config`` TOML file, then its default."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic.dataclasses import dataclass as pydantic_dataclass

import trio_encode
import trio_encode.server.serve
from trio_encode.cli import cli
from trio_encode.declare import SETTINGS, in_group
from trio_encode.encoder import EncoderSettings
from trio_encode.options import command_settings
from trio_encode.settings import ServerSettings, catalog
from trio_encode.sizes import GiB, KiB, MiB, format_size, parse_size


def _serve(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["serve", *args], env=env)
    return result.exit_code, result.output


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trio-encode.toml"
    path.write_text(text)
    return path


def test_a_flag_beats_a_variable_which_beats_the_file_which_beats_the_default(
    tmp_path: Path, captured: list[ServerSettings]
) -> None:
    config = _config(
        tmp_path,
        'port = 9000\nsend_timeout = 5\nengine_protocol = "rdma"\nmax_batch_size = 4\n'
        'cache_bytes = "1GiB"\n',
    )
    env = {"TRIO_ENCODE_PORT": "9001", "TRIO_ENCODE_SEND_TIMEOUT": "7"}
    code, output = _serve("--config", str(config), "--port", "9002", env=env)
    assert code == 0, output
    (settings,) = captured
    assert settings.port == 9002  # flag over variable over file
    assert settings.service.send_timeout == 7.0  # variable over file
    assert settings.engine.protocol == "rdma"  # file over default
    assert settings.encoder.max_batch_size == 4
    assert settings.encoder.cache_bytes == GiB
    assert settings.host == "127.0.0.1"  # default
    assert settings.encoder.depth == EncoderSettings().depth


def test_the_config_file_may_be_named_by_a_variable(
    tmp_path: Path, captured: list[ServerSettings]
) -> None:
    config = _config(tmp_path, 'log_format = "json"\naccess_log = false\n')
    code, output = _serve(env={"TRIO_ENCODE_CONFIG": str(config)})
    assert code == 0, output
    (settings,) = captured
    assert settings.log_format == "json"
    assert settings.access_log is False


def test_sizes_take_units_everywhere(tmp_path: Path, captured: list[ServerSettings]) -> None:
    config = _config(tmp_path, 'max_image_bytes = "512KiB"\n')
    env = {"TRIO_ENCODE_MAX_BODY_BYTES": "4MiB"}
    code, output = _serve("--config", str(config), "--cache-bytes", "1.5GiB", env=env)
    assert code == 0, output
    (settings,) = captured
    assert settings.encoder.cache_bytes == 3 * GiB // 2
    assert settings.max_body_bytes == 4 * MiB
    assert settings.encoder.max_image_bytes == 512 * KiB


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("64MiB", 64 * MiB), ("1.5GiB", 3 * GiB // 2), ("10kB", 10_000), ("2 GB", 2 * 10**9)],
)
def test_a_size_is_read_in_its_unit(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes
    assert parse_size(nbytes) == nbytes


@pytest.mark.parametrize("text", ["12XB", "MiB", "1.5", "-1MiB"])
def test_a_size_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"size|whole number"):
        parse_size(text)


def test_sizes_are_shown_in_the_largest_unit_that_divides_them() -> None:
    assert [format_size(n) for n in (64 * MiB, 3 * KiB, 1000, 0)] == ["64MiB", "3KiB", "1000", "0"]


def test_a_bad_size_names_the_flag_and_the_variable(captured: list[ServerSettings]) -> None:
    code, output = _serve("--cache-bytes", "12XB")
    assert code == 2
    assert "invalid --cache-bytes:" in output
    assert "not a size" in output
    assert not captured


def test_a_bad_value_from_a_variable_is_refused_once_with_where_it_is_set(
    captured: list[ServerSettings],
) -> None:
    code, output = _serve(env={"TRIO_ENCODE_PORT": "70000"})
    assert code == 2
    assert "invalid TRIO_ENCODE_PORT:" in output
    assert "less than or equal to 65535" in output
    assert "Traceback" not in output
    assert not captured


def test_api_key_is_another_name_for_the_token(captured: list[ServerSettings]) -> None:
    code, output = _serve("--api-key", "s3cret")
    assert code == 0, output
    assert captured[0].token == "s3cret"
    assert "s3cret" not in repr(captured[0])


def test_a_switch_can_be_turned_off_by_flag_or_variable(captured: list[ServerSettings]) -> None:
    assert _serve("--no-access-log")[0] == 0
    assert _serve(env={"TRIO_ENCODE_ACCESS_LOG": "false", "TRIO_ENCODE_WARMUP": "0"})[0] == 0
    assert _serve()[0] == 0
    by_flag, by_variable, default = captured
    assert by_flag.access_log is False
    assert (by_variable.access_log, by_variable.encoder.warmup) == (False, False)
    assert (default.access_log, default.encoder.warmup) == (True, True)


def test_an_unknown_key_or_a_missing_file_is_a_usage_error(
    tmp_path: Path, captured: list[ServerSettings]
) -> None:
    code, output = _serve("--config", str(_config(tmp_path, "prot = 1\n")))
    assert code == 2
    assert "unknown setting 'prot'; did you mean 'port'?" in output
    code, output = _serve("--config", str(_config(tmp_path, "zzz = 1\n")))
    assert code == 2
    assert output.rstrip().endswith("unknown setting 'zzz'")
    code, output = _serve("--config", str(tmp_path / "missing.toml"))
    assert code == 2
    assert "missing.toml" in output
    assert "Traceback" not in output
    assert not captured


def test_a_config_key_may_be_a_flags_long_name(
    tmp_path: Path, captured: list[ServerSettings]
) -> None:
    assert _serve("--config", str(_config(tmp_path, 'api_key = "s3cret"\n')))[0] == 0
    (settings,) = captured
    assert settings.token == "s3cret"
    code, output = _serve("--config", str(_config(tmp_path, 'api_key = "a"\ntoken = "b"\n')))
    assert code == 2
    assert "'api_key' and 'token' both set 'token'" in output


def test_serve_help_lists_every_setting_in_its_group() -> None:
    result = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0
    titles = ["Server:", "Engine:", "Model:", "Batching:", "Cache:", "Logging:"]
    starts = [result.output.index(f"\n{title}\n") for title in titles]
    assert starts == sorted(starts)
    ends = [*starts[1:], len(result.output)]
    sections = {title: result.output[a:b] for title, a, b in zip(titles, starts, ends, strict=True)}
    for entry in catalog():
        section = sections[entry.group.capitalize() + ":"]
        assert entry.flag in section, entry.name
        assert entry.env is not None
        assert entry.env in section
    assert "--token, --api-key" in sections["Server:"]
    assert "default: 64MiB" in sections["Server:"]


def test_engine_log_level_is_declared_with_the_engine(captured: list[ServerSettings]) -> None:
    code, output = _serve("--engine-log-level", "warning")
    assert code == 0, output
    assert captured[0].engine.log_level == "WARNING"
    assert _serve("--engine-log-level", "chatty")[0] == 2


def test_arguments_in_code_use_the_flat_names_and_a_whole_section_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRIO_ENCODE_IMAGE_SIZE", "64")
    monkeypatch.setenv("TRIO_ENCODE_SHUTDOWN_GRACE", "3")
    flat = ServerSettings(send_timeout=2, engine_protocol="rdma")
    assert (flat.service.send_timeout, flat.service.shutdown_grace) == (2, 3)
    assert flat.engine.protocol == "rdma"
    assert flat.encoder.image_size == 64
    whole = ServerSettings(encoder=EncoderSettings(image_size=32, patch_size=8))
    assert whole.encoder.image_size == 32


def test_demo_and_bench_flags_come_from_their_own_declarations() -> None:
    demo = CliRunner().invoke(cli, ["demo", "--help"], terminal_width=200)
    assert "\nDemo:\n" in demo.output
    assert "--requests INTEGER" in demo.output
    assert "--port" not in demo.output
    bench = CliRunner().invoke(cli, ["bench", "--help"], terminal_width=200)
    assert "\nBench:\n" in bench.output
    assert "default: 1,2,4,8" in bench.output
    refused = CliRunner().invoke(cli, ["bench", "--transfer-images", "0,2"])
    assert refused.exit_code == 2
    assert "--transfer-images" in refused.output


def test_python_dash_m_runs_the_command_and_dash_v_names_the_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trio_encode", "-V"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"trio-encode, version {trio_encode.__version__}"


def test_a_missing_mooncake_is_one_line_that_names_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    result = CliRunner().invoke(cli, ["serve", "--port", "0"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    # The start-up line (a log line) comes first; the failure is one line after it.
    (line,) = [line for line in result.output.splitlines() if not line.startswith("ts=")]
    assert line.startswith("Error: the Mooncake transfer engine is not usable")
    assert "pip install 'trio-encode[mooncake]'" in line


def test_a_missing_hf_extra_is_one_line_that_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    result = CliRunner().invoke(cli, ["serve", "--port", "0", "--model", str(tmp_path)])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert "needs the 'transformers' package: pip install 'trio-encode[hf]'" in line


def test_the_contract_states_the_declared_names_and_defaults() -> None:
    """docs/api.md lists some settings with their variables and defaults; they must be the
    declared ones (the declaration is the source, the document a copy)."""
    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    rows = re.findall(r"^\| `(--[a-z-]+)`[^|]*\| `(TRIO_ENCODE_\w+)` \| (.*) \|$", text, re.M)
    assert len(rows) >= 5
    by_flag = {entry.flag: entry for entry in catalog()}
    for flag, env, default in rows:
        entry = by_flag[flag]
        assert entry.env == env
        declared = entry.info.get_default(call_default_factory=True)
        stated = re.match(r"`([^`]+)`", default)
        if declared is None:
            assert stated is None, flag
        else:
            assert stated is not None, flag
            assert type(declared)(stated[1]) == declared, flag


def test_exactly_reads_no_variable_and_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIO_ENCODE_TOKEN", "from-the-shell")
    monkeypatch.setenv("TRIO_ENCODE_CONFIG", str(_config(tmp_path, "port = 9000\n")))
    assert (ServerSettings().token, ServerSettings().port) == ("from-the-shell", 9000)
    exact = ServerSettings.exactly(send_timeout=4)
    assert (exact.token, exact.port, exact.service.send_timeout) == (None, 8000, 4)
    assert ServerSettings().token == "from-the-shell"  # reading resumes afterwards


def test_a_settings_help_is_its_docstring_and_one_without_is_refused() -> None:
    @pydantic_dataclass(config=SETTINGS)
    class Knobs:
        documented: int = in_group("demo")(1)
        """Said once,
        over two lines."""
        bare: int = in_group("demo")(2)

    documented, bare = command_settings(Knobs)
    assert documented.help == "Said once, over two lines."
    with pytest.raises(TypeError, match="'bare' has no docstring"):
        bare.help  # noqa: B018
