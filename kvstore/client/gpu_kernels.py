"""Triton kernels of the direct GPU restore: gather blocks from registered host pages.

Imported only by `kvstore.client.gpu_gather`, and only when a restore goes to a
CUDA device: importing this module imports Triton.

Both kernels move 32-bit words. Every address they touch (LMDB overflow data
starts 16 bytes into a page; block rows, sections and torch allocations are
multiples of 16 bytes) is a multiple of 16 bytes whenever `ALIGN` is 4, and the
`tl.multiple_of` hints then let Triton issue 16-byte loads and stores, which
keeps enough PCIe reads in flight to reach the host link's rate. The source
pointer is the start of one registered chunk; every block is an int64 word
offset from it (unified addressing: a registered range's device address is its
host address, checked at registration).
"""

# ruff: noqa: N803

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_kernel(src, src_words, dst, WORDS: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """dst[i, :] = the WORDS words at src + src_words[i]; grid (n, cdiv(WORDS, BLOCK))."""
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    off = tl.multiple_of(tl.load(src_words + i), ALIGN)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WORDS
    values = tl.load(src + off + cols, mask=mask)
    tl.store(dst + i * WORDS + cols, values, mask=mask)


@triton.jit
def scatter_kernel(src, src_words, slots, dst, sec_src, sec_words, sec_dst, sec_stride,
                   BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """For block i and section s: the section's words of block i go to
    dst + sec_dst[s] + slots[i] * sec_stride[s]; grid (n, sections, cdiv(longest, BLOCK))."""
    i = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    start = tl.program_id(2) * BLOCK
    words = tl.multiple_of(tl.load(sec_words + s), ALIGN)
    if start < words:
        off = tl.multiple_of(tl.load(src_words + i) + tl.load(sec_src + s), ALIGN)
        slot = tl.load(slots + i)
        where = tl.multiple_of(tl.load(sec_dst + s) + slot * tl.load(sec_stride + s), ALIGN)
        cols = start + tl.arange(0, BLOCK)
        mask = cols < words
        values = tl.load(src + off + cols, mask=mask)
        tl.store(dst + where + cols, values, mask=mask)



@triton.jit
def _low32(x):
    return (x << 32) >> 32


@triton.jit
def _mul128_fold64(a, b):
    """The low and high halves of the 128-bit product a * b, xored (XXH3's mul128_fold64)."""
    a0, a1, b0, b1 = _low32(a), a >> 32, _low32(b), b >> 32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 32) + _low32(p01) + _low32(p10)
    return (_low32(p00) | (mid << 32)) ^ (p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32))


@triton.jit
def _stripes(row, first, keys, s, lane, ROWS: tl.constexpr):
    """The accumulator increments of up to 16 stripes of 64 bytes from word `first` of `row`."""
    data = tl.load(row + first + s * 8 + lane, mask=s < ROWS, other=0).to(tl.uint64, bitcast=True)
    swapped = tl.load(row + first + s * 8 + (lane ^ 1), mask=s < ROWS, other=0).to(tl.uint64, bitcast=True)
    mixed = data ^ keys
    part = _low32(mixed) * (mixed >> 32) + swapped
    return tl.sum(tl.where(s < ROWS, part, 0), axis=0)


@triton.jit
def xxh3_kernel(rows, checksums, ok, consts, ROW_WORDS: tl.constexpr, LENGTH: tl.constexpr):
    """ok[i] = xxh3-64 (seed 0, the default secret) of row i == checksums[i], for rows longer than
    240 bytes whose length is a multiple of 8 (a block of 56,960 bytes); one program per row.

    `consts` (int64, built by gpu_gather) holds: the stripe keys [16, 8] (words 0-127), the
    scramble keys (128-135), the last stripe's keys (136-143), the merge keys (144-151), the
    initial accumulators (152-159), then PRIME32_1, PRIME64_1 and PRIME_MX1 (160-162).
    The 16 stripes of a 1 KiB block add into the 8 lanes independently, so each block's are
    summed as one [16, 8] tile, then scrambled in order; see xxhash.h (XXH3_hashLong_64b).
    """
    i = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, 16)[:, None]
    lane = tl.arange(0, 8)[None, :]
    lanes = tl.arange(0, 8)
    keys = tl.load(consts + s * 8 + lane).to(tl.uint64, bitcast=True)
    scramble = tl.load(consts + 128 + lanes).to(tl.uint64, bitcast=True)
    acc = tl.load(consts + 152 + lanes).to(tl.uint64, bitcast=True)
    prime32 = tl.load(consts + 160).to(tl.uint64, bitcast=True)
    row = rows + i * ROW_WORDS
    blocks: tl.constexpr = (LENGTH - 1) // 1024
    for b in range(blocks):
        acc = acc + _stripes(row, b * 128, keys, s, lane, 16)
        acc = ((acc ^ (acc >> 47)) ^ scramble) * prime32
    acc = acc + _stripes(row, blocks * 128, keys, s, lane, ((LENGTH - 1) - 1024 * blocks) // 64)
    last = tl.load(row + (LENGTH - 64) // 8 + lanes).to(tl.uint64, bitcast=True)
    last_swapped = tl.load(row + (LENGTH - 64) // 8 + (lanes ^ 1)).to(tl.uint64, bitcast=True)
    mixed = last ^ tl.load(consts + 136 + lanes).to(tl.uint64, bitcast=True)
    acc = acc + _low32(mixed) * (mixed >> 32) + last_swapped
    pairs = tl.reshape(acc ^ tl.load(consts + 144 + lanes).to(tl.uint64, bitcast=True), (4, 2))
    column = tl.arange(0, 2)[None, :]
    low = tl.sum(tl.where(column == 0, pairs, 0), axis=1)
    high = tl.sum(tl.where(column == 1, pairs, 0), axis=1)
    h = tl.load(consts + 161).to(tl.uint64, bitcast=True) * LENGTH + tl.sum(_mul128_fold64(low, high), axis=0)
    h = h ^ (h >> 37)
    h = h * tl.load(consts + 162).to(tl.uint64, bitcast=True)
    h = h ^ (h >> 32)
    stored = tl.load(checksums + i).to(tl.uint64, bitcast=True)
    tl.store(ok + i, (h == stored).to(tl.int8))
