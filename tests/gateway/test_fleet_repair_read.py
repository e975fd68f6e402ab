"""The repairer's gRPC batch read (gateway/fleet_repair.py `_read`, docs/FLEET.md F18c): every block stored and
intact, the request is laid out from the metas and each block verified and copied from LMDB's map into its place;
its bytes are what the block-by-block read encodes. A damaged block sends the chunk through the block-by-block
read: counted, not sent, nor any block after it in its run. Real LMDB in a temp dir."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.fleet_repair import FleetRepairer
from kvstore.config_sections import StoreSettings
from kvstore.geometry import TINY
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from kvstore.v1 import fleet_pb2 as pb
from tests.damage import corrupt
from tiers import run_index
from tiers.lmdb_tier import LmdbBlockTier

TOKENS = 16
RUN_BLOCKS = 8
BLOCK = TINY.block_bytes(TOKENS)
SCOPE = BlockScope(TINY.fingerprint, "default")


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[tuple[Any, list[Any], list[bytes]]]:
    """A store holding one run of RUN_BLOCKS blocks, its third pinned; a stand-in repairer over it, its run's
    blocks as a pass plans them, and their bytes."""
    tier = LmdbBlockTier(StoreSettings(data_dir=tmp_path / "s", capacity_bytes=1 << 28, block_tokens=TOKENS,
                                       pin_max_hours=200.0, pin_budget_bytes=1 << 24))
    try:
        run_index.enable(tier.env, RUN_BLOCKS)
        parent = root_hash(TINY.fingerprint, TOKENS)
        hashes = chain_hashes(list(range(RUN_BLOCKS * TOKENS)), block_tokens=TOKENS, parent=parent)
        blocks = [os.urandom(BLOCK) for _ in range(RUN_BLOCKS)]
        tier.put(SCOPE, parent, hashes, blocks, True)
        assert tier.pin(SCOPE, hashes[2], tier.retention_clock.now() + 3600).until_s
        repairer = SimpleNamespace(tier=tier, _names=run_index.namespace_names(tier.env))
        repairer._read_in_place = FleetRepairer._read_in_place.__get__(repairer)
        yield repairer, run_index.members(tier.env, SCOPE.key(hashes[0]), RUN_BLOCKS), blocks
    finally:
        tier.close()


def read(repairer: Any, chunk: list[Any]) -> tuple[bytes, int, int, int, dict[bytes, float]]:
    return FleetRepairer._read(repairer, chunk, set())  # type: ignore[arg-type]


def test_f18c_the_batch_copied_in_place_is_the_block_by_block_encoding(stored: Any) -> None:
    repairer, chunk, blocks = stored
    in_place = read(repairer, chunk)
    assert repairer._read_in_place(chunk, set(), in_place[4]) == (in_place, 0)  # it answered: all intact
    repairer._read_in_place = lambda *args: (None, 0)  # the block-by-block read alone
    by_block = read(repairer, chunk)
    assert in_place == by_block
    request, count, size, damaged, pins = in_place
    assert (count, size, damaged) == (RUN_BLOCKS, RUN_BLOCKS * BLOCK, 0)
    assert list(pins) == [chunk[2].key]
    parsed = pb.CopyBlocksRequest.FromString(request)
    assert [b.data for b in parsed.blocks] == blocks and [b.key for b in parsed.blocks] == [b.key for b in chunk]
    assert [b.pin_until_s > 0 for b in parsed.blocks] == [i == 2 for i in range(RUN_BLOCKS)]


def test_f18c_a_damaged_block_is_counted_and_neither_it_nor_what_follows_it_is_sent(stored: Any,
                                                                                   tmp_path: Path) -> None:
    repairer, chunk, blocks = stored
    data_file = tmp_path / "s" / "data.mdb"
    corrupt(data_file, blocks[5])
    request, count, size, damaged, _ = read(repairer, chunk)
    assert (count, size, damaged) == (5, 5 * BLOCK, 1)
    assert [b.data for b in pb.CopyBlocksRequest.FromString(request).blocks] == blocks[:5]
