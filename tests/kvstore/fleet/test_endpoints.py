"""The [fleet] settings: endpoints and cluster names checked at load, off by default, the advertised address."""

from __future__ import annotations

import socket

import pytest

from kvstore.config import Settings, load_settings
from kvstore.config_sections import FleetSettings
from kvstore.errors import ConfigError
from kvstore.fleet.endpoints import Endpoint, node_key, nodes_prefix, parse_endpoints
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
    ("https://10.0.0.5:2379", "only http://"), ("10.0.0.5:2379/v3", "is not host:port"), ("a b:1", "is not host:port"),
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
