"""``trio-encode demo``: a real server, TP real receivers, every landed byte checked.

It is the smallest complete deployment, run as a client scenario: the built-in encoder, one
Mooncake engine for the server and one per prefill rank (each with its own registered landing
pool), over TCP on loopback. Every rank calls ``/encode`` and ``/send`` for every request at
once, as TP ranks do; afterwards every rank's copy must equal, byte for byte, the embedding
the model computes directly (one image at a time, no server, no batching), and the server must
hold no registration.

Progress goes to stderr while it runs (each step says what it waits for); the final table
goes to stdout. Only the demo's settings are imported with this module (``trio-encode demo
--help`` reads them); torch, the server and the client load when the demo runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic.dataclasses import dataclass as settings_dataclass

from trio_encode.declare import SETTINGS, in_group
from trio_encode.settings import LogLevel

if TYPE_CHECKING:
    import torch
    from rich.table import Table

    from trio_encode.client import EncodeClient, EncodeResult, LandingSlot
    from trio_encode.encoder import ImageEncoder
    from trio_encode.settings import ServerSettings
    from trio_encode.tools.progress import Steps

demo_setting = in_group("demo")


@settings_dataclass(frozen=True, config=SETTINGS)
class DemoSettings:
    """The demo's own knobs (the model and engine are the server's settings)."""

    requests: int = demo_setting(8, gt=0)
    """Requests to run."""
    images: int = demo_setting(2, gt=0)
    """Images per request."""
    tp: int = demo_setting(4, gt=0)
    """Receiving prefill ranks."""
    log_level: LogLevel = demo_setting("WARNING")
    """Least severe of the server's log lines shown (the progress display and the final table are
    the demo's own output)."""
    progress: bool = demo_setting(True)
    """Show progress on stderr while the demo runs."""


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
    copies_checked: int = 0
    cut_short: int = 0
    failures: list[str] = field(default_factory=list)
    engines: list[object] = field(default_factory=list, repr=False)
    """The demo's Mooncake engines, alive until the caller lets go. Mooncake has no close():
    dropping an engine stops its threads, about a second each, one at a time (the GIL is
    held), so the command line exits without waiting for that."""

    @property
    def ok(self) -> bool:
        return not self.failures

    def table(self) -> Table:
        """The result as a table: what moved, how fast, what the server held afterwards."""
        from rich.table import Table

        rate = self.bytes_moved / self.seconds / 1e6 if self.seconds else 0.0
        table = Table(title="trio-encode demo", show_header=True, title_justify="left")
        table.add_column("what")
        table.add_column("value", justify="right")
        table.add_row("requests x ranks", f"{self.requests} x {self.tp}")
        table.add_row("bytes moved", f"{self.bytes_moved / 1e6:.1f} MB")
        table.add_row("time (encoding included)", f"{self.seconds:.2f} s")
        table.add_row("throughput", f"{rate:.0f} MB/s")
        table.add_row("copies equal to the model's output", f"{self.copies_checked}")
        if self.arena:
            table.add_row("the arena, registered once", "yes")
            table.add_row("requests outside the arena", f"{self.fallbacks:.0f}")
        table.add_row("registrations made by requests", f"{self.registrations:.0f}")
        table.add_row("registrations released by requests", f"{self.deregistrations:.0f}")
        table.add_row("registrations live at the end", f"{self.live_registrations:.0f}")
        table.add_row("requests cut short at shutdown", f"{self.cut_short}")
        return table

    def verdict(self) -> str:
        lines = [f"FAILED: {failure}" for failure in self.failures]
        lines.append("OK: every byte checked" if self.ok else "demo FAILED")
        return "\n".join(lines)


async def run_demo(settings: ServerSettings, config: DemoSettings) -> DemoOutcome:
    """Run the demo; prints progress (unless switched off) and the final table."""
    from rich.console import Console

    from trio_encode.tools.progress import Steps

    with Steps(config.progress) as steps:
        outcome = await _run(settings, config, steps)
    console = Console()
    console.print(outcome.table())
    console.print(outcome.verdict(), highlight=False)
    return outcome


async def _run(settings: ServerSettings, config: DemoSettings, steps: Steps) -> DemoOutcome:
    from contextlib import AsyncExitStack
    from functools import partial

    import trio

    from trio_encode.client import EncodeClient, LandingPool, metric_value
    from trio_encode.encoder import ImageEncoder
    from trio_encode.engine.mooncake import MooncakeEngine
    from trio_encode.errors import RequestError
    from trio_encode.server.metrics import Metrics
    from trio_encode.server.serve import open_server
    from trio_encode.testing.images import noise_uri

    requests, images, tp = config.requests, config.images, config.tp
    outcome = DemoOutcome(requests, tp)
    metrics = Metrics()
    with steps.step(f"starting {tp + 1} Mooncake engines (server + ranks)", tp + 1) as done:
        engine = await MooncakeEngine.create(settings.engine)
        done()
        ranks = []
        for _ in range(tp):
            ranks.append(await MooncakeEngine.create(settings.engine))
            done()
    outcome.engines += [engine, *ranks]
    with steps.step("loading the model and running one warm-up forward"):
        encoder = await trio.to_thread.run_sync(
            partial(ImageEncoder.from_settings, settings.encoder, observer=metrics)
        )
    if encoder.info.bytes_per_image is None:
        raise ValueError("the demo needs a model with one token count per image")
    per_request = images * encoder.info.bytes_per_image
    items = [[noise_uri(req * images + i, 224) for i in range(images)] for req in range(requests)]
    answers: dict[tuple[int, int], tuple[EncodeResult, LandingSlot]] = {}

    async with AsyncExitStack() as stack:
        running = await stack.enter_async_context(
            open_server(settings, engine=engine, encoder=encoder, metrics=metrics)
        )
        pools = [
            await stack.enter_async_context(LandingPool.open(rank, requests * per_request + 4096))
            for rank in ranks
        ]
        client = await stack.enter_async_context(EncodeClient(running.url, token=settings.token))

        with steps.step(f"/encode + /send from {tp} ranks", requests * tp) as sent:

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
                sent()

            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for req in range(requests):
                    for r in range(tp):
                        nursery.start_soon(rank_request, req, r)
            outcome.seconds = trio.current_time() - started
        with steps.step("checking every rank's bytes against the model's own", requests) as one:
            for req in range(requests):
                expected = await trio.to_thread.run_sync(_direct_embedding, encoder, items[req])
                _check(req, tp, per_request, expected, answers, outcome)
                one()
        with steps.step("waiting for every scope to release its registration"):
            outcome.arena = encoder.arena is not None
            text = await _settled(client, arena=int(outcome.arena))
        outcome.registrations = metric_value(text, "registrations_total")
        outcome.deregistrations = metric_value(text, "deregistrations_total")
        outcome.live_registrations = metric_value(text, "live_registrations") - outcome.arena
        outcome.fallbacks = metric_value(text, "arena_fallbacks")
        outcome.bytes_moved = int(metric_value(text, "transfer_bytes_total"))
        # The rest runs as the stack unwinds: the client's connections close, each rank
        # deregisters its pool, and the server stops.
        teardown = steps.begin("stopping the server and closing the landing pools")
    steps.finish(teardown)
    report = running.service.shutdown_report
    outcome.cut_short = report.cut_short if report is not None else 0
    # Rows are sent as they lie, each image's registered on its own unless it lies in the
    # arena (whose own registration is counted apart). With the arena: for each request that
    # did not fit, its rows outside it (one to all of them); without: every image of every
    # request.
    if outcome.arena:
        least, most = outcome.fallbacks, outcome.fallbacks * images
    else:
        least = most = requests * images
    if not least <= outcome.registrations <= most:
        wanted = f"{least:.0f}" if least == most else f"{least:.0f} to {most:.0f}"
        outcome.failures.append(
            f"{outcome.registrations:.0f} registrations for {requests} requests "
            f"of {images} images (expected {wanted})"
        )
    if outcome.live_registrations or running.service.ledger.live_registrations:
        outcome.failures.append("registrations were still held after the requests ended")
    return outcome


def _direct_embedding(encoder: ImageEncoder, items: list[str]) -> torch.Tensor:
    """The request's embedding as the model computes it alone, image by image, as raw bytes."""
    import torch

    from trio_encode.encoder import load_item

    settings = encoder.settings
    rows = []
    for item in items:
        data = load_item(item, max_bytes=settings.max_image_bytes)
        image = encoder.model.decode(data, max_pixels=settings.max_image_pixels)
        with torch.inference_mode():
            rows.append(encoder.model.encode([image])[0].to("cpu"))
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
    import torch

    from trio_encode.embedding import TORCH_DTYPES

    copies = [answers[req, r] for r in range(tp) if (req, r) in answers]
    if len(copies) != tp:
        return  # already reported
    first, _ = copies[0]
    itemsize = TORCH_DTYPES[first.dtype].itemsize
    if first.embedding_size != per_request or first.embedding_size != (
        first.embedding_len * first.embedding_dim * itemsize
    ):
        outcome.failures.append(f"demo-{req}: answer's size {first.embedding_size} is off")
        return
    for r, (_, slot) in enumerate(copies):
        if torch.equal(slot.raw()[: first.embedding_size], expected):
            outcome.copies_checked += 1
        else:
            outcome.failures.append(f"demo-{req}: rank {r}'s copy differs from the model's output")


async def _settled(client: EncodeClient, *, arena: int) -> str:
    """/metrics once every scope has released, leaving only the ``arena`` registration (or
    after 5 s, to report what is still held)."""
    import trio

    from trio_encode.client import metric_value

    text = await client.metrics()
    with trio.move_on_after(5):
        while metric_value(text, "live_scopes") or metric_value(text, "live_registrations") > arena:
            await trio.sleep(0.02)
            text = await client.metrics()
    return text
