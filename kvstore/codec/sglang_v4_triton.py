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
from kvstore.geometry import ModelGeometry

#: Rows per program of the load and of the save (a row is 512 channels: 4,096 and 2,048 elements).
LOAD_ROWS = 8
SAVE_ROWS = 4
#: Warps per program.
NUM_WARPS = 4
#: E4M3 casts: True the GPU's cvt (round to nearest even, compute capability 8.9+), False on the bits (any
#: GPU, and the interpreter, whose float8 cast does not round to nearest even), None: True where the GPU has it.
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
def _nope_bytes(codes, scale, factor, nan, nope_table, NAN_KEY: tl.constexpr, HW_FP8: tl.constexpr):
    """V4 E4M3 bytes (int32) of 4-bit codes under scale bytes `scale` and `factor` = |scale| x 2^(127 - tile
    exponent); where `nan` (a NaN tile), the torch path's byte table at its NaN key."""
    magnitude = _e4m3_magnitude(e2m1_value(codes & 7) * factor, HW_FP8)
    byte = magnitude | ((((codes >> 3) ^ (scale >> 7)) & 1) << 7)
    table = tl.load(nope_table + (((NAN_KEY * 256 + scale) * 16) + codes), mask=nan, other=0).to(tl.int32)
    return tl.where(nan, table, byte)


@triton.jit
def _rope_bits(codes, scale, rope_table):
    """bf16 bits (int32, 0..0xFFFF) of 4-bit codes under E4M3 scale bytes: code value x scale is exact in
    bf16 (the float32 bits' high half); a NaN scale's from the torch path's table."""
    y = e2m1_value(codes & 7) * e4m3_value(scale & 0x7F)
    bits = (y.to(tl.int32, bitcast=True) >> 16) | ((((codes >> 3) ^ (scale >> 7)) & 1) << 15)
    nan = (scale & 0x7F) == 0x7F
    table = tl.load(rope_table + ((scale * 16) + codes), mask=nan, other=0).to(tl.int32) & 0xFFFF
    return tl.where(nan, table, bits)


@triton.jit
def _tile_factors(magnitude, scale):
    """(tile exponent [R, T], |scale| x 2^(127 - exponent) [R, T, 4]) of groups [R, T, 4]."""
    exponent = tl.max(_group_exponent(magnitude, scale), axis=2)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(127 - e), exact (e = 256: unused)
    return exponent, e4m3_value(scale & 0x7F) * inverse[:, :, None]


@triton.jit
def _row_offsets(table, rows, rows_per_block, stride, ALIGN: tl.constexpr):
    """Byte offset of each row: its block's start plus the row's place in a block (`table`)."""
    place = tl.load(table + (rows % rows_per_block).to(tl.int32))
    return tl.multiple_of((rows // rows_per_block) * stride + place, ALIGN)


@triton.jit
def _copy_rows(src_ptr, dst_ptr, src_row, dst_row, live, BYTES: tl.constexpr, PADDED: tl.constexpr,
               UNIT: tl.constexpr):
    """Copy BYTES bytes of each row (the indexer rows that ride along), in UNIT-byte words."""
    word = tl.arange(0, PADDED)
    mask = live[:, None] & (word < BYTES // UNIT)[None, :]
    if UNIT == 4:
        src = src_ptr.to(tl.pointer_type(tl.int32)) + (src_row // 4)[:, None] + word[None, :]
        dst = dst_ptr.to(tl.pointer_type(tl.int32)) + (dst_row // 4)[:, None] + word[None, :]
    else:
        src = src_ptr + src_row[:, None] + word[None, :]
        dst = dst_ptr + dst_row[:, None] + word[None, :]
    tl.store(dst, tl.load(src, mask=mask, other=0), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _load_kernel(src_ptr, dst_ptr, src_table, dst_table, copy_src_table, copy_dst_table, nope_table, rope_table,
                 n_rows, rows_per_block, src_stride, dst_stride,
                 NOPE: tl.constexpr, ROPE: tl.constexpr, V4_BYTES: tl.constexpr, TILES_P: tl.constexpr,
                 ROPE_P: tl.constexpr, SCALES_P: tl.constexpr, NAN_KEY: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 COPY_BYTES: tl.constexpr, COPY_P: tl.constexpr, COPY_UNIT: tl.constexpr,
                 SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr, HW_FP8: tl.constexpr):
    TILES: tl.constexpr = NOPE // 64
    HALF: tl.constexpr = (NOPE + ROPE) // 2
    ROPE_GROUPS: tl.constexpr = ROPE // 16
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = rows < n_rows
    src_row = _row_offsets(src_table, rows, rows_per_block, src_stride, SRC_ALIGN)
    dst_row = _row_offsets(dst_table, rows, rows_per_block, dst_stride, DST_ALIGN)
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
    low_byte = _nope_bytes(low, scale[:, :, :, None], factor[:, :, :, None], nan, nope_table, NAN_KEY, HW_FP8)
    high_byte = _nope_bytes(high, scale[:, :, :, None], factor[:, :, :, None], nan, nope_table, NAN_KEY, HW_FP8)
    dst16 = dst_ptr.to(tl.pointer_type(tl.int16))
    tl.store(dst16 + ((dst_row // 2)[:, None, None, None] + place), (low_byte | (high_byte << 8)).to(tl.int16),
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
                     other=0).to(tl.int32)[:, :, None]
    pair = _rope_bits(rpacked & 15, rscale, rope_table) | (_rope_bits(rpacked >> 4, rscale, rope_table) << 16)
    dst32 = dst_ptr.to(tl.pointer_type(tl.int32))
    tl.store(dst32 + (((dst_row + NOPE) // 4)[:, None, None] + rplace), pair, mask=groups[:, :, None])
    if COPY_BYTES > 0:
        _copy_rows(src_ptr, dst_ptr, _row_offsets(copy_src_table, rows, rows_per_block, src_stride, COPY_UNIT),
                   _row_offsets(copy_dst_table, rows, rows_per_block, dst_stride, COPY_UNIT), live,
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
    by_layer: dict[int, dict[str, tuple[object, object]]] = {}
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


def _hw_fp8(device: torch.device) -> bool:
    if HW_FP8 is not None:
        return HW_FP8
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


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


def _launch_load(src: torch.Tensor, dst: torch.Tensor, shape: v4.RowShape, n_rows: int, rows_per_block: int,
                 src_stride: int, dst_stride: int, tables: _Offsets, copy_bytes: int) -> bool:
    """Run the load kernel, or False where the destination's alignment does not allow its wide stores."""
    src_table, dst_table, copy_src, copy_dst = tables.device
    dst_align = _alignment(dst.data_ptr(), dst_stride, tables.align[1])
    if dst_align < 4:
        return False
    src_align = _alignment(src.data_ptr(), src_stride, tables.align[0])
    unit = 4 if copy_bytes and _alignment(src.data_ptr(), dst.data_ptr(), src_stride, dst_stride, copy_bytes,
                                          tables.align[2], tables.align[3]) >= 4 else 1
    nope_table, rope_table, nan_key = _load_tables(src.device)
    words = copy_bytes // unit
    with _on_device(src):
        _load_kernel[(triton.cdiv(n_rows, LOAD_ROWS),)](
            src, dst, src_table, dst_table, copy_src, copy_dst, nope_table, rope_table,
            n_rows, rows_per_block, src_stride, dst_stride,
            NOPE=shape.nope, ROPE=shape.rope, V4_BYTES=shape.v4_bytes,
            TILES_P=triton.next_power_of_2(shape.tiles), ROPE_P=triton.next_power_of_2(shape.rope // v4.GROUP),
            SCALES_P=triton.next_power_of_2(shape.v4_bytes - shape.nope - 2 * shape.rope), NAN_KEY=nan_key,
            BLOCK_ROWS=LOAD_ROWS, COPY_BYTES=copy_bytes, COPY_P=triton.next_power_of_2(max(1, words)),
            COPY_UNIT=unit, SRC_ALIGN=src_align, DST_ALIGN=dst_align, HW_FP8=_hw_fp8(src.device),
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
