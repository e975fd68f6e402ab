"""kill -9 of `kvstore serve` while reads refresh retention: Gets, and shared-memory transfer fetches.

Blocks are stored, then two hours pass on the server's clock, so every read is
due a retention refresh (a touch commit); the kill lands while reads, and so
their commits, are running. After a restart the store must open with every
block intact and counted, and the client's shared-memory segments must be gone.

A read the client saw complete must have refreshed its blocks durably, kill or
not: 71 more hours later, a Put into the full store may evict blocks never read
since they were stored (73 h ago), but never those read to the end before the
kill (71 h ago).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore import geometry
from kvstore.errors import FailedPrecondition, KVStoreError

CHAINS = 8
BLOCKS_PER_CHAIN = 128
READERS = 2
#: Chains read to the end before the kill: the rest are being read, or not yet, when it lands.
READ_BEFORE_KILL = 2
HOUR_S = 3600.0


def _capacity_bytes(block_tokens: int) -> int:
    """Room for exactly the test's chains and the marker block: one more chain must evict."""
    return (CHAINS * BLOCKS_PER_CHAIN + 1) * geometry.REGISTRY[geometry.V4_1_FLASH.name].block_bytes(block_tokens)


def _store_then_age(server: Any, clock: Any, kit: Any) -> tuple[list[Any], Any]:
    """Store the chains (acknowledged), then let two hours pass: every block is due a refresh on its next read.

    Returns:
        The chains, and a one-block marker chain stored after the two hours: a write
        then, so the store's persisted time has passed them whether or not a read's
        refresh commits before the kill (the store's clock resumes from it at restart).
    """
    with server.client() as client:
        chains = kit.make_chains(client, CHAINS, BLOCKS_PER_CHAIN)
        for chain in chains:
            client.put(chain.tokens, chain.payload())
            chain.acked = chain.blocks
        clock.advance(2 * HOUR_S)
        marker = kit.make_chains(client, 1, 1, first_seed=CHAINS + 2)[0]
        client.put(marker.tokens, marker.payload())
        marker.acked = 1
    return chains, marker


def _read_until_killed(server: Any, chains: list[Any], read_one: Callable[[Any, Any], None]) -> list[Any]:
    """READERS threads read chains in turn; the one that completes the READ_BEFORE_KILL-th chain SIGKILLs
    the server at once, while the other is mid-chain.

    Returns:
        The chains whose read completed (answered in full) before the kill.
    """
    done: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    todo = iter(chains)

    def reader() -> None:
        try:
            with server.client(timeout_s=60) as client:
                while True:
                    with lock:
                        chain = next(todo, None)
                    if chain is None:
                        return
                    read_one(client, chain)
                    with lock:
                        done.append(chain)
                        if len(done) == READ_BEFORE_KILL:
                            server.proc.kill()
        except KVStoreError:
            pass  # the server died under it
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(READERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    server.kill9()  # reaps it: it died of the SIGKILL
    assert READ_BEFORE_KILL <= len(done) < CHAINS, f"{len(done)} chains read whole: the kill did not land mid-read"
    return list(done)


def _check_after_restart(serve: Callable[..., Any], data_dir: Path, cfg: Path, clock: Any, chains: list[Any],
                         marker: Any, read_whole: list[Any], kit: Any) -> Any:
    """Restart; every block is counted; 71 h on, a Put that must evict spares every chain read before the kill."""
    again = serve(data_dir, config=cfg, clock=clock)
    with again.client() as client:
        # No read here: it would refresh the blocks this test needs unrefreshed.
        stats = client.stats()
        stored = CHAINS * BLOCKS_PER_CHAIN + 1
        assert (stats.blocks_stored, stats.bytes_stored) == (stored, stored * client.block_bytes)
        clock.advance(71 * HOUR_S)
        newcomer = kit.make_chains(client, 1, BLOCKS_PER_CHAIN, first_seed=CHAINS + 1)[0]
        client.put(newcomer.tokens, newcomer.payload())
        newcomer.acked = newcomer.blocks
        for chain in chains:
            chain.acked = chain.blocks if chain in read_whole else 0
        kit.assert_usage_matches(client, kit.census(client, [*chains, marker, newcomer]))
        assert client.stats().evictions >= BLOCKS_PER_CHAIN
    return again


def test_kill_9_during_gets_that_refresh_retention(serve: Callable[..., Any], config: Callable[..., Path],
                                                   server_clock: Any, tmp_path: Path, kit: Any) -> None:
    data_dir = tmp_path / "data"
    cfg = config(store={"capacity_bytes": _capacity_bytes(kit.BLOCK_TOKENS)})
    server = serve(data_dir, config=cfg, clock=server_clock)
    chains, marker = _store_then_age(server, server_clock, kit)

    def get_whole(client: Any, chain: Any) -> None:
        got = client.get(chain.tokens)
        assert got.blocks == chain.payload(), f"chain {chain.seed} read back wrong before the kill"

    read_whole = _read_until_killed(server, chains, get_whole)
    _check_after_restart(serve, data_dir, cfg, server_clock, chains, marker, read_whole, kit)


def test_kill_9_during_shm_transfer_fetches(serve: Callable[..., Any], config: Callable[..., Path],
                                            server_clock: Any, tmp_path: Path, kit: Any) -> None:
    data_dir = tmp_path / "data"
    cfg = config(store={"capacity_bytes": _capacity_bytes(kit.BLOCK_TOKENS)})
    before = kit.segment_lines()
    server = serve(data_dir, config=cfg, clock=server_clock)
    with server.client() as client, client.transfer(path="shm") as probe:
        try:
            probe.deregister(probe.register(client.block_bytes))
        except FailedPrecondition as exc:
            pytest.skip(f"the server cannot map this process's regions here: {exc.message}")
    chains, marker = _store_then_age(server, server_clock, kit)
    sessions: dict[int, Any] = {}  # one per reader's client

    def fetch_whole(client: Any, chain: Any) -> None:
        if id(client) not in sessions:
            sessions[id(client)] = client.transfer(path="shm")
        session = sessions[id(client)]
        region = session.register(chain.blocks * client.block_bytes)
        state = session.fetch(client.hashes(chain.tokens), region)
        assert state.done_prefix == chain.blocks
        assert bytes(region.view) == b"".join(chain.payload()), f"chain {chain.seed} fetched wrong before the kill"
        session.deregister(region)

    try:
        read_whole = _read_until_killed(server, chains, fetch_whole)
    finally:
        for session in sessions.values():
            session.close()
    # The server is gone and the sessions are closed: no segment is left mapped or open here.
    assert kit.segment_lines() - before == set()

    again = _check_after_restart(serve, data_dir, cfg, server_clock, chains, marker, read_whole, kit)
    with again.client() as client, client.transfer(path="shm") as session:
        stats = client.transfer_stats()
        assert (stats.sessions, stats.regions) == (1, 0)
        chain = read_whole[0]
        region = session.register(chain.blocks * client.block_bytes)
        assert session.fetch(client.hashes(chain.tokens), region).done_prefix == chain.blocks
        assert bytes(region.view) == b"".join(chain.payload())
    assert kit.segment_lines() - before == set()
