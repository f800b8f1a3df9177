"""A short sample of ``trio-encode soak``: a few hundred requests against a real server with
every kind of fault, all checks as in the full soak (``nox -s soak``)."""

from __future__ import annotations

import numpy as np
import torch
import trio

from support.engines import RankEngines
from trio_encode.encoder import EncoderSettings, load_backend
from trio_encode.engine import Write
from trio_encode.testing.identity import MARKER, Foreign, read_slot, tag, words
from trio_encode.testing.images import natural_jpegs
from trio_encode.testing.stamped_model import StampedModel
from trio_encode.tools.soak.drill import Rank, describe
from trio_encode.tools.soak.receiver import open_receiver
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
        first_contact_freeze=4.0,
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
    assert result.late_freeze_window is not None  # a rank resumed after its deadline
    assert (result.counts.foreign_bytes, result.counts.corrupt_bytes) == (0, 0)
    assert 0 < result.probe_first_contact_max < 2.0  # probes ran, none stalled


async def test_a_write_landing_in_a_slot_between_its_requests_is_caught_and_attributed(
    rank_engines: RankEngines,
) -> None:
    """The soak's foreign-byte check, against a real receiver: a slot whose request ended is
    filled with the marker; stamped bytes that land before its next request uses it (a
    transfer the server let outlive its request) are reported as that image's, with the
    offset they landed at and the word they were; bytes that are no image's are corruption."""
    slot_bytes = 4096
    foreign = torch.from_numpy(words(42, 64)[8:24].copy())  # image 42's bytes 64..191
    garbage = torch.full((32,), 7, dtype=torch.uint8)
    async with open_receiver(slot_bytes, "rank") as receiver:
        rank = Rank(receiver, 512, slot_bytes // 512, quiet_seconds=0.0, dirty_seconds=0.0)
        async with trio.open_nursery() as nursery, rank.slot(nursery) as slot:
            assert (await rank.clean(slot)).clean  # never used: zeros
            slot.dirty = True  # its send failed; it rests, then is filled
        async with trio.open_nursery() as nursery, rank.slot(nursery) as slot:
            assert (await rank.clean(slot)).clean
        await rank_engines.server.transfer(
            Write(receiver.session_id, [(int(foreign.data_ptr()), 128)], slot.address + 1024)
        )
        await rank_engines.server.transfer(
            Write(receiver.session_id, [(int(garbage.data_ptr()), 32)], slot.address + 3072)
        )
        async with trio.open_nursery() as nursery, rank.slot(nursery) as again:
            assert again is slot
            reading = await rank.clean(again)
    assert reading.foreign == [Foreign(identity=42, nbytes=128, offset=1024, word=8)]
    assert reading.corrupt == 32
    assert not reading.clean
    owners = {42: "soak-7 image 0"}
    assert describe(reading, owners.__getitem__) == (
        "128 bytes of soak-7 image 0 (its byte 64 on) at slot offset 1024; "
        "32 bytes of no request (corrupt)"
    )


def test_a_slot_reading_tells_own_bytes_foreign_bytes_and_corruption_apart() -> None:
    """Word by word: the expected images in place, a missing stretch, another image's bytes
    (whose, where, which word), own bytes out of place, and bytes that are no image's."""
    part = 256  # 32 words an image
    slot = np.zeros(3 * part, dtype=np.uint8)
    slot.view("<u8")[:32] = words(5, 32)  # image 5, in place
    slot.view("<u8")[32:64] = words(6, 32)  # image 6, in place but for what follows
    slot.view("<u8")[40:44] = words(9, 32)[20:24]  # 32 bytes of image 9, its words 20..23
    slot.view("<u8")[60:64] = 0  # 32 bytes of image 6 never written
    slot.view("<u8")[70:72] = words(5, 32)[:2]  # image 5's bytes again, out of place
    slot.view("<u8")[80] = 0x1234  # not a stamp
    slot[90 * 8 : 96 * 8] = MARKER  # blank
    reading = read_slot(slot, part, expected=[5, 6])
    assert reading.parts_ok == [True, False]
    assert reading.foreign == [Foreign(identity=9, nbytes=32, offset=320, word=20)]
    assert (reading.missing, reading.own_late, reading.corrupt) == (32, 16, 8)
    late = read_slot(slot, part, known=[5])  # after its 200, image 5's bytes are late
    assert late.own_late == 256 + 16
    assert {f.identity for f in late.foreign} == {6, 9}


def test_a_stamped_model_names_each_tagged_image_in_every_word() -> None:
    """What the soak's server runs: the real model, whose embedding of a tagged image is that
    image's identity and word index in every word; an untagged image keeps the model's."""
    model = load_backend(TINY)
    photo = natural_jpegs(1, TINY.image_size, 0)[0]
    stamped = StampedModel(model)
    tagged, plain = (
        stamped.decode(data, max_pixels=TINY.max_image_pixels) for data in (tag(photo, 77), photo)
    )
    out = stamped.encode([tagged, plain])
    raw = out[0].contiguous().view(torch.uint8).reshape(-1).numpy()
    assert (raw.view("<u8") == words(77, raw.size // 8)).all()
    expected = model.encode([model.decode(photo, max_pixels=TINY.max_image_pixels)])[0]
    assert torch.equal(out[1], expected)
    assert stamped.model_id != model.model_id
    assert stamped.fingerprint != model.fingerprint
