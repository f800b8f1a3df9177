"""The request pixel budget (``max_request_pixels``) counts fetched ``http(s)`` images with the
inline ones, from their headers, before any image is decoded.

A budget that counted only data URIs would let a request of small inline images and large
URLs (or URLs alone) hold the decode threads for as long as it likes: the limit exists so one
request cannot. Here the request's data URIs alone fit; its URL images push it over, and it is
refused without a single image decoded (a spy on Pillow's pixel decoding and on the model's
decode counts every decode; a request that fits shows the spies see them).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from PIL import ImageFile

from support.engines import RankEngines
from support.fake_encoder import FakeBackend, inline
from support.harness import http_server
from support.web_server import WebServer, web_server
from trio_encode.encoder import ImageEncoder
from trio_encode.encoder.backend import Prepared
from trio_encode.encoder.settings import EncoderSettings
from trio_encode.errors import InvalidInput
from trio_encode.testing.images import image_uri, solid_image

BUDGET = 200
"""max_request_pixels: two 8x8 inline images (128) fit, with a 10x10 URL image (228) not."""
INLINE = [image_uri(solid_image(8, 8, (40, 0, 0))), image_uri(solid_image(8, 8, (80, 0, 0)))]
SETTINGS = EncoderSettings(
    warmup=False,
    cache_bytes=0,
    max_request_pixels=BUDGET,
    remote_fetch=True,
    remote_private_networks=("127.0.0.0/8",),
)


class Decodes:
    """Counts every pixel decode: Pillow's (``ImageFile.load``, which reading a header never
    calls) and the model's own ``decode``."""

    def __init__(self) -> None:
        self.pillow = 0
        self.model = 0

    @property
    def total(self) -> int:
        return self.pillow + self.model


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Decodes:
    counts = Decodes()
    real_load = ImageFile.ImageFile.load

    def counting_load(self: ImageFile.ImageFile) -> Any:
        counts.pillow += 1
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    return counts


def spy_on_model(encoder: ImageEncoder, counts: Decodes) -> None:
    real_decode = encoder.model.decode

    def counting_decode(data: bytes, *, max_pixels: int) -> Prepared:
        counts.model += 1
        return real_decode(data, max_pixels=max_pixels)

    encoder.model.decode = counting_decode  # type: ignore[method-assign]


def serve_images(web: WebServer) -> None:
    web.routes["/big.png"] = (200, {"Content-Type": "image/png"}, solid_image(10, 10, (0, 90, 0)))
    web.routes["/a.png"] = (200, {"Content-Type": "image/png"}, solid_image(6, 6, (0, 0, 50)))
    web.routes["/b.png"] = (200, {"Content-Type": "image/png"}, solid_image(6, 6, (0, 0, 60)))
    web.routes["/c.png"] = (200, {"Content-Type": "image/png"}, solid_image(1, 1, (0, 0, 70)))


def test_the_inline_images_alone_fit_the_budget() -> None:
    """The premise: without the URLs, these requests are within the budget."""
    assert 2 * 8 * 8 <= BUDGET < 2 * 8 * 8 + 10 * 10
    assert BUDGET == 2 * 8 * 8 + 2 * 6 * 6


@pytest.mark.parametrize(
    ("order", "over_at"),
    [
        (["inline0", "inline1", "/big.png"], 2),  # the URL is the one over
        (["/big.png", "inline0", "inline1"], 2),  # an inline image is over, thanks to the URL
        (["inline0", "/a.png", "inline1", "/b.png", "/c.png"], 4),  # one pixel over, by URLs
    ],
)
async def test_urls_count_toward_the_pixel_budget_and_nothing_is_decoded(
    decodes: Decodes, order: list[str], over_at: int
) -> None:
    encoder = ImageEncoder(FakeBackend(), SETTINGS, run_decode=inline, run_forward=inline)
    spy_on_model(encoder, decodes)
    async with web_server() as web:
        serve_images(web)
        items = [
            INLINE[int(name[-1])] if name.startswith("inline") else web.url(name) for name in order
        ]
        async with trio.open_nursery() as nursery:
            await nursery.start(encoder.run)
            with trio.fail_after(30):
                await encoder.load_items([item for item in items if item in INLINE])
                with pytest.raises(InvalidInput) as refused:
                    await encoder.load_items(items)
            nursery.cancel_scope.cancel()
        fetched = [path for path, _host in web.requests]
    assert refused.value.message == (
        f"mm_items[{over_at}]: the request's images have more than {BUDGET} pixels together "
        "(max_request_pixels)"
    )
    urls = [name for name in order[: over_at + 1] if not name.startswith("inline")]
    assert fetched == urls, "the URLs up to the one over were fetched (read from their headers)"
    assert decodes.total == 0, "no image was decoded"


async def test_a_request_exactly_at_the_budget_is_loaded_and_then_decoded(
    decodes: Decodes,
) -> None:
    """The control: the same mix at the budget is loaded, and encoding it decodes every image
    (the spies see decodes when there are any)."""
    encoder = ImageEncoder(FakeBackend(), SETTINGS, run_decode=inline, run_forward=inline)
    spy_on_model(encoder, decodes)
    async with web_server() as web:
        serve_images(web)
        items = [INLINE[0], web.url("/a.png"), INLINE[1], web.url("/b.png")]
        async with trio.open_nursery() as nursery:
            await nursery.start(encoder.run)
            with trio.fail_after(30):
                images = await encoder.load_items(items)
                assert decodes.total == 0, "loading reads headers only"
                rows = (await encoder.encode(images)).tensor
            nursery.cancel_scope.cancel()
    assert [int(row[0]) for row in rows[::2]] == [40, 0, 80, 0]
    assert decodes.model == 4
    assert decodes.pillow >= 4


async def test_over_http_a_mix_over_the_budget_is_a_400_that_leaves_nothing(
    rank_engines: RankEngines, decodes: Decodes
) -> None:
    encoder = ImageEncoder(FakeBackend(), SETTINGS)
    async with (
        web_server() as web,
        http_server(rank_engines.server, encoder=encoder, shutdown_grace=0) as harness,
    ):
        serve_images(web)
        spy_on_model(encoder, decodes)
        items = [*INLINE, web.url("/big.png")]
        async with httpx.AsyncClient(base_url=harness.running.url, timeout=30) as http:
            answer = await http.post("/encode", json={"req_id": "mix", "mm_items": items})
            assert answer.status_code == 400
            body = answer.json()
            assert (body["error"], body["req_id"]) == ("invalid_input", "mix")
            assert body["message"] == (
                f"mm_items[2]: the request's images have more than {BUDGET} pixels together "
                "(max_request_pixels)"
            )
            # Bad input leaves nothing: the inline images alone are a fresh request.
            fits = await http.post(
                "/encode", json={"req_id": "mix", "mm_items": INLINE, "receive_count": 1}
            )
            assert fits.status_code == 200, fits.text
        assert decodes.model == 2, "only the request that fits was decoded"
        assert web.requests == [("/big.png", f"127.0.0.1:{web.port}")]
        service = harness.running.service
        assert service.registry.live("mix") is not None
        await service.shutdown()
        await harness.settled()
