"""Print the resume plan of a prompt against a running kvstore service.

The prompt's token ids come from a file (a JSON array, or integers separated by
whitespace or commas; `-` reads stdin). The planner asks the service what is
cached (found blocks, the SWA snapshot that serves the longest resume) and
prints its decision: each line with its numbers, then a summary (`--json`: one
object with the plan's fields). The plan is neither leased nor counted in the
server's usable-token stats: nothing executes it.

Examples:
  kvstore plan --tokens prompt.json --target 127.0.0.1:50051
  kvstore plan --tokens - --replay-windows exact --json < prompt.txt
  kvstore plan --tokens prompt.json --hosts --network-gbps 2.5   # where the prefix lives, per host
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kvstore.commands import add_connection_arguments, client_options
from kvstore.errors import InvalidArgument
from replay.cost import (
    DEFAULT_FETCH_GBPS,
    DEFAULT_RECOMPUTE_TOKENS_PER_S,
    DEFAULT_REPLAY_OVERHEAD_S,
    CostModel,
    parse_replay_windows,
)
from replay.hosts import DEFAULT_DIRECT_GPU_GBPS, DEFAULT_NETWORK_GBPS, PathRates

DEFAULT_TARGET = "127.0.0.1:50051"
_SEPARATORS = re.compile(r"[\s,]+")
_TOKEN_MAX = 2**32 - 1


def parse_tokens(text: str, source: str) -> list[int]:
    """Token ids from `text`: a JSON array of integers, or integers separated by whitespace or commas.

    Raises:
        InvalidArgument: no tokens, or an item that is not a token id (named with its index).
    """
    body = text.strip()
    if body.startswith("["):
        try:
            items: list[object] = json.loads(body)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{source}: not a JSON array of token ids: {exc}") from None
        if not isinstance(items, list):
            raise InvalidArgument(f"{source}: not a JSON array of token ids")
    else:
        items = [w for w in _SEPARATORS.split(body) if w]
    tokens: list[int] = []
    for i, item in enumerate(items):
        value = item
        if isinstance(item, str):
            try:
                value = int(item)
            except ValueError:
                value = None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _TOKEN_MAX:
            raise InvalidArgument(f"{source}: item {i} ({item!r}) is not a token id (an integer in "
                                  f"[0, {_TOKEN_MAX}])")
        tokens.append(value)
    if not tokens:
        raise InvalidArgument(f"{source}: no token ids", hint="give a JSON array or integers separated by spaces")
    return tokens


def read_tokens(path: str) -> list[int]:
    """The token ids in the file at `path` (`-`: stdin).

    Raises:
        OSError: the file cannot be read.
        InvalidArgument: its content is not token ids.
    """
    if path == "-":
        return parse_tokens(sys.stdin.read(), "stdin")
    return parse_tokens(Path(path).read_text(), path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    parser.add_argument("--tokens", required=True, metavar="FILE",
                        help="token ids: a JSON array or integers separated by spaces or commas; - for stdin")
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
    parser.add_argument("--namespace", default="", help="tenant (default: the token's; 'default' without auth)")
    parser.add_argument("--geometry", default="", help="geometry name (default: the server's)")
    parser.add_argument("--extra-key", action="append", default=[], metavar="KEY",
                        help="an extra key the blocks were stored with (repeat for several, in order)")
    parser.add_argument("--replay-windows", default="1", metavar="N|exact",
                        help="bounded replay length in windows (default 1), or 'exact' (layers x window only)")
    parser.add_argument("--fetch-gbps", type=float, default=DEFAULT_FETCH_GBPS,
                        help=f"block fetch rate, GB/s (default {DEFAULT_FETCH_GBPS:g}: kvstore bench transfer)")
    parser.add_argument("--recompute-tps", type=float, default=DEFAULT_RECOMPUTE_TOKENS_PER_S,
                        help=f"worker compute rate, tokens/s (default {DEFAULT_RECOMPUTE_TOKENS_PER_S:,.0f})")
    parser.add_argument("--replay-overhead", type=float, default=DEFAULT_REPLAY_OVERHEAD_S, metavar="SECONDS",
                        help="fixed cost of one replay call beyond its tokens "
                             f"(default {DEFAULT_REPLAY_OVERHEAD_S:g} s; 0.03 for the eager reference worker)")
    parser.add_argument("--fidelity", default="",
                        help="the tenant's fidelity as a setting or error budget (exact, windows:N, kl:X, "
                             "fastllm:P): the span is the smallest measured one meeting it (docs/PLANNER.md); "
                             "overrides --replay-windows")
    parser.add_argument("--fidelity-table", default="",
                        help="with --fidelity: the worker's measured table (default: the shipped table of the "
                             "client's geometry, replay/fidelity/*.json)")
    parser.add_argument("--snapshot-probes", type=int, default=4,
                        help="block boundaries asked about for a snapshot (default 4)")
    parser.add_argument("--hosts", action="store_true",
                        help="also say which hosts hold the found prefix, the path a worker on each would "
                             "restore by and its plan's estimated time (docs/PLANNER.md)")
    parser.add_argument("--direct-gpu-gbps", type=float, default=DEFAULT_DIRECT_GPU_GBPS,
                        help=f"with --hosts: a direct GPU restore's rate (default {DEFAULT_DIRECT_GPU_GBPS:g})")
    parser.add_argument("--network-gbps", type=float, default=DEFAULT_NETWORK_GBPS,
                        help=f"with --hosts: blocks over gRPC from another host (default {DEFAULT_NETWORK_GBPS:g})")
    parser.add_argument("--no-direct", action="store_true",
                        help="with --hosts: workers beside a node have no ColocatedReader (shared memory or gRPC)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_connection_arguments(parser)  # --token (default $KVSTORE_TOKEN) and the TLS flags


def run(args: argparse.Namespace) -> int:
    """Plan the prompt in `args.tokens` against `args.target` and print the plan.

    Raises:
        OSError: the token file cannot be read.
        KVStoreError: bad input, or the server could not be asked.
    """
    from kvstore.client import Client
    from replay.fidelity_budget import FidelityTable, parse_budget
    from replay.planner import Planner

    budget = parse_budget(args.fidelity) if args.fidelity else None
    table = None
    if budget is not None and budget.kind in ("kl", "fastllm"):
        try:
            table = FidelityTable.load(args.fidelity_table) if args.fidelity_table else None  # None: the
            # planner takes the shipped table measured on the client's geometry (table_for_geometry)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
    cost = CostModel(fetch_gbps=args.fetch_gbps, recompute_tokens_per_s=args.recompute_tps,
                     replay_windows=parse_replay_windows(args.replay_windows), replay_overhead_s=args.replay_overhead)
    rates = PathRates(direct_gpu_gbps=args.direct_gpu_gbps, shm_gbps=args.fetch_gbps, network_gbps=args.network_gbps,
                      direct=not args.no_direct) if args.hosts else None
    tokens = read_tokens(args.tokens)
    with Client(args.target, namespace=args.namespace, geometry=args.geometry, timeout_s=args.timeout,
                **client_options(args)) as client:
        with Planner(client, cost=cost, lease_ms=0, snapshot_probes=args.snapshot_probes, report=False,
                     hosts=rates, fidelity=budget, fidelity_table=table) as planner:
            plan = planner.plan(tokens, extra_keys=args.extra_key)
        geometry, block_tokens = client.geometry, client.block_tokens
    if args.json:
        print(json.dumps({**plan.to_dict(), "target": args.target, "namespace": args.namespace,
                          "geometry": geometry, "block_tokens": block_tokens}))
        return 0
    tenant = args.namespace or "of the token (default without auth)"
    print(f"plan for {plan.prompt_tokens:,} prompt tokens at {args.target} (namespace {tenant}, "
          f"geometry {geometry}, blocks of {block_tokens})")
    for line in plan.reasons:
        print(f"  {line}")
    print(plan.summary())
    if args.hosts:
        print("hosts (where the found prefix lives; the path and plan of a worker on each, cheapest first):"
              if plan.found_tokens else "hosts: nothing found, so no host holds the prompt's prefix")
        for host in plan.hosts:
            print(f"  {host.line()}")
    return 0
