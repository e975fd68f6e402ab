"""`kvstore stats`: hit-rate windows per tenant, --json, --chart, the capacity warning (real server on loopback,
time moved with a ManualClock)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from kvstore.cli import main
from kvstore.client import Client
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings

HOUR = 3600.0


def stored_tokens(client: Client) -> list[int]:
    """Two blocks of tokens, stored."""
    tokens = list(range(client.block_tokens * 2))
    client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])
    return tokens


def stats_json(target: str, capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    assert main(["stats", "--target", target, "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_json_has_every_window_every_tenant_and_the_chart(server: Any, client: Client, clock: ManualClock,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    started = clock.now()
    clock.advance(HOUR)  # the write rate of a store up for one second would extrapolate one put
    tokens = stored_tokens(client)
    client.lookup(tokens + list(range(9_000, 9_000 + 2 * client.block_tokens)))  # 2 of 4 blocks found
    with Client(server.target, namespace="acme") as acme:
        acme.get(tokens)  # acme stored nothing: both blocks missing
    data = stats_json(server.target, capsys)
    assert list(data["windows"]) == ["5m", "1h", "24h", "start", "all"]
    assert data["windows"]["1h"]["lookup_token_hit_rate"] == 0.5 and data["windows"]["1h"]["lookups"] == 1
    assert data["windows"]["start"]["retrieve_block_hit_rate"] == 0.0
    assert data["windows"]["all"]["swa_hit_rate"] is None  # nothing asked: no rate
    assert sorted(data["tenants"]) == ["acme", "default"]
    default = data["tenants"]["default"]
    assert default["windows"]["24h"]["lookup_block_hit_rate"] == 0.5 and default["windows"]["24h"]["gets"] == 0
    assert default["token_hours"] is not None and default["blocks_stored"] == 2
    assert data["tenants"]["acme"]["windows"]["24h"]["tokens_served"] == 0
    assert len(data["chart"]) == 48 and data["chart"][-1]["lookups"] == 1
    assert data["headroom_warning"] is False and data["capacity_hours"] is not None
    assert data["lookup_hit_rate"] == 0.5  # the store's totals keep their keys
    assert data["run_started_at_s"] == data["counted_since_s"] == started


def test_window_and_tenant_flags_narrow_the_answer(server: Any, client: Client,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    client.lookup(stored_tokens(client))
    with Client(server.target, namespace="acme") as acme:
        acme.lookup(list(range(acme.block_tokens)))
    data = stats_json(server.target, capsys, "--tenant", "acme", "--window", "1h")
    assert list(data["windows"]) == ["1h"] and list(data["tenants"]) == ["acme"]
    assert data["windows"]["1h"]["lookup_blocks_asked"] == 1 and data["windows"]["1h"]["lookup_blocks_found"] == 0


def test_the_table_shows_hit_rates_per_window_and_tenant(server: Any, client: Client, clock: ManualClock,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    clock.advance(HOUR)
    tokens = stored_tokens(client)
    client.lookup(tokens)
    client.report_resume(prompt_tokens=100, found_tokens=64, usable_tokens=32, action="bounded-replay")
    client.report_resume(prompt_tokens=100, found_tokens=0, usable_tokens=0, action="full-prefill")
    assert main(["stats", "--target", server.target]) == 0
    out = capsys.readouterr().out
    assert "Lookup hit rate (tokens found / asked)       100.0%" in out  # the totals table, as before
    assert re.search(r"Hit rates \(default\) +5 min +1 h +24 h +since start +all time\n", out)
    assert re.search(r"  Lookup hit rate, tokens +100\.0% +100\.0% +100\.0% +100\.0% +100\.0%\n", out)
    assert re.search(r"  Replay share \(replay plans / plans\) +50\.0% ", out)
    assert re.search(r"  Usable share of found tokens +50\.0% ", out)
    assert re.search(r"  Token-hours stored +0\.0 \(2 blocks, [\d,]+ B stored now\)", out)
    assert "WARNING" not in out


def test_the_chart_shows_24_hours_of_the_hit_rate_in_plain_text(server: Any, client: Client, clock: ManualClock,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    tokens = stored_tokens(client)
    client.lookup(tokens + list(range(9_000, 9_000 + 2 * client.block_tokens)))  # 50% ...
    clock.advance(23.5 * HOUR)
    client.lookup(tokens)  # ... then 100%, 23.5 h later
    assert main(["stats", "--target", server.target, "--chart"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("lookup hit rate over the last 24 h (tenant default, kvstore at ")
    rows = {line[:5].strip(): line[7:] for line in lines[1:12]}
    assert list(rows) == [f"{p}%" for p in range(100, -1, -10)]
    assert all(len(columns) == 48 for columns in rows.values())
    assert rows["100%"] == " " * 47 + "#" and rows["60%"] == " " * 47 + "#"
    assert rows["50%"] == "#" + " " * 46 + "#"  # the oldest column: 23.5 h ago, at 50%
    assert lines[13].split() == ["-24h", "-18h", "-12h", "-6h", "now"]
    assert "46 of 48 without traffic" in lines[14]
    assert all(ord(ch) < 128 for line in lines for ch in line)  # plain ASCII: pipes and logs keep it


@pytest.mark.parametrize(("half_blocks", "warned"), [(72 * 2 - 1, True), (72 * 2 + 1, False)])
def test_the_warning_appears_exactly_when_capacity_at_the_write_rate_is_under_the_retention(
        start_server: Callable[..., Any], store_settings: StoreSettings, clock: ManualClock,
        capsys: pytest.CaptureFixture[str], half_blocks: int, warned: bool) -> None:
    with Client(start_server(store_settings).target) as probe:
        block_bytes = probe.block_bytes
    settings = replace(store_settings, data_dir=store_settings.data_dir.with_name("sized"),
                       capacity_bytes=half_blocks * block_bytes // 2, write_rate_window_s=HOUR)
    target = start_server(settings).target
    with Client(target) as client:
        client.put(list(range(client.block_tokens)), [os.urandom(block_bytes)])
    clock.advance(HOUR)
    assert main(["stats", "--target", target]) == 0
    out = capsys.readouterr().out
    assert ("WARNING: at the recent write rate" in out) is warned
    if warned:
        assert f"holds {half_blocks / 2:.1f} h of writes, less than the 72 h retention" in out
        assert f"Raise store.capacity_bytes to at least {72 * block_bytes:,} B" in out
    assert stats_json(target, capsys)["headroom_warning"] is warned
