"""The SWA paths' snapshot checksums (xxh3-64) and arena copies, native where `kvstore.native._blockcopy` is built.

The native forms (kvstore/native/_swa_digest.h) use the widest xxh3 kernel the CPU has and
let go of the GIL for the whole pass over a snapshot, so a direct put can checksum
one snapshot on a worker thread while its sending thread streams the next
(kvstore.client.swa_direct), and a verified shared-memory get copies and checksums
a snapshot in one pass (kvstore.client.swa_shm). The Python forms stand in where
the module is not built, with the same results (python-xxhash: it too lets go of
the GIL over a large buffer, but copy and checksum are then two passes).
`NATIVE` says which runs.

`stream_into` is a shared-memory put's copy into the staging arena: non-temporal
stores, so the bytes go to memory rather than into the writer's cache, which
never reads them again; the server that copies them on meanwhile (a verified
put's WRITTEN notes) then reads them from memory at full speed, not line by line
out of the writer's core (docs/SWA_POOL.md has the figures).

`copy_hashed` is the server's copy of a snapshot from the staging arena into the
tenant's sealed arena: natively one pass without the GIL (each 32 KiB read once
out of the staging arena and stored both into a private buffer, hashed there,
and into the arena), so the bytes hashed are the bytes the arena is given
whatever the writer does to its staging range meanwhile; the Python form copies
a chunk, then hashes it where it lies in the arena.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import xxhash

Buffer = bytes | bytearray | memoryview


class Hasher(Protocol):
    """A streaming xxh3-64: `update()` it with pieces in order; `intdigest()` is the digest of the whole."""

    def update(self, data: Any, /) -> None:
        """Hash these bytes next."""

    def intdigest(self) -> int:
        """xxh3-64 (seed 0) of every byte given so far."""


def digest_python(data: Buffer) -> int:
    """xxh3-64 of `data` (python-xxhash)."""
    return xxhash.xxh3_64_intdigest(data)


def copy_digest_python(src: Buffer) -> tuple[bytes, int]:
    """A copy of `src` and the xxh3-64 of the bytes copied (two passes: copy, then hash)."""
    copy = bytes(src)
    return copy, xxhash.xxh3_64_intdigest(copy)


def stream_into_python(dst: memoryview, src: Buffer) -> None:
    """Copy `src` into `dst` (of one length; a plain memcpy)."""
    dst[:] = src


#: Bytes the Python `copy_hashed` copies before it hashes them (while they are in cache).
COPY_CHUNK = 256 << 10


def copy_hashed_python(dst: memoryview, src: Buffer, hasher: Hasher) -> None:
    """Copy `src` into `dst` (of one length; ValueError otherwise) a chunk at a time, feeding `hasher` each
    chunk as it lies in `dst` just after it is copied: the checksum is of the bytes written, whatever `src`
    holds meanwhile."""
    source = memoryview(src).cast("B")
    if len(dst) != len(source):
        raise ValueError("copy_hashed: dst and src must be of one length")
    for lo in range(0, len(source), COPY_CHUNK):
        hi = min(lo + COPY_CHUNK, len(source))
        dst[lo:hi] = source[lo:hi]
        hasher.update(dst[lo:hi])


def _load() -> tuple[Callable[[Buffer], int], Callable[[Buffer], tuple[bytes, int]], Callable[[], Hasher],
                     Callable[[memoryview, Buffer], None], Callable[[memoryview, Buffer, Hasher], None]] | None:
    try:
        from kvstore.native._blockcopy import Hasher as NativeHasher
        from kvstore.native._blockcopy import copy_digest as native_copy
        from kvstore.native._blockcopy import copy_hashed as native_copy_hashed
        from kvstore.native._blockcopy import digest as native_digest
        from kvstore.native._blockcopy import stream_into as native_stream_into
    except ImportError:  # not built, or built before these existed
        return None
    return native_digest, native_copy, NativeHasher, native_stream_into, native_copy_hashed


_native = _load()
#: True when the native forms run (without the GIL, with the CPU's widest xxh3 kernel).
NATIVE = _native is not None

#: xxh3-64 of a buffer (`kvstore.swa_snapshot.checksum`'s value); native: without the GIL.
digest: Callable[[Buffer], int] = _native[0] if _native else digest_python
#: (a bytes copy of a buffer, the xxh3-64 of that copy); native: one pass, each 32 KiB hashed
#: from L1 just after it is copied, without the GIL.
copy_digest: Callable[[Buffer], tuple[bytes, int]] = _native[1] if _native else copy_digest_python
#: A new streaming xxh3-64 (one thread feeds it; the native one keeps the GIL while it hashes).
hasher: Callable[[], Hasher] = _native[2] if _native else xxhash.xxh3_64
#: Copy a buffer into a writable one of the same length (ValueError otherwise); native: non-temporal
#: stores, without the GIL.
stream_into: Callable[[memoryview, Buffer], None] = _native[3] if _native else stream_into_python
#: Copy a buffer into a writable one of the same length (ValueError otherwise), feeding a `hasher()` the
#: bytes as written; native: one pass without the GIL (TypeError for a hasher not of this module's
#: `hasher()`, RuntimeError if another thread is feeding that hasher meanwhile).
copy_hashed: Callable[[memoryview, Buffer, Hasher], None] = _native[4] if _native else copy_hashed_python
