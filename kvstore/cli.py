"""The `kvstore` command: serve, stats, check, bench.

This module is the composition root: it alone imports across the layers
(gateway, tiers, benchmarks), and only inside the command that needs them, so
`kvstore stats` never loads LMDB and `kvstore serve` never loads torch.

Errors end a command with one line on stderr (one JSON object on stdout under
`--json`) and a non-zero exit: 2 for a kvstore error, 1 for an OS error; a
reader that stops early (`kvstore stats | head -3`) ends it quietly.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib
import json
import logging
import math
import os
import sys
from pathlib import Path

from kvstore.errors import ConfigError, KVStoreError, to_status

DEFAULT_TARGET = "127.0.0.1:50051"


def _serve(args: argparse.Namespace) -> int:
    from gateway.server import serve
    from kvstore.config import load_settings

    settings = load_settings(args.config, overrides={
        "server": {"port": args.port, "host": args.host},
        "store": {"data_dir": args.data_dir},
        "auth": {"insecure": True if args.insecure else None},
        "tls": {"cert_file": args.tls_cert, "key_file": args.tls_key, "client_ca_file": args.tls_client_ca},
    })
    asyncio.run(serve(settings))  # a ConfigError or OSError at start reaches main as one line
    return 0


def _check(args: argparse.Namespace) -> int:
    from kvstore.bench.report import Progress
    from tiers.integrity import check_store

    data_dir: Path = args.data_dir
    if not data_dir.exists():
        raise ConfigError(f"data dir {data_dir} does not exist", hint="give the folder `kvstore serve` stores in "
                          "(--data-dir or store.data_dir)")
    if not data_dir.is_dir():
        raise ConfigError(f"data dir {data_dir} is not a folder")
    with Progress(enabled=not args.json and not args.no_progress).bar("kvstore check: records", 0, "rec") as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        report = check_store(data_dir, repair=args.repair, progress=progress)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print("\n".join(report.lines()))
    if report.fatal:
        return 2  # nothing could be walked: not "problems found", which a repair would fix
    return 0 if report.ok or report.repaired else 1


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
    ("Headroom (hours at that rate)", "headroom_hours"), ("Retention (hours)", "retention_hours"),
    ("Evictions", "evictions"), ("Rejected puts (store full)", "rejected_puts"),
    ("Corrupt blocks", "corrupt_blocks"), ("Active leases", "active_leases"), ("Uptime (s)", "uptime_s"),
)


def _stats(args: argparse.Namespace) -> int:
    from kvstore.client import Client
    from kvstore.commands import client_options

    with Client(args.target, timeout_s=args.timeout, **client_options(args)) as client:
        data = stats_dict(client.stats())
        data["swa"] = swa_stats_dict(client)
        data["transfer"] = transfer_stats_dict(client)
    if args.json:
        print(json.dumps(data))
        return 0
    width = max(len(label) for label, _ in STATS_ROWS)
    print(f"kvstore at {args.target}")
    for label, key in STATS_ROWS:
        value = data.get(key)
        if key.endswith("hit_rate") and value is not None:
            print(f"  {label:<{width}}  {value:.1%}")
        elif key == "headroom_hours" and value is None:
            print(f"  {label:<{width}}  unbounded (no writes in the window)")
        else:
            print(f"  {label:<{width}}  {_fmt(value)}")
    _print_by_geometry(data["stored_by_geometry"])  # type: ignore[arg-type]
    _print_section("Resume plans (planner reports)", data, RESUME_ROWS)
    _print_section("SWA pool", data["swa"], SWA_ROWS)  # type: ignore[arg-type]
    _print_section("Transfer", data["transfer"], TRANSFER_ROWS)  # type: ignore[arg-type]
    return 0


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
        print(f"  {label:<{width}}  {_fmt(r['blocks_stored'])} blocks, {_fmt(r['bytes_stored'])} bytes")


def swa_stats_dict(client: object) -> dict[str, object] | None:
    """The SWA pool's SwaStatsResponse as a flat dict with its hit rate; None if the server has no pool."""
    from kvstore.errors import Internal

    try:
        reply = client.swa.stats()  # type: ignore[attr-defined]
    except Internal:  # UNIMPLEMENTED: a server without the SwaPool service
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
    """The transfer service's TransferStatsResponse as a flat dict; None if the server predates it."""
    from kvstore.errors import Internal

    try:
        return message_dict(client.transfer_stats())  # type: ignore[attr-defined]
    except Internal:  # UNIMPLEMENTED: a server without Transfer.Stats
        return None


TRANSFER_ROWS = (
    ("Copy loop", "copy_loop"), ("Copy threads", "copy_threads"), ("Sessions open", "sessions"),
    ("Regions mapped", "regions"), ("Bytes mapped", "mapped_bytes"),
    ("Descriptors in flight", "descriptors_in_flight"), ("Read batches", "read_batches"),
    ("Write batches", "write_batches"), ("Descriptors done", "descriptors_done"),
    ("Descriptors missing", "descriptors_missing"), ("Descriptors failed", "descriptors_failed"),
    ("Refresh failures", "refresh_failures"), ("Bytes moved", "bytes_moved"),
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


def _bench(args: argparse.Namespace) -> int:
    from kvstore.bench.report import Progress

    report = args.bench_module.run(args, Progress(enabled=not args.json and not args.no_progress))
    print(report.to_json() if args.json else report.to_table())
    return 0


#: Commands whose arguments and body live in their own module, imported only when chosen
#: (so `kvstore serve` never loads the planner or torch): name -> (module, help).
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("replay.plan_command", "print the resume plan of a prompt against a running service"),
    "worker": ("replay.worker.command", "run the reference GPU worker (replay and prefill) as a gRPC service"),
    "tenant": ("kvstore.commands.tenant", "create, revoke and list tenants' API tokens (on the data dir)"),
}


def _lazy(args: argparse.Namespace) -> int:
    return int(args.command_module.run(args) or 0)


def _chosen_command(argv: list[str] | None) -> str | None:
    """The first non-option word of the command line: the command that will run."""
    args = sys.argv[1:] if argv is None else argv
    words = [a for a in args if not a.startswith("-")]
    return words[0] if words else None


def _chosen_bench(argv: list[str] | None) -> str | None:
    """The benchmark named on the command line, if any (so only its module is imported)."""
    args = sys.argv[1:] if argv is None else argv
    if "bench" in args:
        rest = [a for a in args[args.index("bench") + 1:] if not a.startswith("-")]
        return rest[0] if rest else None
    return "" if args else None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command-line interface; `argv` lets it import only the benchmark that runs."""
    from kvstore.bench import BENCHES
    from kvstore.commands import add_connection_arguments

    parser = argparse.ArgumentParser(prog="kvstore", description="KV-cache storage and transfer service.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the storage service",
                           description="Run the kvstore service (KVStore, health and reflection on one port). "
                           "Settings: defaults < TOML (--config or KVSTORE_CONFIG) < KVSTORE_<SECTION>_<FIELD> "
                           "environment variables < these flags.")
    serve.add_argument("--port", type=int, help="TCP port (default 50051; 0 picks a free one)")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--data-dir", type=Path, help="folder for the LMDB store (default ./kvstore-data)")
    serve.add_argument("--config", type=Path, help="TOML config file")
    serve.add_argument("--tls-cert", help="server certificate chain, PEM (tls.cert_file; turns TLS on)")
    serve.add_argument("--tls-key", help="server private key, PEM (tls.key_file)")
    serve.add_argument("--tls-client-ca", help="CA (PEM) client certificates must chain to: mutual TLS "
                       "(tls.client_ca_file)")
    serve.add_argument("--insecure", action="store_true", help="allow a bind beyond loopback without tokens "
                       "or TLS (auth.insecure): a trusted network only")
    serve.set_defaults(func=_serve)

    stats = sub.add_parser("stats", help="show counters, hit rates and retention headroom",
                           description="Show a server's lookup and retrieve hit rates, storage use, evictions "
                           "and retention headroom.")
    stats.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
    add_connection_arguments(stats)
    stats.set_defaults(func=_stats)

    check = sub.add_parser("check", help="verify a stored data dir (read-only), or repair it",
                           description="Walk every record of the store in DATA_DIR, verify sizes and checksums, "
                           "and report what a repair would drop (a damaged block and every block below it, "
                           "orphans, stale index entries). Read-only unless --repair; a check may run while a "
                           "server serves the store, a repair needs it stopped. Exit 0: sound (or repaired); "
                           "1: problems found; 2: could not check.")
    check.add_argument("--data-dir", type=Path, required=True, help="the store's folder (store.data_dir)")
    check.add_argument("--repair", action="store_true", help="drop and fix what the check finds")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    check.set_defaults(func=_check)

    chosen_command = _chosen_command(argv)
    for name, (module_path, help_) in LAZY_COMMANDS.items():
        if chosen_command != name:
            sub.add_parser(name, help=help_)  # listed; its module is imported only when it runs
            continue
        module = importlib.import_module(module_path)
        p = sub.add_parser(name, help=help_, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=_lazy, command_module=module)

    bench = sub.add_parser("bench", help="run a benchmark against its baseline",
                           description="Benchmarks print each figure beside a baseline measured in the same run "
                           "(ratio > 1: better than the baseline). Names: " + ", ".join(BENCHES))
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="NAME")
    chosen = _chosen_bench(argv)
    for name, module_path in BENCHES.items():
        if chosen is not None and name != chosen:
            bench_sub.add_parser(name)  # listed; its module is imported only when it runs
            continue
        module = importlib.import_module(module_path)
        p = bench_sub.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0],
                                 description=module.__doc__)
        p.add_argument("--json", action="store_true", help="print one JSON object with a figures list")
        p.add_argument("--no-progress", action="store_true", help="hide progress bars")
        module.add_arguments(p)
        p.set_defaults(func=_bench, bench_module=module)
    return parser


def error_dict(exc: BaseException) -> dict[str, object]:
    """`{"error": {...}}` for an error ended a command: its gRPC status name (or errno name), type, message, hint."""
    if isinstance(exc, KVStoreError):
        return {"error": {"code": to_status(exc).name, "type": type(exc).__name__, "message": exc.message,
                          "hint": exc.hint, "retryable": exc.retryable}}
    code = errno.errorcode.get(getattr(exc, "errno", None) or 0, "OS_ERROR")
    return {"error": {"code": code, "type": type(exc).__name__, "message": str(exc), "hint": "",
                      "retryable": False}}


def _report_error(exc: KVStoreError | OSError, as_json: bool) -> int:
    if as_json:
        print(json.dumps(error_dict(exc)))
    elif isinstance(exc, KVStoreError):
        print(f"kvstore: {type(exc).__name__}: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""),
              file=sys.stderr)
    else:
        print(f"kvstore: {exc}", file=sys.stderr)
    return 2 if isinstance(exc, KVStoreError) else 1


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the reader is gone, and the flush at exit must not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvstore` command."""
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    as_json = bool(getattr(args, "json", False))
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return 141  # as a process killed by SIGPIPE: the reader stopped early, nothing went wrong here
    except (KVStoreError, OSError) as exc:
        return _report_error(exc, as_json)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
