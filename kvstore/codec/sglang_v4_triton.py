"""Triton kernels for SGLang's `v4` transcode on CUDA: one pass per direction (issue 27 item 4).

Imported only on the first CUDA call (`kvstore.codec.sglang_v4` through `fp4.CudaKernel`), so CPU-only
machines never import triton. Each function returns what the torch path of sglang_v4.py returns, bit for
bit, or None for an input it does not take (the torch path then runs): checked against it on CUDA by
tests/kvstore/codec/test_sglang_v4_triton_gpu.py and on the CPU, under Triton's interpreter, by
tests/kvstore/codec/test_sglang_v4_triton_interpret.py. sglang_v4.py states the rules; here is how each
is computed without a float op that could round differently from the torch path's:

- **Load** (model row -> V4 row, `encode_rows`): a NoPE group's largest value is code value x |E4M3
  scale|, an exact float32 product (at most 6 significant bits, never subnormal); its exponent is
  `_tile_exponent` of that on the bits (floor 1e-4, then the biased exponent less 8, plus one above
  mantissa 0x600000), 256 for a NaN scale byte; a tile's, the largest of its four groups'. Each output
  value is code value x (|scale| x 2^(127 - e)), both products exact and normal (e is 105..130 for a
  finite tile), so the only rounding is the E4M3 cast, round to nearest even (the GPU's cvt, or the
  cast on the bits as c10 does it: `HW_FP8`), with the sign the XOR of the code's and the scale's. That
  value depends on the code only through its magnitude, so a group's 8 output magnitudes are cast once
  (`_magnitude_table`: 7 casts for 16 codes, two words of 4 bytes) and each code picks its byte from them
  (`_pick`: PTX `prmt` picks 4 bytes by 4 packed codes in one instruction; the same picks in Triton ops
  under the interpreter). A lane holds whole 16-code groups: 8 code bytes in, 16 bytes out, 8 at a time.
  RoPE values are exact in bf16 (the float32 bits' high half), picked the same way from a group's table of
  8. Where a scale byte is NaN (0x7F, 0xFF), the bytes are gathered from the torch path's own tables (built
  on the CPU, whose NaN bits they carry).
- **Save** (V4 row -> model row + exactness, `recover_rows`): the search runs on the torch path's own
  tables (`_RecoverTables`: the nearest scale, each element's code and whether it re-encodes, the
  decoded values), per group as `sglang_v4._search` does (near, then its lower and upper neighbours,
  the first that re-encodes kept, collisions counted), and the found row is re-encoded by the load's
  math in registers and compared with the engine's 584 bytes: exact where all agree.

Whole blocks: one launch per direction; a row's place in a block (and the indexer row copied with it)
comes from a per-geometry table of offsets (`_plan`).
"""

# Triton names constexpr parameters in capitals (BLOCK_ROWS); a constexpr `if` selects code at compile time.
# ruff: noqa: N803, N806, SIM108

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvstore.codec import sglang_v4 as v4
from kvstore.codec.rows_triton import e2m1_value, e4m3_code, e4m3_value
from kvstore.geometry import ModelGeometry, Section

#: Rows per program of the load and of the save (a row is 512 channels: 4,096 and 2,048 elements).
#: The load's 4 rows x 2 warps: best of 4-32 rows x 2-8 warps on the H200 (2026-12-02: 1.55 ms at 1M tokens
#: with the cvt, against 1.78-5.3 ms for the others).
LOAD_ROWS = 4
SAVE_ROWS = 4
#: Warps per program: the load's, the save's.
LOAD_WARPS = 2
NUM_WARPS = 4
#: E4M3 casts of the load: True or None (the default) on a GPU of compute capability 8.9+: PTX
#: `cvt.rn.satfinite.e4m3x2.f32` in inline assembly (`_magnitude_table`); False: on the bits (any GPU, and the
#: interpreter, whose float8 cast does not round to nearest even). The save always casts on the bits. Not
#: Triton's own float8e4nv convert: on the H200 (sm_90, Triton 3.6, 2026-12-02) its results came out of its
#: packed e4m3x2 registers into the wrong elements (bytes 2 and 3 of every 4 consecutive NoPE bytes held
#: code-independent values, 0x00, 0x80, 0xFC, in every row: 6.9M of 65,536 realistic rows' bytes), not a
#: rounding difference: the same cvt instruction called directly gives the torch path's bytes on those
#: rows and on 1M tokens of blocks (torch.equal).
HW_FP8: bool | None = None
#: The load's byte picks through PTX `prmt` (`_pick`) on CUDA; False: the same picks in Triton ops, as under the
#: interpreter (which cannot run inline PTX).
PRMT = True


@triton.jit
def _group_exponent(magnitude, scale):
    """The store's tile exponent of a NoPE group from its largest code magnitude and E4M3 scale byte (int32)."""
    amax = e2m1_value(magnitude) * e4m3_value(scale & 0x7F)          # exact: <= 6 significant bits
    bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.where((scale & 0x7F) == 0x7F, 256, exponent)


@triton.jit
def _e4m3_magnitude(y, HW_FP8: tl.constexpr):
    """E4M3 byte of float32 y >= 0, y <= 448, round to nearest even (int32)."""
    if HW_FP8:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        code = e4m3_code(y)
    return code


@triton.jit
def _nope_bytes(codes, scale, factor, nan, any_nan, nope_table, NAN_KEY: tl.constexpr, HW_FP8: tl.constexpr):
    """V4 E4M3 bytes (int32) of 4-bit codes under scale bytes `scale` and `factor` = |scale| x 2^(127 - tile
    exponent); where `nan` (a NaN tile), the torch path's byte table at its NaN key."""
    magnitude = _e4m3_magnitude(e2m1_value(codes & 7) * factor, HW_FP8)
    byte = magnitude | ((((codes >> 3) ^ (scale >> 7)) & 1) << 7)
    if any_nan:                                                       # rare: only programs holding a NaN scale
        table = tl.load(nope_table + (((NAN_KEY * 256 + scale) * 16) + codes), mask=nan, other=0).to(tl.int32)
        byte = tl.where(nan, table, byte)
    return byte


@triton.jit
def _rope_bits(codes, scale, any_nan, rope_table):
    """bf16 bits (int32, 0..0xFFFF) of 4-bit codes under E4M3 scale bytes: code value x scale is exact in
    bf16 (the float32 bits' high half); a NaN scale's from the torch path's table."""
    y = e2m1_value(codes & 7) * e4m3_value(scale & 0x7F)
    bits = (y.to(tl.int32, bitcast=True) >> 16) | ((((codes >> 3) ^ (scale >> 7)) & 1) << 15)
    nan = (scale & 0x7F) == 0x7F
    if any_nan:                                                       # rare: only programs holding a NaN scale
        table = tl.load(rope_table + ((scale * 16) + codes), mask=nan, other=0).to(tl.int32) & 0xFFFF
        bits = tl.where(nan, table, bits)
    return bits


@triton.jit
def _any(flags):
    """Whether any element of a 2-D boolean tensor is set (one reduction per program)."""
    return tl.max(tl.max(flags.to(tl.int32), axis=1), axis=0) > 0


@triton.jit
def _tile_factors(magnitude, scale):
    """(tile exponent [R, T], |scale| x 2^(127 - exponent) [R, T, 4]) of groups [R, T, 4]."""
    exponent = tl.max(_group_exponent(magnitude, scale), axis=2)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(127 - e), exact (e = 256: unused)
    return exponent, e4m3_value(scale & 0x7F) * inverse[:, :, None]


@triton.jit
def _row_offsets(table, rows, ROWS_PER_BLOCK: tl.constexpr, stride, ALIGN: tl.constexpr):
    """Byte offset of each row (int32 index): its block's start plus the row's place in a block (`table`);
    the block size a constant, so the division is a multiply."""
    place = tl.load(table + rows % ROWS_PER_BLOCK)
    return tl.multiple_of((rows // ROWS_PER_BLOCK).to(tl.int64) * stride + place, ALIGN)


@triton.jit
def _copy_rows(src_ptr, src32_ptr, dst_ptr, dst32_ptr, src_row, dst_row, live, BYTES: tl.constexpr,
               PADDED: tl.constexpr, UNIT: tl.constexpr):
    """Copy BYTES bytes of each row (the indexer rows that ride along), in UNIT-byte words (`*32_ptr`: int32
    views of the same memory, used where UNIT is 4)."""
    word = tl.arange(0, PADDED)
    mask = live[:, None] & (word < BYTES // UNIT)[None, :]
    if UNIT == 4:
        src = src32_ptr + (src_row // 4)[:, None] + word[None, :]
        dst = dst32_ptr + (dst_row // 4)[:, None] + word[None, :]
    else:
        src = src_ptr + src_row[:, None] + word[None, :]
        dst = dst_ptr + dst_row[:, None] + word[None, :]
    tl.store(dst, tl.load(src, mask=mask, other=0), mask=mask)


@triton.jit
def _max_magnitude(c0, c1):
    """The largest code magnitude (0..7, int32) of each group's 16 codes, packed as nibbles in words c0, c1,
    bit by bit across all its nibbles at once (no per-code extraction): whether any nibble has bit 2, then
    among those bit 1, then bit 0."""
    m0, m1 = c0 & 0x77777777, c1 & 0x77777777
    has4 = ((m0 | m1) & 0x44444444) != 0
    m0 &= tl.where(has4, ((m0 >> 2) & 0x11111111) * 7, 0x77777777)
    m1 &= tl.where(has4, ((m1 >> 2) & 0x11111111) * 7, 0x77777777)
    has2 = ((m0 | m1) & 0x22222222) != 0
    m0 &= tl.where(has2, ((m0 >> 1) & 0x11111111) * 7, 0x77777777)
    m1 &= tl.where(has2, ((m1 >> 1) & 0x11111111) * 7, 0x77777777)
    has1 = ((m0 | m1) & 0x11111111) != 0
    return has4.to(tl.int32) * 4 + has2.to(tl.int32) * 2 + has1.to(tl.int32)


@triton.jit
def _magnitude_table(factor, HW_FP8: tl.constexpr):
    """A group's 8 E4M3 output magnitudes, code value x `factor` for codes 0..7, as two int32 words of 4 bytes
    (codes 0-3, 4-7): the casts of `_e4m3_magnitude`, 7 a group instead of one per code."""
    if HW_FP8:
        lo, hi = tl.inline_asm_elementwise(
            """{
            .reg .f32 z, a, b, c, d, e, g;
            .reg .b16 p, q, r, s;
            mov.f32 z, 0f00000000;
            mul.f32 a, $2, 0f3F000000;
            mul.f32 b, $2, 0f3FC00000;
            mul.f32 c, $2, 0f40000000;
            mul.f32 d, $2, 0f40400000;
            mul.f32 e, $2, 0f40800000;
            mul.f32 g, $2, 0f40C00000;
            cvt.rn.satfinite.e4m3x2.f32 p, a, z;
            cvt.rn.satfinite.e4m3x2.f32 q, b, $2;
            cvt.rn.satfinite.e4m3x2.f32 r, d, c;
            cvt.rn.satfinite.e4m3x2.f32 s, g, e;
            mov.b32 $0, {p, q};
            mov.b32 $1, {r, s};
            }""", "=r,=r,r", [factor], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        lo = (e4m3_code(0.5 * factor) << 8) | (e4m3_code(factor) << 16) | (e4m3_code(1.5 * factor) << 24)
        hi = e4m3_code(2.0 * factor) | (e4m3_code(3.0 * factor) << 8) | (e4m3_code(4.0 * factor) << 16) \
            | (e4m3_code(6.0 * factor) << 24)
    return lo, hi


@triton.jit
def _pick_portable(w, lo, hi, HALF: tl.constexpr):
    """`_pick`'s word for half HALF of w, in Triton ops (the interpreter's path)."""
    out = tl.zeros_like(w)
    for k in tl.static_range(4):
        code = (w >> (16 * HALF + 4 * k)) & 15
        magnitude = code & 7
        table = tl.where(magnitude < 4, lo, hi)
        byte = ((table >> ((magnitude & 3) * 8)) & 0xFF) ^ ((code >> 3) << 7)
        out |= byte << (8 * k)
    return out


@triton.jit
def _pick(w, lo, hi, PRMT: tl.constexpr):
    """The 8 E4M3 bytes (two words) of the 8 codes packed in int32 `w`: each code's magnitude byte from its
    group's table (`lo`, `hi`: magnitudes 0-3, 4-7, the scale's sign already in bit 7), XOR its own sign.
    PRMT: PTX `prmt` picks 4 of the 8 bytes by 4 codes in one instruction, and moves the 4 sign bits to the
    bytes' top bits in another (the codes' signs sit at bits 3, 7, 11, 15 of a half: `w << 4` has codes 0
    and 2's at bits 7 and 15, `w` codes 1 and 3's)."""
    if PRMT:
        low, high = tl.inline_asm_elementwise(
            """{
            .reg .b32 sel, t, m;
            shl.b32 t, $2, 4;
            and.b32 sel, $2, 0x7777;
            prmt.b32 $0, $3, $4, sel;
            prmt.b32 m, t, $2, 0x5140;
            and.b32 m, m, 0x80808080;
            xor.b32 $0, $0, m;
            shr.b32 sel, $2, 16;
            and.b32 sel, sel, 0x7777;
            prmt.b32 $1, $3, $4, sel;
            prmt.b32 m, t, $2, 0x7362;
            and.b32 m, m, 0x80808080;
            xor.b32 $1, $1, m;
            }""", "=r,=r,r,r,r", [w, lo, hi], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        low = _pick_portable(w, lo, hi, 0)
        high = _pick_portable(w, lo, hi, 1)
    return low, high


@triton.jit
def _nan_words(w, scale, nope_table, NAN_KEY: tl.constexpr):
    """`_pick`'s two words where a tile's scale is NaN: the torch path's table bytes at its NaN key, code by
    code (rare: only programs holding one)."""
    low = tl.zeros_like(w)
    high = tl.zeros_like(w)
    base = (NAN_KEY * 256 + scale) * 16
    for k in tl.static_range(4):
        low |= tl.load(nope_table + (base + ((w >> (4 * k)) & 15))).to(tl.int32) << (8 * k)
        high |= tl.load(nope_table + (base + ((w >> (16 + 4 * k)) & 15))).to(tl.int32) << (8 * k)
    return low, high


@triton.jit
def _rope_tables(scale):
    """A RoPE group's bf16 outputs for codes 0..7 (code value x scale, exact in bf16, the scale's sign in bit 15)
    as byte tables: low bytes (codes 0-3, 4-7), then high bytes, four int32 words."""
    s = e4m3_value(scale & 0x7F)
    sign = (scale >> 7) << 7                                         # bit 7 of each high byte
    low0 = tl.zeros_like(scale)
    low1 = tl.zeros_like(scale)
    high0 = sign
    high1 = sign | (sign << 8) | (sign << 16) | (sign << 24)
    for m in tl.static_range(1, 8):
        bits = (e2m1_value(tl.full(scale.shape, m, tl.int32)) * s).to(tl.int32, bitcast=True) >> 16
        if m < 4:
            low0 |= (bits & 0xFF) << (8 * m)
            high0 |= ((bits >> 8) & 0x7F) << (8 * m) | (sign << (8 * m))
        else:
            low1 |= (bits & 0xFF) << (8 * (m - 4))
            high1 |= ((bits >> 8) & 0x7F) << (8 * (m - 4))
    return low0, low1, high0, high1


@triton.jit
def _rope_pick_portable(w, low0, low1, high0, high1, BYTE: tl.constexpr):
    """`_rope_pick`'s word of code byte BYTE of w, in Triton ops."""
    out = tl.zeros_like(w)
    for h in tl.static_range(2):
        code = (w >> (8 * BYTE + 4 * h)) & 15
        magnitude = code & 7
        shift = (magnitude & 3) * 8
        low = (tl.where(magnitude < 4, low0, low1) >> shift) & 0xFF
        high = ((tl.where(magnitude < 4, high0, high1) >> shift) & 0xFF) ^ ((code >> 3) << 7)
        out |= (low | (high << 8)) << (16 * h)
    return out


@triton.jit
def _rope_pick(w, low0, low1, high0, high1, PRMT: tl.constexpr):
    """The 4 output words (two bf16 each) of the 4 code bytes of int32 `w` from the group's byte tables,
    each code's sign XORed into its bf16's bit 15. PRMT: per word, one `prmt` spreads the byte's two codes to
    the selector nibbles (low code, low code, high code, high code), two pick the low and high bytes, one
    moves the signs."""
    if PRMT:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            """{
            .reg .b32 u, a, b, sel, x, y, t, m;
            shl.b32 t, $4, 4;
            prmt.b32 u, $4, $4, 0x0000;
            shl.b32 a, u, 4;
            shr.b32 b, u, 4;
            and.b32 sel, u, 0x7007; and.b32 a, a, 0x0070; and.b32 b, b, 0x0700; or.b32 sel, sel, a; or.b32 sel, sel, b;
            prmt.b32 x, $5, $6, sel; prmt.b32 y, $7, $8, sel;
            prmt.b32 m, t, $4, 0x4000; and.b32 m, m, 0x80008000;
            and.b32 x, x, 0x00FF00FF; and.b32 y, y, 0xFF00FF00; or.b32 x, x, y; xor.b32 $0, x, m;
            prmt.b32 u, $4, $4, 0x1111;
            shl.b32 a, u, 4;
            shr.b32 b, u, 4;
            and.b32 sel, u, 0x7007; and.b32 a, a, 0x0070; and.b32 b, b, 0x0700; or.b32 sel, sel, a; or.b32 sel, sel, b;
            prmt.b32 x, $5, $6, sel; prmt.b32 y, $7, $8, sel;
            prmt.b32 m, t, $4, 0x5010; and.b32 m, m, 0x80008000;
            and.b32 x, x, 0x00FF00FF; and.b32 y, y, 0xFF00FF00; or.b32 x, x, y; xor.b32 $1, x, m;
            prmt.b32 u, $4, $4, 0x2222;
            shl.b32 a, u, 4;
            shr.b32 b, u, 4;
            and.b32 sel, u, 0x7007; and.b32 a, a, 0x0070; and.b32 b, b, 0x0700; or.b32 sel, sel, a; or.b32 sel, sel, b;
            prmt.b32 x, $5, $6, sel; prmt.b32 y, $7, $8, sel;
            prmt.b32 m, t, $4, 0x6020; and.b32 m, m, 0x80008000;
            and.b32 x, x, 0x00FF00FF; and.b32 y, y, 0xFF00FF00; or.b32 x, x, y; xor.b32 $2, x, m;
            prmt.b32 u, $4, $4, 0x3333;
            shl.b32 a, u, 4;
            shr.b32 b, u, 4;
            and.b32 sel, u, 0x7007; and.b32 a, a, 0x0070; and.b32 b, b, 0x0700; or.b32 sel, sel, a; or.b32 sel, sel, b;
            prmt.b32 x, $5, $6, sel; prmt.b32 y, $7, $8, sel;
            prmt.b32 m, t, $4, 0x7030; and.b32 m, m, 0x80008000;
            and.b32 x, x, 0x00FF00FF; and.b32 y, y, 0xFF00FF00; or.b32 x, x, y; xor.b32 $3, x, m;
            }""", "=r,=r,=r,=r,r,r,r,r,r", [w, low0, low1, high0, high1], dtype=(tl.int32, tl.int32, tl.int32,
                                                                               tl.int32), is_pure=True, pack=1)
    else:
        o0 = _rope_pick_portable(w, low0, low1, high0, high1, 0)
        o1 = _rope_pick_portable(w, low0, low1, high0, high1, 1)
        o2 = _rope_pick_portable(w, low0, low1, high0, high1, 2)
        o3 = _rope_pick_portable(w, low0, low1, high0, high1, 3)
    return o0, o1, o2, o3


@triton.jit
def _rope_nan_word(w, scale, rope_table, BYTE: tl.constexpr):
    """The output word of code byte BYTE of w from the torch path's RoPE table (rare: NaN scales)."""
    byte = w >> (8 * BYTE)
    return _rope_bits(byte & 15, scale, True, rope_table) | (_rope_bits((byte >> 4) & 15, scale, True,
                                                                         rope_table) << 16)


@triton.jit
def _load_pair(src32_ptr, src64_ptr, word, mask, SRC64: tl.constexpr):
    """Two consecutive int32 words at int32 index `word` (even where SRC64: one 8-byte load)."""
    if SRC64:
        both = tl.load(src64_ptr + word // 2, mask=mask, other=0)
        first = both.to(tl.int32)
        second = (both >> 32).to(tl.int32)
    else:
        first = tl.load(src32_ptr + word, mask=mask, other=0)
        second = tl.load(src32_ptr + word + 1, mask=mask, other=0)
    return first, second


@triton.jit
def _store_pair(dst32_ptr, dst64_ptr, word, first, second, mask, DST64: tl.constexpr):
    """Two int32 words at int32 index `word` (even where DST64: one 8-byte store)."""
    if DST64:
        tl.store(dst64_ptr + word // 2, first.to(tl.uint32).to(tl.int64) | (second.to(tl.int64) << 32), mask=mask)
    else:
        tl.store(dst32_ptr + word, first, mask=mask)
        tl.store(dst32_ptr + word + 1, second, mask=mask)


@triton.jit(do_not_specialize=["n_rows", "one"])
def _load_kernel(src_ptr, src32_ptr, src64_ptr, dst_ptr, dst32_ptr, dst64_ptr, src_table, dst_table, copy_src_table,
                 copy_dst_table, nope_table, rope_table,
                 n_rows, one, src_stride, dst_stride, ROWS_PER_BLOCK: tl.constexpr,
                 NOPE: tl.constexpr, ROPE: tl.constexpr, TILES_P: tl.constexpr,
                 ROPE_P: tl.constexpr, SCALE_WORDS: tl.constexpr,
                 NAN_KEY: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 COPY_BYTES: tl.constexpr, COPY_P: tl.constexpr, COPY_UNIT: tl.constexpr,
                 SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr, HW_FP8: tl.constexpr, PRMT: tl.constexpr):
    """Model rows -> V4 rows, one 16-code group per lane element: its 8 code bytes in one load, its 16 output
    bytes in two 8-byte stores (where aligned), all in one layout (no data moved between threads but the
    tile's exponent). `one` is 1, unknown to the compiler: group offsets times `one` have no contiguity it
    could see, so it gives no load or store a wider layout of its own (the scale words' along the tiles was
    one) and every group tensor keeps the lanes' one layout."""
    TILES: tl.constexpr = NOPE // 64
    HALF: tl.constexpr = (NOPE + ROPE) // 2
    ROPE_GROUPS: tl.constexpr = ROPE // 16
    SRC64: tl.constexpr = SRC_ALIGN >= 8
    DST64: tl.constexpr = DST_ALIGN >= 8
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)              # int32: < 2^31 rows
    live = rows < n_rows
    src_row = _row_offsets(src_table, rows, ROWS_PER_BLOCK, src_stride, SRC_ALIGN)
    dst_row = _row_offsets(dst_table, rows, ROWS_PER_BLOCK, dst_stride, DST_ALIGN)
    src_word = tl.multiple_of(src_row // 4, SRC_ALIGN // 4)              # the hints survive no division
    dst_word = tl.multiple_of(dst_row // 4, DST_ALIGN // 4)
    # NoPE groups [R, tile, group]: two words of 8 codes each, the group's scale byte (from its tile's word).
    t = tl.arange(0, TILES_P)[None, :, None] * one
    g = tl.arange(0, 4)[None, None, :] * one
    tiles = live[:, None] & (tl.arange(0, TILES_P) < TILES)[None, :]
    mask = tiles[:, :, None] & (tl.arange(0, 4) < 4)[None, None, :]
    c0, c1 = _load_pair(src32_ptr, src64_ptr, src_word[:, None, None] + t * 8 + g * 2, mask, SRC64)
    scale_word = tl.load(src32_ptr + (src_word[:, None, None] + HALF // 4 + t + g * 0), mask=mask, other=0)
    scale = (scale_word >> (g * 8)) & 0xFF
    exponent, factor = _tile_factors(_max_magnitude(c0, c1), scale)
    lo, hi = _magnitude_table(factor, HW_FP8)
    sign = tl.where(scale > 127, -2139062144, 0)                      # 0x80808080: the scale's sign, every byte
    w0, w1 = _pick(c0, lo ^ sign, hi ^ sign, PRMT)
    w2, w3 = _pick(c1, lo ^ sign, hi ^ sign, PRMT)
    if _any(exponent == 256):                                        # rare: only programs holding a NaN scale
        nan = (exponent == 256)[:, :, None]
        n0, n1 = _nan_words(c0, scale, nope_table, NAN_KEY)
        n2, n3 = _nan_words(c1, scale, nope_table, NAN_KEY)
        w0, w1, w2, w3 = tl.where(nan, n0, w0), tl.where(nan, n1, w1), tl.where(nan, n2, w2), tl.where(nan, n3, w3)
    out = dst_word[:, None, None] + t * 16 + g * 4
    _store_pair(dst32_ptr, dst64_ptr, out, w0, w1, mask, DST64)
    _store_pair(dst32_ptr, dst64_ptr, out + 2, w2, w3, mask, DST64)
    # The scale field: the tile exponents' low bytes, then zeros to its end, as words of 4 tiles.
    q = tl.arange(0, TILES_P // 4)
    b = tl.arange(0, 4)
    field_bytes = tl.reshape(tl.where((tl.arange(0, TILES_P) < TILES)[None, :], exponent & 0xFF, 0),
                             (BLOCK_ROWS, TILES_P // 4, 4))
    field = tl.sum(field_bytes << (b * 8)[None, None, :], axis=2)
    scale_words = live[:, None] & (q < SCALE_WORDS)[None, :]
    tl.store(dst32_ptr + (dst_word[:, None] + (NOPE + 2 * ROPE) // 4 + q[None, :]), field, mask=scale_words)
    # RoPE groups [R, 1, group] (the NoPE groups' rank: the same layout): two words of 8 codes, the scale byte
    # (from a word: the field is 4-aligned) ->
    # 8 output words of two bf16 each.
    r = tl.arange(0, ROPE_P)[None, None, :] * one
    groups = live[:, None, None] & (r < ROPE_GROUPS)
    r0, r1 = _load_pair(src32_ptr, src64_ptr, src_word[:, None, None] + NOPE // 8 + r * 2, groups, SRC64)
    rscale = (tl.load(src32_ptr + (src_word[:, None, None] + (HALF + NOPE // 16) // 4 + r // 4), mask=groups, other=0)
              >> ((r % 4) * 8)) & 0xFF
    low0, low1, high0, high1 = _rope_tables(rscale)
    p0, p1, p2, p3 = _rope_pick(r0, low0, low1, high0, high1, PRMT)
    p4, p5, p6, p7 = _rope_pick(r1, low0, low1, high0, high1, PRMT)
    nan = (rscale & 0x7F) == 0x7F
    if _any(tl.max(nan.to(tl.int32), axis=1) > 0):                   # rare: only programs holding a NaN scale
        p0 = tl.where(nan, _rope_nan_word(r0, rscale, rope_table, 0), p0)
        p1 = tl.where(nan, _rope_nan_word(r0, rscale, rope_table, 1), p1)
        p2 = tl.where(nan, _rope_nan_word(r0, rscale, rope_table, 2), p2)
        p3 = tl.where(nan, _rope_nan_word(r0, rscale, rope_table, 3), p3)
        p4 = tl.where(nan, _rope_nan_word(r1, rscale, rope_table, 0), p4)
        p5 = tl.where(nan, _rope_nan_word(r1, rscale, rope_table, 1), p5)
        p6 = tl.where(nan, _rope_nan_word(r1, rscale, rope_table, 2), p6)
        p7 = tl.where(nan, _rope_nan_word(r1, rscale, rope_table, 3), p7)
    out = dst_word[:, None, None] + NOPE // 4 + r * 8
    _store_pair(dst32_ptr, dst64_ptr, out, p0, p1, groups, DST64)
    _store_pair(dst32_ptr, dst64_ptr, out + 2, p2, p3, groups, DST64)
    _store_pair(dst32_ptr, dst64_ptr, out + 4, p4, p5, groups, DST64)
    _store_pair(dst32_ptr, dst64_ptr, out + 6, p6, p7, groups, DST64)
    if COPY_BYTES > 0:
        _copy_rows(src_ptr, src32_ptr, dst_ptr, dst32_ptr,
                   _row_offsets(copy_src_table, rows, ROWS_PER_BLOCK, src_stride, COPY_UNIT),
                   _row_offsets(copy_dst_table, rows, ROWS_PER_BLOCK, dst_stride, COPY_UNIT), live,
                   COPY_BYTES, COPY_P, COPY_UNIT)


@dataclass(frozen=True)
class _Offsets:
    """Where each compressed-KV row of a block lies in both layouts, and the indexer row copied with it.

    Attributes:
        device: int64 [rows] byte offsets within a block, on the device: model rows, V4 rows, then the
            indexer row in the model's block and in the V4 block.
        align: for each of the four, the largest power of two (<= 16) dividing all its offsets.
    """

    device: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    align: tuple[int, int, int, int]

    @classmethod
    def of(cls, offsets: list[list[int]], device: torch.device) -> _Offsets:
        """Offsets from four lists of ints, copied to `device`."""
        tables = tuple(torch.tensor(o, dtype=torch.int64).to(device) for o in offsets)
        return cls(device=tables, align=tuple(_alignment(*o) for o in offsets))  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Plan:
    """A geometry's block plan: `rows` compressed-KV rows per block at `offsets`, each with its indexer row
    of `index_bytes` (0: none copied)."""

    rows: int
    offsets: _Offsets
    index_bytes: int


@functools.cache
def _plan(model: ModelGeometry, block_tokens: int, device: torch.device) -> _Plan | None:
    """The block plan of `model`'s blocks, or None where a block is not pairs of compressed-KV and indexer
    sections of equal rows (the torch path then runs)."""
    engine = v4.engine_geometry(model)
    shape = v4.RowShape.of(model)
    offsets: list[list[int]] = [[], [], [], []]
    index_bytes = 0
    native_layout, v4_layout = model.block_layout(block_tokens), engine.block_layout(block_tokens)
    by_layer: dict[int, dict[str, tuple[Section, Section]]] = {}
    for a, b in zip(native_layout, v4_layout, strict=True):
        if (a.layer, a.component, a.rows) != (b.layer, b.component, b.rows):
            return None
        by_layer.setdefault(a.layer, {})[a.component] = (a, b)
    for parts in by_layer.values():
        if set(parts) != {"compressed_kv", "indexer"}:
            return None
        (kv_a, kv_b), (ix_a, ix_b) = parts["compressed_kv"], parts["indexer"]
        if kv_a.rows != ix_a.rows or kv_a.row_bytes != shape.native_bytes or kv_b.row_bytes != shape.v4_bytes \
                or ix_a.row_bytes != ix_b.row_bytes or index_bytes not in (0, ix_a.row_bytes):
            return None
        index_bytes = ix_a.row_bytes
        for column, (section, size) in enumerate(((kv_a, kv_a.row_bytes), (kv_b, kv_b.row_bytes),
                                                  (ix_a, ix_a.row_bytes), (ix_b, ix_b.row_bytes))):
            offsets[column] += [section.offset + i * size for i in range(section.rows)]
    return _Plan(rows=len(offsets[0]), offsets=_Offsets.of(offsets, device), index_bytes=index_bytes)


def _alignment(*values: int) -> int:
    """The largest of 16, 8, 4, 2, 1 dividing every value."""
    for align in (16, 8, 4, 2):
        if all(v % align == 0 for v in values):
            return align
    return 1


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Launch on t's GPU (Triton launches on the current one); a no-op for the CPU interpreter."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _nan_key(device: torch.device) -> int:
    """The dense key of a NaN tile exponent (256) in the torch path's byte tables: the largest."""
    t = v4._encode_tables(torch.device("cpu"))
    key = int(t.group_key[(0 << 8) | 0x7F])
    if key != t.key_exponent.numel() - 1:
        raise AssertionError("the NaN tile exponent is not the last key")
    return key


@functools.cache
def _load_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(E4M3 byte table uint8, RoPE bf16 table int16 [(scale, code)], NaN key) on `device`."""
    t = v4._byte_tables(device)
    return t.nope, t.rope.view(torch.int16), _nan_key(device)


def _view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """A `dtype` view of uint8 `t` [n, w] (the same memory, for the kernels' wide loads and stores), or None."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


def _launch_load(src: torch.Tensor, dst: torch.Tensor, shape: v4.RowShape, n_rows: int, rows_per_block: int,
                 src_stride: int, dst_stride: int, tables: _Offsets, copy_bytes: int) -> bool:
    """Run the load kernel, or False where the source's or the destination's alignment does not allow its
    word loads and stores."""
    src_table, dst_table, copy_src, copy_dst = tables.device
    if n_rows >= 2**31 - 1024:                        # the kernels index rows in int32
        return False
    dst_align = _alignment(dst.data_ptr(), dst_stride, tables.align[1])
    src_align = _alignment(src.data_ptr(), src_stride, tables.align[0])
    dst32, src32 = _view(dst, torch.int32), _view(src, torch.int32)
    if dst_align < 4 or src_align < 4 or dst32 is None or src32 is None:
        return False
    dst64, src64 = _view(dst, torch.int64), _view(src, torch.int64)
    if dst64 is None:
        dst_align = min(dst_align, 4)
    if src64 is None:
        src_align = min(src_align, 4)
    unit = 4 if copy_bytes and _alignment(src.data_ptr(), dst.data_ptr(), src_stride, dst_stride, copy_bytes,
                                          tables.align[2], tables.align[3]) >= 4 else 1
    nope_table, rope_table, nan_key = _load_tables(src.device)
    words = copy_bytes // unit
    scale_words = (shape.v4_bytes - shape.nope - 2 * shape.rope) // 4
    with _on_device(src):
        _load_kernel[(triton.cdiv(n_rows, LOAD_ROWS),)](
            src, src32, src32 if src64 is None else src64, dst, dst32, dst32 if dst64 is None else dst64, src_table,
            dst_table, copy_src, copy_dst, nope_table, rope_table,
            n_rows, 1, src_stride, dst_stride, ROWS_PER_BLOCK=rows_per_block, NOPE=shape.nope, ROPE=shape.rope,
            TILES_P=max(triton.next_power_of_2(shape.tiles), 4 * triton.next_power_of_2(scale_words)),
            ROPE_P=triton.next_power_of_2(shape.rope // v4.GROUP), SCALE_WORDS=scale_words, NAN_KEY=nan_key,
            BLOCK_ROWS=LOAD_ROWS, COPY_BYTES=copy_bytes, COPY_P=triton.next_power_of_2(max(1, words)),
            COPY_UNIT=unit, SRC_ALIGN=src_align, DST_ALIGN=dst_align, HW_FP8=_load_cvt(src.device),
            PRMT=bool(PRMT) and src.is_cuda, num_warps=LOAD_WARPS)
    return True


def _load_cvt(device: torch.device) -> bool:
    """Whether the load casts to E4M3 with the GPU's cvt (`HW_FP8`; None: where the GPU has it)."""
    if HW_FP8 is not None:
        return bool(HW_FP8) and device.type == "cuda"
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _single(device: torch.device) -> _Offsets:
    """The offsets of plain rows: every row its own block, at offset 0."""
    return _Offsets.of([[0], [0], [0], [0]], device)


def encode_rows(native: torch.Tensor, shape: v4.RowShape, out: torch.Tensor) -> torch.Tensor | None:
    """`sglang_v4.encode_rows` of uint8 `native` [..., native_bytes] into `out` [..., v4_bytes] (checked by the
    caller), or None where the layout does not suit the kernel (rows not viewable as [n, width] with a unit
    last stride, or `out` not 4-byte aligned)."""
    flat = native.reshape(-1, shape.native_bytes)
    try:
        target = out.view(-1, shape.v4_bytes)
    except RuntimeError:
        return None
    if flat.stride(-1) != 1 or target.stride(-1) != 1 or flat.shape[0] == 0:
        return None
    if not _launch_load(flat, target, shape, flat.shape[0], 1, flat.stride(0), target.stride(0),
                        _single(native.device), 0):
        return None
    return out


def native_blocks_to_v4(blocks: torch.Tensor, model: ModelGeometry, block_tokens: int) -> torch.Tensor | None:
    """`sglang_v4.native_blocks_to_v4` of uint8 blocks [n, block_bytes] (checked by the caller) in one launch,
    or None for a layout the plan does not take."""
    plan = _plan(model, block_tokens, blocks.device)
    shape, engine = v4.RowShape.of(model), v4.engine_geometry(model)
    if plan is None or blocks.dim() != 2 or blocks.stride(-1) != 1 or blocks.shape[0] == 0:
        return None
    out = torch.empty(blocks.shape[0], engine.block_bytes(block_tokens), dtype=torch.uint8, device=blocks.device)
    if not _launch_load(blocks, out, shape, blocks.shape[0] * plan.rows, plan.rows, blocks.stride(0),
                        out.stride(0), plan.offsets, plan.index_bytes):
        return None
    return out


# -- the save: V4 rows -> model rows, exactness ------------------------------------------------------------


@triton.jit
def _attempt(base, scale, target, table, decoded, mask, STRIDE: tl.constexpr):
    """`sglang_v4._search`'s `attempt`: under scale bytes [R, G] (int32), each element's code [R, G, 16], whether
    all of a group's re-encode to `target` [R, G], and the codes' values (the `decoded` table)."""
    slot = tl.where(scale > 127, 128, scale)
    got = tl.load(table + ((base + slot * STRIDE)[:, :, None] + target), mask=mask, other=16).to(tl.int32)
    codes = got & 15
    values = tl.load(decoded + ((slot << 4)[:, :, None] + codes), mask=mask, other=0.0)
    return codes, tl.max(got, axis=2) < 16, values


@triton.jit
def _search(base, target, near, table, decoded, live, STRIDE: tl.constexpr, ALTERNATIVES: tl.constexpr):
    """`sglang_v4._search` on groups [R, G] of elements `target` [R, G, 16]: (codes, scale bytes, count)."""
    codes, ok, values = _attempt(base, near, target, table, decoded, live[:, :, None], STRIDE)
    scale = near
    count = ok.to(tl.int32)
    if ALTERNATIVES:
        tried_here = live
    else:
        tried_here = live & ~ok
    if _any(tried_here):                                             # on the save, rare: a group that failed
        for step in tl.static_range(2):                              # the neighbours: lower, then upper
            tried = tl.minimum(tl.maximum(near + (2 * step - 1), 1), 126)
            c, k, v = _attempt(base, tried, target, table, decoded, tried_here[:, :, None], STRIDE)
            k = k & tried_here
            distinct = (tl.max((v != values).to(tl.int32), axis=2) > 0) | ~ok
            count += (k & distinct & (tried != scale)).to(tl.int32)
            better = k & ~ok                                         # taken only where nothing re-encoded yet
            codes = tl.where(better[:, :, None], c, codes)
            values = tl.where(better[:, :, None], v, values)
            scale = tl.where(better, tried, scale)
            ok = ok | better
    return codes, scale, count


@triton.jit
def _store_packed(dst_ptr, row, place, codes, mask, G: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Codes [R, G, 16] as bytes (element 2i low nibble, 2i+1 high) at `row` + `place` [1, G, 8]."""
    even, odd = tl.split(tl.reshape(codes, (BLOCK_ROWS, G, 8, 2)))
    tl.store(dst_ptr + (row[:, None, None] + place), (even | (odd << 4)).to(tl.uint8), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _save_kernel(src_ptr, src16_ptr, src32_ptr, dst_ptr, dst32_ptr, exact_ptr, ambiguous_ptr, src_table, dst_table,
                 copy_src_table,
                 copy_dst_table, nope_near, rope_near, nope_outcome, rope_outcome, decoded, nope_bytes_table,
                 rope_table, n_rows, src_stride, dst_stride, ROWS_PER_BLOCK: tl.constexpr,
                 NOPE: tl.constexpr, ROPE: tl.constexpr, V4_BYTES: tl.constexpr, TILES_P: tl.constexpr,
                 ROPE_P: tl.constexpr, SCALES_P: tl.constexpr, NAN_KEY: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 COPY_BYTES: tl.constexpr, COPY_P: tl.constexpr, COPY_UNIT: tl.constexpr,
                 SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr, HW_FP8: tl.constexpr,
                 ALTERNATIVES: tl.constexpr):
    TILES: tl.constexpr = NOPE // 64
    GROUPS_P: tl.constexpr = TILES_P * 4
    HALF: tl.constexpr = (NOPE + ROPE) // 2
    ROPE_GROUPS: tl.constexpr = ROPE // 16
    SLOTS: tl.constexpr = 129
    FIELD: tl.constexpr = NOPE + 2 * ROPE                             # where the scale field starts
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)              # int32: < 2^31 rows
    live = rows < n_rows
    src_row = _row_offsets(src_table, rows, ROWS_PER_BLOCK, src_stride, SRC_ALIGN)
    dst_row = _row_offsets(dst_table, rows, ROWS_PER_BLOCK, dst_stride, DST_ALIGN)
    lane = tl.arange(0, 16)
    byte = tl.arange(0, 8)
    # NoPE groups [R, G] of 16 E4M3 bytes under their tile's exponent byte (clamped to 1..254).
    g = tl.arange(0, GROUPS_P)
    groups = live[:, None] & (g < NOPE // 16)[None, :]
    target = tl.load(src_ptr + (src_row[:, None, None] + g[None, :, None] * 16 + lane[None, None, :]),
                     mask=groups[:, :, None], other=0).to(tl.int32)
    stored_exponent = tl.load(src_ptr + (src_row[:, None] + FIELD + (g // 4)[None, :]), mask=groups,
                              other=0).to(tl.int32)
    exponent = tl.minimum(tl.maximum(stored_exponent, 1), 254)
    near = tl.load(nope_near + ((exponent << 7) | tl.max(target & 0x7F, axis=2)), mask=groups, other=1)
    codes, scale, count = _search(exponent * (SLOTS * 256), target, near.to(tl.int32), nope_outcome, decoded,
                                  groups, 256, ALTERNATIVES)
    # RoPE groups [R, G] of 16 bf16 values.
    r = tl.arange(0, ROPE_P)
    rgroups = live[:, None] & (r < ROPE_GROUPS)[None, :]
    src16 = src16_ptr
    src_half = tl.multiple_of((src_row + NOPE) // 2, SRC_ALIGN // 2)
    rtarget = tl.load(src16 + (src_half[:, None, None] + r[None, :, None] * 16 + lane[None, None, :]),
                      mask=rgroups[:, :, None], other=0).to(tl.int32) & 0xFFFF
    rnear = tl.load(rope_near + tl.max(rtarget & 0x7FFF, axis=2), mask=rgroups, other=1)
    rcodes, rscale, rcount = _search(tl.zeros_like(rnear).to(tl.int32), rtarget, rnear.to(tl.int32), rope_outcome,
                                     decoded, rgroups, 65536, ALTERNATIVES)
    # The model row found: packed codes, then the scale bytes (NoPE groups', then RoPE's).
    _store_packed(dst_ptr, dst_row, g[None, :, None] * 8 + byte[None, None, :], codes, groups[:, :, None],
                  GROUPS_P, BLOCK_ROWS)
    _store_packed(dst_ptr, dst_row, NOPE // 2 + r[None, :, None] * 8 + byte[None, None, :], rcodes,
                  rgroups[:, :, None], ROPE_P, BLOCK_ROWS)
    tl.store(dst_ptr + (dst_row[:, None] + HALF + g[None, :]), scale.to(tl.uint8), mask=groups)
    tl.store(dst_ptr + (dst_row[:, None] + HALF + NOPE // 16 + r[None, :]), rscale.to(tl.uint8), mask=rgroups)
    # Its re-encoding (the load's math) against the engine's bytes: NoPE, the exponent bytes, RoPE, the pad.
    group_exponent = _group_exponent(tl.max(codes & 7, axis=2), scale)
    tile = tl.max(tl.reshape(group_exponent, (BLOCK_ROWS, TILES_P, 4)), axis=2)
    tile_exponent = tl.reshape(tl.broadcast_to(tile[:, :, None], (BLOCK_ROWS, TILES_P, 4)), (BLOCK_ROWS, GROUPS_P))
    factor = e4m3_value(scale & 0x7F) * ((254 - tile_exponent) << 23).to(tl.float32, bitcast=True)
    again = _nope_bytes(codes, scale[:, :, None], factor[:, :, None], (tile_exponent == 256)[:, :, None],
                        _any(tile_exponent == 256),
                        nope_bytes_table, NAN_KEY, HW_FP8)
    wrong = tl.max(((again != target) & groups[:, :, None]).to(tl.int32), axis=2)
    wrong |= ((tile_exponent & 0xFF) != stored_exponent) & groups
    rwrong = tl.max(((_rope_bits(rcodes, rscale[:, :, None], _any((rscale & 0x7F) == 0x7F), rope_table) != rtarget)
                     & rgroups[:, :, None]).to(tl.int32), axis=2)
    q = tl.arange(0, SCALES_P)
    pad = live[:, None] & ((q >= TILES) & (q < V4_BYTES - FIELD))[None, :]
    pad_bytes = tl.load(src_ptr + (src_row[:, None] + FIELD + q[None, :]), mask=pad, other=0).to(tl.int32)
    exact = (tl.max(wrong, axis=1) == 0) & (tl.max(rwrong, axis=1) == 0) & (tl.max(pad_bytes, axis=1) == 0)
    collision = (tl.max(((count > 1) & groups).to(tl.int32), axis=1) > 0) \
        | (tl.max(((rcount > 1) & rgroups).to(tl.int32), axis=1) > 0)
    tl.store(exact_ptr + rows, exact.to(tl.int8), mask=live)
    tl.store(ambiguous_ptr + rows, (exact & collision).to(tl.int8), mask=live)
    if COPY_BYTES > 0:
        _copy_rows(src_ptr, src32_ptr, dst_ptr, dst32_ptr,
                   _row_offsets(copy_src_table, rows, ROWS_PER_BLOCK, src_stride, COPY_UNIT),
                   _row_offsets(copy_dst_table, rows, ROWS_PER_BLOCK, dst_stride, COPY_UNIT), live,
                   COPY_BYTES, COPY_P, COPY_UNIT)


def _launch_save(src: torch.Tensor, dst: torch.Tensor, shape: v4.RowShape, n_rows: int, rows_per_block: int,
                 src_stride: int, dst_stride: int, offsets: _Offsets, copy_bytes: int, alternatives: bool,
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Run the save kernel: (exact, ambiguous) bool [n_rows], or None where the source's alignment does not
    allow its 16-bit loads."""
    src_table, dst_table, copy_src, copy_dst = offsets.device
    if n_rows >= 2**31 - 1024:                        # the kernels index rows in int32
        return None
    src_align = _alignment(src.data_ptr(), src_stride, offsets.align[0])
    src16, src32, dst32 = _view(src, torch.int16), _view(src, torch.int32), _view(dst, torch.int32)
    if src_align < 2 or src16 is None:
        return None
    dst_align = _alignment(dst.data_ptr(), dst_stride, offsets.align[1])
    unit = 4 if copy_bytes and _alignment(src.data_ptr(), dst.data_ptr(), src_stride, dst_stride, copy_bytes,
                                          offsets.align[2], offsets.align[3]) >= 4 else 1
    if src32 is None or dst32 is None:
        unit = 1
    t = v4._recover_tables(src.device)
    nope_bytes, rope_table, nan_key = _load_tables(src.device)
    exact = torch.empty(n_rows, dtype=torch.int8, device=src.device)
    ambiguous = torch.empty(n_rows, dtype=torch.int8, device=src.device)
    with _on_device(src):
        _save_kernel[(triton.cdiv(n_rows, SAVE_ROWS),)](
            src, src16, src if src32 is None else src32, dst, dst if dst32 is None else dst32, exact, ambiguous,
            src_table, dst_table, copy_src, copy_dst, t.nope_near, t.rope_near,
            t.nope, t.rope, t.decoded, nope_bytes, rope_table, n_rows, src_stride, dst_stride,
            ROWS_PER_BLOCK=rows_per_block,
            NOPE=shape.nope, ROPE=shape.rope, V4_BYTES=shape.v4_bytes,
            TILES_P=triton.next_power_of_2(shape.tiles), ROPE_P=triton.next_power_of_2(shape.rope // v4.GROUP),
            SCALES_P=triton.next_power_of_2(shape.v4_bytes - shape.nope - 2 * shape.rope), NAN_KEY=nan_key,
            BLOCK_ROWS=SAVE_ROWS, COPY_BYTES=copy_bytes, COPY_P=triton.next_power_of_2(max(1, copy_bytes // unit)),
            COPY_UNIT=unit, SRC_ALIGN=src_align, DST_ALIGN=dst_align, HW_FP8=False,
            ALTERNATIVES=alternatives, num_warps=NUM_WARPS)
    return exact.view(torch.bool), ambiguous.view(torch.bool)


def recover_rows(rows: torch.Tensor, shape: v4.RowShape, alternatives: bool,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`sglang_v4.recover_rows` of uint8 V4 rows [..., v4_bytes] (checked by the caller): (native, exact,
    ambiguous) of its leading shape, or None where the rows are not viewable as [n, v4_bytes] with a unit last
    stride at even offsets."""
    flat = rows.reshape(-1, shape.v4_bytes)
    if flat.stride(-1) != 1 or flat.shape[0] == 0:
        return None
    native = torch.empty(flat.shape[0], shape.native_bytes, dtype=torch.uint8, device=rows.device)
    found = _launch_save(flat, native, shape, flat.shape[0], 1, flat.stride(0), native.stride(0),
                         _single(rows.device), 0, alternatives)
    if found is None:
        return None
    lead = rows.shape[:-1]
    return native.view(*lead, shape.native_bytes), found[0].view(lead), found[1].view(lead)


def v4_blocks_to_native(blocks: torch.Tensor, model: ModelGeometry, block_tokens: int,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`sglang_v4.v4_blocks_to_native` of uint8 V4 blocks [n, v4 block_bytes] (checked by the caller) in one
    launch: (model-rows blocks, exact [n], int64 [3]: rows, exact rows, ambiguous rows), or None for a layout
    the plan does not take."""
    plan = _plan(model, block_tokens, blocks.device)
    if plan is None or blocks.dim() != 2 or blocks.stride(-1) != 1 or blocks.shape[0] == 0:
        return None
    n, shape = blocks.shape[0], v4.RowShape.of(model)
    swapped = _Offsets(device=(plan.offsets.device[1], plan.offsets.device[0], plan.offsets.device[3],
                               plan.offsets.device[2]),
                       align=(plan.offsets.align[1], plan.offsets.align[0], plan.offsets.align[3],
                              plan.offsets.align[2]))
    native = torch.empty(n, model.block_bytes(block_tokens), dtype=torch.uint8, device=blocks.device)
    found = _launch_save(blocks, native, shape, n * plan.rows, plan.rows, blocks.stride(0), native.stride(0),
                         swapped, plan.index_bytes, False)
    if found is None:
        return None
    exact, ambiguous = found
    rows = torch.full((), n * plan.rows, dtype=torch.int64, device=blocks.device)      # a fill: no host copy
    counts = torch.stack((rows, exact.sum(), ambiguous.sum()))
    return native, exact.view(n, plan.rows).all(dim=1), counts
