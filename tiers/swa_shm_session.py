"""One shared-memory session of the SWA pool: what each control request does to the pool, under its grant.

A session starts when a client says HELLO with a valid ticket
(tiers.swa_shm_server checks the ticket and hands the session its `ShmGrant`).
From then on its requests (docs/SWA_POOL.md "Shared-memory path") are:

- GET: locate the keys in the pool, check each record's header, answer where
  each snapshot lies, and pin those records until the session's next request
  (the client copies them out meanwhile);
- BEGIN: check keys and T, reserve a range per record (counted against the
  cap, evicting by LRU) and one in the tenant's staging arena, where the client
  copies the snapshot (the arena itself is sealed against every client's
  writes: tiers.swa_shm); WRITTEN: copy the bytes the client says it has
  copied so far into the arena and checksum them there; COMMIT: make the
  records live under the grant's TTL, sealed with the server's checksum of
  what is in the arena (or settled and sealed by the pool just after);
  ABORT: give the reservation back.

The pool is reached through `ShmPool` (tiers.swa_memory.MemoryPool is the
one), so this module and the socket server never import the pool's module.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from kvstore.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvstore.geometry import ModelGeometry
from kvstore.native.swa_digest import Hasher, copy_hashed, hasher
from kvstore.prefix import HASH_BYTES
from kvstore.swa_snapshot import HEADER_BYTES, check_position, seal, snapshot_bytes
from kvstore.v1 import swa_pb2 as pb
from tiers.swa_shm import Arena, Located, Reserved

#: A record header's fields as kvstore.swa_snapshot.seal lays them out: magic, version, geometry
#: fingerprint, T, the data's checksum, the checksum of those fields. Read here for T and the checksum;
#: `header_fields` then re-seals them, so a header is accepted only if it is exactly what seal writes.
_HEADER_LAYOUT = struct.Struct("<4sB8sQQQ")
#: A record's header, or a function of its snapshot's checksum that makes it (sealed later).
Header = bytes | Callable[[int], bytes]


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
    """The gateway's side of each request: its quotas, counters and access trace (called on the session's
    thread)."""

    def admit(self, tenant: str) -> None:
        """Raise a KVStoreError (ResourceExhausted) when `tenant` is over its request rate."""

    def got(self, grant: ShmGrant, keys: Sequence[bytes], found: int, corrupt: int) -> None:
        """One get under `grant` of the snapshots `keys` (the client's 32-byte keys): `found` served (hits),
        `corrupt` found corrupt (here, or by the client since its last request)."""

    def put(self, grant: ShmGrant, keys: Sequence[bytes], stored: int, nbytes: int) -> None:
        """One put (a COMMIT) under `grant` of the snapshots `keys`: `stored` of them, of `nbytes` bytes, made
        live (the others had no room under the cap)."""


class ShmPool(Protocol):
    """What a session needs of the pool whose arenas hold the records (tiers.swa_memory.MemoryPool)."""

    def arena(self, tenant: bytes) -> Arena:
        """The arena of the tenant whose namespace id is `tenant` (clients only read it)."""

    def staging(self, tenant: bytes) -> Arena:
        """The staging arena of that tenant (its writers copy puts there)."""

    def reserve(self, tenant: bytes, lengths: Sequence[int], *, arena: Arena | None = None) -> list[Reserved | None]:
        """Ranges for records of `lengths` bytes, counted against the cap (None: dropped); PermissionDenied
        when `arena` is no longer the tenant's."""

    def release(self, tenant: bytes, spans: Sequence[Reserved]) -> None:
        """Give back reservations never committed."""

    def commit(self, tenant: bytes, items: Sequence[tuple[bytes, Reserved, Header]], ttl_s: float) -> None:
        """Make reserved (key, reservation, header) records live for `ttl_s`."""

    def locate(self, keys: Sequence[bytes], *, pin: bool = False, arena: Arena | None = None) -> list[Located | None]:
        """Where each live record lies (in `arena` only, when given); with `pin`, kept from reuse until
        `unpin`."""

    def unpin(self, located: Sequence[Located | None]) -> None:
        """Let the ranges `locate(pin=True)` kept be reused."""


@dataclass
class _Reserved:
    """A record BEGIN reserved: its storage key, ranges (None: dropped), length, T, and its checksum so far."""

    key: bytes
    span: Reserved | None
    length: int
    position: int
    #: The snapshot's xxh3 so far, over its first `hashed` bytes as copied into the arena (WRITTEN notes
    #: move it on).
    digest: Hasher = field(default_factory=hasher)
    hashed: int = 0


class ShmSession:
    """One connection's session: its grant and arena once HELLO succeeded, what BEGIN reserved, a
    WRITTEN note that was refused (it has no reply: the COMMIT fails with it), and what the last GET
    pinned. Served by its connection's thread only.

    Args:
        pool: the pool whose arenas hold the records.
        hooks: the gateway's quotas and counters.
    """

    def __init__(self, pool: ShmPool, hooks: ShmHooks) -> None:
        self.pool = pool
        self.hooks = hooks
        self.grant: ShmGrant | None = None
        self.arena: Arena | None = None
        self.staging: Arena | None = None
        self._pending: list[_Reserved] = []
        self._refused = ""
        #: The records the last GET named, kept from reuse until the next request (copied by then).
        self._pinned: list[Located | None] = []

    def hello(self, grant: ShmGrant, lifetime_s: float) -> tuple[pb.SwaShmReply, list[int]]:
        """Start (or restart) the session under `grant`: the reply and new descriptors to send with it (the
        caller sends and closes them): the tenant's arena, read-only (sealed: no descriptor of it can
        be mapped for writing), then, when the grant may write, the tenant's staging arena, read-write
        (the client takes its size from the descriptor). A reader is never handed the staging arena."""
        self.release()
        self.grant = grant
        self.arena = arena = self.pool.arena(grant.tenant_id)
        self.staging = self.pool.staging(grant.tenant_id) if grant.writable else None
        fds = [arena.open_fd(writable=False)]
        try:
            if self.staging is not None:
                fds.append(self.staging.open_fd(writable=True))
        except BaseException:
            os.close(fds[0])
            raise
        return pb.SwaShmReply(arena_bytes=arena.size, writable=grant.writable, ttl_ms=max(int(grant.ttl_s * 1000), 1),
                              lifetime_s=lifetime_s, max_batch=grant.max_batch), fds

    def _current(self, grant: ShmGrant) -> Arena:
        """The session's arena, still the tenant's (one that held nothing is let go and replaced: the
        client must open anew to be handed the new one)."""
        if self.arena is None or self.pool.arena(grant.tenant_id) is not self.arena:
            raise PermissionDenied("this shared-memory session has ended: its tenant's arena was renewed",
                                   hint="ask SwaPool.OpenDirect again")
        return self.arena

    def _keys(self, grant: ShmGrant, keys: list[bytes]) -> list[bytes]:
        """Storage keys of the tenant's snapshot keys (32 bytes each, 1 to max_batch of them)."""
        if not 1 <= len(keys) <= grant.max_batch:
            raise InvalidArgument(f"keys has {len(keys)} entries; send 1 to {grant.max_batch} (max_batch_snapshots)")
        for i, key in enumerate(keys):
            if len(key) != HASH_BYTES:
                raise InvalidArgument(f"keys[{i}] is {len(key)} bytes; a snapshot key is {HASH_BYTES}")
        prefix = grant.fingerprint + grant.tenant_id
        return [prefix + k for k in keys]

    def unpin(self) -> None:
        """Let the records the last GET named be reused (the client has copied them)."""
        if self._pinned:
            self.pool.unpin(self._pinned)
            self._pinned = []

    def get(self, grant: ShmGrant, request: pb.SwaShmRequest) -> pb.SwaShmReply:
        """Where each key's snapshot lies (offset -1: missing or corrupt), its T and checksum; pinned."""
        asked = list(request.keys)
        keys = self._keys(grant, asked)
        if request.corrupt > grant.max_batch * 64:
            raise InvalidArgument(f"corrupt = {request.corrupt} is more than this session could have read")
        reply = pb.SwaShmReply()
        found = corrupt = 0
        self._pinned = self.pool.locate(keys, pin=True, arena=self._current(grant))
        for located in self._pinned:
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
        self.hooks.got(grant, asked, found, corrupt + request.corrupt)
        return reply

    def begin(self, grant: ShmGrant, request: pb.SwaShmRequest) -> pb.SwaShmReply:
        """Reserve a range per record (a BEGIN never committed is given back first); where to copy each."""
        if not grant.writable:
            raise PermissionDenied("this shared-memory session may not write (no write right, or the tenant has a "
                                   "byte quota, which the gateway's Put keeps)", hint="put through the gateway")
        self.release()
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
        spans = self.pool.reserve(grant.tenant_id, lengths, arena=self._current(grant))
        self._pending = [_Reserved(key=k, span=s, length=n, position=t)
                         for k, s, n, t in zip(keys, spans, lengths, positions, strict=True)]
        self._refused = ""
        # Where the client copies each snapshot: its staging range, after the header's room.
        return pb.SwaShmReply(offsets=[-1 if s is None else s.staged + HEADER_BYTES for s in spans])

    def _hash_to(self, item: _Reserved, end: int) -> None:
        """Copy `item`'s snapshot on into the arena up to `end`, and move its checksum on over those bytes
        as written there (one native pass without the GIL: kvstore.native.swa_digest.copy_hashed)."""
        assert self.arena is not None and self.staging is not None and item.span is not None
        dst, src = item.span.offset + HEADER_BYTES, item.span.staged + HEADER_BYTES
        copy_hashed(self.arena.view[dst + item.hashed:dst + end], self.staging.view[src + item.hashed:src + end],
                    item.digest)
        item.hashed = end

    def written(self, index: int, written: int) -> None:
        """The client's note that the first `written` bytes of snapshot `index` of its BEGIN are in place:
        checksum them now, while the client copies on. A bad note is kept for the COMMIT to refuse."""
        if self.grant is None or not self._pending:
            self._refused = self._refused or "WRITTEN without a BEGIN"
            return
        item = self._pending[index] if index < len(self._pending) else None
        if item is None or item.span is None:
            self._refused = self._refused or (f"WRITTEN index {index} names no reserved snapshot "
                                              f"(BEGIN reserved {len(self._pending)})")
        elif not item.hashed <= written <= item.length - HEADER_BYTES:
            self._refused = self._refused or (f"WRITTEN {written} bytes of snapshot {index}: after {item.hashed}, "
                                              f"at most its {item.length - HEADER_BYTES}")
        else:
            self._hash_to(item, written)

    def commit(self, grant: ShmGrant, request: pb.SwaShmRequest) -> pb.SwaShmReply:
        """Make what BEGIN reserved live, under the grant's TTL (or the shorter one asked)."""
        if self._refused:
            refused = self._refused
            self.release()
            raise InvalidArgument(f"{refused}; nothing of the batch is stored")
        if not self._pending:
            raise FailedPrecondition("COMMIT without a BEGIN: nothing is reserved")
        ttl_s = min(request.ttl_ms / 1000.0, grant.ttl_s) if request.ttl_ms else grant.ttl_s
        # The checksum is of what is in the arena: the server's, not the client's word. A snapshot the
        # client noted as it copied is checksummed now (the notes did most of it); one without notes is
        # live at once and checksummed by the pool's sealing thread, off the writer's path.
        items: list[tuple[bytes, Reserved, Header]] = []
        keys = [p.key[-HASH_BYTES:] for p in self._pending]  # the client's keys, the storage prefix cut off
        noted = any(p.hashed for p in self._pending)
        for p in self._pending:
            if p.span is None:
                continue
            if noted:
                self._hash_to(p, p.length - HEADER_BYTES)
                header = seal(grant.fingerprint, p.position, b"", p.digest.intdigest())
                items.append((p.key, p.span, header))
            else:
                items.append((p.key, p.span, partial(seal, grant.fingerprint, p.position, b"")))
        self._pending = []
        self.pool.commit(grant.tenant_id, items, ttl_s)
        self.hooks.put(grant, keys, len(items), sum(span.length - HEADER_BYTES for _, span, _ in items))
        return pb.SwaShmReply(ttl_ms=max(int(ttl_s * 1000), 1))

    def release(self) -> None:
        """Give back what the session reserved and never committed (ABORT, a new BEGIN, the end)."""
        if self.grant is not None and self._pending:
            self.pool.release(self.grant.tenant_id, [p.span for p in self._pending if p.span is not None])
        self._pending = []
        self._refused = ""
