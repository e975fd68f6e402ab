"""Per-namespace (tenant) usage of the NVMe tier: blocks, bytes and token-hours stored (R17).

A storage key is `fingerprint (8) | namespace id (8) | chain hash (32)`
(docs/PREFIX_HASHING.md): the namespace id is a hash of the tenant's name, so the
records alone do not say whose a block is by name. Each namespace has one record
in the state db, `ns/` + its id, holding its totals and its name:

    u64 blocks | u64 stored bytes | f64 block-seconds | f64 as-of time | name (UTF-8)

Like the store's totals (R14), the record is read, changed and written inside
each write transaction that stores or removes the namespace's blocks, so an
abort changes nothing. At open, namespaces whose counts differ from the records
are repaired (tiers/usage.py recounts them in the same walk as the totals).

**Token-hours stored** is the integral, over retention-clock time (R13: time the
server ran), of the tokens the namespace has stored: every block counts the
store's `block_tokens`. The record keeps `block-seconds`, the integral of the
block count up to `as-of`; the blocks stored since then are added when it is
read: token_hours = (block_seconds + blocks x (now - as_of)) x block_tokens / 3600.
It only grows, and it survives purges and restarts. A namespace recounted at
open without a record starts from what its stored blocks have been stored for,
sum(now - created); what evicted blocks held before that is unknown. The name
is learned from the first Put (or import) that writes in the namespace after
this version: until then the namespace is known by id only (its retention is
the store's, `tiers/retention.py`).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import lmdb

from kvstore.prefix import FINGERPRINT_BYTES, NAMESPACE_ID_BYTES, namespace_id
from tiers.usage import NamespaceCount, Usage, scan_prefix

log = logging.getLogger(__name__)

#: State-db keys of the namespace records: this prefix and the 8-byte namespace id.
NAMESPACE_PREFIX = b"ns/"
_HEAD = struct.Struct("<QQdd")
#: Where the namespace id sits in a storage key (after the geometry fingerprint).
ID_START = FINGERPRINT_BYTES
ID_END = ID_START + NAMESPACE_ID_BYTES


def id_of_key(key: bytes) -> bytes:
    """The namespace id of a storage key."""
    return key[ID_START:ID_END]


@dataclass(frozen=True, kw_only=True, slots=True)
class NamespaceUsage:
    """What one namespace stores now.

    Attributes:
        blocks: blocks stored.
        stored_bytes: their bytes (block data, as the store's capacity counts them).
        token_hours: the integral of tokens stored over retention-clock time, in
            token-hours (each block counts `block_tokens` tokens).
    """

    blocks: int
    stored_bytes: int
    token_hours: float


@dataclass(kw_only=True, slots=True)
class NamespaceTotals:
    """A namespace record as stored (`block_seconds` integrated up to `as_of_s`)."""

    blocks: int = 0
    stored_bytes: int = 0
    block_seconds: float = 0.0
    as_of_s: float = 0.0
    name: str = ""

    def advance(self, now_s: float) -> None:
        """Integrate the blocks stored since `as_of_s` up to `now_s`."""
        if now_s > self.as_of_s:
            self.block_seconds += self.blocks * (now_s - self.as_of_s)
            self.as_of_s = now_s

    def pack(self) -> bytes:
        return _HEAD.pack(self.blocks, self.stored_bytes, self.block_seconds, self.as_of_s) + self.name.encode()

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> NamespaceTotals | None:
        """The record, or None when it is too short to be one (damaged: it is recounted at open)."""
        raw = bytes(raw)
        if len(raw) < _HEAD.size:
            return None
        blocks, stored, seconds, as_of = _HEAD.unpack_from(raw)
        return cls(blocks=blocks, stored_bytes=stored, block_seconds=seconds, as_of_s=as_of,
                   name=raw[_HEAD.size:].decode(errors="replace"))

    def usage(self, now_s: float, block_tokens: int) -> NamespaceUsage:
        seconds = self.block_seconds + self.blocks * max(now_s - self.as_of_s, 0.0)
        return NamespaceUsage(blocks=self.blocks, stored_bytes=self.stored_bytes,
                              token_hours=seconds * block_tokens / 3600.0)


def read(txn: lmdb.Transaction, state_db: lmdb._Database, ns_id: bytes) -> NamespaceTotals | None:
    """The namespace's record as this transaction sees it; None when it has none."""
    raw = txn.get(NAMESPACE_PREFIX + ns_id, db=state_db)
    return None if raw is None else NamespaceTotals.unpack(raw)


def read_all(txn: lmdb.Transaction, state_db: lmdb._Database) -> dict[bytes, NamespaceTotals]:
    """Every namespace record, by namespace id."""
    out: dict[bytes, NamespaceTotals] = {}
    for ns_id, value in scan_prefix(txn, state_db, NAMESPACE_PREFIX):
        totals = NamespaceTotals.unpack(value)
        if totals is not None:
            out[ns_id] = totals
    return out


def usage_of(txn: lmdb.Transaction, state_db: lmdb._Database, namespace: str, *, now_s: float,
             block_tokens: int) -> NamespaceUsage:
    """`namespace`'s usage now (zeros when it never stored a block)."""
    totals = read(txn, state_db, namespace_id(namespace))
    return (totals or NamespaceTotals()).usage(now_s, block_tokens)


def apply(txn: lmdb.Transaction, state_db: lmdb._Database, deltas: Mapping[bytes, Usage],
          names: Mapping[bytes, str], now_s: float) -> None:
    """Add a write transaction's changes per namespace id to the records, with it; learn names."""
    for ns_id in deltas.keys() | names.keys():
        delta = deltas.get(ns_id, Usage())
        name = names.get(ns_id, "")
        totals = read(txn, state_db, ns_id)
        if totals is None:
            totals = NamespaceTotals(as_of_s=now_s)
        elif not delta.blocks and not delta.stored_bytes and (not name or totals.name):
            continue
        totals.advance(now_s)
        totals.blocks = max(totals.blocks + delta.blocks, 0)
        totals.stored_bytes = max(totals.stored_bytes + delta.stored_bytes, 0)
        totals.name = totals.name or name
        txn.put(NAMESPACE_PREFIX + ns_id, totals.pack(), db=state_db)


def check_and_repair(env: lmdb.Environment, state_db: lmdb._Database, counted: Mapping[bytes, NamespaceCount],
                     now_s: float) -> None:
    """Make the namespace records agree with counts recounted from the records at open.

    A record with the wrong blocks or bytes is corrected (its token-hours kept);
    a namespace without one gets one whose token-hours are what its stored
    blocks have been stored for; a record of a namespace with no blocks left
    drops to zero blocks (kept: its token-hours are history).
    """
    with env.begin() as txn:
        stored = read_all(txn, state_db)
    fixes: dict[bytes, NamespaceTotals] = {}
    for ns_id, count in counted.items():
        totals = stored.get(ns_id)
        if totals is None:
            seconds = max(count.blocks * now_s - count.created_sum_s, 0.0)
            fixes[ns_id] = NamespaceTotals(blocks=count.blocks, stored_bytes=count.stored_bytes,
                                           block_seconds=seconds, as_of_s=now_s)
        elif (totals.blocks, totals.stored_bytes) != (count.blocks, count.stored_bytes):
            totals.advance(now_s)
            totals.blocks, totals.stored_bytes = count.blocks, count.stored_bytes
            fixes[ns_id] = totals
    for ns_id, totals in stored.items():
        if ns_id not in counted and (totals.blocks or totals.stored_bytes):
            totals.advance(now_s)
            totals.blocks = totals.stored_bytes = 0
            fixes[ns_id] = totals
    if not fixes:
        return
    log.info("usage per namespace recounted from the records (%d namespaces repaired)", len(fixes))
    with env.begin(write=True) as txn:
        for ns_id, totals in fixes.items():
            txn.put(NAMESPACE_PREFIX + ns_id, totals.pack(), db=state_db)


def names(txn: lmdb.Transaction, state_db: lmdb._Database) -> dict[bytes, str]:
    """Namespace id -> name, for the namespaces whose name is known."""
    return {ns_id: t.name for ns_id, t in read_all(txn, state_db).items() if t.name}
