"""Show a server's hit rates, storage use, evictions and retention headroom.

The first table is the store's totals since it was created, all tenants
together. "Hit rates" then shows lookup, retrieve, SWA and usable (planner)
hit rates over windows that end now: the last 5 minutes, hour and 24 hours
(minute buckets kept across restarts), since this server process started, and
since the data dir's counters began; then the same per tenant, with its
token-hours stored and tokens served from cache. A caller sees only its own
tenant unless it holds the admin right.

A WARNING line appears when the whole capacity, at the recent write rate,
holds less than the retention: once full, the store must refuse puts.

examples:
  kvstore stats
  kvstore stats --tenant acme --window 1h
  kvstore stats --chart            # the lookup hit rate over the last 24 h
  kvstore stats --json | jq .windows
  kvstore stats --target etcd://10.0.0.5:2379/prod   # every node of a fleet, and the totals
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from kvstore.commands import add_connection_arguments, client_options
from kvstore.commands.stats_chart import Slice, render
from kvstore.counted import counted

DEFAULT_TARGET = "127.0.0.1:50051"
WINDOW_NAMES = ("5m", "1h", "24h", "start", "all")
WINDOW_LABELS = {"5m": "5 min", "1h": "1 h", "24h": "24 h", "start": "since start", "all": "all time"}
#: Columns of the chart: half an hour each.
CHART_POINTS = 48
#: Rates a window shows: key -> (found, asked) counters (sums of fields where a tuple).
RATES: dict[str, tuple[str | tuple[str, ...], str]] = {
    "lookup_token_hit_rate": ("lookup_tokens_found", "lookup_tokens_asked"),
    "lookup_block_hit_rate": ("lookup_blocks_found", "lookup_blocks_asked"),
    "retrieve_token_hit_rate": ("get_tokens_returned", "get_tokens_asked"),
    "retrieve_block_hit_rate": ("get_blocks_returned", "get_blocks_asked"),
    "swa_hit_rate": ("swa_snapshots_found", "swa_snapshots_asked"),
    "usable_hit_rate": ("resume_usable_tokens", "resume_prompt_tokens"),
    "usable_share_of_found": ("resume_usable_tokens", "resume_found_tokens"),
    "replay_share": (("resume_bounded_replay_plans", "resume_exact_replay_plans"), "resume_plans"),
}
#: What --chart can plot: name -> the rate's key.
CHART_RATES = {"lookup": "lookup_token_hit_rate", "retrieve": "retrieve_token_hit_rate", "swa": "swa_hit_rate",
               "usable": "usable_hit_rate"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags."""
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
    add_connection_arguments(p)
    p.add_argument("--tenant", default="", help="one tenant's hit rates (default: every tenant you may see)")
    p.add_argument("--window", choices=WINDOW_NAMES, help="one window only (default: all five)")
    p.add_argument("--chart", action="store_true", help="print the hit rate over the last 24 h as a chart")
    p.add_argument("--chart-rate", choices=tuple(CHART_RATES), default="lookup",
                   help="the rate --chart plots (default: lookup, in tokens)")


def run(args: argparse.Namespace) -> int:
    """Ask the server (or, for an etcd:// target, every node of the fleet) and print."""
    from kvstore.client import Client

    if args.target.startswith(("etcd://", "etcds://")):  # etcds://: TLS to etcd (F57)
        return run_fleet(args)
    from kvstore.commands.stats_totals import print_table, stats_dict, swa_stats_dict, transfer_stats_dict

    windows = [args.window] if args.window else []
    with Client(args.target, timeout_s=args.timeout, **client_options(args)) as client:
        reply = client.stats(tenant=args.tenant, windows=windows, chart_points=CHART_POINTS)
        data = stats_dict(reply)
        # The pool's and the transfer service's counters span every tenant, as the store's do.
        data["swa"] = swa_stats_dict(client) if reply.store_wide else None
        data["transfer"] = transfer_stats_dict(client) if reply.store_wide else None
    data.update(hit_dict(reply))
    if args.json:
        print(json.dumps(data))
    elif args.chart:
        print("\n".join(chart_lines(data, args)))
    elif reply.store_wide:
        print_table(data, args.target)
        print_hits(data)
    else:
        print(f"kvstore at {args.target}: your tenant's hit rates (the store's totals need the admin right)")
        print_hits(data)
    return 0


def _counts(message: object) -> dict[str, int]:
    return {f.name: int(getattr(message, f.name)) for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def with_rates(counts: dict[str, int]) -> dict[str, object]:
    """Counters with every rate of RATES added (None where nothing was asked)."""
    out: dict[str, object] = dict(counts)
    for key, (found, asked) in RATES.items():
        names = found if isinstance(found, tuple) else (found,)
        top = sum(counts.get(n, 0) for n in names)
        out[key] = top / counts[asked] if counts.get(asked) else None
    out["tokens_served"] = counts.get("get_tokens_returned", 0)
    return out


def _window_dict(windows: object) -> dict[str, dict[str, object]]:
    return {w.window: {"seconds": w.seconds, **with_rates(_counts(w.counts))} for w in windows}  # type: ignore[attr-defined]


def hit_dict(reply: object) -> dict[str, object]:
    """The hit windows, tenants and chart of a StatsResponse as plain JSON values (its scalar fields,
    the capacity warning among them, are in `stats_dict`)."""
    r = reply
    tenants = {}
    for t in r.tenants:  # type: ignore[attr-defined]
        entry: dict[str, object] = {"windows": _window_dict(t.windows)}
        entry.update({"token_hours": t.token_hours, "blocks_stored": t.blocks_stored, "bytes_stored": t.bytes_stored,
                      "pins": t.pins, "pinned_bytes": t.pinned_bytes}  # pins: docs/RETENTION.md R27
                     if t.usage_known else {"token_hours": None, "blocks_stored": None, "bytes_stored": None,
                                            "pins": None, "pinned_bytes": None})
        tenants[t.tenant] = entry
    return {
        "windows": _window_dict(r.windows),  # type: ignore[attr-defined]
        "tenants": tenants,
        "chart": [{"start_s": p.start_s, "seconds": p.seconds, **with_rates(_counts(p.counts))}
                  for p in r.chart],  # type: ignore[attr-defined]
    }


def headroom_warning(data: dict[str, object]) -> str | None:
    """The WARNING line, when the capacity at the recent write rate holds less than the retention."""
    if not data["headroom_warning"]:
        return None
    rate, capacity = float(data["write_rate_bytes_per_s"]), int(data["capacity_bytes"])  # type: ignore[arg-type, call-overload]
    retention, hours = float(data["retention_hours"]), float(data["capacity_hours"])  # type: ignore[arg-type]
    needed = math.ceil(rate * retention * 3600)
    return (f"WARNING: at the recent write rate ({rate:,.0f} B/s over the last {data['write_rate_window_s']:,.0f} s) "
            f"the whole capacity ({capacity:,} B) holds {hours:.1f} h of writes, less than the {retention:g} h "
            f"retention: once full, the store refuses puts rather than evict blocks younger than {retention:g} h. "
            f"Raise store.capacity_bytes to at least {needed:,} B, or write less.")


HIT_ROWS = (
    ("Lookup hit rate, tokens", "lookup_token_hit_rate"), ("Lookup hit rate, blocks", "lookup_block_hit_rate"),
    ("Retrieve hit rate, tokens", "retrieve_token_hit_rate"), ("Retrieve hit rate, blocks", "retrieve_block_hit_rate"),
    ("SWA hit rate (snapshots)", "swa_hit_rate"), ("Usable hit rate (usable / prompt tokens)", "usable_hit_rate"),
    ("Usable share of found tokens", "usable_share_of_found"), ("Replay share (replay plans / plans)", "replay_share"),
    ("Lookups", "lookups"), ("Gets", "gets"), ("SWA gets", "swa_gets"), ("Plans reported", "resume_plans"),
    ("Tokens served from cache", "tokens_served"),
)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1%}"
    return f"{value:,}"


def _print_windows(title: str, windows: dict[str, dict[str, object]], extra: list[tuple[str, str]]) -> None:
    names = list(windows)
    width = max(len(label) for label, _ in HIT_ROWS)
    print(f"{title:<{width + 2}}" + "".join(f"{WINDOW_LABELS[n]:>13}" for n in names))
    for label, key in HIT_ROWS:
        print(f"  {label:<{width}}" + "".join(f"{_cell(windows[n][key]):>13}" for n in names))
    for label, value in extra:
        print(f"  {label:<{width}}  {value}")


def print_hits(data: dict[str, object]) -> None:
    """The headroom warning, then the hit-rate windows overall and per tenant."""
    warning = headroom_warning(data)
    if warning:
        print(warning)
    tenants: dict[str, dict[str, object]] = data["tenants"]  # type: ignore[assignment]
    print()
    _print_windows("Hit rates (all tenants shown)" if len(tenants) != 1 else f"Hit rates ({next(iter(tenants))})",
                   data["windows"], [])  # type: ignore[arg-type]
    for name, t in tenants.items():
        hours = t["token_hours"]
        stored = "unknown (the server does not report per-tenant usage)" if hours is None else (
            f"{hours:,.1f} ({counted(t['blocks_stored'], 'block')}, "  # type: ignore[arg-type]  # JSON: an int
            f"{t['bytes_stored']:,} B stored now)")
        pins = "-" if t.get("pins") is None else (
            f"{counted(t['pins'], 'pin')} holding {t['pinned_bytes']:,} B until their time")  # type: ignore[arg-type]
        _print_windows(f"Tenant {name}", t["windows"],  # type: ignore[arg-type]
                       [("Token-hours stored", stored), ("Pins (kept past retention)", pins)])


def chart_lines(data: dict[str, object], args: argparse.Namespace) -> list[str]:
    """The --chart output: the chosen rate over the last 24 h, one column per slice."""
    key = CHART_RATES[args.chart_rate]
    found, asked = RATES[key]
    points: list[dict[str, int]] = data["chart"]  # type: ignore[assignment]
    slices = [Slice(asked=int(p[asked]), found=int(p[found])) for p in points]  # type: ignore[index]
    tenants: dict[str, object] = data["tenants"]  # type: ignore[assignment]
    who = f"tenant {next(iter(tenants))}" if len(tenants) == 1 else "all tenants shown"
    minutes = int(points[0]["seconds"] // 60) if points else 30
    lines = render(slices, title=f"{args.chart_rate} hit rate over the last 24 h ({who}, kvstore at {args.target})",
                   slice_minutes=minutes)
    warning = headroom_warning(data)
    return [*lines, warning] if warning else lines


# -- a fleet: `kvstore stats --target etcd://HOST:PORT/CLUSTER` (docs/FLEET.md) ------------------------
# Each node of the membership is asked its Stats (with the same --tenant and
# --window); a node that does not answer (killed, its lease not yet ended) is
# listed as unreachable, and the totals cover the nodes that answered. Totals are
# sums of the nodes' counters, and every hit rate of the total is recomputed from
# those sums (found over asked), never an average of the nodes' rates: a node
# that served ten times the lookups weighs ten times as much.

#: Store-wide figures of a node's StatsResponse summed into the total.
NODE_FIELDS = ("blocks_stored", "bytes_stored", "capacity_bytes", "bytes_free", "lookups", "gets", "puts",
               "blocks_written", "evictions", "rejected_puts", "corrupt_blocks", "active_leases",
               "lookup_tokens_asked", "lookup_tokens_found", "get_tokens_asked", "get_tokens_returned")


def run_fleet(args: argparse.Namespace) -> int:
    """Ask every node of the fleet and print per node and in total (an etcd:// --target)."""
    from kvstore.client.fleet import FleetClient

    windows = [args.window] if args.window else []
    with FleetClient(args.target, timeout_s=args.timeout, **client_options(args)) as client:
        report = fleet_report(client, tenant=args.tenant, windows=windows)
    print(json.dumps(report) if args.json else "\n".join(report_lines(report)))
    return 0


def fleet_report(client: Any, *, tenant: str, windows: list[str]) -> dict[str, Any]:
    """{"target", "nodes": [...], "total": {...}}: each node's figures and windows, unreachable ones marked."""
    from kvstore.errors import KVStoreError
    from kvstore.v1 import kvstore_pb2 as pb

    request = pb.StatsRequest(tenant=tenant, windows=windows, chart_points=0)
    nodes = []
    for node_id, record in sorted(client.view.nodes.items()):
        row: dict[str, Any] = {"node_id": node_id, "address": record.address}
        try:
            c = client.pool.connection(node_id)
            reply = c.call(c.kvstore.Stats, request)
        except KVStoreError as exc:
            row.update(reachable=False, error=f"{type(exc).__name__}: {exc.message}")
            nodes.append(row)
            continue
        row.update(reachable=True, store_wide=bool(reply.store_wide),
                   **{f: int(getattr(reply, f)) for f in NODE_FIELDS},
                   # the tenants' pins held on this node's copies (docs/RETENTION.md R28)
                   pins=sum(t.pins for t in reply.tenants), pinned_bytes=sum(t.pinned_bytes for t in reply.tenants),
                   windows={w.window: {"seconds": w.seconds, **_counts(w.counts)} for w in reply.windows},
                   trace=_counts(reply.trace))  # the node's own access trace ([trace]); enabled as 0/1
        nodes.append(row)
    answered = [n for n in nodes if n["reachable"]]
    total: dict[str, Any] = {f: sum(n[f] for n in answered) for f in (*NODE_FIELDS, "pins", "pinned_bytes")}
    total.update(nodes=len(nodes), reachable=len(answered), windows=_summed_windows(answered),
                 trace={k: sum(n["trace"][k] for n in answered) for k in answered[0]["trace"]} if answered else {})
    for n in answered:  # the rates beside the counters, each node's from its own
        n["windows"] = {w: {"seconds": c["seconds"], **with_rates(_ints(c))} for w, c in n["windows"].items()}
    return {"target": client.target, "nodes": nodes, "total": total}


def _ints(counts: dict[str, Any]) -> dict[str, int]:
    return {k: int(v) for k, v in counts.items() if k != "seconds"}


def _summed_windows(nodes: list[dict[str, Any]]) -> dict[str, dict[str, object]]:
    """Each window's counters summed over the nodes, the rates recomputed from the sums."""
    sums: dict[str, dict[str, int]] = {}
    seconds: dict[str, float] = {}
    for n in nodes:
        for name, counts in n["windows"].items():
            into = sums.setdefault(name, {})
            for key, value in _ints(counts).items():
                into[key] = into.get(key, 0) + value
            seconds[name] = max(seconds.get(name, 0.0), float(counts["seconds"]))
    return {name: {"seconds": seconds[name], **with_rates(c)} for name, c in sums.items()}


def _rate(value: object) -> str:
    return "-" if value is None else f"{value:.1%}"


def report_lines(report: dict[str, Any]) -> list[str]:
    """The text output: one line per node, the total, then the total's hit-rate windows."""
    nodes, total = report["nodes"], report["total"]
    lines = [f"fleet {report['target']}: {total['reachable']} of {total['nodes']} nodes answered"]
    names = list(total["windows"])
    head = ("NODE", "ADDRESS", "BLOCKS", "BYTES", *(f"LOOKUP HIT {WINDOW_LABELS[w]}" for w in names))
    rows = [head]
    for n in nodes:
        if not n["reachable"]:
            rows.append((n["node_id"], n["address"], "unreachable", n["error"], *("" for _ in names)))
            continue
        rows.append((n["node_id"], n["address"], f"{n['blocks_stored']:,}", f"{n['bytes_stored']:,}",
                     *(_rate(n["windows"].get(w, {}).get("lookup_token_hit_rate")) for w in names)))
    rows.append(("TOTAL", "", f"{total['blocks_stored']:,}", f"{total['bytes_stored']:,}",
                 *(_rate(total["windows"][w]["lookup_token_hit_rate"]) for w in names)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append(f"pins (kept past retention, one per run per copy): {total['pins']:,} holding "
                 f"{total['pinned_bytes']:,} B over the nodes that answered")
    print_buffer: list[str] = []
    if total["windows"]:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print()
            _print_windows("Hit rates (fleet total, from summed counters)", total["windows"], [])
        print_buffer = out.getvalue().rstrip("\n").splitlines()
    return lines + print_buffer

