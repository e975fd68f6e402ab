"""Damaged or shared data dirs under a real `kvstore serve` (issue 9 items 7 and 15, docs/OPERATIONS.md).

Each test fills a store through a real server, stops it, damages `data.mdb` as a
disk or an operator might, and starts `kvstore serve` again: it must refuse with
a message naming the file and what to do, never start on it (a truncated file
killed the server with SIGBUS on its first Lookup, an emptied one was served
silently empty, a damaged leaf aborted it). Then `kvstore check --repair` (or the
operator's other way out) makes it serve again, with what it serves intact.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tiers.lmdb_pages import PageReader

CHAINS, BLOCKS = 6, 8


def fill(serve: Callable[..., Any], config: Path, data_dir: Path, kit: SimpleNamespace) -> list[Any]:
    """Chains stored through a real server, stopped cleanly."""
    server = serve(data_dir, config=config)
    with server.client() as client:
        chains = kit.make_chains(client, CHAINS, BLOCKS)
        for chain in chains:
            client.put(chain.tokens, chain.payload())
            chain.acked = chain.blocks
    assert server.stop() == 0
    return list(chains)


def refused(data_dir: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """Start `kvstore serve` on `data_dir` and expect it to exit with an error, not listen."""
    try:
        run = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--host", "127.0.0.1",
                              "--data-dir", str(data_dir), "--config", str(config)],
                             capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"kvstore serve started on a damaged store: {exc.stdout!r}") from None
    assert run.returncode != 0, run.stdout
    assert "listening on" not in run.stdout
    assert "Traceback" not in run.stderr, run.stderr
    return run


def repair(data_dir: Path) -> str:
    """`kvstore check --data-dir D --repair`; check_store directly while the CLI has no `check`."""
    run = subprocess.run([sys.executable, "-m", "kvstore.cli", "check", "--data-dir", str(data_dir), "--repair"],
                         capture_output=True, text=True, timeout=300)
    if "invalid choice: 'check'" in run.stderr:
        from tiers.integrity import check_store

        report = check_store(data_dir, repair=True)
        assert report.repaired, report.lines()
        return "\n".join(report.lines())
    assert "Traceback" not in run.stderr, run.stderr
    return run.stdout + run.stderr


def serves_what_it_keeps(serve: Callable[..., Any], config: Path, data_dir: Path, chains: list[Any],
                         kit: SimpleNamespace) -> int:
    """Start on the repaired store: every chain's readable blocks are a prefix, bit-identical."""
    for chain in chains:
        chain.acked = 0  # blocks on lost pages are gone: what is left must still be whole
    server = serve(data_dir, config=config)
    with server.client() as client:
        readable = kit.census(client, chains)
        kit.assert_usage_matches(client, readable)
        more = kit.make_chains(client, 1, 2, first_seed=500)[0]
        client.put(more.tokens, more.payload())  # and it takes writes again
        assert client.lookup(more.tokens).found_blocks == 2
    assert server.stop() == 0
    return readable


@pytest.fixture
def store(tmp_path: Path, serve: Callable[..., Any], config: Callable[..., Path],
          kit: SimpleNamespace) -> tuple[Path, Path, list[Any]]:
    cfg = config(store={"capacity_bytes": 64 << 20})
    data_dir = tmp_path / "data"
    return data_dir, cfg, fill(serve, cfg, data_dir, kit)


@pytest.mark.parametrize("keep", ["half", "8KiB"])
def test_a_truncated_data_file_is_refused_then_repaired(store: tuple[Path, Path, list[Any]],
                                                       serve: Callable[..., Any], kit: SimpleNamespace,
                                                       keep: str) -> None:
    data_dir, cfg, chains = store
    data = data_dir / "data.mdb"
    os.truncate(data, data.stat().st_size // 2 if keep == "half" else 8192)
    run = refused(data_dir, cfg)
    assert f"{data} is truncated" in run.stderr and "kvstore check" in run.stderr and "--repair" in run.stderr
    assert "truncated: 1" in repair(data_dir)
    readable = serves_what_it_keeps(serve, cfg, data_dir, chains, kit)
    assert readable < CHAINS * BLOCKS


def test_an_emptied_data_file_is_refused_not_served_empty(store: tuple[Path, Path, list[Any]],
                                                          serve: Callable[..., Any], kit: SimpleNamespace) -> None:
    data_dir, cfg, chains = store
    data = data_dir / "data.mdb"
    os.truncate(data, 0)
    run = refused(data_dir, cfg)
    assert f"{data} is empty" in run.stderr and "move" in run.stderr
    shutil.move(data_dir, data_dir.with_name("data.lost"))  # what the message says to do
    assert serves_what_it_keeps(serve, cfg, data_dir, chains, kit) == 0


def test_a_damaged_leaf_page_is_refused_then_repaired(store: tuple[Path, Path, list[Any]],
                                                      serve: Callable[..., Any], kit: SimpleNamespace) -> None:
    data_dir, cfg, chains = store
    data = data_dir / "data.mdb"
    with PageReader(path=data) as reader:
        records = reader.named_trees()[b"records"]
        for _ in reader.entries(records, "records", values=False):
            pass
        leaves = list(reader.leaves)
    assert len(leaves) > 2, "the store should span several leaves"
    with data.open("r+b") as f:  # a page of zeros where a leaf of block records was
        f.seek(leaves[len(leaves) // 2] * 4096)
        f.write(bytes(4096))
    run = refused(data_dir, cfg)
    assert f"{data} has 1 damaged page(s)" in run.stderr and "--repair" in run.stderr
    report = repair(data_dir)
    assert "damaged-page" in report
    readable = serves_what_it_keeps(serve, cfg, data_dir, chains, kit)
    assert 0 < readable < CHAINS * BLOCKS


def test_a_second_server_on_one_data_dir_is_refused_naming_the_first(tmp_path: Path, serve: Callable[..., Any],
                                                                    config: Callable[..., Path]) -> None:
    """Two servers on one store would each keep their own usage totals and write them back (issue 9 item 7)."""
    cfg = config(store={"capacity_bytes": 64 << 20})
    data_dir = tmp_path / "data"
    first = serve(data_dir, config=cfg)
    run = refused(data_dir, cfg)
    assert f"{data_dir} is in use by another kvstore process (pid {first.proc.pid}" in run.stderr
    assert first.alive
    assert first.stop() == 0
    serve(data_dir, config=cfg).stop()  # the lock went with the first server
