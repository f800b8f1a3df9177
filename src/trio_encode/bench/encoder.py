"""How much of the model's raw throughput the batching encoder delivers, in one run.

(a) the model's forward in a loop at batch size B; (b) :class:`ImageEncoder` under N concurrent
clients sending distinct PNGs (cache off, so every image is decoded and encoded). The ratio
served/raw is the cost of decoding, queueing and batching; a probe task sleeping 10 ms at a
time shows whether the event loop stays responsive while the model runs.

Run: ``python -m trio_encode.bench.encoder [--seconds 15] [--batch-size 8] [--concurrency 16]``
(about 30 s with the defaults on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import io
import time
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import trio
from PIL import Image

from trio_encode.encoder import EncoderSettings, ImageEncoder, VisionBackend, load_backend


@dataclass(frozen=True)
class EncoderBenchResult:
    batch_size: int
    concurrency: int
    raw_images: int
    raw_seconds: float
    raw_spread: tuple[float, float]
    """Slowest and fastest raw images/s over the rounds (their gap shows the noise)."""
    served_images: int
    served_seconds: float
    mean_served_batch: float
    max_loop_lateness: float
    """Worst delay, in seconds, of a 10 ms trio.sleep on the event loop while serving."""
    p99_loop_lateness: float

    @property
    def raw_images_per_second(self) -> float:
        return self.raw_images / self.raw_seconds

    @property
    def served_images_per_second(self) -> float:
        return self.served_images / self.served_seconds

    @property
    def ratio(self) -> float:
        return self.served_images_per_second / self.raw_images_per_second

    def report(self) -> str:
        return (
            f"raw forward  B={self.batch_size}: {self.raw_images_per_second:8.2f} images/s "
            f"({self.raw_images} images in {self.raw_seconds:.2f} s; rounds ranged "
            f"{self.raw_spread[0]:.2f}..{self.raw_spread[1]:.2f})\n"
            f"served       N={self.concurrency}: {self.served_images_per_second:8.2f} images/s "
            f"({self.served_images} images in {self.served_seconds:.2f} s, "
            f"mean batch {self.mean_served_batch:.2f})\n"
            f"served/raw: {self.ratio:.3f}\n"
            f"event loop: lateness of a 10 ms sleep: worst {self.max_loop_lateness * 1000:.1f} ms, "
            f"p99 {self.p99_loop_lateness * 1000:.1f} ms"
        )


class _BatchSizes:
    """Observer that keeps the size of every batch."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def batch_finished(self, images: int, forward_seconds: float, ok: bool) -> None:
        self.sizes.append(images)

    def queue_waited(self, seconds: float) -> None:
        pass

    def cache_looked_up(self, hits: int, misses: int) -> None:
        pass

    def cache_size(self, nbytes: int, entries: int) -> None:
        pass

    def rejected(self, images: int) -> None:
        pass


def distinct_pngs(count: int, side: int) -> list[bytes]:
    """``count`` different noise PNGs of ``side`` x ``side`` pixels (seeded: the same every
    run). Noise does not compress, so decoding costs what a photo of that size costs."""
    generator = torch.Generator().manual_seed(1234)
    images = []
    for _ in range(count):
        array = torch.randint(0, 256, (side, side, 3), generator=generator, dtype=torch.uint8)
        buffer = io.BytesIO()
        Image.fromarray(array.numpy()).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return images


def measure_raw(backend: VisionBackend, batch_size: int, batches: int) -> tuple[int, float]:
    """Images and seconds for ``batches`` forwards at ``batch_size`` (after two warm-ups)."""
    side = backend.preprocess.image_size
    pixels = torch.randn(batch_size, 3, side, side, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        backend.forward(pixels)
    start = time.perf_counter()
    for _ in range(batches):
        backend.forward(pixels)
    return batch_size * batches, time.perf_counter() - start


def measure_raw_for(
    backend: VisionBackend, batch_size: int, seconds: float, *, warmups: int = 1
) -> tuple[int, float]:
    """Images and seconds of back-to-back forwards at ``batch_size`` for at least ``seconds``
    (at least one forward), after ``warmups`` untimed ones. Timed rather than counted so
    that raw and served phases weigh alike whatever the model's speed."""
    side = backend.preprocess.image_size
    pixels = torch.randn(batch_size, 3, side, side, generator=torch.Generator().manual_seed(0))
    for _ in range(warmups):
        backend.forward(pixels)
    start = time.perf_counter()
    images = 0
    while True:
        backend.forward(pixels)
        images += batch_size
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return images, elapsed


async def measure_served(
    backend: VisionBackend,
    settings: EncoderSettings,
    *,
    concurrency: int,
    seconds: float,
) -> tuple[int, float, list[int], list[float]]:
    """Images served, seconds, the batch sizes, and every event-loop lateness seen."""
    sizes = _BatchSizes()
    encoder = ImageEncoder(backend, settings, observer=sizes)
    images = distinct_pngs(concurrency, backend.preprocess.image_size)
    done = 0
    lateness: list[float] = []

    async def client(data: bytes) -> None:
        nonlocal done
        while True:
            await encoder.encode([data])
            done += 1

    async def probe() -> None:
        while True:
            before = trio.current_time()
            await trio.sleep(0.01)
            lateness.append(trio.current_time() - before - 0.01)

    async with trio.open_nursery() as nursery:
        await nursery.start(encoder.run)
        nursery.start_soon(probe)
        start = trio.current_time()
        for data in images:
            nursery.start_soon(client, data)
        await trio.sleep(seconds)
        served, elapsed = done, trio.current_time() - start
        nursery.cancel_scope.cancel()
    return served, elapsed, sizes.sizes[1:], lateness  # sizes[0] is the warm-up


def run_encoder_bench(
    settings: EncoderSettings | None = None,
    *,
    batch_size: int = 8,
    concurrency: int = 16,
    raw_batches: int = 2,
    served_seconds: float = 15.0,
    rounds: int = 3,
) -> EncoderBenchResult:
    """Measure raw and served throughput with one model instance (default: the built-in ViT).

    Raw and served phases alternate for ``rounds`` rounds (``served_seconds`` in all) and are
    pooled, so load from a neighbour that comes or goes during the run skews both alike.
    """
    base = settings if settings is not None else EncoderSettings()
    settings = replace(
        base,
        cache_bytes=0,
        max_batch_size=batch_size,
        queue_size=max(base.queue_size, concurrency),
        warmup=True,
    )
    backend = load_backend(settings)
    raw_images, raw_seconds, raw_rates = 0, 0.0, []
    served, elapsed, batches, lateness = 0, 0.0, [], []
    for _ in range(rounds):
        images, seconds = measure_raw(backend, batch_size, raw_batches)
        raw_images, raw_seconds = raw_images + images, raw_seconds + seconds
        raw_rates.append(images / seconds)
        round_result = trio.run(
            partial(
                measure_served,
                backend,
                settings,
                concurrency=concurrency,
                seconds=served_seconds / rounds,
            )
        )
        served, elapsed = served + round_result[0], elapsed + round_result[1]
        batches += round_result[2]
        lateness += round_result[3]
    return EncoderBenchResult(
        batch_size=batch_size,
        concurrency=concurrency,
        raw_images=raw_images,
        raw_seconds=raw_seconds,
        raw_spread=(min(raw_rates), max(raw_rates)),
        served_images=served,
        served_seconds=elapsed,
        mean_served_batch=sum(batches) / max(1, len(batches)),
        max_loop_lateness=max(lateness, default=0.0),
        p99_loop_lateness=sorted(lateness)[int(0.99 * (len(lateness) - 1))] if lateness else 0.0,
    )


def main(argv: list[str] | None = None) -> None:
    """Options left out take the defaults of :func:`run_encoder_bench` and of
    :class:`EncoderSettings`; none is restated here."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--raw-batches", type=int, help="raw batches per round")
    parser.add_argument("--served-seconds", type=float, help="served time, all rounds")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"))
    parser.add_argument("--torch-threads", type=int, help="torch.set_num_threads")
    parser.add_argument("--max-batch-wait", type=float)
    given = vars(parser.parse_args(argv))
    encoder = {k: given.pop(k) for k in ("dtype", "torch_threads", "max_batch_wait") if k in given}
    result = run_encoder_bench(EncoderSettings(**encoder), **given)
    print(result.report())
    print({**asdict(result), "ratio": round(result.ratio, 4)})


if __name__ == "__main__":
    main()
