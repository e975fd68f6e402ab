"""The one-copy TCP transport, client side: replies read straight into the session's regions.

A session whose server offers "tcp" (`transfer.tcp_bulk`, docs/TRANSFER.md "The one-copy TCP
transport") asks `OpenBulk(transport="tcp")` over its authenticated gRPC channel for the
listener's port and a token, dials the server's host at that port, and sends its hello
(`kvstore.transfer_tcp_wire`). A read is cut into requests of at most `max_blocks` hashes,
`IN_FLIGHT` of them sent before the first reply is read: while this process receives one
reply, the server finds and verifies the next request's blocks in its map. Each reply's found
blocks are `recv_into` their places in the region (a run of consecutive places in one pass of
recv_into calls, no per-block Python in the usual case); the server sent only blocks that
passed their checksums. Nothing is registered: the region's memory is a buffer the socket reads into.

Writes, and every read once the transport fails (a refused or broken connection, an error
frame), go by the session's gRPC path, as the Mooncake bulk path falls back
(`kvstore.client.transfer_bulk.BulkPath`, whose batching and landing this path reuses).
`KVSTORE_CLIENT_BULK=mooncake` in the environment makes sessions ask for Mooncake's transport
even where "tcp" is offered (the benches compare the two).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvstore import transfer_tcp_wire as wire
from kvstore.client.transfer_bulk import BulkPath, region_address
from kvstore.client.transfer_stream import StreamPath
from kvstore.errors import Internal, KVStoreError, Unavailable, from_status
from kvstore.region import Region
from kvstore.transfer import DONE, DescriptorGroup
from kvstore.v1 import transfer_pb2 as pb

if TYPE_CHECKING:
    from kvstore.client.transfer_path import SessionView

#: Requests sent before the first reply is read: the server verifies one while it sends another.
IN_FLIGHT = 3
#: The environment variable that makes sessions skip "tcp" (its value "mooncake").
PREFER_ENV = "KVSTORE_CLIENT_BULK"


def wanted(offered: Sequence[str]) -> bool:
    """Whether a session should ask for the TCP transport among the server's `offered` ones."""
    return "tcp" in offered and os.environ.get(PREFER_ENV, "") != "mooncake"


def open_tcp(session: SessionView, stream: StreamPath) -> tuple[TcpPath | None, str]:
    """Ask the server for the TCP transport and connect; (path, "") or (None, why not)."""
    try:
        reply = session.call(session.stub.OpenBulk, pb.OpenBulkRequest(session_id=session.session_id, transport="tcp"))
    except KVStoreError as exc:
        return None, f"off: {exc.message}"
    if not reply.accepted:
        return None, f"off: the server refused the tcp transport: {reply.reason}"
    host = session.connection.target.rpartition(":")[0].strip("[]") or "127.0.0.1"
    try:
        path = TcpPath(session, stream, reply.max_blocks, (host, reply.tcp_port), reply.tcp_token)
    except (OSError, KVStoreError) as exc:
        return None, f"off: the tcp transport's listener at {host}:{reply.tcp_port} did not answer ({exc})"
    return path, ""


class _Reply:
    """A request sent: `result()` reads its reply, its found blocks into the region, and returns
    the reply's `FetchReply` header (what `BulkPath._land` records)."""

    def __init__(self, path: TcpPath, view: memoryview, offsets: Sequence[int]) -> None:
        self.path, self.view, self.offsets = path, view, offsets
        self._header: bytes | None = None

    def result(self) -> bytes:
        if self._header is None:
            self._header = self.path.receive(self.view, self.offsets)
        return self._header

    def cancel(self) -> bool:
        return False  # nothing to cancel: its reply is read (or the connection closed) by the next user


class TcpPath(BulkPath):
    """Reads over the one-copy TCP transport; writes and every fallback by the session's `StreamPath`.

    Args:
        session: the session (its id, regions).
        stream: the session's gRPC path.
        max_blocks: most blocks a request (the server's OpenBulk answer).
        address: the listener's (host, port).
        token: the session's token for it.

    Raises:
        OSError: the listener could not be reached.
    """

    def __init__(
        self, session: SessionView, stream: StreamPath, max_blocks: int, address: tuple[str, int], token: bytes
    ) -> None:
        # Not BulkPath's: no engine, no registration. Its batching (`_fetch`, `_calls`, `_land`) is reused.
        self.session = session
        self.stream = stream
        self.connection = session.connection
        self.max_blocks = max(1, max_blocks)
        self.address, self.token = address, token
        self.lanes: list[tuple[Any, str]] = [(None, f"tcp {address[0]}:{address[1]}")]
        self.segment = self.lanes[0][1]
        self._named = True
        #: Region id -> its address in this process (the requests name it; replies land in its view).
        self.addresses: dict[int, int] = {}
        self._views: dict[int, memoryview] = {}
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-tcp")
        self._lock = threading.Lock()  # one batch at a time on the connection (the pool has one thread)
        self._sock: socket.socket | None = None
        self._connect()

    def _connect(self) -> None:
        sock = socket.create_connection(self.address, timeout=self.connection.timeout_s or 60.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(wire.hello(self.session.session_id, self.token))
        self._sock = sock

    def register(self, region: Region) -> bool:
        """Note a region (nothing is registered anywhere: replies are read into its view)."""
        address = region_address(region)
        self.addresses[region.region_id] = address
        self._views[address] = region.view
        return True

    def unregister(self, region: Region) -> None:
        """Forget a region (no reply lands in it after: replies land only while a batch runs)."""
        address = self.addresses.pop(region.region_id, None)
        if address is not None:
            self._views.pop(address, None)

    def close(self) -> None:
        """Finish the running batch and close the connection."""
        self._pool.shutdown(wait=True)
        self._close_socket()
        self.addresses.clear()
        self._views.clear()

    def in_flight(self) -> int:
        """Requests sent before their replies are read."""
        return IN_FLIGHT

    def _drain(self) -> None:
        """Nothing can land after a failure: the connection is closed, and only this process writes the region."""
        self._close_socket()

    def _close_socket(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _fetch(self, batches: Sequence[Sequence[DescriptorGroup]], prefix_only: bool) -> Any:
        with self._lock:
            if self._sock is None:
                try:
                    self._connect()  # closed by the server after tcp_idle_s, or after a failure
                except OSError as exc:
                    raise Unavailable(f"the tcp transport's listener did not answer ({exc})") from None
            try:
                return super()._fetch(batches, prefix_only)
            except BaseException:
                self._close_socket()  # a reply may be half read: the connection is not reused
                raise

    def _send(self, request: pb.BulkFetchRequest) -> _Reply:
        sock = self._sock
        if sock is None:
            raise Unavailable("the tcp transport's connection is closed")
        try:
            sock.sendall(wire.request(request.block_hashes, request.prefix_only))
        except OSError as exc:
            raise Unavailable(f"the tcp transport's connection failed sending a request ({exc})") from None
        return _Reply(self, self._views[request.address], request.offsets_bytes)

    def receive(self, view: memoryview, offsets: Sequence[int]) -> bytes:
        """Read one reply: its header, its DONE blocks into `view` at their offsets, its end frame.

        Raises:
            KVStoreError: the server's error frame (its code's class) or a broken connection (Unavailable).
        """
        sock = self._sock
        if sock is None:
            raise Unavailable("the tcp transport's connection is closed")
        try:
            header = self._frame(sock, wire.REPLY)
            statuses = pb.FetchReply.FromString(header).statuses
            if len(statuses) != len(offsets):
                raise Internal(f"a tcp reply holds {len(statuses)} statuses for {len(offsets)} blocks")
            size = self.connection.block_bytes
            done = np.flatnonzero(np.frombuffer(statuses, dtype=np.uint8) == DONE)
            at = np.asarray(offsets, dtype=np.int64)[done]
            for lo, hi in _runs(at, size):
                _recv_into(sock, view[lo:hi])
            end = _recv_exact(sock, len(wire.END))
            if end != wire.END:
                self._error(sock, end)
        except OSError as exc:
            raise Unavailable(f"the tcp transport's connection failed mid-reply ({exc})") from None
        return header

    def _frame(self, sock: socket.socket, magic: bytes) -> bytes:
        head = _recv_exact(sock, wire.FRAME_HEAD.size)
        got, length = wire.FRAME_HEAD.unpack(head)
        if got != magic:
            self._error(sock, head[:4], head[4:])
        if length > wire.MAX_HEAD_BYTES:
            raise Internal(f"a tcp reply header of {length} bytes (at most {wire.MAX_HEAD_BYTES})")
        return _recv_exact(sock, length)

    def _error(self, sock: socket.socket, magic: bytes, rest: bytes = b"") -> None:
        """Raise the error frame that began with `magic` (or an Internal error for anything else)."""
        if magic != wire.ERROR:
            raise Internal(f"the tcp transport's server sent {magic!r} where a reply or error frame belongs")
        rest += _recv_exact(sock, wire.FRAME_HEAD.size - 4 - len(rest))
        (length,) = np.frombuffer(rest, dtype="<u4")
        text = _recv_exact(sock, min(int(length), wire.MAX_HEAD_BYTES)).decode("utf-8", "replace")
        code, _, message = text.partition(": ")
        status = getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL)
        raise from_status(status, f"tcp transport: {message or text}")


def _runs(at: np.ndarray, size: int) -> list[tuple[int, int]]:
    """Byte ranges of consecutive blocks starting at `at` (in order), each `size` long."""
    if not len(at):
        return []
    breaks = np.flatnonzero(np.diff(at) != size) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(at)]))
    return [(int(at[s]), int(at[e - 1]) + size) for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the server closed mid-reply")
        got += n


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)
