"""One hierarchy of request errors: each class has its status and a unique kind, and the
client turns an answer back into its class by the kind alone, never by the prose."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from trio_encode.client.http import UnexpectedResponse, error_of
from trio_encode.engine import ENGINE_CODE_MEANINGS, EngineError
from trio_encode.errors import (
    ERRORS,
    EngineFailed,
    HeadersTooLarge,
    Overloaded,
    RequestError,
    RequestTimedOut,
    ShuttingDown,
    UnsupportedMediaType,
    error_class,
)


def _concrete_subclasses(cls: type[RequestError]) -> set[type[RequestError]]:
    found: set[type[RequestError]] = set()
    for sub in cls.__subclasses__():
        found |= _concrete_subclasses(sub)
        if "kind" in sub.__dict__:
            found.add(sub)
    return found


def test_every_error_class_is_in_the_table_with_a_unique_kind_and_an_error_status() -> None:
    assert set(ERRORS) >= _concrete_subclasses(RequestError) - {UnexpectedResponse}
    kinds = [cls.kind for cls in ERRORS]
    assert len(kinds) == len(set(kinds))
    for cls in ERRORS:
        assert 400 <= cls.status <= 599
        assert error_class(cls.kind) is cls
        assert (cls.retry_after is not None) == (cls.status == 503), cls


@pytest.mark.parametrize("cls", ERRORS, ids=[cls.kind for cls in ERRORS])
def test_the_client_maps_each_kind_to_its_class(cls: type[RequestError]) -> None:
    # The prose says the opposite of the kind: only the kind may decide.
    body = {"status": "error", "error": cls.kind, "message": "shutting down", "req_id": "r"}
    error = error_of(cls.status, body, httpx.Headers({"Retry-After": "7"}))
    assert type(error) is cls
    assert (error.status, error.kind, error.message, error.req_id) == (
        cls.status,
        cls.kind,
        "shutting down",
        "r",
    )
    assert error.retry_after == 7


def test_overloaded_and_shutting_down_differ_by_kind_not_by_message() -> None:
    body = {"status": "error", "message": "the server is shutting down", "req_id": None}
    assert type(error_of(503, {**body, "error": "overloaded"})) is Overloaded
    assert type(error_of(503, {**body, "error": "shutting_down"})) is ShuttingDown


def test_engine_failures_carry_the_code_and_its_meaning_both_ways() -> None:
    raised = EngineError("register", -7, address=0x1000, length=64)
    answered = EngineFailed.from_engine_error(raised, req_id="r")
    assert (answered.engine_call, answered.engine_code) == ("register", -7)
    assert answered.engine_meaning == ENGINE_CODE_MEANINGS[-7]
    body = {
        "status": "error",
        "error": "engine_failed",
        "message": "no code in these words",
        "req_id": "r",
        "engine_call": "register",
        "engine_code": -7,
    }
    error = error_of(502, body)
    assert isinstance(error, EngineFailed)
    assert (error.engine_call, error.engine_code) == ("register", -7)
    assert "overlap" in (error.engine_meaning or "")
    unknown = EngineFailed("x", engine_code=-9999)
    assert unknown.engine_meaning == "an error code this server does not know"


def test_an_unknown_kind_is_an_unexpected_response() -> None:
    error = error_of(418, {"status": "error", "error": "teapot", "message": "m", "req_id": None})
    assert isinstance(error, UnexpectedResponse)
    assert error.status == 418
    assert "teapot" in error.message


def test_the_contract_document_lists_every_kind_with_its_status() -> None:
    api = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    documented = {
        (int(status), kind) for status, kind in re.findall(r"^\| (\d{3}) \| `(\w+)` \|", api, re.M)
    }
    assert documented == {(cls.status, cls.kind) for cls in ERRORS}


async def test_quarts_own_refusals_keep_their_status_and_kind() -> None:
    """A status Quart (or werkzeug) raises before a handler runs is answered with its own
    class, never as an internal error; the client turns it back into that class."""
    from quart import abort
    from quart_trio import QuartTrio

    from trio_encode.server.errors import install_error_handlers

    app = QuartTrio(__name__)
    install_error_handlers(app)

    @app.route("/refuse/<int:status>")
    async def refuse(status: int) -> str:
        abort(status)

    expected = {408: RequestTimedOut, 415: UnsupportedMediaType, 431: HeadersTooLarge}
    async with app.test_app() as test_app:
        client = test_app.test_client()
        for status, cls in expected.items():
            response = await client.get(f"/refuse/{status}")
            body = await response.get_json()
            assert (response.status_code, body["error"]) == (status, cls.kind)
            assert type(error_of(status, body)) is cls
