"""Retention through the service: a real gRPC server on loopback over a small real LMDB store.

Every use a client makes through the wire (Get, Lookup) restarts the blocks'
retention clocks, durably, before the call answers; and Lookup finds only what
Get finds. Time moves on the server's ManualClock.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import ResourceExhausted
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope

HOUR = 3600.0
TOKENS = 16
CHAIN = 4  # blocks per chain; the store holds two chains
BLOCK_BYTES = V4_1_FLASH.block_bytes(TOKENS)


@pytest.fixture
def small_client(start_server: Callable[..., Any], tmp_path: Path) -> Iterator[Client]:
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=2 * CHAIN * BLOCK_BYTES, block_tokens=TOKENS)
    server = start_server(store)
    with Client(server.target) as c:
        assert c.block_bytes == BLOCK_BYTES
        yield c


def prompt(seed: int) -> list[int]:
    return list(range(seed, seed + TOKENS * CHAIN))


def put(client: Client, tokens: list[int]) -> None:
    client.put(tokens, [os.urandom(BLOCK_BYTES) for _ in range(len(tokens) // TOKENS)])


def two_chains_then_a_use(client: Client, clock: ManualClock, use: Callable[[list[int]], object]) -> tuple[
        list[int], list[int]]:
    """Chains a (older) and b stored; 40 h later `use(a)`; 40 h after that a third chain needs a's or b's room."""
    a, b = prompt(0), prompt(10_000)
    put(client, a)
    clock.advance(1)
    put(client, b)
    clock.advance(40 * HOUR)
    use(a)
    clock.advance(40 * HOUR)  # b: 80 h since its use; a: 40 h since this one
    put(client, prompt(20_000))
    return a, b


def test_r5_get_restarts_retention(small_client: Client, clock: ManualClock) -> None:
    a, b = two_chains_then_a_use(small_client, clock, small_client.get)
    assert small_client.get(a).statuses == ["found"] * CHAIN
    assert small_client.lookup(b).found_blocks == 0


def test_r5_lookup_hit_restarts_retention(small_client: Client, clock: ManualClock) -> None:
    a, b = two_chains_then_a_use(small_client, clock, small_client.lookup)
    assert small_client.get(a).statuses == ["found"] * CHAIN
    assert small_client.lookup(b).found_blocks == 0


def test_r5_lookup_of_a_prefix_keeps_the_prefix(small_client: Client, clock: ManualClock) -> None:
    a, b = prompt(0), prompt(10_000)
    put(small_client, a)
    clock.advance(1)
    put(small_client, b)
    clock.advance(40 * HOUR)
    assert small_client.lookup(a[: 2 * TOKENS]).found_blocks == 2  # refreshes a's block 1 only
    clock.advance(40 * HOUR)
    put(small_client, prompt(20_000)[: 2 * TOKENS])  # 2 blocks: a's tail (80 h old) may go, not its prefix
    put(small_client, prompt(30_000)[: 2 * TOKENS])  # 2 more: b's tail
    assert small_client.get(a).statuses[:2] == ["found"] * 2
    with pytest.raises(ResourceExhausted):
        put(small_client, prompt(40_000))  # 4 more: b's prefix (2), then nothing but a's protected prefix


def test_r15_lookup_of_hashes_that_are_not_a_chain(small_client: Client) -> None:
    a = prompt(0)
    put(small_client, a)
    hashes = small_client.hashes(a)
    absent_first = [bytes(32), *hashes[1:]]
    repeated = [hashes[0]] * 3
    for asked in (absent_first, repeated, hashes[1:], hashes[::-1]):
        found = small_client.lookup_hashes(asked, lease_ms=1000)
        got = small_client.get_hashes(asked).statuses
        leading = next((i for i, s in enumerate(got) if s != "found"), len(got))
        assert found.found_blocks <= leading
        assert found.found_blocks == (1 if asked is repeated else 0)
        assert bool(found.lease_id) == (found.found_blocks > 0)
    assert small_client.lookup_hashes(hashes).found_blocks == CHAIN


def test_r16_a_damaged_page_makes_its_blocks_misses_not_errors(start_server: Callable[..., Any],
                                                                tmp_path: Path) -> None:
    store = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 30, block_tokens=TOKENS)
    server = start_server(store)
    with Client(server.target) as client:
        tokens = list(range(TOKENS * 60))
        client.put(tokens, [os.urandom(BLOCK_BYTES) for _ in range(60)])
        hashes = client.hashes(tokens)
        key = BlockScope(V4_1_FLASH.fingerprint, "default").key(hashes[30]) + b"m"
        data = store.data_dir / "data.mdb"
        raw, psize = data.read_bytes(), os.sysconf("SC_PAGE_SIZE")
        fd = os.open(data, os.O_WRONLY)
        try:  # zero the type flags of the leaf pages holding block 30's meta record
            at = raw.find(key)
            while at >= 0:
                page = at // psize
                if struct.unpack_from("<H", raw, page * psize + 10)[0] & 0x02:
                    os.pwrite(fd, b"\0\0", page * psize + 10)
                at = raw.find(key, at + 1)
        finally:
            os.close(fd)
        got = client.get(tokens).statuses
        assert got[30] == "corrupt" and set(got) <= {"found", "corrupt"}
        assert client.lookup(tokens).found_blocks == got.index("corrupt")
        assert client.stats().corrupt_blocks == got.count("corrupt")
        assert client.get(tokens[: TOKENS * 2]).statuses == ["found"] * 2  # the server still serves
