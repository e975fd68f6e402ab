"""SWA snapshot keys, expected size and sealed records (no server)."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.geometry import REGISTRY, V4_1_FLASH
from kvstore.prefix import chain_hashes, root_hash
from kvstore.swa_snapshot import HEADER_BYTES, checksum, seal, snapshot_bytes, snapshot_key, snapshot_keys, unseal

BLOCK = 16
ROOT = root_hash(V4_1_FLASH.fingerprint, BLOCK)


def test_size_of_v4_1_flash_is_window_of_fp8_with_token_scales() -> None:
    assert snapshot_bytes(V4_1_FLASH) == 40 * 128 * 512 + 40 * 128 * 4


def test_size_matches_the_fp8_codec() -> None:
    fp8 = pytest.importorskip("kvstore.codec.fp8")
    for geometry in REGISTRY.values():
        assert snapshot_bytes(geometry) == fp8.snapshot_bytes(geometry)


def test_key_at_a_block_boundary_is_anchored_on_that_block() -> None:
    tokens = list(range(100))
    chain = chain_hashes(tokens, block_tokens=BLOCK, parent=ROOT)
    assert snapshot_keys(tokens, [32], block_tokens=BLOCK, root=ROOT) == [snapshot_key(chain[1], [], 32)]
    assert snapshot_keys(tokens, [37], block_tokens=BLOCK, root=ROOT) == [snapshot_key(chain[1], tokens[32:37], 37)]
    assert snapshot_keys(tokens, [5], block_tokens=BLOCK, root=ROOT) == [snapshot_key(ROOT, tokens[:5], 5)]


def test_keys_differ_by_position_tokens_and_extra_keys() -> None:
    tokens = list(range(100))
    a = snapshot_keys(tokens, [37, 38, 48], block_tokens=BLOCK, root=ROOT)
    other = snapshot_keys([*tokens[:36], 999, *tokens[37:]], [37], block_tokens=BLOCK, root=ROOT)
    salted = snapshot_keys(tokens, [37], block_tokens=BLOCK, root=ROOT, extra_keys=["adapter:x"])
    early = snapshot_keys([1, *tokens[1:]], [37], block_tokens=BLOCK, root=ROOT)
    assert len({*a, other[0], salted[0], early[0]}) == 6
    assert snapshot_keys(tokens[:37], [37], block_tokens=BLOCK, root=ROOT) == a[:1]  # later tokens do not matter


def test_positions_outside_the_tokens_are_rejected() -> None:
    with pytest.raises(InvalidArgument, match="outside"):
        snapshot_keys([1, 2, 3], [4], block_tokens=BLOCK, root=ROOT)


def test_sealed_record_round_trips_and_rejects_any_mismatch() -> None:
    fp = V4_1_FLASH.fingerprint
    data = bytes(range(256)) * 4
    record = seal(fp, data, checksum(data))
    assert len(record) == HEADER_BYTES + len(data)
    assert unseal(record, fingerprint=fp, size_bytes=len(data)) == (data, checksum(data))
    flipped = bytearray(record)
    flipped[-1] ^= 1
    assert unseal(bytes(flipped), fingerprint=fp, size_bytes=len(data)) is None
    assert unseal(record, fingerprint=b"\x00" * 8, size_bytes=len(data)) is None
    assert unseal(record, fingerprint=fp, size_bytes=len(data) - 1) is None
    assert unseal(record[:-1], fingerprint=fp, size_bytes=len(data)) is None
