"""A namespace's blocks as records, out of the store and back in (R21): moving a tenant, warming a node.

`export_records` yields every block of a namespace with what an import needs:
its geometry fingerprint, chain hash, parent hash, depth, data and the xxh3-64
checksum stored beside it. Parents come before children (by depth), so any
prefix of the records is prefix-closed (R6). Blocks are read in chunks of
`EXPORT_CHUNK` in one short read transaction each (so an export never pins
LMDB's old pages for long), verified against their checksums (R2); a corrupt
or damaged block is left out with everything below it, and a block whose
parent was not exported (evicted while the export ran) is left out too. The
listing and the set of exported keys are held in memory while it runs: about
250 bytes per block of the namespace (250 MB for a million blocks, 57 GB of KV).

`import_records` writes records back through the Put path: each chunk of
`IMPORT_CHUNK` records in one durable transaction (R1), with room made and
quotas kept as for a Put (R8, R12, R18, R19). Every record's data is checked
against its checksum before its chunk is written: a damaged record is refused
with DataLoss, a malformed one (or one whose parent is neither stored nor
earlier in the input) with InvalidArgument, naming the record; chunks before
it stay stored. A block already stored is a use of it (R5), not a second copy:
importing the same records twice writes nothing the second time.

The namespace is not in the chain hash (docs/PREFIX_HASHING.md: the storage
key is fingerprint | namespace id | hash), so records exported from one
namespace import into any other. Imported blocks are stamped with the time of
the import: their retention starts then. The chain hash is trusted as given
(an import is an admin's act and the data is checksummed), so a record
claiming a hash its tokens would not produce is stored under that hash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

import lmdb
import xxhash

from kvstore.errors import DataLoss, FailedPrecondition, InvalidArgument, KVStoreError
from kvstore.prefix import FINGERPRINT_BYTES, HASH_BYTES, BlockScope, namespace_id
from tiers.block_txn import BlockDbs, DamagedBlock, PutBatch, PutResult, read_meta
from tiers.purge import namespace_blocks
from tiers.reads import ReadStatus, verified

#: Blocks read per read transaction while exporting (also how often `next()` blocks on LMDB).
EXPORT_CHUNK = 256
#: Records written per durable transaction while importing.
IMPORT_CHUNK = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportRecord:
    """One stored block, as an export carries it.

    Attributes:
        namespace: the namespace it was exported from.
        fingerprint: its geometry fingerprint (8 bytes).
        block_hash: its chain hash (32 bytes).
        parent_hash: the hash before it: its parent's, or the chain root's for a first block.
        depth: 1 for a chain's first block, its parent's + 1 after.
        checksum: xxh3-64 of `data`.
        data: the block's bytes.
    """

    namespace: str
    fingerprint: bytes
    block_hash: bytes
    parent_hash: bytes
    depth: int
    checksum: int
    data: bytes


class BlockRecord(Protocol):
    """What `import_records` reads of a record (an `ExportRecord`, or a file's own record class)."""

    @property
    def fingerprint(self) -> bytes: ...
    @property
    def block_hash(self) -> bytes: ...
    @property
    def parent_hash(self) -> bytes: ...
    @property
    def depth(self) -> int: ...
    @property
    def checksum(self) -> int: ...
    @property
    def data(self) -> bytes: ...


def export_records(env: lmdb.Environment, dbs: BlockDbs, namespace: str,
                   on_corrupt: Callable[[Sequence[bytes]], None],
                   on_damage: Callable[[bytes, BaseException], None]) -> Iterator[ExportRecord]:
    """Every block of `namespace` (every geometry), verified, parents before children.

    Args:
        env, dbs: the tier's environment and databases.
        namespace: the tenant's name.
        on_corrupt: removes blocks that fail their checksum (as a read does).
        on_damage: notes a block whose records sit on a damaged page.
    """
    listed = sorted(namespace_blocks(env, dbs, namespace_id(namespace)))
    exported: set[bytes] = set()
    for start in range(0, len(listed), EXPORT_CHUNK):
        chunk = [key for _, key in listed[start:start + EXPORT_CHUNK]]
        records, corrupt = _read_chunk(env, dbs, namespace, chunk, exported, on_damage)
        if corrupt:
            on_corrupt(corrupt)
        yield from records


def _read_chunk(env: lmdb.Environment, dbs: BlockDbs, namespace: str, keys: list[bytes], exported: set[bytes],
                on_damage: Callable[[bytes, BaseException], None]) -> tuple[list[ExportRecord], list[bytes]]:
    """The chunk's records whose parent was exported (copied out of the txn), and the corrupt keys."""
    out: list[ExportRecord] = []
    corrupt: list[bytes] = []
    done = 0
    while done < len(keys):
        try:
            with env.begin(buffers=True) as txn:
                for key in keys[done:]:
                    done += 1
                    status, view = verified(txn, dbs, key)
                    meta = read_meta(txn, dbs, key)
                    if status is ReadStatus.CORRUPT:
                        corrupt.append(key)
                    if view is None or meta is None:
                        continue
                    parent_key = key[:-HASH_BYTES] + meta.parent_hash
                    if meta.depth > 1 and parent_key not in exported:
                        continue
                    exported.add(key)
                    out.append(ExportRecord(namespace=namespace, fingerprint=key[:FINGERPRINT_BYTES],
                                            block_hash=key[-HASH_BYTES:], parent_hash=meta.parent_hash,
                                            depth=meta.depth, checksum=meta.checksum, data=bytes(view)))
        except DamagedBlock as exc:  # the txn is unusable: go on past the block in a fresh one
            on_damage(exc.key, exc.cause)
    return out, corrupt


def import_records(commit: Callable[[list[PutBatch]], list[PutResult]], records: Iterable[BlockRecord], *,
                   namespace: str | None, quota_bytes: int | None) -> int:
    """Write `records` back, `IMPORT_CHUNK` per durable transaction; how many blocks were new.

    Args:
        commit: stores Put batches in one durable transaction (the tier's Put path).
        records: in chain order, parents first.
        namespace: where they go; None: each record's own `namespace`.
        quota_bytes: the namespace's NVMe quota (R19), None: the tier's quota provider's.

    Raises:
        DataLoss: a record's data does not match its checksum.
        InvalidArgument: a malformed record, or one whose parent is neither stored nor earlier.
        ResourceExhausted: no room, or past the namespace's quota, as for a Put.
    """
    written = 0
    it = iter(records)
    index = 0
    while chunk := list(islice(it, IMPORT_CHUNK)):
        batches = [_batch(index, i, r, namespace, quota_bytes) for i, r in enumerate(chunk)]
        try:
            results = commit(batches)
        except FailedPrecondition as exc:
            raise InvalidArgument(f"records {index}..{index + len(chunk) - 1}: {exc}; records must come parents "
                                  "first (as an export writes them)") from None
        written += sum(r.written_blocks for r in results)
        index += len(chunk)
    return written


def _batch(start: int, offset: int, record: Any, namespace: str | None, quota_bytes: int | None) -> PutBatch:
    """Record `start + offset` (its chunk starts at `start`) as a one-block Put batch, checked."""
    index = start + offset
    try:
        fingerprint, block_hash, parent_hash = record.fingerprint, record.block_hash, record.parent_hash
        depth, checksum, data = int(record.depth), int(record.checksum), record.data
        target = namespace if namespace is not None else record.namespace
    except (AttributeError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"record {index} is not a block record: {exc}") from None
    if len(parent_hash) != HASH_BYTES or depth < 1 or not isinstance(target, str) or not data:
        raise InvalidArgument(f"record {index} (block {bytes(block_hash).hex()[:16]}...) is malformed: parent hash "
                              f"of {len(parent_hash)} bytes, depth {depth}, {len(data)} data bytes, "
                              f"namespace {target!r}")
    try:
        scope = BlockScope(bytes(fingerprint), target)
        scope.key(bytes(block_hash))
    except KVStoreError as exc:
        raise InvalidArgument(f"record {index}: {exc}") from None
    if xxhash.xxh3_64_intdigest(data) != checksum:
        raise DataLoss(f"record {index} (block {bytes(block_hash).hex()[:16]}...) does not match its checksum: "
                       f"the input is damaged; records 0..{start - 1} are stored, none from {start} on",
                       hint="export the namespace again, or restore the file from a good copy")
    return PutBatch(scope=scope, parent_hash=bytes(parent_hash), hashes=[bytes(block_hash)], blocks=[data],
                    is_root=depth == 1, quota_bytes=quota_bytes)
