"""The request ring's native server work (`tiers.ring.serve`), against a real LMDB tier.

Each test builds a real tier (tests/tiers/conftest.Kit), an anonymous ring and region
mapping, and calls `serve` as gateway/transfer_ring_native.py does. What `serve` answers
itself must be exactly what protobuf reads from the same bytes; everything else must come
back as the bytes it read, with nothing corrupt copied.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstore.native.ring import publish
from kvstore.transfer_ring import ANSWER_AT, ANSWERED, HEADER_AT, REQUEST_AT, RING_BYTES, Header
from kvstore.v1 import transfer_pb2 as pb
from tests.damage import corrupt
from tests.tiers.conftest import Kit
from tiers import ring

pytestmark = pytest.mark.skipif(not ring.NATIVE, reason="kvstore.native._ring is not built (no C compiler at install)")

BLOCK = 56_960  # the bench's block size: its records sit on LMDB overflow pages
REGION_ID = 7


def _address(m: mmap.mmap) -> int:
    probe = ctypes.c_char.from_buffer(m)
    address = ctypes.addressof(probe)
    del probe
    return address


@dataclass
class Rig:
    kit: Kit
    hashes: list[bytes]
    blocks: dict[bytes, bytes]
    ring_map: mmap.mmap
    region: mmap.mmap
    mapping: ring.Mapping

    @property
    def header(self) -> Header:
        return Header.from_address(_address(self.ring_map) + HEADER_AT)

    def table(self, region_id: int = REGION_ID, length: int | None = None) -> bytes:
        return ring.region_table([(region_id, _address(self.region), length or len(self.region))])

    def serve(self, raw: bytes, *, due_before: float = 0.0, table: bytes | None = None, seq: int = 5,
              txn: Any = None) -> tuple[int, Any]:
        self.ring_map[REQUEST_AT:REQUEST_AT + len(raw)] = raw
        own = txn is None
        txn = txn or self.kit.tier.env.begin()
        try:
            return ring.serve(_address(self.ring_map), seq, len(raw), table or self.table(), BLOCK, 128,
                              self.kit.scope.prefix, self.mapping, txn, due_before)
        finally:
            if own:
                txn.abort()

    def answer(self) -> pb.TransferState:
        h = self.header
        return pb.TransferState.FromString(self.ring_map[ANSWER_AT:ANSWER_AT + h.answer_length])


@pytest.fixture
def rig(make_kit: Any) -> Iterator[Rig]:
    kit = make_kit(blocks=400)
    hashes = Kit.chain(0, 4)
    data = [os.urandom(BLOCK) for _ in hashes]
    kit.tier.put(kit.scope, Kit.root, hashes, data, True)
    r = Rig(kit, hashes, dict(zip(hashes, data, strict=True)), mmap.mmap(-1, RING_BYTES), mmap.mmap(-1, 8 * BLOCK),
            ring.Mapping(kit.tier.env))
    yield r
    r.ring_map.close()
    r.region.close()


def read(hashes: list[bytes], offsets: list[int], *, region_id: int = REGION_ID, length: int = BLOCK,
         prefix_only: bool = True) -> bytes:
    return pb.SubmitRequest(op=pb.TRANSFER_OP_READ, prefix_only=prefix_only, groups=[pb.DescriptorGroup(
        region_id=region_id, length_bytes=length, block_hashes=b"".join(hashes), offsets_bytes=offsets)]
    ).SerializeToString()


def test_a_plain_read_is_copied_and_answered_as_protobuf_would_write_it(rig: Rig) -> None:
    offsets = [3 * BLOCK, 0, 5 * BLOCK, BLOCK]
    rig.header.state = 2
    assert rig.serve(read(rig.hashes, offsets)) == (ring.READY, 4)
    for block_hash, o in zip(rig.hashes, offsets, strict=True):
        assert rig.region[o:o + BLOCK] == rig.blocks[block_hash]
    h = rig.header
    assert (h.state, h.answer_seq, h.code) == (2, 5, 0), "written, not published"
    publish(_address(rig.ring_map) + HEADER_AT, ANSWERED)
    assert h.state == ANSWERED
    expected = pb.TransferState(done=True, bytes_moved=4 * BLOCK, statuses=bytes([1]) * 4).SerializeToString()
    assert rig.ring_map[ANSWER_AT:ANSWER_AT + h.answer_length] == expected


@pytest.mark.parametrize("case", ["missing", "due", "past the region", "unknown region", "block length",
                                  "short hashes", "two groups", "a write", "unpacked offsets"])
def test_anything_but_the_plain_case_is_handed_back_as_read(rig: Rig, case: str) -> None:
    kwargs: dict[str, Any] = {}
    raw = read(rig.hashes[:2], [0, BLOCK])
    if case == "missing":
        raw = read([rig.hashes[0], b"\x01" * 32], [0, BLOCK])
    elif case == "due":
        kwargs["due_before"] = 1e18
    elif case == "past the region":
        raw = read(rig.hashes[:2], [0, 7 * BLOCK + 1])
    elif case == "unknown region":
        raw = read(rig.hashes[:2], [0, BLOCK], region_id=8)
    elif case == "block length":
        raw = read(rig.hashes[:2], [0, BLOCK], length=BLOCK - 1)
    elif case == "short hashes":
        raw = read([rig.hashes[0], rig.hashes[1][:31]], [0, BLOCK])
    elif case == "two groups":
        g = pb.DescriptorGroup(region_id=REGION_ID, length_bytes=BLOCK, block_hashes=rig.hashes[0], offsets_bytes=[0])
        raw = pb.SubmitRequest(op=pb.TRANSFER_OP_READ, groups=[g, g]).SerializeToString()
    elif case == "a write":
        raw = raw.replace(b"\x10\x01", b"\x10\x02", 1)
    elif case == "unpacked offsets":  # valid protobuf, but not the shape the client writes
        raw = _with_unpacked_offset(pb.DescriptorGroup(region_id=REGION_ID, length_bytes=BLOCK,
                                                       block_hashes=rig.hashes[0]))
    rig.header.state = 0
    assert rig.serve(raw, **kwargs) == (ring.HANDED_BACK, raw)
    assert rig.header.state == 0, "not answered"
    if case in ("missing", "due"):
        assert rig.region[:] == bytes(len(rig.region)), "found blocks are checked before any is copied"


def _with_unpacked_offset(g: pb.DescriptorGroup) -> bytes:
    body = g.SerializeToString() + b"\x20\x00"  # offsets_bytes = [0], unpacked (wire type 0)
    assert list(pb.DescriptorGroup.FromString(body).offsets_bytes) == [0]
    return b"\x10\x01\x4a" + bytes([len(body)]) + body


def test_a_corrupt_block_is_handed_back_and_never_copied(rig: Rig, tmp_path: Path) -> None:
    data_file = Path(rig.kit.tier.env.path()) / "data.mdb"
    corrupt(data_file, rig.blocks[rig.hashes[1]])
    rig.region[:] = b"\xab" * len(rig.region)
    raw = read(rig.hashes[:3], [0, BLOCK, 2 * BLOCK])
    assert rig.serve(raw) == (ring.HANDED_BACK, raw)
    assert rig.region[BLOCK:3 * BLOCK] == b"\xab" * 2 * BLOCK, "nothing at or after the corrupt block landed"


def test_a_snapshot_whose_root_cannot_be_told_is_handed_back(rig: Rig) -> None:
    txn = rig.kit.tier.env.begin()
    try:
        raw = read(rig.hashes[:1], [0])
        assert rig.serve(raw, txn=txn)[0] == ring.READY
        for seed in (100, 200):  # two commits since: neither meta page is txn's any more
            more = Kit.chain(seed, 1)
            rig.kit.tier.put(rig.kit.scope, Kit.root, more, [os.urandom(BLOCK)], True)
        assert rig.serve(raw, txn=txn) == (ring.HANDED_BACK, raw)
    finally:
        txn.abort()


def _mutations(raw: bytes, rnd: random.Random) -> Iterator[bytes]:
    """Random damage to a good request: flipped bytes, cuts, additions, repeated fields."""
    for _ in range(1500):
        b = bytearray(raw)
        kind = rnd.randrange(5)
        if kind == 0:
            for _ in range(rnd.randrange(1, 4)):
                b[rnd.randrange(len(b))] = rnd.randrange(256)
        elif kind == 1:
            del b[rnd.randrange(len(b)):]
        elif kind == 2:
            b[rnd.randrange(len(b)):rnd.randrange(len(b))] = os.urandom(rnd.randrange(1, 6))
        elif kind == 3:
            b += rnd.choice([b"\x10\x01", b"\x20\x01", b"\x28\x01", b"\x0a\x01x", b"\x20\x02", b"\x4a\x00"])
        else:
            at = rnd.randrange(len(b))
            b[at] ^= 1 << rnd.randrange(8)
        yield bytes(b)


def test_what_the_native_parser_answers_is_what_protobuf_reads(rig: Rig) -> None:
    rnd = random.Random(13)
    offsets = [0, 2 * BLOCK, 4 * BLOCK, 6 * BLOCK]
    answered = handed_back = 0
    for raw in _mutations(read(rig.hashes, offsets), rnd):
        rig.region[:] = bytes(len(rig.region))
        kind, value = rig.serve(raw)
        if kind == ring.HANDED_BACK:
            assert value == raw
            handed_back += 1
            continue
        answered += 1
        request = pb.SubmitRequest.FromString(raw)  # protobuf takes it too, and reads the same read
        assert request.op == pb.TRANSFER_OP_READ and len(request.groups) == 1
        g = request.groups[0]
        assert (g.region_id, g.length_bytes, len(g.offsets_bytes)) == (REGION_ID, BLOCK, value)
        expected = bytearray(len(rig.region))  # the copies in order (a mutated offset may overlap another)
        for i, o in enumerate(g.offsets_bytes):
            expected[o:o + BLOCK] = rig.blocks[g.block_hashes[32 * i:32 * (i + 1)]]
        assert rig.region[:] == expected
        assert rig.answer().statuses == bytes([1]) * value
    assert answered and handed_back > 1000, (answered, handed_back)


def test_the_mapping_is_the_tiers_data_file(rig: Rig) -> None:
    page0 = ctypes.string_at(rig.mapping.base, 4096)
    assert struct.unpack_from("<I", page0, 16)[0] == 0xBEEFC0DE  # LMDB's meta magic
    assert rig.mapping.psize == 4096 and rig.mapping.length >= os.path.getsize(
        Path(rig.kit.tier.env.path()) / "data.mdb")
