"""The small-batch fast path (docs/TRANSFER.md, "Small batches"): a read of at most
`chunk_descriptors` descriptors submitted with `wait` is checked on the event loop
and looked up and copied by one copy thread. It must answer exactly as the session
path does (Submit, then GetTransfer), and within the same rules."""

from __future__ import annotations

import os
import threading
from typing import Any

import grpc
import pytest

from gateway.transfer_servicer import TransferServicer
from kvstore.client import Client, TransferSession
from kvstore.transfer import Descriptor, Op, group
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc


def servicer(server: Any) -> TransferServicer:
    """The running server's Transfer service (its `close` is one of the server's closers)."""
    return next(c.__self__ for c in server.closers if isinstance(getattr(c, "__self__", None), TransferServicer))


def request(session: TransferSession, descriptors: list[Descriptor], *, wait: bool,
            prefix_only: bool = False) -> pb.SubmitRequest:
    groups = [pb.DescriptorGroup(region_id=g.region_id, length_bytes=g.length_bytes, block_hashes=g.block_hashes,
                                 offsets_bytes=g.offsets_bytes.tolist()) for g in group(descriptors, Op.READ)]
    return pb.SubmitRequest(session_id=session.session_id, op=pb.TRANSFER_OP_READ, groups=groups, wait=wait,
                            prefix_only=prefix_only)


def both_ways(session: TransferSession, descriptors: list[Descriptor], prefix_only: bool
              ) -> tuple[pb.TransferState, pb.TransferState]:
    """The batch's final state on the fast path, then on the session path."""
    stub = session.stub
    fast = session.call(stub.Submit, request(session, descriptors, wait=True, prefix_only=prefix_only)).state
    started = session.call(stub.Submit, request(session, descriptors, wait=False, prefix_only=prefix_only))
    slow = session.call(stub.GetTransfer, pb.GetTransferRequest(
        session_id=session.session_id, transfer_id=started.transfer_id, wait_ms=10_000))
    return fast, slow


@pytest.mark.parametrize("prefix_only", [False, True])
def test_the_fast_path_answers_as_the_session_path_does(server: Any, prefix_only: bool) -> None:
    with Client(server.target) as a, Client(server.target) as b, a.transfer() as theirs, b.transfer() as s:
        size = b.block_bytes
        tokens = list(range(3 * b.block_tokens))
        blocks = [os.urandom(size) for _ in range(3)]
        b.put(tokens, blocks)
        hashes = b.hashes(tokens)
        mine = s.register(4 * size)
        other = theirs.register(size)
        descs = [Descriptor(block_hash=hashes[0], region_id=mine.region_id, offset_bytes=0, length_bytes=size),
                 Descriptor(block_hash=hashes[1], region_id=mine.region_id, offset_bytes=size, length_bytes=size),
                 Descriptor(block_hash=b"\x07" * 32, region_id=mine.region_id, offset_bytes=0, length_bytes=size),
                 Descriptor(block_hash=hashes[2], region_id=mine.region_id, offset_bytes=4 * size, length_bytes=size),
                 Descriptor(block_hash=hashes[2], region_id=mine.region_id, offset_bytes=0, length_bytes=size - 1),
                 Descriptor(block_hash=b"\x01" * 31, region_id=mine.region_id, offset_bytes=0, length_bytes=size),
                 Descriptor(block_hash=hashes[2], region_id=other.region_id, offset_bytes=0, length_bytes=size),
                 Descriptor(block_hash=hashes[2], region_id=987654, offset_bytes=0, length_bytes=size),
                 Descriptor(block_hash=hashes[2], region_id=mine.region_id, offset_bytes=2 * size, length_bytes=size)]
        fast, slow = both_ways(s, descs, prefix_only)
        assert fast.done and slow.done
        assert (fast.statuses, fast.bytes_moved) == (slow.statuses, slow.bytes_moved)
        assert list(fast.failures) == list(slow.failures)
        codes = {f.index: f.code for f in fast.failures}
        if not prefix_only:
            assert codes == {3: "INVALID_ARGUMENT", 4: "INVALID_ARGUMENT", 5: "INVALID_ARGUMENT",
                             6: "PERMISSION_DENIED", 7: "NOT_FOUND"}
            assert "descriptor 3 span" in {f.index: f.reason for f in fast.failures}[3]
            assert bytes(mine.view[: 3 * size]) == b"".join(blocks)
        assert bytes(other.view) == bytes(size), "nothing reached another session's region"


def test_the_fast_path_keeps_the_batch_bounds(server: Any, client: Client) -> None:
    with client.transfer() as s:
        region = s.register(client.block_bytes)
        empty = pb.SubmitRequest(session_id=s.session_id, op=pb.TRANSFER_OP_READ, wait=True)
        with pytest.raises(grpc.RpcError) as info:
            s.stub.Submit(empty)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1 to" in (info.value.details() or "")
        other = pb_grpc.TransferStub(grpc.insecure_channel(server.target,
                                                           options=[("grpc.use_local_subchannel_pool", 1)]))
        with pytest.raises(grpc.RpcError) as info:
            other.Submit(request(s, [Descriptor(block_hash=b"\0" * 32, region_id=region.region_id, offset_bytes=0,
                                                length_bytes=client.block_bytes)], wait=True))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_small_waited_read_does_not_queue_behind_the_lookup_thread(server: Any, client: Client) -> None:
    tokens = list(range(client.block_tokens))
    block = os.urandom(client.block_bytes)
    client.put(tokens, [block])
    held = threading.Event()
    lookups = servicer(server).copier._lookups
    lookups.submit(held.wait, 30)  # the lookup thread is busy with a long batch
    try:
        with Client(server.target, timeout_s=5) as quick, quick.transfer() as s:
            region = s.register(client.block_bytes)
            state = s.fetch(client.hashes(tokens), region)  # one batch: Submit with wait
            assert state.done_prefix == 1 and bytes(region.view) == block
    finally:
        held.set()
