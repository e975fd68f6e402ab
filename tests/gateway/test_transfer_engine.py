"""The transfer engine (gateway/transfer_engine.py) and batch bookkeeping: chunks cut
across groups, prefix reads across chunks, the Python copy loop standing in for
the native one, GetTransfers, forgetting finished batches, and lookups bounded
ahead of copies."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from gateway.transfer_engine import Copier, ReadBatch, run_read
from gateway.transfer_servicer import TransferServicer
from gateway.transfer_sessions import Session
from kvstore.client import Client
from kvstore.config import StoreSettings, TransferSettings
from kvstore.errors import ResourceExhausted
from kvstore.geometry import V4_1_FLASH
from kvstore.native import blockcopy
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from kvstore.transfer import BatchResults, Descriptor, DescriptorGroup, Op, Status, check_spans
from kvstore.v1 import transfer_pb2 as pb
from tests.waiting import wait_until
from tiers.lmdb_tier import LmdbBlockTier, StagedReads


def stored(client: Client, n: int) -> tuple[list[bytes], list[bytes]]:
    """The hashes and bytes of a stored prompt of `n` full blocks."""
    tokens = list(range(7, 7 + n * client.block_tokens))
    blocks = [os.urandom(client.block_bytes) for _ in range(n)]
    client.put(tokens, blocks)
    return client.hashes(tokens), blocks


def servicer(server: Any) -> TransferServicer:
    return next(c.__self__ for c in server.closers if isinstance(getattr(c, "__self__", None), TransferServicer))


@pytest.fixture
def small_chunks(start_server: Callable[..., Any], store_settings: StoreSettings) -> Any:
    """A server copying 3 descriptors per chunk, on 2 copy threads."""
    return start_server(store_settings, transfer=TransferSettings(chunk_descriptors=3, copy_threads=2))


def test_chunks_cut_across_groups_land_every_block(small_chunks: Any) -> None:
    with Client(small_chunks.target) as client, client.transfer(path="shm") as session:
        hashes, blocks = stored(client, 9)
        size = client.block_bytes
        first, second = session.register(4 * size), session.register(5 * size)
        # Two groups (one per region), so chunks of 3 straddle the boundary between them.
        descriptors = [Descriptor(block_hash=h, region_id=first.region_id, offset_bytes=i * size, length_bytes=size)
                       for i, h in enumerate(hashes[:4])]
        descriptors += [Descriptor(block_hash=h, region_id=second.region_id, offset_bytes=(4 - i) * size,
                                   length_bytes=size) for i, h in enumerate(hashes[4:])]
        state = session.read(descriptors).wait(timeout_s=10)
        assert [r.status for r in state.results] == [Status.DONE] * 9
        assert bytes(first.view) == b"".join(blocks[:4])
        assert bytes(second.view) == b"".join(reversed(blocks[4:])), "each block at its own offset"


def test_prefix_read_stops_at_a_gap_in_a_later_chunk(small_chunks: Any) -> None:
    with Client(small_chunks.target) as client, client.transfer(path="shm") as session:
        hashes, blocks = stored(client, 9)
        hashes[7] = b"\x05" * 32  # not stored
        region = session.register(9 * client.block_bytes)
        state = session.fetch(hashes, region)
        assert state.done_prefix == 7
        assert [r.status for r in state.results][6:] == [Status.DONE, Status.MISSING, Status.SKIPPED]
        assert bytes(region.view[: 7 * client.block_bytes]) == b"".join(blocks[:7])
        assert bytes(region.view[7 * client.block_bytes:]) == bytes(2 * client.block_bytes)


def test_the_python_copy_loop_stands_in_on_one_thread(monkeypatch: pytest.MonkeyPatch,
                                                      start_server: Callable[..., Any],
                                                      store_settings: StoreSettings) -> None:
    monkeypatch.setattr(blockcopy, "NATIVE", False)
    monkeypatch.setattr(blockcopy, "verify_copy", blockcopy.verify_copy_python)
    server = start_server(store_settings, transfer=TransferSettings(chunk_descriptors=2, copy_threads=4))
    assert servicer(server).copier.threads == 1, "the Python loop holds the GIL: more threads only convoy"
    with Client(server.target) as client, client.transfer(path="shm") as session:
        hashes, blocks = stored(client, 5)
        region = session.register(5 * client.block_bytes)
        assert session.fetch(hashes, region).done_prefix == 5
        assert bytes(region.view) == b"".join(blocks)


def test_get_transfers_answers_for_several_batches_in_order(client: Client) -> None:
    with client.transfer(path="shm") as session:
        hashes, _ = stored(client, 4)
        region = session.register(4 * client.block_bytes)
        size = client.block_bytes
        transfers = [session.read([Descriptor(block_hash=h, region_id=region.region_id, offset_bytes=i * size,
                                              length_bytes=size)]) for i, h in enumerate([*hashes[:3], b"\1" * 32])]
        reply = session.stub.GetTransfers(pb.GetTransfersRequest(
            session_id=session.session_id, transfer_ids=[t.transfer_id for t in reversed(transfers)], wait_ms=10_000))
        assert [s.transfer_id for s in reply.states] == [t.transfer_id for t in reversed(transfers)]
        assert all(s.done for s in reply.states)
        assert [bytes(s.statuses) for s in reply.states] == [bytes([pb.DESCRIPTOR_STATUS_MISSING])] + [
            bytes([pb.DESCRIPTOR_STATUS_DONE])] * 3
        states = session.wait_all(transfers)
        assert [s.transfer_id for s in states] == [t.transfer_id for t in transfers]


@pytest.mark.parametrize(("ids", "code", "words"), [
    ([], grpc.StatusCode.INVALID_ARGUMENT, "1 to 1024 transfer ids"),
    (list(range(1, 1026)), grpc.StatusCode.INVALID_ARGUMENT, "got 1025"),
    ([424242], grpc.StatusCode.NOT_FOUND, "no transfer 424242"),
])
def test_get_transfers_refuses_bad_ids(client: Client, ids: list[int], code: grpc.StatusCode, words: str) -> None:
    with client.transfer(path="shm") as session:
        with pytest.raises(grpc.RpcError) as info:
            session.stub.GetTransfers(pb.GetTransfersRequest(session_id=session.session_id, transfer_ids=ids))
        assert info.value.code() == code and words in (info.value.details() or "")


def test_the_oldest_finished_batches_are_forgotten(start_server: Callable[..., Any],
                                                   store_settings: StoreSettings) -> None:
    server = start_server(store_settings, transfer=TransferSettings(keep_finished=2))
    with Client(server.target) as client, client.transfer(path="shm") as session:
        hashes, _ = stored(client, 1)
        region = session.register(client.block_bytes)
        descriptor = Descriptor(block_hash=hashes[0], region_id=region.region_id, offset_bytes=0,
                                length_bytes=client.block_bytes)
        ids = []
        for _ in range(3):
            transfer = session.read([descriptor])
            transfer.wait(timeout_s=10)
            ids.append(transfer.transfer_id)
        session.read([descriptor]).wait(timeout_s=10)  # the 4th: two finished are kept, so the first two go
        for gone in ids[:2]:
            with pytest.raises(grpc.RpcError) as info:
                session.stub.GetTransfer(pb.GetTransferRequest(session_id=session.session_id, transfer_id=gone))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        kept = session.stub.GetTransfer(pb.GetTransferRequest(session_id=session.session_id, transfer_id=ids[2]))
        assert kept.done


class WatchedSemaphore(threading.BoundedSemaphore):
    """A bounded semaphore that counts the threads waiting in `acquire`."""

    waiting = 0

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """As BoundedSemaphore's, counted in `waiting` while it blocks."""
        if super().acquire(blocking=False):
            return True
        if not blocking:
            return False
        self.waiting += 1
        try:
            return super().acquire(True, timeout)
        finally:
            self.waiting -= 1


def read_batch_of(store_settings: StoreSettings, n: int) -> tuple[LmdbBlockTier, ReadBatch, BlockScope]:
    """A real tier holding `n` blocks, and a checked read batch of all of them into a plain buffer."""
    tier = LmdbBlockTier(store_settings)
    scope = BlockScope(V4_1_FLASH.fingerprint, "default")
    root = root_hash(V4_1_FLASH.fingerprint, store_settings.block_tokens)
    hashes = chain_hashes(list(range(n * store_settings.block_tokens)), block_tokens=store_settings.block_tokens,
                          parent=root)
    size = V4_1_FLASH.block_bytes(store_settings.block_tokens)
    tier.put(scope, root, hashes, [os.urandom(size) for _ in hashes], True)
    region = memoryview(bytearray(n * size))
    group = DescriptorGroup.slots(hashes, region_id=1, offset_bytes=0, length_bytes=size)
    spans = check_spans([group], Op.READ, size, BatchResults(n), lambda _: region)
    return tier, ReadBatch(spans=spans, key_prefix=scope.prefix, block_bytes=size, prefix_only=False), scope


def test_lookups_run_at_most_two_chunks_per_copy_thread_ahead(monkeypatch: pytest.MonkeyPatch,
                                                               store_settings: StoreSettings) -> None:
    # Each looked-up chunk holds an LMDB reader slot until copied: many batches in
    # flight must not run the lookups far ahead of slow copies.
    tier, batch, _ = read_batch_of(store_settings, 12)
    open_at_copy: list[int] = []
    copy, stage_reads = StagedReads.copy, tier.stage_reads
    looked_up: list[int] = []

    def counted_stage_reads(keys: Any) -> StagedReads:
        staged = stage_reads(keys)
        looked_up.append(1)
        return staged

    def slow_copy(self: StagedReads, *args: Any, **kwargs: Any) -> bytes:
        # The lookup thread runs as far ahead as it is let: until it waits for a staged slot, or every
        # chunk is looked up (observed, so a loaded box cannot make it look held back).
        wait_until(lambda: watched.waiting or len(looked_up) == 12, "the lookup thread neither ran ahead nor waited")
        open_at_copy.append(sum(1 for line in tier.env.readers().splitlines()[1:] if line.split()[-1] != "-"))
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(StagedReads, "copy", slow_copy)
    monkeypatch.setattr(tier, "stage_reads", counted_stage_reads)
    copier = Copier(tier, threads=1)
    copier._staged = watched = WatchedSemaphore(copier.staged_limit)  # what its lookups wait on, watched
    futures = [copier.copy(batch, i, i + 1) for i in range(12)]
    assert [f.result(timeout=10)[0] for f in futures] == [bytes([pb.DESCRIPTOR_STATUS_DONE])] * 12
    copier.close()
    tier.close()
    assert max(open_at_copy) == copier.staged_limit == 2


def test_a_cancelled_batch_ends_only_after_its_copy_stops(monkeypatch: pytest.MonkeyPatch,
                                                          store_settings: StoreSettings) -> None:
    # Once a batch ends, its session may unmap the region: no copy may still be writing into it.
    tier, batch, scope = read_batch_of(store_settings, 4)
    copied_at: list[float] = []
    copy = StagedReads.copy
    copying, release = threading.Event(), threading.Event()

    def slow_copy(self: StagedReads, *args: Any, **kwargs: Any) -> bytes:
        copying.set()
        release.wait(60)  # the copy runs on until the test lets it end, after the cancel
        out = copy(self, *args, **kwargs)
        copied_at.append(time.monotonic())
        return out

    monkeypatch.setattr(StagedReads, "copy", slow_copy)
    copier = Copier(tier, threads=1)
    session = Session("s", "peer", V4_1_FLASH.name, scope, TransferSettings())
    transfer = session.new_transfer(frozenset({1}), len(batch))

    async def cancel_mid_copy() -> float:
        task = asyncio.create_task(run_read(tier, session, transfer, batch, 4, copier))
        while not copying.is_set():  # a copy is under way (observed, not assumed after a sleep)
            await asyncio.to_thread(copying.wait, 1.0)
        task.cancel()
        # The copy ends a moment after the cancel: a batch that ended at the cancel ends before it.
        asyncio.get_running_loop().call_later(0.1, release.set)
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic()

    ended_at = asyncio.run(cancel_mid_copy())
    assert copied_at and copied_at[0] <= ended_at
    copier.close()
    tier.close()


def test_submit_many_starts_every_batch_and_answers_their_ids_in_order(client: Client) -> None:
    with client.transfer(path="shm") as session:
        hashes, blocks = stored(client, 3)
        size = client.block_bytes
        region = session.register(3 * size)
        requests = [pb.SubmitRequest(op=pb.TRANSFER_OP_READ, groups=[pb.DescriptorGroup(
            region_id=region.region_id, length_bytes=size, block_hashes=h, offsets_bytes=[i * size])])
            for i, h in enumerate(hashes)]
        reply = session.stub.SubmitMany(pb.SubmitManyRequest(session_id=session.session_id, batches=requests))
        assert len(reply.transfer_ids) == 3 and list(reply.transfer_ids) == sorted(reply.transfer_ids)
        states = session.stub.GetTransfers(pb.GetTransfersRequest(
            session_id=session.session_id, transfer_ids=reply.transfer_ids, wait_ms=10_000)).states
        assert [bytes(s.statuses) for s in states] == [bytes([pb.DESCRIPTOR_STATUS_DONE])] * 3
        assert bytes(region.view) == b"".join(blocks)


def test_submit_many_refuses_the_whole_call_naming_the_bad_batch(server: Any, client: Client) -> None:
    with client.transfer(path="shm") as session:
        hashes, _ = stored(client, 1)
        size = client.block_bytes
        region = session.register(size)
        good = pb.SubmitRequest(op=pb.TRANSFER_OP_READ, groups=[pb.DescriptorGroup(
            region_id=region.region_id, length_bytes=size, block_hashes=hashes[0], offsets_bytes=[0])])
        empty = pb.SubmitRequest(op=pb.TRANSFER_OP_READ)
        with pytest.raises(grpc.RpcError) as info:
            session.stub.SubmitMany(pb.SubmitManyRequest(session_id=session.session_id, batches=[good, empty, good]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "batch 1: a batch holds 1 to" in (info.value.details() or "")
        assert "no batch was started" in (info.value.details() or "")
        table = servicer(server).table
        assert not table.sessions[session.session_id].transfers, "nothing started"
        with pytest.raises(grpc.RpcError) as info:
            session.stub.SubmitMany(pb.SubmitManyRequest(session_id=session.session_id))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "got 0" in (info.value.details() or "")


def test_fetch_of_more_batches_than_the_server_remembers(start_server: Callable[..., Any],
                                                         store_settings: StoreSettings) -> None:
    # keep_finished=2: a fetch of 7 one-descriptor batches goes out 2 at a time,
    # each pair collected before the next, so no batch is forgotten unread.
    server = start_server(store_settings, transfer=TransferSettings(keep_finished=2))
    with Client(server.target) as client, client.transfer(path="shm") as session:
        hashes, blocks = stored(client, 7)
        region = session.register(7 * client.block_bytes)
        state = session.fetch(hashes, region, batch_descriptors=1)
        assert state.done_prefix == 7 and bytes(region.view) == b"".join(blocks)


def test_a_session_runs_at_most_keep_finished_batches_at_once(monkeypatch: pytest.MonkeyPatch,
                                                               start_server: Callable[..., Any],
                                                               store_settings: StoreSettings) -> None:
    release = threading.Event()
    copy = StagedReads.copy

    def held_copy(self: StagedReads, *args: Any, **kwargs: Any) -> bytes:
        release.wait(10)  # batches stay running until the test lets them go
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(StagedReads, "copy", held_copy)
    server = start_server(store_settings, transfer=TransferSettings(keep_finished=2, copy_threads=1))
    with Client(server.target) as client, client.transfer(path="shm") as session:
        hashes, _ = stored(client, 1)
        region = session.register(client.block_bytes)
        descriptor = Descriptor(block_hash=hashes[0], region_id=region.region_id, offset_bytes=0,
                                length_bytes=client.block_bytes)
        running = [session.read([descriptor]), session.read([descriptor])]
        with pytest.raises(ResourceExhausted, match="2 batches of this session are running"):
            session.read([descriptor])
        request = pb.SubmitRequest(op=pb.TRANSFER_OP_READ, groups=[pb.DescriptorGroup(
            region_id=region.region_id, length_bytes=client.block_bytes, block_hashes=hashes[0], offsets_bytes=[0])])
        with pytest.raises(grpc.RpcError) as info:
            session.stub.SubmitMany(pb.SubmitManyRequest(session_id=session.session_id, batches=[request]))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        assert all(s.done for s in session.wait_all(running))
        assert session.read([descriptor]).wait(timeout_s=10).done, "room again once they finished"
