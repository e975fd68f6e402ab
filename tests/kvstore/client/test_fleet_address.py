"""The fleet address (`etcd://HOST:PORT[,...][/CLUSTER]`) and a chain's fleet hashes: pure functions."""

from __future__ import annotations

import pytest

from kvstore.client.fleet_address import is_fleet_address, parse_fleet_address
from kvstore.client.fleet_chain import BRIDGE_TAG, fleet_hashes, run_extra_keys
from kvstore.errors import InvalidArgument
from kvstore.fleet.endpoints import EtcdAuth, EtcdTls
from kvstore.prefix import chain_hashes, root_hash

ROOT = root_hash(bytes(8), 4)


def test_an_etcd_address_names_endpoints_and_cluster() -> None:
    address = parse_fleet_address("etcd://127.0.0.1:2379,10.0.0.6:2381/prod")
    assert [str(e) for e in address.endpoints] == ["127.0.0.1:2379", "10.0.0.6:2381"]
    assert address.cluster == "prod" and str(address) == "etcd://127.0.0.1:2379,10.0.0.6:2381/prod"
    assert parse_fleet_address("etcd://localhost:2379").cluster == "default"
    assert parse_fleet_address("etcd://[::1]:2379/").cluster == "default"
    assert is_fleet_address("etcd://h:1") and not is_fleet_address("127.0.0.1:50051") and not is_fleet_address(5)


@pytest.mark.parametrize("bad", ["etcd://", "etcd://host", "etcd://host:0/c", "etcd://h:1/two/parts",
                                 "etcd://h:1/-x", "etcd://http://h:1/c", "127.0.0.1:1"])
def test_a_bad_fleet_address_is_refused_naming_the_syntax(bad: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        parse_fleet_address(bad)
    assert "etcd://HOST:PORT" in refused.value.hint


def test_f57_an_etcds_address_is_tls_to_etcd_with_the_files_its_query_names() -> None:
    plain = parse_fleet_address("etcds://10.0.0.5:2379/prod")
    assert plain.tls == EtcdTls() and str(plain) == "etcds://10.0.0.5:2379/prod" and is_fleet_address(str(plain))
    full = parse_fleet_address("etcds://a:1,b:2/prod?ca_file=/etc/ca.pem&cert_file=/c.pem&key_file=/k%20.pem")
    assert full.tls == EtcdTls(ca_file="/etc/ca.pem", cert_file="/c.pem", key_file="/k .pem")
    assert [str(e) for e in full.endpoints] == ["a:1", "b:2"] and full.cluster == "prod"
    assert parse_fleet_address(str(full)) == full
    assert parse_fleet_address("etcds://a:1?ca_file=/ca.pem").cluster == "default"
    assert parse_fleet_address("etcd://a:1/prod").tls is None


@pytest.mark.parametrize(("bad", "match"), [
    ("etcd://a:1/prod?ca_file=/ca.pem", "TLS files only an etcds:// address takes"),
    ("etcds://a:1/prod?password=x", "query names password"),
    ("etcds://a:1/prod?ca_file=/a&ca_file=/b", "one name twice"),
    ("etcds://a:1/prod?cert_file=/c.pem", "a client certificate and its key together"),
    ("etcds://a:1/prod?junk", "fleet address"),
])
def test_f57_a_bad_etcds_query_is_refused_naming_what_it_takes(bad: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match) as refused:
        parse_fleet_address(bad)
    assert "etcds://" in refused.value.hint


def test_f70_either_scheme_takes_an_etcd_user_and_its_password_file() -> None:
    """F70: ?user=NAME&password_file=PATH on etcd:// and etcds:// (beside the TLS files); never a password."""
    plain = parse_fleet_address("etcd://a:1/prod?user=kvnode&password_file=/etc/kv/etcd%20pw")
    assert plain.auth == EtcdAuth(user="kvnode", password_file="/etc/kv/etcd pw") and plain.tls is None
    assert parse_fleet_address(str(plain)) == plain and str(plain).startswith("etcd://a:1/prod?user=kvnode&")
    both = parse_fleet_address("etcds://a:1/prod?ca_file=/ca.pem&user=kvnode&password_file=/pw")
    assert both.tls == EtcdTls(ca_file="/ca.pem") and both.auth == EtcdAuth(user="kvnode", password_file="/pw")
    assert parse_fleet_address(str(both)) == both
    assert parse_fleet_address("etcd://a:1/prod").auth is None


@pytest.mark.parametrize(("bad", "match"), [
    ("etcd://a:1/prod?user=kvnode", "a user and a password file together"),
    ("etcd://a:1/prod?password_file=/pw", "a user and a password file together"),
    ("etcd://a:1/prod?user=kvnode&password=secret", "query names password: an etcd:// query"),
    ("etcds://a:1/prod?user=a&user=b&password_file=/pw", "one name twice"),
])
def test_f70_a_bad_user_query_is_refused_naming_what_it_takes(bad: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match) as refused:
        parse_fleet_address(bad)
    assert "user=NAME&password_file=PATH" in refused.value.hint


def test_f29_run_0_hashes_as_one_server_and_later_runs_bridge_to_the_prefix() -> None:
    """F29: one chain per run, bound to the prefix before it."""
    tokens = list(range(4 * 3 * 3 + 2))  # 3 runs of 3 blocks of 4 tokens, and a partial block
    chain = fleet_hashes(tokens, root=ROOT, block_tokens=4, run_blocks=3, extra_keys=["k"])
    assert len(chain) == 9
    assert chain[:3] == chain_hashes(tokens[:12], block_tokens=4, parent=ROOT, extra_keys=["k"])
    assert chain[3:6] == chain_hashes(tokens[12:24], block_tokens=4, parent=ROOT,
                                      extra_keys=["k", BRIDGE_TAG + chain[2]])
    assert run_extra_keys(["k"], None) == ["k"]
    other = fleet_hashes([99, *tokens[1:]], root=ROOT, block_tokens=4, run_blocks=3, extra_keys=["k"])
    assert all(a != b for a, b in zip(chain, other, strict=True))  # a token of run 0 changes every later run
    same_tail = fleet_hashes(tokens[:30], root=ROOT, block_tokens=4, run_blocks=3, extra_keys=["k"])
    assert same_tail == chain[:7]  # a prefix of the prompt hashes as a prefix of the chain
