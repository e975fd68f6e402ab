"""The same-host reader: a worker reads its blocks straight from the store's own LMDB file.

On the store's host, `ColocatedReader` opens the store's LMDB environment
read-only in the worker's process, next to the running `kvstore serve`. A read
asks the server a normal leased Lookup (so the blocks are protected, and the hit
counts as a use), then opens its own read transaction and resolves each found
block's data record to a span of this process's mapping of `data.mdb`. While
the `MappedRead` is open LMDB cannot reuse those pages, whatever the server
evicts or writes meanwhile: the reader sees the bytes it leased. It never
writes, and it does not take the data dir's `kvstore.lock` (that lock keeps a
second *server* out; readers are LMDB's business, `lock.mdb`).

Trust model (docs/SECURITY.md): the OS must let this process read `data.mdb`,
which holds every tenant's blocks; the server's auth does not extend to it. It
is for a worker trusted with the host's store, and off unless configured.
Design and paths: docs/DIRECT_RESTORE.md.

The reader knows the file: it begins read transactions and finds a read's block records
in their snapshot (B-tree searches in the mapping where `kvstore.native._blockcopy` is built, py-lmdb's
gets otherwise). A read itself (`MappedRead`, `BlockSpan`) lives in colocated_read.py. The
on-disk format comes from `kvstore.native.records` and the B-tree searches from `kvstore.native.blockcopy` (the
one exception to the core's layering, tests/kvstore/test_wire.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np

from kvstore.client import arguments
from kvstore.client.colocated_memory import mapping_base
from kvstore.client.colocated_read import BlockSpan, FoundRecords, MappedRead, _start_lookup
from kvstore.client.connection import DEFAULT_TENANT
from kvstore.errors import ConfigError, FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from kvstore.native import blockcopy
from kvstore.native.records import DATA_TAG, META_STRUCT, META_TAG
from kvstore.prefix import BlockScope
from kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.client.store import Client

DATA_NAME = "data.mdb"
#: The store's identity file (tiers.datadir.IDENTITY_NAME: part of the on-disk format this reader knows).
IDENTITY_NAME = "kvstore-identity.json"
#: Default lease of a read's Lookup: none, the read txn begins before the Lookup runs.
DEFAULT_LEASE_MS = 0
#: Reader slots in a lock file this process creates (the server's own number, tiers/datadir.py).
_MAX_READERS = 512
#: kvstore.native.records.META_STRUCT ("<32sIIQdd") as a numpy record, to read a batch of meta records at once.
_META_DTYPE = np.dtype([("parent", "V32"), ("depth", "<u4"), ("size", "<u4"), ("checksum", "<u8"),
                        ("created", "<f8"), ("last_access", "<f8")])
assert _META_DTYPE.itemsize == META_STRUCT.size


class ColocatedReader:
    """Opens `<data_dir>/data.mdb` read-only in this process, next to a running server.

    Args:
        data_dir: the server's `store.data_dir`.
        threads: threads that verify and copy blocks (default `kvstore.native.blockcopy.DEFAULT_THREADS`).
        native: look the records up with `kvstore.native._blockcopy.resolve` (B-tree searches in the
            mapping, without the GIL) where it is built; False: through py-lmdb.

    One reader per data dir per process (LMDB's rule). The process needs read
    access to `data.mdb` and read-write access to `lock.mdb` (where LMDB
    registers readers, so the server never reuses the pages of an open read).

    Raises:
        ConfigError: no store in `data_dir`, or LMDB cannot open it.
        PermissionDenied: the OS refuses this user the store's files.
    """

    def __init__(self, data_dir: str | os.PathLike[str], *, threads: int | None = None, native: bool = True) -> None:
        if not isinstance(data_dir, str | os.PathLike):
            raise InvalidArgument(f"data_dir must be a path, got {type(data_dir).__name__}")
        self.data_dir = Path(data_dir).resolve()
        self.threads = None if threads is None else arguments.integer(threads, "threads", least=1, most=256)
        if not isinstance(native, bool):
            raise InvalidArgument(f"native must be a bool, got {type(native).__name__}")
        #: Find records with the native B-tree search where built (else, or False: py-lmdb's gets).
        self.native = native
        self._path = self.data_dir / DATA_NAME
        if not self._path.is_file() or self._path.stat().st_size == 0:
            raise ConfigError(f"{self.data_dir} holds no kvstore store ({DATA_NAME} is missing or empty)",
                              hint="give the server's store.data_dir (--data-dir), on this host")
        try:
            # map_size=0: LMDB takes the size the server's environment recorded in the file.
            self._env = lmdb.open(str(self.data_dir), readonly=True, lock=True, max_dbs=8, map_size=0,
                                  readahead=False, max_readers=_MAX_READERS)
        except lmdb.Error as exc:
            if isinstance(exc, lmdb.ReadonlyError) or "Permission denied" in str(exc):
                raise PermissionDenied(f"this user may not read the store in {self.data_dir}: {exc}",
                                       hint="the reader needs read access to data.mdb and write access to "
                                            "lock.mdb (docs/SECURITY.md, the same-host reader)") from None
            raise ConfigError(f"LMDB cannot open {self._path} read-only: {exc}",
                              hint="is it a kvstore store, and is it not already open in this process?") from None
        try:
            self._records = self._env.open_db(b"records", create=False)
        except lmdb.Error as exc:
            self._env.close()
            raise ConfigError(f"{self._path} has no block records ({exc}): no server has served it yet",
                              hint="start `kvstore serve` on it first") from None
        self._lock = threading.Lock()
        self._open: weakref.WeakSet[MappedRead] = weakref.WeakSet()
        self._tenants: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._base, self._map_bytes = mapping_base(self._path)
        self._inode = self._path.stat().st_ino
        self._closed = False
        self._hooks: list[Callable[[], None]] = []

    @property
    def node_id(self) -> str | None:
        """The store's id, which is its node id in a fleet (docs/FLEET.md F1, F48); None when unreadable."""
        try:
            identity = json.loads((self.data_dir / IDENTITY_NAME).read_text())
        except (OSError, ValueError):
            return None
        store_id = identity.get("store_id") if isinstance(identity, dict) else None
        return store_id if isinstance(store_id, str) else None

    # -- reads -------------------------------------------------------------

    def read(self, client: Client, hashes: Sequence[bytes], *, lease_ms: int = DEFAULT_LEASE_MS,
             wait: bool = True) -> MappedRead:
        """Look `hashes` up through `client` (a leased Lookup: a use) and map the found prefix.

        Args:
            client: a `kvstore.Client` of the server serving this data dir.
            hashes: the prompt's chain hashes, in order (`client.hashes(tokens)`).
            lease_ms: a lease for the Lookup to take (released when the read closes). The read
                needs none: its txn begins before the Lookup runs.
            wait: False returns once the records are looked up, before the Lookup answers: the
                columns are then the candidates until `found_blocks` is read (see `MappedRead`),
                so a copy overlaps the Lookup.

        Returns:
            An open `MappedRead` (close it, or use it as a context manager).

        Raises:
            InvalidArgument: a bad hash, lease or client.
            FailedPrecondition: the reader is closed, or the client's server is not this store's.
            KVStoreError: the Lookup's error (Unavailable when the server is down, ...).
        """
        conn = getattr(client, "connection", None)
        if conn is None or not hasattr(client, "lookup_hashes"):
            raise InvalidArgument(f"client must be a kvstore.Client, got {type(client).__name__}")
        hashes = arguments.hashes(hashes, "hashes")
        lease_ms = arguments.integer(lease_ms, "lease_ms", most=2**32 - 1)
        self._check_open()
        scope = BlockScope(client.fingerprint, client.namespace or self._tenant(conn))
        # The txn first, then the Lookup: the snapshot is then at or before what the Lookup
        # sees, so every block it finds is in the snapshot unless written in between (a miss
        # here), and eviction after the txn began cannot touch its pages: no lease needed.
        # The records are looked up while the Lookup is in flight; its answer cuts them.
        txn = self._begin()
        read = MappedRead(self, client, scope, hashes, lambda: _start_lookup(client, hashes, lease_ms), txn,
                          wait=bool(wait))
        with self._lock:
            self._open.add(read)
        return read

    def _tenant(self, conn: Any) -> str:
        """The tenant an empty namespace means for this connection (GetInfo's `tenant`, asked once)."""
        tenant = self._tenants.get(conn)
        if tenant is None:
            reply = conn.call(conn.kvstore.GetInfo, pb.GetInfoRequest())
            tenant = reply.tenant
            if not tenant:
                if conn.metadata is not None:
                    raise FailedPrecondition("the server does not say which tenant this token is",
                                             hint="name the tenant (Client(namespace=...)), or upgrade the server")
                tenant = DEFAULT_TENANT
            self._tenants[conn] = tenant
        return tenant

    def _begin(self) -> lmdb.Transaction:
        """A read txn; when the server's map grew past ours, adopt its size first (only with no read open)."""
        for _ in range(2):
            try:
                return self._env.begin(db=self._records, buffers=True)
            except lmdb.MapResizedError:
                with self._lock:
                    if len(self._open):
                        raise Unavailable("the store's map grew while reads are open; close them and read again",
                                          hint="retry once the open reads are closed") from None
                    self._env.set_mapsize(0)
                    self._base, self._map_bytes = mapping_base(self._path)
            except lmdb.Error as exc:
                raise Unavailable(f"cannot begin a read of {self._path}: {exc}") from None
        raise Unavailable(f"the map of {self._path} keeps growing; read again")

    def bounds(self) -> tuple[int, int, int]:
        """(base address, bytes valid to read, page bytes) of the mapping, for a read txn begun now."""
        # The newest snapshot's last page bounds this one's: LMDB writes pages before their meta.
        info, psize = self._env.info(), self._env.stat()["psize"]
        return self._base, min((info["last_pgno"] + 1) * psize, self._map_bytes), psize

    def find(self, txn: lmdb.Transaction, scope: BlockScope, hashes: list[bytes],
             bounds: tuple[int, int, int]) -> FoundRecords:
        """The records of `hashes`' found prefix in `txn`'s snapshot, mapped at `bounds` (`bounds()`).

        Searched natively (without the GIL) where built and `native` is on, unless this
        snapshot's tree cannot be told for sure; by py-lmdb's gets otherwise.
        """
        found = _find_native(txn, scope, hashes, bounds, self.threads) if self.native and hashes else None
        return found if found is not None else _find_by_gets(txn, scope, hashes, bounds[0])

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("this ColocatedReader is closed")
        # `kvstore check --repair` may swap in a rebuilt data.mdb: this mapping is then of the
        # old file, while the server answers from the new one.
        try:
            same = self._path.stat().st_ino == self._inode
        except OSError:
            same = False
        if not same:
            raise FailedPrecondition(f"{self._path} was replaced since this reader opened it",
                                     hint="close this ColocatedReader and open a new one")

    def forget(self, read: MappedRead) -> None:
        """Stop counting `read` as open (a read calls it as it closes)."""
        with self._lock:
            self._open.discard(read)

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call `hook` when the reader closes, before its mapping goes (a GPU registration of it, say)."""
        self._hooks.append(hook)

    def close(self) -> None:
        """Close every open read, run the `on_close` hooks, then close the environment (a no-op once closed)."""
        if self._closed:
            return
        for hook in self._hooks:
            with contextlib.suppress(Exception):  # the mapping goes regardless
                hook()
        for read in list(self._open):
            read.close()
        self._closed = True
        self._env.close()

    def __enter__(self) -> ColocatedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _find_native(txn: lmdb.Transaction, scope: BlockScope, hashes: list[bytes], bounds: tuple[int, int, int],
                 threads: int | None) -> FoundRecords | None:
    """Find the records with B-tree searches in the mapping itself, without the GIL; None when
    this snapshot's tree cannot be told for sure (then py-lmdb's gets do it)."""
    if blockcopy.resolve is None:
        return None
    base, length, psize = bounds
    root = blockcopy.named_root(base, length, psize, txn.id(), b"records")
    if root is None:
        return None
    try:  # slices of the key list searched on the pool's threads (a 1M-token read: ~15,600 keys)
        answer = blockcopy.resolve_many(base, length, psize, root, scope.prefix, hashes, threads)
    except ValueError:  # a page that does not parse: LMDB's own reads say what it is
        return None
    if answer is None:
        return None
    found, damaged, offsets, sizes, meta_offsets, checksums = answer
    # The views are made from the mapping when a CPU check or copy needs them.
    return FoundRecords(offsets=offsets, sizes=sizes, checksums=checksums, damaged=[found] if damaged else [],
                        resolved_by="native", meta_offsets=meta_offsets,
                        mapped=memoryview((ctypes.c_char * length).from_address(base)).cast("B"))


def _find_by_gets(txn: lmdb.Transaction, scope: BlockScope, hashes: list[bytes], base: int) -> FoundRecords:
    """Find the found prefix's records with py-lmdb's gets; it ends at a block gone from this
    snapshot or damaged.

    Kept as columns (`offsets`, `sizes`, `checksums`) all the same: not an object per block.
    """
    get, prefix = txn.get, scope.prefix
    keys = [prefix + h for h in hashes]
    metas: list[Any] = []
    datas: list[Any] = []
    damaged: list[int] = []
    try:
        for key in keys:
            meta = get(key + META_TAG)
            if meta is None:  # gone before the txn opened (an expired lease): a miss from here
                break
            metas.append(meta)
            datas.append(get(key + DATA_TAG))
    except lmdb.Error:  # a damaged page: LMDB failed the txn; the prefix ends here
        damaged.append(len(datas))
    n = len(datas)
    if any(len(m) != META_STRUCT.size for m in metas):
        n = next(i for i, m in enumerate(metas) if len(m) != META_STRUCT.size)
    if None in datas[:n]:
        n = datas.index(None, 0, n)
    records = np.frombuffer(b"".join(metas[:n]), dtype=_META_DTYPE)
    sizes = records["size"].astype(np.int64)
    lengths = np.fromiter(map(len, datas[:n]), dtype=np.int64, count=n)
    wrong = np.flatnonzero(lengths != sizes)
    if wrong.size:
        n = int(wrong[0])
    if n < len(datas) and not damaged:
        damaged.append(n)
    offsets = np.asarray(blockcopy.addresses(datas[:n]), dtype=np.int64) - base
    return FoundRecords(offsets=offsets, sizes=sizes[:n], checksums=records["checksum"][:n].copy(),
                        damaged=damaged, metas=metas[:n], datas=datas[:n])


__all__ = ["DEFAULT_LEASE_MS", "BlockSpan", "ColocatedReader", "MappedRead"]
