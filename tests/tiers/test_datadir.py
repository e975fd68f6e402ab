"""The data dir's lock and the checks made before LMDB maps a store (tiers/datadir.py, docs/OPERATIONS.md)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvstore.clock import ManualClock
from kvstore.config import GiB, StoreSettings
from kvstore.errors import ConfigError
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tiers import datadir
from tiers.datadir import IDENTITY_NAME, LOCK_NAME, DataDirBusy, open_environment
from tiers.lmdb_tier import LmdbBlockTier

SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
ROOT = root_hash(V4_1_FLASH.fingerprint, 16)


@pytest.fixture
def settings(tmp_path: Path) -> StoreSettings:
    return StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 24, block_tokens=16)


def filled(settings: StoreSettings, chains: int = 12, length: int = 6, size: int = 1024) -> list[list[bytes]]:
    """A store with `chains` chains of `length` blocks, closed."""
    tier = LmdbBlockTier(settings, clock=ManualClock())
    out = []
    for c in range(chains):
        hashes = chain_hashes(list(range(c * 1000, c * 1000 + 16 * length)), block_tokens=16, parent=ROOT)
        tier.put(SCOPE, ROOT, hashes, [os.urandom(size) for _ in hashes], True)
        out.append(hashes)
    tier.close()
    return out


# -- the lock (issue 9 item 7) -----------------------------------------------------------


def test_a_second_open_in_another_process_is_refused_naming_the_holder(settings: StoreSettings) -> None:
    env, lock = open_environment(settings)
    try:
        code = ("import sys; from pathlib import Path; from kvstore.config import StoreSettings; "
                "from tiers.datadir import open_environment; from kvstore.errors import ConfigError\n"
                f"try: open_environment(StoreSettings(data_dir=Path({str(settings.data_dir)!r}), "
                "capacity_bytes=1 << 24))\n"
                "except ConfigError as e: print(e.message); sys.exit(3)")
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        env.close()
        lock.release()
    assert other.returncode == 3, other.stderr
    assert str(settings.data_dir) in other.stdout
    assert f"pid {os.getpid()}" in other.stdout


def test_a_second_open_in_this_process_is_refused(settings: StoreSettings) -> None:
    tier = LmdbBlockTier(settings)
    try:
        with pytest.raises(DataDirBusy, match=f"pid {os.getpid()}"):
            LmdbBlockTier(settings)
    finally:
        tier.close()


def test_closing_the_tier_releases_the_lock(settings: StoreSettings) -> None:
    LmdbBlockTier(settings).close()
    again = LmdbBlockTier(settings)  # would be refused if close() kept the lock
    again.close()
    assert json.loads((settings.data_dir / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_refused_open_leaves_nothing_held(settings: StoreSettings) -> None:
    filled(settings, chains=1)
    data = settings.data_dir / "data.mdb"
    os.truncate(data, 8192)
    with pytest.raises(ConfigError):
        open_environment(settings)
    os.unlink(data)
    (settings.data_dir / IDENTITY_NAME).unlink()
    env, lock = open_environment(settings)  # the lock was released by the refusal
    env.close()
    lock.release()


# -- what the data dir is (issue 9 item 17) --------------------------------------------------


def test_a_data_dir_that_is_a_file_says_so(settings: StoreSettings) -> None:
    settings.data_dir.write_text("not a folder")
    with pytest.raises(ConfigError) as info:
        open_environment(settings)  # mkdir said "[Errno 17] File exists"
    assert info.value.message == f"store.data_dir {settings.data_dir} is a file, not a folder"


def test_a_data_dir_below_a_file_says_so(settings: StoreSettings) -> None:
    settings.data_dir.write_text("not a folder")
    below = StoreSettings(data_dir=settings.data_dir / "store", capacity_bytes=1 << 24)
    with pytest.raises(ConfigError, match="a part of that path is a file"):
        open_environment(below)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any mode bits: see the EROFS test below")
def test_a_data_dir_without_write_permission_is_refused(settings: StoreSettings) -> None:
    settings.data_dir.mkdir()
    settings.data_dir.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="not writable"):
            open_environment(settings)
    finally:
        settings.data_dir.chmod(0o755)


def test_a_data_dir_this_user_cannot_write_is_refused_even_with_its_files_in_place(
        settings: StoreSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dir made read-only after a store was created keeps a writable lock file and data.mdb,
    so only its own mode says the identity cannot be written (os.access, as the store's user)."""
    filled(settings, chains=1)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == settings.data_dir
                        else real_access(path, mode))
    with pytest.raises(ConfigError, match="not writable by this user"):
        open_environment(settings)


def test_lmdb_refusing_the_dir_is_a_config_error(settings: StoreSettings) -> None:
    (settings.data_dir / "lock.mdb").mkdir(parents=True)  # LMDB cannot open its lock file
    with pytest.raises(ConfigError, match="LMDB cannot open"):
        open_environment(settings)


def test_a_data_file_that_is_a_folder_says_so(settings: StoreSettings) -> None:
    (settings.data_dir / "data.mdb").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"data\.mdb is not a file"):
        open_environment(settings)


def test_a_read_only_file_system_is_refused(settings: StoreSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI runs as root, which mode bits do not stop, and may not mount: the read-only file
    system is simulated where the store first writes, creating its lock file (EROFS)."""
    settings.data_dir.mkdir()
    real_open = os.open

    def read_only(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if flags & (os.O_RDWR | os.O_WRONLY | os.O_CREAT) and str(path).startswith(str(settings.data_dir)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match="read-only file system"):
        open_environment(settings)


def test_a_capacity_above_the_disk_is_refused_naming_both(settings: StoreSettings) -> None:
    settings.data_dir.mkdir()
    free = os.statvfs(settings.data_dir).f_bavail * os.statvfs(settings.data_dir).f_frsize
    too_big = StoreSettings(data_dir=settings.data_dir, capacity_bytes=free + 64 * GiB)
    with pytest.raises(ConfigError) as info:
        open_environment(too_big)
    assert str(too_big.capacity_bytes) in info.value.message and "free" in info.value.message
    assert "lower store.capacity_bytes" in info.value.hint


def test_the_capacity_check_counts_what_the_store_already_holds(settings: StoreSettings,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    filled(settings, chains=2)
    used = (settings.data_dir / "data.mdb").stat().st_blocks * 512
    full = type("Usage", (), {"free": 0})
    monkeypatch.setattr(datadir.shutil, "disk_usage", lambda _: full)
    env, lock = open_environment(StoreSettings(data_dir=settings.data_dir, capacity_bytes=used))
    env.close()
    lock.release()
    assert "warning" not in capsys.readouterr().err
    # Above free + used: a store holding blocks still opens (they stay readable), with a warning.
    env, lock = open_environment(StoreSettings(data_dir=settings.data_dir, capacity_bytes=used + 1))
    env.close()
    lock.release()
    err = capsys.readouterr().err
    assert "0 bytes free" in err and "stay readable" in err


def test_a_new_store_whose_disk_is_full_is_refused(settings: StoreSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    settings.data_dir.mkdir()
    full = type("Usage", (), {"free": 0})
    monkeypatch.setattr(datadir.shutil, "disk_usage", lambda _: full)
    with pytest.raises(ConfigError, match="0 bytes free"):
        open_environment(StoreSettings(data_dir=settings.data_dir, capacity_bytes=1 << 20))


# -- a damaged data file (issue 9 item 15) -------------------------------------------------------


@pytest.mark.parametrize("keep", [0.5, 8192])
def test_a_truncated_data_file_is_refused_before_lmdb_maps_it(settings: StoreSettings, keep: float) -> None:
    filled(settings)
    data = settings.data_dir / "data.mdb"
    os.truncate(data, int(data.stat().st_size * keep) if keep < 1 else int(keep))
    with pytest.raises(ConfigError, match="truncated") as info:
        open_environment(settings)  # LMDB itself would die of SIGBUS on the first read past the end
    assert str(data) in info.value.message
    assert "kvstore check" in info.value.hint and "--repair" in info.value.hint


@pytest.mark.parametrize("how", ["empty", "missing"])
def test_a_data_file_emptied_or_gone_under_its_identity_is_refused(settings: StoreSettings, how: str) -> None:
    filled(settings, chains=1)
    data = settings.data_dir / "data.mdb"
    if how == "empty":
        os.truncate(data, 0)
    else:
        data.unlink()
    with pytest.raises(ConfigError, match=how) as info:
        open_environment(settings)  # LMDB would start an empty store and drop every block silently
    assert str(data) in info.value.message and "move" in info.value.hint


def test_the_identity_is_written_when_a_store_is_created_and_for_an_older_store(settings: StoreSettings) -> None:
    env, lock = open_environment(settings)
    env.close()
    lock.release()
    identity = json.loads((settings.data_dir / IDENTITY_NAME).read_text())
    assert identity["format_version"] == datadir.FORMAT_VERSION and len(identity["store_id"]) == 32
    (settings.data_dir / IDENTITY_NAME).unlink()  # a store from before the identity file
    env, lock = open_environment(settings)
    env.close()
    lock.release()
    assert (settings.data_dir / IDENTITY_NAME).exists()


def test_damaged_header_pages_are_refused(settings: StoreSettings) -> None:
    filled(settings, chains=1)
    data = settings.data_dir / "data.mdb"
    with data.open("r+b") as f:
        f.write(bytes(64))
    with pytest.raises(ConfigError, match="header page 0 is damaged"):
        open_environment(settings)


def test_a_damaged_leaf_page_is_refused_at_start(settings: StoreSettings, zero_leaves: Any) -> None:
    chains = filled(settings)
    data = settings.data_dir / "data.mdb"
    assert zero_leaves(data, SCOPE.key(chains[4][2]) + b"m")
    with pytest.raises(ConfigError, match="damaged page") as info:
        open_environment(settings)  # LMDB aborts the process when a cursor steps onto it
    assert str(data) in info.value.message and "--repair" in info.value.hint


def test_damaged_state_records_are_a_clear_error_not_a_decode_error(settings: StoreSettings) -> None:
    filled(settings, chains=1)
    env = lmdb.open(str(settings.data_dir), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(b"counters", b"\xff\xfe{garbage", db=env.open_db(b"state", txn=txn))
    env.close()
    with pytest.raises(ConfigError, match="state records are damaged"):
        open_environment(settings)


def test_a_tier_that_fails_after_opening_leaves_the_dir_unlocked(settings: StoreSettings,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tiers import usage

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a failure while reading the store's state")

    monkeypatch.setattr(usage, "check_and_repair", broken)
    with pytest.raises(RuntimeError):
        LmdbBlockTier(settings)
    monkeypatch.undo()
    LmdbBlockTier(settings).close()  # would be refused (DataDirBusy) had the failed open kept the lock


def test_counters_written_by_another_version_are_read(settings: StoreSettings) -> None:
    import lmdb

    LmdbBlockTier(settings).close()
    env = lmdb.open(str(settings.data_dir), max_dbs=8)
    with env.begin(write=True, db=env.open_db(b"state")) as txn:
        txn.put(b"counters", json.dumps({"puts": 7, "a_future_counter": 3, "gets": "x"}).encode())
    env.close()
    tier = LmdbBlockTier(settings)
    try:
        assert tier.stats().counters.puts == 7 and tier.stats().counters.gets == 0
    finally:
        tier.close()
