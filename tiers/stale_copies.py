"""A copy its node is no longer a replica of, dropped once the run's replicas confirm theirs (docs/FLEET.md F79).

A node a join pushed out of a run's replicas keeps its copy while the new replica fills (F21); once every replica
answers its digest, the old holder asks each to carry its copy's last uses (`raise_uses`, on the replica: F19's
latest use over the copies) and, every block confirmed, removes its copy (`drop_confirmed`) in a write transaction
that first checks, inside it, that no block is leased or pinned here and none was used here since; a round's stale
copies go in one transaction (`drop_confirmed_runs`, F84).

Both block (run them on the tier's executor).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager

import lmdb

from kvstore.native.records import BlockMeta, meta_key
from tiers import pins
from tiers.block_txn import BlockTxn

WriteTxn = Callable[[], AbstractContextManager[BlockTxn]]


def raise_uses(env: lmdb.Environment, write: WriteTxn, uses: Sequence[tuple[bytes, float]], now_s: float
               ) -> list[bool]:
    """F79 (asked by a run's old holder): raise each held block's last use to the one given, never lowering it and
    never past `now_s` (as a copy's, F19), in one durable write transaction (none when nothing is to raise); for
    each, whether the block is held with a last use at least the one given once that is committed."""
    with env.begin() as txn:
        records = env.open_db(b"records", txn=txn)
        metas = [txn.get(meta_key(k), db=records) for k, _ in uses]
        used = [BlockMeta.unpack(raw).last_access_s if raw is not None else None for raw in metas]
    due = [(k, t) for (k, t), u in zip(uses, used, strict=True) if u is not None and u < t <= now_s]
    if due:
        with write() as w:
            for key, t in due:
                w.touch(key, t)  # BlockTxn.touch: nothing if the block went since, or was used later
            used = [m.last_access_s if (m := w.meta(k)) is not None else None for k, _ in uses]
    return [u is not None and u >= t for (_, t), u in zip(uses, used, strict=True)]


def drop_confirmed(write: WriteTxn, root: bytes, *, confirmed: dict[bytes, float], window_start_s: float,
                   leased: Callable[[], Collection[bytes]], now_s: float) -> int:
    """F79: remove the run stored from `root` (its root and every stored block below it, deepest first, through
    `BlockTxn.delete`, so usage, the run index, pins and the events journal follow) when, read inside the write
    transaction, no block of it is leased (`leased`, as eviction's R9) or held by a live pin (R23), and each block's
    last use is at most the one its replicas confirmed for it (`confirmed`: storage key -> last use) or, not
    confirmed, before `window_start_s` (past its retention and R4's minute: eviction could take it). Returns the
    bytes removed; 0 when any of that does not hold (nothing is removed: the copy stays, as before F79)."""
    return drop_confirmed_runs(write, [(root, confirmed, window_start_s)], leased=leased, now_s=now_s)[0]


def drop_confirmed_runs(write: WriteTxn, runs: Sequence[tuple[bytes, dict[bytes, float], float]], *,
                        leased: Callable[[], Collection[bytes]], now_s: float) -> list[int]:
    """F84: `drop_confirmed` for each of `runs` (root, confirmed, window_start_s), one after another in one write
    transaction (one fsync for a round's stale copies, not one each); each run is checked inside it before any of its
    blocks goes, so a run kept writes nothing and keeps none of the others. The bytes removed, per run."""
    try:
        with write() as w:
            dropped = [_drop_one(w, root, confirmed, start, leased, now_s) for root, confirmed, start in runs]
            if not any(dropped):
                raise _Kept  # nothing removed: nothing to commit
            return dropped
    except _Kept:
        return [0] * len(runs)


class _Kept(Exception):
    """Raised inside `drop_confirmed_runs`' write transaction to abort it: every copy stays."""


def _drop_one(w: BlockTxn, root: bytes, confirmed: dict[bytes, float], window_start_s: float,
              leased: Callable[[], Collection[bytes]], now_s: float) -> int:
    """One run of `drop_confirmed_runs` inside its transaction `w`: its checks first, then its blocks; 0 if kept."""
    if w.meta(root) is None:
        return 0  # gone since planned (evicted, dropped, or below a run dropped before it here): nothing to write
    tree = w.subtree(root)
    held, pins_db = set(leased()), w.dbs.pins  # read per run: a lease taken while the ones before went counts
    for key in tree:
        meta = w.meta(key)
        if meta is None or key in held or (pins_db is not None and pins.holds(w.txn, pins_db, key, now_s)):
            return 0
        if meta.last_access_s > confirmed.get(key, -math.inf) and meta.last_access_s >= window_start_s:
            return 0  # used here since its replicas confirmed it (or never confirmed): theirs may be older
    return sum(w.delete(key, carry_up=False, now_s=now_s) for key in reversed(tree))
