"""Put over the one-copy TCP transport, client side: each block sent with `sendmsg` from the caller's buffer.

Over gRPC a Put's batch is joined into a fresh 3.6 MB request (faulted in page by page), copied
again into gRPC's slices and three more times on the server's event loop, all with the GIL held
(docs/BENCHMARKS.md, `bench store`, P3's budget). Here (docs/TRANSFER.md "Put over the one-copy
TCP transport"):

1. `open_put` asks `Transfer.OpenPut` over the authenticated gRPC channel: the server checks the
   "write" right, the request rate and the scope as for PutStream, and answers a one-use grant
   for its listener (or why not: off, a gateway, an older server);
2. `send` dials the listener at the host the client dials for gRPC, says the put hello, and a
   thread sends each request as a put frame: its PutRequest without blocks, serialized, then its
   blocks by scatter sends straight from the caller's buffers (no join, no copy in Python); the
   caller's thread reads the replies meanwhile, one PutResponse a frame, each sent once its
   batch's commit is durable, in order;
3. an error frame (the server's status and message) is raised as its `kvstore.errors` class, after
   the batches before it were acknowledged, as a PutStream's error is.

A server that does not offer it is remembered per connection (its puts go by gRPC from then on);
`KVSTORE_CLIENT_PUT=grpc` in the environment sends every put by gRPC.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore import transfer_tcp_wire as wire
from kvstore.client.connection import Connection, status_error
from kvstore.errors import Internal, KVStoreError, Unavailable, from_status
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import transfer_pb2, transfer_pb2_grpc

#: Puts with at least this many bytes of blocks go over the TCP transport where the server offers it:
#: below it, a put is one or two gRPC requests, and OpenPut's round trip and the dial would cost more
#: than the copies they save.
TCP_PUT_MIN_BYTES = 8 << 20
#: Seconds a dial of the listener may take before the put goes by gRPC (a listener the server names but a
#: firewall drops packets to must not hold the put for the call's whole deadline).
CONNECT_TIMEOUT_S = 5.0
#: The environment variable that turns the transport off for this process (its value "grpc").
TRANSPORT_ENV = "KVSTORE_CLIENT_PUT"

#: Connections whose server did not offer puts over TCP (or whose listener did not answer): why.
_REFUSED: weakref.WeakKeyDictionary[Connection, str] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, kw_only=True)
class PutGrant:
    """OpenPut's answer: where to dial, what the hello carries, and the most block bytes a frame."""

    address: tuple[str, int]
    grant_id: str
    token: bytes
    max_frame_bytes: int


def wanted(connection: Connection, payload_bytes: int) -> bool:
    """Whether a node's put of `payload_bytes` of blocks should try the TCP transport."""
    return not why_not(connection, payload_bytes)


def why_not(connection: Connection, payload_bytes: int) -> str:
    """Why a put of `payload_bytes` of blocks on this connection goes by gRPC ("": it tries the TCP transport)."""
    if os.environ.get(TRANSPORT_ENV, "") == "grpc":
        return f"{TRANSPORT_ENV}=grpc"
    if connection.run_blocks:
        return "a fleet's gateway: puts by gRPC"
    if connection in _REFUSED:
        return _REFUSED[connection]
    if payload_bytes < TCP_PUT_MIN_BYTES:
        return f"below put_tcp.TCP_PUT_MIN_BYTES ({TCP_PUT_MIN_BYTES:,} bytes)"
    return ""


def refuse(connection: Connection, reason: str) -> None:
    """Send this connection's puts by gRPC from now on (`reason` is what `refused` says)."""
    _REFUSED[connection] = reason


def refused(connection: Connection) -> str:
    """Why this connection's puts go by gRPC ("" while the TCP transport is not known to be refused)."""
    return _REFUSED.get(connection, "")


def open_put(connection: Connection) -> PutGrant | None:
    """A grant for one put over the TCP transport; None when the server does not offer it (remembered).

    Raises:
        KVStoreError: the server refused the call as it would refuse the Put (a read-only token,
            the request rate, a scope not the caller's).
    """
    stub = transfer_pb2_grpc.TransferStub(connection.channel)
    request = transfer_pb2.OpenPutRequest(geometry=connection.geometry, namespace=connection.namespace)
    try:
        reply = stub.OpenPut(request, timeout=connection.timeout_s, metadata=connection.metadata)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
            _REFUSED[connection] = "the server has no OpenPut (an older version)"
            return None
        raise status_error(exc) from None
    if not reply.accepted:
        _REFUSED[connection] = reply.reason
        return None
    host = connection.target.rpartition(":")[0].strip("[]") or "127.0.0.1"
    return PutGrant(address=(host, reply.tcp_port), grant_id=reply.grant_id, token=reply.tcp_token,
                    max_frame_bytes=reply.max_frame_bytes)


def send(connection: Connection, grant: PutGrant, frames: Iterable[tuple[pb.PutRequest, Sequence[Any]]],
         count: int, on_batch: Callable[[int], None] | None) -> list[pb.PutResponse] | None:
    """Put `frames` (each a request without its blocks, and its blocks) over the TCP transport.

    Args:
        connection: the store client's connection.
        grant: `open_put`'s grant.
        frames: the requests, in order; consumed on a thread as they are sent.
        count: how many `frames` yields (as many replies are read).
        on_batch: called with the number of blocks of each acknowledged batch.

    Returns:
        The replies, in order; None when the listener could not be reached (nothing was sent: the
        caller puts by gRPC, and this connection's later puts do too).

    Raises:
        KVStoreError: the server's error frame as its class (the batches before it are stored), or
            Unavailable when the connection broke (putting again is safe).
    """
    try:
        sock = socket.create_connection(grant.address, timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(connection.timeout_s or None)
    except OSError as exc:
        host, port = grant.address
        _REFUSED[connection] = f"the tcp transport's listener at {host}:{port} did not answer ({exc})"
        return None
    failed: list[BaseException] = []
    sender = threading.Thread(target=_send_all, args=(sock, grant, frames, failed), name="kvstore-tcp-put",
                              daemon=True)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(wire.put_hello(grant.grant_id, grant.token))
        sender.start()
        replies: list[pb.PutResponse] = []
        while len(replies) < count:
            reply = _reply(sock, failed)
            replies.append(reply)
            if on_batch is not None:
                on_batch(len(reply.block_hashes))
        return replies
    except OSError as exc:
        raise Unavailable(f"the tcp transport's put connection failed ({exc})") from None
    finally:
        # The server reads the put's end; a sender still sending (after an error) fails and stops.
        with contextlib.suppress(OSError):  # the server closed it already
            sock.shutdown(socket.SHUT_RDWR)
        if sender.is_alive():
            sender.join()
        sock.close()


def _send_all(sock: socket.socket, grant: PutGrant, frames: Iterable[tuple[pb.PutRequest, Sequence[Any]]],
              failed: list[BaseException]) -> None:
    """Send every frame; the first failure noted in `failed` (the reader raises it if no reply explains it)."""
    try:
        for request, blocks in frames:
            views = [_bytes_view(b) for b in blocks]
            size = views[0].nbytes if views else 0
            sock.sendall(wire.put_head(request.SerializeToString(), len(views), size))
            wire.send_views(sock, views)
    except BaseException as exc:  # a request that could not be built, or a connection the server closed
        failed.append(exc)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)  # the server acknowledges what it has, then closes


def _bytes_view(block: Any) -> memoryview:
    view = memoryview(block)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _reply(sock: socket.socket, failed: list[BaseException]) -> pb.PutResponse:
    """The next reply frame, or the error frame's (or the sender's) error raised."""
    head = _recv_exact(sock, wire.FRAME_HEAD.size, failed)
    magic, length = wire.FRAME_HEAD.unpack(head)
    if length > wire.MAX_HEAD_BYTES:
        raise Internal(f"a tcp put reply of {length} bytes (at most {wire.MAX_HEAD_BYTES})")
    body = _recv_exact(sock, length, failed)
    if magic == wire.PUT_REPLY:
        return pb.PutResponse.FromString(body)
    if magic != wire.ERROR:
        raise Internal(f"the tcp transport's server sent {magic!r} where a put reply or error frame belongs")
    code, _, message = body.decode("utf-8", "replace").partition(": ")
    raise from_status(getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL), message or code)


def _recv_exact(sock: socket.socket, n: int, failed: list[BaseException]) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            if failed and isinstance(failed[0], KVStoreError):
                raise failed[0]  # the put's next request could not be built: the batches before it are stored
            raise Unavailable("the tcp transport's server closed the put connection mid-reply"
                              + (f" ({failed[0]})" if failed else ""))
        got += k
    return bytes(buf)
