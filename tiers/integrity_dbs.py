"""`kvstore check` beyond the block records: the pins, the fleet's run index and the event log.

The three databases name blocks, so what a repair drops from `records` must go from them too, in
the same write transaction (tiers/integrity_repair.py applies this plan there):

- `pins` (tiers/pins.py, R22-R29): a pin on a block that is not kept goes, through `pins.drop`, and
  every tenant's totals are rewritten from the pins left (its budget is no longer charged for a block
  that is gone, R26, R30). A check reports a pin whose block is not stored (`orphan-pin`), an expiry-order
  entry without its pin or a pin without one (`stale-pin-entry`, `missing-pin-entry`) and totals that
  differ from the pins (`pin-totals-mismatch`).
- `runs` (tiers/run_index.py, docs/FLEET.md F16), kept while the store records its run_blocks: an entry
  per kept run root, none for anything else (`stale-run-entry`: an entry naming a block not stored or
  not a run's first block; `missing-run-entry`: a kept run root without one).
- `events` (tiers/events.py, docs/EVENTS.md): the removals are logged as BlockRemoved batches through
  `EventLog.log` (one per tenant, children before parents), under the node id and topic the log's own
  batches name, so a consumer replaying the log after the restart learns of them (E1, E3, E9). The
  removals are the dropped blocks and every block the log says is stored that the repair does not keep
  (a lost page's blocks, of which the walk found nothing, are known from the log).

A rebuild (some page unreadable) carries the kept blocks' pins, the run index (rebuilt from the kept
blocks) and the log with the removals; what it cannot carry (a database with a damaged page) it names in
the report, one line each (`not_carried`).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lmdb

from kvstore.native.records import BlockMeta
from kvstore.prefix import KEY_BYTES, namespace_id
from tiers import namespaces, pins, run_index
from tiers.block_txn import Change
from tiers.integrity_report import CheckReport
from tiers.integrity_walk import Walk

if TYPE_CHECKING:  # tiers.events imports msgspec: only a store with an event log needs it
    from tiers.events import EventLog

_U32 = struct.Struct("<I")
_TOPIC_LEN = struct.Struct("<H")
#: A repair appends without trimming: the server's next commit trims to its own `replay_batches` (E4).
_NO_TRIM = 1 << 62


@dataclass(kw_only=True)
class DbPlan:
    """What a repair changes in `pins`, `runs` and `events`."""

    #: Storage keys whose pin goes (their block is not kept, or was never stored).
    drop_pins: list[bytes] = field(default_factory=list)
    #: The kept blocks' pins (a rebuild writes them; in place they stay).
    kept_pins: list[pins.Pin] = field(default_factory=list)
    #: Expiry-order entries to remove / add (in place), and the `x` journal records a rebuild carries.
    drop_pin_entries: list[bytes] = field(default_factory=list)
    add_pin_entries: list[bytes] = field(default_factory=list)
    journal: dict[bytes, bytes] = field(default_factory=dict)
    #: The run_blocks the store keeps its index for (0: none kept), and the index a repair leaves.
    run_blocks: int = 0
    runs: dict[bytes, bytes] = field(default_factory=dict)
    #: The removals to log, children before parents, and the log's node id and topic (None: no log to
    #: append to).
    removed: list[bytes] = field(default_factory=list)
    node_id: str | None = None
    topic: str | None = None


def plan_databases(walk: Walk, kept: dict[bytes, BlockMeta], report: CheckReport) -> DbPlan:
    """Check the pins, the run index and the event log against the blocks a repair keeps."""
    plan = DbPlan()
    _plan_pins(walk, kept, report, plan)
    _plan_runs(walk, kept, report, plan)
    dropped = [k for k, b in walk.blocks.items() if k not in kept and (b.meta is not None or b.data_copies)]
    depth = {k: (b.meta.depth if b.meta is not None else 1 << 30) for k, b in walk.blocks.items()}
    announced: list[bytes] = []
    if b"events" in walk.trees:
        try:
            plan.node_id, plan.topic, announced = _read_log(walk.events)
        except ImportError as exc:  # the events' extra is not installed where the check runs
            report.notes.append(f"the store has an event log but {exc.name} is not installed (pip install "
                                "'kvstore[events]'): a repair's removals are not logged")
    # Children before their parents: what the log announced, latest stored first (a child is stored after its
    # parent), then the dropped blocks it never announced (stored before events were on, E5), deepest first.
    gone = [k for k in reversed(announced) if k not in kept]
    plan.removed = gone + sorted(set(dropped) - set(gone), key=lambda k: (-depth[k], k))
    return plan


def _plan_pins(walk: Walk, kept: dict[bytes, BlockMeta], report: CheckReport, plan: DbPlan) -> None:
    all_pins = [p for k, v in walk.pins.items() if (p := pins.decode_pin(k, v)) is not None]
    names = {k[len(namespaces.NAMESPACE_PREFIX):]: rec.name for k, v in walk.state.items()
             if k.startswith(namespaces.NAMESPACE_PREFIX) and (rec := namespaces.NamespaceTotals.unpack(v)) is not None}
    order = {k for k in walk.pins if k.startswith(b"t")}
    expected_order: set[bytes] = set()
    counted: dict[bytes, pins.PinTotals] = {}
    for pin in all_pins:
        ns = pin.key[pins.ID_START:pins.ID_END]
        t = counted.get(ns, pins.PinTotals())
        counted[ns] = pins.PinTotals(pins=t.pins + 1, charged_bytes=t.charged_bytes + pin.charged_bytes)
        order_key = pins.pin_records(pin)[1][0]
        b = walk.blocks.get(pin.key)
        if pin.key in kept:
            plan.kept_pins.append(pin)
            expected_order.add(order_key)
            if order_key not in order:
                plan.add_pin_entries.append(order_key)
                report.add("missing-pin-entry", "its pin has no entry in the expiry order", pin.key)
            continue
        plan.drop_pins.append(pin.key)
        report.dropped_pins.append((names.get(ns) or ns.hex(), pin))
        if b is None or b.meta is None:
            report.add("orphan-pin", f"pins a block that is not stored (until {pin.until_s:.0f}, "
                                     f"{pin.charged_bytes} bytes charged)", pin.key)
    with_pin = {pins.pin_records(p)[1][0] for p in all_pins}
    for entry in sorted(order - expected_order):
        if entry not in with_pin:
            report.add("stale-pin-entry", "an expiry-order entry without its pin", entry[9:])
        plan.drop_pin_entries.append(entry)
    recorded = pins.totals_of(walk.pins)
    if recorded != counted:
        report.add("pin-totals-mismatch", f"the tenants' pin totals say {_sum(recorded)} (pins, bytes); "
                                          f"the pins hold {_sum(counted)}")
    plan.journal = {k: v for k, v in walk.pins.items() if k.startswith(b"x")}
    report.pins_dropped = len(plan.drop_pins)


def _sum(totals: dict[bytes, pins.PinTotals]) -> tuple[int, int]:
    return sum(t.pins for t in totals.values()), sum(t.charged_bytes for t in totals.values())


def _plan_runs(walk: Walk, kept: dict[bytes, BlockMeta], report: CheckReport, plan: DbPlan) -> None:
    raw = walk.state.get(run_index.RUN_BLOCKS_KEY)
    plan.run_blocks = _U32.unpack(raw)[0] if raw is not None and len(raw) == _U32.size else 0
    if not plan.run_blocks:  # no index kept: the server's `run_index.enable` builds one when it joins a fleet
        plan.runs = dict(walk.runs)
        return
    plan.runs = {k: _U32.pack(m.depth - 1) for k, m in kept.items() if run_index.is_run_root(m.depth, plan.run_blocks)}
    for key, value in walk.runs.items():
        if plan.runs.get(key) == value:
            continue
        b = walk.blocks.get(key[:KEY_BYTES])
        if key in plan.runs:
            report.add("stale-run-entry", "names a run root with the wrong chain index", key)
        elif b is None or b.meta is None:
            report.add("stale-run-entry", "names a block that is not stored", key)
        elif not run_index.is_run_root(b.meta.depth, plan.run_blocks):
            report.add("stale-run-entry", f"names a block at depth {b.meta.depth}, not a run's first "
                                          f"({plan.run_blocks} blocks a run)", key)
        report.run_entries_dropped += 1
    for key in plan.runs.keys() - walk.runs.keys():
        report.add("missing-run-entry", "a kept run's first block has no run-index entry", key)


def _read_log(events: list[tuple[bytes, bytes]]) -> tuple[str | None, str | None, list[bytes]]:
    """Replay the log as a consumer does: (the node id and topic its newest batch naming a node gives, the
    storage keys of the blocks it says are stored, in the order they were stored: parents before children).

    The log says what a consumer believes, so it also names the blocks a lost page took with it, of which
    the walk found nothing."""
    from kvstore.events import wire  # msgspec: only when the store has a log

    node = topic = None
    view: dict[bytes, None] = {}
    for _, value in events:
        n = _TOPIC_LEN.unpack_from(value)[0]
        try:
            batch = wire.decode(value[2 + n:])
        except Exception:  # a batch that does not decode tells nothing
            continue
        for event in batch.events:
            if event.kvstore_node:
                node, topic = event.kvstore_node, value[2:2 + n].decode(errors="replace").rstrip("/").rsplit("/", 1)[0]
            if isinstance(event, wire.AllBlocksCleared):
                view.clear()
                continue
            try:
                prefix = bytes.fromhex(event.kvstore_geometry) + namespace_id(event.kvstore_tenant)
            except ValueError:
                continue
            for h in event.block_hashes:
                view.pop(prefix + h, None)
                if isinstance(event, wire.BlockStored):
                    view[prefix + h] = None
    return node, topic, list(view)


class _Removals:
    """What `EventLog.log` needs of a write transaction: the transaction and the tenants' names."""

    def __init__(self, txn: lmdb.Transaction, state: Any) -> None:
        self.txn = txn
        self._names = namespaces.names(txn, state)

    def namespace_name(self, ns_id: bytes) -> str | None:
        return self._names.get(ns_id)


def open_log(env: lmdb.Environment, plan: DbPlan) -> EventLog | None:
    """The store's event log to append the removals to (None when it has no log naming its node), opened
    before the repair's write transaction (opening reads in transactions of its own)."""
    if plan.node_id is None or plan.topic is None or not plan.removed:
        return None
    from tiers.events import EventLog

    return EventLog(env, node_id=plan.node_id, block_tokens=0, topic=plan.topic, keep_batches=_NO_TRIM,
                    now=time.time)


def log_removals(log: EventLog | None, txn: lmdb.Transaction, state: Any, removed: Sequence[bytes]) -> int:
    """Append BlockRemoved batches of `removed` (children first) in `txn`, one per tenant; batches written."""
    if log is None or not removed:
        return 0
    changes = [Change(key=k, parent_hash=None, stored=False) for k in removed]
    return len(log.log(_Removals(txn, state), changes))  # type: ignore[arg-type]


class _PinTxn:
    """What `pins.drop` needs of a write transaction."""

    def __init__(self, txn: lmdb.Transaction, db: Any) -> None:
        self.txn = txn
        self.dbs = self
        self.pins = db

    def meta(self, key: bytes) -> BlockMeta | None:
        return None


def apply_in_place(txn: lmdb.Transaction, dbs: dict[str, Any], plan: DbPlan) -> None:
    """Drop the dropped blocks' pins (totals rewritten) and fix the run index, in the repair's transaction."""
    if "pins" in dbs:
        w = _PinTxn(txn, dbs["pins"])
        for key in plan.drop_pins:
            pins.drop(w, key)  # type: ignore[arg-type]
        for entry in plan.drop_pin_entries:
            txn.delete(entry, db=dbs["pins"])
        for entry in plan.add_pin_entries:
            txn.put(entry, b"", db=dbs["pins"])
        pins.recount(txn, dbs["pins"])
    if "runs" in dbs and plan.run_blocks:
        for key in set(_keys(txn, dbs["runs"])) - plan.runs.keys():
            txn.delete(key, db=dbs["runs"])
        for key, value in plan.runs.items():
            txn.put(key, value, db=dbs["runs"])


def _keys(txn: lmdb.Transaction, db: Any) -> list[bytes]:
    return [bytes(k) for k in txn.cursor(db=db).iternext(keys=True, values=False)]


def write_rebuilt(txn: lmdb.Transaction, fresh: lmdb.Environment, walk: Walk, plan: DbPlan,
                  report: CheckReport) -> bool:
    """Write the kept pins, the run index and the event log into the rebuilt file; whether the log was
    carried (the removals are then appended to it). What cannot be carried goes in `report.not_carried`."""
    damaged = walk.damaged_trees
    if "main" in damaged:
        report.not_carried.append("the main tree had a damaged page: the pins, run index and event log it "
                                  "named, if it named any, could not be reached and are not carried")
    if b"pins" in walk.trees:
        db = fresh.open_db(pins.PINS_DB, txn=txn)
        for pin in plan.kept_pins:
            for key, value in pins.pin_records(pin):
                txn.put(key, value, db=db)
        for key, value in plan.journal.items():
            txn.put(key, value, db=db)
        pins.recount(txn, db)
        if "pins" in damaged:
            report.not_carried.append("pins: the pins on the damaged pages of the pins database are lost "
                                      f"({len(plan.kept_pins)} kept, their tenants' totals recounted)")
    if b"runs" in walk.trees or plan.run_blocks:
        db = fresh.open_db(run_index.RUNS_DB, txn=txn)
        for key, value in plan.runs.items():
            txn.put(key, value, db=db)
        if "runs" in damaged and not plan.run_blocks:
            report.not_carried.append("runs: the run-index entries on damaged pages are lost; the server "
                                      "rebuilds the index when it next joins a fleet")
    if b"events" not in walk.trees:
        return False
    if "events" in damaged:
        report.not_carried.append("events: the event log had a damaged page and is not carried: the next "
                                  "start with events on begins a fresh log with AllBlocksCleared (E5), and a "
                                  f"consumer starts over; {len(plan.removed)} removals are not logged")
        return False
    db = fresh.open_db(b"events", txn=txn)
    for key, value in walk.events:
        txn.put(key, value, db=db)
    if plan.node_id is None and plan.removed:
        report.not_carried.append(f"events: the log names no node, so its {len(plan.removed)} removals are "
                                  "not logged")
    return True


_KNOWN = {b"records", b"lru", b"state", b"pins", b"runs", b"events"}


def unknown_trees(walk: Walk, report: CheckReport) -> None:
    """Name the databases a rebuild does not know and so cannot carry."""
    for name in sorted(walk.trees - _KNOWN):
        report.not_carried.append(f"{name.decode(errors='replace')}: a database check does not know; not carried")
