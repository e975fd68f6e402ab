"""A memory region a client registers for transfers: a sealed memfd.

The client creates the region with `memfd_create(MFD_ALLOW_SEALING)`, sizes it
and seals it against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL`), then maps it. A server on the same host opens the same file
through `/proc/<pid>/fd/<fd>`, checks the seal and maps the same pages, then
copies blocks straight into or out of them. The seal is what keeps the server
alive: a file that shrank under its mapping would fault (SIGBUS) in the
server's copy loop; a sealed one cannot shrink, even by its creator. When the
server is on another host the mapping is simply local memory that the streamed
path fills, so a caller's code is the same either way.

A region is sparse: no page is committed until something writes it (this
process, or the server copying a block into it).

Zero-copy contract: `view`, `tensor` and `blocks` return views of the mapping,
never copies. They are valid until `close`; after `close` the pages stay
mapped (and the views valid) until the last view is dropped, but the server no
longer reads or writes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import operator
import os
import uuid
from typing import TYPE_CHECKING

from kvstore.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    import torch

#: Every region's memfd name: the prefix then 32 hex digits (the server accepts no other).
SHM_PREFIX = "kvstore-"
#: Bytes at the start of a fresh region that prove to the server it maps the client's pages.
NONCE_BYTES = 16
#: The seals every region carries: it can neither shrink nor grow, and no seal can be added or removed.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Region:
    """A sealed memfd mapped into this process.

    Args:
        size_bytes: the region's size (a positive int).

    Attributes:
        name: the memfd's name (its secret: only this client and the server know it).
        region_id: the server's handle once registered (0 before, or when not shared).
        shared: whether the server mapped it (same host) rather than streaming into it.

    Raises:
        InvalidArgument: `size_bytes` is not a positive int.
    """

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = _int(size_bytes, "size_bytes", 1, 1 << 62)
        self.name = SHM_PREFIX + uuid.uuid4().hex
        self.region_id = 0
        self.shared = False
        self._pinned: torch.Tensor | None = None
        self._fd: int | None = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, size_bytes)  # sparse: no page is committed
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SEALS)
            self._mmap: mmap.mmap | None = mmap.mmap(self._fd, size_bytes)
        except BaseException:
            self.release_fd()
            raise

    @property
    def handle(self) -> tuple[int, int]:
        """(pid, fd): where a server on this host finds the memfd (/proc/<pid>/fd/<fd>).

        Raises:
            FailedPrecondition: the descriptor was released (after registration).
        """
        if self._fd is None:
            raise FailedPrecondition(f"region {self.name} was registered already (its descriptor is closed)")
        return os.getpid(), self._fd

    def release_fd(self) -> None:
        """Close the memfd's descriptor (the mapping keeps the pages): once the server has mapped it."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def view(self) -> memoryview:
        """The whole region as a writable byte view (valid until `close`)."""
        return memoryview(self._live())

    def tensor(self, dtype: torch.dtype | None = None, *, offset_bytes: int = 0, count: int = -1) -> torch.Tensor:
        """A 1-D tensor over the region's bytes, without a copy (valid until `close`).

        Args:
            dtype: the elements' type (uint8 by default).
            offset_bytes: where the tensor starts (a multiple of the element size).
            count: elements, or -1 for all up to the region's end.

        Raises:
            InvalidArgument: a bad dtype, or a span outside the region.
        """
        import torch

        dtype = torch.uint8 if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgument(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        offset_bytes = _int(offset_bytes, "offset_bytes", 0, self.size_bytes)
        item = dtype.itemsize
        count = _int(count, "count", -1, (self.size_bytes - offset_bytes) // item)
        if count == -1 and (self.size_bytes - offset_bytes) % item:
            raise InvalidArgument(f"{self.size_bytes - offset_bytes} bytes from offset {offset_bytes} are not a "
                                  f"whole number of {dtype} elements; give count")
        return torch.frombuffer(self._live(), dtype=dtype, count=count, offset=offset_bytes)

    def blocks(self, block_bytes: int, count: int | None = None, *, offset_bytes: int = 0) -> torch.Tensor:
        """A uint8 tensor [count, block_bytes] over consecutive blocks, without a copy.

        Raises:
            InvalidArgument: a block size below 1, or blocks outside the region.
        """
        block_bytes = _int(block_bytes, "block_bytes", 1, self.size_bytes)
        offset_bytes = _int(offset_bytes, "offset_bytes", 0, self.size_bytes)
        room = (self.size_bytes - offset_bytes) // block_bytes
        n = room if count is None else _int(count, "count", 0, room)
        return self.tensor(offset_bytes=offset_bytes, count=n * block_bytes).view(n, block_bytes)

    def pin(self) -> bool:
        """Page-lock the region for CUDA (cudaHostRegister), so copies to the GPU run at
        full PCIe speed and may be asynchronous. Returns False when CUDA is unavailable.

        Raises:
            FailedPrecondition: CUDA refused to register the pages.
        """
        import torch

        if self._pinned is not None:
            return True
        if not torch.cuda.is_available():
            return False
        pages = self.tensor()
        err = torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), self.size_bytes, 0)
        if int(err) != 0:
            raise FailedPrecondition(f"cudaHostRegister of {self.size_bytes} bytes failed with error {int(err)}",
                                     hint="raise the locked-memory limit (ulimit -l) or pin a smaller region")
        self._pinned = pages
        return True

    @property
    def pinned(self) -> bool:
        """Whether the region is page-locked for CUDA."""
        return self._pinned is not None

    def write_nonce(self) -> bytes:
        """Write a fresh random nonce at the region's start (before registration) and return it."""
        nonce = os.urandom(NONCE_BYTES)
        self.view[:NONCE_BYTES] = nonce[: min(NONCE_BYTES, self.size_bytes)]
        return nonce[: min(NONCE_BYTES, self.size_bytes)]

    def close(self) -> None:
        """Unpin, close the descriptor and unmap. Views still alive keep the pages mapped until they die."""
        if self._pinned is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._pinned.data_ptr())
            self._pinned = None
        self.release_fd()
        if self._mmap is not None:
            # Views (tensors) still alive export the pages; they unmap when the last one dies.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def _live(self) -> mmap.mmap:
        if self._mmap is None:
            raise FailedPrecondition(f"region {self.name} is closed")
        return self._mmap

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Region({self.name}, {self.size_bytes} bytes, id={self.region_id}, shared={self.shared})"


def _int(value: object, name: str, least: int, most: int) -> int:
    """`value` as an int in [least, most] (numpy integers accepted), else InvalidArgument."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an int, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}") from None
    if not least <= number <= most:
        raise InvalidArgument(f"{name} = {number} is outside [{least}, {most}] for this region")
    return number
