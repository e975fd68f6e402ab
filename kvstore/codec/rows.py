"""The model's cache rows: DeepSeek-V4.1-Flash's own bytes for each cached vector.

Every row is `[quantized data][one-byte scales]` (docs/FORMAT.md;
docs/CODEC.md states the rules with measured errors):

| row | data | scales | bytes for d channels (V4.1: d) |
| --- | --- | --- | --- |
| compressed KV | E2M1, 2 per byte | E4M3, one per 16 channels | d/2 + d/16 (512: 288) |
| indexer key | E2M1, 2 per byte | UE8M0, one per 32 channels | d/2 + d/32 (128: 68) |
| window (SWA) KV | E4M3 | UE8M0, one per 32 channels | d + d/32 (512: 528) |

Rules, as the model computes them (its fake-quantization):

1. E2M1 codes: bit 3 sign, bits 2-0 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}; byte i
   holds element 2i in the low nibble and 2i+1 in the high nibble. The code is
   x/scale clamped to +-6 and rounded to nearest, ties to the even code; a value
   with the sign bit set that rounds to 0 keeps it (0x8), -0.0 included.
2. Compressed KV scale: amax of 16 channels, floored at 6*2^-9; scale = amax/6
   rounded to the nearest E4M3 value, ties to even, subnormal scales (down to
   2^-9) allowed. Byte = the float8_e4m3fn bits. amax/6 above 448 (amax > 2688,
   which the model's normalised values never reach) is held at 448: a plain cast
   would give NaN.
3. Indexer scale: amax of 32 channels, floored at 6*2^-126; scale = the power of
   two at or above amax*(1/6), the product taken in float32 as the engines
   compute it (multiplying by the float32 reciprocal, not dividing), the
   exponent's ceiling taken exactly on its bits. Byte = UE8M0, the biased
   exponent: scale 2^(byte-127).
4. Window scale: amax of 32 channels, floored at 1e-4; scale = the power of two
   at or above amax*(1/448) (as rule 3). Data = float8_e4m3fn of x/scale, round
   to nearest even (x/scale is exact: a power of two; the model clamps it to
   +-448 first, which never changes it: scale >= amax/448 exactly).
5. Decoding is exact: code times scale in float32 (then cast to `dtype`).
6. NaN or Inf input raises InvalidArgument; so does a wrong dtype or width.

Idempotence (tests/kvstore/codec/test_rows.py): for every finite x,
decode(rows(decode(rows(x)))) == decode(rows(x)) bit for bit for the indexer and
window rows, and for compressed KV except groups whose amax lies in
[9*2^-9, 10*2^-9] (scale 2^-8 with largest code 4: re-quantized, they get scale
2^-9 and clip). The bytes themselves come back identical for compressed KV
outside that band; indexer and window rows whose largest code is small (indexer
3, window < 232) come back with half the scale and doubled codes: the same values.

CUDA: on CUDA tensors each function first tries a Triton kernel of
`kvstore.codec.rows_triton`, through `fp4.CudaKernel`:

- `rows_triton.compressed_kv_rows(x)`, `rows_triton.indexer_key_rows(x)`,
  `rows_triton.swa_rows(x)`: x as the caller passed it (float32, bfloat16 or
  float16, any leading shape, last dim checked), returning `(rows, flag)`:
  rows uint8 `[..., row_bytes]` (contiguous, x's device), flag a float32 tensor
  (any shape) with a non-finite element exactly when x has NaN or Inf.
- `rows_triton.decode_compressed_kv_rows(rows, dtype)`,
  `rows_triton.decode_indexer_key_rows(rows, dtype)`,
  `rows_triton.decode_swa_rows(rows, dtype)`: rows uint8 `[..., row_bytes]`,
  returning `[..., d]` of dtype.

Any of them may return None to decline an input; the torch code here runs then,
on CPU tensors, or when triton is missing. Both give the same bytes.

Each public function also takes a numpy array (float32 or float16 values, uint8
rows), computes on a CPU tensor over it, and gives numpy back
(`kvstore.codec.arrays`).
"""

from __future__ import annotations

from typing import overload

import numpy as np
import torch

from kvstore.codec.arrays import NDArray, as_tensor, dtype_name, to_numpy
from kvstore.codec.fp4 import CudaKernel, check_finite, check_input, e2m1_codes, e2m1_values, pack_nibbles
from kvstore.codec.fp8 import ceil_power_of_two, ue8m0_bytes, ue8m0_values
from kvstore.errors import InvalidArgument

#: Channels sharing one E4M3 scale in a compressed-KV row.
KV_GROUP = 16
#: Channels sharing one UE8M0 scale in indexer and window rows.
UE8M0_GROUP = 32
#: Floors of a group's amax, per row type (docs/FORMAT.md).
KV_AMAX_FLOOR = 6 * 2.0**-9
INDEXER_AMAX_FLOOR = 6 * 2.0**-126
WINDOW_AMAX_FLOOR = 1e-4
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def compressed_kv_row_bytes(channels: int) -> int:
    """Bytes of one compressed-KV row of `channels` (512 -> 288)."""
    return channels // 2 + channels // KV_GROUP


def indexer_key_row_bytes(channels: int) -> int:
    """Bytes of one indexer-key row of `channels` (128 -> 68)."""
    return channels // 2 + channels // UE8M0_GROUP


def swa_row_bytes(channels: int) -> int:
    """Bytes of one window-KV row of `channels` (512 -> 528)."""
    return channels + channels // UE8M0_GROUP


def _groups(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as float32 `[..., d/size, size]` and each group's amax `[..., d/size, 1]` (NaN if x has one)."""
    g = x.float().unflatten(-1, (-1, size))
    return g, g.abs().amax(dim=-1, keepdim=True)


def _compressed_kv_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, amax = _groups(x, KV_GROUP)
    # Division is correctly rounded in eager torch, and amax/6 rounded to float32
    # then to E4M3 equals the exact quotient rounded once (6x an E4M3 midpoint has
    # 7 bits: no float32 amax other than it rounds onto it).
    # Held at 448 before the cast: torch 2.13 saturates there, but ml_dtypes (and
    # older torch) give NaN above 464.
    scale8 = (amax.clamp_min(KV_AMAX_FLOOR) / E2M1_MAX).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)
    codes = e2m1_codes(g, scale8.float()).flatten(-2)
    rows = torch.cat((pack_nibbles(codes), scale8.view(torch.uint8).flatten(-2)), dim=-1)
    return rows, amax


def _ue8m0_fp4_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, amax = _groups(x, UE8M0_GROUP)
    scale = ceil_power_of_two(amax.clamp_min(INDEXER_AMAX_FLOOR) * (1.0 / E2M1_MAX))
    codes = e2m1_codes(g, scale).flatten(-2)
    return torch.cat((pack_nibbles(codes), ue8m0_bytes(scale).flatten(-2)), dim=-1), amax


def _swa_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, amax = _groups(x, UE8M0_GROUP)
    scale = ceil_power_of_two(amax.clamp_min(WINDOW_AMAX_FLOOR) * (1.0 / E4M3_MAX))
    # 1/scale is an exact power of two (scale >= 2^-22 here), so the product is x/scale.
    # The model clamps it to +-448 first; that never changes anything, as scale >=
    # amax/448 exactly for every float32 amax (test_scales_cover_amax).
    codes = (g * (1.0 / scale)).to(torch.float8_e4m3fn)
    data = codes.view(torch.uint8).flatten(-2)
    return torch.cat((data, ue8m0_bytes(scale).flatten(-2)), dim=-1), amax


def _decode_compressed_kv_torch(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = rows.shape[-1] * 16 // 9
    scales = rows[..., d // 2:].contiguous().view(torch.float8_e4m3fn).float()
    values = e2m1_values(rows[..., :d // 2]).unflatten(-1, (-1, KV_GROUP))
    return (values * scales.unsqueeze(-1)).flatten(-2).to(dtype)


def _decode_indexer_key_torch(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = rows.shape[-1] * 32 // 17
    values = e2m1_values(rows[..., :d // 2]).unflatten(-1, (-1, UE8M0_GROUP))
    return (values * ue8m0_values(rows[..., d // 2:]).unsqueeze(-1)).flatten(-2).to(dtype)


def _decode_swa_torch(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = rows.shape[-1] * 32 // 33
    values = rows[..., :d].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (-1, UE8M0_GROUP))
    return (values * ue8m0_values(rows[..., d:]).unsqueeze(-1)).flatten(-2).to(dtype)


_compressed_kv = CudaKernel("rows_triton", "compressed_kv_rows", _compressed_kv_rows_torch)
_indexer_key = CudaKernel("rows_triton", "indexer_key_rows", _ue8m0_fp4_rows)
_swa = CudaKernel("rows_triton", "swa_rows", _swa_rows_torch)
_decode_compressed_kv = CudaKernel("rows_triton", "decode_compressed_kv_rows", _decode_compressed_kv_torch)
_decode_indexer_key = CudaKernel("rows_triton", "decode_indexer_key_rows", _decode_indexer_key_torch)
_decode_swa = CudaKernel("rows_triton", "decode_swa_rows", _decode_swa_torch)


def _encode(kernel: CudaKernel, x: torch.Tensor | NDArray, *, what: str, multiple: int) -> torch.Tensor | NDArray:
    values = as_tensor(x, what=what, wants=f"float32, bfloat16 or float16 [..., d], d a multiple of {multiple}")
    check_input(values, what=what, multiple=multiple)
    rows, flag = kernel(values)
    check_finite(flag, what=what)
    return to_numpy(rows) if isinstance(x, np.ndarray) else rows


@overload
def compressed_kv_rows(x: NDArray) -> NDArray: ...
@overload
def compressed_kv_rows(x: torch.Tensor) -> torch.Tensor: ...
def compressed_kv_rows(x: torch.Tensor | NDArray) -> torch.Tensor | NDArray:
    """Compressed-KV rows: E2M1 codes with one E4M3 scale per 16 channels (rules 1, 2).

    Args:
        x: float32, bfloat16 or float16 tensor (float32 or float16 numpy array) `[..., d]`, d a multiple of 16
            (V4.1: 512), any leading shape, any device.

    Returns:
        uint8 `[..., d/2 + d/16]` on x's device (numpy for numpy x): d/2 bytes of packed codes, then
        d/16 E4M3 scale bytes.

    Raises:
        InvalidArgument: wrong type, dtype or width; NaN or Inf in x.
    """
    return _encode(_compressed_kv, x, what="compressed_kv_rows", multiple=KV_GROUP)


@overload
def indexer_key_rows(x: NDArray) -> NDArray: ...
@overload
def indexer_key_rows(x: torch.Tensor) -> torch.Tensor: ...
def indexer_key_rows(x: torch.Tensor | NDArray) -> torch.Tensor | NDArray:
    """Indexer-key rows: E2M1 codes with one UE8M0 scale per 32 channels (rules 1, 3).

    Args:
        x: float32, bfloat16 or float16 tensor (float32 or float16 numpy array) `[..., d]`, d a multiple of 32
            (V4.1: 128), any leading shape, any device.

    Returns:
        uint8 `[..., d/2 + d/32]` on x's device (numpy for numpy x): packed codes, then UE8M0 bytes.

    Raises:
        InvalidArgument: wrong type, dtype or width; NaN or Inf in x.
    """
    return _encode(_indexer_key, x, what="indexer_key_rows", multiple=UE8M0_GROUP)


@overload
def swa_rows(x: NDArray) -> NDArray: ...
@overload
def swa_rows(x: torch.Tensor) -> torch.Tensor: ...
def swa_rows(x: torch.Tensor | NDArray) -> torch.Tensor | NDArray:
    """Window (SWA) KV rows: E4M3 codes with one UE8M0 scale per 32 channels (rule 4).

    Args:
        x: float32, bfloat16 or float16 tensor (float32 or float16 numpy array) `[..., d]`, d a multiple of 32
            (V4.1: 512), any leading shape, any device.

    Returns:
        uint8 `[..., d + d/32]` on x's device (numpy for numpy x): d E4M3 bytes, then UE8M0 bytes.

    Raises:
        InvalidArgument: wrong type, dtype or width; NaN or Inf in x.
    """
    return _encode(_swa, x, what="swa_rows", multiple=UE8M0_GROUP)


def _decode(kernel: CudaKernel, rows: torch.Tensor | NDArray, dtype: torch.dtype, *, what: str,
            row_multiple: int) -> torch.Tensor | NDArray:
    t = as_tensor(rows, what=what, wants=f"uint8 rows [..., k * {row_multiple}]")
    if t.dtype != torch.uint8:
        raise InvalidArgument(f"{what}: expected uint8 rows, got {dtype_name(t)}")
    if t.dim() == 0 or t.shape[-1] == 0 or t.shape[-1] % row_multiple:
        raise InvalidArgument(f"{what}: expected rows whose last dimension is a positive multiple of "
                              f"{row_multiple} bytes, got shape {tuple(t.shape)}")
    values: torch.Tensor = kernel(t, dtype)
    return to_numpy(values) if isinstance(rows, np.ndarray) else values


@overload
def decode_compressed_kv_rows(rows: NDArray, dtype: torch.dtype = ...) -> NDArray: ...
@overload
def decode_compressed_kv_rows(rows: torch.Tensor, dtype: torch.dtype = ...) -> torch.Tensor: ...
def decode_compressed_kv_rows(rows: torch.Tensor | NDArray,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor | NDArray:
    """Values of compressed-KV rows: code times scale, exact in float32 (rule 5).

    Args:
        rows: uint8 `[..., 9d/16]` (V4.1: 288), as `compressed_kv_rows` returns.
        dtype: output dtype; float32 and bfloat16 are exact for every valid row.

    Returns:
        `[..., d]` of dtype on rows' device (new memory; numpy for numpy rows, in
        a dtype numpy has: not bfloat16).

    Raises:
        InvalidArgument: not a uint8 tensor of a compressed-KV row width.
    """
    return _decode(_decode_compressed_kv, rows, dtype, what="decode_compressed_kv_rows", row_multiple=9)


@overload
def decode_indexer_key_rows(rows: NDArray, dtype: torch.dtype = ...) -> NDArray: ...
@overload
def decode_indexer_key_rows(rows: torch.Tensor, dtype: torch.dtype = ...) -> torch.Tensor: ...
def decode_indexer_key_rows(rows: torch.Tensor | NDArray, dtype: torch.dtype = torch.float32) -> torch.Tensor | NDArray:
    """Values of indexer-key rows: code times scale, exact in float32 (rule 5).

    Args:
        rows: uint8 `[..., 17d/32]` (V4.1: 68), as `indexer_key_rows` returns.
        dtype: output dtype.

    Returns:
        `[..., d]` of dtype on rows' device (new memory; numpy for numpy rows, in
        a dtype numpy has: not bfloat16).

    Raises:
        InvalidArgument: not a uint8 tensor of an indexer row width.
    """
    return _decode(_decode_indexer_key, rows, dtype, what="decode_indexer_key_rows", row_multiple=17)


@overload
def decode_swa_rows(rows: NDArray, dtype: torch.dtype = ...) -> NDArray: ...
@overload
def decode_swa_rows(rows: torch.Tensor, dtype: torch.dtype = ...) -> torch.Tensor: ...
def decode_swa_rows(rows: torch.Tensor | NDArray, dtype: torch.dtype = torch.float32) -> torch.Tensor | NDArray:
    """Values of window-KV rows: code times scale, exact in float32 (rule 5).

    Args:
        rows: uint8 `[..., 33d/32]` (V4.1: 528), as `swa_rows` returns.
        dtype: output dtype.

    Returns:
        `[..., d]` of dtype on rows' device (new memory; numpy for numpy rows, in
        a dtype numpy has: not bfloat16).

    Raises:
        InvalidArgument: not a uint8 tensor of a window row width.
    """
    return _decode(_decode_swa, rows, dtype, what="decode_swa_rows", row_multiple=33)
