"""The server's table of transfer sessions: who may name which session and region.

Rules 1 and 2 of `gateway.transfer_sessions` (docs/TRANSFER.md numbers them) are
kept here: a session is found only by its tenant and connection, a region only
by its session. Registering a region or a ring checks what the client sent and
the bounds on regions and their bytes (rule 6) before anything is mapped
(`gateway.transfer_regions`); ending a session or deregistering a region unmaps
it (rule 3). One session's batches and their bounds are `Session`'s.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Callable

from gateway.transfer_regions import MappedRegion
from gateway.transfer_sessions import Load, Session, SessionRing, TransferCounters
from kvstore.config import TransferSettings
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from kvstore.prefix import BlockScope
from kvstore.region import NONCE_BYTES
from kvstore.transfer_ring import RING_BYTES

_SHM_NAME = re.compile(r"kvstore-[0-9a-f]{32}")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB"


class SessionTable:
    """Every open session, and every region by id (ids are unique across sessions)."""

    def __init__(self, settings: TransferSettings) -> None:
        self.settings = settings
        self.counters = TransferCounters()
        self.load = Load()
        self.sessions: dict[str, Session] = {}
        self._owner: dict[int, str] = {}
        self._next_region = 0
        self._lock = threading.Lock()

    def open(self, peer: str, geometry: str, scope: BlockScope, *, tenant: str = "default") -> Session:
        """A new session bound to `peer` and `tenant`.

        Raises:
            ResourceExhausted: the server holds `max_sessions` sessions already.
        """
        if len(self.sessions) >= self.settings.max_sessions:
            raise ResourceExhausted(f"the server holds {len(self.sessions)} transfer sessions, its most "
                                    f"(transfer.max_sessions)", hint="close a session you hold, or retry later")
        session = Session(secrets.token_hex(16), peer, geometry, scope, self.settings, self.counters, self.load,
                          tenant=tenant)
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str, peer: str, tenant: str = "default") -> Session:
        """The caller's session (rule 1).

        Raises:
            NotFound: no such session (it ended, or never was), or another tenant's.
            PermissionDenied: the session belongs to another connection of this tenant.
        """
        session = self.sessions.get(session_id)
        if session is None or session.closed or session.tenant != tenant:
            raise NotFound("no open transfer session with that id; open one with OpenSession")
        if session.peer != peer:
            raise PermissionDenied("this transfer session belongs to another connection")
        return session

    def register(self, session: Session, shm_name: str, pid: int, fd: int, size_bytes: int,
                 nonce: bytes) -> MappedRegion:
        """Map a client's sealed memfd into `session` (see `MappedRegion` for the checks).

        Raises:
            InvalidArgument: a bad name, size, pid or nonce.
            ResourceExhausted: the session or the server would pass a bound on regions or their bytes.
            FailedPrecondition: the memfd is not sealed against shrinking.
            OSError: the memfd cannot be opened here (another host).
        """
        s = self.settings
        if not _SHM_NAME.fullmatch(shm_name):
            raise InvalidArgument(f"shm_name {shm_name!r} is not 'kvstore-' and 32 hex digits")
        if not 0 < size_bytes <= s.max_region_bytes:
            raise InvalidArgument(f"size_bytes {size_bytes} is not in [1, {s.max_region_bytes}] "
                                  "(transfer.max_region_bytes)")
        if pid <= 0:
            raise InvalidArgument("pid must name the client's process (the memfd is opened as /proc/<pid>/fd/<fd>)")
        if len(nonce) != min(NONCE_BYTES, size_bytes):
            raise InvalidArgument(f"the nonce must be the region's first {min(NONCE_BYTES, size_bytes)} bytes; "
                                  f"got {len(nonce)}")
        if len(session.regions) >= s.max_regions:
            raise ResourceExhausted(f"a session holds at most {s.max_regions} regions (transfer.max_regions)",
                                    hint="deregister a region first")
        if self.load.regions >= s.max_mapped_regions:
            raise ResourceExhausted(f"the server maps {self.load.regions} regions for every session, its most "
                                    f"(transfer.max_mapped_regions)", hint="retry once other sessions release regions")
        if session.mapped_bytes + size_bytes > s.max_session_mapped_bytes:
            raise ResourceExhausted(
                f"this session maps {_gib(session.mapped_bytes)}; {_gib(size_bytes)} more would pass "
                f"transfer.max_session_mapped_bytes ({_gib(s.max_session_mapped_bytes)})",
                hint="deregister a region first")
        if self.load.mapped_bytes + size_bytes > s.max_mapped_bytes:
            raise ResourceExhausted(
                f"the server maps {_gib(self.load.mapped_bytes)} for every session; {_gib(size_bytes)} more would "
                f"pass transfer.max_mapped_bytes ({_gib(s.max_mapped_bytes)})",
                hint="retry once other sessions release regions, or register a smaller region")
        with self._lock:
            self._next_region += 1
            region_id = self._next_region
        region = MappedRegion(region_id, shm_name, pid, fd, size_bytes, nonce)
        session.regions[region_id] = region
        self.load.mapped_bytes += size_bytes
        self.load.regions += 1
        self._owner[region_id] = session.session_id
        return region

    def register_ring(self, session: Session, shm_name: str, pid: int, fd: int, size_bytes: int, nonce: bytes,
                      start: Callable[[MappedRegion], SessionRing]) -> SessionRing:
        """Map a client's sealed memfd as `session`'s request ring and start serving it
        (`start`), or renew the lease of the ring already registered under that name.

        A ring is not one of the session's regions (no descriptor may name it, and it
        is not counted in the region limits): one per session, RING_BYTES each, so
        at most `max_sessions` of them (32 MiB and 256 mappings with the defaults).

        Raises:
            InvalidArgument: a bad name, size (not RING_BYTES), pid or nonce.
            FailedPrecondition: the session has another ring, or the memfd is not sealed.
            OSError: the memfd cannot be opened here (another host).
        """
        ring = session.ring
        if ring is not None:
            if ring.name != shm_name:
                raise FailedPrecondition("this session has a ring already; one ring per session")
            ring.renew()
            return ring
        if not _SHM_NAME.fullmatch(shm_name):
            raise InvalidArgument(f"shm_name {shm_name!r} is not 'kvstore-' and 32 hex digits")
        if size_bytes != RING_BYTES:
            raise InvalidArgument(f"a ring is {RING_BYTES} bytes (kvstore.transfer_ring); got {size_bytes}")
        if pid <= 0:
            raise InvalidArgument("pid must name the client's process (the memfd is opened as /proc/<pid>/fd/<fd>)")
        if len(nonce) != NONCE_BYTES:
            raise InvalidArgument(f"the nonce must be the ring's first {NONCE_BYTES} bytes; got {len(nonce)}")
        mapped = MappedRegion(0, shm_name, pid, fd, size_bytes, nonce)
        try:
            ring = start(mapped)
        except BaseException:
            mapped.close()
            raise
        session.ring = ring
        return ring

    def region(self, session: Session, region_id: int) -> MappedRegion:
        """A region of `session` that descriptors may name (rule 2; spans are checked by the caller).

        Raises:
            PermissionDenied: the region belongs to another session of the same tenant.
            NotFound: no such region, or another tenant's (rule 1's reason).
        """
        region = session.regions.get(region_id)
        if region is None:
            owner = self.sessions.get(self._owner.get(region_id, ""))
            if owner is not None and owner.tenant == session.tenant:
                raise PermissionDenied(f"region {region_id} belongs to another session")
            raise NotFound(f"region {region_id} is not registered in this session")
        return region

    def deregister(self, session: Session, region_id: int) -> None:
        """Unmap one region (rule 3)."""
        session.drop_region(region_id)
        self._owner.pop(region_id, None)

    async def close(self, session: Session) -> None:
        """End a session: stop its batches and unmap its regions (rule 3)."""
        self.sessions.pop(session.session_id, None)
        for region_id in list(session.regions):
            self._owner.pop(region_id, None)
        await session.close()

    async def close_all(self) -> None:
        """End every session (server shutdown)."""
        for session in list(self.sessions.values()):
            await self.close(session)

    def mapped_regions(self) -> int:
        """Regions mapped now, across sessions."""
        return self.load.regions

    def mapped_bytes(self) -> int:
        """Total size of the regions mapped now."""
        return self.load.mapped_bytes
