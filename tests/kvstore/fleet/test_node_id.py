"""The node id kept in the data dir (docs/FLEET.md F1): a restarted node is the same node, a wiped one is new."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvstore.config import StoreSettings
from kvstore.errors import ConfigError
from tiers import datadir
from tiers.lmdb_tier import LmdbBlockTier


def opened(data_dir: Path) -> str:
    """Open a real store in `data_dir`, close it, and return its node id."""
    tier = LmdbBlockTier(StoreSettings(data_dir=data_dir, capacity_bytes=1 << 26, block_tokens=16))
    tier.close()
    return datadir.node_id(data_dir)


def test_f1_a_restarted_node_keeps_its_id(tmp_path: Path) -> None:
    first = opened(tmp_path / "store")
    assert len(first) == 32 and int(first, 16) >= 0
    assert opened(tmp_path / "store") == first == datadir.read_identity(tmp_path / "store")["store_id"]  # type: ignore[index]


def test_f1_a_wiped_data_dir_is_a_new_node(tmp_path: Path) -> None:
    first = opened(tmp_path / "store")
    shutil.rmtree(tmp_path / "store")
    assert opened(tmp_path / "store") != first
    assert opened(tmp_path / "other") not in (first, opened(tmp_path / "store"))


def test_f1_a_dir_that_never_held_a_store_has_no_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no store yet"):
        datadir.node_id(tmp_path)
    (tmp_path / datadir.IDENTITY_NAME).write_text("{damaged")
    with pytest.raises(ConfigError, match="is damaged"):
        datadir.node_id(tmp_path)
