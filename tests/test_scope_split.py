"""A scope whose siblings went elsewhere (a request split across encoders) is freed by its
backstop and reported as a split; one nobody sent to is only an expiry."""

from __future__ import annotations

import trio
import trio.testing

from support.lifecycle_rig import lifecycle_rig


async def test_a_scope_left_short_is_freed_by_its_backstop_and_counted_as_a_split(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with lifecycle_rig(send_timeout=30) as rig:
        for req_id, sends in (("split", 2), ("nobody", 0)):
            encode, _ = rig.encoder(req_id)
            await rig.open(req_id, encode, receive_count=4)
            scope = rig.registry.require_live(req_id)
            for rank in await rig.landings(sends):
                await scope.send(rank.receiver)
                assert bytes(rank.buffer.numpy().tobytes()) == rig.expected[req_id]
        # The other two ranks of "split" went to another encoder: nobody else comes.
        await trio.sleep(31)
        assert rig.observer.names("split_expired") == [("split", 2, 4)]
        assert {args[0] for args in rig.observer.names("backstop_expired")} == {
            "split",
            "nobody",
        }
        await rig.assert_nothing_held()
