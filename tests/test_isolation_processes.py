"""No receiver slows another, measured on real processes.

A ``trio-encode serve`` child process and prefill nodes whose ranks are receiver processes of
their own (a Mooncake engine each) on loopback addresses of their own, one per node
(:mod:`support.frozen_ranks`); ranks are frozen with SIGSTOP, as a wedged host's would be, and
always resumed. Every byte that lands on a healthy rank is checked, and no slot answered 200 is
written afterwards.

- Many sends to a rank frozen before the server ever reached it share one first-contact probe:
  a new, healthy rank (on the frozen rank's host and on another) is served at once.
- Frozen TP=4 nodes with every rank's sends in flight hold no capacity another node needs: a
  healthy node's request is delayed by less than half a second over the same request unloaded.
  A transfer that holds a worker thread until Mooncake ends it fails this with two frozen
  nodes or more (measured: the healthy node's sends waited for the frozen transfers' progress
  timeout).
"""

from __future__ import annotations

import statistics
import time

import pytest
import trio

from support.frozen_ranks import TINY, Node, Served, frozen, node_ranks, serving
from trio_encode.tools.soak.drill import Call, CheckedImages, Rank
from trio_encode.tools.soak.run import FIRST_CONTACT_BOUND

DELAY_BOUND = 0.5
"""Seconds a healthy node's sends may be delayed by frozen nodes' sends in flight."""
SENDS_PER_RANK = 8
"""Sends in flight to each frozen rank: the server's default ``--engine-sends-per-session``."""


@pytest.fixture(scope="module")
def workload() -> CheckedImages:
    return CheckedImages.build(TINY, 12)


async def test_many_sends_to_a_rank_frozen_before_first_contact_leave_new_ranks_served(
    workload: CheckedImages,
) -> None:
    """48 /sends to a rank frozen before its first contact (a long ``--send-timeout``, so
    none gives up early); meanwhile a new rank on the same host and one on another host each
    get /encode + /send served, bytes checked, in under 2 s. The frozen rank's sends fail
    with 502 once the probe's deadline passes; resumed, it is served."""
    with trio.fail_after(60):
        async with serving(workload, ["--send-timeout", "60"]) as served:
            node_a, node_b = await served.open_nodes(["127.0.0.2", "127.0.0.3"], tp=2, slots=52)
            cold, fresh_same_host = node_a.ranks
            fresh_other_host = node_b.ranks[0]
            for i in range(48):
                assert (await served.encode(node_a, f"cold-{i}", i % 12, 1)).status == 200
            calls: list[Call] = []

            async def to_cold(i: int) -> None:
                calls.append(await served.send(node_a, cold, f"cold-{i}", i % 12))

            async with trio.open_nursery() as nursery, frozen([cold]):
                for i in range(48):
                    nursery.start_soon(to_cold, i)
                await trio.sleep(0.5)  # every send is in the server, waiting on the probe
                assert not calls, calls
                for node, rank in ((node_a, fresh_same_host), (node_b, fresh_other_host)):
                    started = time.monotonic()
                    await _one_rank_request(served, node, rank, f"fresh-{rank.name}", 11)
                    assert time.monotonic() - started < FIRST_CONTACT_BOUND, rank.name
                assert not calls, "the frozen rank's sends ended before its probe's deadline"
                nursery.cancel_scope.deadline = trio.current_time() + 10
                while len(calls) < 48:  # noqa: ASYNC110 (the calls are other tasks')
                    await trio.sleep(0.05)
            assert {call.status for call in calls} == {502}, calls
            assert "first-contact probe" in served.server.log()
            await _one_rank_request(served, node_a, cold, "cold-again", 3)


@pytest.mark.parametrize("frozen_nodes", [1, 2, pytest.param(4, marks=pytest.mark.hostile)])
async def test_frozen_tp4_nodes_with_sends_in_flight_leave_a_healthy_node_served(
    workload: CheckedImages, frozen_nodes: int
) -> None:
    """``frozen_nodes`` TP=4 nodes (each on its own address), every rank already contacted,
    are frozen with 8 sends in flight to each rank; a healthy TP=4 node's request is then
    served with its sends delayed less than ``DELAY_BOUND`` (the slowest of three) over the
    same request unloaded (the median of three), bytes checked. Resumed, the frozen ranks'
    sends end as the contract allows (200 with their bytes, or 502/504)."""
    # Transfers into a paused rank fail after the progress timeout: longer than the test
    # holds the ranks frozen, so nothing but the healthy node's own sends can end meanwhile.
    args = ["--send-timeout", "10", "--engine-progress-timeout", "8"]
    with trio.fail_after(90):
        async with serving(workload, args) as served:
            hosts = [f"127.0.0.{2 + n}" for n in range(frozen_nodes + 1)]
            *stuck_nodes, healthy = await served.open_nodes(hosts, tp=4, slots=SENDS_PER_RANK + 2)
            for n, node in enumerate([*stuck_nodes, healthy]):
                await served.request(node, f"warm-{n}", n)  # every rank has been reached
            unloaded = [await served.request(healthy, f"unloaded-{i}", i) for i in range(3)]
            stuck = [
                (node, rank, f"stuck-{rank.name}-{i}", i)
                for node in stuck_nodes
                for rank in node.ranks
                for i in range(SENDS_PER_RANK)
            ]
            await _encode_all(served, stuck)
            statuses: list[int] = []

            async def stuck_send(node: Node, rank: Rank, req_id: str, image: int) -> None:
                statuses.append((await served.send(node, rank, req_id, image)).status)

            async with trio.open_nursery() as nursery, frozen(node_ranks(stuck_nodes)):
                for entry in stuck:
                    nursery.start_soon(stuck_send, *entry)
                await trio.sleep(1.5)  # each is in the server, its transfer under way
                loaded = [await served.request(healthy, f"loaded-{i}", i) for i in range(3)]
                ended_while_frozen = len(statuses)
            delay = max(loaded) - statistics.median(unloaded)
            assert delay < DELAY_BOUND, (frozen_nodes, unloaded, loaded)
            assert not ended_while_frozen, "a frozen rank's send ended while it was frozen"
            assert len(statuses) == len(stuck)
            assert set(statuses) <= {200, 502, 504}, statuses


async def _one_rank_request(
    served: Served, node: Node, rank: Rank, req_id: str, image: int
) -> None:
    """/encode then /send of one rank (receive_count 1); 200 with the image's bytes."""
    assert (await served.encode(node, req_id, image, 1)).status == 200
    call = await served.send(node, rank, req_id, image)
    assert call.status == 200, call


async def _encode_all(served: Served, entries: list[tuple[Node, Rank, str, int]]) -> None:
    """/encode every entry's request (receive_count 1), 16 at a time."""
    limit = trio.Semaphore(16)

    async def one(node: Node, req_id: str, image: int) -> None:
        async with limit:
            assert (await served.encode(node, req_id, image, 1)).status == 200

    async with trio.open_nursery() as nursery:
        for node, _, req_id, image in entries:
            nursery.start_soon(one, node, req_id, image)
