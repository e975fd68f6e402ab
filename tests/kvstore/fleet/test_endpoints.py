"""The [fleet] settings: endpoints and cluster names checked at load, off by default, the advertised address."""

from __future__ import annotations

import socket

import pytest

from kvstore.config import Settings, load_settings
from kvstore.config_sections import FleetSettings
from kvstore.errors import ConfigError
from kvstore.fleet.endpoints import Endpoint, EtcdTls, endpoints_use_tls, node_key, nodes_prefix, parse_endpoints
from kvstore.fleet.membership import advertised_address


def test_the_fleet_is_off_by_default() -> None:
    assert not Settings().fleet.enabled and not FleetSettings(etcd=" , ").enabled
    assert load_settings(environ={"KVSTORE_FLEET_ETCD": "127.0.0.1:2379"}).fleet.enabled


def test_endpoints_parse() -> None:
    assert parse_endpoints("10.0.0.5:2379, http://etcd-1.etcd:2380/,[::1]:2379") == (
        Endpoint(host="10.0.0.5", port=2379), Endpoint(host="etcd-1.etcd", port=2380),
        Endpoint(host="[::1]", port=2379))
    assert parse_endpoints("") == ()


@pytest.mark.parametrize(("etcd", "match"), [
    ("10.0.0.5", "is not host:port"), ("10.0.0.5:0", "is not host:port"), ("10.0.0.5:70000", "is not host:port"),
    ("grpc://10.0.0.5:2379", "http:// .plaintext gRPC. or https://"), ("10.0.0.5:2379/v3", "is not host:port"),
    ("a b:1", "is not host:port"),
])
def test_a_bad_endpoint_is_refused_at_load(etcd: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_settings(environ={"KVSTORE_FLEET_ETCD": etcd})


@pytest.mark.parametrize("cluster", ["", "a/b", "-x", "x" * 64, "é"])
def test_a_cluster_name_is_one_key_segment(cluster: str) -> None:
    with pytest.raises(ConfigError, match=r"fleet\.cluster"):
        FleetSettings(cluster=cluster)


def test_keys_of_a_cluster() -> None:
    assert nodes_prefix("prod") == b"/kvstore/prod/nodes/"
    assert node_key("prod", "ab12") == b"/kvstore/prod/nodes/ab12"


def test_the_advertised_address() -> None:
    assert advertised_address(FleetSettings(), "10.1.2.3", 50051) == "10.1.2.3:50051"
    assert advertised_address(FleetSettings(), "0.0.0.0", 50051) == f"{socket.getfqdn()}:50051"
    assert advertised_address(FleetSettings(advertise="kv-3.kv:50051"), "0.0.0.0", 1) == "kv-3.kv:50051"


def test_f57_https_endpoints_or_an_etcd_file_turn_tls_to_etcd_on() -> None:
    """F57: https:// on every endpoint, or any etcd_* file, is TLS to etcd; plain endpoints and no file, none."""
    assert parse_endpoints("https://10.0.0.5:2379,https://h:2380") == (Endpoint(host="10.0.0.5", port=2379),
                                                                       Endpoint(host="h", port=2380))
    assert endpoints_use_tls("https://a:1, https://b:2") and not endpoints_use_tls("a:1,http://b:2")
    assert FleetSettings(etcd="https://a:1").etcd_tls == EtcdTls()
    assert FleetSettings(etcd="a:1", etcd_ca_file="/ca.pem").etcd_tls == EtcdTls(ca_file="/ca.pem")
    assert FleetSettings(etcd="a:1").etcd_tls is None
    env = {"KVSTORE_FLEET_ETCD": "https://a:1", "KVSTORE_FLEET_ETCD_CERT_FILE": "/c.pem",
           "KVSTORE_FLEET_ETCD_KEY_FILE": "/k.pem"}
    assert load_settings(environ=env).fleet.etcd_tls == EtcdTls(cert_file="/c.pem", key_file="/k.pem")


@pytest.mark.parametrize(("fields", "match"), [
    ({"etcd": "https://a:1,b:2"}, "mixes https:// with plaintext"),
    ({"etcd": "a:1", "etcd_cert_file": "/c.pem"}, "a client certificate and its key together"),
    ({"etcd": "a:1", "etcd_key_file": "/k.pem"}, "a client certificate and its key together"),
])
def test_f57_a_half_tls_setting_is_refused_at_load(fields: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_settings(environ={f"KVSTORE_FLEET_{name.upper()}": value for name, value in fields.items()})


def test_f57_an_unreadable_tls_file_is_named() -> None:
    with pytest.raises(ConfigError, match=r"the etcd TLS CA file '/nonexistent/ca\.pem' cannot be read"):
        EtcdTls(ca_file="/nonexistent/ca.pem").credentials()
