"""The server's GIL switch interval (gateway/gil_handoff.py): `kvstore serve` shortens it at start, so the event
loop, which drops the GIL around each of a small Lookup's LMDB reads, gets it back sooner from the LMDB threads."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstore
from gateway.gil_handoff import SERVER_SWITCH_INTERVAL_S, shorten_gil_switch_interval
from tests.children import Child
from tests.waiting import wait_until


@pytest.fixture
def restored() -> Iterator[None]:
    """The test process's own interval back after the test."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_interval_is_shortened_and_the_one_before_returned(restored: None) -> None:
    before = sys.getswitchinterval()
    assert shorten_gil_switch_interval() == before
    assert sys.getswitchinterval() == pytest.approx(SERVER_SWITCH_INTERVAL_S)
    assert SERVER_SWITCH_INTERVAL_S < 0.005  # below CPython's default, or it changes nothing


def test_kvstore_serve_runs_with_the_short_interval(tmp_path: Path) -> None:
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(tmp_path / "data")], tmp_path / "logs")
    try:
        pattern = r"kvstore GIL switch interval: ([\d.]+) ms"
        wait_until(lambda: re.search(pattern, child.out_path.read_text()), "the server's switch interval line")
        match = re.search(pattern, child.out_path.read_text())
        assert match is not None
        assert float(match.group(1)) == pytest.approx(SERVER_SWITCH_INTERVAL_S * 1000)  # the server's own, read back
        with kvstore.Client(child.target) as client:
            tokens = list(range(client.block_tokens * 2))
            client.put(tokens, [bytes(client.block_bytes)] * 2)
            assert client.lookup(tokens).found_blocks == 2
        assert child.stop() == 0
    finally:
        child.kill_if_alive()
