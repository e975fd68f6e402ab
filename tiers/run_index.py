"""Which runs of which chains a fleet node holds: the run index, and a run's blocks (docs/FLEET.md F16-F19).

A fleet places each run of `run_blocks` contiguous blocks of a chain on its own
nodes, keyed by the run's first block (kvstore/fleet/placement.py). A node that
must re-replicate after another node's loss has to know which runs it holds, so
a fleet node's store keeps one entry per run in the `runs` database: the storage
key of the run's first block -> that block's index in its chain. The entry is
written in the same write transaction as the block (`tiers.block_txn.BlockTxn.insert`)
and deleted with it (`BlockTxn.delete`: eviction, purge and the drop of a corrupt
block all go through it), so the index names exactly the run roots stored (F16).
A single node keeps no entries: the index is on while the store records its
`run_blocks` (`enable`, called by the server when `[fleet]` is on).

A run's other blocks are not listed: they are the run root's descendants down to
the run's end, found through the records' child entries (`members`). Chains that
share a run's first block and branch inside the run are one run with several
branches, and every branch is found. Blocks evicted from the middle of a run take
their descendants with them (leaves go first, R6), so what `members` finds is
always what is stored.

All functions here block (run them on the tier's executor).
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import lmdb

from kvstore.native.records import CHILD_TAG, META_TAG, BlockMeta, meta_key
from kvstore.prefix import HASH_BYTES, KEY_BYTES
from tiers import namespaces, pins

#: The run index's LMDB database: run root's storage key -> its index in its chain (u32).
RUNS_DB = b"runs"
#: In the `state` database: the run_blocks the index is kept for (absent: no index, a single node).
RUN_BLOCKS_KEY = b"fleet-run-blocks"
_U32 = struct.Struct("<I")
#: Bytes of a run's digest: the XOR of its blocks' hashes' first bytes.
DIGEST_BYTES = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class RunEntry:
    """One run a node holds: its first block's storage key and that block's index in the chain."""

    key: bytes
    first_block: int

    @property
    def run_key(self) -> bytes:
        """What placement hashes: the first block's chain hash."""
        return self.key[KEY_BYTES - HASH_BYTES:]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunBlock:
    """A stored block of a run, as its meta record says."""

    key: bytes
    meta: BlockMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class RunDigest:
    """What a node holds of a run, in a few bytes: equal digests mean (all but surely) the same blocks
    and the same live pins on them (`pins`: (chain hash, pin's time), by hash; docs/RETENTION.md R32)."""

    blocks: int
    size_bytes: int
    digest: bytes
    pins: tuple[tuple[bytes, float], ...] = ()

    @classmethod
    def of(cls, blocks: Sequence[RunBlock], pins: dict[bytes, float] | None = None) -> RunDigest:
        """The digest of a set of blocks (order does not matter), and of the live pins on them (storage key ->
        the pin's time)."""
        acc = 0
        for b in blocks:
            acc ^= int.from_bytes(b.key[KEY_BYTES - HASH_BYTES:KEY_BYTES - HASH_BYTES + DIGEST_BYTES], "little")
        return cls(blocks=len(blocks), size_bytes=sum(b.meta.size_bytes for b in blocks),
                   digest=acc.to_bytes(DIGEST_BYTES, "little"),
                   pins=tuple(sorted((k[KEY_BYTES - HASH_BYTES:], u) for k, u in (pins or {}).items())))

    def same_blocks(self, other: RunDigest) -> bool:
        """Whether `other` counts the same blocks (its pins aside)."""
        return (self.blocks, self.size_bytes, self.digest) == (other.blocks, other.size_bytes, other.digest)

    def pin_of(self, hash_: bytes) -> float:
        """The time of the live pin on the block `hash_` (0: none)."""
        for h, until in self.pins:
            if h == hash_:
                return until
        return 0.0


def run_blocks_of(txn: lmdb.Transaction, state: lmdb._Database) -> int:
    """The run_blocks the store keeps its run index for, 0 when it keeps none (a single node)."""
    raw = txn.get(RUN_BLOCKS_KEY, db=state)
    return _U32.unpack(raw)[0] if raw is not None and len(raw) == _U32.size else 0


def is_run_root(depth: int, run_blocks: int) -> bool:
    """Whether the block at `depth` (1 = a chain's first block) starts a run."""
    return (depth - 1) % run_blocks == 0


def note_insert(txn: lmdb.Transaction, runs: lmdb._Database, key: bytes, depth: int, run_blocks: int) -> None:
    """Index a stored block when it starts a run (inside the write transaction that stores it)."""
    if is_run_root(depth, run_blocks):
        txn.put(key, _U32.pack(depth - 1), db=runs)


def note_delete(txn: lmdb.Transaction, runs: lmdb._Database, key: bytes, depth: int, run_blocks: int) -> None:
    """Forget a run whose first block is deleted (inside the write transaction that deletes it)."""
    if is_run_root(depth, run_blocks):
        txn.delete(key, db=runs)


def enable(env: lmdb.Environment, run_blocks: int) -> int:
    """Keep the run index for `run_blocks` from now on; build it from the records when it is not
    kept for that size (a single node's store joining a fleet, a store rebuilt by `kvstore check
    --repair`). Returns the runs indexed by the rebuild (0 when the index was kept already).

    One write transaction; the rebuild reads every meta record once.
    """
    with env.begin(write=True) as txn:
        state, runs, records = (env.open_db(name, txn=txn) for name in (b"state", RUNS_DB, b"records"))
        kept = run_blocks_of(txn, state) == run_blocks
        if kept and (txn.stat(runs)["entries"] or not txn.stat(records)["entries"]):
            return 0
        txn.drop(runs, delete=False)
        found = 0
        for raw_key, raw in txn.cursor(db=records):
            if len(raw_key) != KEY_BYTES + 1 or raw_key[-1:] != META_TAG:
                continue
            try:
                meta = BlockMeta.unpack(raw)
            except Exception:  # a damaged record: kvstore check names it; the index skips it
                continue
            if is_run_root(meta.depth, run_blocks):
                txn.put(raw_key[:KEY_BYTES], _U32.pack(meta.depth - 1), db=runs)
                found += 1
        txn.put(RUN_BLOCKS_KEY, _U32.pack(run_blocks), db=state)
    return found


def list_runs(env: lmdb.Environment) -> list[RunEntry]:
    """Every run the store holds (its first block stored), in key order."""
    with env.begin() as txn:
        runs = env.open_db(RUNS_DB, txn=txn)
        return [RunEntry(key=bytes(k), first_block=_U32.unpack(v)[0]) for k, v in txn.cursor(db=runs)]


def members(env: lmdb.Environment, root: bytes, run_blocks: int) -> list[RunBlock]:
    """The stored blocks of the run starting at `root`, parents before children ([] when the root
    is not stored): the root's descendants whose chain index is inside the run."""
    with env.begin() as txn:
        records = env.open_db(b"records", txn=txn)
        return _members(txn, records, root, run_blocks)


def _members(txn: lmdb.Transaction, records: lmdb._Database, root: bytes, run_blocks: int) -> list[RunBlock]:
    # A pass walks every block it holds (F18), beside its copies and under their GIL: one cursor stepped with next()
    # (a chain's block most often has one child), no iterator or key conversions per block; each record read once.
    get = txn.get
    raw = get(root + META_TAG, db=records)
    if raw is None:
        return []
    top = BlockMeta.unpack(raw)
    last_depth = top.depth + run_blocks - 1 - (top.depth - 1) % run_blocks
    scope = root[:KEY_BYTES - HASH_BYTES]
    out: list[RunBlock] = []
    todo = deque([(root, top)])
    cursor = txn.cursor(db=records)
    while todo:
        key, meta = todo.popleft()
        out.append(RunBlock(key=key, meta=meta))
        if meta.depth >= last_depth:
            continue  # its children start the next run
        prefix = key + CHILD_TAG
        cut = len(prefix)
        found = cursor.set_range(prefix)
        while found:
            entry = cursor.key()
            if entry[:cut] != prefix:
                break
            child = scope + entry[cut:]
            child_raw = get(child + META_TAG, db=records)
            if child_raw is not None:
                todo.append((child, BlockMeta.unpack(child_raw)))
            found = cursor.next()
    return out


def digests(env: lmdb.Environment, roots: Sequence[bytes], run_blocks: int, *, since_s: float = 0.0,
            now_s: float | None = None, retention_of: Callable[[bytes], float] | None = None) -> list[RunDigest]:
    """The digest of what the store holds of each run (by its root's key), counting only blocks last
    used at or after `since_s` (the retention window's start), and with `now_s`, those a live pin keeps
    too, each run's window its tenant's with `retention_of` (`in_window`)."""
    if now_s is not None:
        return [RunDigest.of(blocks, held) for blocks, held in
                in_window_pins(env, roots, run_blocks, since_s=since_s, now_s=now_s, retention_of=retention_of)]
    with env.begin() as txn:
        records = env.open_db(b"records", txn=txn)
        return [RunDigest.of([b for b in _members(txn, records, root, run_blocks) if b.meta.last_access_s >= since_s])
                for root in roots]


def in_window(env: lmdb.Environment, roots: Sequence[bytes], run_blocks: int, *, since_s: float,
              now_s: float, retention_of: Callable[[bytes], float] | None = None) -> list[list[RunBlock]]:
    """Each run's blocks that re-replication copies and counts (docs/FLEET.md F19, docs/RETENTION.md R31): those
    last used at or after `since_s`, and, whatever their last use, each block a live pin holds at `now_s` with its
    ancestors in the run (R6: a pin keeps its prefix), so a pinned prefix is copied until its pin's time.

    With `retention_of` (storage key -> its tenant's retention seconds), a run's window is its tenant's instead:
    blocks last used at or after `now_s` less that (F19: what the store keeps of the tenant, it copies)."""
    return [blocks for blocks, _ in in_window_pins(env, roots, run_blocks, since_s=since_s, now_s=now_s,
                                                   retention_of=retention_of)]


def in_window_pins(env: lmdb.Environment, roots: Sequence[bytes], run_blocks: int, *, since_s: float,
                   now_s: float, retention_of: Callable[[bytes], float] | None = None
                   ) -> list[tuple[list[RunBlock], dict[bytes, float]]]:
    """`in_window`, each run with the live pins on its blocks (storage key -> the pin's time): what a replica's
    digest counts of its pins (docs/RETENTION.md R32), so one that lacks a pin its run's other copy holds is found."""
    start_of = _window_starts(since_s, now_s, retention_of)
    with env.begin() as txn:
        records, pins_db = env.open_db(b"records", txn=txn), env.open_db(pins.PINS_DB, txn=txn)
        pinning: dict[bytes, bool] = {}  # namespace id -> whether it holds pins here (one read per tenant)

        def holds_pins(ns: bytes) -> bool:
            if ns not in pinning:
                pinning[ns] = bool(pins.totals(txn, pins_db, ns).pins)
            return pinning[ns]

        return [_in_window(txn, pins_db, _members(txn, records, root, run_blocks), start_of(root), now_s, holds_pins)
                for root in roots]


def _window_starts(since_s: float, now_s: float,
                   retention_of: Callable[[bytes], float] | None) -> Callable[[bytes], float]:
    """run root's key -> the start of its window: `since_s` for every run, or with `retention_of` `now_s` less its
    tenant's retention (asked once per namespace: a run's blocks are all its tenant's)."""
    if retention_of is None:
        return lambda root: since_s
    starts: dict[bytes, float] = {}

    def start_of(root: bytes) -> float:
        ns = namespaces.id_of_key(root)
        if ns not in starts:
            starts[ns] = now_s - retention_of(root)
        return starts[ns]

    return start_of


def _in_window(txn: lmdb.Transaction, pins_db: lmdb._Database, blocks: list[RunBlock], since_s: float,
               now_s: float, holds_pins: Callable[[bytes], bool]) -> tuple[list[RunBlock], dict[bytes, float]]:
    # No read per block when the run's tenant holds no pins on this node (the usual case); else one per block.
    if not blocks or not holds_pins(namespaces.id_of_key(blocks[0].key)):
        return [b for b in blocks if b.meta.last_access_s >= since_s], {}
    by_key = {b.key: b for b in blocks}
    kept: set[bytes] = set()
    live: dict[bytes, float] = {}
    for b in blocks:
        pin = pins.read_pin(txn, pins_db, b.key)
        if pin is None or pin.until_s <= now_s:
            continue
        live[b.key] = pin.until_s
        key: bytes | None = b.key
        while key is not None and key not in kept:  # the pinned block and its ancestors inside the run
            kept.add(key)
            up = by_key[key]
            parent = key[:KEY_BYTES - HASH_BYTES] + up.meta.parent_hash
            key = parent if parent in by_key else None
    return [b for b in blocks if b.meta.last_access_s >= since_s or b.key in kept], live


def held(env: lmdb.Environment, keys: Iterable[bytes]) -> list[bool]:
    """Whether each block is stored."""
    with env.begin() as txn:
        records = env.open_db(b"records", txn=txn)
        return [txn.get(meta_key(k), db=records) is not None for k in keys]


def namespace_names(env: lmdb.Environment) -> dict[bytes, str]:
    """Namespace id -> name of every namespace the store knows by name (copies carry the name)."""
    with env.begin() as txn:
        return namespaces.names(txn, env.open_db(b"state", txn=txn))
