"""The operator CLI: `kvstore stats` against a real server, and its errors."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import pytest

from kvstore.cli import main


def test_stats_table_and_json(server: Any, client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    bt = client.block_tokens
    tokens = list(range(bt * 4))
    client.put(tokens[: bt * 2], [os.urandom(client.block_bytes) for _ in range(2)])
    client.lookup(tokens)
    client.get(tokens)
    assert main(["stats", "--target", server.target]) == 0
    table = capsys.readouterr().out
    assert "Lookup hit rate (tokens found / asked)       50.0%" in table
    assert "Retrieve hit rate (tokens returned / asked)  50.0%" in table
    assert "Headroom (hours at that rate)" in table
    assert main(["stats", "--target", server.target, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lookup_hit_rate"] == 0.5 and data["retrieve_hit_rate"] == 0.5
    assert data["blocks_stored"] == 2 and data["rejected_puts"] == 0 and data["corrupt_blocks"] == 0
    assert data["bytes_free"] == data["capacity_bytes"] - 2 * client.block_bytes


def test_stats_show_the_transfer_service(server: Any, client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from tiers import blockcopy

    tokens = list(range(client.block_tokens * 2))
    blocks = [os.urandom(client.block_bytes) for _ in range(2)]
    client.put(tokens, blocks)
    with client.transfer(path="shm") as session:
        region = session.register(3 * client.block_bytes)
        session.fetch([*client.hashes(tokens), b"\x09" * 32], region)
        assert main(["stats", "--target", server.target, "--json"]) == 0
        transfer = json.loads(capsys.readouterr().out)["transfer"]
        assert transfer["copy_loop"] == ("native" if blockcopy.NATIVE else "python")
        assert (transfer["sessions"], transfer["regions"], transfer["mapped_bytes"]) == (1, 1, 3 * client.block_bytes)
        assert (transfer["read_batches"], transfer["descriptors_done"], transfer["descriptors_missing"]) == (1, 2, 1)
        assert transfer["bytes_moved"] == 2 * client.block_bytes and transfer["descriptors_failed"] == 0
    assert main(["stats", "--target", server.target]) == 0
    table = capsys.readouterr().out
    assert "\nTransfer\n" in table and "Sessions open" in table and "Descriptors done     2" in table


def test_stats_on_an_empty_store_has_no_rates(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--target", server.target, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lookup_hit_rate"] is None and data["headroom_hours"] is None


def test_stats_names_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["stats", "--target", f"127.0.0.1:{port}", "--timeout", "2"]) == 2
    assert "Unavailable" in capsys.readouterr().err


def test_bench_lists_its_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "store" in out and "codec" in out
