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
"""

from __future__ import annotations

import argparse
import json
import math

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
    """Ask the server and print."""
    from kvstore.client import Client
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
        entry.update({"token_hours": t.token_hours, "blocks_stored": t.blocks_stored, "bytes_stored": t.bytes_stored}
                     if t.usage_known else {"token_hours": None, "blocks_stored": None, "bytes_stored": None})
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
        _print_windows(f"Tenant {name}", t["windows"], [("Token-hours stored", stored)])  # type: ignore[arg-type]


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
