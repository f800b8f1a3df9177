"""Probes, 503s that say when to retry, the access log and the metrics an operator reads."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry, Counter

from support.engines import RankEngines
from support.harness import http_server, landing_pools
from trio_encode.client import metric_value
from trio_encode.server.loading import LoadingEncoder
from trio_encode.server.metrics import Exposed, Metrics, _Metric, build_versions
from trio_encode.service import Encoder
from trio_encode.testing.images import image_uri
from trio_encode.testing.stand_in_encoder import StandInEncoder, embedding_size

ITEM = image_uri(b"probe image")


async def _until_status(http: httpx.AsyncClient, route: str, status: int) -> httpx.Response:
    """The first answer of ``route`` with ``status``, polled for up to 10 s."""
    for _ in range(500):
        response = await http.get(route)
        if response.status_code == status:
            return response
        await trio.sleep(0.02)
    raise AssertionError(f"{route} never answered {status}")


async def test_readyz_is_503_until_the_model_has_loaded_while_livez_answers(
    rank_engines: RankEngines,
) -> None:
    loaded = threading.Event()

    def load() -> Encoder:
        loaded.wait(timeout=30)  # a model that takes its time, in the loader's thread
        return StandInEncoder()

    loading = LoadingEncoder(load)
    async with (
        http_server(rank_engines.server, encoder=loading, shutdown_grace=0.1) as harness,
        httpx.AsyncClient(base_url=harness.running.url) as http,
    ):
        loading.start_loading()
        assert (await http.get("/livez")).json() == {"status": "ok"}
        for route in ("/readyz", "/health"):
            response = await http.get(route)
            assert response.status_code == 503
            assert response.json()["error"] == "not_ready"
            assert response.headers["Retry-After"] == "5"
        refused = await http.post("/encode", json={"req_id": "early", "mm_items": [ITEM]})
        assert (refused.status_code, refused.json()["error"]) == (503, "not_ready")
        assert refused.headers["Retry-After"] == "5"

        loaded.set()
        await _until_status(http, "/readyz", 200)
        assert (await http.get("/health")).status_code == 200
        encoded = await harness.client.encode("early", [ITEM])  # nothing was left by the 503
        assert encoded.embedding_size == embedding_size(1)
        await harness.running.service.shutdown()


async def test_draining_fails_readiness_but_not_liveness(rank_engines: RankEngines) -> None:
    async with (
        http_server(rank_engines.server, shutdown_grace=1.0) as harness,
        httpx.AsyncClient(base_url=harness.running.url) as http,
    ):
        await harness.client.encode("open", [ITEM], receive_count=2)  # keeps shutdown waiting
        harness.running.stop()
        ready = await _until_status(http, "/readyz", 503)
        assert (ready.status_code, ready.json()["error"]) == (503, "shutting_down")
        assert ready.headers["Retry-After"] == "5"
        assert (await http.get("/livez")).status_code == 200
        refused = await http.post("/encode", json={"req_id": "new", "mm_items": [ITEM]})
        assert (refused.status_code, refused.json()["error"]) == (503, "shutting_down")
        assert "Retry-After" in refused.headers


@pytest.mark.parametrize("enabled", [True, False])
async def test_one_access_log_line_per_answer(
    rank_engines: RankEngines, enabled: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="trio_encode.access"):
        async with (
            http_server(rank_engines.server, access_log=enabled, shutdown_grace=0.1) as harness,
            httpx.AsyncClient(base_url=harness.running.url) as http,
        ):
            await harness.client.encode("logged", [ITEM])
            await http.get("/nope")
            await harness.running.service.shutdown()
    lines = [r for r in caplog.records if r.name == "trio_encode.access"]
    if not enabled:
        assert lines == []
        return
    encode, missing = lines
    assert (encode.method, encode.path, encode.status, encode.req_id) == (  # type: ignore[attr-defined]
        "POST",
        "/encode",
        200,
        "logged",
    )
    assert encode.modality == "IMAGE"  # type: ignore[attr-defined]
    assert encode.bytes > 0  # type: ignore[attr-defined]
    assert encode.duration_ms >= 0  # type: ignore[attr-defined]
    assert (missing.path, missing.status, missing.req_id) == ("/nope", 404, None)  # type: ignore[attr-defined]
    assert not hasattr(missing, "modality")


async def test_metrics_time_each_route_and_scope_and_name_the_build(
    rank_engines: RankEngines,
) -> None:
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, 2 * embedding_size(1)) as pools,
    ):
        await harness.client.encode("m", [ITEM])
        await harness.client.send("m", pools[0].session_id, pools[0].address)
        text = await harness.settled()
    count = "request_seconds_count"
    assert metric_value(text, count, route="/encode") == 1
    assert metric_value(text, count, route="/send") == 1
    assert metric_value(text, "scope_seconds_count", reason="completed") == 1
    assert metric_value(text, "encoder_queue_images") == 0
    versions = build_versions()
    assert versions["mooncake"] != "none"
    assert versions["torch"] != "none"
    assert metric_value(text, "build_info", **versions) == 1
    assert "process_cpu_seconds_total" in text
    assert "python_info" in text
    assert "python_gc_objects_collected_total" in text
    assert "_created" not in text


def test_the_queue_depth_gauge_reads_the_encoder() -> None:
    class Queued(StandInEncoder):
        queued_images = 3

    metrics = Metrics()
    metrics.timed(Queued())
    text = metrics.render().decode()
    assert metric_value(text, "encoder_queue_images") == 3


def test_each_registration_call_is_timed_into_its_own_histogram() -> None:
    metrics = Metrics()
    metrics.registration_timed("register", 0.001)
    metrics.registration_timed("deregister", 0.002)
    metrics.registration_timed("deregister", 0.003)
    text = metrics.render().decode()
    assert metric_value(text, "register_seconds_count") == 1
    assert metric_value(text, "deregister_seconds_count") == 2


def test_a_metric_is_an_attribute_so_a_misspelt_name_fails() -> None:
    metrics = Metrics()
    assert metrics.exposed.requests_total is metrics.exposed.requests_total
    with pytest.raises(AttributeError):
        metrics.exposed.request_total  # type: ignore[attr-defined]  # noqa: B018


def test_a_metrics_help_is_its_attributes_docstring_and_none_goes_without() -> None:
    text = Metrics().render().decode()
    assert (
        "# HELP trio_encode_held_transfers Sends whose memory is held out of reuse because a "
        "transfer the engine stopped waiting for may still read it.\n" in text
    ), "a docstring over two lines is one line of help"

    class Undocumented(Exposed):
        forgotten = _Metric(Counter)

    with pytest.raises(TypeError, match="forgotten is declared without a docstring"):
        Undocumented(CollectorRegistry())
