"""The metrics endpoint's bind rule (gateway.auth.check_metrics_bind): plain HTTP without tokens that
names every tenant, so beyond loopback only with `metrics.insecure` (or `auth.insecure`), on real servers."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.config import AuthSettings, MetricsSettings, ServerSettings, StoreSettings, TlsSettings
from kvstore.errors import ConfigError
from tests.children import write_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(server: Any) -> str:
    """The endpoint's page, read on loopback."""
    port = server.metrics_endpoint.url.rsplit(":", 1)[1].split("/")[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        return str(reply.read().decode())


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "metrics.example"])
def test_metrics_beyond_loopback_are_refused(start_server: Callable[..., Any], store_settings: StoreSettings,
                                             host: str) -> None:
    with pytest.raises(ConfigError, match=r"refusing to serve metrics on .* \(metrics\.host\) over plain HTTP"):
        start_server(store_settings, metrics=MetricsSettings(host=host, port=_free_port()))
    assert not (store_settings.data_dir / "data.mdb").exists()  # refused before the store was opened


def test_tokens_and_tls_on_the_grpc_port_do_not_open_the_metrics(start_server: Callable[..., Any],
                                                                 store_settings: StoreSettings, certs: Any) -> None:
    api_tokens.create(store_settings.data_dir / "tenants.json", "acme", frozenset({"read"}))
    tls = TlsSettings(cert_file=str(certs.server.cert), key_file=str(certs.server.key))
    with pytest.raises(ConfigError, match=r"refusing to serve metrics on 0\.0\.0\.0") as refused:
        start_server(store_settings, server=ServerSettings(host="0.0.0.0", port=0), tls=tls,
                     metrics=MetricsSettings(host="0.0.0.0", port=_free_port()))
    assert "metrics.insecure" in refused.value.hint


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_metrics_on_loopback_are_served(start_server: Callable[..., Any], store_settings: StoreSettings,
                                        host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    server = start_server(store_settings, metrics=MetricsSettings(host=host, port=_free_port()))
    if host != "::1":
        assert "kvstore_store_blocks" in scrape(server)


@pytest.mark.parametrize("insecure", ["metrics", "auth"])
def test_insecure_serves_metrics_beyond_loopback(start_server: Callable[..., Any], store_settings: StoreSettings,
                                                 insecure: str) -> None:
    metrics = MetricsSettings(host="0.0.0.0", port=_free_port(), insecure=insecure == "metrics")
    server = start_server(store_settings, metrics=metrics, auth=AuthSettings(insecure=insecure == "auth"))
    assert "kvstore_store_blocks" in scrape(server)


def test_metrics_off_are_not_checked(start_server: Callable[..., Any], store_settings: StoreSettings) -> None:
    server = start_server(store_settings, metrics=MetricsSettings(host="0.0.0.0", port=0))  # port 0: off
    assert server.metrics_endpoint is None


def test_serve_refuses_in_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path / "kvstore.toml", {"metrics": {"host": "0.0.0.0", "port": _free_port()}})
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir",
                           str(tmp_path / "data"), "--config", str(config)],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("kvstore: ConfigError: refusing to serve metrics on 0.0.0.0:") and "metrics.insecure" in line
