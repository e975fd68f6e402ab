"""TLS and mutual TLS on a real server on loopback, with certificates made for the test (conftest `certs`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.client import Client, TlsOptions
from kvstore.config import ServerSettings, StoreSettings, TlsSettings
from kvstore.errors import ConfigError, InvalidArgument, KVStoreError, Unauthenticated


def tls_server(start_server: Callable[..., Any], store: StoreSettings, certs: Any, *, mutual: bool = False,
               host: str = "127.0.0.1") -> Any:
    tls = TlsSettings(cert_file=str(certs.server.cert), key_file=str(certs.server.key),
                      client_ca_file=str(certs.ca.cert) if mutual else "")
    return start_server(store, server=ServerSettings(host=host, port=0), tls=tls)


def works(target: str, **kwargs: Any) -> bool:
    try:
        with Client(target, timeout_s=5, **kwargs) as client:
            client.lookup(list(range(16)))
        return True
    except KVStoreError:
        return False


def test_tls_handshake_with_the_servers_ca(start_server: Callable[..., Any], store_settings: StoreSettings,
                                           certs: Any) -> None:
    server = tls_server(start_server, store_settings, certs)
    assert works(server.target, tls=TlsOptions(ca_file=str(certs.ca.cert)))
    assert works(f"localhost:{server.port}", tls=TlsOptions(ca_file=str(certs.ca.cert)))


def test_tls_refuses_plaintext_and_an_untrusted_server(start_server: Callable[..., Any],
                                                       store_settings: StoreSettings, certs: Any) -> None:
    server = tls_server(start_server, store_settings, certs)
    assert not works(server.target)  # plaintext to a TLS port
    assert not works(server.target, tls=TlsOptions(ca_file=str(certs.other_ca.cert)))  # not the server's CA
    # A name the certificate does not hold fails too; the right override passes.
    assert not works(server.target, tls=TlsOptions(ca_file=str(certs.ca.cert), server_name="elsewhere"))
    assert works(server.target, tls=TlsOptions(ca_file=str(certs.ca.cert), server_name="localhost"))


def test_mutual_tls_needs_a_client_certificate_of_the_ca(start_server: Callable[..., Any],
                                                         store_settings: StoreSettings, certs: Any) -> None:
    server = tls_server(start_server, store_settings, certs, mutual=True)
    ca = str(certs.ca.cert)
    assert works(server.target, tls=TlsOptions(ca_file=ca, cert_file=str(certs.client.cert),
                                               key_file=str(certs.client.key)))
    assert not works(server.target, tls=TlsOptions(ca_file=ca))  # no client certificate
    assert not works(server.target, tls=TlsOptions(ca_file=ca, cert_file=str(certs.other_client.cert),
                                                   key_file=str(certs.other_client.key)))


def test_tokens_over_tls_beyond_loopback_start(start_server: Callable[..., Any], store_settings: StoreSettings,
                                               certs: Any) -> None:
    token = api_tokens.create(store_settings.data_dir / "tenants.json", "acme", frozenset({"read", "write"}))[1]
    server = tls_server(start_server, store_settings, certs, host="0.0.0.0")  # auth and TLS: allowed
    tls = TlsOptions(ca_file=str(certs.ca.cert))
    assert works(server.target, tls=tls, token=token)
    with pytest.raises(Unauthenticated):
        Client(server.target, tls=tls)


def test_tls_without_tokens_beyond_loopback_is_refused(start_server: Callable[..., Any],
                                                       store_settings: StoreSettings, certs: Any) -> None:
    with pytest.raises(ConfigError, match="without auth"):
        tls_server(start_server, store_settings, certs, host="0.0.0.0")


def test_unreadable_certificates_are_named(start_server: Callable[..., Any], store_settings: StoreSettings,
                                           tmp_path: Path, certs: Any) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError, match=r"tls\.cert_file"):
        start_server(store_settings, tls=TlsSettings(cert_file=missing, key_file=str(certs.server.key)))
    with pytest.raises(ConfigError, match="go together"):
        TlsSettings(cert_file=str(certs.server.cert))
    with pytest.raises(InvalidArgument, match=r"tls\.ca_file"):
        Client("127.0.0.1:1", tls=TlsOptions(ca_file=missing))
