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

The on-disk format comes from `tiers.records` and the checksum loop from
`tiers.blockcopy` (the one exception to the core's layering, tests/kvstore/test_wire.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import lmdb
import numpy as np

from kvstore.client import arguments
from kvstore.client.colocated_memory import mapping_base, writable_bytes
from kvstore.client.connection import status_error
from kvstore.errors import ConfigError, FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from kvstore.prefix import BlockScope
from kvstore.v1 import kvstore_pb2 as pb
from tiers import blockcopy
from tiers.records import DATA_TAG, META_STRUCT, META_TAG

if TYPE_CHECKING:
    from kvstore.client.store import Client

DATA_NAME = "data.mdb"
#: The tenant of every call on a server without auth (gateway.auth.DEFAULT_TENANT).
_DEFAULT_TENANT = "default"
#: Default lease of a read's Lookup: none, the read txn begins before the Lookup runs.
DEFAULT_LEASE_MS = 0
#: tiers.records.META_STRUCT ("<32sIIQdd") as a numpy record, to read a batch of meta records at once.
_META_DTYPE = np.dtype([("parent", "V32"), ("depth", "<u4"), ("size", "<u4"), ("checksum", "<u8"),
                        ("created", "<f8"), ("last_access", "<f8")])
assert _META_DTYPE.itemsize == META_STRUCT.size
#: Reader slots in a lock file this process creates (the server's own number, tiers/datadir.py).
_MAX_READERS = 512


@dataclass(frozen=True, slots=True)
class BlockSpan:
    """One block's bytes inside this process's mapping of `data.mdb`.

    Attributes:
        index: position of the block in the list of hashes asked.
        offset: byte offset from `MappedRead.base_address` (also its offset in the file).
        size: the block's length in bytes.
        checksum: its stored xxh3-64 (the meta record's), to verify against.
    """

    index: int
    offset: int
    size: int
    checksum: int


class ColocatedReader:
    """Opens `<data_dir>/data.mdb` read-only in this process, next to a running server.

    Args:
        data_dir: the server's `store.data_dir`.
        threads: threads that verify and copy blocks (default `tiers.blockcopy.DEFAULT_THREADS`).
        native: look the records up with `tiers._blockcopy.resolve` (B-tree searches in the
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

    # -- reads -------------------------------------------------------------

    def read(self, client: Client, hashes: Sequence[bytes], *, lease_ms: int = DEFAULT_LEASE_MS) -> MappedRead:
        """Look `hashes` up through `client` (a leased Lookup: a use) and map the found prefix.

        Args:
            client: a `kvstore.Client` of the server serving this data dir.
            hashes: the prompt's chain hashes, in order (`client.hashes(tokens)`).
            lease_ms: a lease for the Lookup to take (released when the read closes). The read
                needs none: its txn begins before the Lookup runs.

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
        try:
            lookup = _start_lookup(client, hashes, lease_ms)
        except BaseException:
            txn.abort()
            raise
        read = MappedRead(self, client, scope, hashes, lookup, txn)
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
                tenant = _DEFAULT_TENANT
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

    def _forget(self, read: MappedRead) -> None:
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


def _start_lookup(client: Any, hashes: list[bytes], lease_ms: int) -> Any:
    """The read's Lookup, sent without waiting (None for no hashes): the answer is collected
    once the records are looked up."""
    if not hashes:
        return None
    conn = client.connection
    request = pb.LookupRequest(geometry=client.geometry, namespace=client.namespace, block_hashes=hashes,
                               lease_ms=lease_ms)
    try:
        return conn.kvstore.Lookup.future(request, timeout=conn.timeout_s, metadata=conn.metadata)
    except ValueError as exc:  # grpc refuses a call on a closed channel
        raise InvalidArgument(f"cannot look up on this client: {exc}", hint="the client is closed") from None


def _release(client: Any, lease_id: str | None) -> None:
    """Drop a lease without waiting, best effort: it expires on its own (the server may be restarting)."""
    if lease_id:
        conn = client.connection
        with contextlib.suppress(Exception):
            conn.kvstore.Release.future(pb.ReleaseRequest(lease_id=lease_id), timeout=conn.timeout_s,
                                        metadata=conn.metadata)


class MappedRead:
    """The found prefix of one read, as spans of the mapping; holds the read txn until closed.

    Attributes:
        base_address: address of this process's mapping of `data.mdb` (file offset 0).
        map_length: bytes of the mapping valid to read (the file's used pages).
        spans: one `BlockSpan` per block of the found prefix, in order (built on first use).
        offsets, sizes, checksums: the same as numpy columns (int64, int64, uint64): what a
            kernel launch wants, without an object per block.
        hashes: the hashes asked.
        found_blocks: the blocks the Lookup found (`len(spans)` unless some were
            damaged in the file: see `damaged`).
        damaged: asked indices whose records were unreadable or of the wrong
            size in this snapshot (the prefix ends before the first).
    """

    def __init__(self, reader: ColocatedReader, client: Any, scope: BlockScope, hashes: list[bytes],
                 lookup: Any, txn: lmdb.Transaction) -> None:
        self._reader: ColocatedReader | None = reader
        self._client = client
        self._scope = scope
        self._txn: lmdb.Transaction | None = txn
        self._lease_id: str | None = None
        self.hashes = hashes
        self.found_blocks = 0
        self.damaged: list[int] = []
        #: What the server found of each block `report_corrupt` named (span position -> status).
        self.reported: dict[int, str] = {}
        self.base_address = reader._base
        # The newest snapshot's last page bounds this one's: LMDB writes pages before their meta.
        info, psize = reader._env.info(), reader._env.stat()["psize"]
        self.map_length = min((info["last_pgno"] + 1) * psize, reader._map_bytes)
        #: How the records were found: "native" (tiers._blockcopy.resolve) or "lmdb" (py-lmdb gets).
        self.resolved_by = "lmdb"
        self._metas: list[Any] | None = []
        self._datas: list[Any] | None = []
        self._mapped: memoryview | None = None
        self._meta_offsets: np.ndarray | None = None
        #: Each block's offset from `base_address`, its size (int64), its stored xxh3-64 (uint64).
        self.offsets: np.ndarray = np.zeros(0, dtype=np.int64)
        self.sizes: np.ndarray = np.zeros(0, dtype=np.int64)
        self.checksums: np.ndarray = np.zeros(0, dtype=np.uint64)
        try:
            if not (reader.native and hashes and self._resolve_native(txn, scope, hashes, psize)):
                self._resolve(txn, scope, hashes)
            if lookup is not None:
                try:
                    reply = lookup.result()
                except grpc.RpcError as exc:
                    raise status_error(exc) from None
                self.found_blocks, self._lease_id = reply.found_blocks, reply.lease_id or None
            self._cut(self.found_blocks)
        except BaseException:
            if lookup is not None:
                lookup.cancel()
            self.close()
            raise

    def _cut(self, n: int) -> None:
        """Keep the first `n` blocks: those the Lookup found (the records were looked up for all)."""
        if n < len(self.offsets):
            self.offsets, self.sizes, self.checksums = self.offsets[:n], self.sizes[:n], self.checksums[:n]
            if self._meta_offsets is not None:
                self._meta_offsets = self._meta_offsets[:n]
            if self._datas is not None and self._metas is not None:
                self._metas, self._datas = self._metas[:n], self._datas[:n]
        self.damaged = [i for i in self.damaged if i < n]

    def _resolve_native(self, txn: lmdb.Transaction, scope: BlockScope, hashes: list[bytes], psize: int) -> bool:
        """Find the records with B-tree searches in the mapping itself, without the GIL; False when
        this snapshot's tree cannot be told for sure (then py-lmdb's gets do it)."""
        if blockcopy.resolve is None:
            return False
        base, length = self.base_address, self.map_length
        root = blockcopy.named_root(base, length, psize, txn.id(), b"records")
        if root is None:
            return False
        try:
            found, damaged, offs, sizes, metas, sums = blockcopy.resolve(base, length, psize, root, scope.prefix,
                                                                         hashes)
        except ValueError:  # a page that does not parse: LMDB's own reads say what it is
            return False
        if damaged:
            self.damaged.append(found)
        self.offsets = np.frombuffer(offs, dtype=np.int64, count=found)
        self.sizes = np.frombuffer(sizes, dtype=np.int64, count=found)
        self.checksums = np.frombuffer(sums, dtype=np.uint64, count=found)
        self._meta_offsets = np.frombuffer(metas, dtype=np.int64, count=found)
        self._mapped = memoryview((ctypes.c_char * length).from_address(base)).cast("B")
        self._metas = self._datas = None  # views made when a CPU check or copy needs them
        self.resolved_by = "native"
        return True

    def _views(self) -> tuple[list[Any], list[Any]]:
        """(meta, data) views of each block: LMDB's, or slices of the mapping (native resolve)."""
        if self._datas is None or self._metas is None:
            mapped = self._mapped
            assert mapped is not None and self._meta_offsets is not None
            offs, ends = self.offsets.tolist(), (self.offsets + self.sizes).tolist()
            self._datas = [mapped[lo:hi] for lo, hi in zip(offs, ends, strict=True)]
            self._metas = [mapped[m:m + META_STRUCT.size] for m in self._meta_offsets.tolist()]
        return self._metas, self._datas

    def _resolve(self, txn: lmdb.Transaction, scope: BlockScope, hashes: list[bytes]) -> None:
        """Find the found prefix's records with py-lmdb's gets; it ends at a block gone from this
        snapshot or damaged.

        Kept as columns (`offsets`, `sizes`, `checksums`) all the same: not an object per block.
        """
        get, prefix = txn.get, scope.prefix
        keys = [prefix + h for h in hashes]
        metas: list[Any] = []
        datas: list[Any] = []
        try:
            for key in keys:
                meta = get(key + META_TAG)
                if meta is None:  # gone before the txn opened (an expired lease): a miss from here
                    break
                metas.append(meta)
                datas.append(get(key + DATA_TAG))
        except lmdb.Error:  # a damaged page: LMDB failed the txn; the prefix ends here
            self.damaged.append(len(datas))
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
        if n < len(datas) and not self.damaged:
            self.damaged.append(n)
        self._metas, self._datas = metas[:n], datas[:n]
        self.offsets = np.asarray(blockcopy.addresses(self._datas), dtype=np.int64) - self.base_address
        self.sizes = sizes[:n]
        self.checksums = records["checksum"][:n].copy()

    @cached_property
    def spans(self) -> list[BlockSpan]:
        """One `BlockSpan` per block of the found prefix, in order (built on first use: the
        columns `offsets`, `sizes` and `checksums` say the same without an object per block)."""
        return [BlockSpan(i, o, z, c) for i, (o, z, c) in
                enumerate(zip(self.offsets.tolist(), self.sizes.tolist(), self.checksums.tolist(), strict=True))]

    def __len__(self) -> int:
        """Blocks in the found prefix."""
        return len(self.offsets)

    # -- using the bytes ---------------------------------------------------

    def _check_open(self) -> None:
        if self._txn is None:
            raise FailedPrecondition("this MappedRead is closed: its spans may no longer be read")

    def _positions(self, indices: Sequence[int] | None) -> list[int]:
        if indices is None:
            return list(range(len(self)))
        if isinstance(indices, str | bytes) or not isinstance(indices, Sequence):
            raise InvalidArgument(f"indices must be a sequence of ints, got {type(indices).__name__}")
        out = [arguments.integer(i, f"indices[{n}]") for n, i in enumerate(indices)]
        bad = [i for i in out if i >= len(self)]
        if bad:
            raise InvalidArgument(f"indices {bad[:5]} are past the {len(self)} blocks of this read")
        return out

    def view(self, index: int) -> memoryview:
        """Block `index`'s bytes, read-only, valid until `close`."""
        self._check_open()
        (i,) = self._positions([index])
        return memoryview(self._views()[1][i]).toreadonly()

    def verify(self, indices: Sequence[int] | None = None) -> list[bool]:
        """Whether each block (`indices` of the spans, default all) matches its stored checksum.

        Hashed without the GIL over the reader's threads where `tiers._blockcopy` is built.
        """
        self._check_open()
        positions = self._positions(indices)
        if self._mapped is not None:  # resolved natively: hash the spans in place, no view per block
            pick = slice(None) if indices is None else np.asarray(positions, dtype=np.int64)
            checked = blockcopy.verify_spans(self.base_address, self.map_length, self.offsets[pick],
                                             self.sizes[pick], self.checksums[pick], self._threads())
            if checked is not None:
                return checked
        if indices is None:
            return blockcopy.verify_many(self._views()[1], self.checksums.tolist(), self._threads())
        sums, datas = self.checksums.tolist(), self._views()[1]
        return blockcopy.verify_many([datas[i] for i in positions], [sums[i] for i in positions], self._threads())

    def _threads(self) -> int | None:
        return self._reader.threads if self._reader is not None else None

    def copy_into(self, dest: Any, *, verify: bool = True) -> list[int]:
        """Copy the spans, in order and back to back, into `dest` on the CPU (the fallback path).

        Args:
            dest: writable, contiguous CPU memory of at least the spans' total
                bytes: a bytearray, memoryview, numpy array or CPU torch tensor.
            verify: check each block's checksum in the same pass (a corrupt
                block's rows of `dest` are left as they were).

        Returns:
            The indices of the blocks that failed their checksum (empty when all
            are intact, or when `verify` is False).

        Raises:
            InvalidArgument: `dest` is not writable CPU memory, or is too small.
        """
        self._check_open()
        ends = np.cumsum(self.sizes).tolist()
        target = writable_bytes(dest, ends[-1] if ends else 0)
        dests = [target[lo:hi] for lo, hi in zip([0, *ends], ends, strict=False)]
        if not verify:
            for d, data in zip(dests, self._views()[1], strict=True):
                d[:] = data
            return []
        metas, datas = self._views()
        codes = blockcopy.copy_many(metas, datas, dests, self._threads())
        return [i for i, c in enumerate(codes) if c != blockcopy.FOUND]

    def report_corrupt(self, indices: Sequence[int]) -> None:
        """Tell the server these blocks failed their checksum here (ReportCorrupt).

        Args:
            indices: positions in the asked list (a span's `index`, or one of `damaged`).

        The server checks each again itself and drops and counts only those that
        really fail; what it found is kept in `reported` (asked index ->
        "found" (intact, kept), "missing" or "corrupt" (dropped)).

        Raises:
            InvalidArgument: an index past the hashes asked.
            KVStoreError: the call's error (the server may be down: the blocks are
                checked again on the next Get or read that meets them).
        """
        if isinstance(indices, str | bytes) or not isinstance(indices, Sequence):
            raise InvalidArgument(f"indices must be a sequence of ints, got {type(indices).__name__}")
        asked = [arguments.integer(i, f"indices[{n}]", most=len(self.hashes) - 1) for n, i in enumerate(indices)]
        if not asked:
            return
        conn = self._client.connection
        reply = conn.call(conn.kvstore.ReportCorrupt, pb.ReportCorruptRequest(
            geometry=self._client.geometry, namespace=self._client.namespace,
            block_hashes=[self.hashes[i] for i in asked]))
        for i, status in zip(asked, reply.statuses, strict=False):
            self.reported[i] = pb.BlockStatus.Name(status).removeprefix("BLOCK_STATUS_").lower()

    def close(self) -> None:
        """End the read txn (the spans may no longer be read) and drop the lease (a no-op once closed)."""
        if self._txn is None:
            return
        self._metas = self._datas = []
        self._mapped = None
        self._txn.abort()
        self._txn = None
        if self._reader is not None:
            self._reader._forget(self)
            self._reader = None
        _release(self._client, self._lease_id)
        self._lease_id = None

    def __enter__(self) -> MappedRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DEFAULT_LEASE_MS", "BlockSpan", "ColocatedReader", "MappedRead"]
