"""The documentation site builds offline with every warning an error, and shows what it must.

One Sphinx build (about 10 s) in a subprocess whose sockets may reach only loopback, so a
theme asset or an inventory fetched from the network fails the build instead of passing here
and failing on an offline machine. Sphinx is a test dependency: if it is missing, this fails.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trio_encode.cli import cli
from trio_encode.settings import catalog

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SPHINX = (sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html")
"""As ``nox -s docs`` runs it: every warning an error, references checked (nitpicky)."""

NO_NETWORK = """
import ipaddress, socket

_connect = socket.socket.connect

def _loopback_only(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        if not ipaddress.ip_address(socket.gethostbyname(address[0])).is_loopback:
            raise OSError(f"the docs build must not use the network (tried {address!r})")
    return _connect(self, address)

socket.socket.connect = _loopback_only
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site's HTML directory."""
    work = tmp_path_factory.mktemp("docs")
    (work / "sitecustomize.py").write_text(NO_NETWORK)
    out = work / "html"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work), str(ROOT / "src")])}
    result = subprocess.run(
        [*SPHINX, "-d", str(work / "doctrees"), str(DOCS), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _text(site: Path, name: str) -> str:
    """A page's words as a reader sees them, whitespace collapsed."""
    page = (site / f"{name}.html").read_text(encoding="utf-8")
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page)).split())


def test_the_network_guard_refuses_a_remote_connection(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(NO_NETWORK)
    probe = "import socket; socket.socket().connect(('192.0.2.1', 80))"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "must not use the network" in result.stderr


def test_every_markdown_page_in_docs_is_a_page_of_the_site(site: Path) -> None:
    pages = sorted(
        path.relative_to(DOCS) for path in DOCS.rglob("*.md") if not path.parts[0].startswith("_")
    )
    assert len(pages) >= 12
    for page in pages:
        assert (site / page.with_suffix(".html")).is_file(), page


def test_the_site_loads_no_remote_script_style_or_image(site: Path) -> None:
    remote = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.I)
    for page in site.rglob("*.html"):
        assert not remote.search(page.read_text(encoding="utf-8")), page


def test_every_image_a_page_shows_is_in_the_site(site: Path) -> None:
    shown = 0
    for page in site.rglob("*.html"):
        for source in re.findall(r"<img\b[^>]*\bsrc=\"([^\"]+)\"", page.read_text("utf-8")):
            assert (page.parent / source).resolve().is_file(), (page, source)
            shown += 1
    assert shown >= 4  # the three drawings and the routing plot


def test_the_settings_reference_lists_every_setting_with_its_variable_and_help(
    site: Path,
) -> None:
    page = _text(site, "reference/settings")
    for entry in catalog():
        assert entry.flag in page, entry.name
        assert entry.env is not None
        assert entry.env in page, entry.name
        assert entry.help in page, entry.name


def test_the_cli_reference_documents_every_command(site: Path) -> None:
    page = _text(site, "reference/cli")
    for name in cli.commands:
        assert f"trio-encode {name} [OPTIONS]" in page, name


@pytest.mark.parametrize(
    "name",
    [
        "trio_encode.client.http.EncodeClient",
        "trio_encode.client.receiver.LandingPool",
        "trio_encode.client.fleet.FleetClient",
        "trio_encode.errors.RequestError",
        "trio_encode.service.core.EncodeService",
        "trio_encode.scope.RequestScope",
        "trio_encode.scopes.ScopeRegistry",
        "trio_encode.ledger.RegistrationLedger",
        "trio_encode.request_types.Receiver",
        "trio_encode.engine.base.TransferEngine",
        "trio_encode.engine.base.EngineError",
        "trio_encode.testing.explore.run_schedule",
    ],
)
def test_the_api_reference_documents_the_public_surface(site: Path, name: str) -> None:
    assert f'id="{name}"' in (site / "reference" / "api.html").read_text(encoding="utf-8")


def test_the_drawings_are_what_their_script_draws(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("diagrams", DOCS / "img" / "diagrams.py")
    assert spec is not None
    assert spec.loader is not None
    diagrams = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diagrams)
    diagrams.draw_all(tmp_path)
    for name in diagrams.DRAWINGS:
        drawn = (tmp_path / name).read_text(encoding="utf-8")
        assert drawn == (DOCS / "img" / name).read_text(encoding="utf-8"), (
            f"docs/img/{name} is stale: run python docs/img/diagrams.py"
        )


def test_the_readme_set_up_is_the_two_commands_it_says() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set-up: two commands", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, commands
