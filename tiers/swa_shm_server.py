"""The server side of the SWA shared-memory path: an abstract unix socket answering small control requests.

The gateway (gateway.swa_servicer, SwaPool.OpenDirect) authenticates a client by
its token and `grant`s it a ticket bound to its tenant, geometry, write right
and TTL. The client says HELLO with the ticket on this server's socket and gets
the descriptor of its own tenant's arena (SCM_RIGHTS; read-only, and sealed so
that no descriptor of it can be made writable), and, when it may write, that of
its tenant's staging arena, where its puts are copied; then it sends BEGIN / WRITTEN / COMMIT / ABORT / GET requests
(SwaShmRequest, one SOCK_SEQPACKET message each; kvstore.client.swa_shm is the
client). Only offsets, keys, T and checksums cross the socket; snapshots are
copied by the client straight out of the arena, where the pool
(tiers.swa_memory) keeps every record of the tenant, or into the staging
arena, from which the server copies them into the arena. What each request does to
the pool is the session's (tiers.swa_shm_session): this module owns the socket,
the tickets and the dispatch.

The gateway's rules hold here as on its gRPC path: keys are scoped to the
ticket's tenant and geometry (so another tenant's records cannot be named, and
their bytes are in an arena this client was never given); sizes come from T;
the TTL is the ticket's, a put may ask for less; reserved records count
against the pool's cap and evict by LRU; hits, puts and request rates go
through `ShmHooks` to the gateway's counters, quotas and access trace (each get
and put with its tenant and keys, recorded on the connection's thread). Each connection is
served by its own thread: a request is a dictionary lookup under the pool's
lock, never a copy out to a client (a WRITTEN note is the server's copy of
what the client wrote into the arena, hashed as it is written: one native pass
without the GIL, kvstore.native.swa_digest.copy_hashed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import uuid
from pathlib import Path

from google.protobuf.message import DecodeError

from kvstore.clock import Clock
from kvstore.errors import Internal, InvalidArgument, KVStoreError, PermissionDenied, Unauthenticated, to_status
from kvstore.v1 import swa_pb2 as pb
from tiers.swa_shm_session import ShmGrant, ShmHooks, ShmPool, ShmSession

__all__ = ["MAX_MESSAGE", "TICKET_BYTES", "ShmGrant", "ShmHooks", "ShmServer", "host_id"]

log = logging.getLogger(__name__)

TICKET_BYTES = 32
#: Largest request read (a batch of max_batch_snapshots keys is far below).
MAX_MESSAGE = 256 << 10


def host_id() -> str:
    """This host's identity (the kernel's boot id): a client compares it before trying the socket."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class ShmServer:
    """The control socket over one pool; a thread accepts, a thread per connection serves.

    Args:
        pool: the embedded pool whose arenas hold the records.
        hooks: the gateway's quotas and counters.
        clock: its monotonic face times tickets and sessions.
    """

    def __init__(self, pool: ShmPool, hooks: ShmHooks, *, clock: Clock) -> None:
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
            threading.Thread(target=self._serve, args=(sock,), name="swa-shm-conn", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        session = ShmSession(self.pool, self.hooks)
        buf = bytearray(MAX_MESSAGE)
        try:
            while True:
                n = sock.recv_into(buf)
                if n == 0:
                    return
                session.unpin()  # the client has copied what its last GET named
                fds: list[int] = []
                try:
                    request = pb.SwaShmRequest()
                    try:
                        request.ParseFromString(bytes(buf[:n]))
                    except DecodeError:
                        raise InvalidArgument("an unreadable SwaShmRequest") from None
                    if request.op == pb.SWA_SHM_OP_WRITTEN:
                        session.written(request.index, request.written)  # one-way: no reply
                        continue
                    reply, fds = self._handle(session, request)
                except KVStoreError as exc:
                    text = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
                    reply = pb.SwaShmReply(code=to_status(exc).value[0], message=text)
                except Exception as exc:  # a bug must not end the connection silently
                    log.exception("SWA shared-memory request failed")
                    reply = pb.SwaShmReply(code=to_status(Internal("")).value[0], message=f"internal error: {exc}")
                data = reply.SerializeToString()
                try:
                    if fds:
                        socket.send_fds(sock, [data], fds)
                    else:
                        sock.sendall(data)
                finally:
                    for fd in fds:
                        os.close(fd)
        except OSError:
            return
        finally:
            session.release()
            session.unpin()
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _handle(self, session: ShmSession, request: pb.SwaShmRequest) -> tuple[pb.SwaShmReply, list[int]]:
        """The reply to one request, and the descriptors to send with it (HELLO's only)."""
        if request.op == pb.SWA_SHM_OP_HELLO:
            with self._lock:
                grant = self._grants.get(request.ticket)
            now = self.clock.monotonic()
            if grant is None or now >= grant.expires_s:
                raise PermissionDenied("unknown or expired shared-memory ticket", hint="ask SwaPool.OpenDirect again")
            return session.hello(grant, lifetime_s=grant.expires_s - now)
        grant = session.grant
        if grant is None:
            raise Unauthenticated("say HELLO with the ticket SwaPool.OpenDirect handed out first")
        if self.clock.monotonic() >= grant.expires_s:
            raise PermissionDenied("this shared-memory session has ended", hint="ask SwaPool.OpenDirect again")
        self.hooks.admit(grant.tenant)
        if request.op == pb.SWA_SHM_OP_GET:
            return session.get(grant, request), []
        if request.op == pb.SWA_SHM_OP_BEGIN:
            return session.begin(grant, request), []
        if request.op == pb.SWA_SHM_OP_COMMIT:
            return session.commit(grant, request), []
        if request.op == pb.SWA_SHM_OP_ABORT:
            session.release()
            return pb.SwaShmReply(), []
        raise InvalidArgument(f"op {request.op} is not a SwaShmOp this server knows")
