"""Sessions for tests, lint and benchmarks.

Everything installs through pip (not uv) with ``constraints.txt``, because only pip finds the
CPU torch wheel that lies on disk; uv would download a multi-GB CUDA build. Pythons are never
downloaded: only the local 3.11 has that wheel.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.download_python = "never"
nox.options.sessions = ["lint", "tests"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
PYPROJECT = nox.project.load_toml("pyproject.toml")


def _install(session: nox.Session, *extras_and_groups: str) -> None:
    extras = [e for e in extras_and_groups if not e.startswith("group:")]
    groups = [g.removeprefix("group:") for g in extras_and_groups if g.startswith("group:")]
    requirements: list[str] = []
    for group in groups:
        requirements += nox.project.dependency_groups(PYPROJECT, group)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-c", "constraints.txt", target, *requirements)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite, against the real Mooncake engine (TCP on loopback) and the mock clock."""
    _install(session, "mooncake", "hf", "group:tests")
    session.run("pytest", *session.posargs, env={"GLOG_minloglevel": "2"})


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (check and format) and strict mypy over the package."""
    _install(session, "mooncake", "hf", "group:lint")
    session.run("ruff", "check", "src", "tests", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "noxfile.py")
    session.run("mypy")


@nox.session(python=PYTHON)
def mutants(session: nox.Session) -> None:
    """Re-create the brief's bugs one at a time in a copy of the package; the scope tests must
    fail for each (proves every lifecycle rule has a test that would catch its loss)."""
    _install(session, "group:tests")
    session.run("python", "tests/mutants.py", env={"GLOG_minloglevel": "2"})


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """``trio-encode soak``: 5,000 requests against a real server and TP=4 receiver processes
    while ranks freeze and die, clients vanish and the engine fails calls; every answer, byte,
    deadline and leak checked, RSS and latency bounded (several minutes on 2 cores). Arguments
    after ``--`` go to the command, e.g. ``nox -s soak -- --json soak.json``."""
    _install(session, "mooncake")
    session.run("trio-encode", "soak", *session.posargs, env={"MC_LOG_LEVEL": "ERROR"})


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """``trio-encode bench``: served /send and /encode against raw Mooncake transfers and the
    raw forward, a /health probe and peak RSS (2-3 minutes on 2 cores; run it on an idle
    machine). Arguments after ``--`` go to the command, e.g. ``nox -s bench -- --json``."""
    _install(session, "mooncake")
    env = {"GLOG_minloglevel": "2"}
    session.run("trio-encode", "bench", *session.posargs, env=env)
    # Again with a core left to the event loop, decoding and transfers: on small hosts this
    # is the configuration where the serving path's share of the machine shows.
    spare = str(max(1, (os.cpu_count() or 2) - 1))
    session.run("trio-encode", "bench", "--torch-threads", spare, *session.posargs, env=env)
