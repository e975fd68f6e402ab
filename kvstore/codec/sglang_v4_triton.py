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
  cast on the bits as c10 does it: `HW_FP8`), with the sign the XOR of the code's and the scale's. RoPE
  values are exact in bf16: the float32 bits' high half. Where a scale byte is NaN (0x7F, 0xFF), the
  bytes are gathered from the torch path's own tables (built on the CPU, whose NaN bits they carry).
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
LOAD_ROWS = 8
SAVE_ROWS = 4
#: Warps per program.
NUM_WARPS = 4
#: E4M3 casts: True the GPU's cvt through Triton's float8e4nv, False or None (the default) on the bits (any
#: GPU, and the interpreter, whose float8 cast does not round to nearest even). Bits by default: on the H200
#: (sm_90, Triton 3.6, 2026-12-02) the cvt path gave other bytes than the torch path's in every row (byte 2
#: of each row), where the bit cast was torch.equal; the cvt path stays for a Triton that gets it right.
HW_FP8: bool | None = None


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


@triton.jit(do_not_specialize=["n_rows"])
def _load_kernel(src_ptr, src32_ptr, dst_ptr, dst16_ptr, dst32_ptr, src_table, dst_table, copy_src_table,
                 copy_dst_table, nope_table, rope_table,
                 n_rows, src_stride, dst_stride, ROWS_PER_BLOCK: tl.constexpr,
                 NOPE: tl.constexpr, ROPE: tl.constexpr, V4_BYTES: tl.constexpr, TILES_P: tl.constexpr,
                 ROPE_P: tl.constexpr, SCALES_P: tl.constexpr, NAN_KEY: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 COPY_BYTES: tl.constexpr, COPY_P: tl.constexpr, COPY_UNIT: tl.constexpr,
                 SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr, HW_FP8: tl.constexpr):
    TILES: tl.constexpr = NOPE // 64
    HALF: tl.constexpr = (NOPE + ROPE) // 2
    ROPE_GROUPS: tl.constexpr = ROPE // 16
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)              # int32: < 2^31 rows
    live = rows < n_rows
    src_row = _row_offsets(src_table, rows, ROWS_PER_BLOCK, src_stride, SRC_ALIGN)
    dst_row = _row_offsets(dst_table, rows, ROWS_PER_BLOCK, dst_stride, DST_ALIGN)
    # NoPE: bytes [R, tile, group, 8], two codes each; scale bytes [R, tile, group].
    t = tl.arange(0, TILES_P)
    g = tl.arange(0, 4)
    k = tl.arange(0, 8)
    tiles = live[:, None] & (t < TILES)[None, :]
    place = t[None, :, None, None] * 32 + g[None, None, :, None] * 8 + k[None, None, None, :]
    packed = tl.load(src_ptr + (src_row[:, None, None, None] + place), mask=tiles[:, :, None, None],
                     other=0).to(tl.int32)
    low, high = packed & 15, packed >> 4
    scale = tl.load(src_ptr + (src_row[:, None, None] + HALF + t[None, :, None] * 4 + g[None, None, :]),
                    mask=tiles[:, :, None], other=0).to(tl.int32)
    magnitude = tl.maximum(tl.max(low & 7, axis=3), tl.max(high & 7, axis=3))
    exponent, factor = _tile_factors(magnitude, scale)
    nan = (exponent == 256)[:, :, None, None]
    any_nan = _any(exponent == 256)
    low_byte = _nope_bytes(low, scale[:, :, :, None], factor[:, :, :, None], nan, any_nan, nope_table, NAN_KEY,
                           HW_FP8)
    high_byte = _nope_bytes(high, scale[:, :, :, None], factor[:, :, :, None], nan, any_nan, nope_table, NAN_KEY,
                            HW_FP8)
    dst16 = dst16_ptr
    dst_half = tl.multiple_of(dst_row // 2, DST_ALIGN // 2)            # the hints survive no division
    tl.store(dst16 + (dst_half[:, None, None, None] + place), (low_byte | (high_byte << 8)).to(tl.int16),
             mask=tiles[:, :, None, None])
    # The scale field: the tile exponents' low bytes, then zeros to its end.
    tl.store(dst_ptr + (dst_row[:, None] + NOPE + 2 * ROPE + t[None, :]), (exponent & 0xFF).to(tl.uint8),
             mask=tiles)
    q = tl.arange(0, SCALES_P)
    pad = live[:, None] & ((q >= TILES) & (q < V4_BYTES - NOPE - 2 * ROPE))[None, :]
    tl.store(dst_ptr + (dst_row[:, None] + NOPE + 2 * ROPE + q[None, :]), tl.zeros_like(q).to(tl.uint8)[None, :],
             mask=pad)
    # RoPE: bytes [R, group, 8] -> two bf16 each, one int32.
    r = tl.arange(0, ROPE_P)
    groups = live[:, None] & (r < ROPE_GROUPS)[None, :]
    rplace = r[None, :, None] * 8 + k[None, None, :]
    rpacked = tl.load(src_ptr + (src_row[:, None, None] + NOPE // 2 + rplace), mask=groups[:, :, None],
                      other=0).to(tl.int32)
    rscale = tl.load(src_ptr + (src_row[:, None] + HALF + NOPE // 16 + r[None, :]), mask=groups,
                     other=0).to(tl.int32)
    rope_nan = _any((rscale & 0x7F) == 0x7F)
    rscale = rscale[:, :, None]
    pair = _rope_bits(rpacked & 15, rscale, rope_nan, rope_table) \
        | (_rope_bits(rpacked >> 4, rscale, rope_nan, rope_table) << 16)
    dst32 = dst32_ptr
    dst_word = tl.multiple_of((dst_row + NOPE) // 4, DST_ALIGN // 4)
    tl.store(dst32 + (dst_word[:, None, None] + rplace), pair, mask=groups[:, :, None])
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
    """Run the load kernel, or False where the destination's alignment does not allow its wide stores."""
    src_table, dst_table, copy_src, copy_dst = tables.device
    if n_rows >= 2**31 - 1024:                        # the kernels index rows in int32
        return False
    dst_align = _alignment(dst.data_ptr(), dst_stride, tables.align[1])
    dst16, dst32, src32 = _view(dst, torch.int16), _view(dst, torch.int32), _view(src, torch.int32)
    if dst_align < 4 or dst16 is None or dst32 is None:
        return False
    src_align = _alignment(src.data_ptr(), src_stride, tables.align[0])
    unit = 4 if copy_bytes and _alignment(src.data_ptr(), dst.data_ptr(), src_stride, dst_stride, copy_bytes,
                                          tables.align[2], tables.align[3]) >= 4 else 1
    if src32 is None:
        unit = 1
    nope_table, rope_table, nan_key = _load_tables(src.device)
    words = copy_bytes // unit
    with _on_device(src):
        _load_kernel[(triton.cdiv(n_rows, LOAD_ROWS),)](
            src, src if src32 is None else src32, dst, dst16, dst32, src_table, dst_table, copy_src, copy_dst,
            nope_table, rope_table,
            n_rows, src_stride, dst_stride, ROWS_PER_BLOCK=rows_per_block,
            NOPE=shape.nope, ROPE=shape.rope, V4_BYTES=shape.v4_bytes,
            TILES_P=triton.next_power_of_2(shape.tiles), ROPE_P=triton.next_power_of_2(shape.rope // v4.GROUP),
            SCALES_P=triton.next_power_of_2(shape.v4_bytes - shape.nope - 2 * shape.rope), NAN_KEY=nan_key,
            BLOCK_ROWS=LOAD_ROWS, COPY_BYTES=copy_bytes, COPY_P=triton.next_power_of_2(max(1, words)),
            COPY_UNIT=unit, SRC_ALIGN=src_align, DST_ALIGN=dst_align, HW_FP8=bool(HW_FP8),
            num_warps=NUM_WARPS)
    return True


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
            COPY_UNIT=unit, SRC_ALIGN=src_align, DST_ALIGN=dst_align, HW_FP8=bool(HW_FP8),
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
