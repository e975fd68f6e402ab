"""Record parsers meet damaged bytes: a typed DataLoss naming the record, never a struct.error."""

from __future__ import annotations

import pytest

from kvstore.errors import DataLoss
from kvstore.native.records import META_STRUCT, BlockMeta, lru_entry, lru_key


def test_a_meta_record_of_the_wrong_size_is_data_loss() -> None:
    good = BlockMeta(parent_hash=bytes(32), depth=1, size_bytes=8, checksum=1, created_s=1.0, last_access_s=2.0)
    assert BlockMeta.unpack(good.pack()) == good
    for size in (0, 17, META_STRUCT.size + 1):
        with pytest.raises(DataLoss, match=f"meta record \\({size} bytes\\)"):
            BlockMeta.unpack(bytes(size))


def test_a_short_lru_entry_is_data_loss() -> None:
    key = bytes(range(48))
    assert lru_entry(lru_key(12.5, 3, key)) == (12.5, key)
    for raw in (b"", b"]%x", bytes(12)):
        with pytest.raises(DataLoss, match="LRU index entry"):
            lru_entry(raw)
