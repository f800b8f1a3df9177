"""The docs name only what exists, and their shell blocks run or say why they cannot.

Every ``--flag``, HTTP route, metric, ``TRIO_ENCODE_*`` variable, setting group and error kind
that README.md or a page of docs/ names is checked against the thing itself: the click CLI
(a flag in a ``trio-encode CMD ...`` command line against CMD's own options), the app's URL
map, the metrics registry of a live :class:`~trio_encode.server.metrics.Metrics`, the settings
catalog and the error table. SGLang's command lines are checked against the flags of SGLang
0.5.23's own argument parsers (the tables at the end of this file). A flag of any other tool
must be in :data:`OTHER_TOOLS`, which says whose it is.

Shell blocks (```` ```bash ````, ``sh``, ``console``) either run here, in a scratch directory
(:func:`test_every_shell_block_runs_or_says_why_not`), or the line before them is a marker
``<!-- needs: REASON -->`` whose first word is one of :data:`NEEDS`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx
import pytest
import trio

from trio_encode.cli import cli
from trio_encode.declare import GROUPS
from trio_encode.errors import ERRORS
from trio_encode.server.app import create_app
from trio_encode.server.metrics import Metrics
from trio_encode.service import EncodeService, ServiceSettings
from trio_encode.settings import ServerSettings, catalog
from trio_encode.testing.memory_engine import InMemoryEngine, InMemoryFabric
from trio_encode.testing.stand_in_encoder import StandInEncoder

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCRIPTS = Path(sys.executable).parent
"""The scripts of the environment running the suite (``trio-encode``, ``mooncake_master``)."""
PAGES = (ROOT / "README.md", *sorted(DOCS.glob("*.md")))
"""The pages people read as written (docs/reference is generated from the code)."""

NEEDS = {
    "gpu": "a CUDA GPU",
    "cluster": "other hosts, RDMA NICs or a cluster's addresses",
    "sglang": "SGLang and its GPUs",
    "root": "installs system packages (CI runs it: .ci/run)",
    "minutes": "runs for minutes (a benchmark, a soak, a nox session)",
    "docker": "Docker, absent here (tests/test_deploy.py checks the Dockerfiles' steps)",
    "port-8000": "binds the default port 8000, which another server here may hold",
}
"""Why a shell block may not run here: the first word of its ``<!-- needs: ... -->`` marker."""

OTHER_TOOLS = {
    "--download-python": "nox",
    "--broad": "tests/mutants.py",
    "--explore-seed": "tests/conftest.py",
    "--short": "tests/gpu/steps.py",
    "--plot": "trio_encode.tools.bench.routing_sim",
    "--no-deps": "pip",
    "--keep-going": "sphinx-build",
    "--native": "py-spy",
    "--gil": "py-spy",
    **dict.fromkeys(
        (
            "--rpc_port",
            "--rpc_address",
            "--metrics_port",
            "--metrics_host",
            "--enable_ha",
            "--etcd_endpoints",
            "--eviction_ratio",
            "--eviction_high_watermark_ratio",
            "--default_kv_lease_ttl",
        ),
        "mooncake_master",
    ),
}
"""Flags of tools other than trio-encode and SGLang that the docs name, and whose they are
(mooncake_master's and the routing simulation's are checked against the tools themselves)."""

OTHER_VARIABLES = {"TRIO_ENCODE_EXPLORE_SEED": "tests/conftest.py"}
"""``TRIO_ENCODE_*`` variables that are not settings, and who reads them."""

OTHER_ROUTES = {
    "/scheduler_receive_url": "SGLang's encode server (not served here)",
    "/get_all_keys": "mooncake_master's HTTP port",
    "/get_all_segments": "mooncake_master's HTTP port",
    "/query_key": "mooncake_master's HTTP port",
}
"""Routes the docs name that are other servers', not this one's."""


# -- what exists ---------------------------------------------------------------------------


@cache
def trio_encode_flags() -> dict[str, frozenset[str]]:
    """Each command's long options ('' for the group's own), ``--help`` included."""
    flags = {"": frozenset({"--help", "--version"})}
    for name, command in cli.commands.items():
        options = {"--help"}
        for param in command.params:
            options.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
        flags[name] = frozenset(options)
    return flags


def known_anywhere() -> frozenset[str]:
    """Every flag a bare ``--flag`` in prose may name."""
    ours = frozenset().union(*trio_encode_flags().values())
    return ours | SGLANG_SERVER_FLAGS | SGLANG_ROUTER_FLAGS | frozenset(OTHER_TOOLS)


class _Loaded(StandInEncoder):
    """The stand-in encoder, loaded from the start (so the probes answer 200)."""

    ready = True


@cache
def live_app() -> tuple[frozenset[str], dict[str, object]]:
    """The rules of the app's URL map as ``create_app`` builds them, and its ``/health``
    answer."""

    async def build() -> tuple[frozenset[str], dict[str, object]]:
        async with trio.open_nursery() as nursery:
            metrics = Metrics()
            service = EncodeService(
                nursery=nursery,
                engine=InMemoryEngine(InMemoryFabric(), "127.0.0.1:1"),
                encoder=_Loaded(),
                settings=ServiceSettings(),
                observer=metrics,
            )
            app = create_app(service, metrics, ServerSettings.exactly())
            health = await app.test_client().get("/health")
            assert health.status_code == 200
            answer = await health.get_json()
            nursery.cancel_scope.cancel()
        return frozenset(rule.rule for rule in app.url_map.iter_rules()), answer

    return trio.run(build)


def served_routes() -> frozenset[str]:
    return live_app()[0]


_SAMPLES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "info": ("_info",),
}


def exported_metrics() -> frozenset[str]:
    """Every family and sample name a fresh server's registry exports."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names.update(family.name + suffix for suffix in _SAMPLES.get(family.type, ("",)))
    return frozenset(names)


# -- reading the pages ---------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A fenced block of a page."""

    page: str
    line: int
    lang: str
    body: str
    needs: str | None
    """The reason of the ``<!-- needs: ... -->`` marker on the line before it; None if none."""


_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_NEEDS = re.compile(r"<!--\s*needs:\s*(.+?)\s*-->\s*\Z")
SHELL = frozenset({"bash", "sh", "shell", "console"})


def blocks(page: str, text: str) -> list[Block]:
    found = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _NEEDS.search(before)
        found.append(
            Block(
                page,
                text.count("\n", 0, match.start()) + 1,
                match.group(1),
                match.group(2),
                marker.group(1) if marker else None,
            )
        )
    return found


def prose(text: str) -> str:
    """``text`` without its fenced blocks (blank lines in their place)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def spans(text: str) -> list[str]:
    """The inline code spans of ``text`` (no fences), as written."""
    return [m.group(2) for m in _SPAN.finditer(prose(text))]


def command_lines(body: str) -> Iterator[list[str]]:
    """The commands of a shell block: continuations joined, comments dropped, one token list
    for each command of ``&&``/``||``/``;``/``|`` chains."""
    for line in body.replace("\\\n", " ").splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            tokens = line.split("#", 1)[0].split()
        command: list[str] = []
        for token in tokens:
            if token in {"&&", "||", ";", "|"}:
                if command:
                    yield command
                command = []
            else:
                command.append(token)
        if command:
            yield command


@dataclass(frozen=True)
class Invocation:
    program: str
    """``trio-encode CMD`` (``trio-encode`` alone for the group), ``sglang.launch_server``,
    ``sglang_router.launch_router``, or the first word of anything else."""
    flags: tuple[str, ...]


_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
_LONG_OPTION = re.compile(r"--[a-zA-Z<*]")


def invocation(tokens: list[str]) -> Invocation | None:
    """What ``tokens`` run and the long options they give it (up to a ``--``)."""
    while tokens and _ENV.match(tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None
    head, rest = Path(tokens[0]).name, tokens[1:]
    if head.startswith("python") and rest[:1] == ["-m"] and len(rest) > 1:
        head, rest = rest[1], rest[2:]
    if head in {"trio-encode", "trio_encode"}:
        command = next((t for t in rest if not t.startswith("-")), "")
        head = f"trio-encode {command}".strip()
        if command and command not in cli.commands:
            head = f"trio-encode {command}"  # an unknown command: its flags all fail
    flags = []
    for token in rest:
        if token == "--":
            break
        if _LONG_OPTION.match(token):
            flags.append(token.split("=", 1)[0])
    return Invocation(head, tuple(flags))


def flags_of(program: str) -> frozenset[str] | None:
    """The flags ``program`` takes; None for a program whose flags are not checked here."""
    if program.startswith("trio-encode"):
        return trio_encode_flags().get(program.removeprefix("trio-encode").strip(), frozenset())
    return {
        "sglang.launch_server": SGLANG_SERVER_FLAGS,
        "sglang_router.launch_router": SGLANG_ROUTER_FLAGS,
    }.get(program)


_PROSE_FLAG = re.compile(r"(?<![\w`/-])--[a-z][a-z0-9_-]*")


def _exists(flag: str, known: frozenset[str]) -> bool:
    """``flag`` is in ``known``; a pattern (``--engine-*-threads``, ``--no-<name>``) matches one."""
    if "*" not in flag and "<" not in flag:
        return flag in known
    pattern = re.compile(re.sub(r"\\\*|<[^>]*>", ".+", re.escape(flag)))
    return any(pattern.fullmatch(option) for option in known)


def unknown_flags(page: str, text: str) -> list[str]:
    """Each flag ``text`` names that its program (or, alone, any known program) lacks."""
    wrong = []
    anywhere = known_anywhere()

    def check(where: str, tokens: list[str]) -> None:
        called = invocation(tokens)
        if called is None:
            return
        known = flags_of(called.program)
        for flag in called.flags:
            if not _exists(flag, anywhere if known is None else known):
                wrong.append(f"{page}: {flag} in {where!r} ({called.program})")

    for block in blocks(page, text):
        if block.lang in SHELL:
            for tokens in command_lines(block.body):
                check(" ".join(tokens), tokens)
    for span in spans(text):
        for tokens in command_lines(span.replace("\n", " ").replace("\\|", "|")):
            if tokens[0].startswith("-"):  # flags alone, or with their values
                loose = (t.split("=", 1)[0] for t in tokens if _LONG_OPTION.match(t))
                wrong += [f"{page}: {f} in {span!r}" for f in loose if not _exists(f, anywhere)]
            else:
                check(span, tokens)
    outside = _SPAN.sub(" ", prose(text))
    wrong += [f"{page}: {f}" for f in _PROSE_FLAG.findall(outside) if not _exists(f, anywhere)]
    return wrong


def page_texts() -> list[tuple[str, str]]:
    return [(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")) for path in PAGES]


# -- the checks ----------------------------------------------------------------------------


def test_the_pages_are_read() -> None:
    assert len(PAGES) >= 14
    assert "serve" in trio_encode_flags()
    assert "--allowed-receivers" in trio_encode_flags()["serve"]


def test_every_flag_the_docs_name_exists_where_they_name_it() -> None:
    wrong = [line for page, text in page_texts() for line in unknown_flags(page, text)]
    assert not wrong, "\n".join(wrong)


def unknown_commands(page: str, text: str) -> list[str]:
    """The ``trio-encode CMD`` commands ``text`` runs or names that the CLI lacks."""
    known = {f"trio-encode {name}".strip() for name in trio_encode_flags()}
    bodies = [b.body for b in blocks(page, text) if b.lang in SHELL] + spans(text)
    return sorted(
        {
            f"{page}: {called.program}"
            for body in bodies
            for tokens in command_lines(body.replace("\n", " "))
            if (called := invocation(tokens)) is not None
            and called.program.startswith("trio-encode")
            and called.program not in known
        }
    )


def test_every_command_the_docs_name_exists() -> None:
    wrong = [line for page, text in page_texts() for line in unknown_commands(page, text)]
    assert not wrong, "\n".join(wrong)
    assert unknown_commands("x.md", "`trio-encode recieve` and `trio-encode serve`") == [
        "x.md: trio-encode recieve"
    ]


def test_the_other_tools_flags_are_theirs() -> None:
    """mooncake_master's flags (gflags: ``-name``) and the routing simulation's, as the
    tools themselves list them."""
    bin_dir = SCRIPTS
    master = subprocess.run(
        [str(bin_dir / "mooncake_master"), "--helpfull"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    listed = master.stdout + master.stderr
    for flag, tool in OTHER_TOOLS.items():
        if tool == "mooncake_master":
            assert re.search(rf"^\s*-{flag[2:]} ", listed, re.M), flag
    simulation = subprocess.run(
        [str(bin_dir / "python"), "-m", "trio_encode.tools.bench.routing_sim", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "--plot" in simulation.stdout, simulation.stderr


def test_a_doc_naming_a_missing_flag_fails() -> None:
    synthetic = (
        "Start it with `trio-encode serve --remote-host example.org`.\n\n"
        "```bash\ntrio-encode bench --quiet\n"
        "python -m sglang.launch_server --model-path /m --tp 4\n```\n"
        "Or bare: `--no-such-flag`, and in prose --neither-this.\n"
    )
    wrong = unknown_flags("synthetic.md", synthetic)
    assert wrong == [
        "synthetic.md: --quiet in 'trio-encode bench --quiet' (trio-encode bench)",
        "synthetic.md: --tp in 'python -m sglang.launch_server --model-path /m --tp 4' "
        "(sglang.launch_server)",
        "synthetic.md: --remote-host in 'trio-encode serve --remote-host example.org' "
        "(trio-encode serve)",
        "synthetic.md: --no-such-flag in '--no-such-flag'",
        "synthetic.md: --neither-this",
    ]
    # A flag of another command is wrong there, though it exists: serve has no --vlm.
    assert unknown_flags("x.md", "`trio-encode serve --vlm`") == [
        "x.md: --vlm in 'trio-encode serve --vlm' (trio-encode serve)"
    ]
    # And the real ones pass.
    assert unknown_flags("x.md", "`trio-encode serve --remote-hosts a --model /m`") == []


_ROUTE_SPAN = re.compile(r"^(?:(?:GET|POST|HEAD|PUT|DELETE) )?(/[a-z_]+)(?: .*)?$", re.S)


def named_routes(text: str) -> set[str]:
    """The routes ``text`` names in code spans (`/send`, `POST /encode`, `GET /metrics`)."""
    return {m.group(1) for span in spans(text) if (m := _ROUTE_SPAN.match(span))}


NOT_ROUTES = frozenset({"/tmp", "/metadata"})
"""Spans shaped like a route that name a directory or another server's path."""


def test_every_route_the_docs_name_is_served() -> None:
    served = served_routes()
    assert {"/encode", "/send", "/livez", "/readyz", "/health", "/metrics"} <= served
    wrong = [
        f"{page}: {route}"
        for page, text in page_texts()
        for route in sorted(named_routes(text) - NOT_ROUTES)
        if route not in served and route not in OTHER_ROUTES
    ]
    assert not wrong, "\n".join(wrong)
    assert named_routes("`POST /nowhere` and `/encode`") - served == {"/nowhere"}


_METRIC = re.compile(r"\btrio_encode_[a-z0-9_]*[a-z0-9]\b")
_ABBREVIATED = re.compile(r"\.\.\._([a-z0-9_]+)")


def unknown_metrics(text: str, exported: frozenset[str]) -> list[str]:
    """Metric names in ``text`` the registry does not export; ``..._suffix`` must end one."""
    wrong = [name for name in _METRIC.findall(text) if name not in exported]
    wrong += [
        f"..._{tail}"
        for tail in _ABBREVIATED.findall(text)
        if not any(name.endswith("_" + tail) for name in exported)
    ]
    return wrong


def test_every_metric_the_docs_name_is_exported() -> None:
    exported = exported_metrics()
    assert "trio_encode_requests_total" in exported
    assert "trio_encode_build_info" in exported
    wrong = [f"{page}: {n}" for page, text in page_texts() for n in unknown_metrics(text, exported)]
    assert not wrong, "\n".join(wrong)
    assert unknown_metrics("`trio_encode_made_up_total`, `..._nope`", exported) == [
        "trio_encode_made_up_total",
        "..._nope",
    ]


_VARIABLE = re.compile(r"\bTRIO_ENCODE_[A-Z0-9_]*[A-Z0-9]\b")


def test_every_variable_the_docs_name_is_a_setting() -> None:
    variables = {entry.env for entry in catalog()} | set(OTHER_VARIABLES)
    wrong = [
        f"{page}: {name}"
        for page, text in page_texts()
        for name in _VARIABLE.findall(text)
        if name not in variables
    ]
    assert not wrong, "\n".join(wrong)


def groups_table(text: str) -> list[str]:
    """The first column of the ``| group | what |`` table."""
    table = text.split("| group | what |\n|---|---|\n", 1)[1].split("\n\n", 1)[0]
    return [row.split("|")[1].strip() for row in table.splitlines()]


_GROUP_NAMED = re.compile(r"\b(?:the|in the) `?([a-z]+)`? group\b")


def test_the_setting_groups_the_docs_name_are_the_groups_help_shows() -> None:
    shown = {entry.group for entry in catalog()}
    assert shown <= set(GROUPS)
    rows = groups_table((DOCS / "operations.md").read_text(encoding="utf-8"))
    assert sorted(rows) == sorted(shown), rows
    named = [(page, group) for page, text in page_texts() for group in _GROUP_NAMED.findall(text)]
    wrong = [f"{page}: the {group} group" for page, group in named if group not in GROUPS]
    assert not wrong, "\n".join(wrong)
    assert groups_table("| group | what |\n|---|---|\n| memory | x |\n") == ["memory"]


_STATUS_KIND = re.compile(r"\b([1-5]\d\d)\s*\|?\s*`([a-z]+(?:_[a-z]+)*)`")


def test_every_error_kind_the_docs_name_exists_with_its_status() -> None:
    status_of = {cls.kind: cls.status for cls in ERRORS}
    wrong = [
        f"{page}: {status} {kind} (the contract: {status_of.get(kind)})"
        for page, text in page_texts()
        for status, kind in _STATUS_KIND.findall(text)
        if status_of.get(kind) != int(status)
    ]
    assert not wrong, "\n".join(wrong)
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    assert not [kind for kind in status_of if f"`{kind}`" not in api]
    assert _STATUS_KIND.findall("a 415 `unsupported_media_type`, 200 `made_up`") == [
        ("415", "unsupported_media_type"),
        ("200", "made_up"),
    ]


def test_the_health_answer_the_docs_show_is_the_servers() -> None:
    """``/health`` shows what it answers, and never the engine's ``session_id``."""
    answer = live_app()[1]
    assert "session_id" not in answer
    operations = (DOCS / "operations.md").read_text(encoding="utf-8")
    row = re.search(r"^\| `GET /health` \|([^|]*)\|", operations, re.M)
    assert row is not None
    shown = row.group(1).split("(", 1)[0]
    assert set(re.findall(r"`(\w+)`", shown)) == set(answer), shown


def test_no_page_installs_or_runs_what_a_reader_cannot() -> None:
    for page, text in page_texts():
        flat = " ".join(text.split())
        assert "trio-encode[" not in flat, f"{page}: install from this directory, '.[extra]'"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    # nox is in .venv after .ci/run, never on PATH: the README names it as a module.
    assert "\nnox " not in readme
    assert " `nox -s docs`" not in readme


# -- the SGLang recipe ---------------------------------------------------------------------


def options(tokens: list[str]) -> dict[str, list[str]]:
    """Each ``--flag`` of ``tokens`` and the words after it, up to the next flag."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for token in tokens:
        if token.startswith("--"):
            current = found.setdefault(token, [])
        elif current is not None:
            current.append(token)
    return found


def recipe() -> dict[str, dict[str, list[str]]]:
    """The options of each command of docs/sglang.md's four commands, by role."""
    text = (DOCS / "sglang.md").read_text(encoding="utf-8")
    section = text.split("### The four commands", 1)[1]
    (block,) = [b for b in blocks("docs/sglang.md", section.split("\n### ", 1)[0])]
    roles: dict[str, dict[str, list[str]]] = {}
    for tokens in command_lines(block.body):
        called = invocation(tokens)
        assert called is not None
        given = options(tokens)
        role = {
            "trio-encode serve": "encode",
            "sglang_router.launch_router": "router",
        }.get(called.program) or given["--disaggregation-mode"][0]
        roles[role] = given
    return roles


def test_the_sglang_recipe_fits_together() -> None:
    import ipaddress

    roles = recipe()
    assert set(roles) == {"encode", "prefill", "decode", "router"}
    encode, prefill, decode, router = (roles[r] for r in ("encode", "prefill", "decode", "router"))
    model = encode["--model"]
    assert prefill["--model-path"] == model == decode["--model-path"], "one model path"
    assert prefill["--encoder-urls"] == [
        f"http://{encode['--engine-hostname'][0]}:{encode['--port'][0]}"
    ], "the prefill calls the encoder where it listens"
    assert "--language-only" in prefill
    assert prefill["--encoder-transfer-backend"] == ["mooncake"]
    assert "--language-only" not in decode, "a language-only decode would send images to encode"
    text = (DOCS / "sglang.md").read_text(encoding="utf-8")
    prefill_host = re.search(r"SGLANG_HOST_IP=(\S+) python -m sglang.launch_server", text)
    assert prefill_host is not None
    network = ipaddress.ip_network(encode["--allowed-receivers"][0])
    assert ipaddress.ip_address(prefill_host.group(1)) in network, "/send may reach the ranks"
    assert "--pd-disaggregation" in router
    assert router["--prefill"] == [
        f"http://{prefill_host.group(1)}:{prefill['--port'][0]}",
        prefill["--disaggregation-bootstrap-port"][0],
    ]
    (decode_url,) = router["--decode"]
    assert decode_url.endswith(f":{decode['--port'][0]}")


def test_every_public_serve_command_names_its_receivers() -> None:
    """A server on every interface without ``--allowed-receivers`` answers every rank on
    another host 403 ``receiver_not_allowed``."""
    for path in PAGES:
        page = str(path.relative_to(ROOT))
        for block in blocks(page, path.read_text(encoding="utf-8")):
            for tokens in command_lines(block.body) if block.lang in SHELL else ():
                called = invocation(tokens)
                if called and called.program == "trio-encode serve" and "0.0.0.0" in tokens:
                    assert "--allowed-receivers" in called.flags, f"{page}:{block.line}"


# -- shell blocks --------------------------------------------------------------------------


def shell_blocks() -> list[Block]:
    return [
        block
        for path in PAGES
        for block in blocks(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
        if block.lang in SHELL
    ]


def test_every_shell_block_runs_or_says_why_not() -> None:
    blocks_ = shell_blocks()
    assert len(blocks_) >= 15
    unmarked = [b for b in blocks_ if b.needs is None]
    reasons = [b.needs.split(":")[0].split()[0] for b in blocks_ if b.needs is not None]
    assert set(reasons) <= set(NEEDS), reasons
    # Each unmarked block is one RUNS knows how to run here.
    assert sorted(f"{b.page}:{b.body}" for b in unmarked) == sorted(
        f"{page}:{body}" for page, body in RUNS
    ), "a shell block is neither marked <!-- needs: ... --> nor run by this module"


def test_a_block_without_a_marker_is_caught() -> None:
    text = "<!-- needs: gpu -->\n```bash\ntrio-encode serve\n```\n\n```sh\nls\n```\n"
    found = blocks("x.md", text)
    assert [(b.line, b.needs) for b in found] == [(2, "gpu"), (6, None)]


RUNS: list[tuple[str, str]] = []
"""The unmarked shell blocks, filled in below by :func:`_runs`: (page, body)."""


def _runs() -> None:
    for block in shell_blocks():
        if block.needs is None:
            RUNS.append((block.page, block.body))


_runs()

READY = "serving on"
"""The log line a server prints once it listens: a block's server is stopped after it."""


def run_block(body: str, scratch: Path) -> list[str]:
    """Run a shell block's commands in ``scratch`` as a reader would after the set-up (the
    virtual environment's scripts on PATH (this interpreter's: ``.venv`` here, nox's session
    in CI), ``/tmp/`` mapped into ``scratch``, the default
    port a free one, ``TRIO_ENCODE_PORT=0``, since other servers here may hold 8000); a server
    (``trio-encode serve`` without ``--help``) is run until it says it serves, then
    interrupted. The failures, one line each."""
    (scratch / ".venv").symlink_to(sys.prefix)
    env = {
        **os.environ,
        "PATH": f"{SCRIPTS}{os.pathsep}{os.environ['PATH']}",
        "TRIO_ENCODE_PORT": "0",
    }
    failures = []
    for line in body.replace("\\\n", " ").splitlines():
        command = line.split(" #", 1)[0].strip().replace("/tmp/", f"{scratch}/")
        if not command or command.startswith("#"):
            continue
        tokens = shlex.split(command)
        called = invocation(tokens)
        serves = (
            called is not None and called.program == "trio-encode serve" and "--help" not in tokens
        )
        if serves:
            failures += _until_ready(command, scratch, env)
            continue
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            failures.append(f"{command}: exit {done.returncode}: {done.stderr[-2000:]}")
    return failures


def _until_ready(command: str, scratch: Path, env: dict[str, str]) -> list[str]:
    """Start a server, wait until ``/readyz`` answers 200 (the model loaded), interrupt it
    as Ctrl-C would, and expect a clean exit."""
    log = scratch / "server.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], cwd=scratch, env=env, stdout=sink, stderr=sink
        )
    try:
        ready = _wait_ready(server, log)
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    if not ready or server.returncode != 0:
        return [f"{command}: ready {ready}, exit {server.returncode}: {log.read_text()[-2000:]}"]
    return []


def _wait_ready(server: subprocess.Popen[bytes], log: Path) -> bool:
    for _ in range(600):
        if server.poll() is not None:
            return False
        serving = re.search(rf"{READY} (http://[^ ]+)", log.read_text())
        if serving:
            try:
                if httpx.get(serving.group(1) + "/readyz", timeout=5).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    return False


@pytest.mark.parametrize(
    ("page", "body"), RUNS, ids=[f"{page}:{body.splitlines()[0][:40]}" for page, body in RUNS]
)
def test_the_shell_block_runs(page: str, body: str, tmp_path: Path) -> None:
    failures = run_block(body, tmp_path)
    assert not failures, "\n".join(failures)


def test_a_failing_block_is_reported(tmp_path: Path) -> None:
    failures = run_block("trio-encode bench --quiet\n", tmp_path)
    assert len(failures) == 1
    assert "No such option" in failures[0]
    assert "--quiet" in failures[0]


# -- SGLang 0.5.23's flags -----------------------------------------------------------------
# Read from its released wheel: the option strings of the argparse parser its own
# ``ServerArgs.add_cli_args`` builds (``python -m sglang.launch_server``), and of
# sglang-router 0.3.2's ``RouterArgs.add_cli_args`` (``python -m sglang_router.launch_router``).

SGLANG_SERVER_FLAGS = frozenset(
    """
    --abort-on-priority-when-disabled --admin-api-key --allow-auto-truncate
    --allowed-media-domains --api-key --asr-max-buffer-seconds --asr-max-concurrent-sessions
    --attention-backend --attention-context-parallel-size --attention-data-parallel-size
    --attn-cp-size --attn-dp-size --base-gpu-id --batch-notify-size --bf16-gemm-backend
    --boundary-reduction --bucket-e2e-request-latency --bucket-inter-token-latency
    --bucket-time-to-first-token --c128-page-size --chat-template
    --checkpoint-engine-wait-weights-before-ready --chunked-prefill-size --completion-template
    --config --constrained-json-disable-any-whitespace --constrained-json-max-whitespace-cnt
    --constrained-json-whitespace-pattern --context-bucket --context-length --cp-strategy
    --cpu-offload-gb --crash-dump-folder --cuda-graph-backend-decode
    --cuda-graph-backend-prefill --cuda-graph-bs-decode --cuda-graph-bs-prefill
    --cuda-graph-config --cuda-graph-max-bs-decode --cuda-graph-max-bs-prefill
    --cuda-graph-max-seq-len-prefill --cuda-graph-prefill-max-context --custom-weight-loader
    --data-parallel-size --dcp-comm-backend --dcp-replicate-q-proj --dcp-size --debug-cuda-graph
    --debug-tensor-dump-input-file --debug-tensor-dump-layers --debug-tensor-dump-output-folder
    --decode-attention-backend --decode-context-parallel-size --decode-log-interval
    --decoupled-spec-bind-endpoint --decoupled-spec-connect-endpoints --decoupled-spec-rank
    --decoupled-spec-role --decrypted-config-file --decrypted-draft-config-file --deepep-config
    --deepep-dispatcher-output-dtype --deepep-mode --deepep-v2-mode
    --default-chat-template-kwargs --default-priority-value --delete-ckpt-after-loading
    --detokenizer-worker-num --device --disable-aiter-allreduce-fusion-in-decode
    --disable-aiter-allreduce-fusion-in-prefill --disable-attn-tp-gather
    --disable-chunked-prefix-cache --disable-cuda-graph --disable-cuda-graph-padding
    --disable-custom-all-reduce --disable-decode-cuda-graph --disable-fast-image-processor
    --disable-flashinfer-autotune --disable-flashinfer-cutlass-moe-fp4-allgather
    --disable-hybrid-swa-memory --disable-outlines-disk-cache --disable-overlap-schedule
    --disable-prefill-cuda-graph --disable-priority-preemption --disable-radix-cache
    --disable-shared-experts-fusion --disable-tokenizer-batch-decode
    --disaggregation-bootstrap-port --disaggregation-decode-allocation-policy
    --disaggregation-decode-enable-offload-kvcache --disaggregation-decode-enable-radix-cache
    --disaggregation-decode-extra-slots --disaggregation-decode-host-receive-threshold
    --disaggregation-decode-polling-interval --disaggregation-decode-retraction-backup
    --disaggregation-enable-kv-checksum --disaggregation-ib-device --disaggregation-mode
    --disaggregation-transfer-backend --dist-init-addr --dist-timeout --dllm-algorithm
    --dllm-algorithm-config --dllm-fdfo --download-dir --dp-size --dsa-decode-backend
    --dsa-paged-mqa-logits-backend --dsa-prefill-backend --dsa-topk-backend --dsa-triton-union
    --dsv4-attn-backend --dsv4-prefill-backend --dtype --dwdp-size
    --dynamic-batch-tokenizer-batch-size --dynamic-batch-tokenizer-batch-timeout
    --elastic-ep-backend --elastic-ep-initial-size --elastic-ep-join-mode
    --elastic-ep-join-rank-offset --elastic-ep-scale-timeout
    --enable-adaptive-dispatch-to-encoder --enable-aiter-allreduce-fusion
    --enable-amd-monokernel --enable-attn-tp-input-scattered
    --enable-broadcast-mm-inputs-process --enable-cache-report --enable-cp-decode-attn-tp
    --enable-cudagraph-gc --enable-custom-logit-processor --enable-decoder-swa-bounded-replay
    --enable-deepseek-v4-fp4-indexer --enable-dense-mlp-attn-tp --enable-deterministic-inference
    --enable-dp-attention --enable-dp-attention-local-control-broadcast --enable-dp-lm-head
    --enable-draft-weights-cpu-backup --enable-dsa-cache-layer-split --enable-dsa-fused-indexer
    --enable-dynamic-batch-tokenizer --enable-dynamic-chunking --enable-elastic-expert-backup
    --enable-encoder-swa-bounded-replay --enable-eplb --enable-flashinfer-allreduce-fusion
    --enable-flexkv --enable-forward-pass-metrics --enable-fp32-lm-head
    --enable-fused-moe-sum-all-reduce --enable-fused-qk-norm-rope --enable-hicache
    --enable-hierarchical-cache --enable-hisparse --enable-http-worker-reuseport --enable-http2
    --enable-int8-mamba-checkpoint --enable-kv-cache-sharding --enable-layernorm-sp
    --enable-layerwise-nvtx-marker --enable-lean-attention --enable-linear-replayssm
    --enable-linear-replayssm-spec --enable-linker-mla-dedup --enable-lmcache --enable-lora
    --enable-lora-overlap-loading --enable-mamba-cache-stochastic-rounding
    --enable-megamoe-for-layernorm-sp --enable-memory-saver --enable-metrics
    --enable-metrics-for-all-schedulers --enable-mfu-metrics --enable-mis --enable-mixed-chunk
    --enable-mm-global-cache --enable-mscclpp --enable-multi-layer-eagle --enable-multimodal
    --enable-nccl-nvls --enable-nvidia-megakernel --enable-p2p-check
    --enable-page-major-kv-layout --enable-paged-experts --enable-pd-role-switch --enable-pdmux
    --enable-precise-embedding-interpolation --enable-prefill-cp --enable-prefill-delayer
    --enable-prefix-mm-cache --enable-priority-scheduling --enable-profile-cuda-graph
    --enable-quant-communications --enable-request-time-stats-logging --enable-response-store
    --enable-return-aux-hidden-states --enable-return-hidden-states --enable-return-indexer-topk
    --enable-return-routed-experts --enable-scattered-sconv --enable-session-radix-cache
    --enable-shared-experts-attn-tp --enable-single-batch-overlap --enable-ssl-refresh
    --enable-streaming-session --enable-strict-thinking --enable-symm-mem --enable-tf32-matmul
    --enable-tokenizer-batch-encode --enable-torch-compile --enable-torch-compile-debug-mode
    --enable-torch-symm-mem --enable-tp-lm-head-all-to-all --enable-trace
    --enable-two-batch-overlap --enable-unified-cache-external-linker --enable-unified-memory
    --enable-w4a4-mxfp4-megamoe --enable-waterfill --enable-watermark
    --enable-weights-cpu-backup --encoder-bootstrap-port --encoder-only --encoder-register-urls
    --encoder-transfer-backend --encoder-urls --enforce-disable-flashinfer-allreduce-fusion
    --enforce-shared-experts-fusion --engine-info-bootstrap-port --ep --ep-dispatch-algorithm
    --ep-num-redundant-experts --ep-size --eplb-algorithm
    --eplb-min-rebalancing-utilization-threshold --eplb-rebalance-layers-per-chunk
    --eplb-rebalance-num-iterations --expert-balancedness-report-mode
    --expert-distribution-recorder-buffer-size --expert-distribution-recorder-mode
    --expert-parallel-size --experts-shared-outer-loras --export-metrics-to-file
    --export-metrics-to-file-dir --extra-metric-labels --fastapi-root-path --file-storage-path
    --flashinfer-a2a-dispatch-type --flashinfer-allreduce-fusion-backend
    --flashinfer-autotune-skip-ops --flashinfer-mla-disable-ragged
    --flashinfer-mxfp4-moe-precision --flexkv-config-file --forward-hooks
    --forward-pass-metrics-ipc-name --forward-pass-metrics-worker-id --fp4-gemm-backend
    --fp8-gemm-backend --fuseep-mode --gated-launch-port --gc-threshold
    --gc-warning-threshold-secs --generation-tokens-buckets --gpu-id-step --grammar-backend
    --grpc-http-sidecar-port --grpc-mode --grpc-port --grpc-response-timeout-secs --help
    --hf-chat-template-name --hicache-host-memory-fraction --hicache-host-memory-mode
    --hicache-io-backend --hicache-mem-layout --hicache-ratio --hicache-size
    --hicache-storage-backend --hicache-storage-backend-extra-config
    --hicache-storage-prefetch-policy --hicache-storage-prefetch-retry-max-attempts
    --hicache-storage-prefetch-retry-poll-interval --hicache-write-policy
    --hierarchical-sparse-attention-extra-config --hisparse-config --host
    --http2-initial-connection-window-size --http2-max-concurrent-streams
    --image-processor-backend --incremental-streaming-output --init-expert-location
    --int8-mamba-ckpt-size --is-embedding --json-model-override-args --kt-cpuinfer
    --kt-max-deferred-experts-per-token --kt-method --kt-num-gpu-experts --kt-threadpool-count
    --kt-weight-path --kv-cache-dtype --kv-canary --kv-canary-real-data
    --kv-canary-sweep-interval --kv-events-config --language-model-only --language-only
    --limit-mm-data-per-request --linear-attn-backend --linear-attn-decode-backend
    --linear-attn-prefill-backend --linear-attn-verify-backend --linear-replayssm-cache-len
    --lmcache-config-file --load-balance-method --load-format --load-publish-endpoint
    --load-snapshot-publish-interval --log-level --log-level-http --log-requests
    --log-requests-format --log-requests-level --log-requests-target --lora-backend
    --lora-drain-wait-threshold --lora-eviction-policy --lora-paths --lora-strict-loading
    --lora-target-modules --lora-use-virtual-experts --mamba-backend --mamba-cache-philox-rounds
    --mamba-full-memory-ratio --mamba-max-states-per-path --mamba-radix-cache-strategy
    --mamba-ssm-dtype --mamba-track-interval --max-ep-size --max-loaded-loras
    --max-lora-chunk-size --max-lora-rank --max-loras-per-batch --max-mamba-cache-size
    --max-prefill-tokens --max-queued-requests --max-running-requests --max-total-tokens
    --media-url-max-file-size-mb --mem-fraction-static --min-free-slots-delay
    --mlx-enable-sampling --mm-attention-backend --mm-enable-dp-encoder --mm-feature-transport
    --mm-global-cache-backend --mm-io-worker-num --mm-preprocess-cache-size-mb
    --mm-process-config --mm-processor-worker-num --model --model-checksum --model-config-parser
    --model-impl --model-loader-extra-config --model-path --modelexpress-config
    --modelopt-checkpoint-restore-path --modelopt-checkpoint-save-path --modelopt-export-path
    --modelopt-quant --moe-a2a-backend --moe-data-parallel-size --moe-dense-tp-size
    --moe-dp-size --moe-runner-backend --monokernel-backend --mooncake-ib-device
    --msprobe-dump-config --nccl-init-addr --nccl-port --nnodes --no-dcp-replicate-q-proj
    --no-dllm-fdfo --no-enable-decoder-swa-bounded-replay --no-enable-dsa-fused-indexer
    --no-enable-fused-qk-norm-rope --no-enable-tf32-matmul --no-enable-tp-lm-head-all-to-all
    --no-experts-shared-outer-loras --no-lora-strict-loading --no-mm-enable-dp-encoder
    --no-ple-offload-embedding --no-speculative-enable-w4a4-mxfp4-megamoe --node-rank
    --num-continuous-decode-steps --num-reserved-decode-tokens --numa-node --offload-group-size
    --offload-mode --offload-num-in-group --offload-prefetch-step --optimistic-prefill-attempts
    --otlp-service-name --otlp-traces-endpoint --page-size --paged-experts-num-resident
    --pdmux-config-path --pipeline-parallel-size --ple-offload-backend --ple-offload-dir
    --ple-offload-embedding --port --pp-async-batch-depth --pp-max-micro-batch-size --pp-size
    --pre-warm-nccl --preferred-sampling-params --prefill-attention-backend
    --prefill-decode-interval --prefill-decode-interval-min-bs
    --prefill-delayer-forward-passes-buckets --prefill-delayer-max-delay-ms
    --prefill-delayer-max-delay-passes --prefill-delayer-queue-min-ratio
    --prefill-delayer-token-usage-low-watermark --prefill-delayer-wait-seconds-buckets
    --prefill-kv-cache-dequant-dtype --prefill-max-requests --prefill-only-disable-kv-cache
    --priority-scheduling-preemption-threshold --prompt-tokens-buckets --qsa-indexer-dtype
    --quantization --quantization-param-path --quantize-and-serve --radix-cache-backend
    --radix-eviction-policy --radix-eviction-policy-config --random-seed --reasoning-parser
    --remote-instance-weight-loader-backend --remote-instance-weight-loader-seed-instance-ip
    --remote-instance-weight-loader-seed-instance-service-port
    --remote-instance-weight-loader-send-weights-group-ports
    --remote-instance-weight-loader-start-seed-via-transfer-engine --retraction-policy
    --return-aux-hidden-state-layer-ids --return-hidden-states-mode --return-input-ids
    --return-output-ids --revision --rl-on-policy-target --rl-quant-profile --sampling-backend
    --sampling-defaults --sampling-mask-max-tokens --schedule-conservativeness
    --schedule-low-priority-values-first --schedule-policy --scheduler-recv-interval
    --served-model-name --shared-experts-tp-size --show-time-cost --sidecar --sidecar-args
    --skip-server-warmup --skip-tokenizer-init --sleep-on-idle --sm-group-num --smg-grpc-mode
    --smg-http-sidecar-port --soft-watchdog-timeout --spec-trace-dir
    --speculative-accept-threshold-acc --speculative-accept-threshold-single
    --speculative-adaptive --speculative-adaptive-config --speculative-algorithm
    --speculative-attention-mode --speculative-dflash-block-size
    --speculative-domino-candidate-pool-size --speculative-draft-attention-backend
    --speculative-draft-kv-cache-dtype --speculative-draft-load-format --speculative-draft-model
    --speculative-draft-model-path --speculative-draft-model-quantization
    --speculative-draft-model-revision --speculative-draft-sink-size
    --speculative-draft-window-size --speculative-dsa-topk-backend
    --speculative-dspark-align-verify-tokens-to-graph-tier --speculative-dspark-block-size
    --speculative-dspark-confidence-sts-path --speculative-dspark-sps-table-path
    --speculative-eagle-topk --speculative-enable-w4a4-mxfp4-megamoe
    --speculative-moe-a2a-backend --speculative-moe-runner-backend --speculative-ngram-capacity
    --speculative-ngram-external-corpus-max-tokens --speculative-ngram-external-corpus-path
    --speculative-ngram-external-sam-budget --speculative-ngram-match-type
    --speculative-ngram-max-bfs-breadth --speculative-ngram-max-trie-depth
    --speculative-ngram-min-bfs-breadth --speculative-num-draft-tokens --speculative-num-steps
    --speculative-token-map --speculative-use-block-verification
    --speculative-use-rejection-sampling --ssl-ca-certs --ssl-certfile --ssl-keyfile
    --ssl-keyfile-password --startup-weight-load-mode --stream-interval
    --stream-response-default-include-usage --strip-thinking-cache --swa-full-tokens-ratio
    --swa-prefix-tails --tbo-token-distribution-threshold --tensor-parallel-size
    --tokenizer-backend --tokenizer-metrics-allowed-custom-labels
    --tokenizer-metrics-custom-labels-header --tokenizer-mode --tokenizer-path
    --tokenizer-worker-num --tool-call-parser --tool-server --torch-compile-max-bs --tp-size
    --trace-modules --triton-attention-num-kv-splits --triton-attention-reduce-in-fp32
    --triton-attention-split-tile-size --trust-mm-content-hashes --trust-remote-code
    --trust-request-chat-template --unified-cache-external-linker-backend
    --unified-cache-external-linker-config --uno-lora-path --use-ray
    --uvicorn-access-log-exclude-prefixes --warmups --watchdog-timeout --watermark-config
    --weight-cache-mode --weight-cache-socket --weight-cache-timeout
    --weight-loader-disable-mmap --weight-loader-drop-cache-after-load
    --weight-loader-prefetch-checkpoints --weight-loader-prefetch-num-threads --weight-version
"""[1:].split()
)

SGLANG_ROUTER_FLAGS = frozenset(
    """
    --api-key --assignment-mode --backend --balance-abs-threshold --balance-rel-threshold
    --bucket-adjust-interval-secs --ca-cert-paths --cache-threshold --cb-failure-threshold
    --cb-success-threshold --cb-timeout-duration-secs --cb-window-duration-secs --chat-template
    --client-cert-path --client-key-path --control-plane-api-keys --control-plane-audit-enabled
    --cors-allowed-origins --decode --decode-policy --decode-selector --disable-circuit-breaker
    --disable-health-check --disable-retries --dp-aware --enable-igw --enable-trace
    --eviction-interval-secs --health-check-endpoint --health-check-interval-secs
    --health-check-timeout-secs --health-failure-threshold --health-success-threshold --help
    --history-backend --host --jwt-audience --jwt-issuer --jwt-jwks-uri --jwt-role-mapping
    --log-dir --log-level --max-concurrent-requests --max-idle-secs --max-payload-size
    --max-tree-size --mcp-config-path --mini-lb --model-path --oracle-connect-descriptor
    --oracle-password --oracle-pool-max --oracle-pool-min --oracle-pool-timeout-secs
    --oracle-tns-alias --oracle-username --oracle-wallet-path --otlp-traces-endpoint
    --pd-disaggregation --policy --port --postgres-db-url --postgres-pool-max --prefill
    --prefill-policy --prefill-selector --prometheus-duration-buckets --prometheus-host
    --prometheus-port --queue-size --queue-timeout-secs --rate-limit-tokens-per-second
    --reasoning-parser --redis-pool-max --redis-retention-days --redis-url --request-id-headers
    --request-timeout-secs --retry-backoff-multiplier --retry-initial-backoff-ms
    --retry-jitter-factor --retry-max-backoff-ms --retry-max-retries --selector
    --service-discovery --service-discovery-namespace --service-discovery-port
    --shutdown-grace-period-secs --tls-cert-path --tls-key-path --tokenizer-cache-enable-l0
    --tokenizer-cache-enable-l1 --tokenizer-cache-l0-max-entries --tokenizer-cache-l1-max-memory
    --tokenizer-path --tool-call-parser --worker-startup-check-interval
    --worker-startup-timeout-secs --worker-urls
"""[1:].split()
)
