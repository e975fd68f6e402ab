"""What the codec takes: tensors as they are, numpy arrays and byte buffers without a copy (arrays.py rules 1-4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.codec import arrays, fp4, fp8
from kvstore.errors import InvalidArgument


def test_rule1_a_tensor_is_used_as_it_is() -> None:
    t = torch.zeros(3, 4)
    assert arrays.as_tensor(t, what="x", wants="anything") is t


def test_rule2_a_numpy_array_becomes_a_tensor_over_the_same_memory() -> None:
    a = np.zeros((3, 4), dtype=np.uint8)
    t = arrays.as_tensor(a, what="x", wants="uint8")
    a[1, 2] = 7  # the change shows through: no copy
    assert t.dtype == torch.uint8 and t.shape == (3, 4) and t[1, 2].item() == 7
    floats = arrays.as_tensor(np.ones(5, dtype=np.float16), what="x", wants="float")
    assert floats.dtype == torch.float16


def test_rule2_a_negative_stride_is_copied_or_refused_where_views_come_back() -> None:
    a = np.arange(10, dtype=np.uint8)
    t = arrays.as_tensor(a[::-1], what="x", wants="uint8")
    assert t.tolist() == list(range(9, -1, -1))
    with pytest.raises(InvalidArgument, match=r"x: a numpy array with a negative stride .*ascontiguousarray"):
        arrays.as_tensor(a[::-1], what="x", wants="uint8", views=True)


def test_rule2_a_dtype_torch_lacks_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match=r"x: numpy array of dtype <U1 has no torch equivalent"):
        arrays.as_tensor(np.array(["a"]), what="x", wants="uint8")


def test_rule3_buffers_are_uint8_views_of_their_bytes() -> None:
    data = bytearray(b"\x01\x02\x03")
    t = arrays.as_tensor(data, what="x", wants="bytes", buffers=True)
    data[0] = 9
    assert t.dtype == torch.uint8 and t.tolist() == [9, 2, 3]
    assert arrays.as_tensor(b"\x05", what="x", wants="bytes", buffers=True).tolist() == [5]
    assert arrays.as_tensor(memoryview(b"ab"), what="x", wants="bytes", buffers=True).tolist() == [97, 98]
    assert arrays.as_tensor(b"", what="x", wants="bytes", buffers=True).numel() == 0


def test_rule3_a_buffer_that_is_strided_or_not_bytes_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="x: expected a contiguous buffer"):
        arrays.as_tensor(memoryview(b"abcd")[::2], what="x", wants="bytes", buffers=True)
    with pytest.raises(InvalidArgument, match=r"x: buffer has 4-byte items \(format 'f'\)"):
        arrays.as_tensor(memoryview(np.zeros(2, dtype=np.float32)), what="x", wants="bytes", buffers=True)


def test_rule3_buffers_only_where_the_argument_is_bytes() -> None:
    with pytest.raises(InvalidArgument, match=r"x: expected float \[n, 4\], as a torch tensor or a numpy array; "
                                              r"got bytes"):
        arrays.as_tensor(b"abcd", what="x", wants="float [n, 4]")
    with pytest.raises(InvalidArgument, match=r"as a torch tensor, a numpy array, bytes, bytearray or memoryview; "
                                              r"got list"):
        arrays.as_tensor([1, 2], what="x", wants="bytes", buffers=True)


def test_rule4_numpy_back_shares_memory_and_keeps_read_only() -> None:
    t = torch.arange(4, dtype=torch.uint8)
    a = arrays.to_numpy(t)
    t[0] = 9
    assert a[0] == 9 and a.flags.writeable
    assert not arrays.to_numpy(t, read_only=True).flags.writeable
    frozen = np.zeros(3, dtype=np.uint8)
    frozen.flags.writeable = False
    assert arrays.is_read_only(frozen) and not arrays.is_read_only(np.zeros(3)) and not arrays.is_read_only(t)


def test_rule4_a_dtype_numpy_lacks_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="numpy has no bfloat16"):
        arrays.to_numpy(torch.zeros(2, dtype=torch.bfloat16))


@pytest.mark.parametrize("piece", [fp4.pack_nibbles, fp4.e2m1_values, fp8.ceil_power_of_two, fp8.ue8m0_bytes,
                                   fp8.ue8m0_values, lambda x: fp4.e2m1_codes(x, x)])
def test_the_fp4_and_fp8_pieces_say_they_want_a_torch_tensor(piece: object) -> None:
    with pytest.raises(InvalidArgument, match=r"expected a torch tensor, got ndarray .*torch.from_numpy"):
        piece(np.zeros(4, dtype=np.float32))  # type: ignore[operator]
