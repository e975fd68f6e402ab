"""A fleet node's own series (docs/METRICS.md, "Fleet"), read at scrape time from its registration and repairer.

Everything here is a plain attribute read (ints, a bool, the view's immutable
node mapping), safe from the endpoint's HTTP thread without the event loop: the
membership the node's re-replication follows (its size and whether etcd is away,
F7), its re-replication progress (the record it publishes in etcd, F18), and its
lease's keep-alives (F3, F5). A single node registers no such collector, so
none of these series exist there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.fleet_repair import FleetRepairer
    from kvstore.fleet.membership import Registration


class FleetNodeCollector(Collector):
    """Membership, re-replication and lease series of one fleet node.

    Args:
        registration: the node's record in etcd and its lease's keep-alives.
        repairer: the node's re-replication (its membership view and progress).
    """

    def __init__(self, registration: Registration, repairer: FleetRepairer) -> None:
        self.registration = registration
        self.repairer = repairer

    def describe(self) -> list[Metric]:
        """Nothing: the values are read at each scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        view, p, reg = self.repairer.membership, self.repairer.progress, self.registration
        yield GaugeMetricFamily("kvstore_fleet_members", "Live nodes in this node's view of the membership "
                                "(the last set seen while etcd is away).", value=len(view.nodes))
        yield GaugeMetricFamily("kvstore_fleet_membership_stale", "1 while etcd is out of reach and the view is "
                                "the last set seen (F7), else 0.", value=1.0 if view.stale else 0.0)
        yield GaugeMetricFamily("kvstore_fleet_membership_stale_seconds", "Seconds since the view lost etcd "
                                "(0 while current).", value=view.stale_s)
        yield GaugeMetricFamily("kvstore_fleet_repair_under_replicated_bytes", "Bytes of copies this node still "
                                "has to make to bring its runs back to their replication factor (F18).",
                                value=p.under_replicated_bytes)
        yield GaugeMetricFamily("kvstore_fleet_repair_under_replicated_runs", "Runs with a replica this node is "
                                "to fill still lacking blocks.", value=p.under_replicated_runs)
        yield CounterMetricFamily("kvstore_fleet_repair_copied_bytes", "Bytes this node's re-replication stored "
                                  "on other nodes, since it started.", value=p.copied_bytes)
        yield CounterMetricFamily("kvstore_fleet_repair_sent_bytes", "Bytes of block data sent in copies, since "
                                  "the node started (above copied: blocks the target stored meanwhile).",
                                  value=p.sent_bytes)
        yield CounterMetricFamily("kvstore_fleet_repair_passes", "Re-replication passes finished, since the node "
                                  "started.", value=p.passes)
        yield GaugeMetricFamily("kvstore_fleet_repair_running", "1 while a re-replication pass is under way.",
                                value=1.0 if p.running else 0.0)
        # Settled as `kvstore fleet status` says it fleet-wide, for this node: its 0 can be trusted.
        settled = not p.running and p.passes > 0 and p.planned_nodes == sorted(view.nodes)
        yield GaugeMetricFamily("kvstore_fleet_repair_settled", "1 once this node finished a pass over today's "
                                "membership (its under-replicated 0 can be trusted), else 0.",
                                value=1.0 if settled else 0.0)
        yield GaugeMetricFamily("kvstore_fleet_repair_failed_runs", "Runs a copy failed for in the last pass "
                                "(retried on the next).", value=p.failed_runs)
        yield GaugeMetricFamily("kvstore_fleet_draining", "1 while this node drains (`kvstore fleet drain`).",
                                value=1.0 if p.draining else 0.0)
        yield CounterMetricFamily("kvstore_fleet_lease_renewals", "Keep-alives of this node's lease that etcd "
                                  "answered, since it started.", value=reg.renewals)
        yield CounterMetricFamily("kvstore_fleet_lease_renewal_failures", "Keep-alives that could not reach "
                                  "etcd (the lease expires a TTL after the last one that did).",
                                  value=reg.renewal_failures)
        yield CounterMetricFamily("kvstore_fleet_lease_losses", "Times this node found its lease gone (expired "
                                  "or revoked) and registered again (F5).", value=max(0, reg.registrations - 1))
