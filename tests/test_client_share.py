"""One client, a share: whatever receivers one client names, it holds at most half of the
engine's transfers in flight, so the rest stays for others.

The server caps each client address's ``/send`` calls in flight (``max_sends_per_client``;
each is one transfer) and the engine caps its transfers in flight (``transfers_in_flight``);
the settings refuse a per-client cap above half the engine's. Real Mooncake for the healthy
receiver, stand-in frozen receivers (see ``test_engine_poller``).
"""

from __future__ import annotations

import time

import pytest
import torch
import trio
from pydantic import ValidationError

from test_engine_poller import AT_ONCE, SIZE, FrozenReceivers, frozen_sessions, until
from trio_encode.engine import Write
from trio_encode.engine.mooncake import MooncakeEngine
from trio_encode.settings import ServerSettings


def test_a_client_s_share_is_at_most_half_the_engine_s_transfers() -> None:
    with pytest.raises(ValidationError) as refused:
        ServerSettings.exactly(max_sends_per_client=5, engine_transfers_in_flight=8)
    message = str(refused.value)
    assert "--max-sends-per-client (5)" in message
    assert "--engine-transfers-in-flight (8)" in message
    assert ServerSettings.exactly(max_sends_per_client=4, engine_transfers_in_flight=8)
    defaults = ServerSettings.exactly()
    assert 2 * defaults.max_sends_per_client <= defaults.engine.transfers_in_flight


async def test_one_client_at_its_full_share_leaves_the_rest_to_others(
    mooncake_engines: tuple[MooncakeEngine, MooncakeEngine],
) -> None:
    """One client's full share of sends parked on frozen receivers, each on its own host (no
    per-receiver bound stops them) with one submission thread: they hold half the engine's
    transfers in flight, and another client's send to a healthy receiver is served at once,
    every byte landed."""
    _, receiver = mooncake_engines
    settings = ServerSettings.exactly(
        max_sends_per_client=4,
        engine_transfers_in_flight=8,
        engine_sends_per_session=1,
        engine_sends_per_host=1,
        engine_transfer_threads=1,
    )
    share = settings.max_sends_per_client
    created = await MooncakeEngine.create(settings.engine)
    raw = FrozenReceivers(created.raw, {receiver.session_id})
    sender = MooncakeEngine(raw, created.settings)
    source = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
    into = torch.zeros(SIZE, dtype=torch.uint8)
    write = Write(receiver.session_id, [(int(source.data_ptr()), SIZE)], int(into.data_ptr()))
    await receiver.register(int(into.data_ptr()), SIZE)
    try:
        await sender.transfer(write)  # first contact made
        into.zero_()
        sessions = frozen_sessions(share, 1)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for session_id in sessions:
                    nursery.start_soon(sender.transfer, Write(session_id, [(0x1000, 64)], 0x2000))
                await until(lambda: raw.total_submitted == 1 + share)
                assert 2 * sender.threads.in_flight.borrowed_tokens == (
                    settings.engine.transfers_in_flight
                )
                began = time.monotonic()
                await sender.transfer(write)
                assert time.monotonic() - began < AT_ONCE
                assert torch.equal(into, source)
                raw.thaw(*sessions)
        assert raw.asked_after_end == []
    finally:
        await receiver.deregister(int(into.data_ptr()))


def test_the_share_holds_whatever_the_client_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check is on the combination, wherever the values come from: a config's or the
    environment's cap counts as a flag's would."""
    monkeypatch.setenv("TRIO_ENCODE_ENGINE_TRANSFERS_IN_FLIGHT", "100")
    with pytest.raises(ValidationError, match="at most half"):
        ServerSettings(max_sends_per_client=51)
    assert ServerSettings(max_sends_per_client=50).engine.transfers_in_flight == 100
