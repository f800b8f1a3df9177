"""``tests/walks.py`` measures the walks of ``/encode`` and ``/send`` through the package: here
it runs once, in-process with the in-memory engine, and its walks must be real ones."""

from __future__ import annotations

import trio

from test_layers import RANK
from walks import climbs, collapsed, module_lines, rank_of, walk_routes


def test_the_walks_start_at_the_http_server_and_reach_the_encoder_and_the_engine() -> None:
    encode, send = trio.run(walk_routes)
    assert (encode.route, send.route) == ("/encode", "/send")
    for walk in (encode, send):
        files = walk.files()
        assert files, walk.route
        assert files[0].startswith("server/"), files
        assert len(files) >= len(set(files)) > 3, files
    assert "encoder/front.py" in encode.files()
    assert any(rank_of(file) == RANK["engine"] for file in send.files()), send.files()
    assert not any(file.startswith("encoder/") for file in send.files())


def test_a_walk_collapses_runs_and_counts_each_step_up_a_layer() -> None:
    walk = collapsed(["server/app.py", "service/core.py", "service/core.py", "scope.py"])
    assert walk == ["server/app.py", "service/core.py", "scope.py"]
    assert climbs(walk) == 0
    assert climbs([*walk, "service/core.py", "scope.py", "server/app.py"]) == 2
    assert climbs(["scope.py", "testing/memory_engine.py", "scope.py"]) == 1  # as the engine
    counted = [count for _, count in module_lines() if count is not None]
    assert counted
    assert all(count > 0 for count in counted)
