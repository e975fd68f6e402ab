"""Removing blocks on purpose: an admin's purge of a prompt or a whole namespace (R20),
and corrupt blocks with their descendants (R10).

Both keep R6 (no stored block whose parent is gone): a block goes only with
every stored block below it. A purge first lists what it will remove in a read
transaction, then removes it deepest first in write transactions of at most
`PURGE_CHUNK` blocks, each durable before the next (R1) and each keeping R6 on
its own: a block is removed with `subtree`, so a child a Put added since the
listing goes with it. A crash mid-purge leaves a smaller, consistent store;
running the purge again finishes it.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import lmdb

from kvstore.native.records import META_TAG, meta_key
from tiers.block_txn import BlockDbs, BlockTxn, DamagedBlock
from tiers.damage import MAX_DAMAGED_PER_CALL, DamagedBlocks

log = logging.getLogger(__name__)

#: Blocks removed per write transaction: bounds a purge's dirty pages, and how long it holds the writer lock.
PURGE_CHUNK = 1024

_FINGERPRINT_BYTES = 8
_DEPTH = struct.Struct("<I")
_DEPTH_OFFSET = 32  # after the parent hash (records.META_STRUCT)

WriteTxn = Callable[[], AbstractContextManager[BlockTxn]]


def namespace_blocks(env: lmdb.Environment, dbs: BlockDbs, ns_id: bytes) -> list[tuple[int, bytes]]:
    """(depth, storage key) of every block of the namespace, in every geometry (one read txn).

    Keys sort by geometry fingerprint, then namespace id: the walk jumps from one
    fingerprint to the next and reads only the namespace's own range of each.
    """
    out: list[tuple[int, bytes]] = []
    key_len = _FINGERPRINT_BYTES + len(ns_id) + 32 + len(META_TAG)
    with env.begin(buffers=True) as txn:
        for fingerprint in _fingerprints(txn.cursor(db=dbs.records)):
            prefix = fingerprint + ns_id
            cursor = txn.cursor(db=dbs.records)
            if not cursor.set_range(prefix):
                continue
            for key, value in cursor.iternext(keys=True, values=True):
                if bytes(key[:len(prefix)]) != prefix:
                    break
                if len(key) == key_len and bytes(key[-1:]) == META_TAG:
                    out.append((_DEPTH.unpack_from(value, _DEPTH_OFFSET)[0], bytes(key[:-1])))
    return out


def _fingerprints(cursor: Any) -> Iterator[bytes]:
    """The distinct geometry fingerprints of the stored records, in order."""
    if not cursor.first():
        return
    while True:
        fingerprint = bytes(cursor.key()[:_FINGERPRINT_BYTES])
        yield fingerprint
        following = int.from_bytes(fingerprint, "big") + 1
        if following >> (8 * _FINGERPRINT_BYTES) or not cursor.set_range(
                following.to_bytes(_FINGERPRINT_BYTES, "big")):
            return


def subtree_blocks(env: lmdb.Environment, dbs: BlockDbs, keys: Sequence[bytes]) -> list[tuple[int, bytes]]:
    """(depth, storage key) of each stored block of `keys` and every stored block below it."""
    out: dict[bytes, int] = {}
    with env.begin(buffers=True) as txn:
        view = BlockTxn(txn, dbs)
        for key in keys:
            if key in out or txn.get(meta_key(key), db=dbs.records) is None:
                continue
            for node in view.subtree(key):
                meta = view.meta(node)
                if meta is not None:
                    out[node] = meta.depth
    return [(depth, key) for key, depth in out.items()]


def remove_deepest_first(write: WriteTxn, damage: DamagedBlocks, blocks: list[tuple[int, bytes]]) -> int:
    """Remove `blocks` (and anything stored below them), deepest first, in durable chunks; how many went.

    Raises:
        DataLoss: a block to remove is on a damaged page (`kvstore check --repair` removes it).
    """
    order = [key for _, key in sorted(blocks, key=lambda b: -b[0])]
    removed = 0
    for start in range(0, len(order), PURGE_CHUNK):
        chunk = order[start:start + PURGE_CHUNK]
        removed += damage.retry(lambda chunk=chunk: _remove(write, chunk), "this purge")  # type: ignore[misc]
    return removed


def _remove(write: WriteTxn, keys: list[bytes]) -> int:
    removed = 0
    with write() as w:
        for key in keys:
            if w.meta(key) is None:
                continue
            for victim in reversed(w.subtree(key)):
                w.delete(victim, carry_up=False)
                removed += 1
    return removed


def drop_corrupt(write: WriteTxn, damage: DamagedBlocks, keys: Sequence[bytes], count_damaged: Callable[[], None],
                 data_dir: object) -> None:
    """Remove corrupt blocks and their descendants (R10); count each.

    A block whose removal meets a damaged page stays (with its subtree, so
    R6 holds) and is remembered as damaged: reads miss it, eviction skips it.
    """
    todo = list(dict.fromkeys(keys))
    for _ in range(MAX_DAMAGED_PER_CALL):
        current: list[bytes] = []
        try:
            dropped = _drop_all(write, todo, current)
        except DamagedBlock as exc:
            damage.note(exc.key, exc.cause)
            for key in current:
                damage.note(key, exc.cause)
            todo = [k for k in todo if k not in current]
            continue
        except lmdb.Error as exc:
            log.error("could not drop corrupt blocks from %s: %s", data_dir, exc)
            return
        for key in dropped:
            if not damage.forget(key):  # else counted when it was found damaged
                count_damaged()
        return


def _drop_all(write: WriteTxn, keys: list[bytes], current: list[bytes]) -> list[bytes]:
    dropped: list[bytes] = []
    with write() as w:
        for key in keys:
            current[:] = [key]
            if w.meta(key) is None:
                continue
            for victim in reversed(w.subtree(key)):
                w.delete(victim, carry_up=False)
            dropped.append(key)
    return dropped
