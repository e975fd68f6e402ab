"""Fixtures of the metrics and request-log tests: a real server with the metrics interceptor and endpoint."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import MetricsEndpoint, MetricsInterceptor, ServerMetrics, serve_metrics
from gateway.request_log import RequestLog
from kvstore.config import StoreSettings


@dataclass(frozen=True)
class Scrape:
    """The samples of one scrape: (name, labels) -> value."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, frozenset(s.labels.items()))] = s.value
        return cls(samples)

    def value(self, name: str, **labels: str) -> float | None:
        """The sample `name` with exactly `labels` (None: absent)."""
        return self.samples.get((name, frozenset(labels.items())))

    def where(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Every sample named `name`: (labels, value)."""
        return [(dict(labels), v) for (n, labels), v in self.samples.items() if n == name]


@dataclass
class Metered:
    """A running server with its metrics registry and scrape endpoint."""

    running: Any
    metrics: ServerMetrics
    endpoint: MetricsEndpoint
    parts: dict[str, Any] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return str(self.running.target)

    def scrape_text(self) -> str:
        """GET /metrics over HTTP, as Prometheus does."""
        with urllib.request.urlopen(self.endpoint.url, timeout=30) as reply:
            return str(reply.read().decode())

    def scrape(self) -> Scrape:
        """Every sample of a scrape over HTTP."""
        return Scrape.parse(self.scrape_text())


class _Chain(grpc.aio.ServerInterceptor):
    """Two interceptors as one: `outer`, then `inner`, then the method."""

    def __init__(self, outer: grpc.aio.ServerInterceptor, inner: grpc.aio.ServerInterceptor) -> None:
        self.outer, self.inner = outer, inner

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        return await self.outer.intercept_service(lambda d: self.inner.intercept_service(continuation, d), details)


def _catching(make: Callable[..., Any], name: str, parts: dict[str, Any]) -> Callable[..., Any]:
    """`make`, keeping what it made in parts[name]."""
    def caught(*args: Any, **kwargs: Any) -> Any:
        parts[name] = made = make(*args, **kwargs)
        return made
    return caught


@pytest.fixture
def start_metered(start_server: Callable[..., Any], store_settings: StoreSettings, loop_thread: Any,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Metered]]:
    """Start a real server (gateway.server.start) with the metrics interceptor and a request log, its
    stats watched, and the endpoint on a free loopback port.

    Until gateway/server.py wires gateway.metrics itself, the interceptor goes in where the server
    constructs UndecodableRequests (just outside it), and the servicers are caught as the server
    constructs them.
    """
    import gateway.server as srv

    endpoints: list[MetricsEndpoint] = []

    def start(*, tenant_labels_cap: int = 64, namespace_tenants: bool = False, **kwargs: Any) -> Metered:
        metrics = ServerMetrics(tenant_labels_cap=tenant_labels_cap)
        interceptor = (MetricsInterceptor(metrics, RequestLog(), current_caller=None) if namespace_tenants
                       else MetricsInterceptor(metrics, RequestLog()))
        parts: dict[str, Any] = {}
        undecodable = srv.UndecodableRequests
        monkeypatch.setattr(srv, "UndecodableRequests", lambda: _Chain(interceptor, undecodable()))
        for name in ("KVStoreServicer", "SwaCache", "TransferServicer"):
            monkeypatch.setattr(srv, name, _catching(getattr(srv, name), name, parts))
        running = start_server(store_settings, **kwargs)

        async def watch() -> None:
            metrics.watch(running.tier, swa=parts["SwaCache"], transfer=parts["TransferServicer"],
                          resume=parts["KVStoreServicer"].resume)

        loop_thread.run(watch())
        endpoint = serve_metrics(metrics.registry, "127.0.0.1", 0)
        endpoints.append(endpoint)
        return Metered(running=running, metrics=metrics, endpoint=endpoint, parts=parts)

    yield start
    for endpoint in endpoints:
        endpoint.close_now()
