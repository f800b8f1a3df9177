"""The soak's "many sends to a frozen new rank" fault, on its own: a short soak against a real
server whose new rank 0 is SIGSTOPped before the server ever reached it, while its own calls
and 32 more requests' sends wait on it; a new, healthy receiver's first request must be served
within the first-contact bound, the other ranks go on, and every promise of the soak holds."""

from __future__ import annotations

from trio_encode.encoder import EncoderSettings
from trio_encode.tools.soak.run import FIRST_CONTACT_BOUND, SoakConfig, run_soak

TINY = EncoderSettings(
    image_size=32,
    patch_size=16,
    width=32,
    depth=1,
    heads=1,
    hidden_size=1024,
    torch_threads=1,
    cache_bytes=1 << 20,
)


async def test_many_sends_to_a_frozen_new_rank_leave_a_new_healthy_rank_served() -> None:
    config = SoakConfig(
        requests=120,
        warmup=20,
        images=24,
        concurrency=8,
        send_timeout=6.0,
        freeze_seconds=0,
        kill=False,
        freeze_past_deadline=False,
        first_contact_freeze=5.0,
        first_contact_sends=32,
        vanish_rate=0,
        engine_faults=None,
        encoder=TINY,
    )
    result = await run_soak(config)
    assert result.ok, result.table()
    assert result.counts.requests_done == 120
    assert 0 < result.new_rank_first_contact < FIRST_CONTACT_BOUND
    assert result.frozen_new_rank_sends >= 24  # they waited on the frozen rank, and failed
    assert result.statuses["/send"].get("502", 0) >= 24
    assert 0 < result.probe_first_contact_max < FIRST_CONTACT_BOUND
    assert (result.left_scopes, result.left_registrations) == (0, 0)
    assert (result.counts.foreign_bytes, result.counts.corrupt_bytes) == (0, 0)
