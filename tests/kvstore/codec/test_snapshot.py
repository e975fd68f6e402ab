"""SWA snapshots as bytes: window rows in layer and position order, then the raw tail at an odd T."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kvstore.codec.rows import decode_swa_rows, swa_rows
from kvstore.codec.snapshot import decode_snapshot, encode_snapshot, join_snapshot, split_snapshot
from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY, V4_1_FLASH
from kvstore.swa_snapshot import snapshot_bytes


def _rows(geometry, n: int, seed: int = 0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (geometry.num_layers, n, geometry.window_row_bytes), dtype=torch.uint8, generator=g)


def _tail(geometry, seed: int = 1) -> torch.Tensor:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(geometry.ratio2_source_layers), 2, geometry.head_dim, generator=g)


def test_an_even_snapshot_is_the_window_rows_layer_by_layer_in_position_order() -> None:
    rows = _rows(V4_1_FLASH, 128)
    data = join_snapshot(rows, None)
    assert len(data) == 2_703_360 == snapshot_bytes(V4_1_FLASH, 1000)
    # Layer 7's row of the 5th window position starts at (7 * 128 + 5) * 528.
    at = (7 * 128 + 5) * 528
    assert data[at:at + 528] == rows[7, 5].numpy().tobytes()
    back, tail = split_snapshot(data, 1000)
    assert tail is None and torch.equal(back, rows)


def test_an_odd_snapshot_ends_with_each_ratio2_sources_kv_then_score_in_float32_le() -> None:
    rows, tail = _rows(V4_1_FLASH, 128), _tail(V4_1_FLASH)
    data = join_snapshot(rows, tail)
    assert len(data) == snapshot_bytes(V4_1_FLASH, 1001) == 2_703_360 + 12_288
    # Layer 8 (the second ratio-2 source): its score's channel 3.
    at = 2_703_360 + (1 * 2 + 1) * 512 * 4 + 3 * 4
    assert struct.unpack("<f", data[at:at + 4])[0] == tail[1, 1, 3].item()
    back_rows, back_tail = split_snapshot(data, 1001)
    assert torch.equal(back_rows, rows) and back_tail is not None and torch.equal(back_tail, tail)


def test_a_short_prompt_holds_only_its_own_positions() -> None:
    for t in (5, 6):
        rows = _rows(TINY, t)
        tail = _tail(TINY) if t % 2 else None
        data = join_snapshot(rows, tail, geometry=TINY)
        assert len(data) == snapshot_bytes(TINY, t)
        back_rows, back_tail = split_snapshot(data, t, TINY)
        assert back_rows.shape == (5, t, 132) and torch.equal(back_rows, rows)
        assert (back_tail is None) == (tail is None)


def test_split_returns_views_of_the_buffer() -> None:
    data = bytearray(join_snapshot(_rows(TINY, 8), _tail(TINY), geometry=TINY))
    rows, tail = split_snapshot(data, 9, TINY)
    assert tail is not None
    data[0] ^= 0xFF
    data[-4:] = struct.pack("<f", 2.5)
    assert rows[0, 0, 0].item() == data[0] and tail[-1, -1, -1].item() == 2.5


def test_split_of_a_uint8_tensor_stays_on_its_device() -> None:
    data = torch.frombuffer(bytearray(join_snapshot(_rows(TINY, 4), None, geometry=TINY)), dtype=torch.uint8)
    rows, tail = split_snapshot(data, 4, TINY)
    assert tail is None and rows.data_ptr() == data.data_ptr()


def test_encode_quantizes_the_window_with_swa_rows_and_decode_gives_it_back() -> None:
    window = torch.randn(TINY.num_layers, 8, TINY.head_dim) * 3
    tail = _tail(TINY)
    data = encode_snapshot(window, tail, geometry=TINY)
    rows, back_tail = split_snapshot(data, 41, TINY)
    assert torch.equal(rows, swa_rows(window)) and back_tail is not None and torch.equal(back_tail, tail)
    values, _ = decode_snapshot(data, 41, TINY)
    assert torch.equal(values, decode_swa_rows(swa_rows(window)))
    again, _ = decode_snapshot(encode_snapshot(values, tail, geometry=TINY), 41, TINY)
    assert torch.equal(again, values)  # decoded values come back as they are


def test_wrong_sizes_and_shapes_are_refused_naming_what_is_expected() -> None:
    rows = _rows(TINY, 8)
    with pytest.raises(InvalidArgument, match=r"expected 5280 bytes"):
        split_snapshot(b"\0" * 10, 8, TINY)
    with pytest.raises(InvalidArgument, match="snapshot position"):
        split_snapshot(b"", 0, TINY)
    with pytest.raises(InvalidArgument, match=r"uint8 \[5, n, 132\]"):
        join_snapshot(rows[:, :, :100], None, geometry=TINY)
    with pytest.raises(InvalidArgument, match=r"1 <= n <= 8"):
        join_snapshot(_rows(TINY, 9), None, geometry=TINY)
    with pytest.raises(InvalidArgument, match=r"float32 \[1, 2, 128\]"):
        join_snapshot(rows, torch.zeros(3, 2, 128), geometry=TINY)
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        join_snapshot(rows, torch.full((1, 2, 128), float("inf")), geometry=TINY)
    with pytest.raises(InvalidArgument, match="odd: it needs its raw tail"):
        join_snapshot(_rows(TINY, 5), None, geometry=TINY)
    with pytest.raises(InvalidArgument, match="even: it has no raw tail"):
        join_snapshot(_rows(TINY, 4), _tail(TINY), geometry=TINY)
    with pytest.raises(InvalidArgument, match=r"snapshot window: expected a float \[5, n, 128\] .*got \(5, 8, 64\)"):
        encode_snapshot(torch.zeros(5, 8, 64), None, geometry=TINY)
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        encode_snapshot(torch.full((5, 8, 128), float("nan")), None, geometry=TINY)


# -- numpy arrays and buffers (kvstore.codec.arrays): what Client.swa.put takes ---------------

@pytest.mark.parametrize("t", [1000, 1001, 5, 6])
def test_join_of_numpy_rows_and_tail_is_the_same_bytes_as_of_tensors(t: int) -> None:
    geometry = V4_1_FLASH if t > 100 else TINY
    rows = _rows(geometry, min(t, geometry.window), seed=t)
    tail = _tail(geometry) if t % 2 else None
    expected = join_snapshot(rows, tail, geometry=geometry)
    assert join_snapshot(rows.numpy(), None if tail is None else tail.numpy(), geometry=geometry) == expected
    for kind in (bytes, bytearray, memoryview):  # the window rows as one buffer of their bytes
        assert join_snapshot(kind(rows.numpy().tobytes()), tail, geometry=geometry) == expected


def test_split_and_decode_of_a_numpy_snapshot_give_numpy() -> None:
    rows, tail = _rows(TINY, 8), _tail(TINY)
    data = np.frombuffer(bytearray(join_snapshot(rows, tail, geometry=TINY)), dtype=np.uint8)
    back_rows, back_tail = split_snapshot(data, 9, TINY)
    assert isinstance(back_rows, np.ndarray) and isinstance(back_tail, np.ndarray)
    assert np.array_equal(back_rows, rows.numpy()) and np.array_equal(back_tail, tail.numpy())
    assert back_tail.dtype == np.float32 and np.shares_memory(back_rows, data) and np.shares_memory(back_tail, data)
    values, value_tail = decode_snapshot(data, 9, TINY)
    assert isinstance(values, np.ndarray)  # random bytes decode to some NaNs: compared bit for bit
    assert np.array_equal(values.view(np.uint32), decode_swa_rows(rows).numpy().view(np.uint32))
    assert isinstance(value_tail, np.ndarray) and np.array_equal(value_tail, tail.numpy())
    even_rows, none = split_snapshot(data[:5 * 8 * 132], 8, TINY)
    assert none is None and isinstance(even_rows, np.ndarray)
    frozen = np.frombuffer(join_snapshot(rows, None, geometry=TINY), dtype=np.uint8)
    assert not split_snapshot(frozen, 8, TINY)[0].flags.writeable  # read-only in, read-only views out


def test_encode_of_numpy_window_is_the_same_bytes_as_of_a_tensor() -> None:
    window = torch.randn(TINY.num_layers, 8, TINY.head_dim) * 3
    tail = _tail(TINY)
    expected = encode_snapshot(window, tail, geometry=TINY)
    assert encode_snapshot(window.numpy(), tail.numpy(), geometry=TINY) == expected
    assert encode_snapshot(window.half().numpy(), None, geometry=TINY) == encode_snapshot(window.half(), None,
                                                                                         geometry=TINY)


def test_wrong_types_are_refused_naming_what_is_accepted() -> None:
    rows = _rows(TINY, 8)
    with pytest.raises(InvalidArgument, match=r"snapshot window rows: expected uint8 \[5, n, 132\] .*as a torch "
                                              r"tensor, a numpy array, bytes, bytearray or memoryview; got list"):
        join_snapshot(rows.tolist(), None, geometry=TINY)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"snapshot window rows: expected uint8 .*got 100 bytes"):
        join_snapshot(bytes(100), None, geometry=TINY)
    with pytest.raises(InvalidArgument, match=r"snapshot window rows: expected uint8 .*got int16 \(5, 8, 132\)"):
        join_snapshot(rows.numpy().astype(np.int16), None, geometry=TINY)
    with pytest.raises(InvalidArgument, match=r"snapshot tail: expected float32 \[1, 2, 128\] .*got float64"):
        join_snapshot(_rows(TINY, 8), _tail(TINY).numpy().astype(np.float64), geometry=TINY)
    with pytest.raises(InvalidArgument, match=r"snapshot tail: expected .*as a torch tensor or a numpy array; "
                                              r"got bytes"):
        join_snapshot(_rows(TINY, 8), _tail(TINY).numpy().tobytes(), geometry=TINY)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"snapshot window: expected a float \[5, n, 128\] .*got str"):
        encode_snapshot("window", None, geometry=TINY)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"SWA snapshot at T = 8: expected a 1-D contiguous uint8 array"):
        split_snapshot(np.zeros(5280, dtype=np.float32), 8, TINY)
    with pytest.raises(InvalidArgument, match="numpy has no bfloat16"):
        decode_snapshot(np.zeros(5280, dtype=np.uint8), 8, TINY, dtype=torch.bfloat16)
