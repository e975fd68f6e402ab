"""The direct path's GET reply reader (kvstore.client.swa_resp) against a real redis-server, and against a
socket pair for replies Redis itself never sends (a reply cut short, a reply that is not a GET's)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError, InvalidResponse, ResponseError

from kvstore.client.swa_resp import GetReplies, pack_gets


@pytest.fixture
def raw(redis_server: Any) -> Iterator[redis.Redis]:
    with redis.Redis(port=redis_server.port, protocol=2) as client:
        yield client


def exchange(client: redis.Redis, keys: list[bytes], max_bytes: int = 1 << 30) -> list[bytearray | None]:
    """GET `keys` with one packed write and the reader, on a connection of `client`'s pool."""
    conn = client.connection_pool.get_connection()
    try:
        conn.send_packed_command([pack_gets(keys)], False)
        return GetReplies(conn._sock, max_bytes=max_bytes).read_all(len(keys))
    finally:
        client.connection_pool.release(conn)


def test_redis_py_keeps_a_connected_connections_socket_in_sock(raw: redis.Redis) -> None:
    """The direct get reads replies off `Connection._sock` (else it falls back to redis-py's pipeline)."""
    conn = raw.connection_pool.get_connection()
    try:
        assert isinstance(conn._sock, socket.socket)
    finally:
        raw.connection_pool.release(conn)


def test_values_and_misses_come_back_in_order_each_in_a_buffer_of_its_own(raw: redis.Redis) -> None:
    big, small = os.urandom(3 << 20), b"x"
    raw.set(b"big", big)
    raw.set(b"small", small)
    raw.set(b"empty", b"")
    got = exchange(raw, [b"big", b"none", b"small", b"empty", b"big"])
    assert [None if g is None else bytes(memoryview(g)[:-2]) for g in got] == [big, None, small, b"", big]
    assert got[0] is not got[4]
    assert raw.ping()  # the connection is still in step


def test_an_error_reply_is_raised_after_every_reply_was_read(redis_server: Any, raw: redis.Redis) -> None:
    raw.acl_setuser("reader", enabled=True, passwords=["+pw"], keys=["ok:*"], commands=["+get", "+ping"])
    raw.set(b"ok:1", b"one")
    raw.set(b"ok:2", os.urandom(1 << 20))  # longer than any one read of a reply line
    with redis.Redis(port=redis_server.port, username="reader", password="pw", protocol=2) as user:
        conn = user.connection_pool.get_connection()
        conn.send_packed_command([pack_gets([b"ok:1", b"other", b"ok:2"])], False)
        with pytest.raises(ResponseError, match=r"^NOPERM"):
            GetReplies(conn._sock, max_bytes=1 << 20).read_all(3)
        conn.send_command("PING")
        assert conn.read_response() == b"PONG"  # no reply was left unread on the connection
        user.connection_pool.release(conn)


def test_a_value_over_the_limit_is_read_and_dropped(raw: redis.Redis) -> None:
    raw.set(b"huge", os.urandom(5 << 20))
    raw.set(b"fine", b"fine")
    got = exchange(raw, [b"huge", b"fine"], max_bytes=1 << 20)
    assert got[0] == bytearray() and got[1] is not None and bytes(got[1][:-2]) == b"fine"
    assert raw.ping()


@pytest.mark.parametrize(("sent", "error"), [
    (b"$10\r\nabc", ConnectionError),  # Redis went away mid-reply
    (b"+OK\r\n", InvalidResponse),  # not a GET's reply
    (b"$x\r\n", InvalidResponse),
    (b"$3\r\nabcXY", InvalidResponse),  # a bulk string without its CRLF
])
def test_a_reply_cut_short_or_not_a_gets_is_an_error(sent: bytes, error: type) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(sent)
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(error):
            GetReplies(ours, max_bytes=1 << 20).read_all(1)
