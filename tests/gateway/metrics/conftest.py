"""Fixtures of the metrics and request-log tests: `kvstore serve`'s server (gateway.server.start) with its
/metrics endpoint on a free loopback port, scraped over HTTP as Prometheus does."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import ServerMetrics
from kvstore import api_tokens
from kvstore.config import MetricsSettings, StoreSettings


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

    def by_tenant(self, name: str) -> dict[str, float]:
        """The samples named `name` summed per tenant label."""
        out: dict[str, float] = {}
        for labels, value in self.where(name):
            out[labels["tenant"]] = out.get(labels["tenant"], 0.0) + value
        return out


@dataclass
class Metered:
    """A running server and its metrics endpoint."""

    running: Any

    @property
    def target(self) -> str:
        return str(self.running.target)

    @property
    def metrics(self) -> ServerMetrics:
        return self.running.metrics  # type: ignore[no-any-return]

    def scrape_text(self) -> str:
        """GET /metrics over HTTP, as Prometheus does."""
        with urllib.request.urlopen(self.running.metrics_endpoint.url, timeout=30) as reply:
            return str(reply.read().decode())

    def scrape(self) -> Scrape:
        """Every sample of a scrape over HTTP."""
        return Scrape.parse(self.scrape_text())

    def scrape_until(self, ready: Callable[[Scrape], bool], wait_s: float = 30.0) -> Scrape:
        """Scrape again until `ready` holds (what the server learns after the client moved on, as a
        cancellation, is counted a moment later); the last scrape either way."""
        deadline = time.monotonic() + wait_s
        while True:
            scrape = self.scrape()
            if ready(scrape) or time.monotonic() > deadline:
                return scrape
            time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def start_metered(start_server: Callable[..., Any], store_settings: StoreSettings) -> Callable[..., Metered]:
    """Start a real server with `[metrics] port` on a free loopback port (`tenant_labels` as given)."""

    def start(*, tenant_labels: int = 64, **kwargs: Any) -> Metered:
        for attempt in range(3):  # the free port may be taken between the probe and the bind
            try:
                metrics = MetricsSettings(host="127.0.0.1", port=_free_port(), tenant_labels=tenant_labels)
                return Metered(start_server(store_settings, metrics=metrics, **kwargs))
            except OSError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    return start


@pytest.fixture
def issue(store_settings: StoreSettings) -> Callable[..., str]:
    """Create a token for a tenant in the store's tenants file (auth turns on with the first)."""

    def make(tenant: str, rights: frozenset[str] = frozenset({"read", "write"})) -> str:
        return api_tokens.create(store_settings.data_dir / "tenants.json", tenant, rights)[1]

    return make
