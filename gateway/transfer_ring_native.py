"""One ring's requests served by the native module (`tiers.ring`), the Python read as fallback.

`gateway.transfer_ring.RingServer` uses a `NativeRing` when `kvstore.native._ring` is built and
the tier's data.mdb is found mapped. Per request it charges the tenant's rate, opens a
read txn and calls `tiers.ring.serve`, which takes the plain case (one group, every
descriptor good, every block found, intact and not due a retention refresh) as far as
every block's checksum, without the GIL (a request of more than 16 blocks is copied and
answered there too, then counted and published: its blocks would leave the cache between
their check and a later copy). The thread then counts the read as the Python
read counts it (the tier's gets, the tenant's hits, `Transfer.Stats`' batches) and calls
`tiers.ring.finish`, which copies the verified blocks, writes the answer and wakes the
client without the GIL: a client that reads the counters after its fetch sees it counted,
and no Python runs between the copy and the answer (counting after the copy took ~12 us on
the dev box: the copy had pushed the interpreter out of the caches). Anything else comes back as the
request's bytes, read once from the ring, and `gateway.transfer_ring.read` answers them
(the same checks, codes and durable refresh as before), without charging the rate twice.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import lmdb

from kvstore.native import blockcopy
from kvstore.native.ring import publish
from kvstore.transfer_ring import ANSWERED, HEADER_AT
from tiers import ring
from tiers.retention import Retention

if TYPE_CHECKING:
    from gateway.transfer_regions import MappedRegion
    from gateway.transfer_ring_context import RingContext
    from gateway.transfer_sessions import Session

log = logging.getLogger("kvstore.transfer")

#: How far the retention clock may move between `ready` and the answer before the due times are
#: judged anew (a real spin is 100 us; refreshes go by the minute).
_CLOCK_SLACK_S = 0.5
#: How long a ring keeps what it readied (a read txn, a reader slot, the due time) across requests.
_KEEP_S = 0.01


def tier_mapping(ctx: RingContext) -> ring.Mapping | None:
    """The tier's mapping of data.mdb (found once per server), or None: the native path is off."""
    if not ring.NATIVE or not blockcopy.NATIVE:
        return None
    if ctx.mapping is None and not ctx.mapping_tried:
        ctx.mapping_tried = True
        try:
            ctx.mapping = ctx.tier.map.mapping()
        except (LookupError, OSError, ValueError) as exc:
            log.warning("request rings: the native server is off (%s); the Python server answers", exc)
    return ctx.mapping


class NativeRing:
    """Serves one session's ring requests natively where it can.

    Args:
        ctx: what every ring of the server shares.
        session: the ring's session.
        mapping: the tier's mapping of data.mdb (`tier_mapping`).
        address: the ring's address in this process (its mapping outlives this object).
    """

    def __init__(self, ctx: RingContext, session: Session, mapping: ring.Mapping, address: int) -> None:
        self.ctx = ctx
        self.session = session
        self.mapping = mapping
        self.address = address
        self.block_bytes = ctx.layouts[session.geometry].block_bytes
        self.prefix = session.scope.prefix
        #: Requests answered natively (the others were handed back to the Python read), counted before
        #: the client is woken: a client that reads it after its fetch sees its own request in it.
        self.answered = 0
        #: Calls of `take` begun and returned: the thread spins in one while `takes > taken` (what a
        #: test waits on; a request's answer comes after its `take` returned and was counted).
        self.takes = self.taken = 0
        self._regions: tuple[MappedRegion, ...] = ()
        self._table = b""
        # What counting an answered read calls, found once per ring (it runs between `serve` and `finish`,
        # on the answer's path: bound methods and the tenant's name, no per-read lookups or objects).
        self._count_tier = ctx.tier.count_get
        self._record_hits = None if ctx.hits is None else ctx.hits.record_get
        self._count_batch = ctx.table.counters.count_read_done
        self._tenant = session.scope.namespace
        #: Where `serve` leaves a request's verified blocks for `finish` (this ring's, one request at a time).
        self._plan = bytearray(ring.PLAN_BYTES_PER_DESCRIPTOR * ctx.limit)
        # What `ready` readied for the next request: its read txn, whether it holds a reader slot, the
        # region table's regions and the due time (see `ready`).
        self._txn: lmdb.Transaction | None = None
        self._slot = False
        self._due_before = self._wall = 0.0
        self._rate_tenant = session.tenant
        self._clock = ctx.tier.clock.now
        assert ring.finish_native is not None and ring.take_native is not None
        self._finish = ring.finish_native
        self._take = ring.take_native

    def _region_table(self) -> bytes:
        """The session's regions as `serve` reads them, rebuilt when the set changes.

        Compared by identity, with the objects held, so a region dropped and another mapped under
        the same id (or at a recycled object id) is never served from a stale address. The caller
        holds the ring's `busy` lock, so no region is unmapped while the table is in use.
        """
        regions = tuple(self.session.regions.values())
        # Tuples compare their items by identity first, and MappedRegion has no __eq__: identity alone.
        if regions != self._regions:
            views = [r.view for r in regions]
            addresses = blockcopy.addresses(views)
            self._table = ring.region_table(
                (r.region_id, a, len(v)) for r, a, v in zip(regions, addresses, views, strict=True))
            self._regions = regions
        return self._table

    def serve(self, seq: int, length: int) -> bytes | None:
        """Answer request `seq` (`length` bytes, within the request area); None when it was answered
        here, else the request's bytes for the Python read (the rate is charged already).

        Raises:
            ResourceExhausted: the tenant is over its request rate (nothing was read).
        """
        ctx, session = self.ctx, self.session
        if ctx.rate is not None:
            ctx.rate.take(session.tenant)
        table = self._region_table()
        ctx.take_slot()
        try:
            txn = ctx.tier.map.begin()
            try:
                due_before = Retention.touch_due_before(ctx.tier.retention_clock.now())
                kind, value = ring.serve(self.address, seq, length, table, self.block_bytes, ctx.limit, self.prefix,
                                         self.mapping, txn, due_before, self._plan)
                if kind == ring.PLANNED:  # every block found and verified: counted before the client sees it
                    self._count(value)
                    self.answered += 1
                    ring.finish(self.address, seq, self._plan, value, self.block_bytes)  # copied, then published
                elif kind == ring.READY:  # a larger request, copied and answered in serve: counted, then published
                    self._count(value)
                    self.answered += 1
                    publish(self.address + HEADER_AT, ANSWERED)
            finally:
                txn.abort()
        finally:
            if ctx.slots is not None:
                ctx.slots.release()
        if kind == ring.HANDED_BACK:
            return value  # type: ignore[no-any-return]
        return None

    def ready(self, busy: threading.Lock) -> bool:
        """Ready what the next request needs while none is there, off its path: a reader slot (when
        free), a read txn, the region table (built under `busy`, when free) and the due time. False
        when a slot or `busy` is taken: the request is then served as it comes (`serve`).

        The txn is used only while it is the newest snapshot (`take` answers STALE once a write
        committed since), so a request reads what a txn begun on its arrival would. The due time is
        judged here, at most `_KEEP_S` before the request: retention refreshes go by the minute
        (`TOUCH_GRANULARITY_S`), and `answer` looks at the clock again before any block lands.

        What a natively answered request leaves readied is kept for the next one, for up to `_KEEP_S`
        while the session's regions stay the same: a client asking again at once finds the thread back
        in its spin (a new txn and slot per request took ~4 us of Python between requests, longer than
        the client's own; its next request waited for the thread). Past `_KEEP_S` it is readied
        anew, so the reader slot goes back to the semaphore at least that often, and at once while
        another ring waits for one (`RingContext.take_slot`), which then gets it first.
        """
        ctx = self.ctx
        if self._txn is not None:
            if self._clock() - self._wall < _KEEP_S and not ctx.waiting and not self.regions_moved():
                return True
            self.unready()
        if ctx.waiting:  # another ring waits for a reader slot: it goes first (this request, the long way)
            return False
        if ctx.slots is not None:
            if not ctx.slots.acquire(blocking=False):
                return False
            self._slot = True
        if not busy.acquire(blocking=False):
            self.unready()
            return False
        try:
            self._region_table()
        finally:
            busy.release()
        self._txn = ctx.tier.map.begin()
        self._wall = self._clock()
        self._due_before = Retention.touch_due_before(ctx.tier.retention_clock.now())
        return True

    def unready(self) -> None:
        """End what `ready` readied (the txn, the reader slot); harmless when nothing is."""
        txn, self._txn = self._txn, None
        if txn is not None:
            txn.abort()
        if self._slot:
            self._slot = False
            assert self.ctx.slots is not None
            self.ctx.slots.release()

    def take(self, expected: int, expires: float) -> tuple[int, int, int, Any]:
        """Spin for the next request and plan it (`tiers.ring.take`), with what `ready` readied."""
        assert self._txn is not None
        m = self.mapping  # `tiers.ring.take`, called without its wrapper (its return is on the answer's path)
        self.takes += 1
        try:
            return self._take(self.address, expected, ring.SERVER_HOT_SPIN_S, ring.SERVER_SPIN_S, expires,
                              self._table, self.block_bytes, self.ctx.limit, self.prefix, m.base, m.length, m.psize,
                              self._txn.id(), self._due_before, self._plan)
        finally:
            self.taken += 1

    def regions_moved(self) -> bool:
        """Whether the session's regions changed since the region table was built (`ready`)."""
        return tuple(self.session.regions.values()) != self._regions

    def answer(self, seq: int, n: int) -> bool:
        """Answer request `seq`, which `take` PLANNED (`n` blocks found and verified): charge the rate,
        count the read and `finish` it (copied, answered, the client woken). The caller holds `busy`.
        False, with nothing charged or copied, when the session's regions or the clock moved since
        `ready`: the caller `unready`s and serves the request afresh.

        Raises:
            ResourceExhausted: the tenant is over its request rate (nothing landed).
        """
        # The clock moved past a real spin's worth (a test's clock stepped, or a stalled thread): judge anew.
        # (The wall clock the retention clock follows: one cheap read, where the retention clock takes a lock.)
        if self.regions_moved() or not -_CLOCK_SLACK_S < self._clock() - self._wall < _CLOCK_SLACK_S:
            return False
        rate = self.ctx.rate
        if rate is not None:
            rate.take(self._rate_tenant)
        # `_count`, inline: this runs between the blocks' check and their copy, on the answer's path.
        self._count_tier(n, n)
        if self._record_hits is not None:
            self._record_hits(self._tenant, n, n)
        self._count_batch(n, n * self.block_bytes)
        self.answered += 1
        self._finish(self.address, seq, self._plan, n, self.block_bytes)  # copied, then published
        return True

    def _count(self, n: int) -> None:
        """Count an answered read (all `n` blocks DONE) as `gateway.transfer_ring.read` counts one."""
        self._count_tier(n, n)
        if self._record_hits is not None:
            self._record_hits(self._tenant, n, n)
        self._count_batch(n, n * self.block_bytes)
