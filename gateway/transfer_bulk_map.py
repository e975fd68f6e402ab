"""The bulk transport's zero-copy source: the engine writes blocks straight from LMDB's map.

A BulkFetch served from the map (docs/TRANSFER.md "Bulk transport", "From the map"):

1. a read txn of the tier is begun, and held until the engine's write has returned: while
   it is open LMDB reuses none of its snapshot's pages, whatever is evicted or written;
2. each block's data record is found in the snapshot natively (`kvstore.native.blockcopy.resolve_many`,
   B-tree searches in the map without the GIL), as its offset, size and stored checksum. A
   record is one contiguous span of the map: a 56,960-byte value lives on an overflow run,
   which LMDB allocates as consecutive pages;
3. the found blocks are hashed in place (`blockcopy.verify_spans`, without the GIL);
4. the engine writes them from the map's addresses into the client's region in one batch.

The map (the tier's own, `tiers.ring.Mapping`) is registered with the engine once. With
Mooncake's TCP transport (the one the server's engine runs) registering is bookkeeping: the
range is noted in the engine's segment and checked against each transfer; nothing is pinned.
An RDMA transport would pin and register the whole map with the NIC, so for RDMA the staging
path is the one to keep.

Anything the map path cannot answer exactly as Fetch would (a damaged record, a block that
fails its checksum, a block of another size, a snapshot whose tree cannot be told for sure)
hands the call to the staging path (`None`), which reports, counts and drops as Fetch does.
A map that moved (the environment's map size changed) or a data.mdb replaced under the
server turns the map path off for good: the registration is dropped, staging serves.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import lmdb
import numpy as np

from kvstore.errors import Unavailable
from kvstore.native import blockcopy
from kvstore.native.records import META_STRUCT, META_TAG
from tiers.retention import Retention
from tiers.ring import Mapping
from tiers.store import MappedStore

log = logging.getLogger("kvstore.transfer")

#: Byte offset of `last_access` (float64) in a meta record ("<32sIIQdd").
_LAST_ACCESS_AT = META_STRUCT.size - 8


def missing() -> str:
    """Why blocks cannot be served from the map in this build ("" when they can)."""
    if blockcopy.resolve is None:
        return "kvstore.native._blockcopy is not built (its record lookups)"
    return ""


@dataclass(kw_only=True)
class Resolved:
    """A BulkFetch's blocks found and verified in the map, under `txn` (abort it once written).

    Attributes:
        codes: a `blockcopy` code per key (FOUND, MISSING, or NOT_REACHED past a prefix's end).
        found: the indices of FOUND blocks, in order.
        addresses: the address of each found block's bytes in this process (valid while `txn` is open).
        due: the keys of found blocks due a retention refresh.
    """

    txn: lmdb.Transaction
    codes: bytes
    found: np.ndarray
    addresses: list[int]
    due: list[bytes]


class MapSource:
    """The tier's map of data.mdb, registered with the server's engine.

    Args:
        engines: the server's started Mooncake engines (TCP transport); each registers the map.
        tier: the tier whose map it is.

    Raises:
        LookupError: the map is not found (an empty store, or not Linux).
        Unavailable: the engine would not register it.
    """

    def __init__(self, engines: list[Any], tier: MappedStore) -> None:
        self.engines = engines
        self.tier = tier
        self.mapping: Mapping = tier.map.mapping()
        self.path = tier.map.data_path
        self.inode = self.path.stat().st_ino
        self.map_size = tier.map.map_size()
        # The tier's records database: a miss is checked against it (below).
        self.records = tier.map.records
        for i, engine in enumerate(engines):
            if engine.register_memory(self.mapping.base, self.mapping.length):
                for done in engines[:i]:
                    done.unregister_memory(self.mapping.base)
                raise Unavailable("bulk: the server's transfer engine could not register the map of data.mdb")
        self.reason = ""  # why the map path was turned off ("" while on)

    def usable(self) -> bool:
        """Whether the registered map is still the environment's map of the file the store is in."""
        if self.reason:
            return False
        try:
            inode = self.path.stat().st_ino
        except OSError:
            inode = -1
        if inode != self.inode:
            self._off(f"{self.path} was replaced while the server runs")
        elif self.tier.map.map_size() != self.map_size:
            self._off("the environment's map size changed (LMDB mapped it again elsewhere)")
        return not self.reason

    def _off(self, reason: str) -> None:
        self.reason = reason
        # The old range may be gone from this process: no transfer may name it any more.
        for engine in self.engines:
            engine.unregister_memory(self.mapping.base)
        log.warning("bulk transport: serving from staging from now on: %s", reason)

    def close(self) -> None:
        """Drop the registration (the engine is going)."""
        if not self.reason:
            self.reason = "closed"
            for engine in self.engines:
                engine.unregister_memory(self.mapping.base)

    def resolve(self, keys: list[bytes], block_bytes: int, prefix_only: bool) -> Resolved | None:
        """Find and verify `keys`' blocks in the map under a new read txn (on the tier's pool).

        Returns:
            The blocks, their txn left open for the write; None (the txn ended) when the
            staging path must answer this call.
        """
        txn = self.tier.map.begin_buffers()
        try:
            found = self._find(txn, keys, block_bytes, prefix_only)
        except BaseException:
            txn.abort()
            raise
        if found is None:
            txn.abort()
        return found

    def _find(self, txn: lmdb.Transaction, keys: list[bytes], block_bytes: int, prefix_only: bool
              ) -> Resolved | None:
        m = self.mapping
        # The newest snapshot's last page bounds this one's: nothing past it is read (past the
        # file's end a read of the map would fault).
        length = min((self.tier.map.last_page() + 1) * m.psize, m.length)
        root = blockcopy.named_root(m.base, length, m.psize, txn.id(), b"records")
        if root is None:
            return None
        n = len(keys)
        codes = bytearray(n)
        rows: list[tuple[int, Any, Any, Any, Any]] = []  # (first index, offsets, sizes, metas, sums)
        at = 0
        while at < n:
            try:
                answer = blockcopy.resolve_many(m.base, length, m.psize, root, b"", keys[at:])
            except ValueError:  # a page that does not parse: LMDB's own reads say what it is
                return None
            if answer is None:
                return None
            got, damaged, offs, sizes, metas, sums = answer
            rows.append((at, offs, sizes, metas, sums))
            at += got
            if at == n:
                break
            # Stopped at `at`: a miss, unless its records are half there or damaged (then
            # staging reports it CORRUPT and drops it, as Fetch does).
            if damaged or txn.get(keys[at] + META_TAG, None, self.records) is not None:
                return None
            codes[at] = blockcopy.MISSING
            at += 1
            if prefix_only:
                break
        # `rows` holds one answer at least: a call has one key at least (fetch_keys).
        index = np.concatenate([np.arange(lo, lo + len(offs), dtype=np.int64) for lo, offs, *_ in rows])
        offsets, sizes, metas, sums = (np.concatenate([row[k] for row in rows]) for k in (1, 2, 3, 4))
        if (sizes != block_bytes).any():
            return None  # a block of another size: staging says so as Fetch does
        intact = blockcopy.verify_spans(m.base, length, offsets, sizes, sums)
        if intact is None or not all(intact):
            return None  # corrupt: staging reports, counts and drops it
        for i in index.tolist():
            codes[i] = blockcopy.FOUND
        due_before = Retention.touch_due_before(self.tier.retention_clock.now())
        last = _last_access(m.base, length, metas)
        due = [keys[i] for i in index[last < due_before].tolist()]
        return Resolved(txn=txn, codes=bytes(codes), found=index, addresses=(offsets + m.base).tolist(), due=due)


def _last_access(base: int, length: int, metas: np.ndarray) -> np.ndarray:
    """Each meta record's `last_access` (float64 at `_LAST_ACCESS_AT`), read from the map."""
    if not len(metas):
        return np.zeros(0)
    mapped = np.frombuffer(memoryview((ctypes.c_char * length).from_address(base)).cast("B"), dtype=np.uint8)
    at = metas.astype(np.int64)[:, None] + np.arange(_LAST_ACCESS_AT, _LAST_ACCESS_AT + 8)
    return np.ascontiguousarray(mapped[at]).view("<f8").ravel()

