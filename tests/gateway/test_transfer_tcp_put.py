"""Put over the one-copy TCP transport, server side (docs/TRANSFER.md "Put over the one-copy TCP transport"): a
real server with real LMDB on loopback; raw sockets speak the put frames (`kvstore.transfer_tcp_wire`) to see
what it stores, answers and refuses, and that the listener goes on serving after a bad frame."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.transfer_tcp_put import TcpPuts
from kvstore import api_tokens
from kvstore import transfer_tcp_wire as wire
from kvstore.client import Client
from kvstore.config import StoreSettings, TransferSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.v1 import kvstore_pb2 as kv_pb
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc
from tests.gateway.test_transfer_tcp import _recv

TOKENS = 16
BLOCK_BYTES = V4_1_FLASH.block_bytes(TOKENS)
#: The servers' frame limit: 4 blocks.
MAX_FRAME = max(1 << 16, 4 * BLOCK_BYTES)


@pytest.fixture
def server(start_server: Callable[..., Any], tmp_path: Path) -> Any:
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=64 * BLOCK_BYTES, block_tokens=TOKENS)
    return start_server(store, transfer=TransferSettings(tcp_max_request_bytes=MAX_FRAME, tcp_timeout_s=5.0))


def _grant(target: str, token: str | None = None) -> pb.OpenPutReply:
    with grpc.insecure_channel(target) as channel:
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        return pb_grpc.TransferStub(channel).OpenPut(pb.OpenPutRequest(), timeout=10, metadata=metadata)


def _dial(reply: pb.OpenPutReply, hello: bool = True) -> socket.socket:
    assert reply.accepted, reply.reason
    sock = socket.create_connection(("127.0.0.1", reply.tcp_port), timeout=10)
    if hello:
        sock.sendall(wire.put_hello(reply.grant_id, reply.tcp_token))
    return sock


def _chain(n: int, seed: int = 0) -> tuple[list[int], list[bytes]]:
    return [seed * 100_000 + i for i in range(n * TOKENS)], [os.urandom(BLOCK_BYTES) for _ in range(n)]


def _frame(tokens: list[int], blocks: list[bytes], first: int = 0, parent: bytes = b"", **fields: Any) -> bytes:
    request = kv_pb.PutRequest(parent_hash=parent, token_ids=tokens[first * TOKENS:(first + len(blocks)) * TOKENS],
                               **fields)
    return wire.put_head(request.SerializeToString(), len(blocks), BLOCK_BYTES) + b"".join(blocks)


def _answer(sock: socket.socket) -> kv_pb.PutResponse | str:
    """The next answer: a PutResponse, or an error frame's text."""
    magic, length = wire.FRAME_HEAD.unpack(_recv(sock, wire.FRAME_HEAD.size))
    body = _recv(sock, length)
    if magic == wire.PUT_REPLY:
        return kv_pb.PutResponse.FromString(body)
    assert magic == wire.ERROR, magic
    return body.decode()


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_frames_are_stored_and_each_acknowledged_in_order(server: Any) -> None:
    tokens, blocks = _chain(6)
    with Client(server.target) as client:
        hashes = client.hashes(tokens)
        sock = _dial(_grant(server.target))
        sock.sendall(_frame(tokens, blocks[:4]) + _frame(tokens, blocks[4:], first=4, parent=hashes[3]))
        first, second = _answer(sock), _answer(sock)
        assert isinstance(first, kv_pb.PutResponse) and isinstance(second, kv_pb.PutResponse)
        assert list(first.block_hashes) + list(second.block_hashes) == hashes
        assert (first.written_blocks, second.written_blocks) == (4, 2)
        sock.shutdown(socket.SHUT_WR)  # the put's end
        assert _closed(sock)
        assert client.get(tokens).blocks == blocks


@pytest.mark.parametrize("bad, code", [
    (struct.pack("<4sIII", b"NOPE", 0, 1, BLOCK_BYTES), "INVALID_ARGUMENT: not a put frame"),
    (struct.pack("<4sIII", wire.PUT, 0, 5, BLOCK_BYTES), "RESOURCE_EXHAUSTED: a put frame of 5 blocks"),
    (struct.pack("<4sIII", wire.PUT, wire.MAX_HEAD_BYTES + 1, 1, BLOCK_BYTES),
     "INVALID_ARGUMENT: a put frame's header"),
    (struct.pack("<4sIII", wire.PUT, 3, 0, BLOCK_BYTES) + b"\xff\xff\xff", "INVALID_ARGUMENT: a put frame's header"),
    (wire.put_head(kv_pb.PutRequest(blocks=[b"x"]).SerializeToString(), 0, BLOCK_BYTES),
     "INVALID_ARGUMENT: a put frame's header"),
])
def test_a_bad_frame_ends_the_put_after_the_frames_before_it(server: Any, bad: bytes, code: str) -> None:
    tokens, blocks = _chain(3, seed=1)
    with Client(server.target) as client:
        sock = _dial(_grant(server.target))
        sock.sendall(_frame(tokens, blocks[:2]) + bad)
        assert isinstance(_answer(sock), kv_pb.PutResponse)  # the frame before it: stored and acknowledged
        error = _answer(sock)
        assert isinstance(error, str) and error.startswith(code), error
        assert _closed(sock)
        assert client.lookup(tokens).found_blocks == 2
        # The listener goes on serving: a new grant puts the rest.
        again = _dial(_grant(server.target))
        again.sendall(_frame(tokens, blocks[2:], first=2, parent=client.hashes(tokens)[1]))
        assert isinstance(_answer(again), kv_pb.PutResponse)
        assert client.get(tokens).blocks == blocks


def test_a_block_of_the_wrong_size_is_refused_and_nothing_of_its_frame_stored(server: Any) -> None:
    tokens, _ = _chain(1, seed=2)
    request = kv_pb.PutRequest(token_ids=tokens).SerializeToString()
    sock = _dial(_grant(server.target))
    sock.sendall(wire.put_head(request, 1, BLOCK_BYTES - 1) + b"\0" * (BLOCK_BYTES - 1))
    error = _answer(sock)
    assert isinstance(error, str) and error.startswith("INVALID_ARGUMENT"), error
    with Client(server.target) as client:
        assert client.lookup(tokens).found_blocks == 0


def test_a_grant_serves_one_put_and_a_wrong_token_none(server: Any) -> None:
    reply = _grant(server.target)
    wrong = _dial(reply, hello=False)
    wrong.sendall(wire.put_hello(reply.grant_id, bytes(wire.TOKEN_BYTES)))
    assert str(_answer(wrong)).startswith("UNAUTHENTICATED: no live put grant")
    first = _dial(reply)
    tokens, blocks = _chain(1, seed=3)
    first.sendall(_frame(tokens, blocks))
    assert isinstance(_answer(first), kv_pb.PutResponse)
    used = _dial(reply)  # the same grant again
    assert str(_answer(used)).startswith("UNAUTHENTICATED: no live put grant")


def test_a_read_only_token_gets_no_grant(server: Any) -> None:
    path = server.tenants.path
    reader = api_tokens.create(path, "reader", frozenset({"read"}))[1]
    writer = api_tokens.create(path, "writer", frozenset({"write"}))[1]
    server.tenants.refresh()
    with pytest.raises(grpc.RpcError) as refused:
        _grant(server.target, reader)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _grant(server.target, writer).accepted


def test_puts_off_are_refused_with_the_reason(start_server: Callable[..., Any], tmp_path: Path) -> None:
    store = StoreSettings(data_dir=tmp_path / "off", capacity_bytes=16 * BLOCK_BYTES, block_tokens=TOKENS)
    off = start_server(store, transfer=TransferSettings(tcp_put=False))
    reply = _grant(off.target)
    assert not reply.accepted and reply.reason == "transfer.tcp_put is off on this server"


def test_a_grant_lapses_after_the_timeout(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway import transfer_tcp_put

    reply = _grant(server.target)
    later = transfer_tcp_put.time.monotonic() + 5.0 + 1  # past the server's tcp_timeout_s
    monkeypatch.setattr(transfer_tcp_put.time, "monotonic", lambda: later)
    assert str(_answer(_dial(reply))).startswith("UNAUTHENTICATED: no live put grant")


def test_a_loopback_listener_grants_callers_on_this_host_only() -> None:
    from gateway.auth import OPEN_CALLER
    from gateway.transfer_tcp import TcpBulkServer

    tcp = TcpBulkServer(TransferSettings(tcp_put=False), None, lambda *_: None)  # type: ignore[arg-type]
    refused, _, _ = tcp.open_put(OPEN_CALLER, "ipv4:10.1.2.3:40000")
    assert refused == "the TCP listener binds 127.0.0.1 (transfer.tcp_host): it takes puts from this host only"
    for local in ("ipv4:127.0.0.1:40000", "ipv6:[::1]:40000"):  # on to the next check: puts off here
        assert tcp.open_put(OPEN_CALLER, local)[0] == "transfer.tcp_put is off on this server"


def test_noise_after_the_hello_never_crashes_the_listener(server: Any) -> None:
    rng = random.Random(7)
    tokens, blocks = _chain(2, seed=5)
    for _ in range(30):
        sock = _dial(_grant(server.target))
        head = struct.pack("<4sIII", wire.PUT if rng.random() < 0.7 else rng.randbytes(4), rng.randrange(64),
                           rng.randrange(6), rng.choice([BLOCK_BYTES, rng.randrange(1 << 16)]))
        sock.sendall(head + rng.randbytes(rng.randrange(4096)))
        sock.shutdown(socket.SHUT_WR)
        try:  # an error frame, or a close (what it sent was a whole, empty put); never a hang
            while True:
                answer = _answer(sock)
                assert isinstance(answer, kv_pb.PutResponse) or answer.split(":")[0] in (
                    "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "UNAVAILABLE"), answer
                if isinstance(answer, str):
                    break
        except (EOFError, ConnectionResetError):
            pass
        sock.close()
    with Client(server.target) as client:
        sock = _dial(_grant(server.target))
        sock.sendall(_frame(tokens, blocks))
        assert isinstance(_answer(sock), kv_pb.PutResponse)
        assert client.get(tokens).blocks == blocks


def test_frames_held_over_every_connection_are_bounded_in_bytes() -> None:
    """A frame that would pass MAX_HELD_BYTES with the frames other connections hold waits until one is answered
    (so many connections of large frames cannot exhaust the server's memory); one alone is always taken."""
    puts = TcpPuts(TransferSettings(), max_held_bytes=100)
    assert puts.reserve(150, lambda: False)  # alone: taken, though past the bound
    puts.unreserve(150)
    assert puts.reserve(60, lambda: False)
    taken = threading.Event()

    def take() -> None:
        if puts.reserve(60, lambda: False):
            taken.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 30
    while not puts.waiting_frames and time.monotonic() < deadline:
        waiter.join(0.01)
    assert puts.waiting_frames == 1 and not taken.is_set()  # 60 + 60 > 100: it waits for room
    puts.unreserve(60)
    assert taken.wait(30)
    stop = threading.Event()
    stop.set()
    assert not puts.reserve(60, stop.is_set)  # still full (the waiter's 60): a put that ended stops waiting


def test_each_frame_is_planned_on_its_connections_thread_as_the_grants_caller(
        start_server: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame's plan (checks, hashing, checksums) runs on the thread that read it, before the loop sees it: one
    hop to a thread less a frame (docs/BENCHMARKS.md, helper P5), and still as the grant's caller."""
    from gateway import auth
    from gateway.kvstore_servicer import KVStoreServicer

    planned: list[tuple[str, str]] = []
    real = KVStoreServicer.plan_put

    def plan(self: KVStoreServicer, request: Any) -> Any:
        planned.append((threading.current_thread().name, auth.current_caller().tenant))
        return real(self, request)

    monkeypatch.setattr(KVStoreServicer, "plan_put", plan)
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=64 * BLOCK_BYTES, block_tokens=TOKENS)
    server = start_server(store, transfer=TransferSettings(tcp_max_request_bytes=MAX_FRAME, tcp_timeout_s=5.0))
    writer = api_tokens.create(server.tenants.path, "alice", frozenset({"read", "write"}))[1]
    server.tenants.refresh()
    tokens, blocks = _chain(3, seed=5)
    with Client(server.target, token=writer) as client:
        sock = _dial(_grant(server.target, writer))
        sock.sendall(_frame(tokens, blocks[:2]) + _frame(tokens, blocks[2:], first=2, parent=client.hashes(tokens)[1]))
        assert isinstance(_answer(sock), kv_pb.PutResponse) and isinstance(_answer(sock), kv_pb.PutResponse)
        sock.shutdown(socket.SHUT_WR)
        assert _closed(sock)
        assert client.get(tokens).blocks == blocks
    assert planned == [("kvstore-tcp-read", "alice")] * 2


def test_a_refused_plan_ends_the_put_after_the_frames_before_it(server: Any) -> None:
    tokens, blocks = _chain(3, seed=6)
    with Client(server.target) as client:
        sock = _dial(_grant(server.target))
        short = kv_pb.PutRequest(parent_hash=client.hashes(tokens)[1], token_ids=tokens[2 * TOKENS:3 * TOKENS - 1])
        refused = wire.put_head(short.SerializeToString(), 1, BLOCK_BYTES) + blocks[2]  # a token short: its plan fails
        sock.sendall(_frame(tokens, blocks[:2]) + refused + _frame(tokens, blocks[2:], first=2,
                                                                    parent=client.hashes(tokens)[1]))
        assert isinstance(_answer(sock), kv_pb.PutResponse)  # the frame before it: stored and acknowledged
        error = _answer(sock)
        assert isinstance(error, str) and error.startswith("INVALID_ARGUMENT"), error
        assert client.lookup(tokens).found_blocks == 2  # nothing after the refused frame was stored
