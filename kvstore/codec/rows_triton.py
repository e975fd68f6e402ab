"""Fused Triton kernels for the model's cache rows on CUDA: one pass over the tensor per direction.

Imported only on the first CUDA call (`kvstore.codec.fp4.CudaKernel`, wired in
kvstore/codec/rows.py), so CPU-only machines never import triton. Each function
returns what the torch code in rows.py returns, bit for bit
(tests/kvstore/codec/test_codec_gpu.py); rows.py states the rules.

How each rule is computed here, exactly, without a division per element:

- E2M1 codes: the model rounds float32 x/scale to the E2M1 grid. For a scale of
  at most 4 significant bits (E4M3, or a power of two) and a float32 x, that
  rounded quotient reaches a midpoint m (0.25, 0.75, ..., 5) exactly when |x|
  reaches m*scale, a product exact in float32: the quotients that round onto m
  lie within half an ulp of it, and no float32 |x| lies strictly between
  scale*(m -+ half an ulp) and m*scale. So the kernels compare |x| with m*scale,
  ties to the even code, by a binary search (three comparisons per element).
- Compressed-KV scale: on GPUs with E4M3 instructions (HW_FP8), the torch code's
  own steps: amax/6 correctly rounded (`tl.div_rn`, one per 16 channels), held
  at 448, the GPU's round-to-nearest-even cast (the lanes kernel calls that cvt
  itself, its value taken on the bits: `e4m3_code_cvt`). Otherwise amax/6 rounded once
  to E4M3 (rows.py explains why that is the same): amax*(1/6), cast on the bits,
  is off by at most one code; one step up or down, decided by comparing amax
  with 6x the midpoint between neighbouring codes (a product of at most 7
  significant bits, exact), gives the correctly rounded code, subnormals
  included.
- UE8M0 scales: amax*(1/6) or amax*(1/448) in float32, as the engines compute it,
  and the power of two at or above it taken on the float32 bits. x/scale is then
  x times the exact inverse power of two.
- E4M3 data: the GPU's cast (HW_FP8), else the float32 -> E4M3 cast on the bits,
  as c10 does it; x/scale is clamped to +-448 first, so saturation never acts.
- Decoding: code times scale in float32, an exact product, then the cast to the
  output dtype (round to nearest even, as torch's `.to()`).

No expression here multiplies then adds, so fusing into FMA cannot change a result.

Non-finite input does not fail inside a kernel: a group whose largest magnitude
is inf or NaN stores it in a one-element float32 flag (no reduction across the
program), which rows.py hands to `check_finite`.

Layout: rows are contiguous; a program takes whole rows as a [rows, groups,
group channels] block (BLOCK_ELEMENTS in all); the channel count is a
compile-time constant (one compilation per width and dtype, none per row count).
Speed on an H200 against a copy of the bf16 bytes: kvstore/bench/codec.py.
"""

# Triton names constexpr parameters and values in capitals (BLOCK_ROWS); kept here so kernels read like
# any other. A constexpr `if` selects code at compile time; ternaries would hide that.
# ruff: noqa: N803, N806, SIM108

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

#: Elements per program (rows x channels); rows of more than this take one program each.
#: 4,096 with 4 warps was best or within noise of it for every kernel on an H200 (2048-16384, 4-8 warps tried).
BLOCK_ELEMENTS = 4096
#: Warps per program.
NUM_WARPS = 4
#: Widest row the kernels take; wider ones decline (the torch code runs).
MAX_ROW_ELEMENTS = 16384
#: Output dtypes the decoders write directly; others are converted from float32 afterwards.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: E4M3 conversions (window data both ways, compressed-KV scales): True uses the GPU's own
#: float32 -> E4M3 (round to nearest even, saturating) and E4M3 -> float16 instructions,
#: False the same conversions on the bits (any GPU), None picks True on compute capability
#: 8.9 and later. Both give the same bytes (tests/kvstore/codec/test_codec_gpu.py).
HW_FP8: bool | None = None
#: Which kernel encodes bf16 FP4 rows (compressed KV, indexer key; issue 25 item 5), all giving the same bytes:
#: "lanes" (`_encode_bf16_lanes_kernel`, the default: two channels per int32 word, the E2M1 decision in 16-bit
#: lanes), "general" (`_encode_kernel`, which every other dtype takes) or "pairs" (`_encode_bf16_pairs_kernel`,
#: compressed KV only; slower than "general" on the H200). docs/BENCHMARKS.md's FP4 section has their speeds.
BF16_KERNEL = "lanes"
#: The lanes kernel's byte moves (PTX `prmt`) and lane maxima (`max.u16x2`, sm_90) in inline PTX on CUDA;
#: False: the same results by shifts and masks (any GPU, and the CPU interpreter, which cannot run PTX).
#: None picks True on compute capability 9.0 and later.
LANES_PTX: bool | None = None

# Row formats (the FORMAT constexpr).
COMPRESSED_KV = tl.constexpr(0)
INDEXER_KEY = tl.constexpr(1)
WINDOW = tl.constexpr(2)


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
    return code | sign


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
def ue8m0_value(code):
    """float32 value 2^(code-127) of a UE8M0 byte given as int32 (0 -> 2^-127, 255 -> NaN)."""
    bits = tl.where(code == 0, 0x00400000, code << 23)
    return tl.where(code == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_value(code):
    """float32 value of a 4-bit E2M1 code given as int32 (code 8 is -0.0)."""
    magnitude = code & 7
    normal = (((magnitude >> 1) + 126) << 23) | ((magnitude & 1) << 22)
    bits = tl.where(magnitude < 2, magnitude * (126 << 23), normal)  # 0 -> 0.0, 1 -> 0.5
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_code(bits, ax, scale):
    """4-bit code (int32) of x/scale, x given by its float32 bits and ax = |x|, scale > 0.

    |x| against the exact thresholds m*scale (module docstring), ties to the even
    code, by a binary search over the 8 magnitudes; the sign bit of x is kept.
    """
    upper = ax >= 1.75 * scale  # magnitudes 4-7; a tie goes up to the even code 4
    threshold = tl.where(upper, 3.5 * scale, 0.75 * scale)
    high = ax >= threshold  # 6-7 or 2-3; ties go up to the even codes 6 and 2
    threshold = tl.where(upper, tl.where(high, 5.0 * scale, 2.5 * scale), tl.where(high, 1.25 * scale, 0.25 * scale))
    odd = ax > threshold  # ties stay on the even code
    magnitude = upper.to(tl.int32) * 4 + high.to(tl.int32) * 2 + odd.to(tl.int32)
    return magnitude | ((bits >> 28) & 8)


@triton.jit
def kv_scale_code(amax):
    """E4M3 code (int32) of amax/6 rounded once, ties to even, held at 448 (amax already floored)."""
    code = e4m3_code(tl.minimum(amax * 0.16666666666666666, 448.0))
    # amax*(1/6) is rounded twice; move one code where amax lies beyond 6x the midpoint.
    here = e4m3_value(code)
    up = e4m3_value(code + 1)
    boundary = 6.0 * ((here + up) * 0.5)
    move = (amax > boundary) | ((amax == boundary) & ((code & 1) == 1))
    code = tl.where(move & (code < 0x7E), code + 1, code)
    here = e4m3_value(code)
    down = e4m3_value(code - 1)
    boundary = 6.0 * ((here + down) * 0.5)
    move = (amax < boundary) | ((amax == boundary) & ((code & 1) == 1))
    return tl.where(move & (code > 1), code - 1, code)


@triton.jit
def ceil_power_of_two_bits(v):
    """float32 bits of the power of two at or above positive normal float32 v."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits >> 23) + ((bits & 0x007FFFFF) != 0).to(tl.int32)) << 23


@triton.jit
def _flag_non_finite(flag_ptr, amax_bits):
    """Store a group's largest magnitude in the flag where it is inf or NaN (amax_bits: |x| bits).

    Only such groups store, all to the one flag: no reduction across the program.
    """
    tl.store(flag_ptr + tl.zeros_like(amax_bits), amax_bits.to(tl.float32, bitcast=True),
             mask=amax_bits > 0x7F7FFFFF)


@triton.jit
def e4m3_code_cvt(y):
    """E4M3 (fn) byte (int32) of float32 y, |y| <= 448: the GPU's `cvt.rn.satfinite.e4m3x2.f32` (sm_89 and later,
    round to nearest even) in inline PTX, one value a call (the pair's other half converts 0.0 and is dropped).

    Not Triton's float8e4nv converts, which the lanes kernel used first: on the H200 (Triton 3.6, 2026-12-03)
    the scale bytes came out right but the float32 scales converted back from them (a packed e4m3x2 -> f16x2
    cvt) were wrong in 46% of the groups of 512- and 128-channel rows given 16-byte aligned (as if the scale
    were 0: all-zero groups got code 7), the convert bug kvstore/codec/sglang_v4_triton.py's HW_FP8 note met
    too. The value is taken on the bits instead (`e4m3_value`); scripts/lanes_debug.py shows both."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 p; cvt.rn.satfinite.e4m3x2.f32 p, 0f00000000, $1; cvt.u32.u16 $0, p; }",
        "=r,r", [y], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _fp4_scales(amax, FORMAT: tl.constexpr, HW_FP8: tl.constexpr, CVT: tl.constexpr):
    """(scale byte as int32, scale as float32) of each group of an FP4 row; CVT: with HW_FP8, the E4M3 cast by
    `e4m3_code_cvt` and its value on the bits, instead of Triton's float8e4nv converts."""
    if FORMAT == COMPRESSED_KV:
        floored = tl.maximum(amax, 0.01171875)  # floor 6 * 2^-9
        if HW_FP8 and CVT:
            # The torch code's steps, as below, with the GPU's cvt called directly.
            code = e4m3_code_cvt(tl.minimum(tl.div_rn(floored, 6.0), 448.0))
            scale = e4m3_value(code)
        elif HW_FP8:
            # The torch code's steps: amax/6 correctly rounded, held at 448, the GPU's E4M3 cast (RNE).
            scale8 = tl.minimum(tl.div_rn(floored, 6.0), 448.0).to(tl.float8e4nv)
            code = scale8.to(tl.uint8, bitcast=True).to(tl.int32)
            scale = scale8.to(tl.float32)
        else:
            code = kv_scale_code(floored)
            scale = e4m3_value(code)
    else:
        bits = ceil_power_of_two_bits(tl.maximum(amax, 7.052966104933725e-38) * 0.16666666666666666)
        code = bits >> 23  # floor 6 * 2^-126, then * (1/6)
        scale = bits.to(tl.float32, bitcast=True)
    return code, scale


@triton.jit(do_not_specialize=["n_rows"])  # one compilation whatever the row count
def _encode_kernel(x_ptr, rows_ptr, flag_ptr, n_rows,
                   FORMAT: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, ROW_BYTES: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
                   HW_FP8: tl.constexpr):
    GROUPS: tl.constexpr = D // GROUP
    HALF: tl.constexpr = GROUP // 2
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.arange(0, BLOCK_GROUPS)
    live = (rows < n_rows)[:, None] & (group < GROUPS)[None, :]
    out_row = rows[:, None] * ROW_BYTES
    lane = tl.arange(0, GROUP)
    x = tl.load(x_ptr + (rows[:, None, None] * D + group[None, :, None] * GROUP + lane[None, None, :]),
                mask=live[:, :, None], other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    ax_bits = bits & 0x7FFFFFFF
    amax_bits = tl.max(ax_bits, axis=2)
    _flag_non_finite(flag_ptr, amax_bits)
    amax = amax_bits.to(tl.float32, bitcast=True)
    if FORMAT == WINDOW:
        scale_bits = ceil_power_of_two_bits(tl.maximum(amax, 1e-4) * 0.002232142857142857)  # * (1/448)
        inverse = ((254 << 23) - scale_bits).to(tl.float32, bitcast=True)  # 1/scale, exact
        q = tl.minimum(tl.maximum(x * inverse[:, :, None], -448.0), 448.0)
        if HW_FP8:
            data = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # cvt.rn.satfinite: RNE, |q| <= 448
        else:
            data = e4m3_code(q).to(tl.uint8)
        tl.store(rows_ptr + (out_row[:, :, None] + group[None, :, None] * GROUP + lane[None, None, :]),
                 data, mask=live[:, :, None])
        tl.store(rows_ptr + (out_row + D + group[None, :]), (scale_bits >> 23).to(tl.uint8), mask=live)
    else:
        scale_code, scale = _fp4_scales(amax, FORMAT, HW_FP8, False)
        codes = e2m1_code(bits, ax_bits.to(tl.float32, bitcast=True), scale[:, :, None])
        # Element 2i in the low nibble of byte i, 2i+1 in the high nibble.
        even_codes, odd_codes = tl.split(tl.reshape(codes, (BLOCK_ROWS, BLOCK_GROUPS, HALF, 2)))
        byte = tl.arange(0, HALF)
        tl.store(rows_ptr + (out_row[:, :, None] + group[None, :, None] * HALF + byte[None, None, :]),
                 (even_codes | (odd_codes << 4)).to(tl.uint8), mask=live[:, :, None])
        tl.store(rows_ptr + (out_row + D // 2 + group[None, :]), scale_code.to(tl.uint8), mask=live)


@triton.jit(do_not_specialize=["n_rows"])  # one compilation whatever the row count
def _encode_bf16_pairs_kernel(x32_ptr, rows_ptr, flag_ptr, n_rows,
                              FORMAT: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, ROW_BYTES: tl.constexpr,
                              BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr, HW_FP8: tl.constexpr):
    """`_encode_kernel`'s FP4 rows of bf16 input read as int32 words, two channels each: a word's low half
    is channel 2i (its float32 bits: the half shifted up), the high half channel 2i+1, so the codes of a
    word make its output byte directly (no reshape and split of the codes, which went through shared memory)."""
    GROUPS: tl.constexpr = D // GROUP
    HALF: tl.constexpr = GROUP // 2
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.arange(0, BLOCK_GROUPS)
    live = (rows < n_rows)[:, None] & (group < GROUPS)[None, :]
    out_row = rows[:, None] * ROW_BYTES
    pair = tl.arange(0, HALF)
    words = tl.load(x32_ptr + (rows[:, None, None] * (D // 2) + group[None, :, None] * HALF + pair[None, None, :]),
                    mask=live[:, :, None], other=0)
    even = words << 16                     # float32 bits of channel 2i (bf16 -> float32 is exact)
    odd = words & -65536                   # of channel 2i+1 (0xFFFF0000)
    even_ax, odd_ax = even & 0x7FFFFFFF, odd & 0x7FFFFFFF
    amax_bits = tl.max(tl.maximum(even_ax, odd_ax), axis=2)
    _flag_non_finite(flag_ptr, amax_bits)
    scale_code, scale = _fp4_scales(amax_bits.to(tl.float32, bitcast=True), FORMAT, HW_FP8, False)
    even_codes = e2m1_code(even, even_ax.to(tl.float32, bitcast=True), scale[:, :, None])
    odd_codes = e2m1_code(odd, odd_ax.to(tl.float32, bitcast=True), scale[:, :, None])
    tl.store(rows_ptr + (out_row[:, :, None] + group[None, :, None] * HALF + pair[None, None, :]),
             (even_codes | (odd_codes << 4)).to(tl.uint8), mask=live[:, :, None])
    tl.store(rows_ptr + (out_row + D // 2 + group[None, :]), scale_code.to(tl.uint8), mask=live)


@triton.jit
def _msbs(a, b, PTX: tl.constexpr):
    """Bytes 0xFF or 0x00 (uint32): bits 15 and 31 of a in bytes 0 and 1, of b in bytes 2 and 3."""
    if PTX:
        # One PTX prmt: selector nibbles 8|i copy the top bit of byte i of {b, a} over a whole byte.
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0xFDB9;", "=r,r,r", [a, b], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    return (((a >> 15) & 1) * 0xFF) | (((a >> 31) & 1) * 0xFF00) | (((b >> 15) & 1) * 0xFF0000) | (
        ((b >> 31) & 1) * 0xFF000000)


@triton.jit
def _top_bytes(a, b, PTX: tl.constexpr):
    """Byte 3 of a in byte 0, byte 3 of b in byte 1 (uint32; bytes 2 and 3 are not meant)."""
    if PTX:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x0073;", "=r,r,r", [a, b], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    return (a >> 24) | ((b >> 16) & 0xFF00)


@triton.jit
def _low_halves(a, b, PTX: tl.constexpr):
    """The low 16 bits of a, then those of b (uint32)."""
    if PTX:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    return (a & 0xFFFF) | (b << 16)


@triton.jit
def _lane_max_ptx(a, b):
    """The larger of a's and b's 16-bit lanes, lane by lane (uint32), in one PTX `max.u16x2` (sm_90)."""
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True,
                                     pack=1)


@triton.jit
def _lane_masks(s, PTX: tl.constexpr):
    """0xFFFF in each 16-bit lane of s whose top bit (15, 31) is set, 0 in the others (uint32)."""
    if PTX:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0xBB99;", "=r,r", [s], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    return ((s >> 15) & 0x10001) * 0xFFFF


@triton.jit
def _lane_threshold(scale, midpoint: tl.constexpr, TIE_UP: tl.constexpr):
    """The constant C (uint32, both lanes) for which a + C has its lane's top bit set exactly when the bf16
    magnitude a (15 bits) is at least (TIE_UP) or above midpoint * scale: C = 0x8000 - T, T the smallest bf16
    bits that pass. midpoint * scale is exact in float32 (module docstring), so no rounding decides here."""
    bits = (midpoint * scale).to(tl.uint32, bitcast=True)
    if TIE_UP:
        least = (bits + 0xFFFF) >> 16                 # the smallest bf16 >= t
    else:
        least = (bits >> 16) + 1                      # the smallest bf16 > t
    return ((0x8000 - least) * 0x10001).to(tl.uint32)


@triton.jit
def _pick(mask, if_set, if_clear):
    """Per bit: if_set where mask is set, if_clear elsewhere (one LOP3)."""
    return (if_set & mask) | (if_clear & (mask ^ 0xFFFFFFFF))


@triton.jit(do_not_specialize=["n_groups"])  # one compilation whatever the row count
def _encode_bf16_lanes_kernel(x32_ptr, rows_ptr, flag_ptr, n_groups,
                              FORMAT: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, ROW_BYTES: tl.constexpr,
                              BLOCK_GROUPS: tl.constexpr, HW_FP8: tl.constexpr, PTX: tl.constexpr):
    """`_encode_kernel`'s FP4 rows of bf16 input, two channels at a time in the 16-bit lanes of an int32 word.

    A thread holds whole groups (16-byte chunks of a group on the outer axis, so no shuffles for the amax),
    and decides E2M1 codes on the bf16 bits: for a magnitude a of 15 bits and T the smallest bf16 bits past
    a threshold m*scale, a + (0x8000 - T) sets the lane's top bit exactly when a passes, and no carry crosses
    lanes (both terms are below 0x8000). The binary search of `e2m1_code` then takes 3 adds a word (two
    channels); the next thresholds are picked by lane masks, and the output byte (codes of channels 2i and
    2i+1) is gathered from the sums' and the input's top bits by one multiply. Groups are numbered over
    the whole tensor (rows are contiguous), so any width fills a program."""
    WORDS: tl.constexpr = GROUP // 2                  # int32 words (channel pairs) a group
    CHUNKS: tl.constexpr = WORDS // 4                 # 16-byte loads a group
    GROUPS: tl.constexpr = D // GROUP                 # groups a row
    q = tl.program_id(0) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)  # group index over the tensor (< 2^31)
    live = q < n_groups
    row = (q // GROUPS).to(tl.int64)
    in_row = q - (q // GROUPS) * GROUPS
    chunk = tl.arange(0, CHUNKS)[:, None, None]
    word = tl.arange(0, 4)[None, None, :]
    at = chunk * 4 + word
    w = tl.load(x32_ptr + (q.to(tl.int64)[None, :, None] * WORDS + at), mask=live[None, :, None],
                other=0).to(tl.uint32, bitcast=True)
    a = w & 0x7FFF7FFF                                # both magnitudes
    if PTX:  # each lane's largest
        lanes = tl.reduce(tl.reduce(a, 2, _lane_max_ptx), 0, _lane_max_ptx)
    else:
        lanes = tl.max(tl.max(a & 0xFFFF0000, axis=2), axis=0) | tl.max(tl.max(a & 0xFFFF, axis=2), axis=0)
    amax_bits = tl.maximum(lanes << 16, lanes & 0xFFFF0000).to(tl.int32, bitcast=True)  # float32 bits, bf16 amax
    _flag_non_finite(flag_ptr, amax_bits)
    scale_code, scale = _fp4_scales(amax_bits.to(tl.float32, bitcast=True), FORMAT, HW_FP8, True)
    scale = scale[None, :, None]
    # e2m1_code's search: magnitudes 4-7 at 1.75 (ties up), then 0.75 / 3.5 (ties up), then 0.25 / 1.25 /
    # 2.5 / 5 (ties stay down).
    s1 = a + _lane_threshold(scale, 1.75, True)
    m1 = _lane_masks(s1, PTX)
    s2 = a + _pick(m1, _lane_threshold(scale, 3.5, True), _lane_threshold(scale, 0.75, True))
    m2 = _lane_masks(s2, PTX)
    low = _pick(m2, _lane_threshold(scale, 1.25, False), _lane_threshold(scale, 0.25, False))
    high = _pick(m2, _lane_threshold(scale, 5.0, False), _lane_threshold(scale, 2.5, False))
    s3 = a + _pick(m1, high, low)
    # Byte bits 2,6 (magnitude bit 2 of channels 2i, 2i+1) from s1, 1,5 from s2, 0,4 from s3, 3,7 the signs:
    # each source byte is 0x00 or 0xFF, masked to its one bit; the multiply adds the four bytes into byte 3.
    summed = ((_msbs(s1, s2, PTX) & 0x20024004) | (_msbs(s3, w, PTX) & 0x80081001)) * 0x01010101
    out = row * ROW_BYTES
    if ROW_BYTES % 4 == 0:
        # A chunk's 4 bytes (byte 3 of each sum) into one word, stored as one.
        even, odd = tl.split(tl.reshape(summed, (CHUNKS, BLOCK_GROUPS, 2, 2)))  # words 0, 2 and 1, 3
        p0, p2 = tl.split(even)
        p1, p3 = tl.split(odd)
        packed = _low_halves(_top_bytes(p0, p1, PTX), _top_bytes(p2, p3, PTX), PTX)
        words_ptr = rows_ptr.to(tl.pointer_type(tl.uint32))
        tl.store(words_ptr + ((out // 4)[None, :] + in_row[None, :] * (WORDS // 4) + tl.arange(0, CHUNKS)[:, None]),
                 packed, mask=live[None, :])
    else:
        tl.store(rows_ptr + (out[None, :, None] + in_row[None, :, None] * WORDS + at), (summed >> 24).to(tl.uint8),
                 mask=live[None, :, None])
    tl.store(rows_ptr + (out + D // 2 + in_row), scale_code.to(tl.uint8), mask=live)


@triton.jit(do_not_specialize=["n_rows"])  # one compilation whatever the row count
def _decode_kernel(rows_ptr, out_ptr, n_rows,
                   FORMAT: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, ROW_BYTES: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
                   HW_FP8: tl.constexpr):
    GROUPS: tl.constexpr = D // GROUP
    HALF: tl.constexpr = GROUP // 2
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.arange(0, BLOCK_GROUPS)
    live = (rows < n_rows)[:, None] & (group < GROUPS)[None, :]
    in_row = rows[:, None] * ROW_BYTES
    if FORMAT == WINDOW:
        lane = tl.arange(0, GROUP)
        codes = tl.load(rows_ptr + (in_row[:, :, None] + group[None, :, None] * GROUP + lane[None, None, :]),
                        mask=live[:, :, None], other=0)
        if HW_FP8:
            values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            values = e4m3_value(codes.to(tl.int32))
        scale = ue8m0_value(tl.load(rows_ptr + (in_row + D + group[None, :]), mask=live, other=127).to(tl.int32))
        out = values * scale[:, :, None]
        # Triton's float32 -> bf16/f16 conversion rounds to nearest even, as torch's .to() does.
        tl.store(out_ptr + (rows[:, None, None] * D + group[None, :, None] * GROUP + lane[None, None, :]),
                 out.to(out_ptr.dtype.element_ty), mask=live[:, :, None])
    else:
        scale_code = tl.load(rows_ptr + (in_row + D // 2 + group[None, :]), mask=live, other=0).to(tl.int32)
        if FORMAT == COMPRESSED_KV:
            scale = e4m3_value(scale_code)
        else:
            scale = ue8m0_value(scale_code)
        byte = tl.arange(0, HALF)
        packed = tl.load(rows_ptr + (in_row[:, :, None] + group[None, :, None] * HALF + byte[None, None, :]),
                         mask=live[:, :, None], other=0).to(tl.int32)
        lane = tl.arange(0, GROUP)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_ROWS, BLOCK_GROUPS, GROUP))
        out = e2m1_value(codes) * scale[:, :, None]
        tl.store(out_ptr + (rows[:, None, None] * D + group[None, :, None] * GROUP + lane[None, None, :]),
                 out.to(out_ptr.dtype.element_ty), mask=live[:, :, None])


# (group channels, row bytes for d channels) of each format.
_FORMATS = {
    0: (16, lambda d: d // 2 + d // 16),
    1: (32, lambda d: d // 2 + d // 32),
    2: (32, lambda d: d + d // 32),
}
# d from a row's bytes: d = row_bytes * numerator // denominator.
_WIDTHS = {0: (16, 9), 1: (32, 17), 2: (32, 33)}


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Launch on t's GPU (Triton launches on the current one); a no-op for the CPU interpreter."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _tiling(d: int, group: int) -> tuple[int, int]:
    """(rows per program, groups per row padded to a power of two)."""
    block_groups = triton.next_power_of_2(d // group)
    return max(1, BLOCK_ELEMENTS // (block_groups * group)), block_groups


@functools.cache
def _has_fp8_conversions(device: torch.device) -> bool:
    """Whether the GPU converts float32 <-> E4M3 itself (compute capability 8.9 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _hw_fp8(device: torch.device) -> bool:
    return _has_fp8_conversions(device) if HW_FP8 is None else HW_FP8


def _lanes_ptx(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) if LANES_PTX is None else LANES_PTX


def _encode(x: torch.Tensor, fmt: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    group, row_bytes = _FORMATS[fmt]
    d = x.shape[-1] if x.dim() else 0
    if x.numel() == 0 or d % group or d > MAX_ROW_ELEMENTS or x.dtype not in KERNEL_DTYPES:
        return None
    x = x.contiguous()
    n_rows = x.numel() // d
    rows = torch.empty((*x.shape[:-1], row_bytes(d)), dtype=torch.uint8, device=x.device)
    flag = torch.zeros(1, dtype=torch.float32, device=x.device)
    block_rows, block_groups = _tiling(d, group)
    if fmt != 2 and x.dtype == torch.bfloat16 and BF16_KERNEL == "lanes" and x.data_ptr() % 4 == 0:
        n_groups = x.numel() // group
        with _on_device(x):
            _encode_bf16_lanes_kernel[(triton.cdiv(n_groups, BLOCK_ELEMENTS // group),)](
                x.view(torch.int32), rows, flag, n_groups, FORMAT=fmt, D=d, GROUP=group, ROW_BYTES=row_bytes(d),
                BLOCK_GROUPS=BLOCK_ELEMENTS // group, HW_FP8=_hw_fp8(x.device), PTX=_lanes_ptx(x.device),
                num_warps=NUM_WARPS)
        return rows, flag
    if BF16_KERNEL == "pairs" and fmt == 0 and x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0:
        with _on_device(x):
            _encode_bf16_pairs_kernel[(triton.cdiv(n_rows, block_rows),)](
                x.view(torch.int32), rows, flag, n_rows, FORMAT=fmt, D=d, GROUP=group, ROW_BYTES=row_bytes(d),
                BLOCK_ROWS=block_rows, BLOCK_GROUPS=block_groups, HW_FP8=_hw_fp8(x.device), num_warps=NUM_WARPS)
        return rows, flag
    with _on_device(x):
        _encode_kernel[(triton.cdiv(n_rows, block_rows),)](
            x, rows, flag, n_rows, FORMAT=fmt, D=d, GROUP=group, ROW_BYTES=row_bytes(d),
            BLOCK_ROWS=block_rows, BLOCK_GROUPS=block_groups, HW_FP8=_hw_fp8(x.device), num_warps=NUM_WARPS)
    return rows, flag


def _decode(rows: torch.Tensor, dtype: torch.dtype, fmt: int) -> torch.Tensor | None:
    group, _ = _FORMATS[fmt]
    numerator, denominator = _WIDTHS[fmt]
    width = rows.shape[-1] if rows.dim() else 0
    d = width * numerator // denominator
    if rows.numel() == 0 or width % denominator or d > MAX_ROW_ELEMENTS or rows.dtype != torch.uint8:
        return None
    rows = rows.contiguous()
    n_rows = rows.numel() // width
    kernel_dtype = dtype if dtype in KERNEL_DTYPES else torch.float32
    out = torch.empty((*rows.shape[:-1], d), dtype=kernel_dtype, device=rows.device)
    block_rows, block_groups = _tiling(d, group)
    with _on_device(rows):
        _decode_kernel[(triton.cdiv(n_rows, block_rows),)](
            rows, out, n_rows, FORMAT=fmt, D=d, GROUP=group, ROW_BYTES=width,
            BLOCK_ROWS=block_rows, BLOCK_GROUPS=block_groups, HW_FP8=_hw_fp8(rows.device), num_warps=NUM_WARPS)
    return out if kernel_dtype == dtype else out.to(dtype)


def compressed_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`rows.compressed_kv_rows` in one pass: (uint8 rows [..., d/2 + d/16], non-finite flag), or None."""
    return _encode(x, 0)


def indexer_key_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`rows.indexer_key_rows` in one pass: (uint8 rows [..., d/2 + d/32], non-finite flag), or None."""
    return _encode(x, 1)


def swa_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`rows.swa_rows` in one pass: (uint8 rows [..., d + d/32], non-finite flag), or None."""
    return _encode(x, 2)


def decode_compressed_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`rows.decode_compressed_kv_rows` in one pass, written straight in `dtype`."""
    return _decode(rows, dtype, 0)


def decode_indexer_key_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`rows.decode_indexer_key_rows` in one pass, written straight in `dtype`."""
    return _decode(rows, dtype, 1)


def decode_swa_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`rows.decode_swa_rows` in one pass, written straight in `dtype`."""
    return _decode(rows, dtype, 2)
