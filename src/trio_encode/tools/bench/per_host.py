"""What the per-host bound costs one host: ``python -m trio_encode.tools.bench.per_host``.

``trio-encode bench``'s ``/send`` rows keep at most one send per rank in flight (each rank
sends every ``req_id`` in turn), so with TP=4 or 8 the bound per receiver host
(``--engine-sends-per-host``) never binds there. This drives the engine directly instead: TP
receiver processes on one host (the soak's, each with its own Mooncake engine), and
``in_flight`` sends of one 1.6 MB embedding kept in flight to them together, each send
repeated ``sends`` times, for each bound in turn (alternating, ``rounds`` times). It prints
the bytes moved per second and the median time of one send.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import AsyncExitStack

import numpy as np
import trio

from trio_encode.engine import Write
from trio_encode.engine.mooncake import MooncakeEngine, MooncakeSettings
from trio_encode.tools.soak.receiver import open_receiver

NBYTES = 1_597_440
"""One built-in-ViT image's embedding."""


async def measure(bound: int, tp: int, in_flight: int, sends: int) -> tuple[float, float]:
    """``(GB/s, median seconds of one send)`` with ``--engine-sends-per-host bound``."""
    engine = await MooncakeEngine.create(MooncakeSettings(sends_per_host=bound))
    source = np.ones(NBYTES, dtype=np.uint8)
    address = int(source.ctypes.data)
    await engine.register(address, NBYTES)
    per_rank = -(-in_flight // tp)
    took: list[float] = []
    async with AsyncExitStack() as stack:
        ranks = [
            await stack.enter_async_context(open_receiver(per_rank * NBYTES, f"rank{r}"))
            for r in range(tp)
        ]
        for rank in ranks:  # first contact (a probe and a handshake) outside the clock
            await engine.transfer(Write(rank.session_id, [(address, NBYTES)], rank.address))

        async def sender(k: int) -> None:
            rank = ranks[k % tp]
            slot = rank.address + (k // tp) * NBYTES
            for _ in range(sends):
                began = time.perf_counter()
                await engine.transfer(Write(rank.session_id, [(address, NBYTES)], slot))
                took.append(time.perf_counter() - began)

        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for k in range(in_flight):
                nursery.start_soon(sender, k)
        seconds = time.perf_counter() - began
    await engine.deregister(address)
    return in_flight * sends * NBYTES / seconds / 1e9, statistics.median(took)


async def main(bounds: list[int], tps: list[int], in_flight: int, sends: int, rounds: int) -> None:
    for index in range(rounds):
        for tp in tps:
            for bound in bounds:
                rate, median = await measure(bound, tp, in_flight, sends)
                print(
                    f"round {index} TP={tp} {in_flight} in flight, sends-per-host {bound}: "
                    f"{rate:.2f} GB/s, median send {median * 1000:.1f} ms",
                    flush=True,
                )


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bounds", type=_ints, default=[16, 32])
    parser.add_argument("--tps", type=_ints, default=[4, 8])
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--sends", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    trio.run(main, args.bounds, args.tps, args.in_flight, args.sends, args.rounds)
