"""SWA snapshot keys, sizes at each length T, resume rules and sealed records (no server, no torch)."""

from __future__ import annotations

import itertools

import pytest

from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY, V4_1_FLASH
from kvstore.prefix import chain_hashes, root_hash
from kvstore.swa_snapshot import (
    HEADER_BYTES,
    checksum,
    resume_length,
    seal,
    serves,
    snapshot_bytes,
    snapshot_key,
    snapshot_keys,
    unseal,
)

BLOCK = 16
ROOT = root_hash(V4_1_FLASH.fingerprint, BLOCK)


def test_size_of_v4_1_flash_is_a_window_of_528_byte_rows_in_40_layers() -> None:
    assert snapshot_bytes(V4_1_FLASH, 128) == snapshot_bytes(V4_1_FLASH, 4096) == 40 * 128 * 528 == 2_703_360


def test_an_odd_length_adds_the_raw_tail_of_the_three_ratio2_sources() -> None:
    tail = 3 * 2 * 512 * 4  # layers 2, 8, 14: fp32 kv[512] then fp32 score[512]
    assert snapshot_bytes(V4_1_FLASH, 129) == 2_703_360 + tail
    assert snapshot_bytes(V4_1_FLASH, 4097) == 2_703_360 + tail
    assert snapshot_bytes(V4_1_FLASH, 7) == 40 * 7 * 528 + tail


def test_a_length_below_the_window_holds_only_its_positions() -> None:
    assert snapshot_bytes(V4_1_FLASH, 100) == 40 * 100 * 528
    assert snapshot_bytes(V4_1_FLASH, 1) == 40 * 528 + 3 * 2 * 512 * 4
    # The tiny fixture: 5 layers, window 8, rows of 128 + 4 bytes, one ratio-2 source (layer 1).
    assert snapshot_bytes(TINY, 8) == snapshot_bytes(TINY, 64) == 5 * 8 * 132
    assert snapshot_bytes(TINY, 3) == 5 * 3 * 132 + 1 * 2 * 128 * 4


@pytest.mark.parametrize("bad", [0, -1, 2**64, 1.5, True, "3"])
def test_a_length_that_is_not_a_positive_u64_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="snapshot position"):
        snapshot_bytes(V4_1_FLASH, bad)  # type: ignore[arg-type]


def test_size_matches_the_codec() -> None:
    snapshot = pytest.importorskip("kvstore.codec.snapshot")
    torch = pytest.importorskip("torch")
    for geometry, t in itertools.product((V4_1_FLASH, TINY), (1, 6, 7, 8, 9, 128, 129, 300)):
        n = min(t, geometry.window)
        rows = torch.zeros(geometry.num_layers, n, geometry.window_row_bytes, dtype=torch.uint8)
        tail = torch.zeros(len(geometry.ratio2_source_layers), 2, geometry.head_dim) if t % 2 else None
        assert len(snapshot.join_snapshot(rows, tail, geometry=geometry)) == snapshot_bytes(geometry, t)


# -- resume rules (docs/SWA_POOL.md "Resume rules") ---------------------------------

W = V4_1_FLASH.window


def test_resume_an_even_length_at_or_above_the_window_serves_t_and_t_minus_1_only() -> None:
    for t in (W, W + 2, 1000):
        assert serves(V4_1_FLASH, t, t) and serves(V4_1_FLASH, t, t - 1)
        assert not serves(V4_1_FLASH, t, t - 2) and not serves(V4_1_FLASH, t, t + 1)


def test_resume_an_odd_length_serves_only_itself() -> None:
    for t in (1, 7, W - 1, W + 1, 1001):
        assert serves(V4_1_FLASH, t, t)
        assert not any(serves(V4_1_FLASH, t, r) for r in range(0, t))


def test_resume_an_even_length_below_the_window_serves_any_shorter_length() -> None:
    for t in (2, 64, W - 2):
        assert all(serves(V4_1_FLASH, t, r) for r in range(1, t + 1))
        assert not serves(V4_1_FLASH, t, 0) and not serves(V4_1_FLASH, t, t + 1)


def test_resume_the_tiny_window_is_its_own() -> None:
    assert serves(TINY, 6, 2) and not serves(TINY, 8, 6) and serves(TINY, 8, 7)


def test_resume_length_is_the_longest_length_served_under_the_limit() -> None:
    """resume_length against the brute-force maximum of `serves`, for every T and limit up to 2 windows."""
    for geometry in (V4_1_FLASH, TINY):
        top = 2 * geometry.window + 3
        for t, limit in itertools.product(range(1, top), range(0, top)):
            best = max((r for r in range(1, limit + 1) if serves(geometry, t, r)), default=None)
            assert resume_length(geometry, t, limit) == best, (geometry.name, t, limit)


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
    t = 37
    data = bytes(range(256)) * (snapshot_bytes(TINY, t) // 256) + bytes(snapshot_bytes(TINY, t) % 256)
    record = seal(TINY.fingerprint, t, data, checksum(data))
    assert len(record) == HEADER_BYTES + len(data)
    opened = unseal(record, TINY)
    assert opened is not None and (opened.data, opened.checksum, opened.position) == (data, checksum(data), t)
    flipped = bytearray(record)
    flipped[-1] ^= 1
    assert unseal(bytes(flipped), TINY) is None
    assert unseal(record, V4_1_FLASH) is None  # another geometry
    assert unseal(record[:-1], TINY) is None
    assert unseal(record[:10], TINY) is None


def test_a_sealed_record_whose_size_is_not_its_lengths_is_refused() -> None:
    """The size is checked against the T in the header: T 5's bytes under T 4, 6, 7 or 38 are corrupt."""
    data = bytes(snapshot_bytes(TINY, 5))
    assert unseal(seal(TINY.fingerprint, 5, data, checksum(data)), TINY) is not None
    for other in (4, 6, 7, 38):
        assert unseal(seal(TINY.fingerprint, other, data, checksum(data)), TINY) is None
    even = bytes(snapshot_bytes(TINY, 40))
    assert unseal(seal(TINY.fingerprint, 48, even, checksum(even)), TINY) is not None  # a full window either way


def test_a_record_of_the_earlier_format_is_refused() -> None:
    import struct

    data = bytes(snapshot_bytes(TINY, 8))
    old = struct.pack("<4sB8sQ", b"SWA1", 1, TINY.fingerprint, checksum(data)) + data
    assert unseal(old, TINY) is None


def test_a_damaged_length_in_the_header_is_caught_even_when_the_size_still_fits() -> None:
    """T 9 and T 11 have the same size on the tiny geometry (a full window and a tail):
    the header's own checksum catches the flipped bit."""
    data = bytes(snapshot_bytes(TINY, 9))
    assert snapshot_bytes(TINY, 11) == len(data)
    record = bytearray(seal(TINY.fingerprint, 9, data, checksum(data)))
    at = record.index((9).to_bytes(8, "little"))
    record[at] ^= 0b10  # 9 -> 11
    assert unseal(bytes(record), TINY) is None
