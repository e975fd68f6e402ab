"""Commits made durable after LMDB's write lock is let go, and the crash recovery that makes it safe.

LMDB with `sync=True` flushes a commit's pages while it holds its one write lock: the next write
transaction cannot even start its work until the disk answers. The store opens LMDB with
`sync=False` instead and flushes each commit itself, outside the lock (`DurableCommits`), so the next
transaction's work (a Put's records, its checks) runs while the disk writes the last one. Nothing is
acknowledged before its flush: a caller's write returns, or its Put is answered, only once its commit is
durable (R34). That alone would not be safe: without LMDB's own flush, the kernel may write a commit's
meta page before its data pages, and a power cut in between leaves a newest meta page that points at
pages never written. So:

- one commit at most is not yet flushed: a transaction writes its pages only once the commit before it
  is (R35). LMDB never reuses the pages of the two latest snapshots, so the one before the newest is
  always whole on disk;
- after each flush the store records the flushed transaction's id in `kvstore-durable` (beside
  `data.mdb`), itself flushed before anyone is answered: a commit is durable once marked. At a start
  after a crash, a newest commit past that id may never have been flushed, nor was it acknowledged, and
  is rolled back by pointing LMDB at the meta page before it (`recover`, R36). The mark follows the
  flush on the flusher's thread while the next commit is written, so the newest commit may be one past
  the marked one's successor, which R35 had flushed: that one is kept. A clean close records that it was
  clean: what writes the store after that (a repair, a copy) is trusted as LMDB left it.

The marker: 8 bytes of magic, the transaction id, the state (open while a store writes, closed after a
clean close) and an xxh3-64 of the 24 bytes before it, little endian. A damaged one is set aside as
`kvstore-durable.damaged` and the newest commit trusted (a warning says so).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import lmdb
import xxhash

from kvstore.errors import Unavailable
from tiers.lmdb_pages import HeaderError, LmdbHeader, read_headers

log = logging.getLogger(__name__)
T = TypeVar("T")

MARKER_NAME = "kvstore-durable"
_MAGIC = b"KVDURBL1"
_RECORD = struct.Struct("<8sQQ")
_SUM = struct.Struct("<Q")
_MARKER_BYTES = _RECORD.size + _SUM.size
#: The marker's state: a store has it open (a start finding this had a crash), or closed it cleanly.
OPEN, CLOSED = 1, 0


@dataclass(frozen=True, slots=True)
class Committed(Generic[T]):
    """What a write committed (`value`) and its transaction, not yet known durable: nothing of it is
    acknowledged before the store says it is (`tiers.store.PipelinedPuts.durable`, R34)."""

    value: T
    txn_id: int


def _pack(txn_id: int, state: int) -> bytes:
    record = _RECORD.pack(_MAGIC, txn_id, state)
    return record + _SUM.pack(xxhash.xxh3_64_intdigest(record))


def read_marker(data_dir: Path) -> tuple[int, int] | None:
    """(transaction id, state) the marker records; None when there is none.

    Raises:
        ValueError: the marker is damaged (its length, magic or checksum).
    """
    try:
        with (data_dir / MARKER_NAME).open("rb") as f:
            raw = f.read(_MARKER_BYTES + 1)  # bounded: whatever a disk left there, only this much is read
    except FileNotFoundError:
        return None
    if len(raw) != _MARKER_BYTES:
        raise ValueError(f"{len(raw)} bytes, not {_MARKER_BYTES}")
    magic, txn_id, state = _RECORD.unpack_from(raw)
    if magic != _MAGIC or _SUM.unpack_from(raw, _RECORD.size)[0] != xxhash.xxh3_64_intdigest(raw[:_RECORD.size]) \
            or state not in (OPEN, CLOSED):
        raise ValueError("its magic or checksum does not match")
    return txn_id, state


def recover(data_dir: Path, data_name: str = "data.mdb") -> int | None:
    """Before LMDB opens the store (the data dir's lock held): roll back a commit a crash left not durable
    (R36), then record the store as closed cleanly (what writes it next is trusted). Returns the
    transaction id rolled back, None when nothing was."""
    path = data_dir / MARKER_NAME
    try:
        marker = read_marker(data_dir)
    except (ValueError, OSError) as exc:
        aside = path.with_name(MARKER_NAME + ".damaged")
        log.warning("%s is damaged (%s): set aside as %s; the store's newest commit is trusted", path, exc, aside.name)
        os.replace(path, aside)
        return None
    if marker is None or marker[1] == CLOSED:
        return None
    data = data_dir / data_name
    try:
        headers = read_headers(data)
    except (HeaderError, OSError):
        return None  # the data dir's own checks say what is wrong with the file
    rolled = _roll_back(data, headers, marker[0])
    _write_file(path, max(h.txn_id for h in headers) if rolled is None else rolled - 1, CLOSED)
    return rolled


def _roll_back(data: Path, headers: list[LmdbHeader], durable: int) -> int | None:
    newest = max(range(2), key=lambda i: headers[i].txn_id)
    other = 1 - newest
    if headers[newest].txn_id == durable:
        return None
    # The newest commit past the mark, and the one before it the mark's own or its flushed successor (R35).
    if headers[newest].txn_id != headers[other].txn_id + 1 or headers[other].txn_id not in (durable, durable + 1):
        log.warning("%s: LMDB's newest commit is %d but %s records %d: written by something else since; trusted",
                    data, headers[newest].txn_id, MARKER_NAME, durable)
        return None
    page = headers[other].page_size
    with data.open("r+b") as f:
        f.seek(other * page)
        meta = bytearray(f.read(page))
        struct.pack_into("<Q", meta, 0, newest)  # the page header's own page number
        f.seek(newest * page)
        f.write(meta)
        f.flush()
        os.fdatasync(f.fileno())
    log.warning("%s: rolled back commit %d, which a crash left not durable (nothing it held was acknowledged); "
                "the store resumes at commit %d", data, headers[newest].txn_id, headers[other].txn_id)
    return headers[newest].txn_id


def _write_file(path: Path, txn_id: int, state: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _write_marker(fd, txn_id, state)
    finally:
        os.close(fd)


#: What runs once a commit is durable: given None, or the error that refused its flush.
Then = Callable[[BaseException | None], None]


class DurableCommits:
    """Flushes the store's commits outside LMDB's write lock, one commit at most not yet durable (R34-R36).

    The writer calls `before_commit` inside its transaction, just before committing (it waits for the
    commit before to be durable: R35), then `committed`. A caller is answered once that commit is durable:
    after `wait` returns (a blocking caller: whichever thread waits first flushes, for every commit made by
    then; the others wait for it), or when `when_durable`'s callback runs (a group commit's answers: the
    flusher thread flushes for them, so no thread of the store's executor sits in a flush). Thread-safe.

    Args:
        env: the store's environment, opened with `sync=False`.
        data_dir: where the marker lives.
    """

    def __init__(self, env: lmdb.Environment, data_dir: Path) -> None:
        self._env = env
        self._path = data_dir / MARKER_NAME
        self._cond = threading.Condition()
        self._in_order = threading.Lock()  # what runs once durable runs in commit order
        self._syncing = False
        self._closing = False
        self._failed: BaseException | None = None
        self._due: list[tuple[int, Then]] = []
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        self._committed = self._synced = self._durable = -1  # the latest committed, flushed, marked
        try:
            self.sync()
        except BaseException:
            os.close(self._fd)
            raise
        self._flusher = threading.Thread(target=self._flush_when_due, name="lmdb-flush", daemon=True)
        self._flusher.start()

    @property
    def durable_txn(self) -> int:
        """The latest transaction known durable."""
        return self._durable

    def before_commit(self, txn_id: int) -> None:
        """Inside write transaction `txn_id`, before it commits: the commit before it is flushed first (R35; its
        mark may follow while this one is written).

        Raises:
            Unavailable: a flush failed (this store writes nothing more).
        """
        self._wait(txn_id - 1, flushed=True)

    def committed(self, txn_id: int, then: Then | None = None) -> None:
        """Transaction `txn_id` committed; `then` runs once it is durable, after those of earlier commits."""
        with self._cond:
            self._committed = max(self._committed, txn_id)
        if then is not None:
            self.when_durable(txn_id, then)

    def when_durable(self, txn_id: int, then: Then) -> None:
        """Run `then(None)` once committed transaction `txn_id` is durable (now, if it is), after what waits
        for earlier ones; `then(error)` when its flush failed. It runs on the thread that flushed: keep it short."""
        with self._cond:
            error = self._failed_error()
            if error is None and self._durable < txn_id:
                self._due.append((txn_id, then))
                self._cond.notify_all()  # the flusher's work
                return
        with self._in_order:
            then(error)

    def wait(self, txn_id: int) -> None:
        """Return once transaction `txn_id` (committed) is durable, flushing if no one else is.

        Raises:
            Unavailable: a flush failed (now or before: this store writes nothing more).
        """
        self._wait(txn_id, flushed=False)

    def _wait(self, txn_id: int, *, flushed: bool) -> None:
        with self._cond:
            while True:
                error = self._failed_error()
                if error is not None:
                    raise error
                if (self._synced if flushed else self._durable) >= txn_id:
                    return
                if not self._syncing:
                    break
                self._cond.wait()
            self._syncing = True
            target = max(self._committed, txn_id)
        self._flush(target)

    def sync(self) -> None:
        """Make every commit made so far durable (after a write not made through `before_commit`)."""
        self.wait(self._env.info()["last_txnid"])

    def close(self) -> None:
        """Flush what is left and record a clean close (the store's last write)."""
        try:
            if self._failed is None:
                self.sync()
                _write_marker(self._fd, self._durable, CLOSED)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._flusher.join()
            os.close(self._fd)

    def _flush_when_due(self) -> None:
        """The flusher thread: flush whenever a callback waits for a commit no one is flushing."""
        while True:
            with self._cond:
                while not self._closing and (self._syncing or self._failed is not None
                                             or not any(txn > self._durable for txn, _ in self._due)):
                    self._cond.wait()
                if self._closing:
                    return
                self._syncing = True
                target = self._committed
            with contextlib.suppress(Unavailable):  # told to every waiter by `_flush`
                self._flush(target)

    def _flush(self, target: int) -> None:
        error: BaseException | None = None
        try:
            self._env.sync(True)
            with self._cond:  # flushed: the next commit may write its pages while this one is marked (R35)
                self._synced = max(self._synced, target)
                self._cond.notify_all()
            _write_marker(self._fd, target, OPEN)
        except (OSError, lmdb.Error) as exc:
            error = exc
        with self._cond:
            self._syncing = False
            if error is not None:
                self._failed = error
                failed = self._failed_error()
                due, self._due = [then for _, then in self._due], []
            else:
                failed = None
                self._durable = max(self._durable, target)
                due = [then for txn, then in self._due if txn <= target]
                self._due = [(txn, then) for txn, then in self._due if txn > target]
            self._in_order.acquire()  # before letting go: a later flush's callbacks wait for these
            self._cond.notify_all()
        try:
            for then in due:
                then(failed)
        finally:
            self._in_order.release()
        if failed is not None:
            raise failed

    def _failed_error(self) -> Unavailable | None:
        if self._failed is None:
            return None
        return Unavailable(f"the disk under {self._path.parent} failed to flush a commit ({self._failed}): "
                           "this node stores nothing more until it is restarted",
                           hint="check the disk's health; the commits not flushed were not acknowledged")


def _write_marker(fd: int, txn_id: int, state: int) -> None:
    os.pwrite(fd, _pack(txn_id, state), 0)
    os.fdatasync(fd)
