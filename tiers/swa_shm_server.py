"""The server side of the SWA shared-memory path: an abstract unix socket answering small control requests.

The gateway (gateway.swa_servicer, SwaPool.OpenDirect) authenticates a client by
its token and `grant`s it a ticket bound to its tenant, geometry, write right
and TTL. The client says HELLO with the ticket on this server's socket and gets
the descriptor of its own tenant's arena (SCM_RIGHTS; read-only unless it may
write), then sends BEGIN / WRITTEN / COMMIT / ABORT / GET requests
(SwaShmRequest, one SOCK_SEQPACKET message each; kvstore.client.swa_shm is the
client). Only offsets, keys, T and checksums cross the socket; snapshots are
copied by the client straight into or out of the arena, where the pool
(tiers.swa_memory) keeps every record of the tenant. The server checksums each
put snapshot in the arena as the client's WRITTEN notes say its bytes are in
place (so the record's checksum is the server's), and pins what a GET names
until the connection's next request (so no range is reused under a copy).

The gateway's rules hold here as on its gRPC path: keys are scoped to the
ticket's tenant and geometry (so another tenant's records cannot be named, and
their bytes are in an arena this client was never given); sizes come from T;
the TTL is the ticket's, a put may ask for less; reserved records count
against the pool's cap and evict by LRU; hits, puts and request rates go
through `ShmHooks` to the gateway's counters and quotas. Each connection is
served by its own thread: a request is a dictionary lookup under the pool's
lock, never a copy of a snapshot (a WRITTEN note is an xxh3 pass over bytes
the client wrote, without the GIL).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import xxhash
from google.protobuf.message import DecodeError

from kvstore.clock import Clock
from kvstore.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    Unauthenticated,
    to_status,
)
from kvstore.geometry import ModelGeometry
from kvstore.prefix import HASH_BYTES
from kvstore.swa_snapshot import HEADER_BYTES, check_position, seal, snapshot_bytes
from kvstore.v1 import swa_pb2 as pb

if TYPE_CHECKING:
    from tiers.swa_memory import Located, MemoryPool
    from tiers.swa_shm import Arena

log = logging.getLogger(__name__)

TICKET_BYTES = 32
#: A record header's fields as kvstore.swa_snapshot.seal lays them out: magic, version, geometry
#: fingerprint, T, the data's checksum, the checksum of those fields. Read here for T and the checksum;
#: `header_fields` then re-seals them, so a header is accepted only if it is exactly what seal writes.
_HEADER_LAYOUT = struct.Struct("<4sB8sQQQ")
#: Largest request read (a batch of max_batch_snapshots keys is far below).
MAX_MESSAGE = 256 << 10


def host_id() -> str:
    """This host's identity (the kernel's boot id): a client compares it before trying the socket."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def header_fields(header: bytes, fingerprint: bytes) -> tuple[int, int] | None:
    """(T, data checksum) of a record header of the geometry `fingerprint`, or None when it is not one
    `seal` wrote (another geometry or format, a damaged header)."""
    if len(header) != _HEADER_LAYOUT.size or _HEADER_LAYOUT.size != HEADER_BYTES:
        return None
    position, data_sum = _HEADER_LAYOUT.unpack(header)[3:5]
    if position < 1 or seal(fingerprint, position, b"", data_sum) != header:
        return None
    return position, data_sum


@dataclass(frozen=True, kw_only=True)
class ShmGrant:
    """What a ticket lets its holder do: one tenant's snapshots of one geometry, until `expires_s`."""

    tenant: str
    tenant_id: bytes
    fingerprint: bytes
    geometry: ModelGeometry
    writable: bool
    ttl_s: float
    max_batch: int
    #: On the pool clock's monotonic face.
    expires_s: float


class ShmHooks(Protocol):
    """The gateway's side of each request: its quotas and counters."""

    def admit(self, tenant: str) -> None:
        """Raise a KVStoreError (ResourceExhausted) when `tenant` is over its request rate."""

    def got(self, tenant: str, asked: int, found: int, corrupt: int) -> None:
        """Count one get: snapshots asked, found (hits) and found corrupt."""

    def put(self, snapshots: int, nbytes: int) -> None:
        """Count one put of `snapshots` snapshots of `nbytes` bytes."""


@dataclass
class _Reserved:
    """A record BEGIN reserved: its storage key, range (offset None: dropped), T, and its checksum so far."""

    key: bytes
    offset: int | None
    length: int
    position: int
    #: The snapshot's xxh3 so far, over its first `hashed` bytes (WRITTEN notes move it on).
    digest: xxhash.xxh3_64 = field(default_factory=xxhash.xxh3_64)
    hashed: int = 0


@dataclass
class _Conn:
    """One client connection's state: its grant and arena, what BEGIN reserved, and a WRITTEN
    that was refused (it has no reply: the COMMIT fails with it)."""

    sock: socket.socket
    grant: ShmGrant | None = None
    arena: Arena | None = None
    pending: list[_Reserved] = field(default_factory=list)
    refused: str = ""
    #: The records its last GET named, kept from reuse until its next request (it has copied them by then).
    pinned: list[Located | None] = field(default_factory=list)


class ShmServer:
    """The control socket over one pool; a thread accepts, a thread per connection serves.

    Args:
        pool: the embedded pool whose arenas hold the records.
        hooks: the gateway's quotas and counters.
        clock: its monotonic face times tickets and sessions.
    """

    def __init__(self, pool: MemoryPool, hooks: ShmHooks, *, clock: Clock) -> None:
        self.pool = pool
        self.hooks = hooks
        self.clock = clock
        #: The abstract socket's name (without its leading NUL): unique, reachable on this host only.
        self.name = f"kvstore-swa-{os.getpid()}-{uuid.uuid4().hex}"
        self._grants: dict[bytes, ShmGrant] = {}
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind("\0" + self.name)
        self._listener.listen(128)
        self._thread = threading.Thread(target=self._accept, name="swa-shm-accept", daemon=True)
        self._thread.start()

    def grant(self, grant: ShmGrant) -> bytes:
        """A new ticket for `grant` (random, 256 bits); tickets past their grant's end are dropped."""
        ticket = os.urandom(TICKET_BYTES)
        now = self.clock.monotonic()
        with self._lock:
            for old in [t for t, g in self._grants.items() if g.expires_s <= now]:
                del self._grants[old]
            self._grants[ticket] = grant
        return ticket

    def close(self) -> None:
        """Stop accepting, end every connection (clients see the socket close and use the gateway)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(_Conn(sock),), name="swa-shm-conn", daemon=True).start()

    def _serve(self, conn: _Conn) -> None:
        buf = bytearray(MAX_MESSAGE)
        try:
            while True:
                n = conn.sock.recv_into(buf)
                if n == 0:
                    return
                self._unpin(conn)
                fd = -1
                try:
                    request = pb.SwaShmRequest()
                    try:
                        request.ParseFromString(bytes(buf[:n]))
                    except DecodeError:
                        raise InvalidArgument("an unreadable SwaShmRequest") from None
                    if request.op == pb.SWA_SHM_OP_WRITTEN:
                        self._written(conn, request.index, request.written)  # one-way: no reply
                        continue
                    reply, fd = self._handle(conn, request)
                except KVStoreError as exc:
                    text = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
                    reply = pb.SwaShmReply(code=to_status(exc).value[0], message=text)
                except Exception as exc:  # a bug must not end the connection silently
                    log.exception("SWA shared-memory request failed")
                    reply = pb.SwaShmReply(code=to_status(Internal("")).value[0], message=f"internal error: {exc}")
                data = reply.SerializeToString()
                try:
                    if fd >= 0:
                        socket.send_fds(conn.sock, [data], [fd])
                    else:
                        conn.sock.sendall(data)
                finally:
                    if fd >= 0:
                        os.close(fd)
        except OSError:
            return
        finally:
            self._release(conn)
            self._unpin(conn)
            with self._lock:
                self._conns.discard(conn.sock)
            conn.sock.close()

    def _handle(self, conn: _Conn, request: pb.SwaShmRequest) -> tuple[pb.SwaShmReply, int]:
        """The reply to one request, and a descriptor to send with it (-1: none)."""
        if request.op == pb.SWA_SHM_OP_HELLO:
            return self._hello(conn, request)
        grant = conn.grant
        if grant is None:
            raise Unauthenticated("say HELLO with the ticket SwaPool.OpenDirect handed out first")
        if self.clock.monotonic() >= grant.expires_s:
            raise PermissionDenied("this shared-memory session has ended", hint="ask SwaPool.OpenDirect again")
        self.hooks.admit(grant.tenant)
        if request.op == pb.SWA_SHM_OP_GET:
            return self._get(conn, grant, request), -1
        if request.op == pb.SWA_SHM_OP_BEGIN:
            return self._begin(conn, grant, request), -1
        if request.op == pb.SWA_SHM_OP_COMMIT:
            return self._commit(conn, grant, request), -1
        if request.op == pb.SWA_SHM_OP_ABORT:
            self._release(conn)
            return pb.SwaShmReply(), -1
        raise InvalidArgument(f"op {request.op} is not a SwaShmOp this server knows")

    def _hello(self, conn: _Conn, request: pb.SwaShmRequest) -> tuple[pb.SwaShmReply, int]:
        with self._lock:
            grant = self._grants.get(request.ticket)
        if grant is None or self.clock.monotonic() >= grant.expires_s:
            raise PermissionDenied("unknown or expired shared-memory ticket", hint="ask SwaPool.OpenDirect again")
        self._release(conn)
        conn.grant = grant
        conn.arena = arena = self.pool.arena(grant.tenant_id)
        fd = arena.open_fd(writable=grant.writable)
        return pb.SwaShmReply(arena_bytes=arena.size, writable=grant.writable, ttl_ms=max(int(grant.ttl_s * 1000), 1),
                              lifetime_s=grant.expires_s - self.clock.monotonic(), max_batch=grant.max_batch), fd

    @staticmethod
    def _keys(grant: ShmGrant, keys: list[bytes]) -> list[bytes]:
        """Storage keys of the tenant's snapshot keys (32 bytes each, 1 to max_batch of them)."""
        if not 1 <= len(keys) <= grant.max_batch:
            raise InvalidArgument(f"keys has {len(keys)} entries; send 1 to {grant.max_batch} (max_batch_snapshots)")
        for i, key in enumerate(keys):
            if len(key) != HASH_BYTES:
                raise InvalidArgument(f"keys[{i}] is {len(key)} bytes; a snapshot key is {HASH_BYTES}")
        prefix = grant.fingerprint + grant.tenant_id
        return [prefix + k for k in keys]

    def _unpin(self, conn: _Conn) -> None:
        if conn.pinned:
            self.pool.unpin(conn.pinned)
            conn.pinned = []

    def _get(self, conn: _Conn, grant: ShmGrant, request: pb.SwaShmRequest) -> pb.SwaShmReply:
        keys = self._keys(grant, list(request.keys))
        if request.corrupt > grant.max_batch * 64:
            raise InvalidArgument(f"corrupt = {request.corrupt} is more than this session could have read")
        reply = pb.SwaShmReply()
        found = corrupt = 0
        conn.pinned = self.pool.locate(keys, pin=True)
        for located in conn.pinned:
            fields = header_fields(located.header, grant.fingerprint) if located is not None else None
            if located is None or fields is None or located.length != HEADER_BYTES + snapshot_bytes(
                    grant.geometry, fields[0]):
                corrupt += located is not None
                reply.offsets.append(-1)
                reply.positions.append(0)
                reply.checksums.append(0)
                continue
            found += 1
            reply.offsets.append(located.offset + HEADER_BYTES)
            reply.positions.append(fields[0])
            reply.checksums.append(fields[1])
        self.hooks.got(grant.tenant, len(keys), found, corrupt + request.corrupt)
        return reply

    def _begin(self, conn: _Conn, grant: ShmGrant, request: pb.SwaShmRequest) -> pb.SwaShmReply:
        if not grant.writable:
            raise PermissionDenied("this shared-memory session may not write (no write right, or the tenant has a "
                                   "byte quota, which the gateway's Put keeps)", hint="put through the gateway")
        self._release(conn)  # a BEGIN never committed is given back
        keys = self._keys(grant, list(request.keys))
        positions = list(request.positions)
        if len(positions) != len(keys):
            raise InvalidArgument(f"positions has {len(positions)} entries for {len(keys)} keys: send T of each")
        lengths = []
        for i, t in enumerate(positions):
            try:
                lengths.append(HEADER_BYTES + snapshot_bytes(grant.geometry, check_position(t)))
            except InvalidArgument as exc:
                raise InvalidArgument(f"positions[{i}]: {exc.message}") from None
        offsets = self.pool.reserve(grant.tenant_id, lengths)
        conn.pending = [_Reserved(key=k, offset=o, length=n, position=t)
                        for k, o, n, t in zip(keys, offsets, lengths, positions, strict=True)]
        conn.refused = ""
        return pb.SwaShmReply(offsets=[-1 if o is None else o + HEADER_BYTES for o in offsets])

    def _hash_to(self, conn: _Conn, item: _Reserved, end: int) -> None:
        """Move `item`'s checksum on over the snapshot's bytes up to `end` (xxhash lets go of the GIL)."""
        assert conn.arena is not None and item.offset is not None
        start = item.offset + HEADER_BYTES
        item.digest.update(conn.arena.view[start + item.hashed:start + end])
        item.hashed = end

    def _written(self, conn: _Conn, index: int, written: int) -> None:
        """The client's note that the first `written` bytes of snapshot `index` of its BEGIN are in place:
        checksum them now, while the client copies on. A bad note is kept for the COMMIT to refuse."""
        if conn.grant is None or not conn.pending:
            conn.refused = conn.refused or "WRITTEN without a BEGIN"
            return
        item = conn.pending[index] if index < len(conn.pending) else None
        if item is None or item.offset is None:
            conn.refused = conn.refused or (f"WRITTEN index {index} names no reserved snapshot "
                                            f"(BEGIN reserved {len(conn.pending)})")
        elif not item.hashed <= written <= item.length - HEADER_BYTES:
            conn.refused = conn.refused or (f"WRITTEN {written} bytes of snapshot {index}: after {item.hashed}, "
                                            f"at most its {item.length - HEADER_BYTES}")
        else:
            self._hash_to(conn, item, written)

    def _commit(self, conn: _Conn, grant: ShmGrant, request: pb.SwaShmRequest) -> pb.SwaShmReply:
        if conn.refused:
            refused = conn.refused
            self._release(conn)
            raise InvalidArgument(f"{refused}; nothing of the batch is stored")
        if not conn.pending:
            raise FailedPrecondition("COMMIT without a BEGIN: nothing is reserved")
        ttl_s = min(request.ttl_ms / 1000.0, grant.ttl_s) if request.ttl_ms else grant.ttl_s
        # The checksum is of what is in the arena: the server's, not the client's word. A snapshot the
        # client noted as it copied is checksummed now (the notes did most of it); one without notes is
        # live at once and checksummed by the pool's sealing thread, off the writer's path.
        items: list[tuple[bytes, int, int, bytes | Callable[[int], bytes]]] = []
        noted = any(p.hashed for p in conn.pending)
        for p in conn.pending:
            if p.offset is None:
                continue
            if noted:
                self._hash_to(conn, p, p.length - HEADER_BYTES)
                header = seal(grant.fingerprint, p.position, b"", p.digest.intdigest())
                items.append((p.key, p.offset, p.length, header))
            else:
                items.append((p.key, p.offset, p.length, partial(seal, grant.fingerprint, p.position, b"")))
        conn.pending = []
        self.pool.commit(grant.tenant_id, items, ttl_s)
        self.hooks.put(len(items), sum(length - HEADER_BYTES for _, _, length, _ in items))
        return pb.SwaShmReply(ttl_ms=max(int(ttl_s * 1000), 1))

    def _release(self, conn: _Conn) -> None:
        """Give back what the connection reserved and never committed."""
        if conn.grant is not None and conn.pending:
            self.pool.release(conn.grant.tenant_id, [(p.offset, p.length) for p in conn.pending
                                                     if p.offset is not None])
        conn.pending = []
        conn.refused = ""
