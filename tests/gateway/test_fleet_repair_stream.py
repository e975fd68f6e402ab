"""A gRPC batch streamed in pieces (docs/FLEET.md F18d): the repairer sends a batch above STREAM_PIECE_BYTES as a
CopyBlocksStream, each piece read while the one before is sent and taken from the bucket before it goes; the
receiver checks each piece and commits it while the next arrives, in the stream's order, and answers once all are
durable. Real LMDB stores, a real gRPC server on loopback, and (for the repairer's pass) a real etcd."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway import fleet_repair
from gateway.fleet_servicer import SERVICE, TOKEN_METADATA, FleetServicer
from kvstore.v1 import fleet_pb2 as pb
from tests.conftest import LoopThread
from tests.damage import corrupt
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import BLOCK, RUN_BLOCKS, SCOPE, TOKEN, chain, copies, nodes, put  # noqa: F401
from tests.gateway.test_token_bucket import Recorded
from tiers import run_index

#: Seconds a test waits for a condition before it fails.
DEADLINE_S = 10.0


def _stream(loop_thread: LoopThread, node: Any, pieces: Any) -> Any:
    """One CopyBlocksStream of the async iterator `pieces` (CopyBlocksRequest messages) to `node`."""
    async def go() -> Any:
        return await node.stub.CopyBlocksStream(pieces(), metadata=((TOKEN_METADATA, TOKEN.decode()),))

    return loop_thread.run(go())


def _signal_commits(tier: Any) -> threading.Event:
    """An event set once a Put transaction of `tier` is durable (its group commit's `durable` returned: R34)."""
    committed = threading.Event()
    durable = tier.durable

    async def wrapped(pending: Any) -> Any:
        out = await durable(pending)
        committed.set()
        return out

    tier.durable = wrapped
    return committed


def test_f18d_a_streamed_pieces_blocks_are_durable_before_the_next_piece_is_sent(nodes: Any,  # noqa: F811
                                                                               loop_thread: LoopThread) -> None:
    """The receiver commits a piece as it arrives: the second piece (continuing the first's chain) is sent only once
    the first piece's blocks are stored there; the answer counts both, every block stored byte for byte."""
    a, b = nodes("a"), nodes("b")
    hashes, blocks = chain(RUN_BLOCKS)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    sent = copies(a.tier, keys)
    committed = _signal_commits(b.tier)

    async def pieces() -> Any:
        yield pb.CopyBlocksRequest(blocks=sent[:2])
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, committed.wait, DEADLINE_S)  # without it: nothing stored yet
        assert run_index.held(b.tier.env, keys) == [True, True, False, False]
        yield pb.CopyBlocksRequest(blocks=sent[2:])

    reply = _stream(loop_thread, b, pieces)
    assert (reply.written_blocks, reply.written_bytes) == (RUN_BLOCKS, RUN_BLOCKS * BLOCK)
    assert [data for _, data in b.tier.read(keys)] == blocks


def test_f18d_a_damaged_piece_fails_the_stream_and_what_came_before_it_stays_stored(nodes: Any,  # noqa: F811
                                                                                  loop_thread: LoopThread) -> None:
    """A piece whose block fails its checksum ends the stream FAILED_PRECONDITION: the pieces before it are
    durable (committed as they came), that block and the rest are not stored."""
    a, b = nodes("a"), nodes("b")
    hashes, blocks = chain(RUN_BLOCKS)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    sent = copies(a.tier, keys)
    sent[2].data = bytes([sent[2].data[0] ^ 1]) + sent[2].data[1:]

    async def pieces() -> Any:
        for i in range(RUN_BLOCKS):
            yield pb.CopyBlocksRequest(blocks=sent[i:i + 1])

    with pytest.raises(grpc.aio.AioRpcError) as failed:
        _stream(loop_thread, b, pieces)
    assert failed.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert run_index.held(b.tier.env, keys) == [True, True, False, False]


def _count_pieces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The blocks of each CopyBlocksStream piece the receivers check, in order."""
    seen: list[int] = []
    check = FleetServicer._stream_piece

    def counted(self: FleetServicer, raw: bytes) -> Any:
        batches = check(self, raw)
        seen.append(sum(len(x.hashes) for x in batches))
        return batches

    monkeypatch.setattr(FleetServicer, "_stream_piece", counted)
    return seen


def test_f18d_a_batch_above_a_piece_goes_as_a_stream_of_pieces_each_taken_from_the_bucket(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """With pieces of two blocks, three runs in one batch go as one stream of six pieces (a piece continuing a run
    sent without waiting for an answer); every byte is counted sent and taken from the bucket, piece by piece."""
    monkeypatch.setattr(fleet_repair, "STREAM_PIECE_BYTES", 2 * BLOCK)
    seen = _count_pieces(monkeypatch)
    tiers, _, view = fleet.start(["a", "b"])
    hashes, blocks = chain(3 * RUN_BLOCKS)
    put(tiers["a"], hashes, blocks)
    total = len(blocks) * BLOCK
    bucket = Recorded(rate=1e12, burst=1e12)
    progress = fleet.one_pass(fleet.repairer("a", view, bucket))
    assert (progress.copied_bytes, progress.sent_bytes, progress.failed_runs) == (total, total, 0)
    assert seen == [2] * 6
    assert [n for _, n in bucket.grants] == [2 * BLOCK] * 6
    assert [data for _, data in tiers["b"].read([SCOPE.key(h) for h in hashes])] == blocks


def test_f18d_a_damaged_block_in_a_later_piece_is_counted_and_not_sent_nor_what_follows_it(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A block found damaged by a later piece's read is counted once and dropped; its descendants in the pieces
    after it are not sent; the pieces before it are stored."""
    monkeypatch.setattr(fleet_repair, "STREAM_PIECE_BYTES", BLOCK)
    tiers, _, view = fleet.start(["a", "b"])
    hashes, blocks = chain(RUN_BLOCKS)
    put(tiers["a"], hashes, blocks)
    data_file = tmp_path / "a" / "data.mdb"
    corrupt(data_file, blocks[1])
    progress = fleet.one_pass(fleet.repairer("a", view))
    assert (progress.damaged_blocks, progress.copied_bytes, progress.sent_bytes) == (1, BLOCK, BLOCK)
    assert run_index.held(tiers["b"].env, [SCOPE.key(h) for h in hashes]) == [True, False, False, False]


def test_f18d_a_node_without_the_stream_is_sent_each_batch_as_one_copyblocks(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target that answers the stream UNIMPLEMENTED (an older node: here the method asked is one no node
    serves) is sent that batch, and the rest of the pass, as CopyBlocks: every run copied, none failed."""
    monkeypatch.setattr(fleet_repair, "STREAM_PIECE_BYTES", BLOCK)
    seen = _count_pieces(monkeypatch)

    def old_node(self: fleet_repair.Peers, address: str) -> Any:
        self.stub(address)
        return self._channels[address].stream_unary(SERVICE + "CopyBlocksStreamNotServed", request_serializer=None,
                                                    response_deserializer=pb.CopyBlocksResponse.FromString)

    monkeypatch.setattr(fleet_repair.Peers, "streamer", old_node)
    tiers, _, view = fleet.start(["a", "b"])
    chains = [chain(RUN_BLOCKS, seed=i) for i in range(3)]
    for hashes, blocks in chains:
        put(tiers["a"], hashes, blocks)
    progress = fleet.one_pass(fleet.repairer("a", view))
    assert (progress.copied_bytes, progress.failed_runs) == (3 * RUN_BLOCKS * BLOCK, 0)
    assert seen == []
    for hashes, blocks in chains:
        assert [data for _, data in tiers["b"].read([SCOPE.key(h) for h in hashes])] == blocks


def test_f20_every_fleet_method_is_open_at_the_tenant_auth_and_checks_the_fleet_token() -> None:
    """The auth interceptor lets every Fleet method by (they check the fleet's token themselves, F20): a method
    left out of METHODS would be refused with tenant auth on, and copies to that node would fail."""
    from gateway.fleet_servicer import METHODS

    served = [f"/{s.full_name}/{m.name}" for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods]
    assert SERVICE + "CopyBlocksStream" in served
    assert sorted(served) == sorted(METHODS)


def test_f20_a_stream_without_the_fleet_token_is_refused_and_stores_nothing(nodes: Any,  # noqa: F811
                                                                            loop_thread: LoopThread) -> None:
    a, b = nodes("a"), nodes("b")
    hashes, blocks = chain(RUN_BLOCKS)
    put(a.tier, hashes, blocks)
    keys = [SCOPE.key(h) for h in hashes]
    sent = copies(a.tier, keys)

    async def go() -> Any:
        async def pieces() -> Any:
            yield pb.CopyBlocksRequest(blocks=sent)

        return await b.stub.CopyBlocksStream(pieces())

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        loop_thread.run(go())
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert not any(run_index.held(b.tier.env, keys))
