"""``trio-encode demo``: a real server, TP real receivers, every landed byte checked.

It is the smallest complete deployment: the built-in encoder, one Mooncake engine for the
server and one per prefill rank (each with its own registered landing pool), over TCP on
loopback. Every rank calls ``/encode`` and ``/send`` for every request at once, as TP ranks
do; afterwards every rank's copy must equal, byte for byte, the embedding the model computes
directly (one image at a time, no server, no batching), and the server must hold no
registration.
"""

from __future__ import annotations

import base64
import io
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import trio
from PIL import Image

from trio_encode.client import EncodeClient, EncodeResult, LandingPool, LandingSlot, metric_value
from trio_encode.encoder import ImageEncoder, decode_image, load_item
from trio_encode.errors import RequestError
from trio_encode.server.metrics import Metrics
from trio_encode.server.serve import open_server
from trio_encode.settings import ServerSettings

P = "trio_encode_"


@dataclass
class DemoOutcome:
    """What the demo did and whether every check passed."""

    requests: int
    tp: int
    bytes_moved: int = 0
    seconds: float = 0.0
    registrations: float = 0.0
    deregistrations: float = 0.0
    live_registrations: float = 0.0
    """Besides the arena's, which lives as long as the server."""
    arena: bool = False
    fallbacks: float = 0.0
    """Requests that did not fit in the arena and registered their own memory."""
    cut_short: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        rate = self.bytes_moved / self.seconds / 1e6 if self.seconds else 0.0
        arena = (
            f"the arena registered once, {self.fallbacks:.0f} requests outside it; "
            if self.arena
            else ""
        )
        lines = [
            f"{self.requests} requests x {self.tp} ranks: {self.bytes_moved / 1e6:.1f} MB moved "
            f"in {self.seconds:.2f} s ({rate:.0f} MB/s, encoding included)",
            f"{arena}registrations made {self.registrations:.0f}, released "
            f"{self.deregistrations:.0f}, live at the end {self.live_registrations:.0f}; "
            f"{self.cut_short} requests cut short at shutdown",
        ]
        lines += [f"FAILED: {failure}" for failure in self.failures]
        lines.append("OK: every byte checked" if self.ok else "demo FAILED")
        return "\n".join(lines)


def demo_image(seed: int, side: int = 224) -> str:
    """A noise PNG as a data URI; a different image for every seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def run_demo(settings: ServerSettings, requests: int, images: int, tp: int) -> DemoOutcome:
    from trio_encode.engine.mooncake import MooncakeEngine

    outcome = DemoOutcome(requests, tp)
    metrics = Metrics()
    engine = await MooncakeEngine.create(settings.engine)
    encoder = await trio.to_thread.run_sync(
        partial(ImageEncoder.from_settings, settings.encoder_settings(), observer=metrics)
    )
    per_request = images * encoder.info.bytes_per_image
    ranks = [await MooncakeEngine.create(settings.engine) for _ in range(tp)]
    items = [[demo_image(req * images + i) for i in range(images)] for req in range(requests)]
    answers: dict[tuple[int, int], tuple[EncodeResult, LandingSlot]] = {}

    async with AsyncExitStack() as stack:
        running = await stack.enter_async_context(
            open_server(settings, engine=engine, encoder=encoder, metrics=metrics)
        )
        pools = [
            await stack.enter_async_context(LandingPool.open(rank, requests * per_request + 4096))
            for rank in ranks
        ]
        client = await stack.enter_async_context(EncodeClient(running.url))

        async def rank_request(req: int, r: int) -> None:
            req_id = f"demo-{req}"
            try:
                encoded = await client.encode(req_id, items[req], receive_count=tp, part_idx=r)
                slot = pools[r].allocate(encoded.embedding_size)
                await client.send(req_id, pools[r].session_id, slot.address)
            except RequestError as exc:
                outcome.failures.append(f"{req_id} rank {r}: {type(exc).__name__}: {exc}")
            else:
                answers[req, r] = (encoded, slot)

        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for req in range(requests):
                for r in range(tp):
                    nursery.start_soon(rank_request, req, r)
        outcome.seconds = trio.current_time() - started
        for req in range(requests):
            expected = await trio.to_thread.run_sync(_direct_embedding, encoder, items[req])
            _check(req, tp, per_request, expected, answers, outcome)
        outcome.arena = encoder.arena is not None
        text = await _settled(client, arena=int(outcome.arena))
        outcome.registrations = metric_value(text, P + "registrations_total")
        outcome.deregistrations = metric_value(text, P + "deregistrations_total")
        outcome.live_registrations = metric_value(text, P + "live_registrations") - outcome.arena
        outcome.fallbacks = metric_value(text, P + "arena_fallbacks")
        outcome.bytes_moved = int(metric_value(text, P + "transfer_bytes_total"))
    report = running.service.shutdown_report
    outcome.cut_short = report.cut_short if report is not None else 0
    # With the arena: itself once, plus each request that did not fit; without: one a request.
    expected_registrations = 1 + outcome.fallbacks if outcome.arena else requests
    if outcome.registrations != expected_registrations:
        outcome.failures.append(
            f"{outcome.registrations:.0f} registrations for {requests} requests "
            f"(expected {expected_registrations:.0f})"
        )
    if outcome.live_registrations or running.service.ledger.live_registrations:
        outcome.failures.append("registrations were still held after the requests ended")
    return outcome


def _direct_embedding(encoder: ImageEncoder, items: list[str]) -> torch.Tensor:
    """The request's embedding as the model computes it alone, image by image, as raw bytes."""
    settings = encoder.settings
    rows = []
    for item in items:
        data = load_item(item, max_bytes=settings.max_image_bytes)
        pixels = decode_image(
            data, encoder.backend.preprocess, max_pixels=settings.max_image_pixels
        )
        with torch.inference_mode():
            rows.append(encoder.backend.forward(pixels.unsqueeze(0))[0])
    return torch.cat(rows).contiguous().view(torch.uint8).flatten()


def _check(
    req: int,
    tp: int,
    per_request: int,
    expected: torch.Tensor,
    answers: dict[tuple[int, int], tuple[EncodeResult, LandingSlot]],
    outcome: DemoOutcome,
) -> None:
    """Every rank's copy of one request equals the model's own output, byte for byte."""
    copies = [answers[req, r] for r in range(tp) if (req, r) in answers]
    if len(copies) != tp:
        return  # already reported
    first, _ = copies[0]
    itemsize = torch.empty((), dtype=getattr(torch, first.dtype)).element_size()
    if first.embedding_size != per_request or first.embedding_size != (
        first.embedding_len * first.embedding_dim * itemsize
    ):
        outcome.failures.append(f"demo-{req}: answer's size {first.embedding_size} is off")
        return
    for r, (_, slot) in enumerate(copies):
        if not torch.equal(slot.raw()[: first.embedding_size], expected):
            outcome.failures.append(f"demo-{req}: rank {r}'s copy differs from the model's output")


async def _settled(client: EncodeClient, *, arena: int) -> str:
    """/metrics once every scope has released, leaving only the ``arena`` registration (or
    after 5 s, to report what is still held)."""
    text = await client.metrics()
    with trio.move_on_after(5):
        while (
            metric_value(text, P + "live_scopes")
            or metric_value(text, P + "live_registrations") > arena
        ):
            await trio.sleep(0.02)
            text = await client.metrics()
    return text
