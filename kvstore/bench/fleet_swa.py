"""`kvstore bench fleet-swa`: SWA snapshots (and a transfer fetch) through a fleet client against one node's.

The bench starts its own Redis Cluster (3 masters, redis-server and redis-cli on
PATH), its own etcd and `--nodes` `kvstore serve` nodes whose `[swa]` pool is
that cluster (docs/FLEET.md F44), and one more `kvstore serve` outside the fleet
on the same cluster: the baseline, a plain `kvstore.Client` of one server. Both
clients take the direct path (the worker reads and writes Redis itself as the
tenant's ACL user), so put and get differ only by the fleet client's layer: the
node it picked is the control plane. The Lookup with SWA candidates differs by
design: the fleet finds the blocks across the runs' nodes, then asks the pool's
node for the snapshot (F45: one more call), where the single node answers both
in one. Both clients put and get the same keys (the same Redis slots). Every
figure is the best of `--repeat` rounds, the two clients taking turns (the
least disturbed by the rest of the box).

Also the fleet's transfer session (F49, F62): a fetch of the Lookup's prompt, every
run streamed from its node, against the single node's session on the same
(stream) path; then on the shared-memory path (every node runs on this host, so
each maps the region and copies its runs into it) against the single node's shm
session; and with one node named this host's (its runs over shm, the rest
streamed: a worker beside one node of many), against the same single shm session.

Targets (printed with met / not met): put and get through the fleet >= 0.9x the
single node's client; the Lookup with SWA candidates <= 2x the single node's
time (ratio >= 0.5); the transfer fetch >= 0.9x the single node's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.bench.fleet_processes import EtcdProcess, NodeProcess, stop_all
from kvstore.bench.harness import GiB, scratch, timed
from kvstore.bench.redis_server import RedisClusterProcesses
from kvstore.bench.report import Figure, Progress, Report
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH

if TYPE_CHECKING:
    from kvstore.client import Client

BLOCK_TOKENS = 64
#: Blocks a run places together: small, so the Lookup's prompt spans several runs (and nodes).
RUN_BLOCKS = 16
#: Snapshot candidates of the Lookup (the last block boundaries, as the planner probes).
CANDIDATES = 4

#: name prefix -> (least ratio, how the target reads).
TARGETS: dict[str, tuple[float, str]] = {
    "swa put via fleet": (0.9, ">= 0.9x the single node's client"),
    "swa get via fleet": (0.9, ">= 0.9x the single node's client"),
    "lookup with swa candidates via fleet": (0.5, "<= 2x the single node's time (ratio >= 0.5)"),
    "transfer fetch via fleet": (0.9, ">= 0.9x the single node's session on the same path"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench fleet-swa`."""
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the fleet (default 3)")
    parser.add_argument("--snapshots", type=int, default=32,
                        help="V4.1-Flash snapshots (2.7 MB each) per put and get (default 32; --quick: 4)")
    parser.add_argument("--runs", type=int, default=8,
                        help=f"runs of {RUN_BLOCKS} blocks the Lookup's prompt spans (default 8; --quick: 3)")
    parser.add_argument("--repeat", type=int, default=9, help="rounds of each figure, the best kept (default 9)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests (figures too small to mean much)")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder, removed after)")


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the benchmark; see the module docstring.

    Raises:
        InvalidArgument: fewer than one node, snapshot, run or repeat.
    """
    snapshots = 4 if args.quick and args.snapshots == 32 else args.snapshots
    runs = 3 if args.quick and args.runs == 8 else args.runs
    repeat = 2 if args.quick and args.repeat == 9 else args.repeat
    if min(args.nodes, snapshots, runs, repeat) < 1:
        raise InvalidArgument("--nodes, --snapshots, --runs and --repeat must each be at least 1")
    report = Report(bench="fleet-swa")
    rng = np.random.default_rng(44)
    tokens = rng.integers(0, 50_000, runs * RUN_BLOCKS * BLOCK_TOKENS + 5).tolist()
    report.notes.update(nodes=args.nodes, snapshots=snapshots, snapshot_bytes=_snapshot_bytes(),
                        lookup_tokens=len(tokens), run_blocks=RUN_BLOCKS, cpus=os.cpu_count())
    with scratch(args.dir) as folder, contextlib.ExitStack() as stack:
        redis = RedisClusterProcesses(folder / "redis").start()
        stack.callback(redis.stop)
        etcd = EtcdProcess(folder / "etcd").start()
        stack.callback(etcd.stop)
        pool = {"KVSTORE_SWA_BACKEND": "redis-cluster", "KVSTORE_SWA_CLUSTER_NODES": redis.startup_nodes,
                "KVSTORE_SWA_CAP_BYTES": str(GiB), "KVSTORE_STORE_BLOCK_TOKENS": str(BLOCK_TOKENS),
                "KVSTORE_STORE_CAPACITY_BYTES": str(GiB)}
        single = NodeProcess(folder / "single", pool)
        stack.callback(single.stop)
        cluster = f"bench-{uuid.uuid4().hex[:8]}"
        fleet = {"KVSTORE_FLEET_ETCD": etcd.endpoint, "KVSTORE_FLEET_CLUSTER": cluster,
                 "KVSTORE_FLEET_RUN_BLOCKS": str(RUN_BLOCKS), "KVSTORE_FLEET_LEASE_TTL_S": "10"}
        nodes = [NodeProcess(folder / f"node{i}", {**pool, **fleet}) for i in range(args.nodes)]
        stack.callback(stop_all, nodes)  # together: each fleet node drains a second as it leaves
        import kvstore

        with kvstore.Client(single.target) as one, kvstore.Client(f"etcd://{etcd.endpoint}/{cluster}") as many:
            many.view.wait_until(lambda seen: len(seen) >= args.nodes, 60.0)  # type: ignore[attr-defined]
            with contextlib.ExitStack() as sessions:
                _figures(report, one, many, tokens, snapshots, repeat, rng, sessions)
    _targets(report)
    return report


def _snapshot_bytes() -> int:
    from kvstore.swa_snapshot import snapshot_bytes

    return snapshot_bytes(V4_1_FLASH, 256)


def _figures(report: Report, one: Client, many: Client, tokens: list[int], snapshots: int, repeat: int,
             rng: np.random.Generator, stack: contextlib.ExitStack) -> None:
    """Put, get and the Lookup with SWA candidates on both clients, each figure beside the single node's.

    The rounds interleave the two clients (single, fleet, single, ...), so the box's drift and the
    pool's filling touch both alike; each figure is the best round.
    """
    size = _snapshot_bytes()
    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    prompts = [rng.integers(0, 50_000, 256).tolist() for _ in range(snapshots)]
    clients = {"single": one, "fleet": many}
    calls: dict[str, dict[str, Callable[[], None]]] = {"put": {}, "get": {}, "lookup": {}, "fetch": {},
                                                      "fetch_shm": {}, "fetch_mixed": {}}
    blocks = len(tokens) // BLOCK_TOKENS
    positions = [b * BLOCK_TOKENS for b in range(blocks - CANDIDATES + 1, blocks + 1)]
    # One set of keys for both: the same Redis slots, so the masters' shares are the same for each client.
    keys = [one.swa.key(p) for p in prompts]
    for name, client in clients.items():
        calls["put"][name] = partial(_put, client, [(k, 256, data) for k in keys])
        calls["get"][name] = partial(_get, client, keys, size)
        client.put(tokens, [data[:client.block_bytes]] * blocks)
        client.swa.put(tokens, data[:client.swa.snapshot_bytes(positions[-2])], position=positions[-2])
        calls["lookup"][name] = partial(_lookup, client, tokens, positions)
        # A transfer session's fetch of the prompt's chain: both over the stream path.
        session = stack.enter_context(client.transfer(path="stream"))
        region = session.register(blocks * client.block_bytes)
        calls["fetch"][name] = partial(_fetch, session, client.hashes(tokens), region, blocks)
        # The same fetch on the shm path: the single node's session, and the fleet's mapping its region into
        # this host's nodes (F62: all of them here), then into one node only (the rest of the runs streamed).
        shm = stack.enter_context(client.transfer(path="shm"))
        calls["fetch_shm"][name] = partial(_fetch, shm, client.hashes(tokens), shm.register(region.size_bytes),
                                           blocks)
    from kvstore.client.fleet_transfer import FleetTransferSession

    here = sorted(many.view.nodes)[0]  # type: ignore[attr-defined]
    mixed = stack.enter_context(FleetTransferSession(many, local=[here]))
    calls["fetch_mixed"]["fleet"] = partial(_fetch, mixed, many.hashes(tokens),
                                            mixed.register(blocks * many.block_bytes), blocks)
    seconds = {what: dict.fromkeys(per_client, float("inf")) for what, per_client in calls.items()}
    for _ in range(repeat):
        for what, per_client in calls.items():
            for name, call in per_client.items():
                seconds[what][name] = min(seconds[what][name], timed(call))
    for name, client in clients.items():
        if client.swa.last_path != "direct":
            report.notes[f"{name} path"] = f"{client.swa.last_path}: {client.swa.direct_reason}"
    rate = snapshots * size / 1e6
    for what in ("put", "get"):
        report.add(Figure.against(f"swa {what} via fleet ({snapshots} snapshots)", rate / seconds[what]["fleet"],
                                  "MB/s", "a single node's client, same Redis Cluster", rate / seconds[what]["single"]))
    fetched = blocks * one.block_bytes / 1e6
    report.add(Figure.against(f"transfer fetch via fleet ({blocks} blocks, stream path)",
                              fetched / seconds["fetch"]["fleet"], "MB/s",
                              "a single node's transfer session, stream path", fetched / seconds["fetch"]["single"]))
    report.add(Figure.against(f"transfer fetch via fleet ({blocks} blocks, shm path, every node on this host)",
                              fetched / seconds["fetch_shm"]["fleet"], "MB/s",
                              "a single node's transfer session, shm path", fetched / seconds["fetch_shm"]["single"]))
    report.notes["one node this host's: runs over shm"] = f"{mixed.last_paths.count('shm')} of {len(mixed.last_paths)}"
    report.add(Figure.against(f"fleet fetch, one node this host's ({blocks} blocks, its runs shm, the rest streamed)",
                              fetched / seconds["fetch_mixed"]["fleet"], "MB/s",
                              "a single node's transfer session, shm path", fetched / seconds["fetch_shm"]["single"]))
    report.add(Figure.against(f"lookup with swa candidates via fleet ({len(tokens):,} tokens)",
                              seconds["lookup"]["fleet"] * 1000, "ms", "a single node's Lookup, same candidates",
                              seconds["lookup"]["single"] * 1000))


def _fetch(session: Any, hashes: list[bytes], region: Any, blocks: int) -> None:
    state = session.fetch(hashes, region)
    if state.done_prefix != blocks:
        raise RuntimeError(f"the transfer fetch landed {state.done_prefix} of {blocks} blocks")


def _put(client: Client, items: list[tuple[bytes, int, bytes]]) -> None:
    result = client.swa.put_many(items)
    if result.stored != len(items):
        raise RuntimeError(f"SWA put stored {result.stored} of {len(items)} snapshots ({result.failed} failed)")


def _get(client: Client, keys: list[bytes], size: int) -> None:
    got = client.swa.get_many(keys)
    if any(g is None or len(g) != size for g in got):
        raise RuntimeError(f"SWA get missed {sum(g is None for g in got)} of {len(keys)} snapshots")


def _lookup(client: Client, tokens: list[int], positions: list[int]) -> None:
    found = client.lookup(tokens, swa_positions=positions)
    if found.swa_position != positions[-2]:
        raise RuntimeError(f"the Lookup named snapshot {found.swa_position}, not {positions[-2]}")


def _targets(report: Report) -> None:
    """Say for each figure with a target whether it met it."""
    for f in report.figures:
        for prefix, (least, wording) in TARGETS.items():
            if f.name.startswith(prefix) and f.ratio is not None:
                report.notes[f"target {f.name}"] = f"{wording}: {'met' if f.ratio >= least else 'NOT MET'}"
