"""Transfer sessions on the server: the regions each client mapped, and its batches.

The table of every open session, which finds a session or region for its owner
alone and maps regions and rings, is `gateway.transfer_session_table`.

Safety rules (docs/TRANSFER.md numbers them; tests are named after them):
1. A session belongs to the tenant and the connection that opened it: a call
   naming it from another tenant gets NOT_FOUND, exactly as for an id that never
   was (nothing tells it exists, docs/SECURITY.md); from another connection of
   the same tenant, PERMISSION_DENIED.
2. A region belongs to the session that registered it: a descriptor naming
   another session's region of the same tenant fails with PERMISSION_DENIED, an
   unknown one or another tenant's with NOT_FOUND; a span outside the region
   with INVALID_ARGUMENT.
3. A region is unmapped when its client deregisters it or its session ends
   (the client closes the stream, disconnects or dies). A region is a memfd:
   it has no name in any folder, so nothing of it outlives both ends.
4. A bad descriptor fails alone; the rest of its batch goes on.
5. A region must be sealed against shrinking (F_SEAL_SHRINK) before the server
   maps it, so no client action can fault the server's copy loop (SIGBUS).
6. What a session and the server hold is bounded: regions and their bytes,
   descriptors running and remembered; past a bound, RESOURCE_EXHAUSTED names it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from gateway.transfer_regions import MappedRegion
from kvstore.config import TransferSettings
from kvstore.errors import FailedPrecondition, NotFound, ResourceExhausted
from kvstore.prefix import BlockScope
from kvstore.transfer import DONE, FAILED, MISSING, BatchResults

log = logging.getLogger("kvstore.transfer")


class SessionRing(Protocol):
    """What a session needs of its request ring (`gateway.transfer_ring.RingServer` is one)."""

    #: The ring memfd's name: a second registration under it renews, under another is refused.
    name: str
    #: Held while a ring request copies into a region: a region is never unmapped under it.
    busy: threading.Lock

    def renew(self) -> None:
        """Extend the ring's lease (the client renews it through RegisterRegion, which passes auth)."""

    def stop(self) -> None:
        """End the ring's thread after its current request, and unmap the ring."""


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
    """Finished batches and their descriptors, since the server started (the event loop and
    ring threads add to them, under `_lock`)."""

    read_batches: int = 0
    write_batches: int = 0
    descriptors_done: int = 0
    descriptors_missing: int = 0
    descriptors_failed: int = 0
    bytes_moved: int = 0
    #: Read descriptors copied whose retention refresh failed (they are FAILED, so
    #: also counted in descriptors_failed).
    refresh_failures: int = 0
    #: Requests answered through request rings (refusals included; their reads are counted above too).
    ring_requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, results: BatchResults) -> None:
        """Add one finished batch."""
        done, missing, failed = (results.statuses.count(c) for c in (DONE, MISSING, FAILED))
        with self._lock:
            if results.writes:
                self.write_batches += 1
            else:
                self.read_batches += 1
            self.descriptors_done += done
            self.descriptors_missing += missing
            self.descriptors_failed += failed
            self.bytes_moved += results.bytes_moved

    def count_read_done(self, n: int, bytes_moved: int) -> None:
        """Add one finished read batch whose `n` descriptors were all DONE, `bytes_moved` copied:
        `count` of such a batch without counting its statuses (the request ring's answered reads)."""
        with self._lock:
            self.read_batches += 1
            self.descriptors_done += n
            self.bytes_moved += bytes_moved

    def add_ring_request(self) -> None:
        """Count one request answered through a ring."""
        with self._lock:
            self.ring_requests += 1

    def add_refresh_failures(self, n: int) -> None:
        """Count read descriptors whose retention refresh failed."""
        with self._lock:
            self.refresh_failures += n


@dataclass
class Load:
    """What every session holds now, summed (event loop only): the server-wide limits' side."""

    descriptors_in_flight: int = 0
    #: Of every session's batches, running or finished and still remembered.
    descriptors_held: int = 0
    mapped_bytes: int = 0
    regions: int = 0



class Session:
    """One client's regions and batches, for one tenant and geometry.

    What it may hold is bounded (`TransferSettings`), each bound checked before
    anything starts, so that no client can exhaust the server's memory:
    `keep_finished` batches running, `max_session_descriptors` descriptors held
    by its batches (running, or finished and not yet forgotten), and with every
    other session `max_inflight_descriptors` descriptors running and
    `max_held_descriptors` held; its regions are bounded in `SessionTable.register`
    (`gateway.transfer_session_table`).
    """

    def __init__(self, session_id: str, peer: str, geometry: str, scope: BlockScope,
                 settings: TransferSettings, counters: TransferCounters | None = None,
                 load: Load | None = None, *, tenant: str = "default") -> None:
        self.session_id = session_id
        self.peer = peer
        #: The caller's tenant when it was opened (gateway.auth); only that tenant may name it.
        self.tenant = tenant
        self.geometry = geometry
        self.scope = scope
        self.settings = settings
        self.regions: dict[int, MappedRegion] = {}
        #: The session's request ring, once registered (`gateway.transfer_ring`).
        self.ring: SessionRing | None = None
        self.transfers: OrderedDict[int, Transfer] = OrderedDict()
        self.closed = False
        self._next_transfer = 0
        # Finished batch ids, oldest first: forgetting one costs no scan of `transfers`.
        self._finished: deque[int] = deque()
        self.counters = counters or TransferCounters()
        self._load = load or Load()
        #: Descriptors of the batches in `transfers`, and of those still running.
        self.held_descriptors = 0
        self.running_descriptors = 0

    @property
    def mapped_bytes(self) -> int:
        """Total size of this session's regions."""
        return sum(r.size_bytes for r in self.regions.values())

    def new_transfer(self, region_ids: frozenset[int], size: int, *, writes: bool = False) -> Transfer:
        """Record a new batch of `size` descriptors, forgetting the oldest finished ones to stay
        within `keep_finished` batches, `max_session_descriptors` and `max_held_descriptors`."""
        s = self.settings
        self._next_transfer += 1
        while self._finished and (len(self._finished) >= s.keep_finished
                                  or self.held_descriptors + size > s.max_session_descriptors
                                  or self._load.descriptors_held + size > s.max_held_descriptors):
            self._forget(self._finished.popleft())
        transfer = Transfer(transfer_id=self._next_transfer, region_ids=region_ids,
                            results=BatchResults(size, writes=writes))
        self.transfers[transfer.transfer_id] = transfer
        self.held_descriptors += size
        self._load.descriptors_held += size
        self.running_descriptors += size
        self._load.descriptors_in_flight += size
        return transfer

    def _forget(self, transfer_id: int) -> None:
        gone = self.transfers.pop(transfer_id, None)
        if gone is not None:
            self.held_descriptors -= len(gone.results)
            self._load.descriptors_held -= len(gone.results)

    def finish(self, transfer: Transfer) -> None:
        """Mark a batch done; it is remembered until later ones push it out (see `new_transfer`)."""
        transfer.done.set()
        self._finished.append(transfer.transfer_id)
        self.running_descriptors -= len(transfer.results)
        self._load.descriptors_in_flight -= len(transfer.results)
        self.counters.count(transfer.results)

    def transfer(self, transfer_id: int) -> Transfer:
        """A batch of this session by id."""
        try:
            return self.transfers[transfer_id]
        except KeyError:
            raise NotFound(f"no transfer {transfer_id} in this session (finished ones are kept "
                           f"{self.settings.keep_finished} batches or {self.settings.max_session_descriptors} "
                           "descriptors deep)") from None

    def in_flight(self) -> list[Transfer]:
        """Batches not finished yet."""
        return [t for t in self.transfers.values() if not t.done.is_set()]

    def make_room(self, batches: int, descriptors: int) -> None:
        """Check that `batches` more batches of `descriptors` in all may start.

        A session runs at most `keep_finished` batches and `max_session_descriptors`
        descriptors at once, and the server `max_inflight_descriptors` across
        sessions. Without these bounds a client could queue batches (their
        descriptors, tasks and results) without end; the first also keeps
        every batch readable once it finishes.

        Raises:
            ResourceExhausted: naming the bound they would pass.
        """
        s = self.settings
        running = len(self.transfers) - len(self._finished)
        if running + batches > s.keep_finished:
            raise ResourceExhausted(
                f"{running} batches of this session are running; {batches} more would pass the "
                f"{s.keep_finished} a session may run at once (transfer.keep_finished)",
                hint="wait for running batches (GetTransfers) before submitting more")
        if self.running_descriptors + descriptors > s.max_session_descriptors:
            raise ResourceExhausted(
                f"this session's running batches hold {self.running_descriptors} descriptors; {descriptors} more "
                f"would pass transfer.max_session_descriptors ({s.max_session_descriptors})",
                hint="wait for running batches (GetTransfers) before submitting more")
        if self._load.descriptors_in_flight + descriptors > s.max_inflight_descriptors:
            raise ResourceExhausted(
                f"the server runs {self._load.descriptors_in_flight} descriptors for every session; {descriptors} "
                f"more would pass transfer.max_inflight_descriptors ({s.max_inflight_descriptors})",
                hint="retry once running batches finish")
        # This session's finished batches can be forgotten to make room; other sessions' cannot.
        others = self._load.descriptors_held - (self.held_descriptors - self.running_descriptors)
        if others + descriptors > s.max_held_descriptors:
            raise ResourceExhausted(
                f"the server holds {self._load.descriptors_held} descriptors of batches for every session; "
                f"{descriptors} more would pass transfer.max_held_descriptors ({s.max_held_descriptors})",
                hint="retry once other sessions collect or end their batches")

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
        ring = self.ring
        # A ring request copying into it holds `busy`: never unmap under it.
        if ring is not None and not ring.busy.acquire(blocking=False):
            raise FailedPrecondition(f"region {region_id} may be in use by a ring request; retry")
        try:
            region = self.regions.pop(region_id)
        finally:
            if ring is not None:
                ring.busy.release()
        self._load.mapped_bytes -= region.size_bytes
        self._load.regions -= 1
        region.close()

    async def close(self) -> None:
        """Stop the session's batches (they end after their current chunk), then unmap every region."""
        self.closed = True
        tasks = [t.task for t in self.in_flight() if t.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        ring, self.ring = self.ring, None
        if ring is not None:  # its thread ends its current request, then the ring is unmapped
            await asyncio.to_thread(ring.stop)
        self._load.descriptors_held -= self.held_descriptors
        self.held_descriptors = 0
        self.transfers.clear()
        self._finished.clear()
        for region in self.regions.values():
            self._load.mapped_bytes -= region.size_bytes
            self._load.regions -= 1
            region.close()
        self.regions.clear()

