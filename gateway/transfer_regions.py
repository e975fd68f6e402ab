"""A client's shared-memory region, mapped into the server (rules 3 and 5 of
`gateway.transfer_sessions`; docs/TRANSFER.md).

One idea apart from the session bookkeeping: how the server opens what a client
points it at without being tricked into a FIFO, a device, a hugetlb file or a
region that can shrink under a copy.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat

from kvstore.errors import FailedPrecondition, InvalidArgument, PermissionDenied

log = logging.getLogger("kvstore.transfer")


class MappedRegion:
    """A client's sealed memfd, mapped into the server.

    The server opens the client's descriptor through `/proc/<pid>/fd/<fd>` only
    after that link names the memfd the client says (`/memfd:<name> (deleted)`),
    so it never opens a FIFO, a device or another file a client points it at;
    it then checks what it opened, once more by its own descriptor:
    - a regular shmem file of ordinary pages (a hugetlb memfd can run out of
      huge pages at fault time: SIGBUS), at least `size_bytes` long;
    - sealed against shrinking (F_SEAL_SHRINK): pages mapped here can never be
      cut from under a copy, which would kill the server with SIGBUS.
    It maps the file without MAP_POPULATE: no page of the region is touched
    (or committed) before a descriptor needs it.

    Zero-copy contract: `view` (and every slice of it) shows the client's pages
    and is valid until `close`; the engine drops its slices before a transfer
    finishes, and a region is closed only when no transfer on it is in flight.
    Spans are checked against `size_bytes` before they are cut
    (`kvstore.transfer.group_failures`).

    Raises:
        FileNotFoundError, PermissionError: the descriptor cannot be seen from
            here (another host, another pid namespace, another user).
        FailedPrecondition: the memfd is not sealed against shrinking, or is not
            a plain shmem file.
        InvalidArgument: it is shorter than `size_bytes`.
        PermissionDenied: it does not hold the nonce sent with it.
    """

    def __init__(self, region_id: int, name: str, pid: int, fd: int, size_bytes: int, nonce: bytes) -> None:
        self.region_id = region_id
        self.name = name
        self.size_bytes = size_bytes
        expected = f"/memfd:{name} (deleted)"
        link = f"/proc/{pid}/fd/{fd}"
        if os.readlink(link) != expected:
            raise FileNotFoundError(errno.ENOENT, f"no memfd {name} at {link}")
        handle = os.open(link, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            # By our own descriptor this time: the client cannot swap it under the check.
            if os.readlink(f"/proc/self/fd/{handle}") != expected:
                raise FileNotFoundError(errno.ENOENT, f"no memfd {name} at {link}")
            _check_sealed(handle, name, size_bytes)
            self._mmap = mmap.mmap(handle, size_bytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(handle)
        if not nonce or self._mmap[: len(nonce)] != nonce:
            self._mmap.close()
            raise PermissionDenied(f"region {name} does not hold the nonce sent with it")
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap the region."""
        self.view.release()
        try:
            self._mmap.close()
        except BufferError:  # pragma: no cover - a span outlived its transfer: a bug
            log.error("region %s still has views; it unmaps when they are collected", self.region_id)


def _check_sealed(handle: int, name: str, size_bytes: int) -> None:
    """Refuse a region that could shrink (or fault) under a mapping: see `MappedRegion`."""
    info = os.fstat(handle)
    if not stat.S_ISREG(info.st_mode) or info.st_blksize != mmap.PAGESIZE:
        raise FailedPrecondition(f"region {name} is not a memfd of ordinary pages",
                                 hint="create it with memfd_create(MFD_ALLOW_SEALING), without MFD_HUGETLB")
    try:
        seals = fcntl.fcntl(handle, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if not seals & fcntl.F_SEAL_SHRINK:
        raise FailedPrecondition(
            f"region {name} is not sealed against shrinking (F_SEAL_SHRINK): a client could truncate it "
            "under the server's mapping", hint="create it with memfd_create(MFD_ALLOW_SEALING) and add "
            "F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL (fcntl F_ADD_SEALS) before registering; kvstore.region does")
    if info.st_size < size_bytes:
        raise InvalidArgument(f"region {name} holds {info.st_size} bytes, fewer than the {size_bytes} registered")
