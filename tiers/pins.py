"""Pins: a request's ask that a prefix be kept until a given time, beyond its tenant's retention (R22-R27).

docs/RETENTION.md numbers the rules. A pin names one stored block and an expiry; it keeps
that block, and so (R6: eviction takes only blocks without stored children) its whole
prefix, from eviction until then (R23). Pins are records in the tier's `pins` database,
written in the same write transaction as the blocks they protect (a Put's pin commits with
its blocks, R22), the tenant's limits checked inside it (R24): a pin runs at most the
tenant's `max_s` past now and the prefixes it pins count against its byte budget. A pin past
its time protects nothing and its record goes at the next write that sweeps (R25).

Layout of the `pins` database (keys sort so a tenant's pins and the expiry order are ranges):
    b"k" | namespace id (8) | fingerprint (8) | hash (32)  -> until_s f64 | charged bytes u64
    b"t" | until_s (8, big-endian f64: positive times sort as numbers) | storage key (48) -> b""
    b"n" | namespace id (8)                                -> pins u32 | charged bytes u64
    b"x" | until_s (8, as "t") | storage key (48)          -> charged bytes u64
The `x` records are the expired pins a sweep removed, kept until the server has audited each
(`journal`, `forget`; R29): a sweep in any write transaction (a Put's, a pin's) journals what it removed
there, and the record goes only once audited, so an expiry is audited even when the server stops between
the two (at least once: a stop between the audit and `forget` audits it again).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import lmdb

from kvstore.native.records import BlockMeta
from kvstore.prefix import FINGERPRINT_BYTES, KEY_BYTES, NAMESPACE_ID_BYTES


class _Dbs(Protocol):
    @property
    def pins(self) -> Any: ...


class BlockTxn(Protocol):
    """What a pin needs of the tier's write transaction (`tiers.block_txn.BlockTxn` is one): the LMDB
    transaction, the databases, and a block's meta. A Protocol, so block_txn may import this module."""

    @property
    def txn(self) -> lmdb.Transaction: ...

    @property
    def dbs(self) -> _Dbs: ...

    def meta(self, key: bytes) -> BlockMeta | None: ...

ID_START, ID_END = FINGERPRINT_BYTES, FINGERPRINT_BYTES + NAMESPACE_ID_BYTES  # as tiers.namespaces

#: The pins' database in the store's environment.
PINS_DB = b"pins"
#: Expired pins one sweep removes (a sweep runs in a Put's transaction: bounded).
SWEEP_MAX = 256
_PIN = struct.Struct("<dQ")
_TOTALS = struct.Struct("<IQ")
_TIME = struct.Struct(">d")
_CHARGED = struct.Struct("<Q")


@dataclass(frozen=True, kw_only=True, slots=True)
class PinLimits:
    """A tenant's limits on pins (R24).

    Attributes:
        max_s: longest a pin may run past now, in seconds; 0: the tenant may not pin.
        budget_bytes: most bytes of pinned prefixes the tenant may hold at once; 0: none.
    """

    max_s: float = 0.0
    budget_bytes: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PinGrant:
    """What a pin request got: `until_s` (0: no pin) and, when less than asked, why."""

    asked_until_s: float
    until_s: float
    why: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pin:
    """One live pin: its block, its expiry, the bytes it charges its tenant."""

    key: bytes
    until_s: float
    charged_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PinTotals:
    """A tenant's live pins and the bytes they charge its budget."""

    pins: int = 0
    charged_bytes: int = 0


def _pin_key(key: bytes) -> bytes:
    return b"k" + key[ID_START:ID_END] + key[:FINGERPRINT_BYTES] + key[ID_END:]


def _storage_key(pin_key: bytes) -> bytes:
    ns, fp, rest = pin_key[1:9], pin_key[9:17], pin_key[17:]
    return fp + ns + rest


def _time_key(until_s: float, key: bytes) -> bytes:
    return b"t" + _TIME.pack(max(until_s, 0.0)) + key


def _read_totals(txn: lmdb.Transaction, db: Any, ns_id: bytes) -> PinTotals:
    raw = txn.get(b"n" + ns_id, db=db)
    if raw is None:
        return PinTotals()
    count, charged = _TOTALS.unpack(raw)
    return PinTotals(pins=count, charged_bytes=charged)


def _add_totals(txn: lmdb.Transaction, db: Any, ns_id: bytes, pins: int, charged: int) -> None:
    t = _read_totals(txn, db, ns_id)
    count, total = t.pins + pins, t.charged_bytes + charged
    if count <= 0:
        txn.delete(b"n" + ns_id, db=db)
    else:
        txn.put(b"n" + ns_id, _TOTALS.pack(count, max(total, 0)), db=db)


def read_pin(txn: lmdb.Transaction, db: Any, key: bytes) -> Pin | None:
    """The pin on the block `key`, live or not; None when there is none."""
    raw = txn.get(_pin_key(key), db=db)
    if raw is None:
        return None
    until, charged = _PIN.unpack(raw)
    return Pin(key=key, until_s=until, charged_bytes=charged)


def holds(txn: lmdb.Transaction, db: Any, key: bytes, now_s: float) -> bool:
    """Whether a live pin keeps `key` (R23): one read, asked only of blocks eviction would take."""
    raw = txn.get(_pin_key(key), db=db)
    return raw is not None and _PIN.unpack(raw)[0] > now_s


def grant(w: BlockTxn, key: bytes, until_s: float, *, now_s: float, limits: PinLimits) -> PinGrant:
    """Pin the stored block `key` until `until_s`, within `limits`, in `w`'s transaction (R22, R24).

    A pin on a block already pinned keeps the later expiry and charges once. The charge is the
    prefix's bytes (depth x block size: every block of the prefix is kept).
    """
    db = w.dbs.pins
    if until_s <= now_s:
        return PinGrant(asked_until_s=until_s, until_s=0.0, why="the time asked is not in the future")
    if limits.max_s <= 0 or limits.budget_bytes <= 0:
        return PinGrant(asked_until_s=until_s, until_s=0.0,
                        why="this tenant may not pin (its pin_max_hours or pin_budget_bytes is 0)")
    meta = w.meta(key)
    if meta is None:
        return PinGrant(asked_until_s=until_s, until_s=0.0, why="the block is not stored")
    granted = min(until_s, now_s + limits.max_s)
    why = (f"capped at the tenant's longest pin, {limits.max_s / 3600:g} h from now"
           if granted < until_s else "")
    old = read_pin(w.txn, db, key)
    ns_id = key[ID_START:ID_END]
    if old is not None:
        if old.until_s >= granted:
            return PinGrant(asked_until_s=until_s, until_s=old.until_s, why=why)
        w.txn.delete(_time_key(old.until_s, key), db=db)
        charged, new_pins, new_bytes = old.charged_bytes, 0, 0
    else:
        charged = meta.depth * meta.size_bytes
        totals = _read_totals(w.txn, db, ns_id)
        if totals.charged_bytes + charged > limits.budget_bytes:
            return PinGrant(asked_until_s=until_s, until_s=0.0, why=(
                f"over the tenant's pin budget: its pins hold {totals.charged_bytes} bytes, this prefix "
                f"{charged} more, and its pin_budget_bytes is {limits.budget_bytes}"))
        new_pins, new_bytes = 1, charged
    w.txn.put(_pin_key(key), _PIN.pack(granted, charged), db=db)
    w.txn.put(_time_key(granted, key), b"", db=db)
    if new_pins:
        _add_totals(w.txn, db, ns_id, new_pins, new_bytes)
    return PinGrant(asked_until_s=until_s, until_s=granted, why=why)


def drop(w: BlockTxn, key: bytes, *, expired_by: float | None = None) -> Pin | None:
    """Remove the pin on `key` (its block was removed, or an operator dropped it); what it was.

    With `expired_by` (the time now), a pin already past its time that no sweep took yet is journalled as an
    expiry (an `x` record, as `sweep` writes), so it is audited like any other (R29) though its block goes first.
    """
    db = w.dbs.pins
    pin = read_pin(w.txn, db, key)
    if pin is None:
        return None
    w.txn.delete(_pin_key(key), db=db)
    w.txn.delete(_time_key(pin.until_s, key), db=db)
    _add_totals(w.txn, db, key[ID_START:ID_END], -1, -pin.charged_bytes)
    if expired_by is not None and pin.until_s <= expired_by:
        w.txn.put(b"x" + _time_key(pin.until_s, key)[1:], _CHARGED.pack(pin.charged_bytes), db=db)
    return pin


def sweep(w: BlockTxn, now_s: float, limit: int = SWEEP_MAX) -> list[Pin]:
    """Remove up to `limit` pins past their time (R25), soonest first, journalled for the audit (R29);
    the pins removed."""
    cursor = w.txn.cursor(db=w.dbs.pins)
    due: list[bytes] = []
    if cursor.set_range(b"t"):
        for raw in cursor.iternext(keys=True, values=False):
            raw = bytes(raw)
            if not raw.startswith(b"t") or _TIME.unpack_from(raw, 1)[0] > now_s or len(due) >= limit:
                break
            due.append(raw[9:])
    out = []
    for key in due:
        pin = drop(w, key)
        if pin is not None:
            out.append(pin)
            w.txn.put(b"x" + _time_key(pin.until_s, key)[1:], _CHARGED.pack(pin.charged_bytes), db=w.dbs.pins)
    return out


def due(txn: lmdb.Transaction, db: Any, now_s: float) -> bool:
    """Whether a pin is past its time or an expiry waits for its audit (two reads: the first of each order)."""
    cursor = txn.cursor(db=db)
    if cursor.set_range(b"t"):
        key = bytes(cursor.key())
        if key.startswith(b"t") and _TIME.unpack_from(key, 1)[0] <= now_s:
            return True
    return cursor.set_range(b"x") and bytes(cursor.key()).startswith(b"x")


def journal(txn: lmdb.Transaction, db: Any, limit: int = SWEEP_MAX) -> list[Pin]:
    """Up to `limit` journalled expiries not yet audited (R29), soonest first (read only: `forget` them once
    audited, so a crash between the two audits them again rather than never)."""
    cursor = txn.cursor(db=db)
    out: list[Pin] = []
    if cursor.set_range(b"x"):
        for raw_key, raw in cursor.iternext():
            raw_key = bytes(raw_key)
            if not raw_key.startswith(b"x") or len(out) >= limit:
                break
            out.append(Pin(key=raw_key[9:], until_s=_TIME.unpack_from(raw_key, 1)[0],
                           charged_bytes=_CHARGED.unpack(raw)[0]))
    return out


def forget(w: BlockTxn, audited: list[Pin]) -> None:
    """Remove the journal records of expiries now audited."""
    for pin in audited:
        w.txn.delete(b"x" + _time_key(pin.until_s, pin.key)[1:], db=w.dbs.pins)


def tenant_pins(txn: lmdb.Transaction, db: Any, ns_id: bytes, now_s: float) -> Iterator[Pin]:
    """The tenant's live pins (past-time ones not yet swept left out), in key order."""
    prefix = b"k" + ns_id
    cursor = txn.cursor(db=db)
    if not cursor.set_range(prefix):
        return
    for raw_key, raw in cursor.iternext():
        raw_key = bytes(raw_key)
        if not raw_key.startswith(prefix):
            return
        until, charged = _PIN.unpack(raw)
        if until > now_s and len(raw_key) == 1 + KEY_BYTES:
            yield Pin(key=_storage_key(raw_key), until_s=until, charged_bytes=charged)


def totals(txn: lmdb.Transaction, db: Any, ns_id: bytes) -> PinTotals:
    """The tenant's pins as recorded (swept ones gone; one past its time but not yet swept still in)."""
    return _read_totals(txn, db, ns_id)


class Protected(set[bytes]):
    """The keys a Put's room-making must keep: its own and leased ones, plus any block a live pin holds (R23).

    A set, so the Put adds its blocks to it; membership also asks the pins (one read per block
    eviction would take, and only those: blocks within retention never get that far).
    """

    def __init__(self, keys: set[bytes], pinned: Callable[[bytes], bool]) -> None:
        super().__init__(keys)
        self._pinned = pinned

    def __contains__(self, key: object) -> bool:
        return set.__contains__(self, key) or (isinstance(key, bytes) and self._pinned(key))


# -- for `kvstore check --repair` (tiers/integrity_dbs.py): the records as raw entries --------------

def decode_pin(raw_key: bytes, raw: bytes) -> Pin | None:
    """A `k` record of the pins database as its Pin; None when the entry is no well-formed pin record."""
    if len(raw_key) != 1 + KEY_BYTES or not raw_key.startswith(b"k") or len(raw) != _PIN.size:
        return None
    until, charged = _PIN.unpack(raw)
    return Pin(key=_storage_key(raw_key), until_s=until, charged_bytes=charged)


def pin_records(pin: Pin) -> list[tuple[bytes, bytes]]:
    """The (key, value) records a live pin is made of: its `k` record and its expiry-order entry."""
    return [(_pin_key(pin.key), _PIN.pack(pin.until_s, pin.charged_bytes)), (_time_key(pin.until_s, pin.key), b"")]


def totals_of(entries: dict[bytes, bytes]) -> dict[bytes, PinTotals]:
    """The `n` records (namespace id -> totals) among a pins database's raw entries (unparseable ones left out)."""
    return {k[1:]: PinTotals(pins=c, charged_bytes=b) for k, v in entries.items()
            if k.startswith(b"n") and len(k) == 1 + NAMESPACE_ID_BYTES and len(v) == _TOTALS.size
            for c, b in [_TOTALS.unpack(v)]}


def recount(txn: lmdb.Transaction, db: Any) -> dict[bytes, PinTotals]:
    """Rewrite every tenant's totals (`n` records) from its `k` records (a repair dropped pins or found the
    totals wrong); the totals written."""
    counted: dict[bytes, PinTotals] = {}
    recorded: dict[bytes, bytes] = {}
    for raw_key, raw in txn.cursor(db=db):
        raw_key, raw = bytes(raw_key), bytes(raw)
        if raw_key.startswith(b"n"):
            recorded[raw_key] = raw
            continue
        pin = decode_pin(raw_key, raw)
        if pin is not None:
            ns = pin.key[ID_START:ID_END]
            t = counted.get(ns, PinTotals())
            counted[ns] = PinTotals(pins=t.pins + 1, charged_bytes=t.charged_bytes + pin.charged_bytes)
    for raw_key in recorded.keys() - {b"n" + ns for ns in counted}:
        txn.delete(raw_key, db=db)
    for ns, t in counted.items():
        value = _TOTALS.pack(t.pins, t.charged_bytes)
        if recorded.get(b"n" + ns) != value:
            txn.put(b"n" + ns, value, db=db)
    return counted
