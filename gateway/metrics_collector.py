"""The stores' stats as Prometheus series, read at scrape time (nothing is counted twice or per call).

`StatsCollector.collect` runs on the endpoint's HTTP thread. The NVMe tier's
stats are read there (`BlockStore.stats` is thread-safe); the SWA pool's
and the transfer sessions' live on the event loop (the pool may be Redis, the
session table is event-loop only), so they are gathered by one coroutine
scheduled on the loop, waited for at most `loop_timeout_s`. When the loop does
not answer in time, their series are left out of that scrape and
`kvstore_stats_up{source}` says 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway import metrics_tenants
from gateway.hit_stats import HitStats
from gateway.resume_counters import ResumeCounters
from gateway.transfer_servicer import TransferServicer
from kvstore import geometry
from tiers.accounting import TierStats
from tiers.store import BlockStore
from tiers.swa_cache import SwaCache, SwaStats

log = logging.getLogger("kvstore.metrics")

#: Tier counters (persisted: since the store was created) exported as kvstore_store_<name>_total.
STORE_COUNTERS = {
    "lookups": "Lookup calls.",
    "lookup_tokens_asked": "Tokens asked by Lookups.",
    "lookup_tokens_found": "Leading tokens Lookups found stored.",
    "gets": "Get calls.",
    "get_tokens_asked": "Tokens asked by Gets.",
    "get_tokens_returned": "Tokens Gets returned.",
    "puts": "Put batches committed.",
    "blocks_written": "Blocks written.",
    "bytes_written": "Bytes written.",
    "rejected_puts": "Puts refused for lack of room (RESOURCE_EXHAUSTED).",
    "evictions": "Blocks evicted.",
    "evicted_bytes": "Bytes evicted.",
    "corrupt_blocks": "Blocks found damaged and dropped.",
    "damaged_blocks": "Of the corrupt blocks, those a damaged LMDB page turned into misses while serving (R16).",
}
#: SWA cache counters (since the server started) exported as kvstore_swa_<name>_total.
SWA_COUNTERS = {
    "puts": "SWA Put calls.", "snapshots_put": "Snapshots stored.", "bytes_put": "Snapshot bytes stored.",
    "failed_puts": "Puts the pool could not store.", "gets": "SWA Get calls.",
    "snapshots_asked": "Snapshots asked by Gets.", "hits": "Snapshots found by Gets.",
    "corrupt": "Snapshots that failed their checks (answered as misses).", "deletes": "SWA Delete calls.",
    "lookups": "Snapshot candidate searches by KVStore Lookups.",
    "backend_errors": "Calls that found the pool's backend unreachable.",
}
#: Transfer counters (since the server started) exported as kvstore_transfer_<name>_total.
TRANSFER_COUNTERS = {
    "read_batches": "Read batches finished.", "write_batches": "Write batches finished.",
    "descriptors_done": "Descriptors copied.", "descriptors_missing": "Read descriptors whose block was missing.",
    "descriptors_failed": "Descriptors that failed.", "bytes_moved": "Bytes copied by transfer batches.",
    "refresh_failures": "Read descriptors whose retention refresh failed.",
    "ring_requests": "Requests answered through sessions' request rings.",
    "bulk_fetches": "BulkFetch calls answered by the bulk transport.",
    "bulk_staged": "BulkFetch calls served through the staging pool (the map path could not answer).",
}


@dataclass(frozen=True, kw_only=True)
class LoopStats:
    """What is read on the event loop: SWA stats, the transfer table, resume reports (None: not served)."""

    swa: SwaStats | None
    transfer: dict[str, int] | None
    resume: dict[str, int] | None


def _ratio(found: int, asked: int) -> float:
    return found / asked if asked else math.nan


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _layout_names() -> dict[bytes, str]:
    return {g.fingerprint: name for name, g in geometry.REGISTRY.items()}


class StatsCollector(Collector):
    """Series read from the tier, the SWA cache, the transfer servicer and the resume counters at scrape time.

    Args:
        tier: the NVMe tier.
        swa: the SWA cache (None: no SWA series).
        transfer: the Transfer servicer (None: no transfer series).
        resume: the ReportResume counters (None: no resume series).
        loop: the server's event loop, where the SWA, transfer and resume stats are read.
        hits: the hit counters per tenant (None: no per-tenant hit series).
        tenant_names: the tenants the registry knows (their usage is shown even before they call).
        tenant_label: a tenant's label in the per-call series (None: folded into "other"); thread-safe.
        tenant_labels: how many tenants have a label of their own now.
        loop_timeout_s: longest a scrape waits for the event loop.
    """

    def __init__(self, tier: BlockStore, *, swa: SwaCache | None, transfer: TransferServicer | None,
                 resume: ResumeCounters | None, loop: asyncio.AbstractEventLoop, hits: HitStats | None = None,
                 tenant_names: Callable[[], Iterable[str]] = tuple, tenant_label: Callable[[str], str | None] = str,
                 tenant_labels: Callable[[], int] = lambda: 0, loop_timeout_s: float = 5.0) -> None:
        self.tier = tier
        self.swa = swa
        self.transfer = transfer
        self.resume = resume
        self.loop = loop
        self.hits = hits
        self.tenant_names = tenant_names
        self.tenant_label = tenant_label
        self.tenant_labels = tenant_labels
        self.loop_timeout_s = loop_timeout_s
        self._layout_names = _layout_names()

    def describe(self) -> list[Metric]:
        """Nothing: registering must not read the stats (it runs on the event loop)."""
        return []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("kvstore_stats_up", "Whether the last scrape could read each source's stats.",
                               labels=["source"])
        try:
            tier = self.tier.stats()
        except Exception as exc:  # a closed or damaged store: the scrape still answers
            log.error("metrics: cannot read the store's stats: %s", exc)
            up.add_metric(["store"], 0)
        else:
            up.add_metric(["store"], 1)
            yield from self._store(tier)
        loop_stats = self._loop_stats()
        up.add_metric(["loop"], 0 if loop_stats is None else 1)
        if loop_stats is not None:
            if loop_stats.swa is not None:
                yield from _swa(loop_stats.swa)
            if loop_stats.transfer is not None:
                yield from _transfer(loop_stats.transfer)
            if loop_stats.resume is not None:
                yield from _resume(loop_stats.resume)
        tenants = metrics_tenants.gather(self.tenant_names(), self.tenant_label, self.hits)
        yield from metrics_tenants.series(tenants, self.tier)
        yield up
        yield _gauge("kvstore_metrics_tenant_labels", "Tenants with a label of their own in the kvstore_rpc_* "
                     "series (the rest are counted as tenant='other').", self.tenant_labels())

    def _loop_stats(self) -> LoopStats | None:
        if self.loop.is_closed():
            return None
        try:
            if asyncio.get_running_loop() is self.loop:  # called on the loop itself: waiting would deadlock
                return None
        except RuntimeError:
            pass
        future = asyncio.run_coroutine_threadsafe(self._gather(), self.loop)
        try:
            return future.result(timeout=self.loop_timeout_s)
        except Exception as exc:
            future.cancel()
            log.warning("metrics: the event loop did not answer the scrape within %g s (%s)",
                        self.loop_timeout_s, type(exc).__name__)
            return None

    async def _gather(self) -> LoopStats:
        swa = await self.swa.stats() if self.swa is not None else None
        transfer = self.transfer.figures() if self.transfer is not None else None
        resume = self.resume.stats_fields() if self.resume is not None else None
        return LoopStats(swa=swa, transfer=transfer, resume=resume)

    def _store(self, s: TierStats) -> Iterator[Metric]:
        yield _gauge("kvstore_store_blocks", "Blocks stored on NVMe.", s.blocks_stored)
        yield _gauge("kvstore_store_bytes", "Bytes stored on NVMe.", s.bytes_stored)
        yield _gauge("kvstore_store_capacity_bytes", "The store's capacity (store.capacity_bytes).", s.capacity_bytes)
        yield _gauge("kvstore_store_free_bytes", "Capacity not used by stored blocks.", s.bytes_free)
        yield _gauge("kvstore_store_write_rate_bytes_per_second", "Bytes written per second, recent window.",
                     s.write_rate_bytes_per_s)
        yield _gauge("kvstore_store_headroom_hours", "Hours until the free bytes fill at the recent write rate "
                     "(+Inf with no writes).", s.headroom_hours)
        yield _gauge("kvstore_store_retention_hours", "The retention every block is promised (store.retention_hours).",
                     s.retention_hours)
        yield _gauge("kvstore_store_headroom_retention_ratio", "Headroom over retention: below 1, the capacity at "
                     "the recent write rate holds less than the retention.",
                     s.headroom_hours / s.retention_hours if s.retention_hours else math.nan)
        yield _gauge("kvstore_store_active_leases", "Lookup leases held now.", s.active_leases)
        yield _gauge("kvstore_store_uptime_seconds", "Seconds since the store was opened.", s.uptime_s)
        c = asdict(s.counters)
        for name, doc in STORE_COUNTERS.items():
            yield _counter(f"kvstore_store_{name}", f"{doc} Since the store was created.", c[name])
        yield _gauge("kvstore_store_lookup_hit_ratio", "Lookup tokens found over asked, since the store was created "
                     "(for a window: rate() of the two counters).", _ratio(c["lookup_tokens_found"],
                                                                            c["lookup_tokens_asked"]))
        yield _gauge("kvstore_store_get_hit_ratio", "Get tokens returned over asked, since the store was created.",
                     _ratio(c["get_tokens_returned"], c["get_tokens_asked"]))
        blocks = GaugeMetricFamily("kvstore_store_geometry_blocks", "Blocks stored per geometry.", labels=["geometry"])
        stored = GaugeMetricFamily("kvstore_store_geometry_bytes", "Bytes stored per geometry.", labels=["geometry"])
        for fingerprint, (n, nbytes) in sorted(s.by_layout.items()):
            name = self._layout_names.get(fingerprint, fingerprint.hex())
            blocks.add_metric([name], n)
            stored.add_metric([name], nbytes)
        yield blocks
        yield stored


def _swa(s: SwaStats) -> Iterator[Metric]:
    c, u = asdict(s.counters), s.usage
    up = GaugeMetricFamily("kvstore_swa_backend_up", "Whether the SWA pool's backend answered.", labels=["backend"])
    up.add_metric([s.backend], 0 if u is None else 1)
    yield up
    yield _gauge("kvstore_swa_ttl_seconds", "The longest a snapshot lives (swa.ttl_s).", s.ttl_s)
    for name, doc in SWA_COUNTERS.items():
        yield _counter(f"kvstore_swa_{name}", f"{doc} Since the server started.", c[name])
    yield _gauge("kvstore_swa_hit_ratio", "Snapshots found over asked by SWA Gets, since the server started.",
                 _ratio(c["hits"], c["snapshots_asked"]))
    if u is not None:
        yield _gauge("kvstore_swa_items", "Snapshots in the pool.", u.items)
        yield _gauge("kvstore_swa_bytes", "Bytes the pool holds.", u.bytes_used)
        yield _gauge("kvstore_swa_capacity_bytes", "The pool's byte cap (0: none known).", u.cap_bytes)
        yield _counter("kvstore_swa_expirations", "Snapshots the pool expired, as its backend counts them.",
                       u.expirations)
        yield _counter("kvstore_swa_evictions", "Snapshots the pool evicted for room, as its backend counts them.",
                       u.evictions)


def _transfer(t: dict[str, int]) -> Iterator[Metric]:
    yield _gauge("kvstore_transfer_sessions", "Open transfer sessions.", t["sessions"])
    yield _gauge("kvstore_transfer_regions", "Memory regions mapped by transfer sessions.", t["regions"])
    yield _gauge("kvstore_transfer_mapped_bytes", "Bytes of the mapped regions.", t["mapped_bytes"])
    yield _gauge("kvstore_transfer_descriptors_in_flight", "Descriptors of running batches.",
                 t["descriptors_in_flight"])
    yield _gauge("kvstore_transfer_rings", "Request rings mapped by transfer sessions.", t["rings"])
    yield _gauge("kvstore_transfer_bulk_sessions", "Transfer sessions using the bulk transport.", t["bulk_sessions"])
    yield _gauge("kvstore_transfer_bulk_lanes", "Client engines (lanes) of the bulk sessions.", t["bulk_lanes"])
    for name, doc in TRANSFER_COUNTERS.items():
        yield _counter(f"kvstore_transfer_{name}", f"{doc} Since the server started.", t[name])


def _resume(fields: dict[str, int]) -> Iterator[Metric]:
    for name, value in sorted(fields.items()):
        short = name.removeprefix("resume_")
        yield _counter(f"kvstore_resume_{short}", f"ReportResume totals: {short.replace('_', ' ')}, since the "
                       "server started (the planner's view of hits).", value)

