"""``trio-encode fleet`` end to end, shrunk: a master, two tiny encoders, two ranks, one
encoder killed half-way; every rank served, every byte checked, progress shown while it runs,
the table printed with what every counter means."""

from __future__ import annotations

import pytest

from support.cluster import TINY_ENCODER
from trio_encode.tools.fleet_demo import (
    COLUMNS,
    EncoderCounts,
    FleetDemoConfig,
    FleetOutcome,
    run_fleet_demo,
)


async def test_the_fleet_demo_survives_a_killed_encoder_and_prints_its_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = FleetDemoConfig(
        encoders=2, ranks=2, requests=12, distinct=3, concurrency=2, encoder=TINY_ENCODER
    )
    outcome = await run_fleet_demo(config)
    table = outcome.table()
    assert outcome.ok, table
    assert outcome.served == 12 * 2
    assert outcome.bytes_checked == 12 * 2 * 64 * 1024 * 4
    assert [row.killed for row in outcome.rows] == [False, True]
    # Each image ran through the model about once (a store entry lost with the killed
    # encoder's memory may run once more), never once per request.
    assert 3 <= outcome.forwards <= 5, table
    assert "killed half-way" in table
    assert "OK: every rank served, every byte checked" in table
    progress = capsys.readouterr().err
    for step in ("mooncake_master", "starting 2 encoders", "/encode + /send", "killed encoder"):
        assert step in progress, progress


def test_the_fleet_table_says_what_every_counter_counts() -> None:
    outcome = FleetOutcome(
        FleetDemoConfig(), rows=[EncoderCounts("http://127.0.0.1:1", {"store_failures": 1})]
    )
    table = outcome.table()
    header = table.splitlines()[0]
    for title, _, meaning in COLUMNS:
        assert title in header
        assert f"{title}: {meaning}" in table
    assert "store failed: store lookups that failed" in table
    assert "computed instead" in table
