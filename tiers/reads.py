"""Reading blocks out of the NVMe tier: verified copies, and staged reads for zero-copy transfer.

Every read checks the block against its stored checksum (R2). A block whose
records sit on a damaged page (LMDB raises CorruptedError, PageNotFoundError,
BadValsizeError... while reading them) is reported CORRUPT like a block that
fails its checksum: a miss for that block, never an error for the whole call.
LMDB marks a transaction failed after such an error, so the read restarts in
a fresh transaction past the damaged block.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import lmdb
import xxhash

from kvstore.native import blockcopy
from kvstore.native.records import DATA_TAG, META_STRUCT, META_TAG, BlockMeta, data_key, meta_key
from tiers.block_txn import BlockDbs, DamagedBlock, read_meta
from tiers.damage import DamagedBlocks, SilentDamage
from tiers.retention import Retention


class ReadStatus(enum.Enum):
    """Outcome of reading one block."""

    FOUND = 1
    MISSING = 2
    CORRUPT = 3


#: `blockcopy` result code -> status (NOT_REACHED -> None).
READ_STATUS: dict[int, ReadStatus | None] = {blockcopy.NOT_REACHED: None, **{s.value: s for s in ReadStatus}}

#: Stands for a meta record that could not be read: `blockcopy` reports it CORRUPT.
_UNREADABLE = b""
_NO_DATA = "its meta record is found but not its data, written with it"


def verified(txn: lmdb.Transaction, dbs: BlockDbs, key: bytes) -> tuple[ReadStatus, memoryview | None]:
    """The block's bytes as a view valid until `txn` ends, if intact.

    Raises:
        DamagedBlock: its records are on a damaged page (`txn` is now unusable), or its data is
            missing beside its meta record (a damaged leaf LMDB reads without an error).
    """
    meta = read_meta(txn, dbs, key)
    if meta is None:
        return ReadStatus.MISSING, None
    try:
        data = txn.get(data_key(key), db=dbs.records)
    except lmdb.Error as exc:
        raise DamagedBlock(key, exc) from exc
    if data is None:  # written with its meta record in one txn: its leaf is damaged
        raise DamagedBlock(key, SilentDamage(_NO_DATA))
    if len(data) != meta.size_bytes:  # likewise; and a drop would take the meta's size off the totals
        raise DamagedBlock(key, SilentDamage(f"its data is {len(data)} bytes, its meta record says {meta.size_bytes}"))
    if xxhash.xxh3_64_intdigest(data) != meta.checksum:
        return ReadStatus.CORRUPT, None
    return ReadStatus.FOUND, memoryview(data)


def read_copies(env: lmdb.Environment, dbs: BlockDbs, keys: Sequence[bytes], damage: DamagedBlocks,
                copy: Callable[[int, memoryview], Any] | None = None) -> list[tuple[ReadStatus, Any]]:
    """Each block's status and a copy of its bytes (None unless FOUND); a damaged one is CORRUPT
    (and noted in `damage`), a missing one is put to `damage.explain_misses`. `copy(i, view)`
    makes block i's copy from its view into the map (default: `bytes`): a caller can copy
    straight into what it sends."""
    out: list[tuple[ReadStatus, Any]] = []
    while len(out) < len(keys):
        try:
            with env.begin(buffers=True) as txn:
                for key in keys[len(out):]:
                    status, view = verified(txn, dbs, key)
                    out.append((status, None if view is None else copy(len(out), view) if copy else bytes(view)))
        except DamagedBlock as exc:  # the txn is unusable: go on past the block in a fresh one
            damage.note(exc.key, exc.cause)
            out.append((ReadStatus.CORRUPT, None))
    missing = [i for i, (status, _) in enumerate(out) if status is ReadStatus.MISSING]
    if missing:
        found = [k for k, (status, _) in zip(keys, out, strict=True) if status is ReadStatus.FOUND]
        damage.explain_misses(keys, missing, lambda: _parents(env, dbs, found))
    return out


def read_found(env: lmdb.Environment, dbs: BlockDbs, keys: Sequence[bytes], damage: DamagedBlocks,
               copy: Callable[[int, memoryview], Any] | None, due_before_s: float,
               touch_due: list[bytes] | None) -> list[Any] | None:
    """Each block's copy (as `read_copies` makes it) when every one of `keys` is stored and intact; None
    at the first that is not (missing, failing its checksum, on a damaged page, known damaged).

    One read txn and no side effect: nothing is noted, dropped or written, so a caller may run it where
    a write must not (the event loop), and reads a None again through `read_copies`, which notes and
    drops what it must. The keys whose last use was recorded before `due_before_s` go to `touch_due` (R5)
    only when the whole read succeeds.
    """
    out: list[Any] = []
    due: list[bytes] = []
    try:
        with env.begin(buffers=True) as txn:
            for key in keys:
                meta = read_meta(txn, dbs, key)
                if meta is None or damage.known(key):
                    return None
                data = txn.get(data_key(key), db=dbs.records)
                if data is None or len(data) != meta.size_bytes or xxhash.xxh3_64_intdigest(data) != meta.checksum:
                    return None
                out.append(copy(len(out), memoryview(data)) if copy else bytes(data))
                if meta.last_access_s < due_before_s:
                    due.append(key)
    except (DamagedBlock, lmdb.Error):
        return None
    if touch_due is not None:
        touch_due.extend(due)
    return out


def _parents(env: lmdb.Environment, dbs: BlockDbs, keys: Sequence[bytes]) -> set[bytes]:
    """The parent hashes the meta records of `keys` name (those that read)."""
    try:
        with env.begin(buffers=True) as txn:
            metas = [txn.get(meta_key(k), None, dbs.records) for k in keys]
            return {bytes(m[:32]) for m in metas if m is not None and len(m) == META_STRUCT.size}
    except lmdb.Error:
        return set()


def stage(env: lmdb.Environment, dbs: BlockDbs, keys: Sequence[bytes | None],
          damage: DamagedBlocks) -> tuple[lmdb.Transaction, list[Any], list[Any]]:
    """Each key's meta and data views (None: absent or skipped), in a read txn left open for the copy.

    The lookups hold the GIL between gets, so the usual loop is kept tight. When
    it meets a damaged page, the keys are read again one by one in fresh txns:
    each unreadable one gets an empty meta (CORRUPT to `blockcopy`) and is
    noted in `damage`. Missing ones are put to `damage.explain_misses`.
    """
    bad: set[int] = set()
    careful = False
    while True:
        txn = env.begin(buffers=True)
        try:
            metas, datas = _stage_careful(txn, dbs, keys, bad) if careful else _stage_fast(txn, dbs, keys)
            if datas.count(None) > metas.count(None):  # counted in C, as below: the usual call has none
                for k, m, d in zip(keys, metas, datas, strict=True):
                    if m and d is None:  # an _UNREADABLE meta is noted already
                        damage.note(k, SilentDamage(_NO_DATA))  # type: ignore[arg-type]  # a meta: a key
            if metas.count(None) > keys.count(None):
                missing = [i for i, (k, m) in enumerate(zip(keys, metas, strict=True)) if k is not None and m is None]
                named = {bytes(m[:32]) for m in metas if m is not None and len(m) == META_STRUCT.size}
                damage.explain_misses(keys, missing, named.copy)
            return txn, metas, datas
        except lmdb.Error:  # from the fast loop: find the damaged keys carefully
            txn.abort()
            careful = True
        except _Unreadable as exc:
            txn.abort()
            key = keys[exc.index]
            assert key is not None
            damage.note(key, exc.cause)
            bad.add(exc.index)
        except BaseException:
            txn.abort()
            raise


class _Unreadable(Exception):
    def __init__(self, index: int, cause: BaseException) -> None:
        self.index = index
        self.cause = cause


def _stage_fast(txn: lmdb.Transaction, dbs: BlockDbs, keys: Sequence[bytes | None]) -> tuple[list[Any], list[Any]]:
    get, db, meta_tag, data_tag = txn.get, dbs.records, META_TAG, DATA_TAG
    metas = [None if k is None else get(k + meta_tag, None, db) for k in keys]
    # A key with a meta record is not None.
    datas = [None if m is None else get(k + data_tag, None, db)  # type: ignore[operator]
             for k, m in zip(keys, metas, strict=True)]
    return metas, datas


def _stage_careful(txn: lmdb.Transaction, dbs: BlockDbs, keys: Sequence[bytes | None],
                   bad: set[int]) -> tuple[list[Any], list[Any]]:
    get, db = txn.get, dbs.records
    metas: list[Any] = []
    datas: list[Any] = []
    for i, k in enumerate(keys):
        m: Any = None
        d: Any = None
        if k is not None and i in bad:
            m = _UNREADABLE
        elif k is not None:
            try:
                m = get(k + META_TAG, None, db)
                d = None if m is None else get(k + DATA_TAG, None, db)
            except lmdb.Error as exc:
                raise _Unreadable(i, exc) from exc
        metas.append(m)
        datas.append(d)
    return metas, datas


class StagedReads:
    """Blocks looked up for a copy (`LmdbBlockTier.stage_reads`): views into LMDB's
    map, valid while the read txn they came from is open.

    The txn is not tied to the thread that began it (py-lmdb opens every
    environment with MDB_NOTLS), so `copy` may run on another thread; it ends
    the txn. Use it once.

    Args:
        txn: the read txn the views come from (this object ends it).
        keys, metas, datas: per block: its key (None: skipped), meta and data views.
        now: retention time now (which FOUND blocks are due a refresh).
        drop_corrupt: removes blocks found corrupt.
        damage: where a block whose data and meta record disagree in size is noted (R16), so that
            `drop_corrupt` leaves it: its removal would take the garbled size off the usage totals.
    """

    def __init__(self, txn: lmdb.Transaction, keys: list[bytes | None], metas: list[Any], datas: list[Any], *,
                 now: Callable[[], float], drop_corrupt: Callable[[Sequence[bytes]], None],
                 damage: DamagedBlocks) -> None:
        self._txn: lmdb.Transaction | None = txn
        self._keys = keys
        self._metas = metas
        self._datas = datas
        self._now = now
        self._drop_corrupt = drop_corrupt
        self._damage = damage

    def copy(self, dests: Sequence[memoryview | None], stop_at_missing: bool = False, *,
             touch_due: list[bytes] | None = None) -> bytes:
        """Verify and copy each block into its dest, then end the txn: see `LmdbBlockTier.read_into`.

        A block whose key was None is skipped, so is one whose dest is None.

        Returns:
            A `blockcopy` result code per key (`ReadStatus` values; 0 where not reached).
        """
        if self._txn is None:
            raise RuntimeError("these reads were copied or closed already")
        keys = self._keys
        try:
            due_before = Retention.touch_due_before(self._now())
            if len(dests) != len(keys):
                raise ValueError(f"{len(dests)} dests for {len(keys)} keys")
            wanted = [None if k is None else d for k, d in zip(keys, dests, strict=True)]
            codes, due = blockcopy.verify_copy(self._metas, self._datas, wanted, due_before, stop_at_missing)
            if blockcopy.CORRUPT in codes:  # rare: look at the records while their views are valid
                self._note_wrong_sizes(codes)
        finally:
            self.close()
        if blockcopy.WRONG_SIZE in codes:
            raise ValueError(f"destination {codes.index(blockcopy.WRONG_SIZE)}'s size differs from the stored block's")
        if touch_due is not None:
            touch_due.extend(keys[i] for i in due)  # type: ignore[misc]  # FOUND blocks have keys
        if blockcopy.CORRUPT in codes:
            self._drop_corrupt([k for k, c in zip(keys, codes, strict=True) if c == blockcopy.CORRUPT and k])
        return codes

    def _note_wrong_sizes(self, codes: bytes) -> None:
        """Note as damage each CORRUPT block whose data is not the size its meta record says (as `verified`)."""
        for key, code, meta, data in zip(self._keys, codes, self._metas, self._datas, strict=True):
            if code != blockcopy.CORRUPT or key is None or not meta or data is None or len(meta) != META_STRUCT.size:
                continue
            size = BlockMeta.unpack(meta).size_bytes
            if len(data) != size:
                self._damage.note(key, SilentDamage(f"its data is {len(data)} bytes, its meta record says {size}"))

    def close(self) -> None:
        """Drop the views and end the txn (a no-op once done)."""
        self._metas = self._datas = []
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
