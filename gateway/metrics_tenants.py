"""Per-tenant series read at scrape time: hit counters (gateway.hit_stats) and what each tenant stores.

The tenants are those the tenant registry knows (tokens) and those the hit
counters have seen; each gets the same label as in the per-call series
(gateway.metrics.TenantLabels: past the cap, "other", with the values of
every folded tenant summed). Both run on the scrape's thread, off the event
loop: the registry's tenants, the hit counters and the labels are thread-safe,
and the NVMe tier's per-namespace usage is read there
(`BlockStore.namespace_usage`, one read transaction per tenant).

`TenantsFileCollector` adds how the tenants file's reloads go (gateway.tenants.LoadStatus):
a revocation waits on the next good load, so an alert on a stale load or a
failed one is how an operator learns that the file on disk is not what is served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.hit_stats import HitStats
from gateway.tenants import LoadStatus
from tiers.store import BlockStore

log = logging.getLogger("kvstore.metrics")

#: The label of every tenant past the cap (gateway.metrics.OTHER_TENANT).
OTHER = "other"
#: HitStats fields exported per tenant as kvstore_tenant_<field>_total (since the server started).
HIT_FIELDS = {
    "lookups": "Lookup calls",
    "lookup_tokens_asked": "tokens Lookups asked for",
    "lookup_tokens_found": "leading tokens Lookups found stored",
    "gets": "Get calls",
    "get_tokens_asked": "tokens Gets asked for",
    "get_tokens_returned": "tokens Gets returned (served from cache)",
    "swa_snapshots_asked": "SWA snapshots Gets asked for",
    "swa_snapshots_found": "SWA snapshots Gets found",
    "resume_prompt_tokens": "prompt tokens of the resume plans reported",
    "resume_usable_tokens": "tokens the reported plans served from cache",
}
#: NamespaceUsage fields exported per tenant as gauges.
USAGE_FIELDS = {
    "stored_bytes": ("kvstore_tenant_stored_bytes", "Bytes the tenant stores on NVMe."),
    "blocks": ("kvstore_tenant_stored_blocks", "Blocks the tenant stores on NVMe."),
    "token_hours": ("kvstore_tenant_token_hours", "Token-hours the tenant has stored: tokens stored integrated "
                                                  "over time (each block counts its tokens)."),
}


@dataclass(frozen=True, kw_only=True)
class TenantStats:
    """What `gather` read: each tenant's label, and the hit counters summed per label."""

    labels: dict[str, str]
    hits: dict[str, dict[str, int]]


def gather(names: Iterable[str], label: Callable[[str], str | None], hits: HitStats | None) -> TenantStats:
    """The tenants of `names` and of `hits`, labelled, with their hit counters since the server started."""
    tenants = set(names) | (set(hits.tenants()) if hits is not None else set())
    labels = {t: label(t) or OTHER for t in sorted(tenants)}
    summed: dict[str, dict[str, int]] = {}
    if hits is not None:
        for tenant, name in labels.items():
            counts = hits.windows(tenant, ["start"])[0].counts
            into = summed.setdefault(name, dict.fromkeys(HIT_FIELDS, 0))
            for field in HIT_FIELDS:
                into[field] += counts.get(field, 0)
    return TenantStats(labels=labels, hits=summed)


def series(stats: TenantStats, tier: BlockStore) -> Iterator[Metric]:
    """The per-tenant series: the hit counters gathered, the usage read now from `tier`."""
    for field, doc in HIT_FIELDS.items():
        family = CounterMetricFamily(f"kvstore_tenant_{field}", f"Per tenant: {doc}, since the server started.",
                                     labels=["tenant"])
        for name, counts in sorted(stats.hits.items()):
            family.add_metric([name], counts[field])
        yield family
    usage: dict[str, dict[str, float]] = {}
    for tenant, name in stats.labels.items():
        try:
            found = tier.namespace_usage(tenant)
        except Exception as exc:  # a closed or damaged store: the other series still answer
            log.error("metrics: cannot read the usage of tenant %r: %s", tenant, exc)
            continue
        into = usage.setdefault(name, dict.fromkeys(USAGE_FIELDS, 0.0))
        for field in USAGE_FIELDS:
            into[field] += getattr(found, field)
    for field, (metric, doc) in USAGE_FIELDS.items():
        gauge = GaugeMetricFamily(metric, doc, labels=["tenant"])
        for name, values in sorted(usage.items()):
            gauge.add_metric([name], values[field])
        yield gauge


class TenantsFileCollector(Collector):
    """The tenants file's reload status, read at scrape time.

    Args:
        status: the registry's `TenantRegistry.status` (thread-safe).
    """

    def __init__(self, status: Callable[[], LoadStatus]) -> None:
        self.status = status

    def describe(self) -> list[Metric]:
        """Nothing: the values are read at each scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        yield GaugeMetricFamily("kvstore_tenants_last_load_timestamp_seconds",
                                "Wall-clock time of the tenants file's last load that replaced the token table "
                                "(a read that parsed, or the file found gone).", value=s.last_load_s)
        yield CounterMetricFamily("kvstore_tenants_load_failures",
                                  "Loads of the tenants file that failed (each damaged version once); the last "
                                  "good table is served meanwhile.", value=s.failures)
        yield GaugeMetricFamily("kvstore_tenants_file_ok",
                                "1 when the token table is the tenants file's current content, 0 while the file "
                                "on disk is damaged or cannot be read (revocations written since wait).",
                                value=1.0 if s.file_ok else 0.0)
        yield CounterMetricFamily("kvstore_tenants_file_checks",
                                  "Checks of the tenants file for a change (one every auth.reload_s): a counter "
                                  "that stops growing means the reload stopped.", value=s.checks)
