"""Fixed-size binary records the LMDB tier keeps beside each block.

Kept as struct layouts rather than pickles or protobuf so a record can be read
without allocation-heavy decoding on the hot path, and so the on-disk format is
written down in one place.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.errors import DataLoss
from kvstore.prefix import HASH_BYTES, KEY_BYTES

#: parent hash, depth, size, checksum, created, last access. Public so hot loops can
#: unpack a record in place without building a BlockMeta.
META_STRUCT = struct.Struct("<32sIIQdd")
_LRU_HEAD = struct.Struct(">QI")
_DEPTH_MAX = 0xFFFFFFFF


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockMeta:
    """What the tier knows about one stored block.

    Attributes:
        parent_hash: chain hash of the block before it (a root hash for the first).
        depth: 1 for a chain's first block, parent depth + 1 after.
        size_bytes: length of the block's data.
        checksum: xxh3-64 of the data, verified on every read.
        created_s: time of the first write.
        last_access_s: time of the last write or read (the retention clock).
    """

    parent_hash: bytes
    depth: int
    size_bytes: int
    checksum: int
    created_s: float
    last_access_s: float

    def pack(self) -> bytes:
        """The record's bytes."""
        return META_STRUCT.pack(self.parent_hash, self.depth, self.size_bytes, self.checksum,
                          self.created_s, self.last_access_s)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> BlockMeta:
        """Parse a record.

        Raises:
            DataLoss: the record is not a meta record's size (damaged on disk).
        """
        try:
            parent, depth, size, checksum, created, last = META_STRUCT.unpack(raw)
        except struct.error:
            raise _damaged("meta record", raw) from None
        return cls(parent_hash=parent, depth=depth, size_bytes=size, checksum=checksum,
                   created_s=created, last_access_s=last)


def _damaged(what: str, raw: bytes | memoryview) -> DataLoss:
    return DataLoss(f"a damaged {what} ({len(raw)} bytes) was met in the store",
                    hint="run `kvstore check --data-dir D` (and --repair with the server stopped)")


def lru_key(last_access_s: float, depth: int, key: bytes) -> bytes:
    """Index key ordering blocks by last access, deepest first among equals.

    Deepest first makes a chain written or read in one call give up its tail
    before its prefix, the order eviction must follow.
    """
    return _LRU_HEAD.pack(int(last_access_s * 1e6), _DEPTH_MAX - depth) + key


def lru_entry(raw: bytes | memoryview) -> tuple[float, bytes]:
    """(last access in seconds, block key) of an LRU index key.

    Raises:
        DataLoss: the key is too short to be an LRU entry (damaged on disk).
    """
    if len(raw) <= _LRU_HEAD.size:
        raise _damaged("LRU index entry", raw)
    micros, _ = _LRU_HEAD.unpack_from(raw)
    return micros / 1e6, bytes(raw[_LRU_HEAD.size:])


# A block's records share one LMDB database and sort together: each key is the
# block's storage key and a tag. Its data, its meta record and the entries naming
# its children then sit side by side in the same B-tree leaf, so storing a block
# dirties one leaf page rather than one in each of three trees (a Put ran about
# 20% faster), and reading its meta and data touches one.
CHILD_TAG, DATA_TAG, META_TAG = b"c", b"d", b"m"


def data_key(key: bytes) -> bytes:
    """Record key of a block's data."""
    return key + DATA_TAG


def meta_key(key: bytes) -> bytes:
    """Record key of a block's meta record (`META_STRUCT`)."""
    return key + META_TAG


def children_prefix(key: bytes) -> bytes:
    """Common start of the record keys naming the children of the block at `key`."""
    return key + CHILD_TAG


def child_key(parent_key: bytes, child_hash: bytes) -> bytes:
    """Record key noting that `child_hash` extends the block at `parent_key`."""
    return parent_key + CHILD_TAG + child_hash


def parent_key_of(key: bytes, parent_hash: bytes) -> bytes:
    """The storage key of a block's parent: same layout and tenant, the parent's hash."""
    return key[: KEY_BYTES - HASH_BYTES] + parent_hash
