"""The `kvstore` command: serve, check, bench, and the commands of LAZY_COMMANDS (stats,
tenant, policy, purge, export, import, health, plan, worker), each in its own module.

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
import os
import socket
import sys
from pathlib import Path

from kvstore.errors import ConfigError, KVStoreError, has_default_hint, to_status

DEFAULT_TARGET = "127.0.0.1:50051"


def _serve(args: argparse.Namespace) -> int:
    from gateway.server import serve
    from kvstore.config import load_settings

    settings = load_settings(args.config, overrides={
        "server": {"port": args.port, "host": args.host},
        "store": {"data_dir": args.data_dir},
        "auth": {"insecure": True if args.insecure else None},
        "tls": {"cert_file": args.tls_cert, "key_file": args.tls_key, "client_ca_file": args.tls_client_ca},
        "metrics": {"port": args.metrics_port},
        "trace": {"enabled": True if args.trace or args.trace_dir else None,
                  "dir": str(args.trace_dir) if args.trace_dir else None},
    })
    from gateway.request_log import use_json_lines

    check_port_free(settings.server.host, settings.server.port)
    use_json_lines()  # the failed-request log: bare JSON lines on stderr, not behind the root format's prefix
    asyncio.run(serve(settings))  # a ConfigError or OSError at start reaches main as one line
    return 0


def check_port_free(host: str, port: int) -> None:
    """Raise OSError, in one line naming the port, when another process listens on host:port.

    gRPC's own bind failure names no cause and logs a line of its own first, so the port is
    tried here, as gRPC binds it (SO_REUSEADDR, no SO_REUSEPORT), before gRPC is asked. Port 0
    picks a free one. A port taken between this check and gRPC's bind still fails, in gRPC's words.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # a name that does not resolve: gRPC says so
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    busy = OSError(f"cannot listen on {host}:{port}: port {port} is in use by another process "
                                   "(stop it, or give --port another port; 0 picks a free one)")
                    busy.errno = errno.EADDRINUSE  # for --json's code; not in the message, which says it in words
                    raise busy from None
                return  # another cause (permission, an address not on this host): gRPC reports it


def _check(args: argparse.Namespace) -> int:
    from kvstore.bench.report import Progress
    from tiers.integrity import check_store

    data_dir: Path = args.data_dir
    if not data_dir.exists():
        raise ConfigError(f"data dir {data_dir} does not exist", hint="give the folder `kvstore serve` stores in "
                          "(--data-dir or store.data_dir)")
    if not data_dir.is_dir():
        raise ConfigError(f"data dir {data_dir} is not a folder")
    shown = Progress(enabled=not args.json and not args.no_progress)
    with shown.bar("kvstore check: records", 0, "rec", scale=False) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
            bar.refresh()  # the walk calls now and then: draw each call, or the last frame shows an earlier count

        report = check_store(data_dir, repair=args.repair, progress=progress)
    if report.repaired and report.dropped_pins:  # R30: the pins a repair dropped are audited, as every change
        from gateway.repair_audit import audit_dropped_pins
        audit_dropped_pins(data_dir, report)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print("\n".join(report.lines()))
    if report.fatal:
        return 2  # nothing could be walked: not "problems found", which a repair would fix
    return 0 if report.ok or report.repaired else 1


def _bench(args: argparse.Namespace) -> int:
    from kvstore.bench.report import Progress

    report = args.bench_module.run(args, Progress(enabled=not args.json and not args.no_progress))
    print(report.to_json() if args.json else report.to_table())
    return 0


#: Commands whose arguments and body live in their own module, imported only when chosen
#: (so `kvstore serve` never loads the planner or torch): name -> (module, help).
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("replay.plan_command", "print the resume plan of a prompt against a running service"),
    "worker": ("replay.worker.command",
               "run the reference worker (replay and prefill; CPU by default, --device cuda) as a gRPC service"),
    "tenant": ("kvstore.commands.tenant", "create, revoke and list tenants' API tokens (data dir; fleet: etcd)"),
    "stats": ("kvstore.commands.stats", "show hit rates over time, storage use and retention headroom"),
    "policy": ("kvstore.commands.policy",
               "show and change tenants' retention, SWA TTL and quotas, and the audit log (admin, audited)"),
    "purge": ("kvstore.commands.purge", "delete a prompt's blocks or a tenant's whole cache (admin, audited)"),
    "pins": ("kvstore.commands.pins", "drop a tenant's pins: prefixes kept past retention (admin, audited)"),
    "export": ("kvstore.commands.transfer_tenant", "export a tenant's cache to a file on the server (admin, audited)"),
    "import": ("kvstore.commands.transfer_tenant",
               "import an export file on the server into a tenant's cache (admin, audited)"),
    "health": ("kvstore.commands.health", "ask the server's health service whether it serves (a container probe)"),
    "trace": ("kvstore.trace.command", "simulate the store on public request traces, or replay them against a server"),
    "fleet": ("kvstore.commands.fleet", "list the fleet's storage nodes registered in etcd (fleet status)"),
    "gateway": ("gateway.gateway_main", "serve the KVStore API over a fleet's nodes, holding no state ([fleet] etcd)"),
}


#: What a command (or a command's action) leaves as it was when it stops on an error: the hint of an
#: error whose class gave only its default, which speaks of the store's data calls (kvstore.errors).
#: '' for a command that only reads (nothing to say) or whose errors may come half way (check
#: --repair, a benchmark). An import checks every frame before writing one, then writes frame by
#: frame (gateway/tenant_export.py).
COMMAND_HINTS: dict[str, str] = {
    "serve": "the service did not start",
    "gateway": "the gateway did not start",
    "worker": "the worker did not start",
    "plan": "no plan was made",
    "tenant create": "no token was issued; the tenants file is unchanged",
    "tenant revoke": "no token was revoked; the tenants file is unchanged",
    "policy set": "no policy was changed",
    "purge": "nothing was deleted",
    "pins": "no pin was dropped",
    "export": "no export file was written",
    "import": "nothing is written before every frame checks out; blocks written after that stay, "
              "parents first, and importing the file again is safe",
}


def command_hint(args: argparse.Namespace) -> str:
    """The hint COMMAND_HINTS gives the command (and action) `args` ran, or ''."""
    words = [args.command, getattr(args, "action", None) or getattr(args, "policy_command", None)]
    name = " ".join(w for w in words if w)
    return COMMAND_HINTS.get(name, COMMAND_HINTS.get(args.command, ""))


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
    serve.add_argument("--metrics-port", type=int, help="port of the Prometheus endpoint (metrics.port; 0 = off)")
    serve.add_argument("--insecure", action="store_true", help="allow a bind beyond loopback without tokens "
                       "or TLS (auth.insecure): a trusted network only")
    serve.add_argument("--trace", action="store_true", help="record the server's own access trace (trace.enabled: "
                       "block hashes and counts per call, never tokens; read by `kvstore trace`, docs/CAPACITY.md "
                       "'Recording')")
    serve.add_argument("--trace-dir", type=Path, help="where the trace files go (trace.dir; turns --trace on; "
                       "default <data dir>/trace)")
    serve.set_defaults(func=_serve)

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
                                 description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        if isinstance(exc, KVStoreError) and has_default_hint(exc) and exc.hint and not exc.retryable:
            exc.hint = command_hint(args)  # the class's default speaks of another call (kvstore.errors)
        return _report_error(exc, as_json)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
