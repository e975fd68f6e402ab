"""FP8 and UE8M0 pieces of the model's rows (power-of-two scales), and the old SWA codec.

`kvstore.codec.rows` builds the indexer and window rows from these:

- `ceil_power_of_two`: 2^ceil(log2 v) of a positive float32, exact (on the bits).
- `ue8m0_bytes`: the UE8M0 byte of a power-of-two scale (its biased exponent).
- `ue8m0_values`: the float32 value of UE8M0 bytes, 2^(byte-127).

The rest is the earlier SWA format (E4M3 codes with one float32 power-of-two
scale per token, bound 464, and snapshots of them): nothing stores it any more.
`quantize`, `dequantize` and the snapshot functions stay only until
kvstore/codec/snapshot.py has replaced every use (helper H10 removes the snapshot
functions) and tests/kvstore/test_fuzz_parsers.py fuzzes the rows decoders
instead of `dequantize`; then they go.
"""

from __future__ import annotations

import torch

from kvstore.codec.fp4 import CudaKernel, FusedKernel, check_finite, check_input
from kvstore.errors import InvalidArgument

#: amax/scale never exceeds this: the largest value that rounds to 448 (ties to even).
SCALE_BOUND = 464.0
#: Bytes of one per-token scale.
SCALE_BYTES = 4

_EXPONENT_MASK = 0x7F800000
_MANTISSA_MASK = 0x007FFFFF
_MIN_SCALE = 2.0**-126
_MAX_SCALE = 2.0**126


def ceil_power_of_two(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) for positive normal float32 v, exact: taken on the bits.

    The exponent of v, plus one when any mantissa bit is set, so a power of two
    maps to itself. No logarithm, so no rounding and the same on every device.
    """
    bits = v.view(torch.int32)
    up = ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    return ((bits & _EXPONENT_MASK) + (up << 23)).view(torch.float32)


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte of each normal power-of-two float32 scale: its biased exponent, as uint8."""
    return (scale.view(torch.int32) >> 23).to(torch.uint8)


def ue8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of each UE8M0 byte: 2^(byte-127); byte 0 is 2^-127, 0xFF is NaN."""
    b = codes.to(torch.int32)
    value = (b << 23).view(torch.float32)
    value = torch.where(b == 0, 2.0**-127, value)
    return torch.where(b == 0xFF, float("nan"), value)


def _power_of_two_at_least(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two p in [2^-126, 2^126] with 464*p >= amax (1 for amax 0)."""
    v = torch.clamp(amax / SCALE_BOUND, min=_MIN_SCALE, max=_MAX_SCALE)
    bits = v.view(torch.int32)
    # 2^ceil(log2 v): keep the exponent, and go one up if any mantissa bit is set.
    up = (bits & _MANTISSA_MASK) != 0
    p = ((bits & _EXPONENT_MASK) + up.to(torch.int32) * (1 << 23)).view(torch.float32)
    # amax/464 is rounded (approximate in a fused kernel); 464*p is exact.
    p = torch.where(SCALE_BOUND * p < amax, p * 2.0, p)
    p = torch.where((p > _MIN_SCALE) & (SCALE_BOUND * p * 0.5 >= amax), p * 0.5, p)
    return torch.where(amax > 0, p, 1.0)


@FusedKernel
def _quantize_tokens_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v = x.float()
    amax = v.abs().amax(dim=-1, keepdim=True)
    scale = _power_of_two_at_least(amax)
    # 1/p is an exact power of two, so the product is x/p exactly.
    codes = (v * (1.0 / scale)).to(torch.float8_e4m3fn)
    return codes, scale, amax


def _dequantize_tokens_torch(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scales).to(dtype)


# On CUDA, fused Triton kernels (kvstore/fp8_triton.py) with the same bytes; see fp4.CudaKernel.
_quantize_tokens = CudaKernel("fp8_triton", "quantize_tokens", _quantize_tokens_torch)
_dequantize_tokens = CudaKernel("fp8_triton", "dequantize_tokens", _dequantize_tokens_torch)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to FP8 E4M3 with one power-of-two float32 scale per vector (last dim).

    Args:
        x: float32, bfloat16 or float16 tensor `[..., C]`, on any device.

    Returns:
        `(codes, scales)`: codes float8_e4m3fn `[..., C]`, the round-to-nearest-
        even E4M3 value of x/scale; scales float32 `[..., 1]`, powers of two.

    Raises:
        InvalidArgument: wrong type, dtype or shape; NaN or Inf in x.
    """
    check_input(x, what="fp8.quantize", multiple=1)
    codes, scales, amax = _quantize_tokens(x)
    check_finite(amax, what="fp8.quantize")
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode FP8 codes and their per-vector scales (exact in float32).

    Raises:
        InvalidArgument: dtypes or shapes that do not fit together.
    """
    if codes.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise InvalidArgument(f"fp8.dequantize: expected float8_e4m3fn codes and float32 scales, "
                              f"got {codes.dtype} and {scales.dtype}")
    if tuple(scales.shape) != (*codes.shape[:-1], 1):
        raise InvalidArgument(f"fp8.dequantize: codes {tuple(codes.shape)} need scales of shape "
                              f"{(*codes.shape[:-1], 1)}, got {tuple(scales.shape)}")
    return _dequantize_tokens(codes, scales, dtype)
