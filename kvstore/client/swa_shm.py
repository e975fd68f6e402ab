"""The SWA shared-memory path: a client on the server's host copies snapshots in and out of its tenant's arena.

With the embedded pool every record lives in its tenant's shared-memory arena
(tiers.swa_shm). `SwaPool.OpenDirect` (authenticated by the token, over gRPC)
answers such a client with a ticket and the name of the server's control
socket, an abstract unix socket: reachable on the server's host only. The
client says HELLO with the ticket and receives the descriptor of its tenant's
arena over the socket (SCM_RIGHTS; read-only, of a file sealed against every
write but the server's own), maps it read-only, and, when it may write, the
descriptor of its tenant's staging arena, which it maps read-write. From then
on:

- a put is BEGIN (keys and T: the server reserves a range per record under
  the pool's cap and LRU, and answers where in the staging arena to copy
  each), one memcpy of each snapshot into its staging range, then COMMIT
  (TTL: the records are live at once; the server's sealing thread copies each
  into the arena, checksums it there and writes its header just after, and a
  reader that comes first does so itself). With `verify`, each MiB copied is
  followed by a one-way WRITTEN note, the server copies and checksums it while
  the next is copied, and the records are sealed when COMMIT answers;
- a get is GET (keys: the server answers where each live record's snapshot
  lies, its T and checksum, counts the hits, and keeps those ranges from reuse
  until this connection's next request), then one pass out of the arena that
  copies each snapshot and checksums the copy (kvstore.native.swa_digest.copy_digest).
  A copy whose checksum is not the server's is a miss, counted as corrupt at
  the next GET: whatever changed the bytes after COMMIT, a get never returns
  bytes the server did not checksum (docs/SECURITY.md). Always, `verify` or
  not: no client can write the arena, so only the server (or damage) could
  have changed them, and the price, an xxh3 pass over bytes already in L1, is
  small against returning wrong state to a model.

Only small control messages cross the socket (SOCK_SEQPACKET: one message per
request or reply); the gateway stays the control plane: keys per tenant, TTLs,
sizes, caps, hit counting and request rates are its, and every reply status is
a `kvstore.errors` class. Any socket failure is `Unavailable`; a session past
its lifetime is `PermissionDenied`: the SWA client re-opens once, then uses
the gateway path.

The control messages are SwaShmRequest and SwaShmReply (proto/kvstore/v1/swa.proto);
the server's side is tiers.swa_shm_server.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from kvstore.errors import FailedPrecondition, Internal, InvalidArgument, KVStoreError, Unavailable, from_status
from kvstore.geometry import ModelGeometry
from kvstore.native.swa_digest import copy_digest, stream_into
from kvstore.swa_snapshot import snapshot_bytes, snapshot_shape
from kvstore.v1 import swa_pb2 as pb

Buffer = bytes | bytearray | memoryview

#: The server's allocation granule (tiers.swa_shm.GRANULE): the unit this client tracks its mapped pages in.
GRANULE = 64 << 10
#: madvise: fill the page tables of a range in one call (Linux 5.14), instead of one fault per 4 KiB page.
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
#: Bytes a put copies between WRITTEN notes (each wakes the server to checksum them: fewer, larger
#: notes ran faster on a loaded 2-core machine than 256 KiB ones, and about as fast as one per snapshot).
NOTE = 1 << 20
#: Largest message either side reads (a batch of max_batch_snapshots keys is far below).
MAX_MESSAGE = 256 << 10
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def host_id() -> str:
    """This host's identity as the server states it (the kernel's boot id; tiers.swa_shm_server.host_id)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def raise_for(reply: pb.SwaShmReply) -> None:
    """Raise the kvstore error a non-OK reply carries."""
    if reply.code:
        code = _CODES.get(reply.code, grpc.StatusCode.INTERNAL)
        raise from_status(code, f"SWA shared-memory path: {reply.message}")


def size_error(geometry: ModelGeometry, index: int, size: int, position: int) -> InvalidArgument:
    """The refusal of a snapshot of `size` bytes at T = `position`, worded as the gateway's
    (gateway.swa_servicer.check_snapshot), so a caller sees one message whichever path it took."""
    shape = snapshot_shape(geometry)
    tail = (f" + the raw tail of {len(shape.ratio2_layers)} ratio-2 layers ({shape.tail_bytes} B, T is odd)"
            if position % 2 else " (T is even: no tail)")
    return InvalidArgument(
        f"snapshots[{index}] is {size} bytes; a {geometry.name} SWA snapshot at T = {position} is "
        f"{snapshot_bytes(geometry, position)} bytes: {shape.layers} layers x {shape.window_positions(position)} "
        f"window rows of {shape.row_bytes} B{tail} (kvstore.swa_snapshot.snapshot_bytes)")


@dataclass(frozen=True, kw_only=True)
class ShmGets:
    """One get call: the snapshots (None where missing or not intact) and the copies that failed their check."""

    data: list[bytes | memoryview | None]
    corrupt: int


class ShmPath:
    """One tenant's snapshots in the server's shared memory, reached with the ticket the gateway handed out.

    Args:
        grant: the OpenDirect answer (offered, with `shm_socket`).
        geometry: the geometry snapshot sizes are checked against.
        verify: have the server copy and checksum each put snapshot as it is copied (WRITTEN notes:
            sealed when COMMIT answers, where by default the server settles and seals it just after, off
            the put's path). Gets check every copy against the server's checksum either way.
        timeout_s: how long a control request may take before it is `Unavailable`.
        clock: monotonic seconds (injected in tests).

    Raises:
        FailedPrecondition: the server is on another host.
        Unavailable: its control socket cannot be reached (another host, another network namespace).
        PermissionDenied: the ticket was refused.
    """

    kind = "shm"
    #: The server counts shared-memory gets itself: nothing to report (SwaPool.ReportDirect is the Redis path's).
    reports = False

    def __init__(self, grant: pb.SwaOpenDirectResponse, *, geometry: ModelGeometry, timeout_s: float,
                 verify: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        if grant.shm_host != host_id():
            raise FailedPrecondition("the server is on another host (its boot id differs): no shared memory")
        self.geometry = geometry
        self.verify = verify
        self.tenant = grant.tenant
        self.clock = clock
        self._lock = threading.Lock()  # one request in flight per socket: SwaClient may be shared by threads
        self._buf = bytearray(MAX_MESSAGE)
        self._corrupt = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._map: mmap.mmap | None = None
        self._staging: mmap.mmap | None = None
        try:
            self._sock.settimeout(timeout_s)
            with _mapped():
                self._sock.connect("\0" + grant.shm_socket)
                hello = pb.SwaShmRequest(op=pb.SWA_SHM_OP_HELLO, ticket=grant.shm_ticket)
                self._sock.sendall(hello.SerializeToString())
                data, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, 2)
            try:
                reply = _parse(data)
                if len(fds) != 1 + reply.writable:
                    raise Unavailable(f"SWA shared-memory path: the server sent {len(fds)} arenas, not "
                                      f"{1 + reply.writable}")
                self.writable, self.ttl_ms, self.max_batch = reply.writable, reply.ttl_ms, reply.max_batch
                self._map = mmap.mmap(fds[0], reply.arena_bytes, prot=mmap.PROT_READ)
                if self.writable:
                    self._staging = mmap.mmap(fds[1], os.fstat(fds[1]).st_size)  # sized to the pool's cap
            finally:
                for fd in fds:
                    socket.close(fd)
            self._view = memoryview(self._map)
            self._staged = memoryview(self._staging) if self._staging is not None else None
            # Granules each mapping has touched: a range touched for the first time is populated with
            # one madvise, where a copy into it would take a page fault every 4 KiB (about 3x the copy).
            self._touched = bytearray(-(-reply.arena_bytes // GRANULE))
            self._touched_staging = bytearray(-(-len(self._staging) // GRANULE)) if self._staging else bytearray()
            self._renew_at = clock() + reply.lifetime_s / 2
        except BaseException:
            self.close()
            raise

    @property
    def due(self) -> bool:
        """Whether to ask the gateway for a new session (half its lifetime has passed)."""
        return self.clock() >= self._renew_at

    def _populate(self, mapping: mmap.mmap | None, touched: bytearray, offset: int, size: int, advice: int) -> None:
        """Map the pages of [offset, offset + size) in one call when any of them is new to `mapping`."""
        lo, hi = offset // GRANULE, -(-(offset + size) // GRANULE)
        if 0 in touched[lo:hi]:
            start = lo * GRANULE
            with contextlib.suppress(OSError, ValueError):  # an older kernel: the copy faults them in
                assert mapping is not None
                mapping.madvise(advice, start, min(hi * GRANULE, len(mapping)) - start)
            touched[lo:hi] = b"\x01" * (hi - lo)

    def _call(self, request: pb.SwaShmRequest) -> pb.SwaShmReply:
        """Send one request, return its OK reply."""
        with _mapped():
            self._sock.sendall(request.SerializeToString())
            n = self._sock.recv_into(self._buf)
        return _parse(memoryview(self._buf)[:n])

    def put_many(self, triples: Sequence[tuple[bytes, int, Buffer]], ttl_ms: int) -> int:
        """Store (key, T, snapshot) triples: reserve, copy each into the staging arena, commit. Returns
        bytes put.

        Raises:
            InvalidArgument: a snapshot of the wrong size for its T (nothing sent).
            PermissionDenied: this session may not write (the server refuses the BEGIN).
        """
        for i, (_, position, data) in enumerate(triples):
            if len(data) != snapshot_bytes(self.geometry, position):
                raise size_error(self.geometry, i, len(data), position)
        with self._lock:
            reply = self._call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_BEGIN, keys=[k for k, _, _ in triples],
                                                 positions=[t for _, t, _ in triples]))
            offsets = list(reply.offsets)
            if len(offsets) != len(triples):
                raise Internal(f"SWA shared-memory path: {len(offsets)} offsets for {len(triples)} snapshots")
            placed = [(i, offset, data) for i, (offset, (_, _, data)) in enumerate(zip(offsets, triples, strict=True))
                      if offset >= 0]
            if placed and self._staged is None:
                raise Internal("SWA shared-memory path: the server reserved ranges for a session it gave no "
                               "staging arena")
            try:
                for n, (i, offset, data) in enumerate(placed):
                    assert self._staged is not None
                    self._populate(self._staging, self._touched_staging, offset, len(data), MADV_POPULATE_WRITE)
                    source = memoryview(data).cast("B")
                    for lo in range(0, len(source), NOTE):
                        hi = min(lo + NOTE, len(source))
                        # The one copy, with non-temporal stores: we never read it again, and the server
                        # checksums it from memory rather than out of this core's cache.
                        stream_into(self._staged[offset + lo:offset + hi], source[lo:hi])
                        if self.verify and (hi < len(source) or n + 1 < len(placed)):
                            # The server copies this chunk into the arena and checksums it while we copy
                            # the next (no reply; COMMIT does the last), so it is sealed when COMMIT answers.
                            note = pb.SwaShmRequest(op=pb.SWA_SHM_OP_WRITTEN, index=i, written=hi)
                            with _mapped():
                                self._sock.sendall(note.SerializeToString())
            except KVStoreError:
                raise
            except BaseException:
                with contextlib.suppress(KVStoreError):
                    self._call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_ABORT))
                raise
            self._call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_COMMIT, ttl_ms=ttl_ms))
        return sum(len(d) for _, _, d in triples)

    def get_many(self, keys: Sequence[bytes]) -> ShmGets:
        """The snapshots under `keys`, each copied out of the arena once (bytes) and checked against the
        checksum the server took; None where missing or where the copy fails its check (counted)."""
        with self._lock:
            reply = self._call(pb.SwaShmRequest(op=pb.SWA_SHM_OP_GET, keys=keys, corrupt=self._corrupt))
            self._corrupt = 0
            if not len(reply.offsets) == len(reply.positions) == len(reply.checksums) == len(keys):
                raise Internal(f"SWA shared-memory path: a GET reply of {len(reply.offsets)} items, "
                               f"{len(keys)} keys asked")
            out: list[bytes | memoryview | None] = []
            corrupt = 0
            # The server keeps these ranges from reuse until our next request: copy each once.
            for offset, position, expected in zip(reply.offsets, reply.positions, reply.checksums, strict=True):
                if offset < 0:
                    out.append(None)
                    continue
                size = snapshot_bytes(self.geometry, position)
                self._populate(self._map, self._touched, offset, size, MADV_POPULATE_READ)
                # One pass: each 32 KiB is checksummed just after it is copied, while in L1
                # (kvstore.native.swa_digest.copy_digest; where it is not built, a copy and then a checksum).
                copy, digest = copy_digest(self._view[offset:offset + size])
                if digest == expected:
                    out.append(copy)
                    continue
                corrupt += 1  # changed since the server checksummed it (damage, a server bug): a miss
                out.append(None)
            self._corrupt += corrupt
        return ShmGets(data=out, corrupt=corrupt)

    def close(self) -> None:
        """Close the control socket and unmap the arenas (snapshots already returned are copies)."""
        self._sock.close()
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._view.release()
                self._map.close()
            self._map = None
        if self._staging is not None:
            with contextlib.suppress(BufferError):
                if self._staged is not None:
                    self._staged.release()
                self._staging.close()
            self._staging = None


def _parse(data: bytes | memoryview) -> pb.SwaShmReply:
    """The reply in `data`, raised as its kvstore error when not OK."""
    if not len(data):
        raise Unavailable("SWA shared-memory path: the server closed the control socket (restarted or stopped)")
    reply = pb.SwaShmReply()
    try:
        reply.ParseFromString(bytes(data))
    except DecodeError:
        raise Internal("SWA shared-memory path: an unreadable reply from the server") from None
    raise_for(reply)
    return reply


@contextlib.contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except (OSError, TimeoutError) as exc:
        raise Unavailable(f"SWA shared-memory path: the control socket failed: {type(exc).__name__}: {exc}") from None

