"""One shared-memory session of the SWA pool: what each control request does to the pool, under its grant.

A session starts when a client says HELLO with a valid ticket
(tiers.swa_shm_server checks the ticket and hands the session its `ShmGrant`).
From then on its requests (docs/SWA_POOL.md "Shared-memory path") are:

- GET: locate the keys in the pool, check each record's header, answer where
  each snapshot lies, and pin those records until the session's next request
  (the client copies them out meanwhile);
- BEGIN: check keys and T, reserve a range per record (counted against the
  cap, evicting by LRU); WRITTEN: checksum the bytes the client says it has
  copied so far; COMMIT: make the records live under the grant's TTL, sealed
  with the server's checksum of what is in the arena; ABORT: give the
  reservation back.

The pool is reached through `ShmPool` (tiers.swa_memory.MemoryPool is the
one), so this module and the socket server never import the pool's module.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import xxhash

from kvstore.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kvstore.geometry import ModelGeometry
from kvstore.prefix import HASH_BYTES
from kvstore.swa_snapshot import HEADER_BYTES, check_position, seal, snapshot_bytes
from kvstore.v1 import swa_pb2 as pb
from tiers.swa_shm import Arena, Located

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
    """The gateway's side of each request: its quotas and counters."""

    def admit(self, tenant: str) -> None:
        """Raise a KVStoreError (ResourceExhausted) when `tenant` is over its request rate."""

    def got(self, tenant: str, asked: int, found: int, corrupt: int) -> None:
        """Count one get: snapshots asked, found (hits) and found corrupt."""

    def put(self, snapshots: int, nbytes: int) -> None:
        """Count one put of `snapshots` snapshots of `nbytes` bytes."""


class ShmPool(Protocol):
    """What a session needs of the pool whose arenas hold the records (tiers.swa_memory.MemoryPool)."""

    def arena(self, tenant: bytes) -> Arena:
        """The arena of the tenant whose namespace id is `tenant`."""

    def reserve(self, tenant: bytes, lengths: Sequence[int]) -> list[int | None]:
        """Ranges for records of `lengths` bytes, counted against the cap (None: dropped)."""

    def release(self, tenant: bytes, spans: Sequence[tuple[int, int]]) -> None:
        """Give back reserved (offset, length) ranges never committed."""

    def commit(self, tenant: bytes, items: Sequence[tuple[bytes, int, int, Header]], ttl_s: float) -> None:
        """Make reserved (key, offset, length, header) records live for `ttl_s`."""

    def locate(self, keys: Sequence[bytes], *, pin: bool = False) -> list[Located | None]:
        """Where each live record lies; with `pin`, kept from reuse until `unpin`."""

    def unpin(self, located: Sequence[Located | None]) -> None:
        """Let the ranges `locate(pin=True)` kept be reused."""


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
        self._pending: list[_Reserved] = []
        self._refused = ""
        #: The records the last GET named, kept from reuse until the next request (copied by then).
        self._pinned: list[Located | None] = []

    def hello(self, grant: ShmGrant, lifetime_s: float) -> tuple[pb.SwaShmReply, int]:
        """Start (or restart) the session under `grant`: the reply and a new descriptor of the
        tenant's arena (read-only unless the grant may write; the caller sends and closes it)."""
        self.release()
        self.grant = grant
        self.arena = arena = self.pool.arena(grant.tenant_id)
        fd = arena.open_fd(writable=grant.writable)
        return pb.SwaShmReply(arena_bytes=arena.size, writable=grant.writable, ttl_ms=max(int(grant.ttl_s * 1000), 1),
                              lifetime_s=lifetime_s, max_batch=grant.max_batch), fd

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
        keys = self._keys(grant, list(request.keys))
        if request.corrupt > grant.max_batch * 64:
            raise InvalidArgument(f"corrupt = {request.corrupt} is more than this session could have read")
        reply = pb.SwaShmReply()
        found = corrupt = 0
        self._pinned = self.pool.locate(keys, pin=True)
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
        self.hooks.got(grant.tenant, len(keys), found, corrupt + request.corrupt)
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
        offsets = self.pool.reserve(grant.tenant_id, lengths)
        self._pending = [_Reserved(key=k, offset=o, length=n, position=t)
                         for k, o, n, t in zip(keys, offsets, lengths, positions, strict=True)]
        self._refused = ""
        return pb.SwaShmReply(offsets=[-1 if o is None else o + HEADER_BYTES for o in offsets])

    def _hash_to(self, item: _Reserved, end: int) -> None:
        """Move `item`'s checksum on over the snapshot's bytes up to `end` (xxhash lets go of the GIL)."""
        assert self.arena is not None and item.offset is not None
        start = item.offset + HEADER_BYTES
        item.digest.update(self.arena.view[start + item.hashed:start + end])
        item.hashed = end

    def written(self, index: int, written: int) -> None:
        """The client's note that the first `written` bytes of snapshot `index` of its BEGIN are in place:
        checksum them now, while the client copies on. A bad note is kept for the COMMIT to refuse."""
        if self.grant is None or not self._pending:
            self._refused = self._refused or "WRITTEN without a BEGIN"
            return
        item = self._pending[index] if index < len(self._pending) else None
        if item is None or item.offset is None:
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
        items: list[tuple[bytes, int, int, Header]] = []
        noted = any(p.hashed for p in self._pending)
        for p in self._pending:
            if p.offset is None:
                continue
            if noted:
                self._hash_to(p, p.length - HEADER_BYTES)
                header = seal(grant.fingerprint, p.position, b"", p.digest.intdigest())
                items.append((p.key, p.offset, p.length, header))
            else:
                items.append((p.key, p.offset, p.length, partial(seal, grant.fingerprint, p.position, b"")))
        self._pending = []
        self.pool.commit(grant.tenant_id, items, ttl_s)
        self.hooks.put(len(items), sum(length - HEADER_BYTES for _, _, length, _ in items))
        return pb.SwaShmReply(ttl_ms=max(int(ttl_s * 1000), 1))

    def release(self) -> None:
        """Give back what the session reserved and never committed (ABORT, a new BEGIN, the end)."""
        if self.grant is not None and self._pending:
            self.pool.release(self.grant.tenant_id, [(p.offset, p.length) for p in self._pending
                                                     if p.offset is not None])
        self._pending = []
        self._refused = ""
