"""Put over the one-copy TCP transport, server side: put frames received into pooled buffers and
stored through the same stages as a gRPC PutStream.

A client asks `Transfer.OpenPut` over its authenticated gRPC channel (the auth and quota
interceptors check it as they check PutStream: the "write" right, the tenant's request rate),
and gets a one-use grant: an id and a token for the listener, void after `tcp_timeout_s`. It then
dials the listener, sends the put hello naming the grant, and its put frames
(`kvstore.transfer_tcp_wire`). On the server (docs/TRANSFER.md "Put over the one-copy TCP transport"):

1. the connection's thread reads each frame's head, checks its bounds (blocks times their size at
   most `tcp_max_request_bytes`, a header at most `wire.MAX_HEAD_BYTES`), and reads the frame with
   `recv_into` into a pooled buffer (the kernel's copy is the only one before LMDB's; a pooled
   buffer's pages are faulted in once, not per frame); its header is parsed by protobuf and its
   blocks are views of the buffer (`gateway.put_request.from_frame`); the same thread plans it
   (`KVStoreServicer.plan_put`: checks, the chain's hashes, the checksums) as the grant's caller, while
   the frames before it commit: a hop to a thread less a frame than a gRPC PutStream's plan takes
   (docs/BENCHMARKS.md, `bench store`, helper P5); a refused plan ends the put like a bad frame;
2. the planned batch goes to the event loop, into the node's PutStream stages
   (`KVStoreServicer.put_replies`: group commit, acknowledged only after its commit returned, parent
   before child), run as the grant's caller, so the scope, the NVMe quota and pins are checked as
   for gRPC;
3. each reply (a `PutResponse`) goes back in order through a sender thread; the first error ends
   the stream after the replies of the frames before it, as an error frame (`CODE: message`), and
   the connection is closed. A malformed frame (a bad magic, a bound passed, an undecodable header)
   is such an error: it never reaches the store, and the listener goes on serving.

At most `FRAMES_AHEAD` frames of a connection are received ahead of their replies (each holds its
buffer until its commit has returned), and at most `MAX_HELD_BYTES` of frames over every connection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import hmac
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

from google.protobuf.message import DecodeError

from gateway.auth import Caller, set_caller
from gateway.put_request import PutRequestView, from_frame
from kvstore import transfer_tcp_wire as wire
from kvstore.config import TransferSettings
from kvstore.errors import DeadlineExceeded, InvalidArgument, KVStoreError, ResourceExhausted, Unavailable, to_status
from kvstore.v1 import kvstore_pb2 as kv_pb
from tiers.store import PutBatch

log = logging.getLogger("kvstore.transfer")

#: Put frames of one connection received ahead of their replies (PutStream's depth, and one more
#: being read): enough for the plans and the group commit to see several at once.
FRAMES_AHEAD = 8
#: Grants given and not yet used, at most (the oldest is dropped past it).
MAX_GRANTS = 4096
#: Bytes of receive buffers kept between frames, at most (four connections' worth of 4 MiB frames).
MAX_POOLED_BYTES = 4 * FRAMES_AHEAD * (4 << 20)
#: Bytes of put frames received and not yet answered, over every connection, at most: past it a connection's next
#: frame waits for room (its client's sends wait on TCP's window), so `tcp_max_connections` connections of
#: FRAMES_AHEAD frames of `tcp_max_request_bytes` (64 x 8 x 64 MiB by default) cannot hold 32 GiB. A frame larger
#: than this alone is still taken when nothing else is held.
MAX_HELD_BYTES = 1 << 30

#: The node's PutStream stages: requests in, their replies out, in order (`KVStoreServicer.put_replies`); a request
#: planned already (a `PutBatch`) goes through as it is (gateway/put_stream.py).
PutReplies = Callable[[AsyncIterator[PutRequestView]], AsyncIterator[kv_pb.PutResponse]]
#: The node's plan of a put request (`KVStoreServicer.plan_put`: checks, the chain's hashes, the checksums).
PutPlan = Callable[[PutRequestView], PutBatch]


@dataclass(kw_only=True)
class PutGrant:
    """What OpenPut granted: who puts, the token its hello must carry, and when the grant lapses."""

    caller: Caller
    token: bytes
    expires_s: float  # time.monotonic()


class _Pool:
    """Receive buffers reused across frames and connections, so their pages are faulted in once."""

    def __init__(self, max_bytes: int = MAX_POOLED_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: list[bytearray] = []
        self._bytes = 0  # of the buffers in `_free`

    def take(self, size: int) -> bytearray:
        """A buffer of at least `size` bytes (a pooled one when one is large enough)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= size:
                    self._bytes -= len(buf)
                    return self._free.pop(i)
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        """Keep `buf` for a later frame, unless the pool holds `max_bytes` already (it is then freed)."""
        with self._lock:
            if self._bytes + len(buf) <= self.max_bytes:
                self._free.append(buf)
                self._bytes += len(buf)


class TcpPuts:
    """The grants OpenPut hands out, and each put connection's reading, storing and answering.

    Args:
        settings: the transfer section (`tcp_*`).
        replies: the node's PutStream stages (None: puts are not offered, e.g. on a fleet's gateway).
    """

    def __init__(self, settings: TransferSettings, replies: PutReplies | None = None,
                 max_held_bytes: int = MAX_HELD_BYTES, plan: PutPlan | None = None) -> None:
        self.settings = settings
        self.replies = replies
        #: Plans each frame on its connection's thread, as the grant's caller, before the loop sees it (None: the
        #: stages plan it on a thread of their own, one hop more a frame).
        self.plan = plan
        self.max_held_bytes = max_held_bytes
        self._held_bytes = 0  # of the frames received and not yet answered, over every connection
        self._room = threading.Condition()
        #: Frames waiting for room under `max_held_bytes` now (each a connection's reader).
        self.waiting_frames = 0
        self._grants: collections.OrderedDict[str, PutGrant] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = _Pool()
        #: Put frames received since start (each a batch), and put connections served.
        self.frames = 0
        self.connections = 0

    def refused(self) -> str:
        """Why puts are not offered ("" when they are)."""
        if not self.settings.tcp_put:
            return "transfer.tcp_put is off on this server"
        if self.replies is None:
            return "this server does not take puts over the TCP transport (a fleet's gateway)"
        return ""

    def grant(self, caller: Caller) -> tuple[str, bytes]:
        """A one-use grant for `caller`: (its id, its token)."""
        grant_id, token = secrets.token_hex(16), secrets.token_bytes(wire.TOKEN_BYTES)
        now = time.monotonic()
        with self._lock:
            # Lapsed ones go first (they are in the order given), and the oldest past MAX_GRANTS.
            while self._grants and (len(self._grants) >= MAX_GRANTS
                                    or next(iter(self._grants.values())).expires_s < now):
                self._grants.popitem(last=False)
            self._grants[grant_id] = PutGrant(caller=caller, token=token, expires_s=now + self.settings.tcp_timeout_s)
        return grant_id, token

    def take(self, grant_id: str, token: bytes) -> PutGrant | None:
        """The grant named by a put hello, used up; None when no live grant has this id and token."""
        with self._lock:
            grant = self._grants.get(grant_id)
            # Compared whatever the grant: the time says nothing of which ids exist.
            good = hmac.compare_digest(token, grant.token if grant is not None else bytes(wire.TOKEN_BYTES))
            if grant is None or not good or grant.expires_s < time.monotonic():
                return None
            del self._grants[grant_id]
        return grant

    def serve(self, conn: socket.socket, grant: PutGrant, loop: asyncio.AbstractEventLoop,
              closed: Callable[[], bool]) -> None:
        """Serve one put connection after its hello (on the connection's thread; returns when it ends).

        Args:
            conn: the connection.
            grant: its grant.
            loop: the server's event loop (the PutStream stages run there).
            closed: whether the server is closing.
        """
        self.connections += 1
        out: queue.Queue[bytes | None] = queue.Queue()
        sender = threading.Thread(target=_send_loop, args=(conn, out, self.settings.tcp_timeout_s),
                                  name="kvstore-tcp-put-send", daemon=True)
        sender.start()
        inbox: asyncio.Queue[PutRequestView | PutBatch | Exception | None] = asyncio.Queue()
        room = threading.Semaphore(FRAMES_AHEAD)
        held: collections.deque[tuple[bytearray, int]] = collections.deque()  # each frame's buffer and size, in order
        ended = threading.Event()  # the stream ended on the loop: no more frames are taken
        stored = asyncio.run_coroutine_threadsafe(
            self._acknowledge(grant.caller, inbox, out, room, held, ended), loop)
        as_caller = contextvars.copy_context()  # the plans run as the grant's caller (its tenant, its quota)
        as_caller.run(set_caller, grant.caller)
        try:
            self._read(conn, loop, inbox, room, held, ended, closed, as_caller)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits for more
                loop.call_soon_threadsafe(inbox.put_nowait, None)  # read no more (after an error: never read)
            with contextlib.suppress(Exception):  # its errors went to the client as an error frame
                stored.result(self.settings.tcp_timeout_s)
            out.put(None)
            sender.join()

    def _read(self, conn: socket.socket, loop: asyncio.AbstractEventLoop,
              inbox: asyncio.Queue[PutRequestView | PutBatch | Exception | None], room: threading.Semaphore,
              held: collections.deque[tuple[bytearray, int]], ended: threading.Event,
              closed: Callable[[], bool], as_caller: contextvars.Context) -> None:
        """Read frames (each planned here when `plan` is set) and hand them to the loop until the client's end, the
        first bad frame or refused plan, or the stream's end."""
        def hand(item: PutRequestView | PutBatch | Exception | None) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, item)

        while True:
            while not room.acquire(timeout=0.5):  # FRAMES_AHEAD frames wait for their commit
                if ended.is_set() or closed():
                    return
            if ended.is_set() or closed():
                return
            try:
                request = self._frame(conn, lambda: ended.is_set() or closed())
            except KVStoreError as exc:
                hand(exc)
                return
            except (OSError, EOFError) as exc:
                hand(Unavailable(f"the put's connection broke mid-frame ({exc})"))
                return
            if request is None:
                hand(None)  # the client's end of the put
                return
            buf, size, view = request
            with self._lock:
                held.append((buf, size))
            self.frames += 1
            if self.plan is None:
                hand(view)
                continue
            try:  # the plan here, beside the commits, saves the frame a hop to a thread of the loop's
                batch = as_caller.run(self.plan, view)
            except Exception as exc:  # the stream ends with it, after the frames before it
                hand(exc)
                return
            hand(batch)

    def _frame(self, conn: socket.socket, ended: Callable[[], bool]) -> tuple[bytearray, int, PutRequestView] | None:
        """The next put frame, in a pooled buffer, and the bytes it holds of MAX_HELD_BYTES (None: the client
        ended the put between frames). `ended` says the put or the server ended while the frame waited for room.

        Raises:
            KVStoreError: the frame is malformed or past a bound (nothing of it is stored).
        """
        conn.settimeout(self.settings.tcp_idle_s)
        try:
            first = conn.recv(wire.PUT_HEAD.size, socket.MSG_WAITALL)
        except TimeoutError:
            raise DeadlineExceeded(
                f"no put frame within transfer.tcp_idle_s ({self.settings.tcp_idle_s:g} s)") from None
        if not first:
            return None
        conn.settimeout(self.settings.tcp_timeout_s)
        head = first + _recv_exact(conn, wire.PUT_HEAD.size - len(first))
        magic, header_len, count, block_bytes = wire.PUT_HEAD.unpack(head)
        if magic != wire.PUT:
            raise InvalidArgument(f"not a put frame ({magic!r}; expected {wire.PUT!r})")
        if header_len > wire.MAX_HEAD_BYTES:
            raise InvalidArgument(f"a put frame's header of {header_len} bytes (at most {wire.MAX_HEAD_BYTES})")
        most = self.settings.tcp_max_request_bytes
        if count * block_bytes > most:
            raise ResourceExhausted(f"a put frame of {count} blocks of {block_bytes} bytes is past "
                                    f"transfer.tcp_max_request_bytes ({most})",
                                    hint="send fewer blocks a frame (OpenPut's max_frame_bytes)")
        data = count * block_bytes
        size = header_len + data
        if not self.reserve(size, ended):
            raise Unavailable("the put ended while its next frame waited for room (the server is closing)")
        buf = self._pool.take(size)
        view = memoryview(buf)
        try:
            _recv_into(conn, view[:size])
            request = from_frame(view[:header_len], view[header_len:size], count, block_bytes)
        except DecodeError as exc:
            self._pool.give(buf)
            self.unreserve(size)
            raise InvalidArgument(f"a put frame's header is not a PutRequest without blocks ({exc})") from None
        except BaseException:
            self._pool.give(buf)
            self.unreserve(size)
            raise
        return buf, size, request

    def reserve(self, size: int, ended: Callable[[], bool]) -> bool:
        """Hold `size` bytes of MAX_HELD_BYTES for a frame, waiting while the frames held over every connection
        leave no room; False when `ended` says to stop waiting (nothing is held then)."""
        with self._room:
            while self._held_bytes and self._held_bytes + size > self.max_held_bytes:
                if ended():
                    return False
                self.waiting_frames += 1
                try:
                    self._room.wait(0.5)
                finally:
                    self.waiting_frames -= 1
            self._held_bytes += size
        return True

    def unreserve(self, size: int) -> None:
        """Give back a frame's `size` bytes (it was answered, or never taken)."""
        with self._room:
            self._held_bytes -= size
            self._room.notify_all()

    async def _acknowledge(self, caller: Caller, inbox: asyncio.Queue[PutRequestView | PutBatch | Exception | None],
                           out: queue.Queue[bytes | None], room: threading.Semaphore,
                           held: collections.deque[tuple[bytearray, int]], ended: threading.Event) -> None:
        """On the loop, as `caller`: the frames through the PutStream stages, each reply sent in order."""
        set_caller(caller)  # this task's own context: the plans (on threads) inherit it

        async def requests() -> AsyncIterator[PutRequestView | PutBatch]:
            while True:
                item = await inbox.get()
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item

        assert self.replies is not None
        try:
            stream = self.replies(cast(AsyncIterator[PutRequestView], requests()))  # batches pass as they are
            try:
                async for reply in stream:
                    out.put(wire.put_reply(reply.SerializeToString()))
                    self._release(held, room)
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
        except KVStoreError as exc:
            out.put(wire.error_frame(to_status(exc).name, f"{exc.message} ({exc.hint})" if exc.hint else exc.message))
        except Exception as exc:  # never a crash of the listener: the client is told, the server serves
            log.exception("one-copy TCP transport: a put failed")
            out.put(wire.error_frame("INTERNAL", f"internal error in a TCP put ({type(exc).__name__})"))
        finally:
            ended.set()
            room.release()  # wakes the reader if it waits for room
            while held:  # frames no commit will take: their buffers back
                self._release(held, room)

    def _release(self, held: collections.deque[tuple[bytearray, int]], room: threading.Semaphore) -> None:
        with self._lock:
            frame = held.popleft() if held else None
        if frame is not None:
            self._pool.give(frame[0])
            self.unreserve(frame[1])
        room.release()


def _send_loop(conn: socket.socket, out: queue.Queue[bytes | None], timeout_s: float) -> None:
    """Send what the loop queues, in order, until None; after a failed send, drop the rest (the client went)."""
    broken = False
    while True:
        frame = out.get()
        if frame is None:
            return
        if broken:
            continue
        try:
            conn.settimeout(timeout_s)
            conn.sendall(frame)
        except OSError:
            broken = True
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes the reader


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    """Fill `view` from `conn` (within the connection's timeout: DEADLINE_EXCEEDED past it)."""
    got = 0
    try:
        while got < len(view):
            n = conn.recv_into(view[got:])
            if not n:
                raise EOFError("the client closed mid-frame")
            got += n
    except TimeoutError:
        raise DeadlineExceeded(
            f"a put frame's {len(view)} bytes did not arrive within transfer.tcp_timeout_s") from None


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, memoryview(buf))
    return bytes(buf)
