"""The ring's lean fetch (docs/TRANSFER.md, "The request ring"): `TransferSession.fetch` of
consecutive slots builds its request from a template, reads an all-DONE answer without
protobuf and, where `kvstore.native._ring` is built, asks natively. Each test checks that what the
lean path gives is what the protobuf path (or Submit) gives, against a real `kvstore serve`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.client import transfer_ring as client_ring
from kvstore.client.transfer_ring_request import Template, all_done
from kvstore.errors import InvalidArgument, NotFound
from kvstore.transfer import DONE, TransferState
from kvstore.v1 import transfer_pb2 as pb
from tests.children import Child

SIZE = 56960


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Child]:
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(tmp_path / "data")], tmp_path / "logs")
    yield child
    child.kill_if_alive()


def stored(client: Client, n: int) -> tuple[list[bytes], list[bytes]]:
    tokens = list(range(n * client.block_tokens))
    blocks = [os.urandom(client.block_bytes) for _ in range(n)]
    client.put(tokens, blocks)
    return client.hashes(tokens), blocks


@pytest.mark.parametrize(("region_id", "offset", "n", "prefix_only"),
                         [(1, 0, 1, True), (7, 0, 8, False), (0, SIZE, 3, True), (1 << 40, 1 << 33, 128, False),
                          (300, 5, 16, True)])
def test_a_ring_template_writes_what_protobuf_writes(region_id: int, offset: int, n: int, prefix_only: bool) -> None:
    hashes = [bytes([i % 251]) * 32 for i in range(n)]
    template = Template(region_id, offset, n, SIZE, prefix_only)
    want = pb.SubmitRequest(op=pb.TRANSFER_OP_READ, prefix_only=prefix_only, groups=[pb.DescriptorGroup(
        region_id=region_id, length_bytes=SIZE, block_hashes=b"".join(hashes),
        offsets_bytes=range(offset, offset + n * SIZE, SIZE))]).SerializeToString()
    assert template.head + b"".join(hashes) + template.tail == want
    answer = pb.TransferState.FromString(template.answer)
    assert answer.done and answer.statuses == bytes([DONE]) * n and answer.bytes_moved == n * SIZE
    assert not answer.failures and not answer.transfer_id


def test_the_lean_all_done_state_is_the_dataclasss() -> None:
    lean = all_done(bytes([DONE]) * 5, SIZE)
    full = TransferState(transfer_id=0, done=True, statuses=bytes([DONE]) * 5, bytes_moved=5 * SIZE, block_bytes=SIZE)
    assert lean == full and lean.done_prefix == 5 and lean.results == full.results
    assert lean.failures == {} and lean.failures is not all_done(b"\x01", SIZE).failures


def test_the_lean_fetch_answers_as_submit_does_with_misses(serve: Child) -> None:
    with Client(serve.target) as client, client.transfer() as ring_s, client.transfer(ring=False) as plain:
        hashes, blocks = stored(client, 6)
        asked = [*hashes[:2], b"\x07" * 32, *hashes[2:]]
        got = []
        for session in (ring_s, plain):
            region = session.register(8 * client.block_bytes)
            for prefix_only in (True, False):
                state = session.fetch(asked, region, prefix_only=prefix_only)
                got.append((prefix_only, state.statuses, state.bytes_moved, dict(state.failures), state.done_prefix))
            assert bytes(region.view[: 2 * client.block_bytes]) == b"".join(blocks[:2])
        assert ring_s.ring is not None and ring_s.ring.answered == 2, "both went through the ring"
        assert got[:2] == got[2:]
        all_there = ring_s.fetch(hashes, ring_s.register(6 * client.block_bytes))
        assert all_there.done_prefix == 6 and all_there.bytes_moved == 6 * client.block_bytes


def test_bad_fetch_arguments_fail_as_without_a_ring(serve: Child) -> None:
    with Client(serve.target) as client, client.transfer() as ring_s, client.transfer(ring=False) as plain, \
            client.transfer() as third:
        hashes, _ = stored(client, 2)
        other = third.register(2 * client.block_bytes)
        for session in (ring_s, plain):
            region = session.register(2 * client.block_bytes)
            bad: list[dict[str, Any]] = [
                {"hashes": "ab" * 16}, {"hashes": [hashes[0], "x" * 32]}, {"hashes": [hashes[0], 5]},
                {"offset_bytes": -1}, {"offset_bytes": True}, {"offset_bytes": 1.0}, {"batch_descriptors": 0},
                {"prefix_only": 1}, {"offset_bytes": 1}, {"hashes": hashes * 2}]
            for change in bad:
                args: dict[str, Any] = {"hashes": hashes, "region": region, **change}
                with pytest.raises(InvalidArgument):
                    session.fetch(**args)
            with pytest.raises(NotFound):
                session.fetch(hashes, other)
            with pytest.raises(InvalidArgument):
                session.fetch(hashes, object())  # type: ignore[arg-type]
            # Good but not plain: a tuple, bytearrays, numpy ints: the long way, the same answer.
            odd: dict[str, Any] = {"hashes": tuple(bytearray(h) for h in hashes), "region": region,
                                   "offset_bytes": np.int64(0), "batch_descriptors": np.int32(8)}
            state = session.fetch(**odd)
            assert state.done_prefix == 2


def test_a_lean_fetch_sends_no_protobuf_and_parses_no_all_done_answer(serve: Child,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(serve.target) as client, client.transfer() as session:
        hashes, blocks = stored(client, 8)
        region = session.register(8 * client.block_bytes)
        assert session.ring is not None
        session.fetch(hashes, region)  # the template is built (it parses its answer once)

        def refused(*_: Any, **__: Any) -> Any:
            raise AssertionError("protobuf on the hot path")

        monkeypatch.setattr(client_ring.pb.SubmitRequest, "SerializeToString", refused)
        monkeypatch.setattr(client_ring.pb.TransferState, "FromString", refused)
        region.view[:] = bytes(len(region.view))
        state = session.fetch(hashes, region)
        assert state.done_prefix == 8 and bytes(region.view) == b"".join(blocks)
