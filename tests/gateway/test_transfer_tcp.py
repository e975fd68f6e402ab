"""The one-copy TCP transport, server side (docs/TRANSFER.md "The one-copy TCP transport"): a real
server with real LMDB on loopback; raw sockets speak the frames (`kvstore.transfer_tcp_wire`) to
see what it sends and refuses, and that it goes on serving."""

from __future__ import annotations

import os
import random
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore import transfer_tcp_wire as wire
from kvstore.client import Client
from kvstore.client.transfer import TransferSession
from kvstore.config import StoreSettings, TransferSettings
from kvstore.errors import ConfigError
from kvstore.geometry import V4_1_FLASH
from kvstore.transfer import DONE, FAILED, MISSING
from kvstore.v1 import transfer_pb2 as pb
from tests.gateway.test_transfer_fetch import corrupt

TOKENS = 16
BLOCK_BYTES = V4_1_FLASH.block_bytes(TOKENS)


def _settings(**kw: Any) -> TransferSettings:
    return TransferSettings(tcp_bulk=True, tcp_max_request_bytes=max(1 << 16, 4 * BLOCK_BYTES), **kw)


@pytest.fixture
def tcp_server(start_server: Callable[..., Any], tmp_path: Path) -> Iterator[tuple[Any, Client, Path]]:
    """A server with `transfer.tcp_bulk` on (4 blocks a request), a client and the LMDB file."""
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=64 * BLOCK_BYTES, block_tokens=TOKENS)
    server = start_server(store, transfer=_settings(tcp_max_connections=3, tcp_timeout_s=5.0))
    with Client(server.target) as c:
        yield server, c, store.data_dir / "data.mdb"


def _put(client: Client, n: int) -> tuple[list[bytes], list[bytes]]:
    tokens = list(range(n * TOKENS))
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(n)]
    client.put(tokens, blocks)
    return client.hashes(tokens), blocks


class _Granted:
    """A session opened over gRPC with the TCP transport granted: its id, token and the listener."""

    def __init__(self, client: Client) -> None:
        self.session = TransferSession(client.connection, path="stream")  # a session, no transport of its own
        events = self.session.stub.OpenSession(
            pb.OpenSessionRequest(geometry=client.connection.geometry), metadata=client.connection.metadata
        )
        first = next(events)
        self.events = events
        self.session_id = first.session_id
        assert "tcp" in first.bulk_transports
        reply = client.connection.call(
            self.session.stub.OpenBulk, pb.OpenBulkRequest(session_id=self.session_id, transport="tcp")
        )
        assert reply.accepted, reply.reason
        self.port, self.token, self.max_blocks = reply.tcp_port, reply.tcp_token, reply.max_blocks

    def dial(self, hello: bool = True) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        if hello:
            sock.sendall(wire.hello(self.session_id, self.token))
        return sock

    def close(self) -> None:
        self.events.cancel()
        self.session.close()


@pytest.fixture
def granted(tcp_server: Any) -> Iterator[_Granted]:
    g = _Granted(tcp_server[1])
    yield g
    g.close()


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise EOFError(f"closed after {len(data)} of {n} bytes")
        data += more
    return data


def _reply(sock: socket.socket) -> tuple[bytes, list[Any], bytes]:
    """(statuses, failures, the blocks' bytes) of one reply; raises AssertionError on an error frame."""
    magic, length = wire.FRAME_HEAD.unpack(_recv(sock, wire.FRAME_HEAD.size))
    body = _recv(sock, length)
    assert magic == wire.REPLY, body.decode()
    header = pb.FetchReply.FromString(body)
    data = _recv(sock, header.statuses.count(DONE) * BLOCK_BYTES)
    assert _recv(sock, 4) == wire.END
    return header.statuses, list(header.failures), data


def _error(sock: socket.socket) -> str:
    """The error frame the server sends, then the connection is closed."""
    magic, length = wire.FRAME_HEAD.unpack(_recv(sock, wire.FRAME_HEAD.size))
    assert magic == wire.ERROR
    text = _recv(sock, length).decode()
    assert sock.recv(1) == b""  # closed after it
    return text


def test_t1_a_request_gets_the_stored_bytes_from_the_map(tcp_server: Any, granted: _Granted) -> None:
    _, client, _ = tcp_server
    hashes, blocks = _put(client, 4)
    with granted.dial() as sock:
        sock.sendall(wire.request(b"".join(hashes), False) + wire.request(hashes[2] + b"\7" * 32, False))
        statuses, failures, data = _reply(sock)
        assert statuses == bytes([DONE] * 4) and not failures and data == b"".join(blocks)
        statuses, _, data = _reply(sock)  # pipelined: the second answered after the first
        assert statuses == bytes([DONE, MISSING]) and data == blocks[2]


def test_t2_a_damaged_block_is_never_sent(tcp_server: Any, granted: _Granted) -> None:
    _, client, data_file = tcp_server
    hashes, blocks = _put(client, 3)
    corrupt(data_file, blocks[1])
    with granted.dial() as sock:
        sock.sendall(wire.request(hashes[0] + hashes[2] + hashes[1], False))
        statuses, failures, data = _reply(sock)
    assert statuses == bytes([DONE, DONE, FAILED])
    assert [(f.index, f.code) for f in failures] == [(2, "DATA_LOSS")]
    assert data == blocks[0] + blocks[2]  # the damaged block's bytes are not among them


def test_t3_a_wrong_token_or_session_is_refused(tcp_server: Any, granted: _Granted) -> None:
    with socket.create_connection(("127.0.0.1", granted.port), timeout=10) as sock:
        sock.sendall(wire.hello(granted.session_id, bytes(wire.TOKEN_BYTES)))
        assert _error(sock).startswith("UNAUTHENTICATED: no open session with this id holds this token")
    with socket.create_connection(("127.0.0.1", granted.port), timeout=10) as sock:
        sock.sendall(wire.hello("no-such-session", granted.token))
        assert _error(sock).startswith("UNAUTHENTICATED")
    with granted.dial(hello=False) as sock:  # a request before the hello
        sock.sendall(wire.request(b"\1" * 32, False))
        assert _error(sock).startswith("INVALID_ARGUMENT: the first frame must be a hello")


def test_t4_an_oversized_or_bad_request_is_refused_with_its_limit(tcp_server: Any, granted: _Granted) -> None:
    assert granted.max_blocks == 4
    with granted.dial() as sock:
        sock.sendall(wire.request(b"\1" * 32 * 5, False))
        text = _error(sock)
    assert text.startswith("INVALID_ARGUMENT: a request holds 1 to 4 blocks (transfer.tcp_max_request_bytes")
    with granted.dial() as sock:
        sock.sendall(wire.REQUEST_HEAD.pack(wire.REQUEST, 0, 0))
        assert "got 0" in _error(sock)
    with granted.dial() as sock:
        sock.sendall(wire.REQUEST_HEAD.pack(wire.REQUEST, 1, 0x80) + b"\1" * 32)
        assert _error(sock) == "INVALID_ARGUMENT: unknown request flags 0x80"
    with granted.dial() as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert _error(sock).startswith("INVALID_ARGUMENT: not a request frame")


def test_t5_a_session_that_ended_is_refused_at_its_next_request(tcp_server: Any, granted: _Granted) -> None:
    _, client, _ = tcp_server
    hashes, _ = _put(client, 1)
    sock = granted.dial()
    sock.sendall(wire.request(hashes[0], False))
    _reply(sock)
    granted.close()  # the session's stream ends: its token is void
    from tests.waiting import wait_until

    service = _service(tcp_server[0])
    wait_until(lambda: granted.session_id not in service.tcp.grants, what="the session forgotten")
    sock.sendall(wire.request(hashes[0], False))
    assert _error(sock) == f"FAILED_PRECONDITION: session {granted.session_id} has ended"
    sock.close()


def test_t6_connections_past_the_limit_are_refused_and_a_client_gone_mid_reply_leaves_it_serving(
    tcp_server: Any, granted: _Granted
) -> None:
    _, client, _ = tcp_server
    hashes, blocks = _put(client, 4)
    held = [granted.dial() for _ in range(3)]
    for sock in held:  # each answered once: all three are being served
        sock.sendall(wire.request(hashes[0], False))
        _reply(sock)
    with granted.dial(hello=False) as extra:
        assert _error(extra) == (
            "RESOURCE_EXHAUSTED: the server serves 3 connections already (transfer.tcp_max_connections)"
        )
    # Clients that go away mid-reply: asked for many blocks, read a few bytes, closed.
    for sock in held:
        sock.sendall(wire.request(b"".join(hashes), False) * 3)
        sock.recv(100)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN
        sock.close()
    from tests.waiting import wait_until

    service = _service(tcp_server[0])
    wait_until(lambda: not service.tcp._connections, what="the connections closed")
    with granted.dial() as sock:  # and it serves again, with room for new connections
        sock.sendall(wire.request(b"".join(hashes), False))
        assert _reply(sock)[2] == b"".join(blocks)


def _answer_to(sock: socket.socket, payload: bytes) -> bytes:
    """What the server sends back to `payload` before it closes. It may answer a bad frame and close before
    the rest is sent or before this side's half-close (ENOTCONN, EPIPE, ECONNRESET on a loaded box): what it
    sent before that is still read, and a reset that lost it reads as nothing."""
    got = b""
    try:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)  # the rest never comes: a short frame ends at the close
    except OSError:
        pass  # the server closed first: read what it said
    try:
        while more := sock.recv(1 << 16):
            got += more
    except ConnectionResetError:
        pass
    return got


def test_t7_the_request_parser_never_crashes_on_noise(tcp_server: Any, granted: _Granted) -> None:
    """Fuzz: random frames after a good hello, and random hellos; each is answered by a reply or an
    error frame (never silence, never a dead listener)."""
    _, client, _ = tcp_server
    hashes, _ = _put(client, 2)
    rng = random.Random(7)
    for i in range(60):
        kind = rng.randrange(4)
        if kind == 0:  # random bytes as the hello
            noise = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            sock, payload = granted.dial(hello=False), noise
        elif kind == 1:  # a request header with a random count and flags, then random bytes
            n, flags = rng.choice([0, 1, 3, 4, 5, 1 << 31, (1 << 32) - 1]), rng.randrange(256)
            sock, payload = granted.dial(), wire.REQUEST_HEAD.pack(wire.REQUEST, n, flags) + os.urandom(32 * 4)
        elif kind == 2:  # a good request with its bytes flipped at random
            frame = bytearray(wire.request(hashes[0] + hashes[1], False))
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
            sock, payload = granted.dial(), bytes(frame)
        else:  # a hello with a random session id length
            sock = granted.dial(hello=False)
            payload = wire.HELLO_HEAD.pack(wire.HELLO, rng.randrange(256)) + os.urandom(rng.randrange(300))
        with sock:
            got = _answer_to(sock, payload)
        assert got == b"" or got[:4] in (wire.REPLY, wire.ERROR), (i, got[:40])
    with granted.dial() as sock:  # still serving
        sock.sendall(wire.request(hashes[0], False))
        assert _reply(sock)[0] == bytes([DONE])


def test_t8_settings_are_bounded() -> None:
    with pytest.raises(ConfigError, match="tcp_max_connections"):
        TransferSettings(tcp_max_connections=0)
    with pytest.raises(ConfigError, match="tcp_max_request_bytes"):
        TransferSettings(tcp_max_request_bytes=1)
    with pytest.raises(ConfigError, match="tcp_port"):
        TransferSettings(tcp_port=70000)


def test_t9_off_by_default_and_refused_when_off(server: Any, client: Client) -> None:
    s = TransferSession(client.connection, path="stream")
    events = s.stub.OpenSession(
        pb.OpenSessionRequest(geometry=client.connection.geometry), metadata=client.connection.metadata
    )
    first = next(events)
    try:
        assert "tcp" not in first.bulk_transports
        reply = client.connection.call(
            s.stub.OpenBulk, pb.OpenBulkRequest(session_id=first.session_id, transport="tcp")
        )
        assert not reply.accepted and reply.reason == "transfer.tcp_bulk is off on this server"
    finally:
        events.cancel()
        s.close()


def _service(srv: Any) -> Any:
    from gateway.transfer_servicer import TransferServicer

    return next(c.__self__ for c in srv.closers if isinstance(getattr(c, "__self__", None), TransferServicer))


def test_t10_a_frame_left_half_sent_is_refused_past_the_timeout(
    start_server: Callable[..., Any], tmp_path: Path
) -> None:
    store = StoreSettings(data_dir=tmp_path / "s", capacity_bytes=64 * BLOCK_BYTES, block_tokens=TOKENS)
    server = start_server(store, transfer=_settings(tcp_timeout_s=0.3))
    with Client(server.target) as client:
        g = _Granted(client)
        try:
            with g.dial() as sock:
                sock.sendall(wire.REQUEST_HEAD.pack(wire.REQUEST, 2, 0) + b"\1" * 40)  # 64 hash bytes due, 40 sent
                assert _error(sock) == (
                    "DEADLINE_EXCEEDED: a frame's 64 bytes did not arrive within transfer.tcp_timeout_s"
                )
        finally:
            g.close()
