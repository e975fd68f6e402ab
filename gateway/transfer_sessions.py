"""Transfer sessions on the server: the regions each client mapped, and its batches.

Safety rules (docs/TRANSFER.md numbers them; tests are named after them):
1. A session belongs to the connection that opened it: every call naming it must
   come from the same peer, else PERMISSION_DENIED.
2. A region belongs to the session that registered it: a descriptor naming
   another session's region fails with PERMISSION_DENIED, an unknown one with
   NOT_FOUND; a span outside the region with INVALID_ARGUMENT.
3. A region is unmapped when its client deregisters it or its session ends
   (the client closes the stream, disconnects or dies). Its /dev/shm name is
   removed as soon as the server has mapped it, so no segment outlives both ends.
4. A bad descriptor fails alone; the rest of its batch goes on.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.config import TransferSettings
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from kvstore.prefix import BlockScope
from kvstore.transfer import DONE, FAILED, MISSING, BatchResults

log = logging.getLogger("kvstore.transfer")
_SHM_NAME = re.compile(r"^kvstore-[0-9a-f]{32}$")


class MappedRegion:
    """A client's shared-memory segment, mapped into the server.

    Zero-copy contract: `view` (and every slice of it) shows the client's pages
    and is valid until `close`; the engine drops its slices before a transfer
    finishes, and a region is closed only when no transfer on it is in flight.
    Spans are checked against `size_bytes` before they are cut
    (`kvstore.transfer.group_failures`).
    """

    def __init__(self, region_id: int, path: Path, size_bytes: int, nonce: bytes) -> None:
        self.region_id = region_id
        self.name = path.name
        self.size_bytes = size_bytes
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < size_bytes:
                raise InvalidArgument(f"segment {path.name} is not a regular file of at least {size_bytes} bytes")
            # Populate the page tables now: a fault per 4 KiB page on the first
            # copy would otherwise cost more than the copy itself.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(fd, size_bytes, flags=flags)
        finally:
            os.close(fd)
        if not nonce or self._mmap[: len(nonce)] != nonce:
            self._mmap.close()
            raise PermissionDenied(f"segment {path.name} does not hold the nonce sent with it")
        # Both ends have it mapped now: the name is no longer needed, and a
        # segment with no name cannot outlive the two processes that map it.
        path.unlink(missing_ok=True)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap the segment."""
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:  # pragma: no cover - a span outlived its transfer: a bug
            log.error("region %s still has views; it unmaps when they are collected", self.region_id)


@dataclass(kw_only=True)
class Transfer:
    """One batch's state, filled in by the engine as it goes."""

    transfer_id: int
    region_ids: frozenset[int]
    results: BatchResults
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


@dataclass
class TransferCounters:
    """Finished batches and their descriptors, since the server started (event loop only)."""

    read_batches: int = 0
    write_batches: int = 0
    descriptors_done: int = 0
    descriptors_missing: int = 0
    descriptors_failed: int = 0
    bytes_moved: int = 0

    def count(self, results: BatchResults) -> None:
        """Add one finished batch."""
        if results.writes:
            self.write_batches += 1
        else:
            self.read_batches += 1
        self.descriptors_done += results.statuses.count(DONE)
        self.descriptors_missing += results.statuses.count(MISSING)
        self.descriptors_failed += results.statuses.count(FAILED)
        self.bytes_moved += results.bytes_moved


class Session:
    """One client's regions and batches, for one tenant and geometry."""

    def __init__(self, session_id: str, peer: str, geometry: str, scope: BlockScope,
                 settings: TransferSettings, counters: TransferCounters | None = None) -> None:
        self.session_id = session_id
        self.peer = peer
        self.geometry = geometry
        self.scope = scope
        self.settings = settings
        self.regions: dict[int, MappedRegion] = {}
        self.transfers: OrderedDict[int, Transfer] = OrderedDict()
        self.closed = False
        self._next_transfer = 0
        # Finished batch ids, oldest first: forgetting one costs no scan of `transfers`.
        self._finished: deque[int] = deque()
        self._counters = counters or TransferCounters()

    def new_transfer(self, region_ids: frozenset[int], size: int, *, writes: bool = False) -> Transfer:
        """Record a new batch of `size` descriptors, forgetting the oldest finished ones."""
        self._next_transfer += 1
        while len(self._finished) >= self.settings.keep_finished:
            self.transfers.pop(self._finished.popleft(), None)
        transfer = Transfer(transfer_id=self._next_transfer, region_ids=region_ids,
                            results=BatchResults(size, writes=writes))
        self.transfers[transfer.transfer_id] = transfer
        return transfer

    def finish(self, transfer: Transfer) -> None:
        """Mark a batch done; it is remembered until `keep_finished` later ones have finished."""
        transfer.done.set()
        self._finished.append(transfer.transfer_id)
        self._counters.count(transfer.results)

    def transfer(self, transfer_id: int) -> Transfer:
        """A batch of this session by id."""
        try:
            return self.transfers[transfer_id]
        except KeyError:
            raise NotFound(f"no transfer {transfer_id} in this session (finished ones are kept "
                           f"{self.settings.keep_finished} deep)") from None

    def in_flight(self) -> list[Transfer]:
        """Batches not finished yet."""
        return [t for t in self.transfers.values() if not t.done.is_set()]

    def make_room(self, batches: int) -> None:
        """Check that `batches` more may start: a session runs at most `keep_finished` at once.

        Without a bound, a client could queue batches (and their tasks) without
        end; this one also keeps every batch readable once it finishes.

        Raises:
            ResourceExhausted: that many more would pass the bound.
        """
        running = len(self.transfers) - len(self._finished)
        if running + batches > self.settings.keep_finished:
            raise ResourceExhausted(
                f"{running} batches of this session are running; {batches} more would pass the "
                f"{self.settings.keep_finished} a session may run at once",
                hint="wait for running batches (GetTransfers) before submitting more")

    def drop_region(self, region_id: int) -> None:
        """Unmap one region of this session.

        Raises:
            NotFound: no such region in this session.
            FailedPrecondition: a batch using it is still in flight.
        """
        if region_id not in self.regions:
            raise NotFound(f"region {region_id} is not registered in this session")
        busy = [t.transfer_id for t in self.in_flight() if region_id in t.region_ids]
        if busy:
            raise FailedPrecondition(f"region {region_id} is in use by transfers {busy}; wait for them first")
        self.regions.pop(region_id).close()

    async def close(self) -> None:
        """Stop the session's batches (they end after their current chunk), then unmap every region."""
        self.closed = True
        tasks = [t.task for t in self.in_flight() if t.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for region in self.regions.values():
            region.close()
        self.regions.clear()


class SessionTable:
    """Every open session, and every region by id (ids are unique across sessions)."""

    def __init__(self, settings: TransferSettings) -> None:
        self.settings = settings
        self.counters = TransferCounters()
        self.sessions: dict[str, Session] = {}
        self._owner: dict[int, str] = {}
        self._next_region = 0
        self._lock = threading.Lock()

    def open(self, peer: str, geometry: str, scope: BlockScope) -> Session:
        """A new session bound to `peer`."""
        session = Session(secrets.token_hex(16), peer, geometry, scope, self.settings, self.counters)
        self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str, peer: str) -> Session:
        """The caller's session (rule 1).

        Raises:
            NotFound: no such session (it ended, or never was).
            PermissionDenied: the session belongs to another connection.
        """
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise NotFound("no open transfer session with that id; open one with OpenSession")
        if session.peer != peer:
            raise PermissionDenied("this transfer session belongs to another connection")
        return session

    def register(self, session: Session, shm_name: str, size_bytes: int, nonce: bytes) -> MappedRegion:
        """Map a client's segment into `session`.

        Raises:
            InvalidArgument: a bad name or size.
            ResourceExhausted: the session holds its most regions already.
            OSError: the segment cannot be opened here (another host).
        """
        if not _SHM_NAME.match(shm_name):
            raise InvalidArgument(f"shm_name {shm_name!r} is not 'kvstore-' and 32 hex digits")
        if not 0 < size_bytes <= self.settings.max_region_bytes:
            raise InvalidArgument(f"size_bytes {size_bytes} is not in [1, {self.settings.max_region_bytes}]")
        if len(session.regions) >= self.settings.max_regions:
            raise ResourceExhausted(f"a session holds at most {self.settings.max_regions} regions",
                                    hint="deregister a region first")
        with self._lock:
            self._next_region += 1
            region_id = self._next_region
        region = MappedRegion(region_id, self.settings.shm_dir / shm_name, size_bytes, nonce)
        session.regions[region_id] = region
        self._owner[region_id] = session.session_id
        return region

    def region(self, session: Session, region_id: int) -> MappedRegion:
        """A region of `session` that descriptors may name (rule 2; spans are checked by the caller).

        Raises:
            PermissionDenied: the region belongs to another session.
            NotFound: no such region.
        """
        region = session.regions.get(region_id)
        if region is None:
            if region_id in self._owner:
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
        return sum(len(s.regions) for s in self.sessions.values())

    def mapped_bytes(self) -> int:
        """Total size of the regions mapped now."""
        return sum(r.size_bytes for s in self.sessions.values() for r in s.regions.values())
