"""glibc's allocator, told to keep the memory a Put frees for the next Put (`kvstore serve` does, at start).

A PutStream batch of 64 V4.1 blocks is 3.6 MB that passes through several buffers: the
message gRPC receives, the blocks cut from it, LMDB's dirty pages (an overflow run of 14
pages per block, malloc'd and freed every transaction). By default glibc hands the top of
its heap back to the kernel whenever 128 KiB of it is free, so every batch faults the same
pages in again: 106,000 minor faults and 1.2 s of system time for 0.27 GB put on the dev box
(`kvstore bench store`), against 37,000 and 0.66 s with the heap kept (docs/BENCHMARKS.md).

`keep_freed_memory` keeps up to `TRIM_THRESHOLD_BYTES` free at the top of each heap, grows a
heap `TOP_PAD_BYTES` at a time, and serves allocations below `MMAP_THRESHOLD_BYTES` from the
heap. The last matters as much: setting either of the first two turns off glibc's own raising
of its mmap threshold, after which every allocation of 128 KiB or more (a Lookup's 500 KB of
packed hashes) is mapped and faulted in afresh (123 faults a next turn's Lookup, twice its CPU).

Memory is not lost: what a Put frees is reused by the next one; the process's RSS stays near
its high-water mark instead of sawing up and down. An operator's own `MALLOC_TRIM_THRESHOLD_`,
`MALLOC_TOP_PAD_` or `MALLOC_MMAP_THRESHOLD_` (glibc's environment variables) wins: then nothing
is changed. Elsewhere than glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: mallopt's parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
#: Free bytes kept at a heap's top before any goes back to the kernel.
TRIM_THRESHOLD_BYTES = 64 << 20
#: Bytes a heap grows by beyond what an allocation needs.
TOP_PAD_BYTES = 16 << 20
#: Allocations this size and larger are mapped on their own (glibc's largest: 32 MiB on 64 bits).
MMAP_THRESHOLD_BYTES = 32 << 20
#: The environment variables that say the operator chose for themselves.
OPERATOR_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory(environ: dict[str, str] | None = None) -> bool:
    """Keep freed memory in the heap (module docstring); whether glibc took the settings.

    False, with nothing changed, when not on glibc or when the operator set either of
    `OPERATOR_SETTINGS` in `environ` (default: the process's environment).
    """
    environ = dict(os.environ) if environ is None else environ
    if any(name in environ for name in OPERATOR_SETTINGS) or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt: not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt answers 1 when it took a setting, 0 when not.
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                (M_TOP_PAD, TOP_PAD_BYTES))
    return all([mallopt(param, value) == 1 for param, value in settings])
