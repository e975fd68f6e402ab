"""What one client may make the server hold is bounded (safety rule 6, docs/TRANSFER.md):
bytes mapped per session and per server, descriptors per session and in flight
per server, and the size of a GetTransfers reply. Past a bound the call answers
RESOURCE_EXHAUSTED naming it; the server goes on serving everybody else."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from gateway.transfer_session_table import SessionTable
from kvstore.client import Client
from kvstore.config import StoreSettings, TransferSettings
from kvstore.errors import ConfigError, ResourceExhausted
from kvstore.transfer import Descriptor, Status
from kvstore.v1 import transfer_pb2 as pb
from tiers.lmdb_tier import StagedReads

PAGE = 4096


def table(server: Any) -> SessionTable:
    return next(c.__self__.table for c in server.closers
                if isinstance(getattr(getattr(c, "__self__", None), "table", None), SessionTable))


def stored(client: Client, n: int) -> list[bytes]:
    tokens = list(range(3, 3 + n * client.block_tokens))
    client.put(tokens, [os.urandom(client.block_bytes) for _ in range(n)])
    return client.hashes(tokens)


@pytest.fixture
def held_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Read batches stay running until the test sets the event."""
    release = threading.Event()
    copy = StagedReads.copy

    def held(self: StagedReads, *args: Any, **kwargs: Any) -> bytes:
        release.wait(30)
        return copy(self, *args, **kwargs)

    monkeypatch.setattr(StagedReads, "copy", held)
    yield release
    release.set()


def reads(region_id: int, hashes: list[bytes], size: int) -> list[Descriptor]:
    return [Descriptor(block_hash=h, region_id=region_id, offset_bytes=i * size, length_bytes=size)
            for i, h in enumerate(hashes)]


def test_rule_6_a_session_maps_at_most_max_session_mapped_bytes(start_server: Callable[..., Any],
                                                                store_settings: StoreSettings) -> None:
    server = start_server(store_settings, transfer=TransferSettings(max_session_mapped_bytes=3 * PAGE))
    with Client(server.target) as client, client.transfer(path="shm") as session:
        first = session.register(2 * PAGE)
        session.register(PAGE)
        with pytest.raises(ResourceExhausted, match=r"would pass transfer\.max_session_mapped_bytes"):
            session.register(PAGE)
        session.deregister(first)
        session.register(2 * PAGE)  # room again
        assert table(server).mapped_bytes() == 3 * PAGE


def test_rule_6_the_server_maps_at_most_max_mapped_bytes(start_server: Callable[..., Any],
                                                         store_settings: StoreSettings) -> None:
    server = start_server(store_settings, transfer=TransferSettings(max_mapped_bytes=4 * PAGE))
    with Client(server.target) as a, Client(server.target) as b:
        first = a.transfer(path="shm")
        first.register(3 * PAGE)
        with b.transfer(path="shm") as second:
            with pytest.raises(ResourceExhausted, match=r"would pass transfer\.max_mapped_bytes"):
                second.register(2 * PAGE)
            second.register(PAGE)
            first.close()  # its bytes are the server's again once its stream ends
            assert wait_until(lambda: table(server).mapped_bytes() == PAGE)
            second.register(3 * PAGE)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        done.wait(0.02)
    return predicate()


def test_rule_6_a_session_runs_at_most_max_session_descriptors(start_server: Callable[..., Any],
                                                               store_settings: StoreSettings,
                                                               held_copies: threading.Event) -> None:
    settings = TransferSettings(max_descriptors=4, max_session_descriptors=6, copy_threads=1)
    server = start_server(store_settings, transfer=settings)
    with Client(server.target) as client, client.transfer(path="shm") as session:
        hashes = stored(client, 4)
        size = client.block_bytes
        region = session.register(4 * size)
        running = session.read(reads(region.region_id, hashes, size))
        with pytest.raises(ResourceExhausted, match=r"hold 4 descriptors; 3 more would pass "
                                                    r"transfer\.max_session_descriptors \(6\)"):
            session.read(reads(region.region_id, hashes[:3], size))
        # SubmitMany is refused whole, before any of its batches is even checked.
        batch = pb.SubmitRequest(op=pb.TRANSFER_OP_READ, groups=[pb.DescriptorGroup(
            region_id=region.region_id, length_bytes=size, block_hashes=hashes[0], offsets_bytes=[0])])
        with pytest.raises(grpc.RpcError) as info:
            session.stub.SubmitMany(pb.SubmitManyRequest(session_id=session.session_id, batches=[batch] * 3))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_session_descriptors" in (info.value.details() or "")
        assert session.read(reads(region.region_id, hashes[:2], size)).status().transfer_id  # 6 fit
        held_copies.set()
        assert running.wait(timeout_s=30).count(Status.DONE) == 4


def test_rule_6_finished_batches_are_forgotten_to_stay_within_max_session_descriptors(
        start_server: Callable[..., Any], store_settings: StoreSettings) -> None:
    server = start_server(store_settings, transfer=TransferSettings(max_descriptors=4, max_session_descriptors=8))
    with Client(server.target) as client, client.transfer(path="shm") as session:
        hashes = stored(client, 4)
        region = session.register(4 * client.block_bytes)
        ids = []
        for _ in range(3):  # 4 + 4 held; the third pushes the first out
            transfer = session.read(reads(region.region_id, hashes, client.block_bytes))
            transfer.wait(timeout_s=30)
            ids.append(transfer.transfer_id)
        held = table(server).sessions[session.session_id]
        assert held.held_descriptors == 8 and ids[0] not in held.transfers and ids[1] in held.transfers
        with pytest.raises(grpc.RpcError) as info:
            session.stub.GetTransfer(pb.GetTransferRequest(session_id=session.session_id, transfer_id=ids[0]))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_rule_6_the_server_runs_at_most_max_inflight_descriptors(start_server: Callable[..., Any],
                                                                 store_settings: StoreSettings,
                                                                 held_copies: threading.Event) -> None:
    settings = TransferSettings(max_descriptors=4, max_session_descriptors=4, max_inflight_descriptors=6,
                                copy_threads=1)
    server = start_server(store_settings, transfer=settings)
    with Client(server.target) as a, Client(server.target) as b, a.transfer(path="shm") as sa, \
            b.transfer(path="shm") as sb:
        hashes = stored(a, 4)
        size = a.block_bytes
        ra, rb = sa.register(4 * size), sb.register(4 * size)
        running = sa.read(reads(ra.region_id, hashes, size))
        with pytest.raises(ResourceExhausted, match=r"the server runs 4 descriptors for every session; 3 more "
                                                    r"would pass transfer\.max_inflight_descriptors \(6\)"):
            sb.read(reads(rb.region_id, hashes[:3], size))
        assert b.transfer_stats().descriptors_in_flight == 4
        held_copies.set()
        running.wait(timeout_s=30)
        assert sb.read(reads(rb.region_id, hashes[:3], size)).wait(timeout_s=30).count(Status.DONE) == 3
        assert b.transfer_stats().descriptors_in_flight == 0


def test_rule_6_get_transfers_answers_no_more_than_max_reply_bytes(start_server: Callable[..., Any],
                                                                   store_settings: StoreSettings) -> None:
    settings = TransferSettings(max_descriptors=64, max_reply_bytes=1 << 16)
    server = start_server(store_settings, transfer=settings)
    with Client(server.target) as client, client.transfer(path="shm") as session:
        size = client.block_bytes
        region = session.register(size)
        # Every descriptor fails with a reason (its span runs outside the region): ~9 KB of results a batch.
        bad = [Descriptor(block_hash=bytes([i]) * 32, region_id=region.region_id, offset_bytes=(i + 1) * size,
                          length_bytes=size) for i in range(64)]
        transfers = [session.read(bad) for _ in range(20)]
        ids = [t.transfer_id for t in transfers]
        reply = session.stub.GetTransfers(pb.GetTransfersRequest(
            session_id=session.session_id, transfer_ids=ids, wait_ms=10_000))
        assert reply.ByteSize() <= 1 << 16
        assert 0 < len(reply.states) < 20 and reply.omitted == 20 - len(reply.states)
        assert [s.transfer_id for s in reply.states] == ids[:len(reply.states)]
        # The client asks again for what was left out.
        states = session.wait_all(transfers, timeout_s=30)
        assert all(s.done and s.count(Status.FAILED) == 64 for s in states)


def test_a_fetch_larger_than_the_session_bound_goes_out_in_windows(start_server: Callable[..., Any],
                                                                   store_settings: StoreSettings) -> None:
    settings = TransferSettings(max_descriptors=4, max_session_descriptors=8)
    server = start_server(store_settings, transfer=settings)
    with Client(server.target) as client, client.transfer(path="shm") as session:
        hashes = stored(client, 20)
        region = session.register(20 * client.block_bytes)
        assert session.fetch(hashes, region, batch_descriptors=4).done_prefix == 20


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_descriptors": 8, "max_session_descriptors": 4}, "max_descriptors (8) <= max_session_descriptors (4)"),
    ({"max_session_descriptors": 1 << 21}, "<= max_inflight_descriptors"),
    ({"max_inflight_descriptors": 1 << 23}, "<= max_held_descriptors"),
    ({"max_descriptors": 4096, "max_reply_bytes": 1 << 20}, "cannot hold one batch's results"),
    ({"max_mapped_bytes": 0}, "transfer.max_mapped_bytes = 0 is out of range"),
    ({"max_session_mapped_bytes": -1}, "transfer.max_session_mapped_bytes = -1 is out of range"),
    ({"max_reply_bytes": float("nan")}, "transfer.max_reply_bytes = nan is out of range"),
])
def test_transfer_limits_are_checked_at_start(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransferSettings(**kwargs)
    assert words in info.value.message


def test_rule_6_the_server_maps_at_most_max_mapped_regions(start_server: Callable[..., Any],
                                                           store_settings: StoreSettings) -> None:
    server = start_server(store_settings, transfer=TransferSettings(max_mapped_regions=2))
    with Client(server.target) as a, Client(server.target) as b:
        first = a.transfer(path="shm")
        kept = first.register(PAGE)
        first.register(PAGE)
        with b.transfer(path="shm") as second:
            with pytest.raises(ResourceExhausted, match=r"maps 2 regions for every session, its most "
                                                        r"\(transfer\.max_mapped_regions\)"):
                second.register(PAGE)
            first.deregister(kept)
            second.register(PAGE)
            first.close()
            assert wait_until(lambda: table(server).mapped_regions() == 1)
            second.register(PAGE)


def test_rule_6_the_server_holds_at_most_max_sessions(start_server: Callable[..., Any],
                                                      store_settings: StoreSettings) -> None:
    server = start_server(store_settings, transfer=TransferSettings(max_sessions=2))
    with Client(server.target) as client:
        first, second = client.transfer(), client.transfer()
        with pytest.raises(ResourceExhausted, match=r"holds 2 transfer sessions, its most \(transfer\.max_sessions\)"):
            client.transfer()
        first.close()
        assert wait_until(lambda: len(table(server).sessions) == 1)
        client.transfer().close()
        second.close()


def test_rule_6_the_server_holds_at_most_max_held_descriptors(start_server: Callable[..., Any],
                                                              store_settings: StoreSettings) -> None:
    # Finished batches are remembered (their results take memory): a bound across sessions.
    settings = TransferSettings(max_descriptors=4, max_session_descriptors=8, max_inflight_descriptors=8,
                                max_held_descriptors=8)
    server = start_server(store_settings, transfer=settings)
    with Client(server.target) as a, Client(server.target) as b, Client(server.target) as c, \
            b.transfer(path="shm") as sb, c.transfer(path="shm") as sc:
        hashes = stored(a, 4)
        size = a.block_bytes
        sa = a.transfer(path="shm")
        ra, rb, rc = (s.register(4 * size) for s in (sa, sb, sc))
        sa.read(reads(ra.region_id, hashes, size)).wait(timeout_s=30)
        sc.read(reads(rc.region_id, hashes, size)).wait(timeout_s=30)
        with pytest.raises(ResourceExhausted, match=r"the server holds 8 descriptors of batches for every session; "
                                                    r"1 more would pass transfer\.max_held_descriptors \(8\)"):
            sb.read(reads(rb.region_id, hashes[:1], size))
        # A session holding some makes room by forgetting its own oldest.
        assert sa.read(reads(ra.region_id, hashes, size)).wait(timeout_s=30).count(Status.DONE) == 4
        assert table(server).load.descriptors_held == 8
        sa.close()  # its batches go with it
        assert wait_until(lambda: table(server).load.descriptors_held == 4)
        assert sb.read(reads(rb.region_id, hashes[:1], size)).wait(timeout_s=30).count(Status.DONE) == 1
