"""The embedded SWA pool: records in per-tenant shared-memory arenas, an LRU index, a byte cap, per-record expiry.

No other process is needed, so this is the default for a single node. Each
record (header + snapshot) lives in the shared-memory arena of its tenant
(tiers.swa_shm.Arena, sealed against every write but the server's), so a
client on the same host can copy snapshots out itself (the shared-memory path,
tiers.swa_shm_server); a shared-memory writer copies into the tenant's staging
arena, and the pool moves each committed snapshot from there into the arena,
checksumming it there. The gateway path copies records in and out here. Both
paths share one index, so the rules are the same on both: LRU eviction under
`cap_bytes` of record bytes, each record's TTL from its put, expiry and
eviction as misses. Time comes from the injected Clock: tests expire records
by moving it.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.clock import Clock
from kvstore.config import SwaSettings
from kvstore.errors import PermissionDenied, Unavailable
from kvstore.native.swa_digest import copy_hashed, digest, hasher
from kvstore.prefix import FINGERPRINT_BYTES, HASH_BYTES, NAMESPACE_ID_BYTES
from kvstore.swa_snapshot import HEADER_BYTES
from tiers.swa_pool import PoolUsage, SwaPool, dram_cap_bytes
from tiers.swa_shm import DEFAULT_IDLE_LIMIT, Arena, Located, Reserved
from tiers.swa_shm_server import ShmServer
from tiers.swa_shm_session import Header, ShmHooks

#: Address space of an arena beyond twice the cap (room for fragmentation; only written pages cost memory).
ARENA_SLACK = 64 << 20
#: Most address space of one arena, so that many tenants fit a 47-bit address space (500 of them, or
#: about 340 with a staging arena each): a tenant holds at most about half of it, its own least
#: recently used records making room.
ARENA_MAX = 256 << 30
#: Most address space of a staging arena. It holds only puts reserved, or live and not yet copied into
#: the arena: both count against the cap, so the cap plus ARENA_SLACK leaves room for fragmentation.
STAGING_MAX = ARENA_MAX // 2


def arena_id(key: bytes) -> bytes:
    """The tenant part of a storage key (geometry fingerprint + namespace id + hash): its namespace id.
    Keys of another shape share the arena b'' (the shared-memory path never hands that one out)."""
    if len(key) == FINGERPRINT_BYTES + NAMESPACE_ID_BYTES + HASH_BYTES:
        return key[FINGERPRINT_BYTES:FINGERPRINT_BYTES + NAMESPACE_ID_BYTES]
    return b""


@dataclass(slots=True)
class _Entry:
    arena: Arena
    offset: int
    length: int
    expires_s: float
    #: Where a shared-memory put's snapshot still lies in the tenant's staging arena (the same layout:
    #: header room, then the snapshot) until `_seal` copies it into `arena`; None once it is there.
    staged: tuple[Arena, int] | None = None
    #: The sealing thread is copying or checksumming it without the lock: a reader that seals it meanwhile
    #: copies the same staged bytes itself, and leaves the staging range for the sealing thread to free.
    sealing: bool = False
    #: Shared-memory readers copying it now (`locate(pin=True)` until `unpin`): its range is not reused
    #: before they are done, even if it expires or is evicted meanwhile (`dropped`).
    pins: int = 0
    #: Out of the index (replaced, deleted, expired or evicted): never sealed after, freed once unpinned.
    dropped: bool = False
    #: A shared-memory put committed without its checksum yet: makes its header from the checksum
    #: (`_seal`, by the sealing thread or the first reader, whichever comes first).
    unsealed: Callable[[int], bytes] | None = None


class MemoryPool(SwaPool):
    """Records in per-tenant arenas, indexed by an OrderedDict in LRU order, evicted to stay under `cap_bytes`.

    Args:
        cap_bytes: most record bytes held (keys not counted: they are 32-64 bytes
            against megabyte records), reserved shared-memory puts included.
        clock: the time source for expiry.
        shm: whether same-host clients may use the shared-memory path (`swa.direct`).
        session_lifetime_s: how long a shared-memory session lives before its client asks again.
    """

    name = "memory"

    def __init__(self, *, cap_bytes: int, clock: Clock, shm: bool = True, session_lifetime_s: float = 600.0) -> None:
        self.cap_bytes = cap_bytes
        self.clock = clock
        self.shm_enabled = shm
        self.session_lifetime_s = session_lifetime_s
        # OrderedDict, not dict: move_to_end makes a hit O(1) and popitem(last=False) gives the LRU.
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # (expires_s, key) in expiry order, so a sweep finds expired records without a scan;
        # stale pairs (key rewritten or gone) are skipped when popped.
        self._expiry: list[tuple[float, bytes]] = []
        self._arenas: dict[bytes, Arena] = {}
        self._staging: dict[bytes, Arena] = {}
        #: Arenas that became empty (`Arena.retirable` is checked again before one is let go).
        self._emptied: set[bytes] = set()
        self._bytes = 0
        self._pending = 0  # bytes reserved by shared-memory puts not committed yet
        self._expirations = 0
        self._evictions = 0
        self._lock = threading.Lock()
        self._shm: ShmServer | None = None
        # Shared-memory puts committed unsealed, oldest first, and the thread that seals them.
        self._unsealed: deque[_Entry] = deque()
        self._wake = threading.Condition(self._lock)
        self._sealer: threading.Thread | None = None
        self._closing = False

    @classmethod
    def from_settings(cls, settings: SwaSettings, *, clock: Clock) -> MemoryPool:
        """A pool capped by the settings (explicit bytes or a share of DRAM)."""
        return cls(cap_bytes=dram_cap_bytes(settings), clock=clock, shm=settings.direct,
                   session_lifetime_s=settings.direct_user_lifetime_s)

    # -- arenas and the index (callers hold the lock) ----------------------

    def arena(self, tenant: bytes) -> Arena:
        """The arena of the tenant whose namespace id is `tenant`, made on first use."""
        with self._lock:
            return self._arena(tenant)

    def staging(self, tenant: bytes) -> Arena:
        """The staging arena of the tenant whose namespace id is `tenant` (its writers copy puts there),
        made on first use."""
        with self._lock:
            return self._staging_arena(tenant)

    def _new_arena(self, tenant: bytes, kind: str, *, clients_write: bool) -> Arena:
        # A staging arena holds what is reserved and not yet copied out (the cap at most): no room for the
        # fragmentation of live records is needed there.
        size = (min(self.cap_bytes + ARENA_SLACK, STAGING_MAX) if clients_write
                else min(2 * self.cap_bytes + ARENA_SLACK, ARENA_MAX))
        try:
            return Arena(f"kvstore-swa-{kind}{tenant.hex() or 'other'}", size,
                         idle_limit=min(DEFAULT_IDLE_LIMIT, self.cap_bytes // 4), clients_write=clients_write)
        except OSError as exc:  # out of address space or descriptors: a miss, counted, never a crash
            raise Unavailable(f"cannot make the SWA arena of another tenant: {exc}") from None

    def _arena(self, tenant: bytes) -> Arena:
        arena = self._arenas.get(tenant)
        if arena is None:
            arena = self._arenas[tenant] = self._new_arena(tenant, "", clients_write=False)
        return arena

    def _staging_arena(self, tenant: bytes) -> Arena:
        staging = self._staging.get(tenant)
        if staging is None:
            staging = self._staging[tenant] = self._new_arena(tenant, "staging-", clients_write=True)
        return staging

    def _retire_emptied(self) -> None:
        """Let go of arenas that hold nothing and grew past their idle budget: a sealed arena cannot give
        pages back otherwise. Its sessions see it is not their tenant's arena any more and open anew."""
        for tenant in self._emptied:
            arena = self._arenas.get(tenant)
            if arena is not None and arena.retirable:
                del self._arenas[tenant]
                arena.close()
        self._emptied.clear()

    def _free(self, entry: _Entry) -> None:
        """Give back an entry's ranges: its arena's and, not sealed yet, its staging range."""
        entry.arena.free(entry.offset, entry.length)
        if entry.staged is not None:
            staging, offset = entry.staged
            staging.free(offset, entry.length)
            entry.staged = None
        if entry.arena.used == 0:
            self._emptied.add(self._tenant_of(entry.arena))

    def _tenant_of(self, arena: Arena) -> bytes:
        return next((t for t, a in self._arenas.items() if a is arena), b"")

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.length
        # Gone from the index, pinned or not: the sealing thread may still hold it in its queue, and must
        # skip it there (sealing a freed entry would write its header over whatever took its range).
        entry.dropped = True
        if not entry.pins:
            self._free(entry)  # else the last unpin frees it

    def _sweep(self, now: float) -> None:
        # Before any arena is asked for: never one a caller is about to allocate in.
        if self._emptied:
            self._retire_emptied()
        while self._expiry and self._expiry[0][0] <= now:
            expires_s, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            if entry is not None and entry.expires_s == expires_s:
                self._drop(key)
                self._expirations += 1

    def _room(self, arena: Arena, length: int) -> int | None:
        """Evict least recently used records until `length` more bytes fit under the cap and in
        `arena`; the offset allocated there, or None when the record is larger than the whole pool."""
        if length > self.cap_bytes:
            self._evictions += 1  # larger than the whole pool: dropped at once, as Redis would
            return None
        while self._entries and self._bytes + self._pending + length > self.cap_bytes:
            self._drop(next(iter(self._entries)))
            self._evictions += 1
        offset = arena.alloc(length)
        while offset is None:  # fragmented: free this arena's least recently used records
            victim = next((k for k, e in self._entries.items() if e.arena is arena), None)
            if victim is None:
                return None
            self._drop(victim)
            self._evictions += 1
            offset = arena.alloc(length)
        return offset

    def _install(self, key: bytes, arena: Arena, offset: int, length: int, expires_s: float,
                 unsealed: Callable[[int], bytes] | None = None, staged: tuple[Arena, int] | None = None) -> _Entry:
        if key in self._entries:
            self._drop(key)
        entry = _Entry(arena=arena, offset=offset, length=length, expires_s=expires_s, unsealed=unsealed,
                       staged=staged)
        self._entries[key] = entry
        self._bytes += length
        heapq.heappush(self._expiry, (expires_s, key))
        return entry

    @staticmethod
    def _settle(entry: _Entry) -> int:
        """Copy a staged snapshot into the entry's arena, checksummed as written there (a writer may still
        scribble on its staging range: the checksum is of what readers will map); the checksum. One native
        pass without the GIL (kvstore.native.swa_digest.copy_hashed), so the event loop runs meanwhile."""
        start, end = entry.offset + HEADER_BYTES, entry.offset + entry.length
        if entry.staged is None:
            return digest(entry.arena.view[start:end])
        staging, at = entry.staged
        stream = hasher()
        copy_hashed(entry.arena.view[start:end], staging.view[at + HEADER_BYTES:at + entry.length], stream)
        return stream.intdigest()

    def _seal(self, entry: _Entry, data_checksum: int | None = None) -> None:
        """Write the header of an entry committed unsealed (its snapshot settled in the arena and
        checksummed there first, unless `data_checksum` says that is done), and free its staging range."""
        if entry.unsealed is None:
            return
        if data_checksum is None:
            data_checksum = self._settle(entry)
        entry.arena.write(entry.offset, entry.unsealed(data_checksum))
        entry.unsealed = None
        self._unstage(entry)

    @staticmethod
    def _unstage(entry: _Entry) -> None:
        """Free a sealed entry's staging range, unless the sealing thread still copies from it (it must not
        be reused under that copy: the thread frees it when done)."""
        if entry.staged is not None and entry.unsealed is None and not entry.sealing:
            staging, at = entry.staged
            staging.free(at, entry.length)
            entry.staged = None

    def _ready(self, key: bytes, now: float) -> _Entry | None:
        """The live entry under `key`, sealed first if it is a shared-memory put not sealed yet."""
        entry = self._live(key, now)
        if entry is not None:
            self._seal(entry)
        return entry

    def _seal_forever(self) -> None:
        """The sealing thread: settle committed shared-memory puts off their writers' path. Each is
        pinned, copied from its staging range into the arena and hashed there without the lock (xxh3
        lets go of the GIL too), then sealed under it unless a reader sealed it first. It runs at the
        lowest priority: sealing is background work, and a reader that comes first seals the record
        itself."""
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        with self._lock:
            while True:
                while not self._unsealed and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                entry = self._unsealed.popleft()
                if entry.unsealed is None or entry.dropped:
                    continue
                entry.pins += 1
                entry.sealing = True
                self._lock.release()
                try:
                    data_checksum = self._settle(entry)
                finally:
                    self._lock.acquire()
                    entry.sealing = False
                if not entry.dropped:
                    self._seal(entry, data_checksum)  # nothing to do if a reader sealed it meanwhile...
                    self._unstage(entry)  # ...but then its staging range is this thread's to free
                self._unpin_locked(entry)

    def _unpin_locked(self, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.dropped and not entry.pins:
            self._free(entry)

    def _live(self, key: bytes, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_s <= now:
            self._drop(key)
            self._expirations += 1
            return None
        return entry

    # -- the SwaPool interface (the gateway path) ---------------------------

    async def put_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float) -> None:
        with self._lock:
            now = self.clock.now()
            self._sweep(now)
            for key, record in items:
                if key in self._entries and len(record) <= self.cap_bytes:
                    self._drop(key)  # replaced: its bytes make room first
                arena = self._arena(arena_id(key))
                offset = self._room(arena, len(record))
                if offset is None:
                    continue
                arena.write(offset, record)
                self._install(key, arena, offset, len(record), now + ttl_s)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            now = self.clock.now()
            out: list[bytes | None] = []
            for key in keys:
                entry = self._ready(key, now)  # a shared-memory put not sealed yet: its header first
                if entry is None:
                    out.append(None)
                    continue
                self._entries.move_to_end(key)
                # A copy under the lock: once it is released the range may be reused.
                out.append(entry.arena.read(entry.offset, entry.length))
            return out

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            now = self.clock.now()
            return [self._live(key, now) is not None for key in keys]

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            now = self.clock.now()
            gone = 0
            for key in keys:
                if self._live(key, now) is not None:
                    self._drop(key)
                    gone += 1
            return gone

    async def usage(self) -> PoolUsage:
        with self._lock:
            self._sweep(self.clock.now())
            return PoolUsage(backend=self.name, items=len(self._entries), bytes_used=self._bytes,
                             cap_bytes=self.cap_bytes, expirations=self._expirations, evictions=self._evictions)

    async def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        if self._sealer is not None:
            self._sealer.join(timeout=5)
        with self._lock:
            for arena in [*self._arenas.values(), *self._staging.values()]:
                arena.close()
            self._arenas.clear()
            self._staging.clear()
            self._entries.clear()

    # -- the shared-memory path (tiers.swa_shm_session calls these from the server's threads) --

    def shm_server(self, hooks: ShmHooks) -> ShmServer:
        """The same-host control server over this pool, started on first use with `hooks` (the gateway's
        checks and counters); stopped by `close`."""
        with self._lock:
            if self._shm is None:
                self._shm = ShmServer(self, hooks, clock=self.clock)
                self._sealer = threading.Thread(target=self._seal_forever, name="swa-shm-seal", daemon=True)
                self._sealer.start()
            return self._shm

    def reserve(self, tenant: bytes, lengths: Sequence[int], *, arena: Arena | None = None) -> list[Reserved | None]:
        """Ranges for records of `lengths` bytes: one in `tenant`'s arena, counted against the cap until
        `commit` or `release`, and one of the same length in its staging arena, where the writer copies
        the snapshot; None for a record larger than the pool (dropped, as put_many drops it).

        Raises:
            PermissionDenied: `arena` (the session's) is no longer the tenant's: the session must open anew.
        """
        with self._lock:
            self._sweep(self.clock.now())
            current = self._arena(tenant)
            if arena is not None and arena is not current:
                raise PermissionDenied("this shared-memory session's arena was renewed (its records were all "
                                       "gone)", hint="ask SwaPool.OpenDirect again")
            staging = self._staging_arena(tenant)
            out: list[Reserved | None] = []
            for length in lengths:
                offset = self._room(current, length)
                staged = None if offset is None else staging.alloc(length)
                if offset is not None and staged is None:
                    current.free(offset, length)  # no staging room (fragmented past the slack): dropped
                    self._evictions += 1
                    offset = None
                if offset is not None and staged is not None:
                    self._pending += length
                    out.append(Reserved(offset=offset, staged=staged, length=length))
                else:
                    out.append(None)
            return out

    def release(self, tenant: bytes, spans: Sequence[Reserved]) -> None:
        """Give back reservations that were never committed."""
        with self._lock:
            arena, staging = self._arenas.get(tenant), self._staging.get(tenant)
            for span in spans:
                self._pending -= span.length
                if arena is not None:
                    arena.free(span.offset, span.length)
                if staging is not None:
                    staging.free(span.staged, span.length)
                if arena is not None and arena.used == 0:
                    self._emptied.add(tenant)

    def commit(self, tenant: bytes, items: Sequence[tuple[bytes, Reserved, Header]], ttl_s: float) -> None:
        """Make reserved records live: (key, reservation, header) each; each lives `ttl_s` from now.

        A header given as bytes says the snapshot was already copied into the arena and checksummed
        there (a session's WRITTEN notes): it is written at the reservation's offset and the staging
        range freed. A header given as a function of the snapshot's checksum leaves the snapshot in its
        staging range: the record is live at once and settled and sealed by the sealing thread, or by its
        first reader if that comes first (readers never see it unsealed).
        """
        with self._lock:
            now = self.clock.now()
            arena, staging = self._arenas[tenant], self._staging[tenant]
            for key, span, header in items:
                self._pending -= span.length
                if isinstance(header, bytes):
                    arena.write(span.offset, header)
                    staging.free(span.staged, span.length)
                    self._install(key, arena, span.offset, span.length, now + ttl_s)
                else:
                    self._unsealed.append(self._install(key, arena, span.offset, span.length, now + ttl_s,
                                                        unsealed=header, staged=(staging, span.staged)))
            self._wake.notify()

    def locate(self, keys: Sequence[bytes], *, pin: bool = False, arena: Arena | None = None) -> list[Located | None]:
        """Where each live record lies (a hit: moved to most recently used), None where missing or expired
        (or, given `arena`, in another arena: one that replaced it since the caller was handed it).

        With `pin`, each found record's range is kept from reuse until `unpin(located)`, so a
        client can copy it out after the lock is released.
        """
        with self._lock:
            now = self.clock.now()
            out: list[Located | None] = []
            for key in keys:
                entry = self._ready(key, now)  # its copy, checksum and header before anyone reads them
                if entry is None or (arena is not None and entry.arena is not arena):
                    out.append(None)
                    continue
                self._entries.move_to_end(key)
                entry.pins += pin
                out.append(Located(offset=entry.offset, length=entry.length, pin=entry if pin else None,
                                   header=entry.arena.read(entry.offset, HEADER_BYTES)))
            return out

    def unpin(self, located: Sequence[Located | None]) -> None:
        """Let the ranges `locate(pin=True)` kept be reused (freed now if dropped meanwhile)."""
        with self._lock:
            for item in located:
                if item is not None and isinstance(item.pin, _Entry):
                    self._unpin_locked(item.pin)
