"""`kvstore health`, the container probe, against real servers (plaintext and TLS; certificates from conftest)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.config import ServerSettings, StoreSettings, TlsSettings


def health(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["health", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_serving_server_is_exit_0(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = health(capsys, "--target", server.target)
    assert (code, out["status"]) == (0, "SERVING")


def test_an_unknown_service_is_exit_1(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = health(capsys, "--target", server.target, "--service", "no.such.Service")
    assert (code, out["status"]) == (1, "SERVICE_UNKNOWN")


def test_a_server_that_cannot_be_asked_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = health(capsys, "--target", "127.0.0.1:1", "--timeout", "2")
    assert code == 2 and out["error"]["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_over_tls_with_the_servers_ca(start_server: Callable[..., Any], store_settings: StoreSettings, certs: Any,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    tls = TlsSettings(cert_file=str(certs.server.cert), key_file=str(certs.server.key))
    server = start_server(store_settings, server=ServerSettings(port=0), tls=tls)
    code, out = health(capsys, "--target", server.target, "--tls-ca", str(certs.ca.cert))
    assert (code, out["status"]) == (0, "SERVING")
    code, out = health(capsys, "--target", server.target, "--timeout", "2")  # plaintext to a TLS port
    assert code == 2
