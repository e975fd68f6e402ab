"""The store's totals table of `kvstore stats`: counters since the store was created, all tenants
together, with the per-geometry, resume-plan, SWA-pool and transfer sections (moved from kvstore/cli.py,
its lines and --json keys unchanged)."""

from __future__ import annotations

import math


def _rate(found: int, asked: int) -> float | None:
    return found / asked if asked else None


def message_dict(reply: object) -> dict[str, object]:
    """A stats message as a flat dict: 64-bit counters as ints, infinities as None (null in JSON)."""
    from google.protobuf.json_format import MessageToDict

    out: dict[str, object] = MessageToDict(reply, always_print_fields_with_no_presence=True,  # type: ignore[arg-type]
                                           preserving_proto_field_name=True)
    for key, value in list(out.items()):
        if isinstance(value, str) and value.lstrip("-").isdigit():
            out[key] = int(value)
        elif value in ("Infinity", float("inf")):
            out[key] = None  # headroom with no recent writes: unbounded
    return out


def stats_dict(reply: object) -> dict[str, object]:
    """A StatsResponse as a flat dict with the two hit rates added."""
    out = message_dict(reply)
    out["lookup_hit_rate"] = _rate(int(out["lookup_tokens_found"]), int(out["lookup_tokens_asked"]))  # type: ignore[call-overload]
    out["retrieve_hit_rate"] = _rate(int(out["get_tokens_returned"]), int(out["get_tokens_asked"]))  # type: ignore[call-overload]
    # Planners' reports (ReportResume): the hit rate that counts only usable tokens.
    out["resume_usable_hit_rate"] = _rate(int(out["resume_usable_tokens"]), int(out["resume_prompt_tokens"]))  # type: ignore[call-overload]
    out["resume_found_hit_rate"] = _rate(int(out["resume_found_tokens"]), int(out["resume_prompt_tokens"]))  # type: ignore[call-overload]
    # Fingerprints as hex (MessageToDict gives base64), counts as ints.
    out["stored_by_geometry"] = [
        {"fingerprint": g.fingerprint.hex(), "name": g.name or None, "blocks_stored": g.blocks_stored,
         "bytes_stored": g.bytes_stored}
        for g in reply.stored_by_geometry  # type: ignore[attr-defined]
    ]
    # The server's own access trace ([trace]): its recorder's counters, all 0 while it is off.
    t = reply.trace  # type: ignore[attr-defined]
    out["trace"] = {f.name: (bool(getattr(t, f.name)) if f.name == "enabled" else int(getattr(t, f.name)))
                    for f in t.DESCRIPTOR.fields}
    return out


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:,.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


STATS_ROWS = (
    ("Lookups", "lookups"), ("Lookup hit rate (tokens found / asked)", "lookup_hit_rate"),
    ("Retrieve hit rate (tokens returned / asked)", "retrieve_hit_rate"),
    ("Gets", "gets"), ("Puts", "puts"), ("Blocks written", "blocks_written"),
    ("Blocks stored", "blocks_stored"), ("Bytes stored", "bytes_stored"), ("Capacity bytes", "capacity_bytes"),
    ("Bytes free", "bytes_free"), ("Write rate (B/s, recent)", "write_rate_bytes_per_s"),
    ("Headroom (hours at that rate)", "headroom_hours"),
    ("Capacity at that rate (hours)", "capacity_hours"), ("Retention (hours)", "retention_hours"),
    ("Evictions", "evictions"), ("Rejected puts (store full)", "rejected_puts"),
    ("Corrupt blocks", "corrupt_blocks"), ("Active leases", "active_leases"), ("Uptime (s)", "uptime_s"),
)


def print_table(data: dict[str, object], target: str) -> None:
    """The store's totals, then the per-geometry, resume, SWA and transfer sections."""
    width = max(len(label) for label, _ in STATS_ROWS)
    print(f"kvstore at {target}")
    for label, key in STATS_ROWS:
        value = data.get(key)
        if key.endswith("hit_rate") and value is not None:
            print(f"  {label:<{width}}  {value:.1%}")
        elif key in ("headroom_hours", "capacity_hours") and value is None:
            print(f"  {label:<{width}}  unbounded (no writes in the window)")
        else:
            print(f"  {label:<{width}}  {_fmt(value)}")
    _print_by_geometry(data["stored_by_geometry"])  # type: ignore[arg-type]
    _print_section("Resume plans (planner reports)", data, RESUME_ROWS)
    _print_section("SWA pool", data["swa"], SWA_ROWS)  # type: ignore[arg-type]
    _print_section("Transfer", data["transfer"], TRANSFER_ROWS)  # type: ignore[arg-type]
    trace = data.get("trace")
    if isinstance(trace, dict) and trace.get("enabled"):
        _print_section("Trace ([trace]: the server's own access trace)", trace, TRACE_ROWS)
    else:
        print("Trace ([trace]): off")


TRACE_ROWS = (
    ("Records written", "written_records"), ("Records dropped (writer behind, disk failed)", "dropped_records"),
    ("Bytes written (compressed)", "written_bytes"), ("Files written", "files_written"),
    ("Files removed (max_bytes)", "files_removed"), ("Records queued now", "queued_records"),
    ("Bytes on disk now", "bytes_on_disk"),
)


RESUME_ROWS = (
    ("Plans", "resume_plans"), ("Usable hit rate (usable / prompt tokens)", "resume_usable_hit_rate"),
    ("Found hit rate (found / prompt tokens)", "resume_found_hit_rate"), ("Prompt tokens", "resume_prompt_tokens"),
    ("Usable tokens", "resume_usable_tokens"), ("Fetch + snapshot", "resume_fetch_snapshot_plans"),
    ("Bounded replay", "resume_bounded_replay_plans"), ("Exact replay", "resume_exact_replay_plans"),
    ("Full prefill", "resume_full_prefill_plans"),
)


def _print_by_geometry(rows: list[dict[str, object]]) -> None:
    """Blocks stored per geometry; one this server does not serve (an earlier codec's) is named by fingerprint."""
    if not rows:
        return
    print("\nStored by geometry")
    labels = [str(r["name"]) if r["name"] else f"{r['fingerprint']} (not served: ages out)" for r in rows]
    width = max(len(label) for label in labels)
    for label, r in zip(labels, rows, strict=True):
        print(f"  {label:<{width}}  {_fmt(r['blocks_stored'])} block{'' if r['blocks_stored'] == 1 else 's'}, "
              f"{_fmt(r['bytes_stored'])} bytes")


def swa_stats_dict(client: object) -> dict[str, object] | None:
    """The SWA pool's SwaStatsResponse as a flat dict with its hit rate; None if the server has no pool, or is a
    gateway over nodes that each keep their own (F52: no one pool to count)."""
    from kvstore.errors import FailedPrecondition, Internal

    try:
        reply = client.swa.stats()  # type: ignore[attr-defined]
    except (Internal, FailedPrecondition):  # UNIMPLEMENTED: no SwaPool service; a gateway over separate pools
        return None
    out = message_dict(reply)
    out["hit_rate"] = _rate(int(out["hits"]), int(out["snapshots_asked"]))  # type: ignore[call-overload]
    return out


SWA_ROWS = (
    ("Backend", "backend"), ("Backend reachable", "backend_up"), ("TTL (s)", "ttl_s"),
    ("Hit rate (snapshots returned / asked)", "hit_rate"), ("Puts (calls)", "puts"),
    ("Snapshots put", "snapshots_put"), ("Snapshots lost (backend down)", "failed_puts"),
    ("Expirations", "expirations"), ("Evictions", "evictions"), ("Items", "items"),
    ("Bytes in use", "bytes_used"), ("Cap bytes", "cap_bytes"), ("Corrupt (missed)", "corrupt"),
    ("Backend errors", "backend_errors"),
)


def transfer_stats_dict(client: object) -> dict[str, object] | None:
    """The transfer service's TransferStatsResponse as a flat dict; None if the server predates it, or is a
    gateway (F40: transfer sessions are the nodes')."""
    from kvstore.errors import FailedPrecondition, Internal

    try:
        return message_dict(client.transfer_stats())  # type: ignore[attr-defined]
    except (Internal, FailedPrecondition):  # UNIMPLEMENTED: no Transfer.Stats; a gateway serves no Transfer
        return None


TRANSFER_ROWS = (
    ("Copy loop", "copy_loop"), ("Copy threads", "copy_threads"), ("Sessions open", "sessions"),
    ("Regions mapped", "regions"), ("Bytes mapped", "mapped_bytes"),
    ("Descriptors in flight", "descriptors_in_flight"), ("Read batches", "read_batches"),
    ("Write batches", "write_batches"), ("Descriptors done", "descriptors_done"),
    ("Descriptors missing", "descriptors_missing"), ("Descriptors failed", "descriptors_failed"),
    ("Refresh failures", "refresh_failures"), ("Bytes moved", "bytes_moved"),
    # The paths beside Submit: request rings (small reads of shared regions, no gRPC call) and the
    # bulk transport (regions the server cannot map); their reads are counted in the rows above too.
    ("Request rings mapped", "rings"), ("Ring requests answered", "ring_requests"),
    ("Bulk transport sessions", "bulk_sessions"), ("Bulk lanes", "bulk_lanes"),
    ("Bulk fetches answered", "bulk_fetches"), ("Bulk fetches through staging", "bulk_staged"),
)


def _print_section(title: str, data: dict[str, object] | None, rows: tuple[tuple[str, str], ...]) -> None:
    if data is None:
        print(f"{title}: not served")
        return
    width = max(len(label) for label, _ in rows)
    print(title)
    for label, key in rows:
        value = data.get(key)
        shown = f"{value:.1%}" if key.endswith("hit_rate") and isinstance(value, float) else _fmt(value)
        print(f"  {label:<{width}}  {shown}")
