"""Case 8: property-based fuzzing of every route's JSON body against the real process.

Hypothesis draws bodies for ``/encode``, ``/send`` and ``/scheduler_receive_meta_data``: each
field of the route's schema (``trio_encode.server.schemas``) absent, plausible (a valid value,
or one just past a bound) or any JSON value at all, plus unknown keys; sometimes the body is
not an object. Every answer must be a success of the route's shape or an error of the
contract's shape and kinds, never a 500, and the process must stay alive with ``/livez`` fast.

The server runs with short waits (``--pull-timeout 0.2``, first contact with a receiver
engine 0.2 s), so a pull or a transfer to a dead receiver costs the fuzzer little.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile.rig import Honest, MiB, Server, closed_ports, contract_error, withstand
from trio_encode.testing.images import image_uri, noise_png

SERVER_ARGS = (
    *("--pull-timeout", "0.2", "--send-timeout", "10", "--engine-first-contact-timeout", "0.2"),
    *("--completion-timeout", "0.5"),
)
RSS_BOUND = 64 * MiB
SAMPLE_EXAMPLES = 150
FULL_EXAMPLES = 4000

VALID = image_uri(noise_png(77))
BROKEN = image_uri(b"definitely not an image")
DEAD_PORT = closed_ports(1)[0]
REQ_IDS = ["fz-a", "fz-b", "fz-r_local_part_0", "fz-r_local_part_1"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([2**2100, -(2**2100), 0, -1, 1, 1024, 1025, 65535, 65536, 2**64])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
any_json = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


REQ_ID = st.sampled_from(REQ_IDS[:4]) | st.text(min_size=1, max_size=12).map("fz-".__add__)
ENDPOINT = st.fixed_dictionaries(
    {"prefill_host": st.just("127.0.0.1"), "embedding_port": st.just(DEAD_PORT)}
)
VALID_BODIES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "/encode": st.fixed_dictionaries(
        {
            "req_id": REQ_ID,
            "mm_items": st.lists(
                st.sampled_from([VALID, {"url": VALID, "detail": "high"}, BROKEN]),
                min_size=1,
                max_size=2,
            ),
        },
        optional={
            "receive_count": st.integers(1, 4),
            "modality": st.sampled_from(["IMAGE", "multi_images"]),
            "num_parts": st.just(2),
            "part_idx": st.integers(0, 1),
            "hashes": st.lists(st.integers(0, 2**63) | st.text(max_size=8), max_size=2),
            "time_stats_json": any_json,
        },
    ).flatmap(lambda body: ENDPOINT.map(lambda e: {**body, **e}) | st.just(body)),
    "/send": st.fixed_dictionaries(
        {
            "req_id": REQ_ID,
            "session_id": st.just("127.0.0.1:1"),  # a dead engine: never a real rank's memory
            "buffer_address": st.integers(1, 2**48),
        },
        optional={"receive_count": st.integers(1, 4), "part_idx": st.integers(0, 1)},
    ).flatmap(lambda body: ENDPOINT.map(lambda e: {**body, **e}) | st.just(body)),
    "/scheduler_receive_meta_data": st.fixed_dictionaries(
        {"req_id": REQ_ID},
        optional={"part_idx": st.integers(0, 1), "receive_count": st.integers(1, 4)},
    ),
}
"""Bodies that are valid, or nearly (an image that does not decode, a request not held)."""
FIELDS = {
    "/encode": (
        "req_id",
        "mm_items",
        "modality",
        "receive_count",
        "num_parts",
        "part_idx",
        "prefill_host",
        "embedding_port",
        "hashes",
        "time_stats_json",
    ),
    "/send": (
        "req_id",
        "session_id",
        "buffer_address",
        "receive_count",
        "prefill_host",
        "embedding_port",
        "part_idx",
    ),
    "/scheduler_receive_meta_data": ("req_id", "part_idx", "receive_count"),
}
"""Every field of each route's schema (``trio_encode.server.schemas``)."""
EDGES: st.SearchStrategy[Any] = st.sampled_from(
    [0, -1, 1024, 1025, 65535, 65536, 2**63, 2**64, 2**2100, "", "5", True, 1.0, [], {}, None]
)


@st.composite
def bodies(draw: st.DrawFn, route: str) -> Any:
    """A body for ``route``: valid (or nearly); or that with one to three of its schema's
    fields dropped, set to an edge value or to any JSON value, and unknown keys added; or any
    JSON value at all."""
    kind = draw(st.sampled_from(["valid", "mutated", "mutated", "mutated", "anything"]))
    if kind == "anything":
        return draw(any_json)
    body = dict(draw(VALID_BODIES[route]))
    if kind == "mutated":
        names = st.sampled_from(FIELDS[route])
        for name in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
            how = draw(st.sampled_from(["drop", "edge", "json"]))
            if how == "drop":
                body.pop(name, None)
            else:
                body[name] = draw(EDGES if how == "edge" else any_json)
        body.update(draw(st.dictionaries(st.text(max_size=8), any_json, max_size=2)))
    return body


calls = st.sampled_from(sorted(FIELDS)).flatmap(
    lambda route: st.tuples(st.just(route), bodies(route))
)


SUCCESS_KEYS = {
    "/encode": {"req_id", "embedding_size", "embedding_len", "embedding_dim", "dtype", "checksum"},
    "/send": {"status", "req_id", "embedding_size", "checksum", "receivers_done", "repeat"},
    "/scheduler_receive_meta_data": {"req_id", "part_idx", "embedding_size", "embedding_len"},
}


def fuzz(url: str, examples: int, *, derandomize: bool) -> Counter[tuple[str, int]]:
    """``examples`` calls, each to a route drawn with a body drawn for it; each answer
    checked. Blocking: run it in a thread. Returns how many of each (route, status)."""
    seen: Counter[tuple[str, int]] = Counter()
    with httpx.Client(base_url=url, timeout=30) as http:

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=derandomize,
            suppress_health_check=list(HealthCheck),
        )
        @given(call=calls)
        def answer_is_the_contract_s(call: tuple[str, Any]) -> None:
            route, body = call
            raw = json.dumps(body)
            response = http.post(route, content=raw, headers={"Content-Type": "application/json"})
            seen[route, response.status_code] += 1
            assert response.status_code != 500, (route, raw[:300], response.text[:300])
            data = response.json()
            if response.status_code == 200:
                assert isinstance(data, dict), data
                missing = SUCCESS_KEYS[route] - set(data)
                assert not missing, (route, raw[:300], data)
            else:
                problem = contract_error(response.status_code, data)
                assert problem is None, (route, raw[:300], response.status_code, problem)

        answer_is_the_contract_s()
    return seen


async def fuzz_every_route(
    server: Server, examples: int, *, derandomize: bool
) -> Counter[tuple[str, int]]:
    return await trio.to_thread.run_sync(
        lambda: fuzz(server.url, examples, derandomize=derandomize)
    )


async def test_fuzzed_bodies_get_contract_answers(server: Server, honest: Honest) -> None:
    statuses, _ = await withstand(
        server,
        honest,
        lambda: fuzz_every_route(server, SAMPLE_EXAMPLES, derandomize=True),
        rss_bound=RSS_BOUND,
    )
    assert statuses["/encode", 200], statuses  # the fuzzer reached the success path
    assert statuses["/send", 400], statuses


@pytest.mark.hostile
async def test_fuzzed_bodies_get_contract_answers_at_length(server: Server, honest: Honest) -> None:
    await withstand(
        server,
        honest,
        lambda: fuzz_every_route(server, FULL_EXAMPLES, derandomize=False),
        rss_bound=RSS_BOUND,
    )
