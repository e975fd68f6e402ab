"""The SWA paths' snapshot checksums (xxh3-64) and arena copies, native where `tiers._blockcopy` is built.

The native forms (tiers/_swa_digest.h) use the widest xxh3 kernel the CPU has and
let go of the GIL for the whole pass over a snapshot, so a direct put can checksum
one snapshot on a worker thread while its sending thread streams the next
(kvstore.client.swa_direct), and a verified shared-memory get copies and checksums
a snapshot in one pass (kvstore.client.swa_shm). The Python forms stand in where
the module is not built, with the same results (python-xxhash: it too lets go of
the GIL over a large buffer, but copy and checksum are then two passes).
`NATIVE` says which runs.

`stream_into` is a shared-memory put's copy into the arena: non-temporal stores,
so the bytes go to memory rather than into the writer's cache, which never reads
them again; the server that checksums them meanwhile (a verified put's WRITTEN
notes) then reads them from memory at full speed, not line by line out of the
writer's core (docs/SWA_POOL.md has the figures).
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


def _load() -> tuple[Callable[[Buffer], int], Callable[[Buffer], tuple[bytes, int]], Callable[[], Hasher],
                     Callable[[memoryview, Buffer], None]] | None:
    try:
        from tiers._blockcopy import Hasher as NativeHasher
        from tiers._blockcopy import copy_digest as native_copy
        from tiers._blockcopy import digest as native_digest
        from tiers._blockcopy import stream_into as native_stream_into
    except ImportError:  # not built, or built before these existed
        return None
    return native_digest, native_copy, NativeHasher, native_stream_into


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
