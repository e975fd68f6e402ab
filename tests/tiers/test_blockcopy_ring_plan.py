"""`tiers.ring.serve` with a plan, then `tiers.ring.finish`: the native server's two halves
(every block verified before the read is counted; the copy, the answer and its wake-up
after), against a real LMDB tier as in test_blockcopy_ring.py."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.transfer_ring import ANSWER_AT, ANSWERED, REQUEST_AT, RING_BYTES
from kvstore.v1 import transfer_pb2 as pb
from tests.damage import corrupt
from tests.tiers.conftest import Kit
from tests.tiers.test_blockcopy_ring import BLOCK, Rig, _address, read
from tests.tiers.test_blockcopy_ring import rig as _rig  # noqa: F401  # the fixture
from tiers import ring

pytestmark = pytest.mark.skipif(not ring.NATIVE, reason="kvstore.native._ring is not built (no C compiler at install)")


@pytest.fixture
def rig(_rig: Rig) -> Iterator[Rig]:  # noqa: F811
    yield _rig


def planned(rig: Rig, raw: bytes, plan: bytearray, seq: int = 9) -> tuple[int, Any]:
    rig.ring_map[REQUEST_AT:REQUEST_AT + len(raw)] = raw
    txn = rig.kit.tier.env.begin()
    try:
        kind, value = ring.serve(_address(rig.ring_map), seq, len(raw), rig.table(), BLOCK, 128, rig.kit.scope.prefix,
                                 rig.mapping, txn, 0.0, plan)
        if kind == ring.PLANNED:
            assert rig.region[:] == bytes(len(rig.region)), "nothing copied before finish"
            assert rig.header.state == 2 and rig.header.answer_seq != seq, "nothing answered before finish"
            ring.finish(_address(rig.ring_map), seq, plan, value, BLOCK)
        return kind, value
    finally:
        txn.abort()


def test_a_planned_read_is_verified_then_copied_answered_and_published_by_finish(rig: Rig) -> None:
    offsets = [2 * BLOCK, 0, 6 * BLOCK, BLOCK]
    rig.header.state = 2
    assert planned(rig, read(rig.hashes, offsets), bytearray(16 * 128)) == (ring.PLANNED, 4)
    for block_hash, o in zip(rig.hashes, offsets, strict=True):
        assert rig.region[o:o + BLOCK] == rig.blocks[block_hash]
    h = rig.header
    assert (h.state, h.answer_seq, h.code) == (ANSWERED, 9, 0)
    expected = pb.TransferState(done=True, bytes_moved=4 * BLOCK, statuses=bytes([1]) * 4).SerializeToString()
    assert rig.ring_map[ANSWER_AT:ANSWER_AT + h.answer_length] == expected


def test_a_corrupt_block_is_handed_back_before_anything_is_copied(rig: Rig) -> None:
    data_file = Path(rig.kit.tier.env.path()) / "data.mdb"
    corrupt(data_file, rig.blocks[rig.hashes[2]])
    rig.header.state = 2
    raw = read(rig.hashes[:3], [0, BLOCK, 2 * BLOCK])
    assert planned(rig, raw, bytearray(16 * 128)) == (ring.HANDED_BACK, raw)
    assert rig.region[:] == bytes(len(rig.region)), "not even the blocks before the corrupt one landed"
    assert rig.header.state == 2


def test_a_miss_is_handed_back_with_a_plan_too(rig: Rig) -> None:
    raw = read([rig.hashes[0], b"\x05" * 32], [0, BLOCK])
    rig.header.state = 2
    assert planned(rig, raw, bytearray(16 * 128)) == (ring.HANDED_BACK, raw)
    assert rig.header.state == 2 and rig.region[:] == bytes(len(rig.region))


def test_a_short_plan_or_a_bad_finish_is_refused(rig: Rig) -> None:
    with pytest.raises(ValueError):
        planned(rig, read(rig.hashes, [0, BLOCK, 2 * BLOCK, 3 * BLOCK]), bytearray(16 * 127))
    for n, plan in ((0, bytearray(16)), (2, bytearray(16)), (129, bytearray(16 * 129))):
        with pytest.raises(ValueError):
            ring.finish(_address(rig.ring_map), 1, plan, n, BLOCK)
    with pytest.raises(ValueError):
        ring.finish(0, 1, bytearray(16), 1, BLOCK)
    assert rig.header.state != ANSWERED


def test_without_a_plan_serve_copies_and_writes_as_before(rig: Rig) -> None:
    assert rig.serve(read(rig.hashes[:2], [0, BLOCK])) == (ring.READY, 2)
    assert rig.region[:2 * BLOCK] == rig.blocks[rig.hashes[0]] + rig.blocks[rig.hashes[1]]


def test_a_request_of_more_than_plan_most_blocks_is_copied_in_serve(make_kit: Any) -> None:
    kit = make_kit(blocks=2000)  # room for 17 blocks of BLOCK bytes
    n = ring.PLAN_MOST + 1
    hashes = Kit.chain(0, n)
    data = [os.urandom(BLOCK) for _ in hashes]
    kit.tier.put(kit.scope, Kit.root, hashes, data, True)
    with mmap.mmap(-1, RING_BYTES) as ring_map, mmap.mmap(-1, n * BLOCK) as region:
        rig = Rig(kit, hashes, dict(zip(hashes, data, strict=True)), ring_map, region, ring.Mapping(kit.tier.env))
        plan = bytearray(16 * 128)
        assert planned(rig, read(hashes, [i * BLOCK for i in range(n)]), plan) == (ring.READY, n)
        assert region[:] == b"".join(data) and plan == bytearray(16 * 128), "copied in serve, no plan written"
        del rig
