"""The fault-injecting engine: a seeded fraction of calls fails with Mooncake's codes, before
the wrapped engine is called, so an injected failure leaves what a real one leaves."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from trio_encode.engine import (
    ADDRESS_OVERLAPPED,
    INVALID_ADDRESS,
    TRANSFER_FAILED,
    EngineError,
    Write,
)
from trio_encode.testing.faults import FaultPlan, FaultyEngine

if TYPE_CHECKING:
    from conftest import BufferPool, EnginePair

KIB = 1024


def addr(tensor: torch.Tensor) -> int:
    return int(tensor.data_ptr())


def test_a_plan_is_parsed_per_call_or_as_one_rate() -> None:
    plan = FaultPlan.parse("register=0.25, transfer=0.5,seed=7")
    assert (plan.register, plan.transfer, plan.deregister, plan.seed) == (0.25, 0.5, 0.0, 7)
    assert FaultPlan.parse(str(plan)) == plan
    every = FaultPlan.parse("0.1")
    assert (every.register, every.transfer, every.deregister) == (0.1, 0.1, 0.1)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("register=2", "not in [0, 1]"),
        ("transfer=-0.1", "not in [0, 1]"),
        ("send=0.1", "unknown call 'send'"),
        ("register", "not a number"),
        ("register=x", "not a number"),
        ("seed=1.5", "not an integer"),
        ("register=0.1,transfer", "not name=value"),
    ],
)
def test_a_bad_plan_is_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("[", r"\[")):
        FaultPlan.parse(text)


async def test_injected_failures_carry_mooncakes_codes_and_never_reach_the_engine(
    engine_pair: EnginePair, buffers: BufferPool
) -> None:
    source, landing = buffers.pattern(4 * KIB), buffers.zeros(4 * KIB)
    await engine_pair.receiver.register(addr(landing), 4 * KIB)
    always = FaultyEngine(engine_pair.sender, FaultPlan(register=1, transfer=1, deregister=1))

    with pytest.raises(EngineError) as refused:
        await always.register(addr(source), 4 * KIB)
    assert (refused.value.call, refused.value.code) == ("register", TRANSFER_FAILED)
    assert "injected" in str(refused.value)
    assert not engine_pair.sender.live  # nothing was registered

    with pytest.raises(EngineError) as failed:
        await always.transfer(
            Write(engine_pair.receiver.session_id, [(addr(source), 4 * KIB)], addr(landing))
        )
    assert (failed.value.call, failed.value.code) == ("transfer", TRANSFER_FAILED)
    assert failed.value.session_id == engine_pair.receiver.session_id
    assert not landing.any()  # nothing moved

    # A failed deregistration leaves the region registered, as a real one may: the engine
    # still refuses to register it again.
    await engine_pair.sender.register(addr(source), 4 * KIB)
    with pytest.raises(EngineError) as stuck:
        await always.deregister(addr(source))
    assert (stuck.value.call, stuck.value.code) == ("deregister", INVALID_ADDRESS)
    with pytest.raises(EngineError) as overlap:
        await engine_pair.sender.register(addr(source), 4 * KIB)
    assert overlap.value.code == ADDRESS_OVERLAPPED
    assert always.injected == {"register": 1, "transfer": 1, "deregister": 1}


async def test_the_fraction_is_seeded_and_calls_that_pass_do_their_work(
    engine_pair: EnginePair, buffers: BufferPool
) -> None:
    source, landing = buffers.pattern(4 * KIB), buffers.zeros(4 * KIB)
    await engine_pair.receiver.register(addr(landing), 4 * KIB)
    await engine_pair.sender.register(addr(source), 4 * KIB)
    # First contact (a probe with a deadline) happens before the counted calls: what is
    # counted below is the injected faults, not how fast a loaded machine answers a probe.
    await engine_pair.sender.transfer(
        Write(engine_pair.receiver.session_id, [(addr(source), 4 * KIB)], addr(landing))
    )
    outcomes: list[list[bool]] = []
    for _ in range(2):
        faulty = FaultyEngine(engine_pair.sender, FaultPlan(transfer=0.3, seed=11))
        passed = []
        codes: set[int] = set()
        for _ in range(100):
            landing.zero_()
            try:
                await faulty.transfer(
                    Write(engine_pair.receiver.session_id, [(addr(source), 4 * KIB)], addr(landing))
                )
            except EngineError as exc:
                passed.append(False)
                codes.add(exc.code)
                assert not landing.any()
            else:
                assert torch.equal(landing, source)
                passed.append(True)
        assert faulty.injected["transfer"] == passed.count(False)
        assert codes == {TRANSFER_FAILED}
        outcomes.append(passed)
    assert outcomes[0] == outcomes[1]  # the same seed fails the same calls
    assert 15 <= outcomes[0].count(False) <= 45
    # Calls with a zero rate are never touched.
    never = FaultyEngine(engine_pair.sender, FaultPlan(transfer=1.0))
    await never.deregister(addr(source))
    await never.register(addr(source), 4 * KIB)
    assert never.injected == {}
