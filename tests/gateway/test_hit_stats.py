"""Hit rates over time through a real server on loopback: windows that roll with a ManualClock, counters
that survive a restart, tenants counted apart, SWA gets and planner reports, the capacity warning."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import grpc
import pytest

from kvstore.client import Client
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.v1 import kvstore_pb2 as pb

HOUR = 3600.0


def window(reply: pb.StatsResponse, name: str, tenant: str | None = None) -> pb.HitCounts:
    """The counters of window `name`, overall or of one listed tenant."""
    windows = reply.windows if tenant is None else next(t.windows for t in reply.tenants if t.tenant == tenant)
    return next(w.counts for w in windows if w.window == name)


def store_two_blocks(client: Client) -> list[int]:
    """Four blocks' worth of tokens whose first two blocks are stored."""
    bt = client.block_tokens
    tokens = list(range(bt * 4))
    client.put(tokens[: bt * 2], [os.urandom(client.block_bytes) for _ in range(2)])
    return tokens


def test_windows_roll_a_miss_two_hours_ago_is_not_in_the_last_hour(client: Client, clock: ManualClock) -> None:
    tokens = store_two_blocks(client)
    client.lookup(list(range(10_000, 10_000 + 4 * client.block_tokens)))  # a large miss ...
    client.get(tokens[client.block_tokens * 2:])
    clock.advance(2 * HOUR)
    client.lookup(tokens[: client.block_tokens * 2])  # ... two hours before full hits
    client.get(tokens[: client.block_tokens * 2])
    s = client.stats()
    last_hour, day = window(s, "1h"), window(s, "24h")
    assert (last_hour.lookup_blocks_asked, last_hour.lookup_blocks_found) == (2, 2)
    assert (last_hour.get_tokens_asked, last_hour.get_tokens_returned) == (2 * client.block_tokens,) * 2
    assert (day.lookup_blocks_asked, day.lookup_blocks_found, day.get_blocks_asked) == (6, 2, 4)
    clock.advance(10 * 60)
    assert window(client.stats(), "5m").lookups == 0 and window(client.stats(), "1h").lookups == 1


def test_counters_survive_a_restart_and_start_begins_at_zero(start_server: Callable[..., Any], loop_thread: Any,
                                                             store_settings: StoreSettings,
                                                             clock: ManualClock) -> None:
    first = start_server(store_settings)
    with Client(first.target) as client:
        tokens = store_two_blocks(client)
        client.lookup(tokens)
        before = client.stats().run_started_at_s
    loop_thread.run(first.stop(0))  # the last write, at stop
    clock.advance(30 * 60)
    second = start_server(store_settings)
    with Client(second.target) as client:
        s = client.stats()
        assert (window(s, "1h").lookup_blocks_asked, window(s, "1h").lookup_blocks_found) == (4, 2)
        assert window(s, "all").lookups == 1 and window(s, "start").lookups == 0
        assert s.run_started_at_s == before + 30 * 60 and s.counted_since_s == before
        clock.advance(HOUR)  # the earlier run's lookup leaves the last hour
        client.lookup(tokens)
        s = client.stats()
        assert window(s, "1h").lookups == window(s, "start").lookups == 1 and window(s, "24h").lookups == 2


def test_tenants_are_counted_apart(server: Any, client: Client) -> None:
    tokens = store_two_blocks(client)
    client.lookup(tokens)
    with Client(server.target, namespace="acme") as acme:
        acme.lookup(tokens)  # another tenant's blocks are not acme's: a miss
        acme.get(tokens[: acme.block_tokens])
    s = client.stats()
    assert [t.tenant for t in s.tenants] == ["acme", "default"]
    assert (window(s, "24h", "default").lookup_blocks_found, window(s, "24h", "acme").lookup_blocks_found) == (2, 0)
    assert (window(s, "24h").lookups, window(s, "24h", "acme").gets, window(s, "24h", "default").gets) == (2, 1, 0)
    only = client.stats(tenant="acme")
    assert [t.tenant for t in only.tenants] == ["acme"]
    assert (window(only, "24h").lookup_blocks_asked, window(only, "24h").lookup_blocks_found) == (4, 0)


def test_swa_gets_and_planner_reports_count_per_tenant(client: Client) -> None:
    tokens = list(range(200))
    assert client.swa.put(tokens[:60], os.urandom(client.swa.snapshot_bytes(60))).stored == 1
    assert client.swa.get(tokens[:60]) is not None and client.swa.get(tokens) is None
    client.report_resume(prompt_tokens=400, found_tokens=320, usable_tokens=300, action="bounded-replay")
    client.report_resume(prompt_tokens=100, found_tokens=32, usable_tokens=0, action="full-prefill")
    c = window(client.stats(), "5m", "default")
    assert (c.swa_gets, c.swa_snapshots_asked, c.swa_snapshots_found) == (2, 2, 1)
    assert (c.resume_plans, c.resume_prompt_tokens, c.resume_found_tokens, c.resume_usable_tokens) == (
        2, 500, 352, 300)
    assert (c.resume_bounded_replay_plans, c.resume_full_prefill_plans, c.resume_exact_replay_plans) == (1, 1, 0)


@pytest.mark.parametrize(("half_blocks", "warned"), [(72 * 2 - 1, True), (72 * 2 + 1, False)])
def test_headroom_warning_exactly_when_capacity_at_the_write_rate_is_under_the_retention(
        start_server: Callable[..., Any], store_settings: StoreSettings, clock: ManualClock,
        half_blocks: int, warned: bool) -> None:
    """One block written in the last hour: the capacity holds capacity / block_bytes hours at that rate."""
    with Client(start_server(store_settings).target) as probe:
        block_bytes = probe.block_bytes
    settings = replace(store_settings, data_dir=store_settings.data_dir.with_name("sized"),
                       capacity_bytes=half_blocks * block_bytes // 2, write_rate_window_s=HOUR)
    with Client(start_server(settings).target) as client:
        client.put(list(range(client.block_tokens)), [os.urandom(block_bytes)])
        clock.advance(HOUR)
        s = client.stats()
    assert s.capacity_hours == pytest.approx(half_blocks / 2)  # 71.5 or 72.5 against 72
    assert s.headroom_warning is warned and s.retention_hours == 72


def test_a_stats_request_naming_what_does_not_exist_is_refused(client: Client) -> None:
    for request, says in [(pb.StatsRequest(windows=["7d"]), "windows ['7d'] are not known"),
                          (pb.StatsRequest(chart_points=49), "chart_points is 49: at most 48"),
                          (pb.StatsRequest(tenant="no spaces"), "namespace 'no spaces'")]:
        with pytest.raises(grpc.RpcError) as err:
            client.connection.kvstore.Stats(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in (err.value.details() or "")


def test_transfer_reads_count_as_retrieves_of_the_sessions_tenant(client: Client) -> None:
    tokens = store_two_blocks(client)
    with client.transfer(path="shm") as session:
        region = session.register(3 * client.block_bytes)
        session.fetch([*client.hashes(tokens[: 2 * client.block_tokens]), b"\x09" * 32], region)
    c = window(client.stats(), "5m", "default")
    assert (c.gets, c.get_blocks_asked, c.get_blocks_returned) == (1, 3, 2)
    assert c.get_tokens_returned == 2 * client.block_tokens  # tokens served from cache
