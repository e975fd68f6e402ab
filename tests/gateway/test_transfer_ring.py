"""The request ring (docs/TRANSFER.md, "The request ring"): small reads through shared memory.

Every test runs a real `kvstore serve` child (tests/children.Child) and real
sealed memfds: the ring's server thread, its futex and its checks of what an
untrusted client writes are exercised across two processes, as in production.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.client import Client, TransferSession
from kvstore.client.transfer_ring import _CODES, RingClient
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvstore.transfer import Descriptor, Op, group
from kvstore.transfer_ring import ANSWER_AT, ANSWERED, REQUEST, REQUEST_AT, REQUEST_BYTES, RING_DESCRIPTORS
from kvstore.v1 import transfer_pb2 as pb
from tests.children import Child
from tests.waiting import wait_until


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Child]:
    # A 1 s grace at SIGTERM (10 s by default): a clean stop ends the sessions' open streams sooner.
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(tmp_path / "data")], tmp_path / "logs",
                  env={"KVSTORE_SERVER_GRACE_S": "1"})
    yield child
    child.kill_if_alive()


def stored(client: Client, n: int, first: int = 0) -> tuple[list[bytes], list[bytes]]:
    """Put a chain of n random blocks; their hashes and bytes."""
    tokens = list(range(first, first + n * client.block_tokens))
    blocks = [os.urandom(client.block_bytes) for _ in range(n)]
    client.put(tokens, blocks)
    return client.hashes(tokens), blocks


def stop(pid: int) -> None:
    """SIGSTOP `pid` and wait until each of its threads is stopped: kill() returns before they are,
    and a ring request written in between may still be answered."""
    os.kill(pid, 19)
    deadline = time.monotonic() + 10
    tasks = Path(f"/proc/{pid}/task")
    while any(stat.read_text().rsplit(")", 1)[1].split()[0] != "T" for stat in tasks.glob("*/stat")):
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.001)


def counting_submits(session: TransferSession) -> list[str]:
    """Names of the Transfer calls `session` makes from now on."""
    names: list[str] = []
    call = session.call

    def counted(method: Any, request: Any) -> Any:
        names.append(type(request).__name__)
        return call(method, request)

    session.call = counted  # type: ignore[method-assign]
    session._paths["shm"].call = counted  # type: ignore[attr-defined]  # the path took the bound method
    return names


def raw_ask(ring: RingClient, payload: bytes, *, length: int | None = None, timeout_s: float = 10.0
            ) -> tuple[int, bytes]:
    """Write `payload` as a request (with `length` as the header says, if given) and wait for the answer."""
    header, futex, view = ring._header, ring._futex, ring._view
    assert header is not None and futex is not None and view is not None
    ring._seq += 1
    view[REQUEST_AT:REQUEST_AT + len(payload)] = payload
    header.seq, header.length = ring._seq, len(payload) if length is None else length
    header.state = REQUEST
    futex.wake()
    deadline = time.monotonic() + timeout_s
    while not (header.state == ANSWERED and header.answer_seq == ring._seq):
        assert time.monotonic() < deadline, "the server did not answer the ring"
        futex.wait(header.state, 0.05)
    return header.code, bytes(view[ANSWER_AT:ANSWER_AT + header.answer_length])


@pytest.mark.parametrize("n", [1, 8, 64])
def test_a_ring_fetch_lands_exactly_what_get_returns(serve: Child, n: int) -> None:
    with Client(serve.target) as client, client.transfer() as session:
        hashes, blocks = stored(client, 64)
        region = session.register(64 * client.block_bytes)
        assert session.ring is not None, session.ring_reason
        calls = counting_submits(session)
        state = session.fetch(hashes[:n], region, batch_descriptors=n)
        assert calls == [], "no gRPC call: the ring answered"
        assert session.ring.answered == 1
        assert state.done_prefix == n and state.bytes_moved == n * client.block_bytes
        assert bytes(region.view[: n * client.block_bytes]) == b"".join(blocks[:n])
        tokens = list(range(n * client.block_tokens))
        blocks_got, count = client.get_tensor(tokens)
        assert count == n and bytes(region.view[: n * client.block_bytes]) == blocks_got[:n].numpy().tobytes()
        stats = client.transfer_stats()
        assert stats.rings == 1 and stats.ring_requests == 1 and stats.descriptors_done == n


@pytest.mark.parametrize("prefix_only", [False, True])
def test_the_ring_answers_as_submit_does(serve: Child, prefix_only: bool) -> None:
    with Client(serve.target) as client, client.transfer() as ring_s, \
            client.transfer(ring=False) as plain, client.transfer() as other:
        size = client.block_bytes
        hashes, blocks = stored(client, 3)
        theirs = other.register(size)
        results = []
        for session in (ring_s, plain):
            mine = session.register(4 * size)
            descs = [Descriptor(block_hash=hashes[0], region_id=mine.region_id, offset_bytes=0, length_bytes=size),
                     Descriptor(block_hash=hashes[1], region_id=mine.region_id, offset_bytes=size, length_bytes=size),
                     Descriptor(block_hash=b"\x07" * 32, region_id=mine.region_id, offset_bytes=0, length_bytes=size),
                     Descriptor(block_hash=hashes[2], region_id=mine.region_id, offset_bytes=4 * size,
                                length_bytes=size),
                     Descriptor(block_hash=hashes[2], region_id=mine.region_id, offset_bytes=0, length_bytes=size - 1),
                     Descriptor(block_hash=b"\x01" * 31, region_id=mine.region_id, offset_bytes=0, length_bytes=size),
                     Descriptor(block_hash=hashes[2], region_id=theirs.region_id, offset_bytes=0, length_bytes=size),
                     Descriptor(block_hash=hashes[2], region_id=987654, offset_bytes=0, length_bytes=size),
                     Descriptor(block_hash=hashes[2], region_id=mine.region_id, offset_bytes=2 * size,
                                length_bytes=size)]
            calls = counting_submits(session)
            state = session._paths["shm"].read_many([group(descs, Op.READ)], prefix_only)[0].wait()
            # Reasons name the region: the same checks, each session's own region id.
            failures = {i: (c, r.replace(f"region {mine.region_id} ", "region MINE "))
                        for i, (c, r) in state.failures.items()}
            results.append((state.statuses, state.bytes_moved, failures))
            if session is ring_s:
                assert calls == [] and ring_s.ring is not None and ring_s.ring.answered == 1
            else:
                assert calls == ["SubmitRequest"]
            if not prefix_only:
                assert bytes(mine.view[: 3 * size]) == b"".join(blocks)
        assert results[0] == results[1]
        codes = {i: c for i, (c, _) in results[0][2].items()}
        if not prefix_only:
            assert codes == {3: "INVALID_ARGUMENT", 4: "INVALID_ARGUMENT", 5: "INVALID_ARGUMENT",
                             6: "PERMISSION_DENIED", 7: "NOT_FOUND"}
        assert bytes(theirs.view) == bytes(size), "nothing reached another session's region"


def test_hostile_ring_contents_get_errors_and_never_crash_or_hang_the_server(serve: Child) -> None:
    with Client(serve.target) as client, client.transfer() as session:
        hashes, blocks = stored(client, 2)
        region = session.register(2 * client.block_bytes)
        ring = session.ring
        assert ring is not None
        good = pb.DescriptorGroup(region_id=region.region_id, length_bytes=client.block_bytes,
                                  block_hashes=hashes[0], offsets_bytes=[0])
        cases = [
            (b"\xff\xff\xff\xff garbage", None, "INVALID_ARGUMENT", "not a SubmitRequest"),
            (b"", REQUEST_BYTES + 1, "INVALID_ARGUMENT", "past the request area"),
            (b"", 0xFFFFFFFF, "INVALID_ARGUMENT", "past the request area"),
            (b"", 0, "INVALID_ARGUMENT", "a ring request reads"),
            (pb.SubmitRequest(op=pb.TRANSFER_OP_READ).SerializeToString(), None, "INVALID_ARGUMENT", "1 to"),
            (pb.SubmitRequest(op=pb.TRANSFER_OP_WRITE, groups=[good]).SerializeToString(), None,
             "INVALID_ARGUMENT", "write with Submit"),
            (pb.SubmitRequest(op=pb.TRANSFER_OP_READ, groups=[pb.DescriptorGroup(
                region_id=region.region_id, length_bytes=client.block_bytes, block_hashes=hashes[0] * 129,
                offsets_bytes=[0] * (RING_DESCRIPTORS + 1))]).SerializeToString(), None, "INVALID_ARGUMENT",
             f"1 to {RING_DESCRIPTORS}"),
        ]
        cases.append((pb.SubmitRequest(op=pb.TRANSFER_OP_READ, groups=[good] + [pb.DescriptorGroup()] * 5000)
                      .SerializeToString(), None, "INVALID_ARGUMENT", "5001 groups"))
        for payload, length, code, words in cases:
            got, answer = raw_ask(ring, payload, length=length)
            assert got and answer, (payload[:20], length)
            assert _CODES[got].name == code and words in answer.decode(), answer
        # Spans past the region and a wrapping offset fail per descriptor, as Submit fails them.
        bad = pb.SubmitRequest(op=pb.TRANSFER_OP_READ, groups=[pb.DescriptorGroup(
            region_id=region.region_id, length_bytes=client.block_bytes, block_hashes=hashes[0] * 2,
            offsets_bytes=[2**64 - 1, len(region.view) - client.block_bytes + 1])])
        got, answer = raw_ask(ring, bad.SerializeToString())
        state = pb.TransferState.FromString(answer)
        assert got == 0 and [f.code for f in state.failures] == ["INVALID_ARGUMENT"] * 2
        # A client flipping the state word without a request: the server sleeps, and answers the next one.
        header, futex = ring._header, ring._futex
        assert header is not None and futex is not None
        for value in (7, 0, 2, 0xFFFFFFFF, 3) * 200:
            header.state = value
            futex.wake()
        assert serve.alive
        state2 = session.fetch(hashes, region)
        assert state2.done_prefix == 2 and bytes(region.view) == b"".join(blocks)
        # And the gRPC side still serves.
        assert client.lookup(list(range(2 * client.block_tokens))).found_blocks == 2
    assert serve.alive


def test_a_dead_client_ends_its_ring_and_session(serve: Child, tmp_path: Path) -> None:
    script = f"""
import os, sys, time
sys.path.insert(0, {str(Path.cwd())!r})
from kvstore.client import Client
c = Client({serve.target!r})
s = c.transfer()
r = s.register(c.block_bytes)
assert s.ring is not None, s.ring_reason
print("ready", flush=True)
time.sleep(600)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with Client(serve.target) as admin:
            stats = admin.transfer_stats()
            assert stats.sessions == 1 and stats.rings == 1
            proc.kill()
            proc.wait(timeout=30)
            deadline = time.monotonic() + 20
            while admin.transfer_stats().sessions or admin.transfer_stats().regions or admin.transfer_stats().rings:
                assert time.monotonic() < deadline, "the dead client's session (and ring) outlived it"
                time.sleep(0.05)
        maps = Path(f"/proc/{serve.proc.pid}/maps").read_text()
        assert "memfd:kvstore-" not in maps, "the server unmapped the ring and the region"
        threads = os.listdir(f"/proc/{serve.proc.pid}/task")
        names = [Path(f"/proc/{serve.proc.pid}/task/{t}/comm").read_text().strip() for t in threads]
        assert not [n for n in names if n.startswith("ring-")], "the ring's thread ended"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert serve.alive


def fetch_in_background(session: Any, hashes: list[bytes],
                        region: Any) -> tuple[threading.Thread, list[BaseException | None]]:
    """A fetch started on another thread, and where its outcome lands (None: it returned; else what it raised)."""
    outcome: list[BaseException | None] = []

    def fetch() -> None:
        try:
            session.fetch(hashes, region)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=fetch)
    waiter.start()
    return waiter, outcome


def asked(ring: RingClient, seq: int) -> None:
    """Until request `seq` of `ring` is written, its state word REQUEST: the client now waits for its answer."""
    header = ring._header
    assert header is not None
    wait_until(lambda: header.seq == seq and header.state == REQUEST, "the request was never written to the ring")


def test_a_dead_server_fails_a_waiting_ring_request_without_a_hang(serve: Child) -> None:
    client = Client(serve.target, timeout_s=60)
    session = client.transfer()
    hashes, _ = stored(client, 1)
    region = session.register(client.block_bytes)
    assert session.ring is not None
    stop(serve.proc.pid)  # SIGSTOP: the request is written but nobody answers
    seq = session.ring._seq + 1
    waiter, outcome = fetch_in_background(session, hashes, region)
    asked(session.ring, seq)
    assert not outcome, "the request waits while the server is stopped"
    started = time.monotonic()
    serve.kill9()
    waiter.join(timeout=15)
    assert not waiter.is_alive(), "the client hung on a dead server"
    assert isinstance(outcome[0], Unavailable) and time.monotonic() - started < 15
    assert session.ring is not None and session.ring.broken
    session.close()
    client.close()


def test_fetches_fall_back_to_submit_when_the_ring_is_unavailable(serve: Child) -> None:
    with Client(serve.target) as client:
        hashes, blocks = stored(client, 8)
        with TransferSession(client.connection, ring=False) as off:
            region = off.register(8 * client.block_bytes)
            assert off.ring is None and "off" in off.ring_reason
            calls = counting_submits(off)
            assert off.fetch(hashes, region).done_prefix == 8 and calls == ["SubmitRequest"]
            assert bytes(region.view) == b"".join(blocks)
        with client.transfer() as s:
            region = s.register(8 * client.block_bytes)
            assert s.ring is not None
            s.ring.broken = "broken for the test"  # e.g. after a timed-out request
            calls = counting_submits(s)
            assert s.fetch(hashes, region).done_prefix == 8 and calls == ["SubmitRequest"]
            assert bytes(region.view) == b"".join(blocks)
        with client.transfer(path="stream") as stream:
            region = stream.register(8 * client.block_bytes)
            assert stream.ring is None and stream.fetch(hashes, region).done_prefix == 8


def test_a_region_is_not_deregistered_under_a_ring_request_and_the_ring_is_not_a_region(serve: Child) -> None:
    with Client(serve.target) as client, client.transfer() as session:
        region = session.register(client.block_bytes)
        assert session.ring is not None
        # The ring's name is not a region: a second ring, or a ring of another name, is refused.
        with pytest.raises(FailedPrecondition, match="one ring per session"):
            RingClient(session)
        assert client.transfer_stats().regions == 1
        session.deregister(region)
        with pytest.raises(NotFound):
            session.fetch([b"\0" * 32], region)


def test_tenants_stay_apart_and_a_revoked_token_loses_its_ring(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    tokens_file = data / "tenants.json"
    rw = frozenset({"read", "write"})
    a_token = api_tokens.create(tokens_file, "tenant-a", rw)[1]
    b_token = api_tokens.create(tokens_file, "tenant-b", rw)[1]
    lease = "import kvstore.transfer_ring as r\nr.LEASE_S = 1.0\n"
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(data)], tmp_path / "logs", prelude=lease)
    try:
        with Client(child.target, token=a_token) as a, Client(child.target, token=b_token) as b, \
                a.transfer() as sa, b.transfer() as sb:
            hashes, blocks = stored(a, 2)
            ra = sa.register(2 * a.block_bytes)
            rb = sb.register(2 * b.block_bytes)
            assert sa.ring is not None and sb.ring is not None
            # b's ring: a's blocks are misses (b's scope), a's region is unknown to b.
            assert sb.fetch(hashes, rb, prefix_only=False).statuses == bytes([2, 2])
            descs = [Descriptor(block_hash=hashes[0], region_id=ra.region_id, offset_bytes=0,
                                length_bytes=b.block_bytes)]
            state = sb._paths["shm"].read_many([group(descs, Op.READ)], False)[0].wait()
            assert sb.ring.answered == 2 and [r.code for r in state.results] == ["NOT_FOUND"]
            assert bytes(ra.view) == bytes(len(ra.view)) and bytes(rb.view) == bytes(len(rb.view))
            assert sa.fetch(hashes, ra).done_prefix == 2 and bytes(ra.view) == b"".join(blocks)
            # Revoke b's token: once its lease (1 s here) runs out, its ring answers no more.
            api_tokens.revoke(tokens_file, "tenant-b")

            def refused() -> bool:  # once the lease ran out and the server re-read the tokens file
                try:
                    sb.fetch(hashes, rb)
                except (Unauthenticated, NotFound):
                    return True
                return False

            wait_until(refused, "a revoked tenant's ring still answered past its lease")
    finally:
        child.kill_if_alive()


def test_a_ring_request_of_another_session_cannot_be_made(serve: Child) -> None:
    # The ring belongs to the session that registered it: RegisterRegion(ring) names a session,
    # which another connection may not use (rule 1), so nobody else can renew or map it.
    with Client(serve.target) as a, a.transfer() as sa:
        sa.register(a.block_bytes)
        assert sa.ring is not None
        import grpc

        other = Client(serve.target, timeout_s=5)
        other.connection.channel = grpc.insecure_channel(serve.target, options=[("grpc.use_local_subchannel_pool", 1)])
        from kvstore.v1 import transfer_pb2_grpc as pb_grpc

        stub = pb_grpc.TransferStub(other.connection.channel)
        with pytest.raises(KVStoreError) as info:
            other.connection.call(stub.RegisterRegion, pb.RegisterRegionRequest(
                session_id=sa.session_id, shm_name=sa.ring._region.name if sa.ring._region else "", ring=True))
        assert type(info.value).__name__ == "PermissionDenied"
        other.close()


def test_a_bad_ring_argument_is_a_kvstore_error(serve: Child) -> None:
    with Client(serve.target) as client, pytest.raises(InvalidArgument, match="ring must be a bool"):
        TransferSession(client.connection, ring="yes")  # type: ignore[arg-type]
    assert struct.calcsize("<I") == 4


def test_each_ring_request_is_charged_to_the_tenants_request_rate(server: Any) -> None:
    # In-process server: its Transfer service is handed a request rate (gateway/server.py passes
    # the quota interceptor's) before the first ring is registered.
    from gateway.quotas import QuotaExceeded
    from gateway.transfer_servicer import TransferServicer

    charged: list[str] = []

    class Rate:
        def take(self, tenant: str) -> None:
            charged.append(tenant)
            if len(charged) > 2:
                raise QuotaExceeded(f"tenant {tenant!r} is over its requests_per_s quota of 2 requests/s")

    service = next(c.__self__ for c in server.closers if isinstance(getattr(c, "__self__", None), TransferServicer))
    service.rate = Rate()
    with Client(server.target) as client, client.transfer() as session:
        hashes, _ = stored(client, 1)
        region = session.register(client.block_bytes)
        assert session.ring is not None
        assert session.fetch(hashes, region).done_prefix == 1
        assert session.fetch(hashes, region).done_prefix == 1
        with pytest.raises(ResourceExhausted, match="requests_per_s"):
            session.fetch(hashes, region)
        assert charged == ["default"] * 3 and session.ring.answered == 3


def test_a_ring_read_is_use_durably_and_a_failed_refresh_fails_its_blocks(
        monkeypatch: pytest.MonkeyPatch, start_server: Any, tmp_path: Path, clock: Any) -> None:
    # In-process (its clock is the test's): a block read only through the ring 71 h after it
    # was stored outlives one stored with it and not read, once the store fills 2 h later.
    from concurrent.futures import Future

    from kvstore.config import StoreSettings
    from kvstore.geometry import V4_1_FLASH
    from tiers.lmdb_tier import LmdbBlockTier

    hour = 3600.0
    block_bytes = V4_1_FLASH.block_bytes(16)
    server = start_server(StoreSettings(data_dir=tmp_path / "store", capacity_bytes=4 * block_bytes,
                                        block_tokens=16))
    with Client(server.target) as client, client.transfer(path="shm") as session:
        bt = client.block_tokens
        fetched, idle = list(range(bt)), list(range(1000, 1000 + bt))
        for tokens in (fetched, idle):
            client.put(tokens, [os.urandom(client.block_bytes)])
        clock.advance(71 * hour)
        region = session.register(client.block_bytes)
        assert session.fetch(client.hashes(fetched), region).done_prefix == 1
        assert session.ring is not None and session.ring.answered == 1, "the ring served the read"
        clock.advance(2 * hour)
        with pytest.raises(ResourceExhausted):
            for i in range(8):
                client.put(list(range(10_000 * (i + 2), 10_000 * (i + 2) + bt)), [os.urandom(client.block_bytes)])
        assert client.get(fetched).blocks[0] is not None, "the block read through the ring was kept"
        assert client.lookup(idle).found_blocks == 0

        def failing(self: LmdbBlockTier, keys: Any) -> Future[None]:
            future: Future[None] = Future()
            future.set_exception(Unavailable("fsync failed"))
            return future

        clock.advance(hour)
        monkeypatch.setattr(LmdbBlockTier, "touch_soon", failing)
        state = session.fetch(client.hashes(fetched), region)
        assert session.ring.answered == 2
        assert state.done_prefix == 0 and state.results[0].code == "UNAVAILABLE"
        assert "retention refresh failed" in state.results[0].reason
        assert client.transfer_stats().refresh_failures == 1


def test_a_server_stopping_cleanly_closes_the_ring_and_the_client_sees_it(serve: Child) -> None:
    client = Client(serve.target, timeout_s=30)
    session = client.transfer()
    hashes, _ = stored(client, 1)
    region = session.register(client.block_bytes)
    assert session.ring is not None and session.fetch(hashes, region).done_prefix == 1
    started = time.monotonic()
    assert serve.stop() == 0, serve.log()  # SIGTERM: sessions end, ring threads stop and unmap
    assert time.monotonic() - started < 20
    with pytest.raises(Unavailable):
        session.fetch(hashes, region)
    assert session.ring.broken
    session.close()
    client.close()


def test_a_second_thread_falls_back_to_submit_while_the_ring_is_busy(serve: Child) -> None:
    with Client(serve.target) as client, client.transfer() as session:
        hashes, blocks = stored(client, 2)
        region = session.register(2 * client.block_bytes)
        ring = session.ring
        assert ring is not None
        calls = counting_submits(session)
        with ring._lock:  # another thread's request in flight
            assert session.fetch(hashes, region).done_prefix == 2
        assert calls == ["SubmitRequest"] and ring.answered == 0
        assert bytes(region.view) == b"".join(blocks)


def test_closing_the_session_ends_a_request_waiting_on_another_thread(serve: Child) -> None:
    client = Client(serve.target, timeout_s=60)
    session = client.transfer()
    hashes, _ = stored(client, 1)
    region = session.register(client.block_bytes)
    assert session.ring is not None
    stop(serve.proc.pid)  # SIGSTOP: nobody answers
    seq = session.ring._seq + 1
    waiter, outcome = fetch_in_background(session, hashes, region)
    asked(session.ring, seq)
    started = time.monotonic()
    try:
        session.close()  # the stream is cancelled first: the waiting request sees it end
        waiter.join(timeout=10)
        assert not waiter.is_alive() and time.monotonic() - started < 10
        assert isinstance(outcome[0], Unavailable)
    finally:
        os.kill(serve.proc.pid, 18)  # SIGCONT
        client.close()
