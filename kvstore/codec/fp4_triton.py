"""Fused Triton kernels for the FP4 codec on CUDA: one pass over the tensor per direction.

Imported only on the first CUDA call (`kvstore.codec.fp4.CudaKernel`), so CPU-only
machines never import triton. Each kernel computes what kvstore/fp4.py computes,
with the same float32 products, comparisons and bit operations, so its bytes
equal the CPU codec's (tests/kvstore/test_codec_gpu.py). The rules are stated
in kvstore/fp4.py and docs/CODEC.md; the only division (amax/6) may be
approximate here, which the scale rules already correct for.

Layout: the 16 elements of a group lie back to back in a contiguous tensor
whatever its shape, so main-KV quantize and every dequantize take BLOCK groups
per program without knowing the row length. Dequantize reads a group's 8 bytes
of codes as one int64 word, code j in bits 4j..4j+3 (on a little-endian GPU
element 2i is the low nibble of byte i, as rule 1 requires).

Non-finite input does not fail inside a kernel: it stores that maximum (inf or
NaN) in a one-element float32 flag, which the caller hands to `fp4.check_finite`.
"""

# Triton names constexpr parameters in capitals (BLOCK); kept here so kernels read like any other.
# ruff: noqa: N803

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

#: Elements per program; 4,096 keeps every thread on a few 16-byte accesses.
BLOCK_ELEMENTS = 4096
#: Warps per program (rows longer than BLOCK_ELEMENTS get 8).
NUM_WARPS = 4
#: Longest row the per-vector kernel takes in one program; longer rows use the fallback.
MAX_ROW_ELEMENTS = 16384

_E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6
_F32_MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)  # 2^-126
_E4M3_ULP_BITS = tl.constexpr(1 << 20)


@triton.jit
def magnitude_bits(x):
    """The float32 bits of |x| as int32. On these, an integer maximum is the float maximum, and
    NaN (above +inf) wins it, so one reduction gives amax and shows non-finite input."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def flag_non_finite(flag_ptr, amax_bits):
    """Store the worst maximum (inf or NaN) in the flag when it is not finite."""
    worst = tl.max(amax_bits, axis=0)
    tl.store(flag_ptr, worst.to(tl.float32, bitcast=True), mask=worst > 0x7F7FFFFF)


@triton.jit
def e4m3_code(y):
    """E4M3 (fn) byte of float32 y, round to nearest even, as c10 converts (|y| < 464 stays finite)."""
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    sign = (bits >> 24) & 0x80
    # Normal: round the float32 mantissa to 3 bits, then rebias the exponent (127 -> 7).
    normal = ((magnitude + 524287 + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal (below 2^-6): adding 2^14 rounds to a multiple of 2^-9, the last bits count them.
    subnormal = (magnitude.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    code = tl.where(magnitude >= (121 << 23), normal, subnormal)
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_value(code):
    """float32 value of an E4M3 (fn) byte given as int32, subnormals and NaN included."""
    exponent = (code >> 3) & 15
    mantissa = code & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # m * 2^-9, exact
    bits = tl.where(exponent == 0, subnormal, normal)
    bits = tl.where((code & 0x7F) == 0x7F, 0x7FC00000, bits)
    return (bits | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_value(code):
    """float32 value of a 4-bit E2M1 code given as int32 (code 8 is -0.0)."""
    magnitude = code & 7
    normal = (((magnitude >> 1) + 126) << 23) | ((magnitude & 1) << 22)
    bits = tl.where(magnitude < 2, magnitude * (126 << 23), normal)  # 0 -> 0.0, 1 -> 0.5
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_codes(bits, ax, scale):
    """4-bit codes (int32) of x/scale for scale > 0, x given by its bits, ax = |x|.

    The same decisions as kvstore.codec.fp4._e2m1_codes (|x| against the exact thresholds
    m*scale, ties to even), found by a binary search over the 8 magnitudes: three
    comparisons per element instead of seven.
    """
    upper = ax >= 1.75 * scale  # magnitudes 4-7; a tie goes up to the even code 4
    threshold = tl.where(upper, 3.5 * scale, 0.75 * scale)
    high = ax >= threshold  # 6-7 or 2-3; ties go up to the even codes 6 and 2
    threshold = tl.where(upper, tl.where(high, 5.0 * scale, 2.5 * scale), tl.where(high, 1.25 * scale, 0.25 * scale))
    odd = ax > threshold  # ties stay on the even code
    magnitude = upper.to(tl.int32) * 4 + high.to(tl.int32) * 2 + odd.to(tl.int32)
    return magnitude | ((bits >> 28) & 8)


@triton.jit
def _packed(codes, PAIRS_SHAPE: tl.constexpr):
    """16 codes per group as 8 bytes (last dim 16 -> 8): element 2i in the low nibble of byte i."""
    even, odd = tl.split(tl.reshape(codes, PAIRS_SHAPE))
    return (even | (odd << 4)).to(tl.uint8)


@triton.jit
def _e4m3_nearest(amax):
    """kvstore.codec.fp4._e4m3_nearest: amax/6 to the nearest E4M3 value in [2^-6, 448], ties to even."""
    v = tl.minimum(tl.maximum(amax / 6.0, _E4M3_MIN_NORMAL), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    s = ((bits + 524287 + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # amax/6 was rounded (approximately, here): move one step where amax lies beyond
    # 6x the midpoint to a neighbour. Those products are exact.
    up_bits = s.to(tl.int32, bitcast=True) + _E4M3_ULP_BITS
    up = up_bits.to(tl.float32, bitcast=True)
    boundary = 6.0 * (s + up) * 0.5
    move = (amax > boundary) | ((amax == boundary) & (((up_bits >> 20) & 1) == 0))
    s = tl.where(move & (s < 448.0), up, s)
    down_bits = s.to(tl.int32, bitcast=True) - _E4M3_ULP_BITS
    down = down_bits.to(tl.float32, bitcast=True)
    boundary = 6.0 * (s + down) * 0.5
    move = (amax < boundary) | ((amax == boundary) & (((down_bits >> 20) & 1) == 0))
    return tl.where(move & (s > _E4M3_MIN_NORMAL), down, s)


@triton.jit
def _f32_round_up(amax):
    """kvstore.codec.fp4._f32_round_up: the smallest float32 s of 21 significant bits with 6s >= amax."""
    v = tl.maximum(amax / 6.0, _F32_MIN_NORMAL)
    s = ((v.to(tl.int32, bitcast=True) + 7) & -8).to(tl.float32, bitcast=True)
    up = (s.to(tl.int32, bitcast=True) + 8).to(tl.float32, bitcast=True)
    s = tl.where(6.0 * s < amax, up, s)
    down = (s.to(tl.int32, bitcast=True) - 8).to(tl.float32, bitcast=True)
    s = tl.where((down >= _F32_MIN_NORMAL) & (6.0 * down >= amax), down, s)
    return tl.where(amax > 0.0, s, 0.0)


@triton.jit
def _quantize_groups_kernel(x_ptr, values_ptr, scales_ptr, flag_ptr, n_groups, BLOCK: tl.constexpr):
    groups = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = groups < n_groups
    lane = tl.arange(0, 16)
    x = tl.load(x_ptr + groups[:, None] * 16 + lane[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    ax_bits = magnitude_bits(x)
    amax_bits = tl.max(ax_bits, axis=1)
    flag_non_finite(flag_ptr, amax_bits)
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = _e4m3_nearest(amax)
    codes = _e2m1_codes(bits, ax_bits.to(tl.float32, bitcast=True), scale[:, None])
    byte = tl.arange(0, 8)
    tl.store(values_ptr + groups[:, None] * 8 + byte[None, :], _packed(codes, (BLOCK, 8, 2)), mask=live[:, None])
    # A group that rounds to all zeros stores scale 0, as its decoded zeros would.
    stored = tl.where(amax > 0.25 * scale, scale, 0.0)
    tl.store(scales_ptr + groups, e4m3_code(stored), mask=live)


@triton.jit
def _quantize_vectors_kernel(x_ptr, values_ptr, scales_ptr, flag_ptr, n_rows, groups_per_row,
                             BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.arange(0, BLOCK_GROUPS)
    lane = tl.arange(0, 16)
    live = (rows < n_rows)[:, None] & (group < groups_per_row)[None, :]
    groups = rows[:, None] * groups_per_row + group[None, :]
    x = tl.load(x_ptr + groups[:, :, None] * 16 + lane[None, None, :], mask=live[:, :, None],
                other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    ax_bits = magnitude_bits(x)
    amax_bits = tl.max(tl.max(ax_bits, axis=2), axis=1)
    flag_non_finite(flag_ptr, amax_bits)
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = _f32_round_up(amax)
    # An all-zero vector has scale 0; any positive scale gives its elements code 0 (keeping the sign).
    code_scale = tl.where(scale > 0.0, scale, 1.0)
    codes = _e2m1_codes(bits, ax_bits.to(tl.float32, bitcast=True), code_scale[:, None, None])
    byte = tl.arange(0, 8)
    tl.store(values_ptr + groups[:, :, None] * 8 + byte[None, None, :],
             _packed(codes, (BLOCK_ROWS, BLOCK_GROUPS, 8, 2)), mask=live[:, :, None])
    stored = tl.where(amax > 0.25 * scale, scale, 0.0)
    tl.store(scales_ptr + rows, stored, mask=rows < n_rows)


@triton.jit
def _dequantize_kernel(values_ptr, scales_ptr, out_ptr, n_groups, groups_per_scale,
                       E4M3_SCALES: tl.constexpr, BLOCK: tl.constexpr):
    groups = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = groups < n_groups
    lane = tl.arange(0, 16)
    words = tl.load(values_ptr + groups, mask=live, other=0)
    if E4M3_SCALES:
        scale = e4m3_value(tl.load(scales_ptr + groups, mask=live, other=0).to(tl.int32))
    else:
        scale = tl.load(scales_ptr + groups // groups_per_scale, mask=live, other=0.0)
    codes = ((words[:, None] >> (lane * 4).to(tl.int64)[None, :]) & 15).to(tl.int32)
    out = _e2m1_value(codes) * scale[:, None]
    # Triton's float32 -> bf16/f16 conversion rounds to nearest even, as torch's .to() does.
    tl.store(out_ptr + groups[:, None] * 16 + lane[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None])


#: Output dtypes the kernels write directly; others are converted from float32 afterwards.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _words(values: torch.Tensor) -> torch.Tensor:
    """Packed codes as int64 words (8 bytes = one group), copied only if misaligned or strided."""
    if not values.is_contiguous() or values.data_ptr() % 8:
        values = values.clone(memory_format=torch.contiguous_format)
    return values.view(torch.int64)


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Launch on t's GPU (Triton launches on the current one); a no-op for the CPU interpreter."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _flag(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`fp4.quantize` in one pass: (values, float8_e4m3fn scales, non-finite flag), or None to decline."""
    if x.numel() == 0:
        return None
    x = x.contiguous()
    n_groups = x.numel() // 16
    values = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // 16), dtype=torch.uint8, device=x.device)
    flag = _flag(x.device)
    block = BLOCK_ELEMENTS // 16
    with on_device(x):
        _quantize_groups_kernel[(triton.cdiv(n_groups, block),)](
            x, values, scales, flag, n_groups, BLOCK=block, num_warps=NUM_WARPS)
    return values, scales.view(torch.float8_e4m3fn), flag


def quantize_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`fp4.quantize_per_vector` in one pass, for rows that are whole groups of 16 (else None)."""
    channels = x.shape[-1]
    if x.numel() == 0 or channels % 16 or channels > MAX_ROW_ELEMENTS:
        return None
    x = x.contiguous()
    n_rows, groups_per_row = x.numel() // channels, channels // 16
    values = torch.empty((*x.shape[:-1], channels // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    flag = _flag(x.device)
    block_groups = triton.next_power_of_2(groups_per_row)
    block_rows = max(1, BLOCK_ELEMENTS // (16 * block_groups))
    with on_device(x):
        _quantize_vectors_kernel[(triton.cdiv(n_rows, block_rows),)](
            x, values, scales, flag, n_rows, groups_per_row,
            BLOCK_ROWS=block_rows, BLOCK_GROUPS=block_groups, num_warps=NUM_WARPS if block_rows > 1 else 8)
    return values, scales, flag


def _dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                groups_per_scale: int) -> torch.Tensor | None:
    if values.dim() == 0 or values.numel() == 0 or values.shape[-1] % 8:
        return None
    kernel_dtype = dtype if dtype in KERNEL_DTYPES else torch.float32
    out = torch.empty((*values.shape[:-1], values.shape[-1] * 2), dtype=kernel_dtype, device=values.device)
    words = _words(values)
    e4m3 = scales.dtype == torch.float8_e4m3fn
    scale_data = scales.contiguous().view(torch.uint8) if e4m3 else scales.contiguous()
    n_groups = values.numel() // 8
    block = BLOCK_ELEMENTS // 16
    with on_device(values):
        _dequantize_kernel[(triton.cdiv(n_groups, block),)](
            words, scale_data, out, n_groups, groups_per_scale, E4M3_SCALES=e4m3, BLOCK=block, num_warps=NUM_WARPS)
    return out if kernel_dtype == dtype else out.to(dtype)


def dequantize_groups(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`fp4.dequantize` with E4M3 scales per 16, written straight in `dtype`."""
    return _dequantize(values, scales, dtype, 1)


def dequantize_vectors(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`fp4.dequantize` with one float32 scale per vector, for rows of whole groups (else None)."""
    return _dequantize(values, scales, dtype, values.shape[-1] // 8 if values.dim() else 1)
