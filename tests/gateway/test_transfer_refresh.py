"""A transfer read is use: it restarts its blocks' retention clocks durably before
the batch answers DONE, and a refresh that fails fails its descriptors and is
counted (gateway/transfer_engine.run_read; docs/TRANSFER.md, "Retention")."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from gateway.transfer_engine import Copier, ReadBatch, run_read
from gateway.transfer_sessions import Session, Transfer
from kvstore.client import Client
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings, TransferSettings
from kvstore.errors import ResourceExhausted, Unavailable
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from kvstore.transfer import DONE, FAILED, DescriptorGroup, Op, check_spans
from tiers.lmdb_tier import LmdbBlockTier

HOUR_S = 3600.0


class HeldTouches:
    """The tier, but its refreshes answer only when the test says (a slow or failing fsync)."""

    def __init__(self, tier: LmdbBlockTier) -> None:
        self._tier = tier
        self.asked: list[Future[None]] = []
        self.keys: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tier, name)

    def touch_soon(self, keys: Sequence[bytes]) -> Future[None]:
        future: Future[None] = Future()
        self.asked.append(future)
        self.keys.extend(keys)
        return future


def a_read(tmp_path: Path, clock: ManualClock, n: int) -> tuple[LmdbBlockTier, ReadBatch, Session, Transfer]:
    """A real tier holding `n` blocks stored an hour ago (so a read must refresh them), and a read batch of them."""
    settings = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 30, block_tokens=16)
    tier = LmdbBlockTier(settings, clock=clock)
    scope = BlockScope(V4_1_FLASH.fingerprint, "default")
    root = root_hash(V4_1_FLASH.fingerprint, settings.block_tokens)
    hashes = chain_hashes(list(range(n * settings.block_tokens)), block_tokens=settings.block_tokens, parent=root)
    size = V4_1_FLASH.block_bytes(settings.block_tokens)
    tier.put(scope, root, hashes, [os.urandom(size) for _ in hashes], True)
    clock.advance(HOUR_S)
    region = memoryview(bytearray(n * size))
    group = DescriptorGroup.slots(hashes, region_id=1, offset_bytes=0, length_bytes=size)
    session = Session("s", "peer", V4_1_FLASH.name, scope, TransferSettings())
    transfer = session.new_transfer(frozenset({1}), n)
    spans = check_spans([group], Op.READ, size, transfer.results, lambda _: region)
    batch = ReadBatch(spans=spans, key_prefix=scope.prefix, block_bytes=size, prefix_only=False)
    return tier, batch, session, transfer


def run_with_held_touch(tier: LmdbBlockTier, batch: ReadBatch, session: Session, transfer: Transfer,
                        settle: Callable[[Future[None]], None]) -> tuple[bool, bytes]:
    """Run the batch; once it asks for its refresh, note whether it already answered done, then `settle` it."""
    held = HeldTouches(tier)
    copier = Copier(tier, threads=1)

    async def scenario() -> tuple[bool, bytes]:
        task = asyncio.create_task(run_read(held, session, transfer, batch, 2, copier))  # type: ignore[arg-type]
        while not held.asked and not task.done():
            await asyncio.sleep(0.005)
        assert held.asked, "the read never asked for a refresh"
        done_early, copied = transfer.done.is_set(), bytes(transfer.results.statuses)
        settle(held.asked[0])
        await task
        return done_early, copied

    try:
        return asyncio.run(scenario())
    finally:
        copier.close()


def test_a_read_is_done_only_once_its_refresh_is_durable(tmp_path: Path, clock: ManualClock) -> None:
    tier, batch, session, transfer = a_read(tmp_path, clock, 5)
    try:
        done_early, copied = run_with_held_touch(tier, batch, session, transfer, lambda f: f.set_result(None))
    finally:
        tier.close()
    assert copied == bytes([DONE]) * 5, "the blocks were copied while the refresh was pending"
    assert not done_early, "the batch answered done before its refresh was durable"
    assert transfer.done.is_set() and bytes(transfer.results.statuses) == bytes([DONE]) * 5
    assert session.counters.refresh_failures == 0


def test_a_failed_refresh_fails_the_blocks_and_is_counted(tmp_path: Path, clock: ManualClock) -> None:
    tier, batch, session, transfer = a_read(tmp_path, clock, 4)
    try:
        _, _ = run_with_held_touch(tier, batch, session, transfer,
                                   lambda f: f.set_exception(Unavailable("fsync failed: disk gone")))
    finally:
        tier.close()
    results = transfer.results
    assert transfer.done.is_set()
    assert bytes(results.statuses) == bytes([FAILED]) * 4
    code, reason = results.failures[0]
    assert code == "UNAVAILABLE" and "retention refresh failed" in reason and "disk gone" in reason
    assert results.bytes_moved == 4 * batch.block_bytes, "the bytes did move; only the promise is missing"
    assert session.counters.refresh_failures == 4
    assert session.counters.descriptors_failed == 4


def test_a_failed_refresh_reaches_the_client_and_transfer_stats(monkeypatch: pytest.MonkeyPatch,
                                                                 start_server: Callable[..., Any],
                                                                 store_settings: StoreSettings,
                                                                 clock: ManualClock) -> None:
    def failing(self: LmdbBlockTier, keys: Sequence[bytes]) -> Future[None]:
        future: Future[None] = Future()
        future.set_exception(Unavailable("fsync failed"))
        return future

    server = start_server(store_settings)
    with Client(server.target) as client, client.transfer(path="shm") as session:
        tokens = list(range(3 * client.block_tokens))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(3)])
        clock.advance(HOUR_S)
        monkeypatch.setattr(LmdbBlockTier, "touch_soon", failing)
        region = session.register(3 * client.block_bytes)
        state = session.fetch(client.hashes(tokens), region)
        assert state.done_prefix == 0 and {r.code for r in state.results} == {"UNAVAILABLE"}
        assert "retention refresh failed" in state.results[0].reason
        stats = client.transfer_stats()
        assert stats.refresh_failures == 3 and stats.descriptors_failed == 3


def test_a_block_fetched_only_by_transfer_stays_for_72_hours(start_server: Callable[..., Any], tmp_path: Path,
                                                             clock: ManualClock) -> None:
    # Room for four blocks: two stored, then 71 h later one of them is fetched by
    # transfer (and nothing else); 2 h later the store is filled. The other one is
    # past its 72 h and goes; the fetched one is 2 h into a new window and stays.
    probe = StoreSettings(data_dir=tmp_path / "unused", block_tokens=16)
    block_bytes = V4_1_FLASH.block_bytes(probe.block_tokens)
    settings = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=4 * block_bytes, block_tokens=16)
    server = start_server(settings)
    with Client(server.target) as client, client.transfer(path="shm") as session:
        bt = client.block_tokens
        fetched, idle = list(range(bt)), list(range(1000, 1000 + bt))
        for tokens in (fetched, idle):
            client.put(tokens, [os.urandom(client.block_bytes)])
        clock.advance(71 * HOUR_S)
        region = session.register(client.block_bytes)
        assert session.fetch(client.hashes(fetched), region).done_prefix == 1
        clock.advance(2 * HOUR_S)
        stored = 0
        with pytest.raises(ResourceExhausted):
            for i in range(8):  # one block at a time until nothing more may go
                client.put(list(range(10_000 * (i + 2), 10_000 * (i + 2) + bt)), [os.urandom(client.block_bytes)])
                stored += 1
        assert stored == 3, "the fill evicted only the idle block"
        assert client.get(fetched).blocks[0] is not None, "the block fetched by transfer 2 h ago was evicted"
        assert client.get(idle).blocks == [None], "the idle block was past its 72 h and should have gone"
