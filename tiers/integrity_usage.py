"""The usage records per geometry and per tenant, as `kvstore check` finds and a repair rewrites them (R14, R17, R33).

Beside the store's totals (`usage`), the `state` database keeps the totals of each geometry (`usage/` +
fingerprint: blocks, bytes) and each tenant (`ns/` + namespace id: blocks, bytes, block-seconds, as-of time,
name; tiers/namespaces.py). A check counts what the block records hold per geometry and per tenant and
reports `layout-usage-mismatch` / `namespace-usage-mismatch` where the records say otherwise; a repair writes
what the blocks it keeps hold, in the same transaction as its other changes (in place or into the rebuilt
file), so per-tenant usage matches what is stored whatever the store's size (the recount at open, R17, only
runs on stores small enough for the start-time page check). A tenant's record keeps its token-hours (its
block-seconds are integrated up to the retention clock's high-water mark first: history, not a count); a
tenant with blocks but no record gets the block-seconds its blocks have been stored for, as at open. The
pinned bytes per tenant are the pins' own `n` records, recounted by `tiers/integrity_dbs.py` (R30).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstore.native.records import BlockMeta
from tiers.integrity_report import CheckReport
from tiers.namespaces import NAMESPACE_PREFIX, NamespaceTotals
from tiers.retention import HIGH_WATER, HIGH_WATER_KEY
from tiers.usage import _USAGE, LAYOUT_USAGE_PREFIX, NamespaceCount, Usage

_FINGERPRINT_BYTES = 8
_NAMESPACE_END = _FINGERPRINT_BYTES + 8


@dataclass
class Counted:
    """Blocks and bytes per geometry fingerprint and per namespace id, counted from block records."""

    layouts: dict[bytes, Usage] = field(default_factory=dict)
    namespaces: dict[bytes, NamespaceCount] = field(default_factory=dict)


def count(metas: Mapping[bytes, BlockMeta]) -> Counted:
    """What `metas` (storage key -> meta record) hold per geometry and per tenant."""
    out = Counted()
    for key, meta in metas.items():
        layout = out.layouts.setdefault(key[:_FINGERPRINT_BYTES], Usage())
        layout.blocks += 1
        layout.stored_bytes += meta.size_bytes
        ns = out.namespaces.setdefault(key[_FINGERPRINT_BYTES:_NAMESPACE_END], NamespaceCount())
        ns.blocks += 1
        ns.stored_bytes += meta.size_bytes
        ns.created_sum_s += meta.created_s
    return out


def _recorded(state: Mapping[bytes, bytes]) -> tuple[dict[bytes, Usage], dict[bytes, NamespaceTotals | None]]:
    """The state's per-geometry and per-tenant records (a tenant record too short to parse: None)."""
    layouts: dict[bytes, Usage] = {}
    tenants: dict[bytes, NamespaceTotals | None] = {}
    for key, value in state.items():
        if key.startswith(LAYOUT_USAGE_PREFIX) and len(value) == _USAGE.size:
            blocks, stored = _USAGE.unpack(value)
            layouts[key[len(LAYOUT_USAGE_PREFIX):]] = Usage(blocks=blocks, stored_bytes=stored)
        elif key.startswith(LAYOUT_USAGE_PREFIX):
            layouts[key[len(LAYOUT_USAGE_PREFIX):]] = Usage(blocks=-1, stored_bytes=-1)  # unparseable: differs
        elif key.startswith(NAMESPACE_PREFIX):
            tenants[key[len(NAMESPACE_PREFIX):]] = NamespaceTotals.unpack(value)
    return layouts, tenants


def check(state: Mapping[bytes, bytes], present: Mapping[bytes, BlockMeta], report: CheckReport) -> None:
    """Report each geometry's and tenant's usage record that differs from what the block records hold."""
    counted = count(present)
    layouts, tenants = _recorded(state)
    for fp in sorted(layouts.keys() | counted.layouts.keys()):
        got, want = layouts.get(fp, Usage()), counted.layouts.get(fp, Usage())
        if (got.blocks, got.stored_bytes) != (want.blocks, want.stored_bytes):
            report.add("layout-usage-mismatch", f"geometry {fp.hex()}: its usage record says "
                       f"{(got.blocks, got.stored_bytes)} (blocks, bytes); the records hold "
                       f"{(want.blocks, want.stored_bytes)}")
    for ns_id in sorted(tenants.keys() | counted.namespaces.keys()):
        rec, c = tenants.get(ns_id), counted.namespaces.get(ns_id, NamespaceCount())
        said = "no record" if ns_id not in tenants else ("a damaged record" if rec is None
                                                         else f"{(rec.blocks, rec.stored_bytes)} (blocks, bytes)")
        if rec is None:
            differs = ns_id in tenants or c.blocks > 0
        else:
            differs = (rec.blocks, rec.stored_bytes) != (c.blocks, c.stored_bytes)
        if differs:
            name = f" ({rec.name})" if rec is not None and rec.name else ""
            report.add("namespace-usage-mismatch", f"tenant {ns_id.hex()}{name}: its usage record says {said}; "
                       f"the records hold {(c.blocks, c.stored_bytes)}")


def rewrites(state: Mapping[bytes, bytes], kept: Mapping[bytes, BlockMeta]) -> tuple[list[bytes], dict[bytes, bytes]]:
    """The state records a repair deletes and writes so each geometry's and tenant's usage is what the `kept`
    blocks hold: (keys to delete, key -> value to put)."""
    counted = count(kept)
    layouts, tenants = _recorded(state)
    raw_clock = state.get(HIGH_WATER_KEY)
    now = HIGH_WATER.unpack(raw_clock)[0] if raw_clock is not None and len(raw_clock) == HIGH_WATER.size else max(
        (m.last_access_s for m in kept.values()), default=0.0)
    deletes = [LAYOUT_USAGE_PREFIX + fp for fp in layouts if fp not in counted.layouts]
    puts: dict[bytes, bytes] = {}
    for fp, u in counted.layouts.items():
        got = layouts.get(fp)
        if got is None or (got.blocks, got.stored_bytes) != (u.blocks, u.stored_bytes):
            puts[LAYOUT_USAGE_PREFIX + fp] = _USAGE.pack(u.blocks, u.stored_bytes)
    for ns_id in tenants.keys() | counted.namespaces.keys():
        rec, c = tenants.get(ns_id), counted.namespaces.get(ns_id, NamespaceCount())
        if rec is None:  # none, or damaged: its blocks' stored time, as the recount at open gives (R17)
            if not c.blocks and ns_id not in tenants:
                continue
            rec = NamespaceTotals(block_seconds=max(c.blocks * now - c.created_sum_s, 0.0), as_of_s=now)
        elif (rec.blocks, rec.stored_bytes) == (c.blocks, c.stored_bytes):
            continue
        else:
            rec.advance(now)  # the token-hours up to now were the old count's: kept
        rec.blocks, rec.stored_bytes = c.blocks, c.stored_bytes
        puts[NAMESPACE_PREFIX + ns_id] = rec.pack()
    return deletes, puts
