"""One tenant's SWA records in shared memory: a sealed, sparse memfd and a first-fit allocator over it.

The embedded pool (tiers.swa_memory) keeps every record (header + snapshot) in
the arena of the record's tenant, so a client on the same host can map that
arena and copy a snapshot in or out itself: the same-host path of
docs/SWA_POOL.md ("Shared-memory path"). One arena per tenant is what keeps
tenants apart: a client is handed its own tenant's descriptor only.

The file is sealed against shrinking and growing (as kvstore.region's client
regions are), so no client can make the server's mapping fault. It is sparse:
pages are committed as records are written. A freed range is kept committed
(the next record written there pays no page faults or zeroing) while the
arena's idle committed bytes stay under `idle_limit`; past it a freed range is
given back to the kernel (MADV_REMOVE punches it out of the file).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
from dataclasses import dataclass

from kvstore.errors import FailedPrecondition

#: Pages of the platform (the unit the kernel takes back).
PAGE = mmap.PAGESIZE
#: Allocation granule: whole pages the kernel can take back, and coarse enough that snapshots of one
#: geometry above its window (even T, and odd T with the raw tail) take ranges of one size, so a freed
#: range fits the next record exactly and its pages, already mapped by clients, are reused.
GRANULE = max(64 << 10, PAGE)
#: The seals every arena carries: it can neither shrink nor grow, and no seal can be changed.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Idle committed bytes an arena keeps for reuse when no limit is given.
DEFAULT_IDLE_LIMIT = 256 << 20


@dataclass(frozen=True, slots=True)
class Located:
    """Where a live record lies in its tenant's arena, and its header bytes (read under the pool's lock)."""

    offset: int
    length: int
    header: bytes
    #: The pool's handle of a pinned record (`locate(pin=True)`), for `unpin`; opaque to everyone else.
    pin: object = None


def pages(nbytes: int) -> int:
    """`nbytes` rounded up to whole allocation granules (whole pages)."""
    return -(-nbytes // GRANULE) * GRANULE


class Arena:
    """A sealed memfd of `size` bytes mapped read-write here, with a first-fit allocator.

    Not thread-safe: the pool calls it under its own lock.

    Args:
        name: the memfd's name (shows in /proc/<pid>/fd; no secret).
        size: bytes of address space (rounded up to pages); pages are committed only as written.
        idle_limit: freed bytes kept committed for reuse before freed ranges are punched out.
    """

    def __init__(self, name: str, size: int, *, idle_limit: int = DEFAULT_IDLE_LIMIT) -> None:
        self.size = pages(max(size, PAGE))
        self.idle_limit = idle_limit
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)
        # Free ranges as two parallel sorted lists (offsets, lengths): first fit by offset, coalesced on free.
        self._starts: list[int] = [0]
        self._lengths: list[int] = [self.size]
        self.used = 0
        self._idle = 0

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a fresh range of `nbytes` (granule-aligned), or None when no free range is that long."""
        need = pages(nbytes)
        for i, length in enumerate(self._lengths):
            if length >= need:
                start = self._starts[i]
                if length == need:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i], self._lengths[i] = start + need, length - need
                self.used += need
                self._idle = max(self._idle - need, 0)
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Give back the range `alloc` returned for `nbytes` at `offset`."""
        size = pages(nbytes)
        self.used -= size
        if self._idle + size > self.idle_limit and self._map is not None:
            # Past the idle budget: the pages go back to the kernel (a later record there faults them in).
            self._map.madvise(mmap.MADV_REMOVE, offset, size)
        else:
            self._idle += size
        i = bisect.bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._lengths.insert(i, size)
        # Coalesce with the next range, then with the previous one.
        if i + 1 < len(self._starts) and offset + size == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            del self._starts[i + 1]
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == offset:
            self._lengths[i - 1] += self._lengths.pop(i)
            del self._starts[i]

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Copy `data` to `offset` (one memcpy)."""
        self.view[offset:offset + len(data)] = data

    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of `nbytes` at `offset` (a copy: the range may be reused once the caller's lock is gone)."""
        return bytes(self.view[offset:offset + nbytes])

    def open_fd(self, *, writable: bool) -> int:
        """A new descriptor of the memfd for a client: read-only unless `writable`
        (a read-only descriptor cannot be mapped for writing). The caller closes it."""
        if self._map is None:
            raise FailedPrecondition("the arena is closed")
        return os.open(f"/proc/self/fd/{self.fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)

    def close(self) -> None:
        """Unmap and close the memfd (clients' mappings keep their pages until they unmap)."""
        if self._map is None:
            return
        with contextlib.suppress(BufferError):
            self.view.release()
            self._map.close()
        self._map = None
        os.close(self.fd)
