"""A transfer engine that fails a chosen fraction of calls, for soaks and fault drills.

A server that has only ever seen a healthy engine has never run its error paths under load.
:class:`FaultyEngine` wraps any :class:`TransferEngine` and makes a seeded, random fraction of
its ``register``, ``transfer`` and ``deregister`` calls fail with the codes Mooncake itself
returns, *before* the wrapped engine is called. So an injected failure means what a real one
means: a refused registration holds nothing, a failed transfer moved nothing the receiver may
trust, and a failed deregistration leaves the region registered in the engine.

It is off unless ``trio-encode serve`` is started with ``--engine-faults`` (a drill option
declared here, in ``DrillSettings``); never enable it in production.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import trio
from pydantic import BeforeValidator
from pydantic.dataclasses import dataclass as settings_dataclass

from trio_encode.declare import SETTINGS, in_group
from trio_encode.engine.base import (
    INVALID_ADDRESS,
    TRANSFER_FAILED,
    EngineCall,
    EngineError,
    TransferEngine,
    Write,
)
from trio_encode.testing.forwarding import ForwardingEngine

if TYPE_CHECKING:
    from trio_encode.encoder import VisionModel

log = logging.getLogger(__name__)

INJECTED_CODES: dict[EngineCall, int] = {
    "register": TRANSFER_FAILED,
    "transfer": TRANSFER_FAILED,
    "deregister": INVALID_ADDRESS,
}
"""The Mooncake return code an injected failure of each call carries: ``-1`` is what
``register_memory`` and ``transfer_sync_write`` return when they fail, ``-3`` what
``unregister_memory`` returns when it does not release the address."""


@dataclass(frozen=True)
class FaultPlan:
    """Which fraction of each engine call fails, and the seed of the draws."""

    register: float = 0.0
    transfer: float = 0.0
    deregister: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for call in ("register", "transfer", "deregister"):
            rate = getattr(self, call)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"engine fault rate {call}={rate} is not in [0, 1]")

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """``"register=0.01,transfer=0.02,deregister=0.001,seed=7"``; omitted calls never
        fail. ``"0.01"`` alone fails that fraction of every call."""
        text = text.strip()
        if not text:
            raise ValueError("an empty engine fault plan; leave the setting unset instead")
        if "=" not in text:
            rate = _number(text, "rate")
            return cls(register=rate, transfer=rate, deregister=rate)
        fields: dict[str, float] = {}
        seed = 0
        for part in text.split(","):
            name, equals, value = (piece.strip() for piece in part.partition("="))
            if not equals:
                raise ValueError(f"engine fault plan: {part!r} is not name=value")
            if name == "seed":
                if not value.lstrip("-").isdigit():
                    raise ValueError(f"engine fault plan: seed {value!r} is not an integer")
                seed = int(value)
            elif name in ("register", "transfer", "deregister"):
                fields[name] = _number(value, name)
            else:
                raise ValueError(
                    f"engine fault plan: unknown call {name!r} "
                    "(register, transfer, deregister or seed)"
                )
        return cls(seed=seed, **fields)

    def rate(self, call: EngineCall) -> float:
        rate: float = getattr(self, call, 0.0)
        return rate

    def __str__(self) -> str:
        return (
            f"register={self.register},transfer={self.transfer},"
            f"deregister={self.deregister},seed={self.seed}"
        )


def _number(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"engine fault plan: {name} {text!r} is not a number") from None


_INJECTED = "injected by --engine-faults"


class FaultyEngine(ForwardingEngine):
    """``engine`` with :class:`FaultPlan`'s fraction of calls refused before they reach it."""

    def __init__(self, engine: TransferEngine, plan: FaultPlan) -> None:
        super().__init__(engine)
        self.plan = plan
        self.injected: Counter[EngineCall] = Counter()
        """Failures injected so far, by call."""
        self._random = random.Random(plan.seed)

    def _fails(self, call: EngineCall) -> bool:
        rate = self.plan.rate(call)
        if rate and self._random.random() < rate:
            self.injected[call] += 1
            return True
        return False

    async def register(self, address: int, length: int) -> None:
        if self._fails("register"):
            raise EngineError(
                "register",
                INJECTED_CODES["register"],
                address=address,
                length=length,
                session_id=self.session_id,
                detail=_INJECTED,
            )
        await super().register(address, length)

    async def deregister(self, address: int) -> None:
        if self._fails("deregister"):
            raise EngineError(
                "deregister",
                INJECTED_CODES["deregister"],
                address=address,
                session_id=self.session_id,
                detail=_INJECTED,
            )
        await super().deregister(address)

    async def transfer(self, write: Write, *, submitted: trio.Event | None = None) -> None:
        if self._fails("transfer"):
            raise write.failed(INJECTED_CODES["transfer"], _INJECTED)
        await super().transfer(write, submitted=submitted)


def _fault_plan(value: Any) -> Any:
    """A plan written as text (a flag) -> :class:`FaultPlan`."""
    return FaultPlan.parse(value) if isinstance(value, str) else value


EngineFaults = Annotated[FaultPlan, BeforeValidator(_fault_plan)]


engine_setting = in_group("engine")
model_setting = in_group("model")


@settings_dataclass(frozen=True, config=SETTINGS)
class DrillSettings:
    """What a drill adds to ``trio-encode serve``: engine faults, never in production."""

    engine_faults: EngineFaults | None = engine_setting(None)
    """Drills only: fail a fraction of transfer-engine calls with Mooncake's own codes, e.g.
    'register=0.01,transfer=0.02,deregister=0.001,seed=7' (or one rate for all). Off by default;
    never in production."""

    stamp_embeddings: bool = model_setting(False)
    """Drills only: an image tagged with an identity (the soak's) gets an embedding whose every
    8-byte word names that identity and its own index, so a receiver can tell whose bytes it holds.
    Off by default; never in production."""

    def wrap_model(self, model: VisionModel) -> VisionModel:
        """``model``, stamping tagged images' embeddings when asked to."""
        if not self.stamp_embeddings:
            return model
        from trio_encode.testing.stamped_model import StampedModel

        log.warning("stamping tagged images' embeddings with their identity")
        return StampedModel(model)

    def wrap(self, engine: TransferEngine) -> TransferEngine:
        """``engine`` with the planned faults injected (itself when there are none)."""
        if self.engine_faults is None:
            return engine
        log.warning("injecting engine faults: %s", self.engine_faults)
        return FaultyEngine(engine, self.engine_faults)
