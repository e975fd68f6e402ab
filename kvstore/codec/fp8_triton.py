"""Fused Triton kernels for the FP8 SWA codec on CUDA: one pass over the tensor per direction.

Imported only on the first CUDA call (`kvstore.codec.fp4.CudaKernel`), never on
CPU-only machines. The kernels compute what kvstore/fp8.py computes: the
power-of-two scale from exact products, x times the exact inverse power of two,
and the E4M3 cast done on the float32 bits as c10 does it, so the bytes equal
the CPU codec's (tests/kvstore/test_codec_gpu.py). A program takes whole rows
(one token's vector each).
"""

# Triton names constexpr parameters in capitals (BLOCK); kept here so kernels read like any other.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.codec.fp4_triton import (
    BLOCK_ELEMENTS,
    KERNEL_DTYPES,
    MAX_ROW_ELEMENTS,
    NUM_WARPS,
    e4m3_code,
    e4m3_value,
    flag_non_finite,
    magnitude_bits,
    on_device,
)

_MIN_SCALE = tl.constexpr(1.1754943508222875e-38)  # 2^-126
_MAX_SCALE = tl.constexpr(8.507059173023462e37)  # 2^126


@triton.jit
def _power_of_two_at_least(amax):
    """kvstore.codec.fp8._power_of_two_at_least: smallest power of two p with 464p >= amax (1 for amax 0)."""
    v = tl.minimum(tl.maximum(amax / 464.0, _MIN_SCALE), _MAX_SCALE)
    bits = v.to(tl.int32, bitcast=True)
    up = ((bits & 0x007FFFFF) != 0).to(tl.int32)
    p = ((bits & 0x7F800000) + up * (1 << 23)).to(tl.float32, bitcast=True)
    # amax/464 was rounded (approximately, here); 464p is exact.
    p = tl.where(464.0 * p < amax, p * 2.0, p)
    p = tl.where((p > _MIN_SCALE) & (464.0 * p * 0.5 >= amax), p * 0.5, p)
    return tl.where(amax > 0.0, p, 1.0)


@triton.jit
def _quantize_tokens_kernel(x_ptr, codes_ptr, scales_ptr, flag_ptr, n_rows, n_cols,
                            BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    live = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=live, other=0.0).to(tl.float32)
    amax_bits = tl.max(magnitude_bits(x), axis=1)
    flag_non_finite(flag_ptr, amax_bits)
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = _power_of_two_at_least(amax)
    # 1/p of a power of two, built from its exponent: exact, so x * inverse is x/p exactly.
    inverse = ((254 << 23) - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    tl.store(codes_ptr + offsets, e4m3_code(x * inverse[:, None]), mask=live)
    tl.store(scales_ptr + rows, scale, mask=rows < n_rows)


@triton.jit
def _dequantize_tokens_kernel(codes_ptr, scales_ptr, out_ptr, n_rows, n_cols,
                              BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    live = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]
    codes = tl.load(codes_ptr + offsets, mask=live, other=0).to(tl.int32)
    scale = tl.load(scales_ptr + rows, mask=rows < n_rows, other=0.0)
    out = e4m3_value(codes) * scale[:, None]
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=live)


def _tiling(n_cols: int) -> tuple[int, int, int]:
    """(rows per program, padded columns, warps) for rows of n_cols elements."""
    block_cols = triton.next_power_of_2(n_cols)
    block_rows = max(1, BLOCK_ELEMENTS // block_cols)
    return block_rows, block_cols, NUM_WARPS if block_rows > 1 else 8


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`fp8.quantize` in one pass: (float8_e4m3fn codes, float32 scales, non-finite flag), or None to decline."""
    n_cols = x.shape[-1]
    if x.numel() == 0 or n_cols > MAX_ROW_ELEMENTS:
        return None
    x = x.contiguous()
    n_rows = x.numel() // n_cols
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    flag = torch.zeros(1, dtype=torch.float32, device=x.device)
    block_rows, block_cols, warps = _tiling(n_cols)
    with on_device(x):
        _quantize_tokens_kernel[(triton.cdiv(n_rows, block_rows),)](
            x, codes, scales, flag, n_rows, n_cols, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps)
    return codes.view(torch.float8_e4m3fn), scales, flag


def dequantize_tokens(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`fp8.dequantize` in one pass, written straight in `dtype`."""
    if codes.dim() == 0 or codes.numel() == 0 or codes.shape[-1] > MAX_ROW_ELEMENTS:
        return None
    n_cols = codes.shape[-1]
    n_rows = codes.numel() // n_cols
    kernel_dtype = dtype if dtype in KERNEL_DTYPES else torch.float32
    out = torch.empty(codes.shape, dtype=kernel_dtype, device=codes.device)
    block_rows, block_cols, warps = _tiling(n_cols)
    with on_device(codes):
        _dequantize_tokens_kernel[(triton.cdiv(n_rows, block_rows),)](
            codes.contiguous().view(torch.uint8), scales.contiguous(), out, n_rows, n_cols,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=warps)
    return out if kernel_dtype == dtype else out.to(dtype)
