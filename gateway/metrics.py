"""The Prometheus endpoint: per-RPC series from an interceptor, the stores' stats read at scrape time.

Two kinds of series, so that serving a call costs no more than two clock reads,
an increment and a histogram observation:

- per call (`RpcMetrics`, fed by `MetricsInterceptor`): requests by method,
  tenant and status code, latency histograms by method and tenant, rejections
  by method, tenant, status code and reason (the error class);
- per scrape (`gateway.metrics_collector.StatsCollector`): the NVMe tier's,
  the SWA pool's, the transfer path's and the resume reports' stats, and per
  tenant the hit counters and what each stores (`gateway.metrics_tenants`),
  read when Prometheus asks.

Label cardinality is bounded: methods by the services served (an unknown
method is not counted), status codes and reasons by the code base, tenants by
`tenant_labels_cap`: the first that many distinct tenants get their own label,
every later one is counted as "other" (and `kvstore_metrics_tenants_folded_total`
counts the calls folded so). Tenants come from tokens (gateway.auth), so the
registry bounds them, but a store can hold many more than a dashboard needs.

The endpoint is prometheus-client's HTTP server on its own port and its own
threads (`start_endpoint`); scrapes never run on the gRPC event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from gateway.auth import DEFAULT_TENANT
from gateway.call_outcome import UNAUTHENTICATED_TENANT, CallOutcome, Observer, OutcomeInterceptor
from gateway.hit_stats import HitStats
from gateway.metrics_collector import StatsCollector
from gateway.resume_counters import ResumeCounters
from gateway.transfer_servicer import TransferServicer
from tiers.store import BlockStore
from tiers.swa_cache import SwaCache

#: Latency buckets: from a GetInfo on loopback (~100 us) to a Get of a million-token prompt (seconds).
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Distinct tenants with a label of their own; later ones are counted as OTHER_TENANT.
TENANT_LABELS_CAP = 64
OTHER_TENANT = "other"
#: Codes that are no refusal: success, and a call the client cancelled (closing a transfer session does).
_NOT_REFUSED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.CANCELLED})
#: Labels that never count against the cap.
_RESERVED = frozenset({DEFAULT_TENANT, UNAUTHENTICATED_TENANT, OTHER_TENANT})


class TenantLabels:
    """The tenant label of a call: the tenant itself for the first `cap` distinct ones, OTHER_TENANT after.

    Thread-safe: observers run on the event loop, and on grpc's threads for a sync method.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._labelled: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str | None:
        """The label for `tenant`; None when it is folded into OTHER_TENANT."""
        if tenant in self._labelled or tenant in _RESERVED:
            return tenant
        with self._lock:
            if len(self._labelled) < self.cap:
                self._labelled.add(tenant)
                return tenant
        return None

    def __len__(self) -> int:
        return len(self._labelled)


class RpcMetrics:
    """The per-call series (an `Observer` of call outcomes).

    Args:
        registry: where the series are registered.
        tenant_labels_cap: distinct tenants with their own label.
    """

    def __init__(self, registry: CollectorRegistry, *, tenant_labels_cap: int = TENANT_LABELS_CAP) -> None:
        self.tenants = TenantLabels(tenant_labels_cap)
        self.requests = Counter("kvstore_rpc_requests", "Finished RPCs by method, tenant and status code.",
                                ["method", "tenant", "code"], registry=registry)
        self.latency = Histogram("kvstore_rpc_duration_seconds",
                                 "RPC duration from the method's start to its last message, by method and tenant.",
                                 ["method", "tenant"], buckets=LATENCY_BUCKETS_S, registry=registry)
        self.rejections = Counter("kvstore_rpc_rejections",
                                  "RPCs refused (a status other than OK and CANCELLED), by method, tenant, status code "
                                  "and reason (the kvstore error class that refused it; 'status' when the status "
                                  "was set without one, e.g. by an interceptor or a cancelled call).",
                                  ["method", "tenant", "code", "reason"], registry=registry)
        self.folded = Counter("kvstore_metrics_tenants_folded",
                              f"Calls counted under tenant='{OTHER_TENANT}' because {tenant_labels_cap} other "
                              "tenants already had labels.", registry=registry)
        # Label lookups take a lock and hash the label tuple: keep each series' child.
        self._children: dict[tuple[str, str, grpc.StatusCode], tuple[Any, Any]] = {}

    def __call__(self, outcome: CallOutcome) -> None:
        tenant = self.tenants(outcome.tenant)
        if tenant is None:
            tenant = OTHER_TENANT
            self.folded.inc()
        key = (outcome.method, tenant, outcome.code)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (self.requests.labels(outcome.method, tenant, outcome.code.name),
                                              self.latency.labels(outcome.method, tenant))
        children[0].inc()
        children[1].observe(outcome.duration_s)
        if outcome.code not in _NOT_REFUSED:
            self.rejections.labels(outcome.method, tenant, outcome.code.name, outcome.reason or "status").inc()


class ServerMetrics:
    """One server's registry: the per-call series now, the stats collector once `watch` is called.

    Args:
        tenant_labels_cap: distinct tenants with their own label (see the module docstring).
    """

    def __init__(self, *, tenant_labels_cap: int = TENANT_LABELS_CAP) -> None:
        self.registry = CollectorRegistry()
        self.rpc = RpcMetrics(self.registry, tenant_labels_cap=tenant_labels_cap)
        self.collector: StatsCollector | None = None
        #: The tenants the registry knows (gateway.tenants.TenantRegistry.tenants), read at each scrape.
        self.known_tenants: Callable[[], Iterable[str]] = tuple

    def watch(self, tier: BlockStore, *, swa: SwaCache | None = None, transfer: TransferServicer | None = None,
              resume: ResumeCounters | None = None, hits: HitStats | None = None) -> StatsCollector:
        """Read these components' stats at every scrape. Call it on the server's event loop.

        The per-tenant series cover the tenants `hits` has seen and those `known_tenants` names.
        """
        if self.collector is not None:
            raise RuntimeError("ServerMetrics.watch was already called")
        self.collector = StatsCollector(tier, swa=swa, transfer=transfer, resume=resume,
                                        loop=asyncio.get_running_loop(), hits=hits,
                                        tenant_names=lambda: self.known_tenants(), tenant_label=self.rpc.tenants,
                                        tenant_labels=lambda: len(self.rpc.tenants))
        self.registry.register(self.collector)
        return self.collector


class MetricsInterceptor(OutcomeInterceptor):
    """Times every RPC into `metrics`' per-call series; `also` observe the same outcomes (gateway.request_log).

    Place it before the authentication interceptor, so that calls refused there are counted too.
    """

    def __init__(self, metrics: ServerMetrics, *also: Observer) -> None:
        super().__init__([metrics.rpc, *also])


class EndpointSettings(Protocol):
    """Where the endpoint listens (kvstore.config's [metrics] section)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


@dataclass
class MetricsEndpoint:
    """A running HTTP endpoint serving `/metrics` on its own threads."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        """The scrape URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def close(self) -> None:
        """Stop serving (the HTTP server's shutdown waits for its poll loop: done off the event loop)."""
        await asyncio.to_thread(self.close_now)

    def close_now(self) -> None:
        """Stop serving, blocking until the server thread ends."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    """Serve `registry` over HTTP on `host:port` (port 0: any free port).

    Raises:
        OSError: the address cannot be bound.
    """
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port} for metrics ([metrics] port): "
                                 f"{exc.strerror or exc}") from None
    return MetricsEndpoint(host=host, port=server.server_port, _server=server, _thread=thread)


def start_endpoint(settings: EndpointSettings, registry: CollectorRegistry) -> MetricsEndpoint | None:
    """The endpoint the [metrics] settings ask for; None when `settings.port` is 0 (off).

    Raises:
        OSError: the address cannot be bound.
    """
    if settings.port == 0:
        return None
    return serve_metrics(registry, settings.host, settings.port)
