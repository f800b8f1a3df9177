"""A short sample of ``trio-encode soak``: a few hundred requests against a real server with
every kind of fault, all checks as in the full soak (``nox -s soak``)."""

from __future__ import annotations

from trio_encode.encoder import EncoderSettings
from trio_encode.tools.soak.run import SoakConfig, run_soak

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


async def test_a_short_soak_with_every_fault_keeps_every_promise() -> None:
    config = SoakConfig(
        requests=240,
        warmup=40,
        images=24,
        concurrency=8,
        send_timeout=4.0,
        freeze_seconds=4.0,
        vanish_rate=0.03,
        engine_faults="register=0.01,transfer=0.01,seed=3",
        encoder=TINY,
    )
    result = await run_soak(config)
    assert result.ok, result.table()
    assert result.counts.requests_done == 240
    counts = result.counts
    assert counts.vanished_mid_body > 0
    assert counts.vanished_after_encode > 0
    assert counts.vanished_mid_send > 0
    assert result.statuses["/send"]["200"] > 700
    assert result.statuses["/send"].get("502", 0) > 0  # injected, frozen and killed ranks
    assert result.checked_bytes >= 700 * 4 * 1024 * 4
    assert result.probe_frozen_count > 0
    assert result.backstop_expiries > 0  # ranks that vanished after /encode
    assert (result.left_scopes, result.left_registrations) == (0, 0)
