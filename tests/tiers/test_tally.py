"""The tally's saved counters (tiers/tally.py): the bytes every write persists (R13)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import lmdb

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers.accounting import Counters, WriteRate
from tiers.lmdb_tier import LmdbBlockTier
from tiers.tally import Tally
from tiers.usage import Usage

SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
ROOT = root_hash(V4_1_FLASH.fingerprint, 16)


def test_saved_counters_are_the_json_of_every_field_in_order() -> None:
    # Each field a different value, so a name read from the wrong field, or one left out, shows.
    names = [f.name for f in dataclasses.fields(Counters)]
    counters = Counters(**{name: 1000 + i for i, name in enumerate(names)})
    saved = Tally(counters, Usage(), WriteRate(3600.0, 0.0)).saved()
    # The bytes stores have always held (`dataclasses.asdict`'s JSON): an older server reads them as before.
    assert saved == json.dumps(dataclasses.asdict(counters)).encode()
    assert list(json.loads(saved)) == names
    assert Counters.load(saved) == counters


def test_a_puts_counters_are_read_back_after_a_restart(tmp_path: Path) -> None:
    settings = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 24, block_tokens=16)
    tier = LmdbBlockTier(settings, clock=ManualClock())
    hashes = chain_hashes(list(range(16 * 3)), block_tokens=16, parent=ROOT)
    tier.put(SCOPE, ROOT, hashes, [os.urandom(1024) for _ in hashes], True)
    tier.close()
    env = lmdb.open(str(settings.data_dir), max_dbs=8, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"state", create=False)) as txn:
        raw = txn.get(b"counters")
    env.close()
    assert raw is not None
    stored = json.loads(raw)
    assert stored["puts"] == 1 and stored["blocks_written"] == 3 and stored["bytes_written"] == 3 * 1024
    reopened = LmdbBlockTier(settings, clock=ManualClock())
    try:
        counters = reopened.stats().counters
        assert (counters.puts, counters.blocks_written, counters.bytes_written) == (1, 3, 3 * 1024)
    finally:
        reopened.close()
