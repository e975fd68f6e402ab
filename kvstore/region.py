"""A memory region a client registers for transfers: a shared-memory segment.

The client creates the segment under /dev/shm and maps it; a server on the same
host maps the same pages and copies blocks straight into or out of them. When
the server is on another host the mapping is simply local memory that the
streamed path fills, so a caller's code is the same either way.

Zero-copy contract: `view`, `tensor` and `blocks` return views of the mapping,
never copies. They are valid until `close`; after `close` the pages stay
mapped (and the views valid) until the last view is dropped, but the server no
longer reads or writes them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    import torch

#: Every segment's name: the prefix then 32 hex digits (the server accepts no other).
SHM_PREFIX = "kvstore-"
#: Bytes at the start of a fresh segment that prove to the server it maps the client's pages.
NONCE_BYTES = 16
DEFAULT_SHM_DIR = Path("/dev/shm")


class Region:
    """A shared-memory segment mapped into this process.

    Args:
        size_bytes: the region's size.
        shm_dir: where to create the segment (tmpfs; /dev/shm on Linux).

    Attributes:
        name: the segment's file name (its secret: only this client and the server know it).
        region_id: the server's handle once registered (0 before, or when not shared).
        shared: whether the server mapped it (same host) rather than streaming into it.
    """

    def __init__(self, size_bytes: int, *, shm_dir: Path = DEFAULT_SHM_DIR) -> None:
        if size_bytes <= 0:
            raise InvalidArgument(f"a region needs a positive size, got {size_bytes}")
        self.size_bytes = size_bytes
        self.name = SHM_PREFIX + uuid.uuid4().hex
        self.path = shm_dir / self.name
        self.region_id = 0
        self.shared = False
        self._pinned: torch.Tensor | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size_bytes)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)

    @property
    def view(self) -> memoryview:
        """The whole region as a writable byte view (valid until `close`)."""
        return memoryview(self._live())

    def tensor(self, dtype: torch.dtype | None = None, *, offset_bytes: int = 0, count: int = -1) -> torch.Tensor:
        """A 1-D tensor over the region's bytes, without a copy (valid until `close`)."""
        import torch

        return torch.frombuffer(self._live(), dtype=dtype or torch.uint8, count=count, offset=offset_bytes)

    def blocks(self, block_bytes: int, count: int | None = None, *, offset_bytes: int = 0) -> torch.Tensor:
        """A uint8 tensor [count, block_bytes] over consecutive blocks, without a copy."""
        n = (self.size_bytes - offset_bytes) // block_bytes if count is None else count
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

    def unlink(self) -> None:
        """Remove the segment's name (the pages live on while mapped)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unpin, unlink and unmap. Views still alive keep the pages mapped until they die."""
        if self._pinned is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._pinned.data_ptr())
            self._pinned = None
        self.unlink()
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
