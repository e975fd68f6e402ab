"""The ring's two servers: the native one (`gateway/transfer_ring_native.py`) and the Python one.

In-process servers (`start_server`, `server`): the test reaches the session's ring server to
switch its native half off, so each request can be answered by both and the answers compared.
The Child-based suite in test_transfer_ring.py runs `kvstore serve`, which serves natively
where `kvstore.native._ring` is built; here the Python server alone is exercised too.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gateway.transfer_ring as transfer_ring
from kvstore.client import Client, TransferSession
from kvstore.client.transfer_ring import _CODES, RingClient
from kvstore.config import StoreSettings
from kvstore.transfer_ring import ANSWER_AT, ANSWERED, REQUEST, REQUEST_AT
from kvstore.v1 import transfer_pb2 as pb
from tests.damage import corrupt
from tiers import ring as native_ring

needs_native = pytest.mark.skipif(not native_ring.NATIVE, reason="kvstore.native._ring is not built")


def ring_server(server: Any, session: TransferSession) -> transfer_ring.RingServer:
    """The server's side of `session`'s ring (an in-process server)."""
    from gateway.transfer_servicer import TransferServicer

    service = next(c.__self__ for c in server.closers if isinstance(getattr(c, "__self__", None), TransferServicer))
    found = service.table.sessions[session.session_id].ring
    assert isinstance(found, transfer_ring.RingServer)
    return found


def ask(ring: RingClient, payload: bytes) -> tuple[int, bytes]:
    """Write `payload` as a request and wait for the answer."""
    header, futex, view = ring._header, ring._futex, ring._view
    assert header is not None and futex is not None and view is not None
    ring._seq += 1
    view[REQUEST_AT:REQUEST_AT + len(payload)] = payload
    header.seq, header.length = ring._seq, len(payload)
    header.state = REQUEST
    futex.wake()
    deadline = time.monotonic() + 10
    while not (header.state == ANSWERED and header.answer_seq == ring._seq):
        assert time.monotonic() < deadline, "no answer"
        futex.wait(header.state, 0.05)
    return header.code, bytes(view[ANSWER_AT:ANSWER_AT + header.answer_length])


def stored(client: Client, n: int) -> tuple[list[bytes], list[bytes]]:
    tokens = list(range(n * client.block_tokens))
    blocks = [os.urandom(client.block_bytes) for _ in range(n)]
    client.put(tokens, blocks)
    return client.hashes(tokens), blocks


@needs_native
def test_plain_reads_are_answered_natively_and_counted_as_the_python_server_counts_them(server: Any) -> None:
    with Client(server.target) as client, client.transfer() as session:
        hashes, blocks = stored(client, 3)
        region = session.register(3 * client.block_bytes)
        served = ring_server(server, session)
        assert served.native is not None
        before = client.transfer_stats()
        gets = client.stats().gets
        state = session.fetch(hashes, region)
        assert state.done_prefix == 3 and bytes(region.view) == b"".join(blocks)
        assert served.native.answered == 1 and session.ring is not None and session.ring.answered == 1
        after = client.transfer_stats()
        assert after.read_batches == before.read_batches + 1
        assert after.descriptors_done == before.descriptors_done + 3
        assert after.bytes_moved == before.bytes_moved + 3 * client.block_bytes
        assert after.ring_requests == before.ring_requests + 1
        assert client.stats().gets == gets + 1, "the tier counted the get"
        # A miss is handed back: the Python read answers it, with the same result as Submit.
        missing = session.fetch([hashes[0], b"\x01" * 32, hashes[2]], region)
        assert served.native.answered == 1 and session.ring.answered == 2
        assert [r.status.value for r in missing.results] == ["done", "missing", "skipped"]


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_corrupt_block_fails_and_never_lands(start_server: Callable[..., Any], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    if native and not native_ring.NATIVE:
        pytest.skip("kvstore.native._ring is not built")
    if not native:
        monkeypatch.setattr(transfer_ring, "_native_ring", lambda *a: None)
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 30, block_tokens=16)
    server = start_server(store)
    with Client(server.target) as client, client.transfer() as session:
        hashes, blocks = stored(client, 3)
        corrupt(store.data_dir / "data.mdb", blocks[1])
        region = session.register(3 * client.block_bytes)
        assert (ring_server(server, session).native is not None) == native
        region.view[:] = b"\xab" * len(region.view)
        state = session.fetch(hashes, region, prefix_only=False)
        assert session.ring is not None and session.ring.answered == 1
        assert state.results[0].status.value == "done" and state.results[1].status.value == "failed"
        assert state.results[1].code == "DATA_LOSS"
        assert bytes(region.view[:client.block_bytes]) == blocks[0]
        assert bytes(region.view[client.block_bytes:2 * client.block_bytes]) == b"\xab" * client.block_bytes


def _requests(region_id: int, block_bytes: int, hashes: list[bytes]) -> list[bytes]:
    """Good, bad and randomly damaged ring requests."""
    def read(hs: list[bytes], offsets: list[int], **kw: Any) -> bytes:
        return pb.SubmitRequest(op=pb.TRANSFER_OP_READ, groups=[pb.DescriptorGroup(
            region_id=region_id, length_bytes=block_bytes, block_hashes=b"".join(hs), offsets_bytes=offsets)],
            **kw).SerializeToString()

    good = read(hashes, [0, block_bytes])
    out = [good, read(hashes, [block_bytes, 0], prefix_only=True), read(hashes[:1], [0]),
           read([hashes[0], b"\x02" * 32], [0, block_bytes], prefix_only=True),
           read(hashes, [0, 10 * block_bytes]), read(hashes, [0, 2**64 - 1]), b"", b"\xff\xff garbage",
           pb.SubmitRequest(op=pb.TRANSFER_OP_WRITE).SerializeToString()]
    rnd = random.Random(7)
    for _ in range(150):
        b = bytearray(good)
        b[rnd.randrange(len(b))] = rnd.randrange(256)
        out.append(bytes(b))
    return out


@needs_native
def test_the_native_and_python_servers_answer_every_request_alike(server: Any) -> None:
    with Client(server.target) as client, client.transfer() as session:
        hashes, _ = stored(client, 2)
        region = session.register(2 * client.block_bytes)
        served = ring_server(server, session)
        native = served.native
        assert native is not None and session.ring is not None
        for raw in _requests(region.region_id, client.block_bytes, hashes):
            region.view[:] = bytes(len(region.view))
            served.native = native
            code, answer = ask(session.ring, raw)
            landed = bytes(region.view)
            region.view[:] = bytes(len(region.view))
            served.native = None
            code2, answer2 = ask(session.ring, raw)
            assert code == code2, (raw, answer, answer2)
            if code == 0:
                assert pb.TransferState.FromString(answer) == pb.TransferState.FromString(answer2)
            else:
                assert answer == answer2
            assert landed == bytes(region.view)
        assert native.answered >= 3, "the good requests were answered natively"


def test_the_python_server_alone_serves_and_refuses(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_ring, "NATIVE", False)  # as where kvstore.native._ring was not built
    with Client(server.target) as client, client.transfer() as session:
        hashes, blocks = stored(client, 2)
        region = session.register(2 * client.block_bytes)
        assert ring_server(server, session).native is None and session.ring is not None
        assert session.fetch(hashes, region).done_prefix == 2 and bytes(region.view) == b"".join(blocks)
        code, answer = ask(session.ring, b"\xff\xff garbage")
        assert _CODES[code].name == "INVALID_ARGUMENT" and b"not a SubmitRequest" in answer
        assert session.ring.answered == 1
