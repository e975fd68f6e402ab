"""The SwaPool contract, run against every backend: in-process, one real Redis, a real 3-master Redis Cluster.

Rule numbers are those of tiers/swa_pool.py and docs/SWA_POOL.md. The memory
pool expires by moving its clock; a Redis pool's records by their real PX on the
real server, which `redis_time_passes` shortens as that much time passing would
(Redis has no clock to move, and a real wait would race a loaded machine).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from kvstore.clock import ManualClock
from kvstore.config import SwaSettings
from kvstore.errors import ConfigError
from tests.waiting import wait_until
from tiers.swa_pool import BACKENDS, SwaPool, dram_cap_bytes, open_pool

MiB = 1 << 20
BACKEND_NAMES = list(BACKENDS)


@dataclass
class Case:
    """A pool under test and how to let time pass for it."""

    pool: SwaPool
    run: Callable[[Any], Any]
    wait: Callable[[float], None]


def redis_time_passes(ports: list[int]) -> Callable[[float], None]:
    """`seconds` passing for the records on these Redis servers: each TTL shortened by that much; a
    record it runs out for is given 1 ms and waited on until Redis itself expired it (counted so)."""

    def advance(seconds: float) -> None:
        for port in ports:
            with redis.Redis(port=port) as node:
                for key in node.scan_iter(count=1000):
                    left_ms = node.pttl(key)
                    if left_ms < 0:  # no TTL (or gone meanwhile): time does not end it
                        continue
                    node.pexpire(key, max(left_ms - int(seconds * 1000), 1))
                for key in node.scan_iter(count=1000):
                    left_ms = node.pttl(key)
                    if 0 <= left_ms <= 1:
                        wait_until(lambda k=key, n=node: not n.exists(k), "a record Redis was due to expire stayed")

    return advance


@pytest.fixture(params=BACKEND_NAMES)
def make_case(request: pytest.FixtureRequest, loop_thread: Any, clock: ManualClock) -> Iterator[Callable[..., Case]]:
    """Build a pool of the parametrized backend with a given cap."""
    name = request.param
    made: list[SwaPool] = []

    def _make(cap_bytes: int) -> Case:
        if name == "memory":
            settings = SwaSettings(backend=name, cap_bytes=cap_bytes)
            wait: Callable[[float], None] = clock.advance
        elif name == "redis":
            server = request.getfixturevalue("redis_server")
            settings = SwaSettings(backend=name, cap_bytes=cap_bytes, redis_url=server.url)
            wait = redis_time_passes([server.port])
        else:
            cluster = request.getfixturevalue("redis_cluster")
            settings = SwaSettings(backend=name, cap_bytes=cap_bytes, cluster_nodes=cluster.startup_nodes)
            wait = redis_time_passes([n.port for n in cluster.nodes])
        pool = open_pool(settings, clock=clock)
        made.append(pool)
        return Case(pool=pool, run=loop_thread.run, wait=wait)

    yield _make
    for pool in made:
        loop_thread.run(pool.close())


def keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(4, "little") + bytes(27) for i in range(n)]


def test_rule_0_put_get_round_trip_in_order(make_case: Callable[..., Case]) -> None:
    case = make_case(64 * MiB)
    ks = keys(5)
    records = [os.urandom(1000 + i) for i in range(5)]
    case.run(case.pool.put_many(list(zip(ks, records, strict=True)), 60))
    got = case.run(case.pool.get_many([ks[3], b"missing" + bytes(25), *ks]))
    assert got == [records[3], None, *records]
    assert case.run(case.pool.exists_many([ks[0], b"x" * 32])) == [True, False]


def test_rule_0_put_replaces_and_delete_drops(make_case: Callable[..., Case]) -> None:
    case = make_case(64 * MiB)
    k = keys(2)
    case.run(case.pool.put_many([(k[0], b"old"), (k[1], b"other")], 60))
    case.run(case.pool.put_many([(k[0], b"new")], 60))
    assert case.run(case.pool.get_many([k[0]])) == [b"new"]
    assert case.run(case.pool.delete_many([k[0], b"y" * 32])) == 1
    assert case.run(case.pool.get_many(k)) == [None, b"other"]


def test_rule_1_records_expire_after_their_ttl(make_case: Callable[..., Case]) -> None:
    case = make_case(64 * MiB)
    short, long_ = keys(1, b"s"), keys(1, b"l")
    case.run(case.pool.put_many([(short[0], b"a" * 100)], 30))
    case.run(case.pool.put_many([(long_[0], b"b" * 100)], 600))
    assert case.run(case.pool.get_many(short)) == [b"a" * 100]
    case.wait(60)
    assert case.run(case.pool.get_many(short + long_)) == [None, b"b" * 100]
    assert case.run(case.pool.exists_many(short)) == [False]
    assert case.run(case.pool.usage()).expirations >= 1


def test_rule_2_and_3_cap_evicts_instead_of_refusing(make_case: Callable[..., Case]) -> None:
    case = make_case(8 * MiB)
    ks = keys(30)
    for k in ks:  # one at a time: Redis evicts before each command, a record is never refused
        case.run(case.pool.put_many([(k, os.urandom(MiB))], 60))
    got = case.run(case.pool.get_many(ks))
    usage = case.run(case.pool.usage())
    # Redis's LRU is approximate with a one-second clock: among records written in
    # the same second it may evict the newest, so only the in-process pool is exact.
    assert got[-1] is not None if case.pool.name == "memory" else any(g is not None for g in got)
    assert sum(g is not None for g in got) < len(ks)
    assert usage.evictions > 0
    assert usage.cap_bytes >= 8 * MiB  # per node in a cluster
    if case.pool.name == "memory":
        assert usage.bytes_used <= usage.cap_bytes


def test_usage_reports_items_and_cap(make_case: Callable[..., Case]) -> None:
    case = make_case(16 * MiB)
    case.run(case.pool.put_many([(k, b"z" * 1000) for k in keys(4)], 60))
    usage = case.run(case.pool.usage())
    assert usage.items == 4 and usage.backend == case.pool.name
    assert usage.bytes_used >= 4000


def test_cap_is_a_share_of_dram_unless_given(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000000 kB\nMemFree: 5 kB\n")
    assert dram_cap_bytes(SwaSettings(), meminfo) == int(1000000 * 1024 * 0.10)
    assert dram_cap_bytes(SwaSettings(cap_bytes=12345), meminfo) == 12345
    with pytest.raises(ConfigError, match="MemTotal"):
        dram_cap_bytes(SwaSettings(), tmp_path / "absent")


def test_unknown_backend_is_a_config_error(clock: ManualClock) -> None:
    with pytest.raises(ConfigError, match=r"unknown swa\.backend"):
        open_pool(SwaSettings(backend="memcached"), clock=clock)


def test_config_selects_the_backend(tmp_path: Path) -> None:
    from kvstore.config import load_settings

    toml = tmp_path / "kvstore.toml"
    toml.write_text('[swa]\nbackend = "redis-cluster"\ncluster_nodes = "10.0.0.1:7000,10.0.0.2:7000"\n')
    settings = load_settings(toml, environ={"KVSTORE_SWA_TTL_S": "120"})
    assert settings.swa.backend == "redis-cluster" and settings.swa.ttl_s == 120.0
    assert load_settings(environ={}).swa.backend == "memory"
    with pytest.raises(ConfigError, match="ttl_s"):
        load_settings(environ={"KVSTORE_SWA_TTL_S": "0"})
