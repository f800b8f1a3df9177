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
    # Byte-compiled at install (about a minute of each install): with PYTHONDONTWRITEBYTECODE
    # set, as on the CI machine, nothing imported later would ever be cached, and every child
    # process and mutant run would compile torch again.
    session.install("-c", "constraints.txt", target, *requirements)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite, against the real Mooncake engine (TCP on loopback) and the mock clock."""
    _install(session, "mooncake", "hf", "bench", "group:tests")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON, default=False)
def hostile(session: nox.Session) -> None:
    """The hostile-client suite at length (``tests/hostile``, the ``hostile`` marker): a real
    ``trio-encode serve`` process scanned, cut off, fed bombs and fuzzed, its ``/livez``,
    memory and an honest rank's bytes checked throughout (a few minutes on 2 cores). The short
    sample of each case runs in ``tests``."""
    _install(session, "mooncake", "hf", "bench", "group:tests")
    session.run(
        "pytest",
        "-m",
        "hostile",
        "tests/hostile",
        "tests/test_isolation_processes.py",
        *session.posargs,
    )


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """GPU checks on ``cuda:0`` (not a default session): a tiny Qwen2.5-VL-shaped model served
    on the GPU gives exactly transformers' own ``get_image_features`` on the same device, in
    float32 and bfloat16, through the pinned host arena (``tests/gpu``); then the bench's VLM
    encoder row on the GPU. The steps are ``tests/gpu/steps.py``; arguments after ``--`` go to
    it: ``--device cuda:1``, ``--short`` (a bench of seconds), the rest to pytest. The normal
    suite runs the same steps on the cpu (``tests/test_gpu_steps.py``), as does
    ``nox -s gpu -- --device cpu --short``. On a GPU it installs without
    ``constraints.txt``'s CPU pin (it needs a CUDA build of torch); on the cpu with it."""
    if "cpu" in session.posargs or "--device=cpu" in session.posargs:
        _install(session, "mooncake", "hf", "bench", "group:tests")
    else:
        session.install(".[mooncake,hf,bench]", *nox.project.dependency_groups(PYPROJECT, "tests"))
    session.run("python", "tests/gpu/steps.py", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (check and format) over the code and the docs' Python, strict mypy over the package."""
    _install(session, "mooncake", "hf", "bench", "group:lint")
    python = ["src", "tests", "noxfile.py", "docs/conf.py", "docs/_ext", "docs/img"]
    session.run("ruff", "check", *python)
    session.run("ruff", "format", "--check", *python)
    session.run("mypy")


@nox.session(python=PYTHON)
def mutants(session: nox.Session) -> None:
    """Re-create known lifecycle bugs one at a time in a copy of the package; each mutant's
    killer tests must fail (every rule has a test that would catch its loss). CI runs it."""
    _install(session, "hf", "group:tests")  # the model and video mutants' killers need transformers
    session.run("python", "tests/mutants.py", *session.posargs)


@nox.session(python=PYTHON)
def explore(session: nox.Session) -> None:
    """Cancel-anywhere sweeps and 10,000 random schedules of each kind (a few minutes): every
    broken invariant fails the session. Replay one seed with
    ``nox -s explore -- --explore-seed N``."""
    _install(session, "group:tests")
    session.run(
        "pytest",
        "tests/test_explore.py",
        "--explore-count=10000",
        "--show-capture=no",  # a failure's report is its schedule, not thousands of log lines
        *session.posargs,
    )


@nox.session(python=PYTHON, default=False)
def sglang(session: nox.Session) -> None:
    """SGLang 0.5.23's own receiver code (its tokenizer's dispatch, each TP rank's
    ``WaitingRDMARequest`` with its Mooncake engine and pool) against two real servers of a
    tiny Qwen2.5-VL, TP=2 and TP=4: one image, several, two parts on two servers, pulls before
    /encode, a bad image, a bad image in one of two parts, an image and a video on two servers,
    two videos and an image, a bad video beside an image; then of a tiny Qwen2-Audio: one
    clip, three clips on two servers, pulls before /encode, a bad clip beside a good one. Every
    request must complete with the bytes /encode's checksum names and its grids, video
    metadata and clip lengths, or abort at once with our error. ``-- 2`` runs TP=2 only."""
    _install(session, "mooncake", "group:sglang")
    session.install("--no-deps", "sglang==0.5.23")
    session.run(
        "python",
        "tests/sglang/drive.py",
        *session.posargs,
        env={
            "PYTHONPATH": "tests/sglang/stubs",  # torchvision: see tests/sglang/drive.py
            "MOONCAKE_PROTOCOL": "tcp",
            "MC_LOG_LEVEL": "ERROR",
            "PYTHONWARNINGS": "ignore",
        },
    )


@nox.session(python=PYTHON, default=False)
def video_processor(session: nox.Session) -> None:
    """The video path against transformers' own video processors (the ``video_processor``
    marker). They import torchvision, whose index wheels link CUDA torch and do not load with
    constraints.txt's CPU torch: this session installs the index's torch 2.14.1 with its
    torchvision 0.29.1 (about 5.8 GB installed; about a minute from local wheels), without the
    constraints file."""
    session.install("torch==2.14.1", "torchvision==0.29.1")
    session.install(".[hf]", *nox.project.dependency_groups(PYPROJECT, "tests"))
    session.run(
        "pytest",
        "-m",
        "video_processor",
        "tests/test_encoder_vlm_video.py",
        "tests/test_encoder_vlm_video_square.py",
        "tests/test_encoder_vlm_video_omni.py",
        *session.posargs,
    )


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
    """``trio-encode bench``: served /send against raw Mooncake transfers and an asyncio peer,
    /encode against the raw forward, a /health probe and peak RSS (several minutes on 2 cores;
    run it on an idle machine), then the HTTP calls per route against hypercorn's floor and an
    SGLang-style server, then the modelled RDMA run. Arguments after ``--`` go to the measured
    commands, e.g. ``nox -s bench -- --json`` or ``-- --baseline ../old-tree``."""
    _install(session, "mooncake", "bench")
    session.run("trio-encode", "bench", *session.posargs)
    # Again with a core left to the event loop, decoding and transfers: on small hosts this
    # is the configuration where the serving path's share of the machine shows.
    spare = str(max(1, (os.cpu_count() or 2) - 1))
    session.run("trio-encode", "bench", "--torch-threads", spare, *session.posargs)
    session.run("trio-encode", "bench", "--http", *session.posargs)
    session.run("trio-encode", "bench", "--cost-model", "rdma")


@nox.session(python=PYTHON)
def simulate(session: nox.Session) -> None:
    """Cache hit rate against fleet size, content-affinity vs random routing, with and without
    the store, under Zipf popularity; redraws the plot in docs/ (about 20 s)."""
    _install(session, "group:simulate")
    session.run(
        "python",
        "-m",
        "trio_encode.tools.bench.routing_sim",
        "--plot",
        "docs/img/routing_hit_rate.png",
    )


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site into ``docs/_build/html``, offline, every warning an error
    (a broken link, a docstring Sphinx cannot parse, a reference that resolves nowhere).
    Arguments after ``--`` go to ``sphinx-build``."""
    _install(session, "group:docs")
    session.run(
        "sphinx-build",
        "-E",  # read every page afresh: a page generated by an extension has no file to date
        "-W",
        "--keep-going",
        "-n",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
    )
