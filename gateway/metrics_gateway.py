"""A gateway's own Prometheus series: the router's view and work, read at scrape time (docs/METRICS.md, "Fleet").

A gateway serves the per-call series a node does (`kvstore_rpc_*`, by method,
tenant and code: `gateway.metrics.RpcMetrics`) on `[metrics] port`, and these:

- `kvstore_gateway_nodes`: live nodes in the gateway's view of etcd's membership;
- `kvstore_gateway_membership_stale`: 1 while etcd is out of reach (the view is the last seen, F7);
- `kvstore_gateway_routes`: callers (token, tenant, geometry) with node connections held;
- `kvstore_gateway_forwarded_calls`: Admin and SwaPool calls forwarded and answered, by service, method
  and node (F52);
- the router's fleet-client counters, which the routing code counts in the process's default registry
  (`kvstore.client.fleet_metrics`): `kvstore_fleet_client_failovers`, `_retries`, `_put_not_replicated`,
  `_node_errors`.

Labels are bounded: methods by the services, nodes by the fleet's ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.fleet_store import FleetStore
    from gateway.gateway_forward import Forwarder

#: The default registry's series a gateway re-exports (the router's fleet-client counters).
FLEET_CLIENT_PREFIX = "kvstore_fleet_client_"


class GatewayCollector(Collector):
    """The gateway's series (see the module's docstring), read from `store` and `forwarder` at each scrape."""

    def __init__(self, store: FleetStore, forwarder: Forwarder) -> None:
        self.store = store
        self.forwarder = forwarder

    def describe(self) -> list[Metric]:
        """Nothing: the values are read at each scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        view = self.store.view
        yield GaugeMetricFamily("kvstore_gateway_nodes", "Live nodes in the gateway's view of the membership.",
                                value=len(view.nodes))
        yield GaugeMetricFamily("kvstore_gateway_membership_stale",
                                "1 while etcd is out of reach and the view is the last seen (F7).",
                                value=1.0 if view.stale else 0.0)
        yield GaugeMetricFamily("kvstore_gateway_routes",
                                "Callers (token, tenant, geometry) whose node connections the gateway holds.",
                                value=self.store.routes_held())
        forwarded = CounterMetricFamily("kvstore_gateway_forwarded_calls",
                                        "Admin and SwaPool calls forwarded to a node and answered, by service, "
                                        "method and node (F52).", labels=["service", "method", "node"])
        for (method, node), count in sorted(self.forwarder.forwarded.items()):
            service, name = method.strip("/").rsplit("/", 1)
            forwarded.add_metric([service.rsplit(".", 1)[-1], name, node], count)
        yield forwarded
        for family in REGISTRY.collect():  # the routing code's counters (kvstore.client.fleet_metrics)
            if family.name.startswith(FLEET_CLIENT_PREFIX):
                yield family
