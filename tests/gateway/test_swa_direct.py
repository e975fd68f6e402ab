"""The SWA direct path on a real server over a real redis-server, with tenants from kvstore.api_tokens.

Each tenant's Redis user is confined to its own keys and commands (Redis answers
NOPERM), rotated and deleted on time, and the client falls back to the gateway
(or misses) when Redis is gone; direct puts and gets are the same records as
the gateway's, and are counted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError

from kvstore import api_tokens
from kvstore.client import Client, SwaClient, swa_direct
from kvstore.client.admin import AdminClient
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings, SwaSettings
from kvstore.errors import Unavailable
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc
from tests.waiting import wait_until

RW = frozenset({"read", "write"})
TOKENS = list(range(64))


def redis_settings(redis_server: Any, **kwargs: Any) -> SwaSettings:
    return SwaSettings(backend="redis", redis_url=redis_server.url, cap_bytes=256 << 20, **kwargs)


def open_direct(client: Client) -> pb.SwaOpenDirectResponse:
    stub = pb_grpc.SwaPoolStub(client.connection.channel)
    reply: pb.SwaOpenDirectResponse = client.connection.call(stub.OpenDirect, pb.SwaOpenDirectRequest())
    return reply


def as_user(redis_server: Any, grant: pb.SwaOpenDirectResponse) -> redis.Redis:
    return redis.Redis(port=redis_server.port, username=grant.username, password=grant.password)


def swa(client: Client, path: str, clock: Callable[[], float] = time.monotonic) -> SwaClient:
    return SwaClient(client.connection, path=path, clock=clock)


def snapshot(client: Client, position: int = len(TOKENS)) -> bytes:
    return os.urandom(client.swa.snapshot_bytes(position))


@pytest.fixture
def two_tenants(start_server: Callable[..., Any], store_settings: StoreSettings,
                redis_server: Any) -> Iterator[tuple[Client, Client, str]]:
    """Clients of tenants A and B (read and write) on a Redis-backed server, and an admin token."""
    path = store_settings.data_dir / "tenants.json"
    a_token = api_tokens.create(path, "tenant-a", RW)[1]
    b_token = api_tokens.create(path, "tenant-b", RW)[1]
    admin_token = api_tokens.create(path, "ops", frozenset({"read", "write", "admin"}))[1]
    server = start_server(store_settings, swa=redis_settings(redis_server))
    a, b = Client(server.target, token=a_token), Client(server.target, token=b_token)
    yield a, b, admin_token
    a.close()
    b.close()


def test_a_tenants_redis_user_reaches_its_own_keys_only_and_no_other_command(
        two_tenants: tuple[Client, Client, str], redis_server: Any) -> None:
    a, b, _ = two_tenants
    grant_a, grant_b = open_direct(a), open_direct(b)
    assert grant_a.offered and grant_a.writable and grant_a.tenant == "tenant-a" and grant_b.tenant == "tenant-b"
    assert grant_a.key_prefix != grant_b.key_prefix and grant_a.username != grant_b.username
    a_key, b_key = grant_a.key_prefix + b"x", grant_b.key_prefix + b"x"
    with as_user(redis_server, grant_a) as ra:
        assert ra.ping()
        assert ra.set(a_key, b"1", px=1000) and ra.get(a_key) == b"1" and ra.exists(a_key) == 1
        for forbidden in (lambda: ra.get(b_key), lambda: ra.set(b_key, b"1"), lambda: ra.get(b"other"),
                          lambda: ra.keys("*"), lambda: ra.scan(0), lambda: ra.flushall(), lambda: ra.flushdb(),
                          lambda: ra.config_get("maxmemory"), lambda: ra.acl_list(), lambda: ra.delete(a_key),
                          lambda: ra.execute_command("ACL", "SETUSER", grant_a.username, "+@all"),
                          lambda: ra.setrange(b_key, 0, b"2"), lambda: ra.setrange(b"other", 0, b"2"),
                          lambda: ra.execute_command("MULTI"), lambda: ra.execute_command("WATCH", a_key),
                          lambda: ra.append(a_key, b"2"), lambda: ra.getrange(b_key, 0, 1)):
            with pytest.raises(NoPermissionError):
                forbidden()


def test_a_writer_may_seal_and_rename_its_own_records_and_no_other_tenants(
        two_tenants: tuple[Client, Client, str], redis_server: Any) -> None:
    """SETRANGE and RENAME (a streamed put seals a temporary key and renames it into place) are a
    writer's on its own keys only: naming another tenant's key, as source or target, is refused and
    changes nothing."""
    a, b, _ = two_tenants
    grant_a, grant_b = open_direct(a), open_direct(b)
    a_key, a_temp, b_key = grant_a.key_prefix + b"x", grant_a.key_prefix + b"x~w", grant_b.key_prefix + b"x"
    with redis.Redis(port=redis_server.port) as raw:
        raw.set(b_key, b"tenant b")
    with as_user(redis_server, grant_a) as ra:
        assert ra.set(a_temp, b"....data", px=60_000) and ra.setrange(a_temp, 0, b"head") == 8
        assert ra.rename(a_temp, a_key) and ra.get(a_key) == b"headdata" and 0 < ra.pttl(a_key) <= 60_000
        for forbidden in (lambda: ra.rename(a_key, b_key), lambda: ra.rename(b_key, a_temp),
                          lambda: ra.rename(a_key, b"other"), lambda: ra.setrange(b_key, 0, b"head"),
                          lambda: ra.execute_command("RENAMENX", a_key, a_temp), lambda: ra.copy(a_key, a_temp)):
            with pytest.raises(NoPermissionError):
                forbidden()
        assert ra.get(a_key) == b"headdata"
    with redis.Redis(port=redis_server.port) as raw:
        assert raw.get(b_key) == b"tenant b" and raw.exists(b"other") == 0


@pytest.mark.parametrize("cpus", [2, 16])
def test_a_direct_put_is_seen_by_a_gateway_get_and_vice_versa(two_tenants: tuple[Client, Client, str],
                                                              monkeypatch: pytest.MonkeyPatch, cpus: int) -> None:
    """On two CPUs the put checksums each piece after sending it, on sixteen on a worker thread beside
    the send (kvstore.client.swa_put): either way the gateway opens the record it stored."""
    monkeypatch.setattr(swa_direct, "usable_cpus", lambda: cpus)
    a, _, _ = two_tenants
    direct, gateway = swa(a, "direct"), swa(a, "gateway")
    first, second = snapshot(a), snapshot(a, 63)
    assert direct.put(TOKENS, first).stored == 1 and direct.last_path == "direct"
    assert isinstance(direct._direct, swa_direct.DirectPath) and direct._direct.overlap is (cpus >= 4)
    assert gateway.get(TOKENS) == first and gateway.last_path == "gateway"
    assert gateway.put(TOKENS[:63], second).stored == 1
    assert direct.get(TOKENS[:63]) == second and direct.last_path == "direct"
    assert a.swa.get(TOKENS) == first and a.swa.last_path == "direct"  # "auto" goes direct when offered


def test_another_tenant_never_sees_a_direct_put(two_tenants: tuple[Client, Client, str]) -> None:
    a, b, _ = two_tenants
    data = snapshot(a)
    assert swa(a, "direct").put(TOKENS, data).stored == 1
    assert swa(b, "direct").get(TOKENS) is None and swa(b, "gateway").get(TOKENS) is None


def test_direct_gets_are_counted_as_hits(start_server: Callable[..., Any], store_settings: StoreSettings,
                                         redis_server: Any) -> None:
    server = start_server(store_settings, swa=redis_settings(redis_server))
    with Client(server.target) as client:
        direct = swa(client, "direct")
        direct.put(TOKENS, snapshot(client))
        assert direct.get_many([direct.key(TOKENS), direct.key(TOKENS, 10)]) == [direct.get(TOKENS), None]
        stats = direct.stats()  # reports the pending gets first
        assert (stats.gets, stats.snapshots_asked, stats.hits, stats.snapshots_put) == (2, 3, 2, 1)
        hits = next(t.windows for t in client.stats().tenants if t.tenant == "default")
        counts = next(w.counts for w in hits if w.window == "5m")
        assert (counts.swa_gets, counts.swa_snapshots_asked, counts.swa_snapshots_found) == (2, 3, 2)


def test_closing_the_client_reports_the_direct_gets_still_pending(start_server: Callable[..., Any],
                                                                   store_settings: StoreSettings,
                                                                   redis_server: Any) -> None:
    server = start_server(store_settings, swa=redis_settings(redis_server))
    with Client(server.target) as client:
        client.swa.put(TOKENS, snapshot(client))
        assert client.swa.get(TOKENS) is not None and client.swa.last_path == "direct"
    with Client(server.target) as admin:  # the first client's report went out at its close
        hits = next(t.windows for t in admin.stats().tenants if t.tenant == "default")
        assert next(w.counts for w in hits if w.window == "5m").swa_snapshots_found == 1


def test_a_tenant_with_a_byte_quota_reads_directly_and_writes_through_the_gateway_under_its_ttl(
        two_tenants: tuple[Client, Client, str], redis_server: Any) -> None:
    a, _, admin_token = two_tenants
    with AdminClient(a.target, token=admin_token) as admin:
        admin.set_policy("tenant-a", swa_quota_bytes=1 << 30, swa_ttl_s=5.0)
    grant = open_direct(a)
    assert grant.offered and not grant.writable and grant.ttl_ms == 5000
    with as_user(redis_server, grant) as ra:
        key = grant.key_prefix + b"x"
        for write in (lambda: ra.set(key, b"1"), lambda: ra.setrange(key, 0, b"1"),
                      lambda: ra.rename(key, key + b"~w")):
            with pytest.raises(NoPermissionError):
                write()
    auto = swa(a, "auto")
    data = snapshot(a)
    assert auto.put(TOKENS, data).stored == 1 and auto.last_path == "gateway"  # charged to the ledger
    assert auto.get(TOKENS) == data and auto.last_path == "direct"


def test_the_direct_ttl_is_the_tenants(two_tenants: tuple[Client, Client, str], redis_server: Any) -> None:
    a, _, admin_token = two_tenants
    with AdminClient(a.target, token=admin_token) as admin:
        admin.set_policy("tenant-a", swa_ttl_s=5.0)
    direct = swa(a, "direct")
    assert direct.put(TOKENS, snapshot(a)).ttl_ms == 5000
    grant = open_direct(a)
    with redis.Redis(port=redis_server.port) as raw:
        assert 0 < raw.pttl(grant.key_prefix + a.fingerprint + direct.key(TOKENS)) <= 5000


def test_users_rotate_at_half_life_and_the_old_one_is_deleted_after_its_grace(
        start_server: Callable[..., Any], store_settings: StoreSettings, redis_server: Any,
        clock: ManualClock) -> None:
    server = start_server(store_settings, swa=redis_settings(redis_server, direct_user_lifetime_s=10.0))
    with Client(server.target) as client:
        first = open_direct(client)
        assert first.expires_in_ms == 10_000 and first.renew_after_ms == 5_000
        assert open_direct(client).username == first.username  # before half-life: the same user
        clock.advance(6)
        second = open_direct(client)
        assert second.username != first.username and second.password != first.password
        with as_user(redis_server, first) as old:
            assert old.ping()  # the grace: the old user works until its lifetime ends
        clock.advance(5)  # first is 11 s old: deleted by the next sweep (within REAP_INTERVAL_S)

        def refused() -> bool:
            with as_user(redis_server, first) as old:
                try:
                    old.ping()
                except AuthenticationError:
                    return True
            return False

        wait_until(refused, "the expired user still authenticates")
        with as_user(redis_server, second) as new:
            assert new.ping()


def test_a_client_whose_user_was_deleted_reopens_and_stays_direct(
        start_server: Callable[..., Any], store_settings: StoreSettings, redis_server: Any,
        clock: ManualClock) -> None:
    server = start_server(store_settings, swa=redis_settings(redis_server, direct_user_lifetime_s=10.0))
    with Client(server.target) as client:
        direct = swa(client, "direct")  # its own clock: it never renews by itself here
        data = snapshot(client)
        direct.put(TOKENS, data)
        clock.advance(11)  # the gateway deletes its user (and closes its connections)

        def deleted() -> bool:
            with as_user(redis_server, open_direct(client)) as probe:
                probe.ping()
            with redis.Redis(port=redis_server.port) as admin:
                return len(admin.acl_users()) <= 2  # default + the probe's new user: the client's was deleted

        wait_until(deleted, "the client's expired user was never deleted")
        assert direct.get(TOKENS) == data and direct.last_path == "direct"


def test_redis_down_falls_back_to_the_gateway_or_misses_never_a_redis_error(
        start_server: Callable[..., Any], store_settings: StoreSettings, redis_server: Any) -> None:
    server = start_server(store_settings, swa=redis_settings(redis_server, socket_timeout_s=5.0))
    now = [0.0]
    with Client(server.target) as client:
        auto, direct = swa(client, "auto", lambda: now[0]), swa(client, "direct", lambda: now[0])
        data = snapshot(client)
        assert auto.put(TOKENS, data).stored == 1 and auto.last_path == "direct"
        redis_server.stop()
        assert auto.get(TOKENS) is None and auto.last_path == "gateway"  # the gateway misses too
        assert auto.put(TOKENS, data).failed == 1 and auto.last_path == "gateway"
        assert "cannot be reached" in auto.direct_reason or "unreachable" in auto.direct_reason
        with pytest.raises(Unavailable):
            direct.get(TOKENS)
        redis_server.start()  # a restarted Redis forgets the users: the gateway sets them again
        now[0] += 10  # past RETRY_DIRECT_S
        assert auto.put(TOKENS, data).stored == 1 and auto.last_path == "direct"
        assert auto.get(TOKENS) == data and auto.last_path == "direct"


def test_the_memory_pool_offers_shared_memory_not_redis(client: Client) -> None:
    reply = open_direct(client)
    assert reply.offered and reply.shm_socket and len(reply.shm_ticket) == 32
    assert not reply.redis_url and not reply.username and not reply.password and not reply.cluster_nodes
    data = snapshot(client)
    assert client.swa.put(TOKENS, data).stored == 1 and client.swa.last_path == "shm"
    assert swa(client, "direct").get(TOKENS) == data


def test_a_client_naming_another_tenants_namespace_stays_on_the_gateway(
        two_tenants: tuple[Client, Client, str]) -> None:
    """The direct user is the token's tenant's: an admin naming tenant A's namespace must not write its own keys."""
    a, _, admin_token = two_tenants
    with Client(a.target, token=admin_token, namespace="tenant-a") as admin:
        data = snapshot(admin)
        assert admin.swa.put(TOKENS, data).stored == 1 and admin.swa.last_path == "gateway"
        assert "namespace 'tenant-a'" in admin.swa.direct_reason
    assert swa(a, "direct").get(TOKENS) == data


def test_the_client_asks_for_a_newer_user_at_half_life(start_server: Callable[..., Any],
                                                       store_settings: StoreSettings, redis_server: Any,
                                                       clock: ManualClock) -> None:
    server = start_server(store_settings, swa=redis_settings(redis_server, direct_user_lifetime_s=10.0))
    with Client(server.target) as client:
        direct = swa(client, "direct", clock.monotonic)  # the client's clock moves with the gateway's
        data = snapshot(client)
        direct.put(TOKENS, data)
        first = direct._direct.username if direct._direct else None
        clock.advance(6)
        assert direct.get(TOKENS) == data and direct.last_path == "direct"
        assert direct._direct is not None and direct._direct.username != first


def test_on_a_redis_cluster_the_user_is_confined_on_every_node_and_shares_the_gateways_records(
        start_server: Callable[..., Any], store_settings: StoreSettings, redis_cluster: Any) -> None:
    server = start_server(store_settings, swa=SwaSettings(backend="redis-cluster", cap_bytes=256 << 20,
                                                          cluster_nodes=redis_cluster.startup_nodes))
    with Client(server.target) as client:
        grant = open_direct(client)
        assert grant.offered and grant.cluster_nodes and not grant.redis_url
        direct, gateway = swa(client, "direct"), swa(client, "gateway")
        datas = {t: snapshot(client, t) for t in range(40, 64)}  # keys over many slots, so every node
        assert direct.put_many([(direct.key(TOKENS, t), t, d) for t, d in datas.items()]).stored == len(datas)
        assert gateway.get_many([gateway.key(TOKENS, t) for t in datas]) == list(datas.values())
        newer = snapshot(client, 62)
        gateway.put(TOKENS, newer, position=62)
        assert direct.get(TOKENS, 62) == newer and direct.last_path == "direct"
        for node in redis_cluster.nodes:
            with redis.Redis(port=node.port, username=grant.username, password=grant.password) as r:
                assert r.ping()
                for forbidden in (lambda r=r: r.keys("*"), lambda r=r: r.flushall(),
                                  lambda r=r: r.config_get("maxmemory"), lambda r=r: r.acl_list(),
                                  lambda r=r: r.get(b"kvstore:swa:other")):
                    with pytest.raises(NoPermissionError):
                        forbidden()


def test_a_redis_that_forbids_acl_offers_no_direct_path_and_the_gateway_serves(
        start_server: Callable[..., Any], store_settings: StoreSettings, tmp_path: Any) -> None:
    from kvstore.bench.redis_server import RedisServer, redis_server_path

    if redis_server_path() is None:
        pytest.skip("redis-server is not on PATH")
    managed = RedisServer(tmp_path / "managed", extra_args=("--rename-command", "ACL", '""')).start()
    try:
        server = start_server(store_settings, swa=redis_settings(managed))
        with Client(server.target) as client:
            reply = open_direct(client)
            assert not reply.offered and "refused ACL" in reply.reason
            data = snapshot(client)
            assert client.swa.put(TOKENS, data).stored == 1 and client.swa.get(TOKENS) == data
            assert client.swa.last_path == "gateway"
    finally:
        managed.stop()


def test_direct_false_offers_no_direct_path(start_server: Callable[..., Any], store_settings: StoreSettings,
                                            redis_server: Any) -> None:
    server = start_server(store_settings, swa=redis_settings(redis_server, direct=False))
    with Client(server.target) as client:
        assert not open_direct(client).offered
        assert redis.Redis(port=redis_server.port).acl_users() == ["default"]


def test_a_value_over_the_largest_record_is_a_counted_miss_and_the_batch_goes_on(
        two_tenants: tuple[Client, Client, str], redis_server: Any) -> None:
    """A tenant's writer may SET anything under its prefix: a direct reader misses a value longer than the
    largest record (read and dropped, never kept: test_swa_resp), counts it corrupt and serves the rest."""
    a, _, admin_token = two_tenants
    direct = swa(a, "direct")
    data = snapshot(a, 63)
    direct.put(TOKENS[:63], data)
    grant = open_direct(a)
    with as_user(redis_server, grant) as ra:
        ra.set(grant.key_prefix + a.fingerprint + direct.key(TOKENS), os.urandom(grant.max_record_bytes + 1))
    assert direct.get_many([direct.key(TOKENS), direct.key(TOKENS[:63])]) == [None, data]
    assert direct.last_path == "direct"
    direct.flush_report()
    with Client(a.target, token=admin_token) as admin:  # the pool's counters are the operator's to read
        assert admin.swa.stats().corrupt == 1


def test_a_due_report_goes_out_without_waiting_and_a_failed_one_is_sent_again(
        start_server: Callable[..., Any], store_settings: StoreSettings, redis_server: Any) -> None:
    """Rule 5: a report due during a get is sent as a gRPC future (the get does not wait for it); one
    that fails is sent again under its id (counted once, whether or not the gateway got it the first
    time: test_swa_reports.py), then the newer counts."""
    server = start_server(store_settings, swa=redis_settings(redis_server))
    now = [0.0]
    with Client(server.target) as client:
        direct = swa(client, "direct", lambda: now[0])
        direct.put(TOKENS, snapshot(client))
        key = direct.key(TOKENS)
        assert direct.get_many([key])[0] is not None and direct.last_path == "direct"
        now[0] += 2  # a report is due at the next call...
        timeout_s, client.connection.timeout_s = client.connection.timeout_s, 1e-6  # ...and will miss its deadline
        assert direct.get_many([key, direct.key(TOKENS, 10)])[0] is not None
        client.connection.timeout_s = timeout_s
        assert direct.get_many([key])[0] is not None
        stats = direct.stats()  # waits for the failed report, then sends everything pending
        assert (stats.puts, stats.snapshots_put, stats.gets, stats.snapshots_asked, stats.hits) == (1, 1, 3, 4, 3)
