"""``prefill_host`` and a receiver's host compare as host names do: case and a trailing dot
(the fully qualified form) do not matter; different names do, however alike.

SGLang's prefill ranks name their host in ``/encode`` (``prefill_host``) and their transfer
engine in ``/send`` (``session_id``), each from its own configuration: ``Rank-0.Cluster.`` in
one and ``rank-0.cluster`` in the other is one host, and refusing it (403
``receiver_host_mismatch``) fails every request of that rank.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from support.lifecycle_rig import Landing, SeededEncoder, landing_on, make_embedding
from trio_encode.errors import ReceiverHostMismatch
from trio_encode.receivers import receiver_host, same_host
from trio_encode.service import EncodeService, ServiceSettings
from trio_encode.testing.memory_engine import InMemoryFabric

SAME = [
    ("rank-0.cluster", "rank-0.cluster"),
    ("Rank-0.Cluster", "rank-0.cluster"),
    ("RANK-0.CLUSTER", "rank-0.cluster"),
    ("rank-0.cluster.", "rank-0.cluster"),
    ("Rank-0.Cluster.", "rank-0.CLUSTER"),
    ("gpu-node-7", "GPU-NODE-7."),
    ("localhost", "LOCALHOST."),
    ("localhost", "127.0.0.1"),
    ("::1", "localhost."),
    ("10.0.0.5", "::ffff:10.0.0.5"),
    ("[fd00::5]", "FD00::5"),
]
DIFFERENT = [
    ("rank-0.cluster", "rank-1.cluster"),
    ("rank-0.cluster", "rank-0.clusters"),
    ("rank-0.cluster", "rank-0.cluster.internal"),
    ("rank-0", "rank-0.cluster"),
    ("cluster", "rank-0.cluster"),
    ("rank-0.cluster", "rank-0-cluster"),
    ("10.0.0.5", "10.0.0.6"),
    ("rank-0.cluster", "10.0.0.5"),
    ("localhost", "10.0.0.5"),
    ("fd00::5", "fd00::6"),
]


@pytest.mark.parametrize(("a", "b"), SAME)
def test_names_differing_only_in_case_or_a_trailing_dot_are_one_host(a: str, b: str) -> None:
    assert same_host(a, b)
    assert same_host(b, a)


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_different_names_are_different_hosts(a: str, b: str) -> None:
    assert not same_host(a, b)
    assert not same_host(b, a)


def test_a_session_id_s_host_keeps_its_case_and_dot_for_the_comparison() -> None:
    assert receiver_host("Rank-0.Cluster.:15123") == "Rank-0.Cluster."
    assert receiver_host("[FD00::5]:15123") == "FD00::5"


@asynccontextmanager
async def ranks_named(*names: str) -> AsyncIterator[tuple[EncodeService, dict[str, Landing]]]:
    """A service on the in-memory fabric, and a registered landing buffer on an engine whose
    session id is ``{name}:{port}`` for each name."""
    fabric = InMemoryFabric()
    sender = fabric.engine("encoder")
    ranks: dict[str, Landing] = {}
    for name in names:
        ranks[name] = await landing_on(fabric, name)
    with trio.fail_after(600):
        async with EncodeService.running(
            engine=sender, encoder=SeededEncoder(), settings=ServiceSettings()
        ) as service:
            yield service, ranks
    assert fabric.violations == []


async def test_a_receiver_named_in_another_case_or_with_a_trailing_dot_is_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with ranks_named("Rank-0.Cluster.", "rank-0.CLUSTER", "RANK-0.CLUSTER.") as (
        service,
        ranks,
    ):
        await service.encode(
            "r", ["img:a"], receive_count=len(ranks), prefill_host="rank-0.cluster"
        )
        scope = service.registry.require_live("r")
        for rank in ranks.values():
            report = await service.send("r", rank.receiver)
            assert not report.repeat
        expected = bytes(make_embedding(len(b"img:a")).tensor.numpy().tobytes())
        for rank in ranks.values():
            assert rank.landed(len(expected)) == expected
        await scope.wait_ended()
        assert scope.end_reason == "completed"


@pytest.mark.parametrize(
    ("prefill_host", "receiver_name"),
    [
        ("rank-0.cluster", "rank-1.cluster"),
        ("RANK-0.CLUSTER.", "rank-0.cluster.internal"),
        ("rank-0.cluster.", "rank-0"),
        ("Rank-0.Cluster", "10.0.0.5"),
    ],
)
async def test_a_receiver_on_another_host_is_refused(
    autojump_clock: trio.testing.MockClock, prefill_host: str, receiver_name: str
) -> None:
    async with ranks_named(receiver_name) as (service, ranks):
        await service.encode("r", ["img:a"], receive_count=1, prefill_host=prefill_host)
        rank = ranks[receiver_name]
        with pytest.raises(ReceiverHostMismatch, match="is not this request's prefill_host"):
            await service.send("r", rank.receiver)
        assert rank.landed() == bytes(rank.buffer.numel()), "nothing landed"
