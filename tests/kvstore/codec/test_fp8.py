"""FP8 SWA codec: E4M3 bit-exact against ml_dtypes, power-of-two scales, snapshot size and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.codec import fp8
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH, ModelGeometry

SMALL = ModelGeometry(name="small", num_layers=4, global_layers=V4_1_FLASH.global_layers[:0],
                      swa_window_tokens=8, swa_layers=3, swa_channels=64)


def make_window(geometry: ModelGeometry, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (geometry.swa_layers, geometry.swa_window_tokens, geometry.swa_channels)
    spread = torch.logspace(-6, 4, shape[1]).view(1, -1, 1)  # quiet and loud tokens
    return torch.randn(shape, generator=gen) * spread


def test_snapshot_bytes_adds_one_float32_scale_per_token_per_layer() -> None:
    assert fp8.snapshot_bytes(V4_1_FLASH) == 40 * 128 * 512 + 40 * 128 * 4


def test_codes_match_ml_dtypes_e4m3() -> None:
    ml = pytest.importorskip("ml_dtypes")
    x = make_window(SMALL)
    codes, scales = fp8.quantize(x)
    ref = (x.numpy() / scales.numpy()).astype(ml.float8_e4m3fn)  # exact: scales are powers of two
    assert np.array_equal(codes.view(torch.uint8).numpy(), ref.view(np.uint8))


def test_scales_are_smallest_power_of_two_that_fits() -> None:
    x = make_window(SMALL)
    _, scales = fp8.quantize(x)
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all()
    amax = x.abs().amax(-1, keepdim=True)
    assert (464 * scales >= amax).all() and (232 * scales < amax).all()


def test_snapshot_round_trip_shape_error_and_views() -> None:
    x = make_window(SMALL)
    data = fp8.encode_snapshot(SMALL, x)
    assert data.dtype == torch.uint8 and data.numel() == fp8.snapshot_bytes(SMALL)
    out = fp8.decode_snapshot(SMALL, bytes(data.numpy()))
    assert out.shape == x.shape
    loud = x.abs().amax(-1) > 1e-3
    rel = ((out - x).norm(dim=-1) / x.norm(dim=-1))[loud]
    assert rel.max() < 0.04  # E4M3: 3 mantissa bits, per-token range
    codes, _ = fp8.view_snapshot(SMALL, data)
    assert codes.data_ptr() == data.data_ptr()  # a view, not a copy
    assert torch.equal(fp8.encode_snapshot(SMALL, out), data)


def test_scale_bound_464_rounds_to_448_and_is_idempotent() -> None:
    x = torch.tensor([[464.0, 1.0], [230.0, 1.0], [448.0, -3.0]])
    codes, scales = fp8.quantize(x)
    assert scales.squeeze(-1).tolist() == [1.0, 0.5, 1.0]
    assert codes.float()[:, 0].tolist() == [448.0, 448.0, 448.0]
    again_codes, again_scales = fp8.quantize(fp8.dequantize(codes, scales))
    assert torch.equal(again_codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(again_scales, scales)


def test_all_zero_token_decodes_to_zero() -> None:
    x = make_window(SMALL)
    x[1, 2] = 0
    out = fp8.decode_snapshot(SMALL, fp8.encode_snapshot(SMALL, x))
    assert torch.equal(out[1, 2], torch.zeros(SMALL.swa_channels))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_raises(bad: float) -> None:
    x = make_window(SMALL)
    x[0, 0, 0] = bad
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        fp8.encode_snapshot(SMALL, x)


def test_wrong_shape_or_length_names_what_was_expected() -> None:
    with pytest.raises(InvalidArgument, match=r"shape \(3, 8, 64\)"):
        fp8.encode_snapshot(SMALL, torch.zeros(3, 8, 32))
    with pytest.raises(InvalidArgument, match=f"expected {fp8.snapshot_bytes(SMALL)} bytes"):
        fp8.decode_snapshot(SMALL, b"\0" * 10)
    with pytest.raises(InvalidArgument, match="float32, bfloat16 or float16"):
        fp8.quantize(torch.zeros(2, 4, dtype=torch.int64))
