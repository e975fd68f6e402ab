"""What a simulation measured, as text (a summary, a table of a sweep, bar charts) and as JSON."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.trace.simulate import UNLIMITED, SimResult, Tally, TenantResult

_BAR = 40


def _tb(n: float) -> str:
    return f"{n / 1e12:.3f} TB" if n >= 1e11 else f"{n / 1e9:.2f} GB"


def _capacity(n: int) -> str:
    return "unlimited" if n >= UNLIMITED else _tb(n)


def tally_dict(t: Tally) -> dict[str, Any]:
    """A tally's counts and rates."""
    out: dict[str, Any] = {name: getattr(t, name) for name in t.__dataclass_fields__}
    out.update(lookup_hit_rate=round(t.lookup_hit_rate, 6), usable_hit_rate=round(t.usable_hit_rate, 6))
    return out


def tenant_dict(t: TenantResult) -> dict[str, Any]:
    """One tenant's policy, counts and bytes."""
    return {"policy": t.policy.to_dict(), **tally_dict(t.tally), "stored_bytes": t.stored_bytes,
            "peak_stored_bytes": t.peak_stored_bytes, "retained_bytes": t.retained_bytes,
            "peak_retained_bytes": t.peak_retained_bytes, "own_evicted_blocks": t.evicted_blocks,
            "own_evicted_bytes": t.evicted_bytes}


def result_dict(r: SimResult, *, buckets: bool = True) -> dict[str, Any]:
    """Everything a run measured, JSON-ready."""
    s = r.settings
    reads = list(r.node_reads.values())
    nbytes = list(r.node_bytes.values())
    out: dict[str, Any] = {
        "trace": r.trace, "sessions": r.sessions,
        "settings": {"capacity_bytes": None if s.capacity_bytes >= UNLIMITED else s.capacity_bytes,
                     "retention_hours": s.retention_hours, "swa_ttl_s": s.swa_ttl_s, "nodes": s.nodes,
                     "replication": s.replication, "run_blocks": s.run_blocks, "block_tokens": s.block_tokens,
                     "geometry": s.geometry.name, "bucket_s": s.bucket_s},
        "total": tally_dict(r.total),
        "peak_stored_bytes": r.peak_stored_bytes, "peak_retained_bytes": r.peak_retained_bytes,
        "peak_swa_bytes": r.peak_swa_bytes, "node_bytes": r.node_bytes, "node_reads": r.node_reads,
        "peak_retained_by_hours": {f"{h:g}": n for h, n in r.peak_retained_by_hours.items()},
        "peak_retained_by_policy_bytes": r.peak_retained_by_policy_bytes,
        "node_bytes_balance": round(max(nbytes) / (sum(nbytes) / len(nbytes)), 4) if sum(nbytes) else None,
        "node_reads_balance": round(max(reads) / (sum(reads) / len(reads)), 4) if sum(reads) else None,
        "sessions_past_retention": r.sessions_past_retention,
        "gpu_s": round(r.gpu_s, 3), "gpu_s_without_store": round(r.gpu_s_without_store, 3),
        "wall_s": round(r.wall_s, 3),
        "tenants": {name: tenant_dict(t) for name, t in r.tenants.items()},
    }
    if buckets:
        out["buckets"] = [{"start_s": b.start_s, **tally_dict(b.tally), "stored_bytes": b.stored_bytes,
                           "retained_bytes": b.retained_bytes, "swa_bytes": b.swa_bytes,
                           **({"tenant_bytes": b.tenant_bytes,
                               "tenant_retained_bytes": b.tenant_retained_bytes} if b.tenant_bytes else {})}
                          for b in r.buckets]
    return out


def bar(value: float, top: float, width: int = _BAR) -> str:
    """A text bar of `value` against `top`."""
    n = 0 if top <= 0 else round(width * min(value / top, 1.0))
    return "#" * n + "." * (width - n)


def summary(r: SimResult) -> list[str]:
    """A run in words and numbers."""
    t, s = r.total, r.settings
    d = result_dict(r, buckets=False)
    lines = [
        f"trace {r.trace}: {t.requests:,} requests, {r.sessions:,} sessions, {t.prompt_tokens:,} prompt tokens "
        f"(simulated in {r.wall_s:.1f} s)",
        f"settings: capacity {_capacity(s.capacity_bytes)} per node, retention {s.retention_hours:g} h, "
        f"SWA TTL {s.swa_ttl_s:g} s, {s.nodes} node(s), replication {s.replication}",
        f"hit rate (tokens): lookup {t.lookup_hit_rate:.1%}, usable {t.usable_hit_rate:.1%}",
        f"resumes (found > one window): {t.resumes:,}; from a snapshot {t.snapshot_resumes:,}, "
        f"by replay {t.replay_resumes:,}"
        + (f" ({t.replay_resumes / t.resumes:.1%} replayed)" if t.resumes else ""),
        f"prefill tokens saved {t.usable_tokens:,}; replayed {t.replay_tokens:,}; computed {t.prefill_tokens:,}",
        f"GPU: {r.gpu_s:,.0f} s of prefill and replay, against {r.gpu_s_without_store:,.0f} s without the store",
        f"NVMe: peak stored {_tb(r.peak_stored_bytes)}, peak within retention {_tb(r.peak_retained_bytes)} ("
        + ", ".join(f"{h:g} h: {_tb(n)}" for h, n in r.peak_retained_by_hours.items()) + ")"
        + (f"; each tenant within its own retention: {_tb(r.peak_retained_by_policy_bytes)}" if r.tenants else ""),
        f"evicted {t.evicted_blocks:,} blocks ({_tb(t.evicted_bytes)}), {t.evicted_inside_retention:,} inside the "
        f"retention, {t.evicted_inside_longer:,} inside {max((*s.also_retention_hours, s.retention_hours)):g} h; "
        f"Puts refused {t.refused_puts:,} ({t.refused_blocks:,} blocks not stored)",
        f"DRAM for SWA at the TTL: peak {_tb(r.peak_swa_bytes)}",
        f"sessions outliving {s.retention_hours:g} h: {r.sessions_past_retention:,} of {r.sessions:,}",
    ]
    if r.tenants:
        lines.append(f"{'tenant':<16} {'retention':>9} {'SWA TTL':>8} {'NVMe quota':>11} {'requests':>9} "
                     f"{'lookup':>7} {'usable':>7} {'stored':>11} {'retained':>11} {'evicted':>9} {'refused':>8} "
                     f"{'SWA refused':>11}")
        for name, tr in r.tenants.items():
            p, tt = tr.policy, tr.tally
            quota = _tb(p.nvme_quota_bytes) if p.nvme_quota_bytes else "none"
            lines.append(f"{name:<16} {p.retention_hours:>8g}h {p.swa_ttl_s:>7g}s {quota:>11} {tt.requests:>9,} "
                         f"{tt.lookup_hit_rate:7.1%} {tt.usable_hit_rate:7.1%} {_tb(tr.stored_bytes):>11} "
                         f"{_tb(tr.peak_retained_bytes):>11} {tr.evicted_blocks:>9,} {tt.refused_puts:>8,} "
                         f"{tt.swa_refused:>11,}")
    if s.nodes > 1:
        lines.append(f"per node: bytes max/mean {d['node_bytes_balance']}, reads max/mean {d['node_reads_balance']}")
        for name in r.node_bytes:
            lines.append(f"  {name:>8} {_tb(r.node_bytes[name]):>11} {r.node_reads[name]:>12,} blocks read")
    return lines


def over_time(r: SimResult, *, rows: int = 24) -> list[str]:
    """Usable hit rate and stored bytes per bucket, as bars (at most `rows`, merged evenly)."""
    buckets = r.buckets
    step = max(1, -(-len(buckets) // rows))
    top = max((b.stored_bytes for b in buckets), default=0)
    lines = [f"{'from h':>7} {'usable':>7} {'':{_BAR}}  stored"]
    for i in range(0, len(buckets), step):
        part = buckets[i:i + step]
        t = Tally()
        for b in part:
            t.add(b.tally)
        stored = part[-1].stored_bytes
        lines.append(f"{part[0].start_s / 3600:7.1f} {t.usable_hit_rate:7.1%} {bar(t.usable_hit_rate, 1.0)}  "
                     f"{_tb(stored)} {bar(stored, top, 20)}")
    return lines


def sweep_table(results: Sequence[tuple[str, SimResult]]) -> list[str]:
    """One row per setting of a sweep, with a bar of its usable hit rate."""
    lines = [f"{'setting':<40} {'lookup':>7} {'usable':>7} {'replayed':>9} {'refused':>8} {'peak NVMe':>11} "
             f"{'SWA DRAM':>10}  usable"]
    for label, r in results:
        t = r.total
        replayed = t.replay_resumes / t.resumes if t.resumes else 0.0
        lines.append(f"{label:<40} {t.lookup_hit_rate:7.1%} {t.usable_hit_rate:7.1%} {replayed:9.1%} "
                     f"{t.refused_puts:8,} {_tb(r.peak_stored_bytes):>11} {_tb(r.peak_swa_bytes):>10}  "
                     f"{bar(t.usable_hit_rate, 1.0)}")
    return lines
