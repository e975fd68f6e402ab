"""The one-copy TCP transport, server side: verified blocks sent from LMDB's map with `sendmsg`.

A session that asked `OpenBulk(transport="tcp")` over its authenticated gRPC channel gets the
listener's port and a token of its own (docs/TRANSFER.md "The one-copy TCP transport"). Its
client then dials the listener and speaks frames (`kvstore.transfer_tcp_wire`):

1. a hello naming the session and carrying its token (compared in constant time);
2. requests of 1 to `max_blocks` block hashes. Per request the server finds the blocks in the
   map under a read txn and hashes them in place (`gateway.transfer_bulk_map.MapSource`, as
   BulkFetch does), then sends a reply header (the statuses and failures, as a `FetchReply`
   without data), the found blocks straight from the map (`sendmsg` of their views: the only
   copy is the kernel's), and an end frame once their retention refresh is durable. A call the
   map cannot answer exactly (a damaged block, a stale map) is verify-copied as Fetch is: a
   block that fails its checksum is never sent, its status FAILED with DATA_LOSS.

Each connection has two threads: one reads and verifies the next request while the other sends
the one before, so the checksum pass overlaps the send (at most `_READY` requests verified and
waiting, each holding its read txn). A bad frame, a failed token or an ended session gets an
error frame naming what was wrong (`CODE: message`), and the connection is closed; the server
goes on serving. Bounded: `tcp_max_connections` connections, `tcp_max_request_bytes` a request,
`tcp_timeout_s` for a frame's rest or a reply's send, `tcp_idle_s` between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import logging
import queue
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.auth import Caller, is_loopback
from gateway.transfer_bulk_map import MapSource, missing
from gateway.transfer_fetch import batch_results, copy_blocks, fetch_keys
from gateway.transfer_sessions import Session
from gateway.transfer_tcp_put import PutGrant, TcpPuts
from kvstore import transfer_tcp_wire as wire
from kvstore.config import TransferSettings
from kvstore.errors import KVStoreError, to_status
from kvstore.native import blockcopy
from kvstore.transfer import BatchResults
from kvstore.v1 import transfer_pb2 as pb
from tiers.store import MappedStore

log = logging.getLogger("kvstore.transfer")

#: Requests of one connection verified and waiting for the sender (each holds a read txn).
_READY = 1

#: Called on the event loop after each request: (session, blocks asked, blocks found, results).
Counted = Callable[[Session, int, int, BatchResults], None]


class Refused(Exception):
    """A frame refused: sent as an error frame (`code: message`), then the connection is closed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass(kw_only=True)
class _Grant:
    session: Session
    token: bytes
    block_bytes: int


@dataclass(kw_only=True)
class _Prepared:
    """One request's reply, verified: the header, the found blocks' views and what to end after."""

    header: bytes
    views: list[memoryview]
    txn: Any  # the read txn the views are in (None: they are in `buffer`)
    due: Future[None] | None
    buffer: Any = None


class TcpBulkServer:
    """The listener, its connections and the sessions that were given a token.

    Args:
        settings: the transfer section (`tcp_*`).
        tier: the store whose map the blocks are sent from.
        counted: the servicer's counting of each request (as a Get), run on the event loop.
    """

    def __init__(self, settings: TransferSettings, tier: MappedStore, counted: Counted) -> None:
        self.settings = settings
        self.tier = tier
        self.counted = counted
        #: What OpenSession offers: "tcp" when `transfer.tcp_bulk` is on.
        self.offered = ["tcp"] if settings.tcp_bulk else []
        #: Puts over the listener (gateway/transfer_tcp_put.py); its `replies` wired by the server.
        self.puts = TcpPuts(settings)
        self.grants: dict[str, _Grant] = {}
        #: Requests answered since start, and of them those verify-copied (the map could not serve).
        self.requests = 0
        self.copied = 0
        self.port = 0
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._map: MapSource | None = None
        self._map_reason = missing()
        self._closed = False

    # -- on the event loop ---------------------------------------------------

    def open(self, session: Session, block_bytes: int) -> tuple[str, bytes]:
        """Give `session` a token for the listener (started at the first), or say why not.

        Returns:
            ("", token) when accepted; (reason, b"") when not.
        """
        if not self.settings.tcp_bulk:
            return "transfer.tcp_bulk is off on this server", b""
        refused = self._listening()
        if refused:
            return refused, b""
        grant = self.grants.get(session.session_id)
        if grant is None:
            grant = self.grants[session.session_id] = _Grant(
                session=session, token=secrets.token_bytes(wire.TOKEN_BYTES), block_bytes=block_bytes
            )
        return "", grant.token

    def open_put(self, caller: Caller, peer: str) -> tuple[str, str, bytes]:
        """A one-use put grant for `caller` calling from `peer` (gRPC's "ipv4:host:port"; the listener started
        at the first), or say why not: a listener on loopback is offered to callers on this host only (a client
        elsewhere could not reach it, and would try before putting by gRPC).

        Returns:
            ("", grant id, token) when accepted; (reason, "", b"") when not.
        """
        host = peer.partition(":")[2].rpartition(":")[0]
        if is_loopback(self.settings.tcp_host) and not is_loopback(host):
            return (f"the TCP listener binds {self.settings.tcp_host} (transfer.tcp_host): "
                    "it takes puts from this host only"), "", b""
        refused = self.puts.refused() or self._listening()
        if refused:
            return refused, "", b""
        return "", *self.puts.grant(caller)

    def _listening(self) -> str:
        """Start the listener if it is not: "" once it listens, else why it could not."""
        if self._listener is None:
            try:
                self._start()
            except OSError as exc:
                return f"the TCP listener could not start on {self.settings.tcp_host}:{self.settings.tcp_port} ({exc})"
        return ""

    def max_blocks(self, block_bytes: int) -> int:
        """Most blocks one request may ask for at `block_bytes` a block."""
        return max(1, min(self.settings.max_descriptors, self.settings.tcp_max_request_bytes // block_bytes))

    def forget(self, session_id: str) -> None:
        """The session ended: its token is void (its connections are refused at their next request)."""
        self.grants.pop(session_id, None)

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        listener = socket.create_server((self.settings.tcp_host, self.settings.tcp_port), backlog=64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, name="kvstore-tcp-accept", daemon=True).start()
        log.info("one-copy TCP transport listening on %s:%d", self.settings.tcp_host, self.port)

    def close(self) -> None:
        """Stop listening and close every connection (their threads end at their next read or send)."""
        self._closed = True
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for conn in self._connections:
                _shut(conn)

    # -- on the listener's threads -------------------------------------------

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = len(self._connections) >= self.settings.tcp_max_connections
                if not full:
                    self._connections.add(conn)
            if full:
                threading.Thread(
                    target=self._refuse,
                    args=(
                        conn,
                        Refused(
                            "RESOURCE_EXHAUSTED",
                            f"the server serves {self.settings.tcp_max_connections} connections "
                            "already (transfer.tcp_max_connections)",
                        ),
                    ),
                    daemon=True,
                ).start()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-tcp-read", daemon=True).start()

    def _refuse(self, conn: socket.socket, refused: Refused) -> None:
        try:
            conn.settimeout(self.settings.tcp_timeout_s)
            conn.sendall(wire.error_frame(refused.code, refused.message))
        except OSError:
            pass
        finally:
            _shut(conn)
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        """Read, verify and queue this connection's requests; a sender thread answers them in order.
        A put hello hands the connection to the puts (gateway/transfer_tcp_put.py)."""
        ready: queue.Queue[_Prepared | Refused | None] = queue.Queue(_READY)
        sender: threading.Thread | None = None
        item: _Prepared | Refused | None = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            grant = self._hello(conn)
            if isinstance(grant, PutGrant):
                assert self._loop is not None
                self.puts.serve(conn, grant, self._loop, lambda: self._closed)
                return
            sender = threading.Thread(target=self._send_loop, args=(conn, ready), name="kvstore-tcp-send",
                                      daemon=True)
            sender.start()
            while not self._closed:
                request = self._request(conn, grant)
                if request is None:
                    break  # the client closed between requests
                item = self._prepare(grant, *request)
                ready.put(item)
                item = None
        except Refused as exc:
            item = exc
        except (OSError, EOFError):
            item = None  # the client went (or a read timed out): nothing more to answer
        except Exception as exc:  # never a crash of the listener: the client is told, the server serves
            log.exception("one-copy TCP transport: a request failed")
            item = Refused("INTERNAL", f"{type(exc).__name__}: {exc}")
        finally:
            if sender is not None:
                ready.put(item)  # a refusal to send, or the end
                sender.join()
            elif isinstance(item, Refused):  # refused at the hello
                with contextlib.suppress(OSError):
                    conn.settimeout(self.settings.tcp_timeout_s)
                    conn.sendall(wire.error_frame(item.code, item.message))
                _shut(conn)
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _send_loop(self, conn: socket.socket, ready: queue.Queue[_Prepared | Refused | None]) -> None:
        broken = False
        while True:
            item = ready.get()
            if item is None:
                break
            if isinstance(item, Refused):
                if not broken:
                    try:
                        conn.settimeout(self.settings.tcp_timeout_s)
                        conn.sendall(wire.error_frame(item.code, item.message))
                    except OSError:
                        pass
                break
            try:
                if not broken:
                    self._send(conn, item)
            except OSError:
                broken = True  # the client went or stopped reading: the reader is woken below
                _shut(conn)
            finally:
                _end(item)
        _shut(conn)
        # Whatever the reader still queues is released, never sent.
        while True:
            try:
                left = ready.get_nowait()
            except queue.Empty:
                return
            if isinstance(left, _Prepared):
                _end(left)

    def _send(self, conn: socket.socket, item: _Prepared) -> None:
        conn.settimeout(self.settings.tcp_timeout_s)
        conn.sendall(item.header)
        wire.send_views(conn, item.views)
        item.views = []
        if item.txn is not None:
            item.txn.abort()
            item.txn = None
        code = ""
        if item.due is not None:
            try:  # as Fetch: the client holds no bytes whose retention the store did not record
                item.due.result(self.settings.tcp_timeout_s)
            except KVStoreError as exc:
                code = f"{to_status(exc).name}: {exc.message}"
            except Exception as exc:
                code = f"INTERNAL: retention refresh failed ({type(exc).__name__}: {exc})"
        if code:
            name, _, message = code.partition(": ")
            conn.sendall(wire.error_frame(name, message))
            raise OSError("refresh failed")  # the connection ends after the error frame
        conn.sendall(wire.END)

    def _hello(self, conn: socket.socket) -> _Grant | PutGrant:
        conn.settimeout(self.settings.tcp_timeout_s)
        head = _recv_exact(conn, wire.HELLO_HEAD.size)
        magic, sid_len = wire.HELLO_HEAD.unpack(head)
        if magic not in (wire.HELLO, wire.PUT_HELLO):
            raise Refused("INVALID_ARGUMENT",
                          f"the first frame must be a hello ({wire.HELLO!r} or {wire.PUT_HELLO!r}), got {magic!r}")
        if not 0 < sid_len <= wire.MAX_SESSION_ID:
            raise Refused("INVALID_ARGUMENT", f"session id of {sid_len} bytes (1 to {wire.MAX_SESSION_ID})")
        body = _recv_exact(conn, sid_len + wire.TOKEN_BYTES)
        session_id, token = body[:sid_len].decode("utf-8", "replace"), body[sid_len:]
        if magic == wire.PUT_HELLO:
            put = self.puts.take(session_id, token) if not self.puts.refused() else None
            if put is None:
                raise Refused("UNAUTHENTICATED", "no live put grant has this id and token (OpenPut over gRPC gives "
                                                 "one, for one put, valid transfer.tcp_timeout_s)")
            return put
        grant = self.grants.get(session_id)
        # Compared whatever the session: the time says nothing of which ids exist.
        good = hmac.compare_digest(token, grant.token if grant is not None else bytes(wire.TOKEN_BYTES))
        if grant is None or not good:
            raise Refused(
                "UNAUTHENTICATED",
                "no open session with this id holds this token (OpenBulk with transport 'tcp' over gRPC gives it)",
            )
        return grant

    def _request(self, conn: socket.socket, grant: _Grant) -> tuple[bytes, bool] | None:
        """The next request's hashes and prefix flag (None: the client closed between requests)."""
        conn.settimeout(self.settings.tcp_idle_s)
        try:
            first = conn.recv(wire.REQUEST_HEAD.size, socket.MSG_WAITALL)
        except TimeoutError:
            return None  # idle past tcp_idle_s: closed (the client dials again)
        if not first:
            return None
        conn.settimeout(self.settings.tcp_timeout_s)
        head = first + _recv_exact(conn, wire.REQUEST_HEAD.size - len(first))
        magic, n, flags = wire.REQUEST_HEAD.unpack(head)
        if magic != wire.REQUEST:
            raise Refused("INVALID_ARGUMENT", f"not a request frame ({magic!r}; expected {wire.REQUEST!r})")
        most = self.max_blocks(grant.block_bytes)
        if not 0 < n <= most:
            raise Refused(
                "INVALID_ARGUMENT",
                f"a request holds 1 to {most} blocks (transfer.tcp_max_request_bytes "
                f"{self.settings.tcp_max_request_bytes} at {grant.block_bytes} bytes "
                f"a block, transfer.max_descriptors); got {n}",
            )
        if flags & ~wire.PREFIX_ONLY:
            raise Refused("INVALID_ARGUMENT", f"unknown request flags {flags:#x}")
        hashes = _recv_exact(conn, n * wire.HASH_BYTES)
        if self.grants.get(grant.session.session_id) is not grant:
            raise Refused("FAILED_PRECONDITION", f"session {grant.session.session_id} has ended")
        return hashes, bool(flags & wire.PREFIX_ONLY)

    def _prepare(self, grant: _Grant, hashes: bytes, prefix_only: bool) -> _Prepared:
        """Find and verify the blocks (from the map, else verify-copied), the refresh queued."""
        size = grant.block_bytes
        try:
            keys = fetch_keys(
                grant.session.scope,
                hashes,
                block_bytes=size,
                max_blocks=len(hashes) // wire.HASH_BYTES,
                max_bytes=len(hashes) // wire.HASH_BYTES * size,
            )
        except KVStoreError as exc:
            raise Refused(to_status(exc).name, exc.message) from None
        views: list[memoryview] = []
        txn = buffer = None
        source = self._source()
        resolved = source.resolve(keys, size, prefix_only) if source is not None else None
        if resolved is not None:
            codes, due, txn = resolved.codes, resolved.due, resolved.txn
            views = [_mapped(address, size) for address in resolved.addresses]
        else:
            buffer = np.empty(len(keys) * size, dtype=np.uint8)
            codes, due = copy_blocks(self.tier, keys, buffer.data, size, prefix_only)
            found = np.flatnonzero(np.frombuffer(codes, dtype=np.uint8) == blockcopy.FOUND).tolist()
            views = [buffer.data[i * size : (i + 1) * size] for i in found]
            self.copied += 1
        self.requests += 1
        results = batch_results(codes, size)
        found_n = codes.count(blockcopy.FOUND)
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self.counted, grant.session, len(keys), found_n, results)
        reply = pb.FetchReply(
            statuses=bytes(results.statuses),
            failures=[
                pb.DescriptorFailure(index=i, code=code, reason=reason)
                for i, (code, reason) in sorted(results.failures.items())
            ],
        ).SerializeToString()
        return _Prepared(
            header=wire.reply_head(reply),
            views=views,
            txn=txn,
            due=self.tier.touch_soon(due) if due else None,
            buffer=buffer,
        )

    def _source(self) -> MapSource | None:
        """The map (no engine registers it: the kernel reads it), made at the first request; None: copy."""
        with self._lock:
            if self._map is None and not self._map_reason:
                try:
                    self._map = MapSource([], self.tier)
                except LookupError:
                    return None  # an empty store: tried again at the next request
                except (OSError, ValueError) as exc:
                    self._map_reason = str(exc)
            source = self._map
        return source if source is not None and source.usable() else None


def _mapped(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    """`n` bytes of a frame begun (within the connection's timeout: DEADLINE_EXCEEDED past it)."""
    try:
        data = conn.recv(n, socket.MSG_WAITALL) if n else b""
        while len(data) < n:  # MSG_WAITALL may still return short (a signal, a timeout's edge)
            more = conn.recv(n - len(data))
            if not more:
                raise EOFError("the client closed mid-frame")
            data += more
    except TimeoutError:
        raise Refused(
            "DEADLINE_EXCEEDED", f"a frame's {n} bytes did not arrive within transfer.tcp_timeout_s"
        ) from None
    return data


def _end(item: _Prepared) -> None:
    item.views = []
    if item.txn is not None:
        item.txn.abort()
        item.txn = None


def _shut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already shut, or never connected
        conn.shutdown(socket.SHUT_RDWR)
