"""`check_store`: what a check finds in a damaged store, and that a repair leaves one that serves."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import ConfigError
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import BlockMeta, child_key, data_key, lru_key, meta_key
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers.integrity import CheckReport, check_store
from tiers.lmdb_pages import PageReader, read_header
from tiers.lmdb_tier import LmdbBlockTier

SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
ROOT = root_hash(V4_1_FLASH.fingerprint, 16)
CHAINS, LENGTH, SIZE = 12, 6, 1024


@pytest.fixture
def settings(tmp_path: Path) -> StoreSettings:
    return StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 24, block_tokens=16)


@pytest.fixture
def chains(settings: StoreSettings) -> list[list[bytes]]:
    """A closed store of CHAINS chains of LENGTH blocks of SIZE bytes."""
    tier = LmdbBlockTier(settings, clock=ManualClock())
    out = []
    for c in range(CHAINS):
        hashes = chain_hashes(list(range(c * 1000, c * 1000 + 16 * LENGTH)), block_tokens=16, parent=ROOT)
        tier.put(SCOPE, ROOT, hashes, [os.urandom(SIZE) for _ in hashes], True)
        out.append(hashes)
    tier.close()
    return out


def edit(settings: StoreSettings) -> tuple[lmdb.Environment, dict[str, Any]]:
    env = lmdb.open(str(settings.data_dir), max_dbs=8)
    return env, {name: env.open_db(name.encode()) for name in ("records", "lru", "state")}


def found(settings: StoreSettings, chains: list[list[bytes]]) -> list[int]:
    """Blocks Lookup finds per chain, through the tier (which also proves the store opens)."""
    tier = LmdbBlockTier(settings, clock=ManualClock())
    try:
        return [tier.lookup(SCOPE, hashes)[0] for hashes in chains]
    finally:
        tier.close()


def repaired_and_clean(settings: StoreSettings) -> CheckReport:
    report = check_store(settings.data_dir, repair=True)
    assert report.repaired and not report.ok
    after = check_store(settings.data_dir, repair=False)
    assert after.ok, after.lines()
    return report


def test_a_sound_store_checks_ok(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    seen: list[tuple[int, int]] = []
    report = check_store(settings.data_dir, repair=False, progress=lambda done, total: seen.append((done, total)))
    assert report.ok, report.lines()
    assert (report.blocks_checked, report.bytes_checked) == (CHAINS * LENGTH, CHAINS * LENGTH * SIZE)
    assert report.usage_recorded == (CHAINS * LENGTH, CHAINS * LENGTH * SIZE)
    assert seen[-1][0] == seen[-1][1] > 0
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True
    assert report.lines()[-1].startswith("OK")


def test_a_corrupt_block_goes_with_its_descendants(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    env, dbs = edit(settings)
    with env.begin(write=True) as txn:
        txn.put(data_key(SCOPE.key(chains[3][2])), os.urandom(SIZE), db=dbs["records"])  # same size, new bytes
    env.close()
    report = check_store(settings.data_dir, repair=False)
    assert report.counts["damaged-block"] == 1 and report.counts["orphan-block"] == LENGTH - 3
    assert (report.blocks_dropped, report.blocks_kept) == (LENGTH - 2, CHAINS * LENGTH - (LENGTH - 2))
    assert "checksum" in " ".join(report.lines())
    assert found(settings, chains)[3] == LENGTH  # a check without --repair writes nothing
    repaired_and_clean(settings)
    counts = found(settings, chains)
    assert counts[3] == 2 and counts.count(LENGTH) == CHAINS - 1


def test_a_block_whose_size_differs_from_its_meta_is_damaged(settings: StoreSettings,
                                                             chains: list[list[bytes]]) -> None:
    env, dbs = edit(settings)
    with env.begin(write=True) as txn:
        txn.put(data_key(SCOPE.key(chains[0][5])), os.urandom(SIZE - 1), db=dbs["records"])
    env.close()
    report = check_store(settings.data_dir, repair=False)
    assert report.counts["damaged-block"] == 1 and report.blocks_dropped == 1
    assert "1023 bytes, meta says 1024" in " ".join(report.lines())


def test_a_meta_without_its_data_is_damaged(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    env, dbs = edit(settings)
    with env.begin(write=True) as txn:
        txn.delete(data_key(SCOPE.key(chains[0][5])), db=dbs["records"])
    env.close()
    report = check_store(settings.data_dir, repair=False)
    assert report.counts == {"damaged-block": 1, "stale-child-entry": 1, "stale-index-entry": 1}
    assert report.problems[0].detail == "meta record without data"


def test_orphans_of_a_missing_parent_are_dropped(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    env, dbs = edit(settings)
    middle = SCOPE.key(chains[5][1])
    with env.begin(write=True) as txn:
        txn.delete(data_key(middle), db=dbs["records"])
        txn.delete(meta_key(middle), db=dbs["records"])
    env.close()
    report = check_store(settings.data_dir, repair=False)
    assert report.counts["orphan-block"] == LENGTH - 2
    assert report.counts["damaged-block"] == 1  # the child entry left behind, with no meta
    repaired_and_clean(settings)
    assert found(settings, chains)[5] == 1


def test_index_entries_are_made_to_match_the_metas(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    key = SCOPE.key(chains[2][4])
    env, dbs = edit(settings)
    with env.begin(write=True) as txn:
        raw = txn.get(meta_key(key), db=dbs["records"])
        assert raw is not None
        meta = BlockMeta.unpack(raw)
        txn.delete(lru_key(meta.last_access_s, meta.depth, key), db=dbs["lru"])  # missing
        txn.put(lru_key(meta.last_access_s + 5, meta.depth, key), b"", db=dbs["lru"])  # stale
    env.close()
    report = check_store(settings.data_dir, repair=False)
    assert report.counts == {"missing-index-entry": 1, "stale-index-entry": 1}
    assert (report.entries_added, report.entries_dropped, report.blocks_dropped) == (1, 1, 0)
    repaired_and_clean(settings)
    env, dbs = edit(settings)
    with env.begin() as txn:
        assert txn.get(lru_key(meta.last_access_s, meta.depth, key), db=dbs["lru"]) is not None
    env.close()


def test_child_entries_are_made_to_match_the_blocks(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    parent, child = SCOPE.key(chains[1][2]), chains[1][3]
    env, dbs = edit(settings)
    with env.begin(write=True) as txn:
        txn.delete(child_key(parent, child), db=dbs["records"])  # missing: eviction would take the parent first
        txn.put(child_key(parent, b"\x07" * 32), b"", db=dbs["records"])  # stale: names no block
    env.close()
    report = check_store(settings.data_dir, repair=False)
    assert report.counts == {"missing-child-entry": 1, "stale-child-entry": 1}
    repaired_and_clean(settings)
    env, dbs = edit(settings)
    with env.begin() as txn:
        assert txn.get(child_key(parent, child), db=dbs["records"]) is not None
        assert txn.get(child_key(parent, b"\x07" * 32), db=dbs["records"]) is None
    env.close()


def test_usage_totals_are_rewritten_from_the_records(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    env, dbs = edit(settings)
    with env.begin(write=True) as txn:
        txn.put(b"usage", struct.pack("<QQ", 0, 0), db=dbs["state"])
    env.close()
    report = check_store(settings.data_dir, repair=False)
    assert report.counts == {"usage-mismatch": 1} and report.usage_recorded == (0, 0)
    repaired_and_clean(settings)
    tier = LmdbBlockTier(settings, clock=ManualClock())
    try:
        assert (tier.stats().blocks_stored, tier.stats().bytes_stored) == (CHAINS * LENGTH, CHAINS * LENGTH * SIZE)
    finally:
        tier.close()


def test_damaged_counters_are_reset(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    env, dbs = edit(settings)
    with env.begin(write=True) as txn:
        txn.put(b"counters", b"\xff{not json", db=dbs["state"])
    env.close()
    assert check_store(settings.data_dir, repair=False).counts == {"damaged-counters": 1}
    repaired_and_clean(settings)
    assert found(settings, chains) == [LENGTH] * CHAINS


def test_a_record_of_no_known_form_is_dropped(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    env, dbs = edit(settings)
    with env.begin(write=True) as txn:
        txn.put(b"stray", b"x", db=dbs["records"])
    env.close()
    assert check_store(settings.data_dir, repair=False).counts == {"unknown-record": 1}
    repaired_and_clean(settings)


def test_a_damaged_page_is_stepped_over_and_the_store_rebuilt(settings: StoreSettings, chains: list[list[bytes]],
                                                              zero_leaves: Any) -> None:
    data = settings.data_dir / "data.mdb"
    assert zero_leaves(data, meta_key(SCOPE.key(chains[7][3])))
    report = check_store(settings.data_dir, repair=False)  # LMDB's own cursor would abort the process here
    assert report.counts["damaged-page"] >= 1 and report.unreadable
    assert "records: page" in report.unreadable[0]
    assert report.blocks_dropped > 0 and report.blocks_kept > CHAINS * LENGTH // 2
    kept = report.blocks_kept
    report = repaired_and_clean(settings)
    assert "data.mdb.damaged" in " ".join(report.notes)
    counts = found(settings, chains)
    assert sum(counts) == kept and counts[0] == LENGTH


def test_pages_past_the_last_used_one_are_not_read(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    """A file may run past its last used page (pages of an uncommitted write): a tree pointing
    there points at stale bytes, however well-formed they look."""
    header = read_header(settings.data_dir / "data.mdb")
    with PageReader(path=settings.data_dir / "data.mdb",
                    header=dataclasses.replace(header, last_page=header.last_page // 2)) as reader:
        for name, tree in reader.named_trees().items():
            for _ in reader.entries(tree, name.decode()):
                pass
        assert any("past the last used page" in d.reason for d in reader.damaged)


def test_a_truncated_store_is_checked_and_salvaged(settings: StoreSettings, chains: list[list[bytes]]) -> None:
    data = settings.data_dir / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    report = check_store(settings.data_dir, repair=False)
    assert report.counts["truncated"] == 1 and report.counts["damaged-page"] >= 1
    report = repaired_and_clean(settings)
    assert sum(found(settings, chains)) == report.blocks_kept


def test_a_repair_is_refused_while_a_server_holds_the_store(settings: StoreSettings,
                                                            chains: list[list[bytes]]) -> None:
    code = ("import sys; from pathlib import Path; from kvstore.config import StoreSettings; "
            "from tiers.lmdb_tier import LmdbBlockTier\n"
            f"t = LmdbBlockTier(StoreSettings(data_dir=Path({str(settings.data_dir)!r}), capacity_bytes=1 << 24))\n"
            "print('open', flush=True); sys.stdin.readline(); t.close()")
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "open\n"
        with pytest.raises(ConfigError, match="while a server serves it") as info:
            check_store(settings.data_dir, repair=True)
        assert f"pid {server.pid}" in info.value.message
        report = check_store(settings.data_dir, repair=False)  # a live store may be checked read-only
        assert report.live and report.ok, report.lines()
    finally:
        server.communicate("\n", timeout=60)


def test_a_folder_without_a_store_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no store"):
        check_store(tmp_path, repair=False)
