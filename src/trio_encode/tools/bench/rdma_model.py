"""``trio-encode bench --cost-model rdma``: the arena against per-request registration, modelled.

Registration costs microseconds over TCP on loopback, so the measured rows cannot show what
it costs where it matters. This run puts the real request lifecycle (scope registry, ledger,
scopes, sends) on the in-memory engine with a cost model (:mod:`trio_encode.testing.costs`) and
Trio's mock clock, and counts requests per second of *virtual* time for both paths:

- **arena**: the embedding lies in an arena registered once before the clock starts; a
  request registers nothing;
- **per-request registration**: each request's embedding is its own memory, registered by
  its scope on the first send and deregistered when the last rank has sent (what SGLang does
  per ``req_id``).

TP ranks send every request in turn, as prefill ranks do; encoding takes no time here. The
numbers are a model's output, never a measurement, and are labelled so wherever shown.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import trio
import trio.testing

from trio_encode.arena import Arena
from trio_encode.embedding import ArenaEmbedding, Embedding
from trio_encode.ledger import RegistrationLedger
from trio_encode.observer import NullObserver, RegistrationCall
from trio_encode.request_types import EmbeddingMemory, Receiver
from trio_encode.scopes import ScopeRegistry
from trio_encode.testing.costs import CostModel
from trio_encode.testing.memory_engine import InMemoryEngine, InMemoryFabric

PATHS = ("arena", "per-request registration")
MODEL_SIZES = (400_000, 1_600_000, 6_400_000, 25_600_000)
"""Embedding sizes the modelled run covers, in bytes."""
MODEL_TPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class ModelRow:
    path: str
    nbytes: int
    tp: int
    requests: int
    seconds: float
    """Virtual seconds for every rank to send every request."""
    registrations: int
    register_seconds: float
    """Virtual seconds spent in register and deregister calls, all requests together."""

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class ModelResult:
    model: CostModel
    rows: list[ModelRow]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "model",
            "model": asdict(self.model),
            "rows": [
                {**asdict(row), "requests_per_second": row.requests_per_second} for row in self.rows
            ],
        }

    def table(self) -> str:
        """The rows side by side, each line marked as a model."""
        lines = [
            f"MODEL, not a measurement: cost model {self.model.name!r} in virtual time "
            "(the request lifecycle on the in-memory engine)",
            *(f"  figures: {source}" for source in self.model.sources),
            "",
            f"{'embedding':>12}{'TP':>4}{'arena req/s':>14}{'per-request req/s':>20}"
            f"{'arena/per-request':>19}{'registration ms/req':>21}",
        ]
        by_cell: dict[tuple[int, int], dict[str, ModelRow]] = {}
        for row in self.rows:
            by_cell.setdefault((row.nbytes, row.tp), {})[row.path] = row
        for (nbytes, tp), cell in sorted(by_cell.items()):
            arena, plain = cell[PATHS[0]], cell[PATHS[1]]
            per_request_ms = plain.register_seconds / plain.requests * 1e3
            lines.append(
                f"{nbytes / 1e6:>9.1f} MB{tp:>4}{arena.requests_per_second:>14.0f}"
                f"{plain.requests_per_second:>20.0f}"
                f"{arena.requests_per_second / plain.requests_per_second:>19.2f}"
                f"{per_request_ms:>21.3f}"
            )
        return "\n".join(lines)


class _Timing(NullObserver):
    """Counts registrations and the virtual time spent in them."""

    def __init__(self) -> None:
        self.registrations = 0
        self.seconds = 0.0

    def registered(self, address: int, length: int) -> None:
        self.registrations += 1

    def registration_timed(self, call: RegistrationCall, seconds: float) -> None:
        self.seconds += seconds


async def _one_path(model: CostModel, path: str, nbytes: int, tp: int, requests: int) -> ModelRow:
    fabric = InMemoryFabric()
    sender = fabric.engine("encoder")
    sender.apply_costs(model)
    landings = []
    for number in range(tp):
        engine: InMemoryEngine = fabric.engine(f"rank{number}")
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        await engine.register(int(buffer.data_ptr()), nbytes)
        landings.append((Receiver(engine.session_id, int(buffer.data_ptr())), buffer))
    timing = _Timing()
    ledger = RegistrationLedger(sender, timing)
    arena = Arena(2 * nbytes * (tp + 2)) if path == PATHS[0] else None
    async with trio.open_nursery() as nursery:
        registry = ScopeRegistry(nursery, engine=sender, ledger=ledger, send_timeout=1e6)
        arena_lease = None
        if arena is not None:
            arena_lease = await ledger.acquire(arena.address, arena.nbytes, owner=arena)
        timing.registrations, timing.seconds = 0, 0.0  # the arena's own is paid at start
        opening = trio.Lock()
        scopes = []

        async def encode() -> EmbeddingMemory:
            if arena is None:
                return Embedding(torch.ones(nbytes // 4, 1))
            segment = await arena.allocate_by(nbytes, trio.current_time() + 60)
            if segment is None:
                raise RuntimeError("the modelled arena is too small")
            view = torch.frombuffer(segment.buffer, dtype=torch.float32).view(-1, 1)
            return ArenaEmbedding([(segment, view)])

        async def rank(receiver: Receiver) -> None:
            for index in range(requests):
                req_id = f"model-{index}"
                async with opening:
                    scope = registry.live(req_id)
                    if scope is None:
                        scope = await registry.open(req_id, receive_count=tp, encode=encode)
                        scopes.append(scope)
                await scope.send(receiver)

        started = trio.current_time()
        async with trio.open_nursery() as ranks:
            for receiver, _ in landings:
                ranks.start_soon(rank, receiver)
        for scope in scopes:  # the last deregistrations belong to the run
            await scope.wait_ended()
        seconds = trio.current_time() - started
        row = ModelRow(path, nbytes, tp, requests, seconds, timing.registrations, timing.seconds)
        if arena_lease is not None:
            await ledger.release(arena_lease)
        nursery.cancel_scope.cancel()
    return row


async def _all(
    model: CostModel, sizes: Sequence[int], tps: Sequence[int], requests: int
) -> list[ModelRow]:
    rows = []
    for nbytes in sizes:
        for tp in tps:
            for path in PATHS:
                rows.append(await _one_path(model, path, nbytes, tp, requests))
    return rows


def run_model(
    model: CostModel, sizes: Sequence[int], tps: Sequence[int], requests: int = 32
) -> ModelResult:
    """Both paths for every size and TP, on a mock clock (seconds of real time, not more)."""
    rows = trio.run(
        partial(_all, model, sizes, tps, requests),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    return ModelResult(model, rows)
