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

