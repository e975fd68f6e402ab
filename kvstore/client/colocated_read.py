"""One same-host read: the found prefix's blocks as spans of this process's mapping of `data.mdb`.

`kvstore.client.colocated.ColocatedReader.read` makes a `MappedRead`; this module holds it:
its Lookup (sent before the records are found, settled when first needed), its columns, and
the checks and copies of its bytes. Finding the records in the snapshot is the reader's
(`ColocatedReader.find`, which knows the file); what a read needs of its reader is `ReadOwner`,
so this module does not import the reader's. Like colocated.py it uses the on-disk format
(`kvstore.native.records`) and the checksum loops (`kvstore.native.blockcopy`): the layering test allows
exactly those (tests/kvstore/test_wire.py). Design: docs/DIRECT_RESTORE.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import grpc
import lmdb
import numpy as np

from kvstore.client import arguments
from kvstore.client.colocated_memory import writable_bytes
from kvstore.client.connection import status_error
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.native import blockcopy
from kvstore.native.records import META_STRUCT
from kvstore.prefix import BlockScope
from kvstore.v1 import kvstore_pb2 as pb


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


@dataclass(slots=True, kw_only=True)
class FoundRecords:
    """A read's records as found in its snapshot (`ReadOwner.find`): the found prefix's columns
    (as `MappedRead` has them), the asked indices found damaged, and how they were found.

    `metas` and `datas` are LMDB's views of each block's records when found by gets; found
    natively, they are None (made from `mapped`, at `meta_offsets` and `offsets`, when needed).
    """

    offsets: np.ndarray
    sizes: np.ndarray
    checksums: np.ndarray
    damaged: list[int] = field(default_factory=list)
    resolved_by: str = "lmdb"
    metas: list[Any] | None = None
    datas: list[Any] | None = None
    mapped: memoryview | None = None
    meta_offsets: np.ndarray | None = None


class ReadOwner(Protocol):
    """What a `MappedRead` needs of the reader that opened it (`kvstore.client.colocated.ColocatedReader`)."""

    #: Threads that verify and copy blocks (None: `kvstore.native.blockcopy.DEFAULT_THREADS`).
    threads: int | None

    def bounds(self) -> tuple[int, int, int]:
        """(base address, bytes valid to read, page bytes) of the mapping, for a read txn begun now."""
        ...

    def find(self, txn: lmdb.Transaction, scope: BlockScope, hashes: list[bytes],
             bounds: tuple[int, int, int]) -> FoundRecords:
        """The records of `hashes`' found prefix in `txn`'s snapshot."""
        ...

    def forget(self, read: MappedRead) -> None:
        """Stop counting `read` as open (it closed)."""
        ...


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

    A read opened with `wait=False` returns before its Lookup answers: until `found_blocks`
    (or `damaged`, `spans`, `settle`, `copy_into`) is first read, the columns hold every
    record this snapshot has of the asked prefix (the candidates), so a copy can run while
    the Lookup is in flight; that first read waits for the answer and cuts the columns to the
    blocks it found. A caller copying the candidates uses only the first `found_blocks` rows.
    """

    def __init__(self, reader: ReadOwner, client: Any, scope: BlockScope, hashes: list[bytes],
                 start_lookup: Callable[[], Any], txn: lmdb.Transaction, *, wait: bool = True) -> None:
        self._reader: ReadOwner | None = reader
        self._client = client
        self._scope = scope
        self._txn: lmdb.Transaction | None = txn
        self._lease_id: str | None = None
        self.hashes = hashes
        self._found = 0
        self._damaged: list[int] = []
        self._start_lookup: Callable[[], Any] | None = start_lookup  # sent once, after the txn began
        self._lookup: Any = None  # the Lookup's future until its answer has cut the columns
        self._settling = threading.Lock()
        #: What the server found of each block `report_corrupt` named (span position -> status).
        self.reported: dict[int, str] = {}
        bounds = reader.bounds()
        self.base_address, self.map_length = bounds[0], bounds[1]
        #: How the records were found: "native" (kvstore.native._blockcopy.resolve) or "lmdb" (py-lmdb gets).
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
            # The Lookup first: the server answers it while the records are searched here. (Sent
            # while the pool searches, it held the GIL the slices start with: no faster on the H200.)
            self._send_lookup()
            self._take(reader.find(txn, scope, hashes, bounds))
            if wait:
                self.settle()
        except BaseException:
            if self._lookup is not None:
                self._lookup.cancel()
            self._lookup = None
            self.close()
            raise

    def _take(self, found: FoundRecords) -> None:
        """Hold the columns and views the reader found."""
        self.offsets, self.sizes, self.checksums = found.offsets, found.sizes, found.checksums
        self._damaged, self.resolved_by = found.damaged, found.resolved_by
        self._metas, self._datas, self._mapped = found.metas, found.datas, found.mapped
        self._meta_offsets = found.meta_offsets

    def _send_lookup(self) -> None:
        """Send the Lookup (once), before the records are searched, so the two overlap."""
        start, self._start_lookup = self._start_lookup, None
        if start is not None:
            self._lookup = start()

    @property
    def found_blocks(self) -> int:
        """The blocks the Lookup found (waits for its answer on a `wait=False` read)."""
        self.settle()
        return self._found

    @property
    def damaged(self) -> list[int]:
        """Asked indices whose records were unreadable or of the wrong size in this snapshot,
        within what the Lookup found (waits for its answer on a `wait=False` read)."""
        self.settle()
        return self._damaged

    def settle(self) -> None:
        """Wait for the Lookup's answer and cut the columns to the blocks it found (once; a no-op after).

        Raises:
            KVStoreError: the Lookup's error (Unavailable when the server is down, ...); the read
                then holds no block.
        """
        if self._lookup is None:
            return
        with self._settling:
            lookup, self._lookup = self._lookup, None
            if lookup is None:
                return
            try:
                reply = lookup.result()
            except grpc.RpcError as exc:
                self._cut(0)  # no answer: nothing of this read may be used
                raise status_error(exc) from None
            self._found, self._lease_id = reply.found_blocks, reply.lease_id or None
            self._cut(self._found)

    def _cut(self, n: int) -> None:
        """Keep the first `n` blocks: those the Lookup found (the records were looked up for all)."""
        if n < len(self.offsets):
            self.offsets, self.sizes, self.checksums = self.offsets[:n], self.sizes[:n], self.checksums[:n]
            if self._meta_offsets is not None:
                self._meta_offsets = self._meta_offsets[:n]
            if self._datas is not None and self._metas is not None:
                self._metas, self._datas = self._metas[:n], self._datas[:n]
        self._damaged = [i for i in self._damaged if i < n]

    def _views(self) -> tuple[list[Any], list[Any]]:
        """(meta, data) views of each block: LMDB's, or slices of the mapping (native resolve)."""
        if self._datas is None or self._metas is None:
            mapped = self._mapped
            assert mapped is not None and self._meta_offsets is not None
            offs, ends = self.offsets.tolist(), (self.offsets + self.sizes).tolist()
            self._datas = [mapped[lo:hi] for lo, hi in zip(offs, ends, strict=True)]
            self._metas = [mapped[m:m + META_STRUCT.size] for m in self._meta_offsets.tolist()]
        return self._metas, self._datas

    @cached_property
    def spans(self) -> list[BlockSpan]:
        """One `BlockSpan` per block of the found prefix, in order (built on first use: the
        columns `offsets`, `sizes` and `checksums` say the same without an object per block)."""
        self.settle()
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

        Hashed without the GIL over the reader's threads where `kvstore.native._blockcopy` is built.
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
        self.settle()  # the CPU path copies only what the Lookup found
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
        lookup, self._lookup = self._lookup, None
        if lookup is not None:  # never waited for: keep its lease to drop, or stop it
            if lookup.done():
                with contextlib.suppress(Exception):
                    self._lease_id = lookup.result().lease_id or None
            else:
                lookup.cancel()
        self._metas = self._datas = []
        self._mapped = None
        self._txn.abort()
        self._txn = None
        if self._reader is not None:
            self._reader.forget(self)
            self._reader = None
        _release(self._client, self._lease_id)
        self._lease_id = None

    def __enter__(self) -> MappedRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["BlockSpan", "MappedRead"]
