"""deploy/ holds what the server is: the containers install what the docs install, the probes
name routes the app serves on the port it listens on, the manifest's flags and variables are
settings, and every dashboard query names metrics the server exports.

Docker is not on these machines, so the Dockerfiles are checked by reading them: their install
step against the docs' set-up blocks, their health checks against the app's URL map and the
default port.
"""

from __future__ import annotations

import html
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from test_docs_consistency import blocks, command_lines, exported_metrics, served_routes
from trio_encode.cli import cli
from trio_encode.observer import METRIC_PREFIX
from trio_encode.server.metrics import Exposed, _Metric
from trio_encode.settings import ServerSettings, catalog

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DEFAULTS = ServerSettings.exactly()


# -- the containers ------------------------------------------------------------------------


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuations joined, comments dropped."""
    joined = re.sub(r"\\\n(?:\s*#[^\n]*\n)*", " ", dockerfile)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def pip_installs(commands: list[list[str]]) -> list[tuple[str, ...]]:
    """The arguments of each ``pip install`` among ``commands``, pip's own options dropped."""
    installs = []
    for tokens in commands:
        if "pip" in (Path(t).name for t in tokens[:1]) and tokens[1:2] == ["install"]:
            installs.append(tuple(t for t in tokens[2:] if t not in {"--no-cache-dir", "-q"}))
    return installs


def dockerfile_installs(name: str) -> list[tuple[str, ...]]:
    runs = [rest for word, rest in instructions((DEPLOY / name).read_text()) if word == "RUN"]
    return pip_installs([c for run in runs for c in command_lines(run)])


def docs_installs(page: str, heading: str) -> list[tuple[str, ...]]:
    """The ``pip install`` arguments of the shell blocks under ``heading`` of ``page``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    section = text.split(heading, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    found = [b for b in blocks(page, section) if b.lang == "bash"]
    return pip_installs([c for b in found for c in command_lines(b.body)])


@pytest.mark.parametrize(
    ("dockerfile", "page", "heading"),
    [
        ("Dockerfile", "README.md", "## Set-up: two commands"),
        ("Dockerfile.cuda", "docs/sglang.md", "### Installing on a GPU host"),
    ],
)
def test_a_container_installs_what_the_docs_install(
    dockerfile: str, page: str, heading: str
) -> None:
    documented = docs_installs(page, heading)
    assert len(documented) == 1, documented
    assert dockerfile_installs(dockerfile) == documented
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (target,) = [arg for arg in documented[0] if arg.startswith(".[")]
    assert set(target[2:-1].split(",")) <= set(extras), target


def test_the_install_comparison_sees_a_different_extra() -> None:
    cpu = pip_installs(list(command_lines("pip install -c constraints.txt '.[mooncake]'")))
    gpu = pip_installs(list(command_lines("pip install --no-cache-dir '.[mooncake-cuda]'")))
    assert cpu == [("-c", "constraints.txt", ".[mooncake]")]
    assert gpu == [(".[mooncake-cuda]",)]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_a_container_is_multi_stage_non_root_and_checks_a_real_probe(dockerfile: str) -> None:
    steps = instructions((DEPLOY / dockerfile).read_text())
    words = [word for word, _ in steps]
    assert words.count("FROM") >= 2, "multi-stage: the build stage's tools stay behind"
    final = steps[len(words) - 1 - words[::-1].index("FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users, "the runtime stage sets a user"
    assert users[-1] not in {"root", "0"}
    (health,) = [rest for word, rest in final if word == "HEALTHCHECK"]
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/[a-z_]+)", health)
    assert url is not None, health
    assert int(url.group(1)) == DEFAULTS.port
    assert url.group(2) in served_routes()
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert f"TRIO_ENCODE_PORT={DEFAULTS.port}" in env
    assert ("EXPOSE", str(DEFAULTS.port)) in final
    assert [rest for word, rest in final if word == "ENTRYPOINT"] == ['["trio-encode"]']


# -- the manifest --------------------------------------------------------------------------


def manifest() -> dict[str, dict[str, Any]]:
    """The manifest's documents by kind."""
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    return {document["kind"]: document for document in documents}


def test_the_manifest_wires_the_probes_to_the_real_routes_and_port() -> None:
    kinds = manifest()
    assert {"Deployment", "Service"} <= set(kinds)
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": DEFAULTS.port}
    probes = {
        "livenessProbe": "/livez",  # never 503 while loading or draining: no restart mid-drain
        "readinessProbe": "/readyz",  # 503 while loading and draining: out of the Service
    }
    for probe, route in probes.items():
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"]) == (route, "http"), probe
        assert route in served_routes()
    (service_port,) = kinds["Service"]["spec"]["ports"]
    assert service_port["targetPort"] == "http"
    assert (
        kinds["Service"]["spec"]["selector"]
        == kinds["Deployment"]["spec"]["selector"]["matchLabels"]
    )
    assert pod["terminationGracePeriodSeconds"] > DEFAULTS.service.shutdown_grace
    resources = container["resources"]
    assert resources["requests"]["cpu"]
    assert resources["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_the_manifests_flags_and_variables_are_settings() -> None:
    (container,) = manifest()["Deployment"]["spec"]["template"]["spec"]["containers"]
    command, *args = container["args"]
    assert command == "serve"
    serve = cli.commands["serve"]
    parsed = serve.make_context("serve", list(args), resilient_parsing=True)
    assert parsed.params["model"] == args[args.index("--model") + 1]
    variables = {entry.env for entry in catalog()}
    env = {item["name"]: item for item in container["env"]}
    assert set(env) <= variables, set(env) - variables
    assert env["TRIO_ENCODE_PORT"]["value"] == str(DEFAULTS.port)
    hostname = env["TRIO_ENCODE_ENGINE_HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert hostname == "status.podIP", "ranks reach the engine at the pod's own address"


def test_a_flag_serve_lacks_is_refused_by_the_manifest_check() -> None:
    import click

    with pytest.raises(click.NoSuchOption):
        cli.commands["serve"].make_context("serve", ["--no-such-flag", "1"])


# -- the dashboard -------------------------------------------------------------------------

PROMQL_WORDS = frozenset(
    {"sum", "by", "without", "rate", "increase", "histogram_quantile", "avg", "max", "min"}
)
"""The PromQL functions and aggregations the dashboard's queries use."""


def metric_labels() -> dict[str, frozenset[str]]:
    """Each declared metric's family name and its label names."""
    labels = {}
    for declared in vars(Exposed).values():
        if isinstance(declared, _Metric):
            name = METRIC_PREFIX + declared.name.removesuffix("_total")
            labels[name] = frozenset(declared.labels)
    return labels


def _family(sample: str, labels: dict[str, frozenset[str]]) -> str | None:
    for suffix in ("_bucket", "_sum", "_count", "_total", ""):
        if sample.endswith(suffix) and sample.removesuffix(suffix) in labels:
            return sample.removesuffix(suffix) if suffix else sample
    return None


def query_faults(expr: str, exported: frozenset[str]) -> list[str]:
    """What in ``expr`` the server does not export: metric names, and labels grouped by that
    none of its metrics carries."""
    bare = re.sub(r"\[[^\]]*\]|\{\{[^}]*\}\}|\$__\w+|\"[^\"]*\"", " ", expr)
    grouped = {
        label.strip()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", bare)
        for label in group.split(",")
        if label.strip()
    }
    names = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", bare)) - PROMQL_WORDS - grouped
    faults = sorted(f"metric {name}" for name in names if name not in exported)
    labels = metric_labels()
    carried = {"le"} if any(n.endswith("_bucket") for n in names) else set()
    for name in names:
        family = _family(name, labels)
        if family is not None:
            carried |= labels[family]
    faults += sorted(f"label {label}" for label in grouped - carried)
    if not names:
        faults.append("names no metric")
    return faults


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return loaded


def test_every_dashboard_query_names_only_what_the_server_exports() -> None:
    exported = exported_metrics()
    panels = dashboard()["panels"]
    assert len(panels) >= 10
    assert len({panel["id"] for panel in panels}) == len(panels)
    queried = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            faults = query_faults(target["expr"], exported)
            assert not faults, (panel["title"], target["expr"], faults)
            queried |= set(re.findall(r"\btrio_encode_\w+", target["expr"]))
    watched = {"trio_encode_live_registrations", "trio_encode_held_transfer_bytes"}
    assert watched <= queried, "the leak and the held memory are on the dashboard"


def test_a_made_up_metric_or_label_in_a_query_is_caught() -> None:
    exported = exported_metrics()
    assert query_faults("rate(trio_encode_made_up_total[5m])", exported) == [
        "metric trio_encode_made_up_total"
    ]
    assert query_faults("sum by (rank) (rate(trio_encode_requests_total[5m]))", exported) == [
        "label rank"
    ]
    assert query_faults("sum by (le) (rate(nonsense_bucket[5m]))", exported) == [
        "metric nonsense_bucket"
    ]
    assert query_faults("sum by (route) (rate(trio_encode_requests_total[5m]))", exported) == []


def test_the_dashboards_panels_do_not_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(box["x"], box["x"] + box["w"])
            for y in range(box["y"], box["y"] + box["h"])
        }
        assert not cells & taken, panel["title"]
        taken |= cells


def test_the_docs_show_the_dashboard() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    assert "](img/dashboard.svg)" in operations
    drawn = (ROOT / "docs" / "img" / "dashboard.svg").read_text(encoding="utf-8")
    for panel in dashboard()["panels"]:
        assert html.escape(panel["title"]) in drawn, panel["title"]
