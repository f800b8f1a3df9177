"""SGLang 0.5.23's EPD Mooncake sequence, replayed against the real server and real ranks.

Written from SGLang's released receiver and encode-server source, as SGLang sends it:

1. the tokenizer POSTs ``/encode`` once per part, ``req_id`` ``"{rid}_local_part_{i}"``, with
   ``mm_items`` (URL strings, or ``{"url": ...}`` objects with per-item options), ``modality``,
   ``num_parts``, ``part_idx``, ``prefill_host``, ``embedding_port``, ``time_stats_json`` and no
   ``receive_count``;
2. every TP rank POSTs ``/scheduler_receive_meta_data`` ``{req_id, part_idx}`` for every part
   (maybe before step 1 arrived), sorts the answers by ``part_idx``, and allocates one landing
   buffer for the sum of their ``embedding_size``;
3. every rank POSTs ``/send`` for every part: the pulled answer updated with ``prefill_host``,
   ``embedding_port`` (its own ZMQ PULL socket for this request), ``session_id``,
   ``buffer_address`` (its offset in the buffer) and ``receive_count`` (the TP size). Any
   non-200 fails the rank; it logs ``message``;
4. the rank completes the request only when a completion message per part has arrived on its
   PULL socket (loaded here by an unpickler following SGLang's allow-list rule).

Every landed byte and every message is checked, and nothing is left live afterwards.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import zmq

from support.engines import TP, RankEngines
from support.harness import Harness, http_server, landing_pools
from support.sglang_pickle import EmbeddingData, Modality, safe_loads
from trio_encode.client import LandingPool, metric_value
from trio_encode.testing.images import image_uri
from trio_encode.testing.stand_in_encoder import embedding_size, expected_embedding

PREFILL_HOST = "127.0.0.1"


def part_req_id(rid: str, part_idx: int) -> str:
    """SGLang's ``create_part_req_id``."""
    return f"{rid}_local_part_{part_idx}"


def tokenizer_bodies(rid: str, parts: list[list[Any]]) -> list[dict[str, Any]]:
    """What SGLang's tokenizer POSTs to ``/encode``, one body per part."""
    return [
        {
            "mm_items": items,
            "num_parts": len(parts),
            "part_idx": part_idx,
            "req_id": part_req_id(rid, part_idx),
            "modality": "IMAGE",
            "prefill_host": PREFILL_HOST,
            "embedding_port": None,  # SGLang's Mooncake path: ranks name theirs in /send
            "time_stats_json": '{"created_time": 1.0}',
        }
        for part_idx, items in enumerate(parts)
    ]


async def gather_posts(
    http: httpx.AsyncClient, calls: list[tuple[str, dict[str, Any]]]
) -> list[httpx.Response]:
    """POST every call at once, as SGLang's ``asyncio.gather`` does."""
    responses: list[httpx.Response | None] = [None] * len(calls)

    async def one(i: int, route: str, body: dict[str, Any]) -> None:
        responses[i] = await http.post(route, json=body)

    async with trio.open_nursery() as nursery:
        for i, (route, body) in enumerate(calls):
            nursery.start_soon(one, i, route, body)
    return [r for r in responses if r is not None]


def first_error(responses: list[httpx.Response]) -> tuple[int, str] | None:
    """SGLang's ``_extract_encoder_error``: the first non-200, with its ``message``."""
    for response in responses:
        if response.status_code != 200:
            return response.status_code, response.json().get("message", "Unknown error")
    return None


class Rank:
    """One TP rank's ``WaitingRDMARequest``: pull every part, one buffer, send every part."""

    def __init__(self, http: httpx.AsyncClient, pool: LandingPool) -> None:
        self.http = http
        self.pool = pool
        self.error: tuple[int, str] | None = None
        self.landed: list[bytes] = []
        self.messages: list[EmbeddingData] = []

    async def completions(self, pull: zmq.Socket[bytes], count: int) -> None:
        """Wait for a completion message per part, as SGLang's scheduler polls its socket."""
        with trio.fail_after(10):
            while len(self.messages) < count:
                try:
                    self.messages.append(safe_loads(pull.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    await trio.sleep(0.005)

    async def receive(self, rid: str, num_parts: int) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        pull = context.socket(zmq.PULL)
        try:
            port = pull.bind_to_random_port(f"tcp://{PREFILL_HOST}")
            await self._receive(rid, num_parts, pull, port)
        finally:
            pull.close(linger=0)
            context.term()

    async def _receive(
        self, rid: str, num_parts: int, pull: zmq.Socket[bytes], embedding_port: int
    ) -> None:
        pulls = await gather_posts(
            self.http,
            [
                ("/scheduler_receive_meta_data", {"req_id": part_req_id(rid, i), "part_idx": i})
                for i in range(num_parts)
            ],
        )
        if (error := first_error(pulls)) is not None:
            self.error = error
            return
        answers = sorted((r.json() for r in pulls), key=lambda rj: rj["part_idx"])
        sizes = [rj["embedding_size"] for rj in answers]
        slot = self.pool.allocate(sum(sizes))
        sends = []
        offset = 0
        for rj, size in zip(answers, sizes, strict=True):
            rj.update(
                {
                    "prefill_host": PREFILL_HOST,
                    "embedding_port": embedding_port,
                    "session_id": self.pool.session_id,
                    "buffer_address": offset + slot.address,
                    "receive_count": TP,
                }
            )
            sends.append(("/send", rj))
            offset += size
        if (error := first_error(await gather_posts(self.http, sends))) is not None:
            self.error = error
            return
        await self.completions(pull, num_parts)
        for message in self.messages:  # SGLang's checks, then the fields it reads
            assert message.req_id == part_req_id(rid, message.part_idx)
            assert message.num_parts == num_parts
            assert message.error_msg is None
            assert message.modality is Modality.IMAGE
            answer = answers[message.part_idx]
            assert message.shape == [answer["embedding_len"], answer["embedding_dim"]]
            assert message.grid_dim is None  # the stand-in has a fixed grid
        assert sorted(m.part_idx for m in self.messages) == list(range(num_parts))
        raw = bytes(slot.raw().numpy().tobytes())
        offset = 0
        for size in sizes:
            self.landed.append(raw[offset : offset + size])
            offset += size
        slot.release()


def expected_bytes(images: list[bytes]) -> bytes:
    return bytes(expected_embedding(images).numpy().tobytes())


async def run_request(
    harness: Harness,
    pools: list[LandingPool],
    rid: str,
    parts: list[list[Any]],
    *,
    pulls_first: bool,
) -> tuple[list[httpx.Response], list[Rank]]:
    """The tokenizer's ``/encode`` calls and every rank's pull + send, in SGLang's order;
    with ``pulls_first`` the ranks are already waiting when the ``/encode`` calls arrive."""
    async with httpx.AsyncClient(base_url=harness.running.url, timeout=30) as http:
        ranks = [Rank(http, pool) for pool in pools]
        encodes: list[httpx.Response] = []

        async def tokenizer() -> None:
            calls = [("/encode", body) for body in tokenizer_bodies(rid, parts)]
            encodes.extend(await gather_posts(http, calls))

        async with trio.open_nursery() as nursery:
            if not pulls_first:
                await tokenizer()
            for rank in ranks:
                nursery.start_soon(rank.receive, rid, len(parts))
            if pulls_first:
                # Every rank is blocked in its pulls before the tokenizer's /encode arrives.
                with trio.fail_after(10):
                    while True:
                        arrivals = harness.running.service.arrivals
                        if all(part_req_id(rid, i) in arrivals for i in range(len(parts))):
                            break
                        await trio.sleep(0.01)
                await tokenizer()
    return encodes, ranks


async def test_one_part_one_image_pulls_after_encode(rank_engines: RankEngines) -> None:
    image = b"one image" * 40
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, 1 << 20) as pools,
    ):
        encodes, ranks = await run_request(
            harness, pools, "rid-a", [[image_uri(image)]], pulls_first=False
        )
        assert [r.status_code for r in encodes] == [200]
        assert encodes[0].json()["receive_count"] is None  # SGLang's /encode names none
        assert encodes[0].json()["grid_dim"] is None  # the stand-in has a fixed grid
        for rank in ranks:
            assert rank.error is None
            assert rank.landed == [expected_bytes([image])]

        text = await harness.settled()
        assert metric_value(text, "transfer_bytes_total") == TP * embedding_size(1)
        assert metric_value(text, "requests_total", route="/send", status="200") == TP
        assert metric_value(text, "backstop_expiries_total") == 0


async def test_two_multi_image_parts_pulled_before_the_encode(rank_engines: RankEngines) -> None:
    """Two parts of two and three images, items as strings and as ``{"url": ...}`` objects
    with SGLang's per-item options; the ranks pull before the tokenizer's /encode arrives."""
    part0 = [b"part0 image0" * 30, b"part0 image1" * 30]
    part1 = [b"part1 image0" * 30, b"part1 image1" * 30, b"part1 image2" * 30]
    items: list[list[Any]] = [
        [image_uri(part0[0]), {"url": image_uri(part0[1]), "detail": "auto"}],
        [
            {"url": image_uri(part1[0]), "content_hash": "f00d", "detail": "high"},
            image_uri(part1[1]),
            {"url": image_uri(part1[2])},
        ],
    ]
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, 1 << 22) as pools,
    ):
        encodes, ranks = await run_request(harness, pools, "rid-b", items, pulls_first=True)
        assert [r.status_code for r in encodes] == [200, 200]
        for rank in ranks:
            assert rank.error is None
            assert rank.landed == [expected_bytes(part0), expected_bytes(part1)]

        text = await harness.settled()
        assert metric_value(text, "registrations_total") == 2
        assert metric_value(text, "deregistrations_total") == 2
        assert metric_value(text, "transfer_bytes_total") == TP * embedding_size(5)
        assert metric_value(text, "backstop_expiries_total") == 0
        assert len(harness.running.service.arrivals) == 0


async def test_many_requests_at_once_in_both_orders(rank_engines: RankEngines) -> None:
    """Requests overlap, some with pulls first and some after; every copy is exact."""
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, 1 << 23) as pools,
    ):
        results: dict[int, list[Rank]] = {}

        async def request(n: int) -> None:
            parts = [[image_uri(f"req {n} part {p}".encode() * 20)] for p in range(1 + n % 2)]
            _, ranks = await run_request(harness, pools, f"rid-{n}", parts, pulls_first=n % 2 == 0)
            results[n] = ranks

        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(request, n)
        for n, ranks in results.items():
            expected = [
                expected_bytes([f"req {n} part {p}".encode() * 20]) for p in range(1 + n % 2)
            ]
            for rank in ranks:
                assert rank.error is None
                assert rank.landed == expected
        await harness.settled()


# "At once" for a pull over real HTTP on a shared machine: far below the 180 s pull timeout it
# would otherwise wait for, with room for a loaded scheduler.
AT_ONCE = 5.0


async def timed_pull(http: httpx.AsyncClient, req_id: str, part_idx: int) -> tuple[float, Any]:
    started = trio.current_time()
    response = await http.post(
        "/scheduler_receive_meta_data", json={"req_id": req_id, "part_idx": part_idx}
    )
    return trio.current_time() - started, response


async def test_a_failed_encode_fails_every_rank_with_its_message(rank_engines: RankEngines) -> None:
    """Part 1's encoder run fails: every rank's pull of it gets 500 and the encoder's message
    (SGLang logs ``message``). Part 0, whose ranks will now never send it, is released at once
    (not at its backstop); later pulls of either part get the failure at once."""
    items = [[image_uri(b"fine" * 30)], [image_uri(b"FAIL" * 30)]]
    async with (
        http_server(rank_engines.server, send_timeout=60.0) as harness,
        landing_pools(rank_engines, 1 << 20) as pools,
    ):
        encodes, ranks = await run_request(harness, pools, "rid-f", items, pulls_first=True)
        assert encodes[1].status_code == 500
        # Part 0's /encode either finished first or learns that its sibling failed.
        assert encodes[0].status_code == 200 or (
            encodes[0].status_code == 500
            and encodes[0].json()["message"].startswith("part 1 of this request failed")
        )
        for rank in ranks:
            assert rank.error is not None
            status, message = rank.error
            assert status == 500
            assert "stand-in encoder told to fail" in message
        text = await harness.settled(within=2.0)  # far below the 60 s backstop
        assert metric_value(text, "scopes_closed_total", reason="abandoned") == 1
        assert metric_value(text, "backstop_expiries_total") == 0
        assert len(harness.running.service.arrivals) == 0
        async with httpx.AsyncClient(base_url=harness.running.url) as http:
            for part_idx in (0, 1):
                seconds, late = await timed_pull(http, part_req_id("rid-f", part_idx), part_idx)
                assert seconds < AT_ONCE
                assert late.status_code == 500
                assert "stand-in encoder told to fail" in late.json()["message"]


async def test_a_bad_image_answers_pulls_at_once_also_those_after_it(
    rank_engines: RankEngines,
) -> None:
    """An image found undecodable while encoding: the /encode gets 400, and so does every
    pull, those waiting and those arriving after the failure, at once (not at the
    180 s pull timeout), while a corrected /encode may still reuse the id."""
    items = [[image_uri(b"BAD image" * 30)]]
    async with (
        http_server(rank_engines.server, shutdown_grace=0) as harness,
        landing_pools(rank_engines, 1 << 20) as pools,
    ):
        encodes, ranks = await run_request(harness, pools, "rid-bad", items, pulls_first=True)
        assert [r.status_code for r in encodes] == [400]
        for rank in ranks:
            assert rank.error == (400, "mm_items[0]: cannot decode the image")
        async with httpx.AsyncClient(base_url=harness.running.url) as http:
            seconds, late = await timed_pull(http, part_req_id("rid-bad", 0), 0)
            assert seconds < AT_ONCE
            assert late.status_code == 400
            assert late.json()["message"] == "mm_items[0]: cannot decode the image"
            body = tokenizer_bodies("rid-bad", [[image_uri(b"good" * 30)]])[0]
            assert (await http.post("/encode", json=body)).status_code == 200


async def test_an_encode_naming_ranks_tells_each_of_them_it_failed(
    rank_engines: RankEngines,
) -> None:
    """An /encode that names its ranks' ZMQ endpoints (``embedding_port`` a list, as SGLang's
    ZMQ paths do): when it fails, each rank gets SGLang's error message at once."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pulls = [context.socket(zmq.PULL) for _ in range(TP)]
    try:
        ports = [pull.bind_to_random_port(f"tcp://{PREFILL_HOST}") for pull in pulls]
        body = tokenizer_bodies("rid-e", [[image_uri(b"FAIL" * 30)]])[0] | {"embedding_port": ports}
        async with http_server(rank_engines.server) as harness:
            async with httpx.AsyncClient(base_url=harness.running.url) as http:
                assert (await http.post("/encode", json=body)).status_code == 500
            for pull in pulls:
                rank = Rank(http, None)  # type: ignore[arg-type]
                await rank.completions(pull, 1)
                (message,) = rank.messages
                assert message.req_id == part_req_id("rid-e", 0)
                assert message.error_code == 500
                assert "stand-in encoder told to fail" in message.error_msg
                assert message.shape is None
            text = await harness.settled()
            assert (
                metric_value(text, "completion_messages_total", kind="error", result="sent") == TP
            )
    finally:
        for pull in pulls:
            pull.close(linger=0)
        context.term()


async def test_a_pull_for_an_id_no_encode_names_gets_504(rank_engines: RankEngines) -> None:
    async with http_server(rank_engines.server, pull_timeout=0.3) as harness:
        async with httpx.AsyncClient(base_url=harness.running.url) as http:
            response = await http.post(
                "/scheduler_receive_meta_data", json={"req_id": "never", "part_idx": 0}
            )
        assert response.status_code == 504
        assert response.json()["req_id"] == "never"
        assert "no /encode named" in response.json()["message"]
        assert len(harness.running.service.arrivals) == 0


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"part_idx": 2, "num_parts": 2}, "part_idx 2 is out of range for num_parts 2"),
        ({"part_idx": -1}, "part_idx: Input should be greater than or equal to 0"),
        ({"num_parts": 0, "part_idx": 0}, "num_parts: Input should be greater than or equal to 1"),
        ({"modality": "TEXT"}, "modality 'TEXT' is not supported"),
        ({"mm_items": [{"detail": "auto"}]}, "mm_items.0"),
    ],
)
async def test_sglang_bodies_that_are_wrong_get_400_and_leave_nothing(
    rank_engines: RankEngines, change: dict[str, Any], complaint: str
) -> None:
    body = tokenizer_bodies("bad", [[image_uri(b"x" * 30)]])[0] | change
    async with http_server(rank_engines.server) as harness:
        async with httpx.AsyncClient(base_url=harness.running.url) as http:
            response = await http.post("/encode", json=body)
        assert response.status_code == 400
        assert complaint in response.json()["message"]
        assert response.json()["status"] == "error"
        assert len(harness.running.service.registry) == 0


async def test_multi_images_modality_and_hashes_are_accepted(rank_engines: RankEngines) -> None:
    image = b"multi" * 30
    body = tokenizer_bodies("mi", [[image_uri(image)]])[0] | {
        "modality": "multi_images",
        "hashes": ["not-trusted"],
    }
    async with (
        http_server(rank_engines.server) as harness,
        landing_pools(rank_engines, 1 << 20) as pools,
    ):
        async with httpx.AsyncClient(base_url=harness.running.url) as http:
            encoded = await http.post("/encode", json=body)
            assert encoded.status_code == 200
            assert encoded.json()["modality"] == "MULTI_IMAGES"
            assert "hashes" not in encoded.json()
            rank = Rank(http, pools[0])
            # One receiver only: the pull names the count this time (our dialect allows it).
            pulled = await http.post(
                "/scheduler_receive_meta_data",
                json={"req_id": part_req_id("mi", 0), "part_idx": 0, "receive_count": 1},
            )
            assert pulled.status_code == 200
            slot = rank.pool.allocate(pulled.json()["embedding_size"])
            sent = await http.post(
                "/send",
                json=pulled.json()
                | {"session_id": rank.pool.session_id, "buffer_address": slot.address},
            )
            assert sent.status_code == 200
            assert bytes(slot.raw().numpy().tobytes()) == expected_bytes([image])
            slot.release()
        await harness.settled()


async def test_completion_messages_go_only_to_allowed_hosts(rank_engines: RankEngines) -> None:
    """The server pushes to ``prefill_host``: the receivers' rule applies to it (loopback
    only here), before anything is encoded or sent."""
    body = tokenizer_bodies("far", [[image_uri(b"x" * 30)]])[0]
    async with http_server(rank_engines.server) as harness:
        async with httpx.AsyncClient(base_url=harness.running.url) as http:
            encoded = await http.post(
                "/encode", json=body | {"prefill_host": "203.0.113.9", "embedding_port": [5555]}
            )
            sent = await http.post(
                "/send",
                json={
                    "req_id": "far",
                    "session_id": "127.0.0.1:5",
                    "buffer_address": 4096,
                    "prefill_host": "203.0.113.9",
                    "embedding_port": 5555,
                },
            )
        for answer in (encoded, sent):
            assert answer.status_code == 403
            assert answer.json()["error"] == "receiver_not_allowed"
            assert "prefill_host host '203.0.113.9'" in answer.json()["message"]
        assert len(harness.running.service.registry) == 0
