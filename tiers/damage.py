"""Blocks on damaged pages met at run time (R16): remembered, counted once, kept out of writes.

LMDB raises (CorruptedError, PageNotFoundError...) when a read reaches a damaged
page, and marks the transaction failed: nothing more can be read in it. So a
damaged block is remembered here, the read goes on past it in a fresh
transaction, and write transactions never touch it again (`BlockTxn.unreadable`):
it is a miss to readers and skipped by eviction until `kvstore check --repair`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import lmdb

from kvstore.errors import DataLoss, ResourceExhausted
from tiers.block_txn import DamagedBlock

log = logging.getLogger(__name__)
T = TypeVar("T")

#: A call that meets more damaged blocks than this gives up with DataLoss.
MAX_DAMAGED_PER_CALL = 64
#: What LMDB raises for a damaged page in a write (a read contains any lmdb.Error per block).
DAMAGE_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.BadTxnError)
#: How a commit that ran out of disk fails (errno text; py-lmdb has no class for it). LMDB
#: reports a short write, the usual form of a full disk, as EIO.
_NO_SPACE = ("No space left on device", "File too large", "Disk quota exceeded", "Input/output error")


def refused_write(exc: lmdb.Error, data_dir: Path) -> ResourceExhausted | None:
    """What to answer a write the map or the disk had no room for (R8); None for any other LMDB error."""
    if isinstance(exc, lmdb.MapFullError):
        return ResourceExhausted("the LMDB map is full; raise store.capacity_bytes")
    if not any(why in str(exc) for why in _NO_SPACE):
        return None
    return ResourceExhausted(f"the disk under {data_dir} refused the write ({exc}): it is full or failing; "
                             "nothing was stored",
                             hint="free disk space or lower store.capacity_bytes to what the disk holds; "
                             "if the disk is not full, check its health")


class DamagedBlocks:
    """The blocks of one store found on damaged pages; thread-safe.

    Args:
        data_dir: the store's folder (named in logs and errors).
        on_new: called once per block when it is first found damaged (counts it).
    """

    def __init__(self, data_dir: Path, on_new: Callable[[], None]) -> None:
        self._data_dir = data_dir
        self._on_new = on_new
        self._lock = threading.Lock()
        self._keys: set[bytes] = set()

    def note(self, key: bytes, cause: BaseException) -> None:
        """Remember `key` as damaged; count and log it the first time."""
        with self._lock:
            if key in self._keys:
                return
            self._keys.add(key)
        self._on_new()
        log.error("block %s... is on a damaged page of %s (%s): served as a miss; run `kvstore check --repair`",
                  key[-32:].hex()[:16], self._data_dir, cause)

    def known(self, key: bytes) -> bool:
        """Whether `key` was found damaged."""
        with self._lock:
            return key in self._keys

    def snapshot(self) -> frozenset[bytes]:
        """The damaged keys now."""
        with self._lock:
            return frozenset(self._keys)

    def forget(self, key: bytes) -> bool:
        """Drop `key` (its records were removed after all); whether it was known."""
        with self._lock:
            known = key in self._keys
            self._keys.discard(key)
            return known

    def read_each(self, env: lmdb.Environment, keys: Sequence[bytes],
                  fn: Callable[[lmdb.Transaction, bytes], T]) -> list[T | None]:
        """`fn(txn, key)` for each key in read txns; None for a key whose records are damaged."""
        out: list[T | None] = []
        while len(out) < len(keys):
            try:
                with env.begin(buffers=True) as txn:
                    for key in keys[len(out):]:
                        out.append(fn(txn, key))
            except DamagedBlock as exc:  # the txn is unusable: go on in a fresh one
                self.note(exc.key, exc.cause)
                out.append(None)
        return out

    def retry(self, attempt: Callable[[], T], what: str) -> T:
        """Run a write `attempt`, again after noting each damaged block it meets (later attempts skip it).

        Raises:
            DataLoss: it needs a block known damaged (a Put's parent, say), or met too many.
        """
        for _ in range(MAX_DAMAGED_PER_CALL):
            try:
                return attempt()
            except DamagedBlock as exc:
                if self.known(exc.key):
                    raise DataLoss(f"{what} needs block {exc.key[-32:].hex()[:16]}..., whose records are on a "
                                   f"damaged page of {self._data_dir}: {exc.cause}") from None
                self.note(exc.key, exc.cause)
            except DAMAGE_ERRORS as exc:
                raise DataLoss(f"{what} met a damaged page of {self._data_dir}: {exc}") from None
        raise DataLoss(f"{what} met more than {MAX_DAMAGED_PER_CALL} damaged blocks in {self._data_dir}")
