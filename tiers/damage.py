"""Blocks on damaged pages met at run time (R16): remembered, counted once, kept out of writes.

LMDB raises (CorruptedError, PageNotFoundError...) when a read reaches a damaged
page, and marks the transaction failed: nothing more can be read in it. So a
damaged block is remembered here, the read goes on past it in a fresh
transaction, and write transactions never touch it again (`BlockTxn.unreadable`):
it is a miss to readers and skipped by eviction until `kvstore check --repair`.

Damage LMDB does not notice is worse: a flipped key on a leaf is simply not found
(and LMDB's binary search on that page may miss its neighbours too), a flipped
meta record reads as another chain's. Such a miss is taken for damage when the
store itself contradicts it: a block read in the same call names the missing one
as its parent (`explain_misses`, and the chain walk in `tiers/chains.py`), or the
leaf page that should hold it does not parse (`leaf_of`, which reads the pages of
the snapshot a read transaction pins with `pread`, never through LMDB's cursor).
Each damaged block is counted once (`on_new`); each damaged page is logged once,
as one WARNING naming the page, however many blocks and requests meet it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import lmdb

from kvstore.errors import DataLoss, ResourceExhausted
from kvstore.native.records import META_TAG
from kvstore.prefix import HASH_BYTES
from tiers.block_txn import DamagedBlock
from tiers.datadir import DATA_NAME
from tiers.lmdb_pages import P_INVALID, HeaderError, PageReader, read_headers

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


class SilentDamage(Exception):
    """Why a block LMDB read without an error is taken for damaged (the cause `note` is given)."""


class DamagedBlocks:
    """The blocks of one store found on damaged pages; thread-safe.

    Args:
        data_dir: the store's folder (named in logs and errors).
        on_new: called once per block when it is first found damaged (counts it).
        env: the store's environment, to pin a snapshot while its pages are read
            (`leaf_of`); None: pages are not looked at (the log names no page).
    """

    def __init__(self, data_dir: Path, on_new: Callable[[], None], env: lmdb.Environment | None = None) -> None:
        self._data_dir = data_dir
        self._on_new = on_new
        self._env = env
        self._lock = threading.Lock()
        self._keys: set[bytes] = set()
        self._pages: set[int] = set()  # pages logged

    def note(self, key: bytes, cause: BaseException) -> None:
        """Remember `key` as damaged; count it the first time, and log its page the first time it is met."""
        with self._lock:
            if key in self._keys:
                return
            self._keys.add(key)
        self._on_new()
        page, why = self.leaf_of(key)
        with self._lock:
            first = page is None or page not in self._pages
            if page is not None:
                self._pages.add(page)
        if first:
            where = "an unknown page" if page is None else f"page {page}" + (f" ({why})" if why else "")
            log.warning("%s of %s is damaged: block %s... and any other on it are served as misses (%s); run "
                        "`kvstore check --data-dir %s --repair` with the server stopped", where,
                        self._data_dir / DATA_NAME, key[-HASH_BYTES:].hex()[:16], cause, self._data_dir)

    def leaf_of(self, key: bytes) -> tuple[int | None, str]:
        """(the records page holding `key`'s meta record, or the first damaged one on the way to it;
        why that page is damaged, "" when it parses). (None, "") when the file cannot be read so."""
        if self._env is None:
            return None, ""
        path = self._data_dir / DATA_NAME
        try:
            with self._env.begin() as txn:  # pins the snapshot: its pages are not reused while read
                header = next((h for h in read_headers(path) if h.txn_id == txn.id()), None)
                if header is None:  # two commits since the txn began: its meta page is overwritten
                    return None, ""
                with PageReader(path=path, header=header) as reader:
                    records = reader.named_trees().get(b"records")
                    if records is None:
                        return header.main_tree.root, "the main tree does not name the records tree"
                    page, why = reader.find_leaf(records, key + META_TAG)
                    return (None if page == P_INVALID else page), why
        except (OSError, HeaderError, lmdb.Error):
            return None, ""

    def explain_misses(self, keys: Sequence[bytes | None], missing: Sequence[int],
                       parents: Callable[[], set[bytes]]) -> None:
        """Find which of the blocks a read found missing are damage, and note those.

        Args:
            keys: the call's storage keys (None: skipped).
            missing: indexes of the keys not found.
            parents: the parent hashes named by the meta records of the blocks the call
                found (read only when needed).

        A missing block that a block of the same call names as its parent was stored
        (R6): damage. Of the others, the first not yet known damaged has the leaf that
        should hold it parsed (about 0.5 ms, so one per call, unless it is damaged: then
        the others it would hold are found too): a leaf that does not parse makes it
        damaged. A block absent from an intact leaf is a plain miss.
        """
        todo = [k for k in (keys[i] for i in missing) if k is not None and not self.known(k)]
        if not todo:
            return
        named = parents()
        rest: list[bytes] = []
        for key in todo:
            if key[-HASH_BYTES:] in named:
                self.note(key, SilentDamage("a block read in the same call names it as its parent, but its meta "
                                            "record is not found"))
            else:
                rest.append(key)
        if not rest:
            return
        page, why = self.leaf_of(rest[0])
        if not why:
            return
        self.note(rest[0], SilentDamage(f"the leaf that should hold it is damaged: {why}"))
        for key in rest[1:MAX_DAMAGED_PER_CALL]:  # a damaged page found: which of the others it holds
            if self.leaf_of(key)[0] == page:
                self.note(key, SilentDamage(f"the leaf that should hold it is damaged: {why}"))

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
