"""kill -9 of `kvstore serve` while puts run over the one-copy TCP transport (docs/TRANSFER.md "Put over
the one-copy TCP transport"): the scenario of test_kill_during_put.py (three group-committed streams beside
refused Puts), every put of it sent as put frames. A batch is acknowledged only once its commit is durable,
so after the restart every acknowledged block is there, bit-identical, and usage equals what is readable."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import put_tcp
from tests.faults.test_kill_during_put import _kill_mid_streams
from tests.tcp_puts import watch_tcp_puts


@pytest.fixture
def over_tcp(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every put tries the TCP transport; each that went over it is listed (-1 while unanswered)."""
    return watch_tcp_puts(monkeypatch)


def test_kill_9_during_tcp_puts_keeps_every_acknowledged_block(
        serve: Callable[..., Any], config: Callable[..., Path], tmp_path: Path, kit: Any,
        over_tcp: list[int]) -> None:
    data_dir, cfg = tmp_path / "data", config()
    chains = _kill_mid_streams(serve, cfg, data_dir, kit)
    assert len(over_tcp) >= 4, "the streams and the refused puts went over the TCP transport"
    again = serve(data_dir, config=cfg)
    with again.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains))
        for chain in chains:  # the store takes the rest of every chain after the crash, over TCP again
            found = client.lookup(chain.tokens).found_blocks
            client.put(chain.tokens, chain.payload(found), first_block=found)
            chain.acked = chain.blocks
        assert put_tcp.refused(client.connection) == ""
        kit.assert_usage_matches(client, kit.census(client, chains))


def test_sigterm_during_tcp_puts_stops_cleanly_and_keeps_every_acknowledged_block(
        serve: Callable[..., Any], config: Callable[..., Path], tmp_path: Path, kit: Any,
        over_tcp: list[int]) -> None:
    data_dir, cfg = tmp_path / "data", config()
    chains = _kill_mid_streams(serve, cfg, data_dir, kit, sig=signal.SIGTERM)  # asserts exit 0, "kvstore stopped"
    assert len(over_tcp) >= 4
    again = serve(data_dir, config=cfg)
    with again.client() as client:
        kit.assert_usage_matches(client, kit.census(client, chains))
