"""A fleet's Stats as one answer: every node's StatsResponse summed (docs/FLEET.md F53).

A gateway answers KVStore.Stats for the fleet by asking every live node with the
caller's token and merging the answers: counters, bytes and capacities are
summed (every copy counts: two copies of a block are two stored blocks), each
hit window's counts summed per window name, each tenant's per tenant, the chart
per slice start, the stored bytes per geometry; rates over time are recomputed
by the reader from the sums (`kvstore stats`), never averaged. The fields that
are not amounts take the fleet's bound: the longest retention, uptime and write
window, the earliest start and count start, the least headroom and capacity
hours (the node that fills first), a headroom warning when any node warns, and
`store_wide` only when every node answered store-wide. The access trace's counters ([trace]) are
each node's recorder summed, on when any node records (docs/CAPACITY.md "Recording").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstore.v1 import kvstore_pb2 as pb

#: StatsResponse's fields that are not summed, and how the fleet's value is chosen.
_BOUNDS: dict[str, Callable[[Sequence[Any]], Any]] = {
    "retention_hours": max, "uptime_s": max, "write_rate_window_s": max,
    "run_started_at_s": min, "counted_since_s": min, "headroom_hours": min, "capacity_hours": min,
    "headroom_warning": any, "store_wide": all,
}


def _add_scalars(out: Any, replies: Sequence[Any], bounds: dict[str, Callable[[Sequence[Any]], Any]]) -> None:
    for field in out.DESCRIPTOR.fields:
        if field.type in (field.TYPE_MESSAGE, field.TYPE_STRING, field.TYPE_BYTES) or field.is_repeated:
            continue
        values = [getattr(r, field.name) for r in replies]
        choose = bounds.get(field.name)
        setattr(out, field.name, choose(values) if choose is not None else sum(values))


def _windows(groups: Sequence[Sequence[pb.HitWindow]]) -> list[pb.HitWindow]:
    """Windows by name, in the first answer's order: counts summed, the longest seconds."""
    by_name: dict[str, list[pb.HitWindow]] = {}
    for windows in groups:
        for w in windows:
            by_name.setdefault(w.window, []).append(w)
    out = []
    for name, same in by_name.items():
        merged = pb.HitWindow(window=name, seconds=max(w.seconds for w in same))
        _add_scalars(merged.counts, [w.counts for w in same], {})
        out.append(merged)
    return out


def merge_stats(replies: Sequence[pb.StatsResponse]) -> pb.StatsResponse:
    """The fleet's Stats from every node's (see the module's docstring); at least one reply."""
    out = pb.StatsResponse()
    _add_scalars(out, replies, _BOUNDS)
    out.windows.extend(_windows([r.windows for r in replies]))
    traced = [r.trace for r in replies if r.HasField("trace")]
    if traced:  # a tenant's own answer has none: it spans every tenant
        _add_scalars(out.trace, traced, {"enabled": any})
    tenants: dict[str, list[pb.TenantHits]] = {}
    for r in replies:
        for t in r.tenants:
            tenants.setdefault(t.tenant, []).append(t)
    for name, hits in tenants.items():
        merged = pb.TenantHits(tenant=name)
        _add_scalars(merged, hits, {"usage_known": all})
        merged.windows.extend(_windows([t.windows for t in hits]))
        out.tenants.append(merged)
    chart: dict[float, list[pb.HitPoint]] = {}
    for r in replies:
        for p in r.chart:
            chart.setdefault(p.start_s, []).append(p)
    for start in sorted(chart):
        points = chart[start]
        point = pb.HitPoint(start_s=start, seconds=max(p.seconds for p in points))
        _add_scalars(point.counts, [p.counts for p in points], {})
        out.chart.append(point)
    geometries: dict[bytes, list[pb.GeometryUsage]] = {}
    for r in replies:
        for g in r.stored_by_geometry:
            geometries.setdefault(g.fingerprint, []).append(g)
    for fingerprint, stored in geometries.items():
        usage = pb.GeometryUsage(fingerprint=fingerprint, name=stored[0].name)
        _add_scalars(usage, stored, {})
        out.stored_by_geometry.append(usage)
    return out
