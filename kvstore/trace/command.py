"""Read public request traces, simulate the store on them, and replay them against a running server.

  kvstore trace simulate TRACE   the store's own rules on virtual time: hit rates, NVMe and DRAM
                                 needed, evictions, replays, GPU time, per-node balance; sweeps
  kvstore trace replay TRACE     drive a running server through the real client, time-scaled,
                                 beside the simulation of the same slice
  kvstore trace export TRACE     write it in Mooncake's line format, for other replay tools

TRACE is a weka folder, session .json or sessions.tar.zst, or a Mooncake .jsonl(.zst)
(../shared/traces/ holds both; docs/CAPACITY.md has the figures and the commands that made them).

Examples:
  kvstore trace simulate ../shared/traces/weka/sessions.tar.zst
  kvstore trace simulate ../shared/traces/mooncake/conversation_trace.jsonl.zst --capacity 50GB,100GB,1TB
  kvstore trace simulate TRACE --swa-ttl 60,300,1800 --retention-hours 72,168 --json
  kvstore trace simulate TRACE --tenants 2 --policy tenant-1:retention_hours=168,nvme_quota_bytes=50GB
  kvstore trace replay TRACE --sessions 2 --target 127.0.0.1:50051 --speed 100
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.trace.load import DEFAULT_SESSION_EVERY_S


def _size(text: str) -> int:
    from kvstore.commands.policy import parse_bytes
    from kvstore.trace.simulate import UNLIMITED

    t = text.strip()
    if t.lower() in ("0", "unlimited", "inf"):
        return UNLIMITED
    if t[-1:].upper() in "KMGT" and t[-1:].isalpha():
        t += "B"  # 1T: a terabyte, as operators write it
    return parse_bytes(t)


def _list(kind: Any) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return parse


def _slice_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="the trace file or folder")
    p.add_argument("--sessions", type=int, help="read only the first N weka sessions (by file name)")
    p.add_argument("--requests", type=int, help="keep only the first N arrivals")
    p.add_argument("--session-every-s", type=float, default=DEFAULT_SESSION_EVERY_S,
                   help=f"seconds between weka sessions' starts (default {DEFAULT_SESSION_EVERY_S:g})")


def _sim_arguments(p: argparse.ArgumentParser, *, sweep: bool) -> None:
    many = " (a comma list sweeps)" if sweep else ""
    p.add_argument("--capacity", type=_list(_size) if sweep else _size, default="0",
                   help=f"NVMe bytes per node, e.g. 1T, 500GB (default unlimited){many}")
    p.add_argument("--swa-ttl", type=_list(float) if sweep else float, default="300",
                   help=f"SWA snapshot TTL, seconds (default 300; 0: no snapshots){many}")
    p.add_argument("--retention-hours", type=_list(float) if sweep else float, default="72",
                   help=f"retention after last use (default 72){many}")
    p.add_argument("--nodes", type=_list(int) if sweep else int, default="1",
                   help=f"storage nodes, runs placed as the fleet places them (default 1){many}")
    p.add_argument("--replication", type=int, default=1, help="copies of each run (default 1)")
    p.add_argument("--run-blocks", type=int, default=256, help="blocks per placement run (default 256)")
    p.add_argument("--bucket-s", type=float, default=3600.0, help="report interval, seconds (default 3600)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    sim = sub.add_parser("simulate", help="simulate the store's rules on a trace (virtual time)")
    _slice_arguments(sim)
    _sim_arguments(sim, sweep=True)
    sim.add_argument("--tenants", type=int, default=0,
                     help="deal the trace's sessions to N tenants tenant-0..; 0 (default): the trace's own "
                          "(kvstore's recorded trace names them), else one")
    sim.add_argument("--policy", action="append", default=[], metavar="TENANT:FIELD=VALUE,...",
                     help="a tenant's policy, as `kvstore policy set` names its fields (retention_hours, "
                          "swa_ttl_s, nvme_quota_bytes, swa_quota_bytes); repeatable")
    sim.add_argument("--policies", type=Path, metavar="FILE",
                     help="a server's tenant policies (<data_dir>/admin/policies.json); --policy applies over it")
    sim.add_argument("--json", action="store_true", help="print one JSON object (every run, with its buckets)")
    sim.add_argument("--png", type=Path, help="draw the sweep's curves to this PNG (needs matplotlib)")
    rep = sub.add_parser("replay", help="replay a trace slice against a running server, beside its simulation")
    _slice_arguments(rep)
    _sim_arguments(rep, sweep=False)
    rep.add_argument("--target", default="127.0.0.1:50051", help="the server (default 127.0.0.1:50051)")
    rep.add_argument("--token", default=None, help="API token (default $KVSTORE_TOKEN)")
    rep.add_argument("--speed", type=float, default=0.0,
                     help="time scale: 10 = ten times faster than recorded; 0 (default): as fast as it goes")
    rep.add_argument("--concurrency", type=int, default=8, help="sessions replayed at once (default 8)")
    rep.add_argument("--max-requests", type=int, default=200, help="stop after this many requests (default 200)")
    rep.add_argument("--max-seconds", type=float, default=300.0, help="stop after this long (default 300)")
    rep.add_argument("--json", action="store_true", help="print one JSON object")
    exp = sub.add_parser("export", help="write a trace in Mooncake's line format (512-token blocks, global ids)")
    _slice_arguments(exp)
    exp.add_argument("--out", type=Path, required=True, help="the file to write (.jsonl, or .jsonl.zst)")


def run(args: argparse.Namespace) -> int:
    """Run the chosen action."""
    from kvstore.trace.load import load_trace

    trace = load_trace(args.trace, sessions=args.sessions, requests=args.requests,
                       session_every_s=args.session_every_s)
    if not trace.requests:
        raise InvalidArgument(f"trace {args.trace} holds no requests (after --sessions/--requests)")
    if args.action == "simulate":
        return _simulate(args, trace)
    if args.action == "export":
        from kvstore.trace.export import write_mooncake

        print(f"wrote {write_mooncake(trace, args.out):,} requests to {args.out}")
        return 0
    return _replay(args, trace)


def _simulate(args: argparse.Namespace, trace: Any) -> int:
    from kvstore.trace import sim_report
    from kvstore.trace.sim_policies import parse_policy
    from kvstore.trace.simulate import UNLIMITED, SimSettings, Simulation

    combos = list(itertools.product(args.capacity, args.swa_ttl, args.retention_hours, args.nodes))
    policies: dict[str, dict[str, float]] = {}
    for text in args.policy:
        tenant, fields = parse_policy(text, _size)
        policies.setdefault(tenant, {}).update(fields)
    results = []
    for capacity, ttl, hours, nodes in combos:
        settings = SimSettings(capacity_bytes=capacity, swa_ttl_s=ttl, retention_hours=hours, nodes=nodes,
                               replication=args.replication, run_blocks=args.run_blocks, bucket_s=args.bucket_s,
                               tenants=args.tenants, policies=policies, policies_file=args.policies)
        label = (f"cap {'unlimited' if capacity >= UNLIMITED else f'{capacity / 1e12:g}TB'} ttl {ttl:g}s "
                 f"ret {hours:g}h nodes {nodes}")
        if not args.json:
            print(f"simulating {label} ...", file=sys.stderr)
        results.append((label, Simulation(settings).run(trace)))
    if args.png:
        from kvstore.trace.sim_plot import plot

        plot(results, args.png)
    if args.json:
        print(json.dumps({"runs": [dict(label=label, **sim_report.result_dict(r)) for label, r in results]}))
        return 0
    for _, r in results:
        print("\n".join(sim_report.summary(r)))
        print("\n".join(sim_report.over_time(r)))
        print()
    if len(results) > 1:
        print("\n".join(sim_report.sweep_table(results)))
    return 0


def _replay(args: argparse.Namespace, trace: Any) -> int:
    import os

    from kvstore.trace.replayer import replay
    from kvstore.trace.requests import Trace
    from kvstore.trace.simulate import SimSettings, Simulation

    tally = replay(trace, target=args.target, token=args.token or os.environ.get("KVSTORE_TOKEN"),
                   swa_ttl_s=args.swa_ttl, speed=args.speed, concurrency=args.concurrency,
                   max_requests=args.max_requests, max_seconds=args.max_seconds)
    settings = SimSettings(capacity_bytes=args.capacity, swa_ttl_s=args.swa_ttl, retention_hours=args.retention_hours,
                           nodes=args.nodes, replication=args.replication, run_blocks=args.run_blocks)
    done = Trace(name=trace.name, kind=trace.kind, requests=tally.done)
    sim = Simulation(settings).run(done).total if tally.done else None
    calls = {call: {"p50_ms": round(tally.percentile_ms(call, 0.5), 3),
                    "p99_ms": round(tally.percentile_ms(call, 0.99), 3), "count": len(xs)}
             for call, xs in sorted(tally.latencies_s.items())}
    out = {"requests": tally.requests, "wall_s": round(tally.wall_s, 3),
           "requests_per_s": round(tally.requests / tally.wall_s, 3) if tally.wall_s else None,
           "prompt_tokens_per_s": round(tally.prompt_tokens / tally.wall_s, 1) if tally.wall_s else None,
           "lookup_hit_rate": round(tally.lookup_hit_rate, 6), "usable_hit_rate": round(tally.usable_hit_rate, 6),
           "simulated": None if sim is None else {"lookup_hit_rate": round(sim.lookup_hit_rate, 6),
                                                  "usable_hit_rate": round(sim.usable_hit_rate, 6)},
           "calls": calls, "errors": dict(tally.errors)}
    if args.json:
        print(json.dumps(out))
        return 0 if not tally.errors else 1
    print(f"replayed {tally.requests:,} requests in {tally.wall_s:.1f} s ({out['requests_per_s']} req/s, "
          f"{out['prompt_tokens_per_s']} prompt tokens/s) against {args.target}")
    sim_line = "" if sim is None else (f"; simulated: lookup {sim.lookup_hit_rate:.1%}, "
                                       f"usable {sim.usable_hit_rate:.1%}")
    print(f"hit rate (tokens): lookup {tally.lookup_hit_rate:.1%}, usable {tally.usable_hit_rate:.1%}{sim_line}")
    for call, c in calls.items():
        print(f"  {call:<8} p50 {c['p50_ms']:9.2f} ms  p99 {c['p99_ms']:9.2f} ms  ({c['count']:,} calls)")
    print("errors: " + (", ".join(f"{k} {v}" for k, v in tally.errors.items()) or "none"))
    return 0 if not tally.errors else 1
