"""BulkDrain (docs/TRANSFER.md "Bulk transport"): a BulkFetch the client gives up on leaves its
engine write running in the server; a client falling back to gRPC first waits for the session's
writes to end, so none lands in memory it has filled since. A real server with real LMDB and
real Mooncake engines on loopback; the server's engine writes are wrapped (slowed, or failed)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import grpc
import pytest

from gateway import transfer_bulk as server_bulk
from gateway import transfer_servicer
from gateway.transfer_bulk_lanes import Lanes
from kvstore.client import transfer_bulk as client_bulk
from kvstore.client.transfer import TransferSession
from kvstore.errors import Unavailable
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc
from tests.gateway import test_transfer_bulk as one_lane
from tests.gateway.test_transfer_bulk import BLOCK_BYTES, TOKENS, needs_engine
from tests.waiting import wait_until

pytestmark = needs_engine
# The one-lane tests' fixtures: a server with bulk on (two blocks a call), from the map and from staging.
source = one_lane.source
bulk_server = one_lane.bulk_server


def _stored(client: Any, n: int) -> tuple[list[bytes], list[bytes]]:
    tokens = list(range(n * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(n)]
    client.put(tokens, blocks)
    return client.hashes(tokens), blocks


class FirstFailsSecondLingers:
    """The server's engine write, wrapped, for a fetch of two calls in flight: once both writes
    have begun, the first call's (its blocks land lowest) fails at once, and the second's writes
    `slow_s` late. The client lands its calls in order, so it sees the failure, and gives up on
    the second call, while that call's write still runs. With `release`, that write waits for it
    instead (at most a minute): it still runs for as long as the test says."""

    def __init__(self, slow_s: float, release: threading.Event | None = None) -> None:
        self.slow_s = slow_s
        self.release = release
        self.real = server_bulk.write_blocks
        self.both = threading.Barrier(2, timeout=10)
        self.lowest: list[int] = []
        self.failed_at = self.ended_at = 0.0

    def __call__(self, engine: Any, segment: str, local: list[int], remote: list[int], block_bytes: int) -> int:
        self.lowest.append(min(remote))
        if len(self.lowest) <= 2:
            self.both.wait()
            if min(remote) == min(self.lowest):
                self.failed_at = time.monotonic()
                return -1
            if self.release is None:
                time.sleep(self.slow_s)
            else:
                self.release.wait(60)
            try:
                return self.real(engine, segment, local, remote, block_bytes)
            finally:
                self.ended_at = time.monotonic()
        return self.real(engine, segment, local, remote, block_bytes)


def test_a_write_left_running_by_a_failed_call_ends_before_the_grpc_fallback_returns(
        bulk_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_bulk, "IN_FLIGHT", 2)
    client, _ = bulk_server
    hashes, blocks = _stored(client, 4)  # two BulkFetch calls of two blocks, both in flight
    write = FirstFailsSecondLingers(slow_s=1.0)
    monkeypatch.setattr(server_bulk, "write_blocks", write)
    with TransferSession(client.connection, path="bulk", streams=2) as session:
        region = session.register(4 * BLOCK_BYTES)
        state = session.fetch(hashes, region, batch_descriptors=4)
        returned = time.monotonic()
        assert session.bulk is None and "BulkFetch failed" in session.bulk_reason
        assert state.done_prefix == 4 and bytes(region.view) == b"".join(blocks)
    assert 0 < write.ended_at <= returned, "the fallback waited for the write its failed call left running"
    assert 0 < write.failed_at < write.ended_at, "the failure came while that write still ran"


def test_a_write_still_running_past_the_drain_fails_the_fetch(bulk_server: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_bulk, "IN_FLIGHT", 2)
    # The server waits 0.5 s of this deadline for the write, then answers with 5 s to spare (0.2 s by
    # default: a loaded box's answer missed it): one write left.
    monkeypatch.setattr(client_bulk, "DRAIN_S", 5.5)
    monkeypatch.setattr(transfer_servicer, "DRAIN_MARGIN_S", 5.0)
    client, _ = bulk_server
    hashes, _ = _stored(client, 4)
    write = FirstFailsSecondLingers(slow_s=0.0, release=threading.Event())  # it runs until released
    monkeypatch.setattr(server_bulk, "write_blocks", write)
    with TransferSession(client.connection, path="bulk", streams=2) as session:
        region = session.register(4 * BLOCK_BYTES)
        try:
            with pytest.raises(Unavailable, match="1 of the server's writes into this session's regions still run"):
                session.fetch(hashes, region, batch_descriptors=4)
        finally:
            assert write.release is not None
            write.release.set()
        wait_until(lambda: write.ended_at > 0, "the stuck write never ended")  # before the session does


def test_bulk_drain_answers_for_its_own_sessions_only(bulk_server: Any) -> None:
    client, _ = bulk_server
    stub = pb_grpc.TransferStub(client.connection.channel)
    events = stub.OpenSession(pb.OpenSessionRequest())
    sid = next(events).session_id
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.BulkDrain(pb.BulkDrainRequest(session_id=sid))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # no OpenBulk yet
        with pytest.raises(grpc.RpcError) as err:
            stub.BulkDrain(pb.BulkDrainRequest(session_id="f" * 32))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert stub.OpenBulk(pb.OpenBulkRequest(session_id=sid, transport="mooncake",
                                                segment="127.0.0.1:1")).accepted
        assert stub.BulkDrain(pb.BulkDrainRequest(session_id=sid)).writing == 0  # nothing written yet
    finally:
        events.cancel()


def test_drain_counts_the_writes_a_cancelled_call_left_running() -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    async def run(pool: ThreadPoolExecutor) -> None:
        lanes, release = Lanes(), threading.Event()
        write = lanes.submit(pool, lambda: int(release.wait(5)))
        write.cancel()  # the call's await ends; the write does not
        assert len(lanes.running) == 1 and await lanes.drain(0.05) == 1
        release.set()
        assert await lanes.drain(5.0) == 0 and not lanes.running

    with ThreadPoolExecutor(2) as pool:
        asyncio.run(run(pool))


def test_a_session_the_server_no_longer_knows_falls_back_as_before(bulk_server: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.errors import FailedPrecondition

    async def ended(self: Lanes, timeout_s: float) -> int:  # as BulkDrain answers once the session ended there
        raise FailedPrecondition("this session has no bulk transport")

    monkeypatch.setattr(client_bulk, "IN_FLIGHT", 2)
    monkeypatch.setattr(Lanes, "drain", ended)
    client, _ = bulk_server
    hashes, blocks = _stored(client, 4)
    monkeypatch.setattr(server_bulk, "write_blocks", FirstFailsSecondLingers(slow_s=0.0))
    with TransferSession(client.connection, path="bulk", streams=2) as session:
        region = session.register(4 * BLOCK_BYTES)
        state = session.fetch(hashes, region, batch_descriptors=4)
        assert session.bulk is None and state.done_prefix == 4 and bytes(region.view) == b"".join(blocks)
