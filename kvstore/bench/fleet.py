"""A fleet of `kvstore serve` nodes on one host, against a single `kvstore serve` in the same run.

The bench starts its own etcd (the `etcd` binary on PATH) and its own nodes on
free loopback ports in a temp folder, and stops them all at the end, on an
error and on Ctrl-C. First a single `kvstore serve` (no fleet) takes the blocks
(Put), streams them back (Get) and answers the Lookup of a 1M-token prompt: the
baselines. Then, for each node count and replication factor, a fresh fleet
(its own cluster name in the one etcd) does the same through the fleet client
(`kvstore.Client("etcd://...")`, which routes each run itself), and its Get is
set beside the same runs read from the same nodes directly. For each node count
at its highest replication, one node is added (the bytes it is sent, against
the ideal 1/N of every copy) and then, at replication 2, one original node is
killed with SIGKILL: the survivors' re-replication rate, from the moment its
lease ends to the last survivor's pass over the new membership (their own
records in etcd), against the bulk transport between two processes (Mooncake's
TCP batch read; the raw gRPC stream of the same block size where Mooncake is
not importable, as the figure's baseline says). The nodes copy without their
rate limit (`repair_bytes_per_s` at its maximum): the figure is the mechanism's
speed, not the configured cap. Where Mooncake is importable the nodes run it
(`[transfer] bulk = "mooncake"`), so their copies go over it (docs/FLEET.md F18);
the note says how many of the bytes did.

The Lookup's prompt is stored in the small test geometry (10 KB blocks of 64
tokens): a Lookup reads hashes and records, never block bytes, so its cost is
the same, and storing 1M tokens of full-size blocks in every fleet would take
most of the run. Put and Get move full-size V4.1-Flash blocks. Three Lookups,
each against the single node's same Lookup: the stored prompt sent again, the
same with a lease (each node leases what it found; the Release is untimed), and
a prompt whose first half is stored (every run is asked: one call per node,
docs/FLEET.md F50).

Targets (printed with met / not met): Get through the router >= 0.9x of the
same nodes read directly; the 1M-token Lookup <= 1.5x the single node's (ratio
>= 0.67); Put at replication 2 >= 0.45x replication 1; an added node is sent
<= 1.2/N of the bytes (ratio ideal / moved >= 0.83); re-replication >= 0.5x
the bulk transport's rate. Beside the kill's rate, with no target, the same bytes
put into plain LMDB on the same disk (one fsync'd transaction per 16 MiB): where
the copies end, so where a disk's LMDB takes less than the network carries, the
figure shows how near the copies come to the store's own limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvstore.bench.fleet_processes import EtcdProcess, NodeProcess, stop_all
from kvstore.bench.harness import GiB, RawLmdb, raw_stream_server, scratch, timed
from kvstore.bench.report import Figure, Progress, Report
from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY, V4_1_FLASH

if TYPE_CHECKING:
    from kvstore.client import Client
    from kvstore.client.fleet import FleetClient
    from kvstore.fleet.etcd import EtcdSession

BLOCK_TOKENS = 64
#: Seconds a node's lease outlives it (etcd's least): a killed node leaves the view within this.
LEASE_TTL_S = 2
#: Longest wait for a fleet to settle (every node's pass over the membership done, nothing left).
SETTLE_DEADLINE_S = 300.0
#: Repeats of each Get and Lookup (the best is kept: the least disturbed by the rest of the box).
REPEAT = 3
#: Lookups of each kind: the best is the figure (as every round's), the median goes in the notes beside it (five let
#: one best swing 0.6-1.3x between kinds that make the same calls on a shared host).
LOOKUP_REPEAT = 5
#: The durable-write baseline's batch: the repairer's CopyBlocks size (gateway/fleet_repair.py BATCH_BYTES).
DURABLE_BATCH_BYTES = 16 << 20

T = TypeVar("T")

#: name prefix -> (least ratio, how the target reads); a figure whose name starts with the prefix has it.
TARGETS: dict[str, tuple[float | None, str]] = {
    "get via router": (0.9, ">= 0.9x the same nodes read directly"),
    "lookup": (1 / 1.5, "<= 1.5x the single node's time (ratio >= 0.67)"),
    "put r=2 vs r=1": (0.45, ">= 0.45x replication 1"),
    "bytes sent to an added node": (1 / 1.2, "<= 1.2/N of the bytes (ratio ideal/moved >= 0.83)"),
    "re-replication vs durable writes": (0.5, ">= 0.5x the disk's durable write rate (same bytes, same writers)"),
    # Where the copies end: how near they come to what the store itself can write durably on this disk.
    "re-replication vs raw LMDB": (None, "none (where the copies end: the store's own durable write rate)"),
    "re-replication": (0.5, ">= 0.5x the bulk transport's rate"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench fleet`."""
    parser.add_argument("--nodes", type=counts, default=None,
                        help="node counts, comma-separated (default 1,2,4; --quick: 1,2)")
    parser.add_argument("--replication", type=counts, default=(1, 2),
                        help="replication factors (default 1,2; those above a fleet's node count are skipped)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--blocks", type=int, default=None,
                      help="V4.1-Flash blocks (64 tokens, 57 KB) to put and get (default 1024, 58 MB)")
    size.add_argument("--gib", type=float, default=None, help="or the same as GiB of blocks")
    parser.add_argument("--tokens", type=int, default=1_048_576,
                        help="prompt length of the Lookup figure (default 1,048,576)")
    parser.add_argument("--run-blocks", type=int, default=256,
                        help="blocks a run places together ([fleet] run_blocks, default 256)")
    parser.add_argument("--join-prompts", type=int, default=512,
                        help="one-run prompts stored before a node joins, its share counted over them (default 512: "
                        "the Put's chain is a few runs, too few to measure a 1/N share by)")
    parser.add_argument("--placement-seed", type=int, default=23,
                        help="node ids derived from this seed, the same in every run, so the runs each node "
                        "holds and the bytes a kill loses are too (default 23; -1: random ids, a fresh placement "
                        "each run)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and 1 and 2 nodes, for tests (figures too small to mean much)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="scratch folder on the disk under test (default: a temp folder, removed after)")


@dataclass(frozen=True)
class Sizes:
    """What one run stores."""

    nodes: tuple[int, ...]
    replication: tuple[int, ...]
    blocks: int
    lookup_blocks: int
    run_blocks: int
    join_prompts: int
    placement_seed: int = -1


def sizes(args: argparse.Namespace) -> Sizes:
    """The run's sizes from its flags (--quick: 1 and 2 nodes, 48 blocks, a 8,192-token lookup, 16-block runs).

    Raises:
        InvalidArgument: nothing to store.
    """
    nodes = args.nodes or ((1, 2) if args.quick else (1, 2, 4))
    replication = args.replication
    block_bytes = V4_1_FLASH.block_bytes(BLOCK_TOKENS)
    if args.gib is not None:
        blocks = int(args.gib * GiB) // block_bytes
    else:
        blocks = args.blocks if args.blocks is not None else (48 if args.quick else 1024)
    tokens = 8192 if args.quick and args.tokens == 1_048_576 else args.tokens
    run_blocks = 16 if args.quick and args.run_blocks == 256 else args.run_blocks
    if blocks < 1 or tokens < BLOCK_TOKENS or run_blocks < 1:
        raise InvalidArgument("--blocks/--gib, --tokens and --run-blocks must each store at least one block")
    join = 64 if args.quick and args.join_prompts == 512 else args.join_prompts
    return Sizes(nodes=nodes, replication=replication, blocks=blocks, lookup_blocks=tokens // BLOCK_TOKENS,
                 run_blocks=run_blocks, join_prompts=max(join, 1), placement_seed=args.placement_seed)


def counts(text: str) -> tuple[int, ...]:
    """`1,2,4` -> (1, 2, 4), sorted, each once (an argparse type: a bad list is a usage error)."""
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"whole numbers separated by commas, not {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"numbers >= 1, not {text!r}")
    return values


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the benchmark; see the module docstring."""
    size = sizes(args)
    report = Report(bench="fleet")
    block_bytes = V4_1_FLASH.block_bytes(BLOCK_TOKENS)
    report.notes.update(blocks=size.blocks, block_bytes=block_bytes, total_bytes=size.blocks * block_bytes,
                        lookup_tokens=size.lookup_blocks * BLOCK_TOKENS, run_blocks=size.run_blocks,
                        cpus=os.cpu_count(), lookup_geometry=TINY.name)
    from kvstore.client import Client

    # The single node's Lookups check the hashes while the call flies where this is on (docs/FLEET.md F83), as the
    # fleet's first round always does: the Lookup figures' baseline moves with it.
    report.notes["lookup_overlap_check"] = Client.overlap_check
    data = Data.make(size, block_bytes, TINY.block_bytes(BLOCK_TOKENS))
    with scratch(args.dir) as folder, contextlib.ExitStack() as stack:
        etcd = EtcdProcess(folder / "etcd").start()
        stack.callback(etcd.stop)
        single = _single(folder / "single", data, progress)
        bench = FleetBench(folder, etcd.endpoint, data, size, single, report, progress)
        with bench.status:
            for n in size.nodes:
                usable = [r for r in size.replication if r <= n]
                skipped = [r for r in size.replication if r > n]
                if skipped:
                    report.notes[f"n={n}"] = f"replication {skipped} skipped: more copies than nodes"
                for r in usable:
                    bench.config(n, r, grow=r == usable[-1])
    _targets(report)
    return report


@dataclass
class Data:
    """The blocks every store takes: the payload (full-size blocks) and the Lookup's prompt (small ones)."""

    tokens: list[int]
    blocks: list[bytes]
    lookup_tokens: list[int]
    lookup_blocks: list[bytes]
    #: One-block prompts (one run each) a joining node's share is counted over: many runs.
    join_tokens: list[list[int]]

    @property
    def payload_bytes(self) -> int:
        """Bytes of the payload (one copy)."""
        return sum(len(b) for b in self.blocks)

    @classmethod
    def make(cls, size: Sizes, block_bytes: int, lookup_block_bytes: int) -> Data:
        """Random tokens and bytes (64 distinct blocks, repeated: LMDB stores each anyway)."""
        rng = np.random.default_rng(23)
        pool = [rng.integers(0, 256, block_bytes, dtype=np.uint8).tobytes() for _ in range(64)]
        small = [rng.integers(0, 256, lookup_block_bytes, dtype=np.uint8).tobytes() for _ in range(64)]
        return cls(tokens=rng.integers(0, 50_000, size.blocks * BLOCK_TOKENS).tolist(),
                   blocks=[pool[i % 64] for i in range(size.blocks)],
                   lookup_tokens=rng.integers(0, 50_000, size.lookup_blocks * BLOCK_TOKENS).tolist(),
                   lookup_blocks=[small[i % 64] for i in range(size.lookup_blocks)],
                   join_tokens=rng.integers(0, 50_000, (size.join_prompts, BLOCK_TOKENS)).tolist())


@dataclass(frozen=True)
class Single:
    """The single `kvstore serve`'s seconds: the baselines."""

    put_s: float
    get_s: float
    #: The Lookup figures' seconds by kind (LOOKUP_KINDS), best and median.
    lookup_s: dict[str, float]
    lookup_median_s: dict[str, float]


def _node_env(capacity: int, fleet: dict[str, object] | None = None) -> dict[str, str]:
    env = {"KVSTORE_STORE_CAPACITY_BYTES": str(capacity), "KVSTORE_STORE_BLOCK_TOKENS": str(BLOCK_TOKENS)}
    env.update({f"KVSTORE_FLEET_{k.upper()}": str(v) for k, v in (fleet or {}).items()})
    if fleet is not None and not _mooncake_missing():  # F18: the nodes copy over the bulk transport
        env["KVSTORE_TRANSFER_BULK"] = "mooncake"
    return env


def _mooncake_missing() -> str:
    from kvstore.bench.transfer_baselines import mooncake_missing

    return mooncake_missing()


def _capacity(data: Data) -> int:
    stored = data.payload_bytes + sum(len(b) for b in data.lookup_blocks)
    return int(stored * 1.5) + GiB


def _put(client: Client, tokens: list[int], blocks: list[bytes], desc: str,
         progress: Progress) -> tuple[float, list[bytes]]:
    """Seconds to put the chain, and its hashes."""
    with progress.bar(desc, len(blocks) * len(blocks[0])) as bar:
        start = time.perf_counter()
        result = client.put(tokens, blocks, on_batch=lambda n: bar.update(n * len(blocks[0])))
        seconds = time.perf_counter() - start
    if result.written_blocks != len(blocks):
        raise RuntimeError(f"{desc}: {result.written_blocks} of {len(blocks)} blocks written")
    return seconds, list(result.block_hashes)


def stream_s(client: Client, hashes: Sequence[bytes], expect: int) -> float:
    """Seconds to stream every block of `hashes`; checks the bytes that came back."""
    start = time.perf_counter()
    got = sum(len(data) for _, _, data in client.stream(list(hashes)))
    seconds = time.perf_counter() - start
    if got != expect:
        raise RuntimeError(f"get returned {got:,} bytes, expected {expect:,}")
    return seconds


def _single(folder: Path, data: Data, progress: Progress) -> Single:
    """Put, Get and the Lookup on one `kvstore serve` without a fleet."""
    from kvstore.client import Client

    node = NodeProcess(folder, _node_env(_capacity(data)))
    try:
        with Client(node.target) as client:
            put_s, hashes = _put(client, data.tokens, data.blocks, "single serve: put", progress)
            get_s = min(stream_s(client, hashes, data.payload_bytes) for _ in range(REPEAT))
        with Client(node.target, geometry=TINY.name) as small:
            _put(small, data.lookup_tokens, data.lookup_blocks, "single serve: lookup's prompt", progress)
            lookup_s, lookup_median_s = _lookups_s(small, data)
    finally:
        node.stop()
    return Single(put_s=put_s, get_s=get_s, lookup_s=lookup_s, lookup_median_s=lookup_median_s)


def _one_lookup_s(client: Client, kind: str, hashes: list[bytes], lease_ms: int, expect: int) -> float:
    """Seconds of one Lookup (its Release untimed); checks what it found."""
    start = time.perf_counter()
    found = client.lookup_hashes(hashes, lease_ms=lease_ms)
    elapsed = time.perf_counter() - start
    if found.lease_id:
        client.release(found.lease_id)
    if found.found_blocks != expect:
        raise RuntimeError(f"the {kind}Lookup found {found.found_blocks} blocks, not {expect}")
    return elapsed


def _lookups_s(client: Client, data: Data, between: Callable[[], object] = lambda: None
               ) -> tuple[dict[str, float], dict[str, float]]:
    """Best and median seconds of LOOKUP_REPEAT Lookups of each kind (LOOKUP_KINDS), after one (a fresh chain is
    walked once): the stored prompt sent again; the same with a lease, released after each (untimed); a prompt whose
    first half is stored (the rest new tokens)."""
    whole = client.hashes(data.lookup_tokens)
    half = len(data.lookup_tokens) // 2 // BLOCK_TOKENS * BLOCK_TOKENS
    other = client.hashes(data.lookup_tokens[:half] + [t + 1 for t in data.lookup_tokens[half:]])
    best, median = {}, {}
    for kind, hashes, lease_ms, expect in (("", whole, 0, len(whole)), ("leased ", whole, 60_000, len(whole)),
                                           ("half stored ", other, 0, half // BLOCK_TOKENS)):
        once = partial(_one_lookup_s, client, kind, hashes, lease_ms, expect)
        once()
        times = []
        for _ in range(LOOKUP_REPEAT):
            between()
            times.append(once())
        best[kind], median[kind] = min(times), statistics.median(times)
    return best, median


class Status:
    """The fleet's records in etcd (nodes and their re-replication progress), over one session."""

    def __init__(self, etcd: str) -> None:
        from kvstore.config_sections import FleetSettings
        from kvstore.fleet.membership import session_for

        self.loop = asyncio.new_event_loop()
        self.session: EtcdSession = session_for(FleetSettings(etcd=etcd), timeout_s=5.0)

    def __enter__(self) -> Status:
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.close()

    def read(self, cluster: str) -> tuple[set[str], dict[str, dict[str, object]]]:
        """(live node ids, node id -> its re-replication record as a dict)."""
        from dataclasses import asdict

        from kvstore.fleet.membership import read_nodes
        from kvstore.fleet.repair_progress import RepairProgress, repair_prefix

        async def read() -> tuple[set[str], dict[str, dict[str, object]]]:
            nodes, _ = await read_nodes(self.session, cluster)
            found = await self.session.call(lambda c: c.get_prefix(repair_prefix(cluster)))
            records = (RepairProgress.from_json(kv.value) for kv in found)
            return {n.record.node_id for n in nodes}, {p.node_id: asdict(p) for p in records if p is not None}

        return self.loop.run_until_complete(read())

    def wait_settled(self, cluster: str, live: set[str]) -> dict[str, dict[str, object]]:
        """Wait until exactly `live` are registered and each finished a pass over them with nothing left.

        Raises:
            RuntimeError: not within SETTLE_DEADLINE_S.
        """
        deadline = time.monotonic() + SETTLE_DEADLINE_S
        while True:
            nodes, repairs = self.read(cluster)
            done = [repairs.get(n) for n in live]
            if nodes == live and all(r is not None and not r["running"] and r["passes"]
                                     and sorted(r["planned_nodes"]) == sorted(live)  # type: ignore[call-overload]
                                     and r["under_replicated_bytes"] == 0 for r in done):
                return repairs
            if time.monotonic() > deadline:
                raise RuntimeError(f"fleet {cluster} did not settle in {SETTLE_DEADLINE_S:.0f} s: {repairs}")
            time.sleep(0.01)  # polling etcd's records under the deadline above

    def wait_gone(self, cluster: str, node_id: str) -> float:
        """Wait until `node_id`'s registration is gone; the wall-clock time it was first seen gone."""
        deadline = time.monotonic() + SETTLE_DEADLINE_S
        while node_id in self.read(cluster)[0]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node_id} stayed registered past {SETTLE_DEADLINE_S:.0f} s")
            time.sleep(0.005)  # polling etcd under the deadline; the lease ends within LEASE_TTL_S
        return time.time()


def copied(repairs: dict[str, dict[str, object]], nodes: set[str]) -> int:
    """Bytes the `nodes` have copied to others since they started (their own records)."""
    return sum(int(repairs[n]["copied_bytes"]) for n in nodes if n in repairs)  # type: ignore[call-overload]


class FleetBench:
    """The fleets of one run, one after another, on one etcd."""

    def __init__(self, folder: Path, etcd: str, data: Data, size: Sizes, single: Single, report: Report,
                 progress: Progress) -> None:
        self.folder, self.etcd, self.data, self.size = folder, etcd, data, size
        self.single, self.report, self.progress = single, report, progress
        self.status = Status(etcd)
        self.put_r1: dict[int, float] = {}

    def config(self, n: int, r: int, *, grow: bool) -> None:
        """One fleet of `n` nodes at replication `r`: Put, Get, (grow: add a node, kill one), the Lookup."""
        cluster = f"bench-{uuid.uuid4().hex[:8]}"
        settings = {"etcd": self.etcd, "cluster": cluster, "lease_ttl_s": LEASE_TTL_S, "replication": r,
                    "run_blocks": self.size.run_blocks, "repair_bytes_per_s": 1 << 40,
                    "repair_interval_s": 86_400}
        env = _node_env(_capacity(self.data), settings)
        label = f"n={n} r={r}"
        with contextlib.ExitStack() as stack:
            count = iter(range(1 << 20))
            every: list[NodeProcess] = []
            stack.callback(stop_all, every)  # all at once: each fleet node drains a second as it leaves

            def start(k: int) -> list[NodeProcess]:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(k) as pool:
                    started = list(pool.map(lambda i: NodeProcess(self.folder / cluster / f"node{i}", env,
                                                                  _store_id(self.size.placement_seed, n, r, i)),
                                            [next(count) for _ in range(k)]))
                every.extend(started)
                return started

            nodes = start(n)
            live = {node.node_id for node in nodes}
            self.status.wait_settled(cluster, live)
            address = f"etcd://{self.etcd}/{cluster}"
            self._data_path(address, nodes, live, n, r, label)
            if grow:
                live = self._grow(cluster, address, nodes, start, live, n, r)
            self._lookup(address, live, r, label)

    def _client(self, address: str, r: int, live: set[str], geometry: str = "") -> FleetClient:
        from kvstore.client.fleet import FleetClient

        client = FleetClient(address, replication=r, geometry=geometry)
        try:
            client.view.wait_until(lambda nodes: set(nodes) == live, SETTLE_DEADLINE_S)
        except BaseException:
            client.close()
            raise
        return client

    def _data_path(self, address: str, nodes: list[NodeProcess], live: set[str], n: int, r: int,
                   label: str) -> None:
        from kvstore.client import Client

        data, single = self.data, self.single
        gb = data.payload_bytes / 1e9
        fleet = self._client(address, r, live)
        with fleet:
            put_s, chain = _put(fleet, data.tokens, data.blocks, f"{label}: put", self.progress)
            # The direct baseline reads each run from its first replica, one node after another.
            by_node: dict[str, list[bytes]] = {}
            for run in fleet.placement(chain):
                by_node.setdefault(run.replicas[0], []).extend(chain[run.first_block:run.end_block])
            targets = {node.node_id: node.target for node in nodes}
            direct_clients = {k: Client(targets[k]) for k in by_node}
            try:
                router_s = direct_s = float("inf")
                with self.progress.bar(f"{label}: get, router and direct in turns", 2 * REPEAT, "round") as bar:
                    for _ in range(REPEAT):
                        router_s = min(router_s, stream_s(fleet, chain, data.payload_bytes))
                        bar.update(1)
                        direct_s = min(direct_s, sum(
                            stream_s(direct_clients[k], hashes, len(hashes) * len(data.blocks[0]))
                            for k, hashes in by_node.items()))
                        bar.update(1)
            finally:
                for c in direct_clients.values():
                    c.close()
        self.report.add(Figure.against(f"put {label}", gb / put_s, "GB/s", "single kvstore serve put, same blocks",
                                       gb / single.put_s))
        if r == 1:
            self.put_r1[n] = put_s
        elif 1 in self.size.replication and n in self.put_r1:
            self.report.add(Figure.against(f"put r={r} vs r=1 n={n}", gb / put_s, "GB/s", f"put r=1 n={n}",
                                           gb / self.put_r1[n]))
        self.report.add(Figure.against(f"get {label}", gb / router_s, "GB/s", "single kvstore serve get, same blocks",
                                       gb / single.get_s))
        self.report.add(Figure.against(f"get via router {label}", gb / router_s, "GB/s",
                                       "the same runs read from the same nodes directly", gb / direct_s))

    def _grow(self, cluster: str, address: str, nodes: list[NodeProcess],
              start: Callable[[int], list[NodeProcess]], live: set[str], n: int, r: int) -> set[str]:
        """Add a node (bytes it is sent against 1/N); at r >= 2, then kill an original one (re-replication)."""
        join = self._join_set(address, r, live, f"n={n} r={r}")
        before = copied(self.status.read(cluster)[1], live)
        with self.progress.bar(f"n={n} r={r}: a node joins, the others copy its share", 1, "step") as bar:
            added = start(1)[0]
            grown = live | {added.node_id}
            moved = copied(self.status.wait_settled(cluster, grown), grown) - before
            bar.update(1)
        # The join set's bytes the new node holds: it started empty and only re-replication wrote to it.
        held = _held(added.target, join)
        block = len(self.data.blocks[0])
        fraction = held / (len(join) * r)
        ideal = 1 / (n + 1)
        self.report.add(Figure(name=f"bytes sent to an added node {n}->{n + 1} r={r}", value=fraction,
                               unit="of all copies", baseline=f"ideal 1/{n + 1}", baseline_value=ideal,
                               ratio=ideal / fraction if fraction else float("inf")))
        stored = (self.data.payload_bytes + len(join) * block) * r
        self.report.notes[f"join {n}->{n + 1} r={r}"] = (
            f"{held:,} of the {len(join):,} one-run prompts' {len(join) * r:,} copies sent to the new node; "
            f"with the {_runs(len(self.data.blocks), self.size.run_blocks)} runs of the Put's chain, "
            f"{moved:,} of {stored:,} bytes ({moved / stored:.3f})")
        if r < 2:
            self.report.notes[f"re-replication n={n} r={r}"] = "skipped: one copy, nothing to copy from once killed"
            return grown
        victim = nodes[0]
        survivors = grown - {victim.node_id}
        repairs = before_repairs = self.status.read(cluster)[1]
        before = copied(repairs, survivors)
        with self.progress.bar(f"n={n + 1} r={r}: a node is killed, the survivors copy", 1, "step") as bar:
            victim.kill()
            gone_at = self.status.wait_gone(cluster, victim.node_id)
            repairs = self.status.wait_settled(cluster, survivors)
            bar.update(1)
        sent = copied(repairs, survivors) - before
        # The last survivor's record is written as its pass ends (its own clock: this host's).
        done_at = max(float(repairs[s]["updated_at"]) for s in survivors)  # type: ignore[arg-type]
        seconds = max(done_at - gone_at, 1e-6)
        measured = max(sent, 16 << 20)  # the baselines move at least 16 MiB, however little a kill lost
        name, rate = _bulk_rate(measured, len(self.data.blocks[0]), self.progress)
        self.report.add(Figure.against(f"re-replication after a node kill {n + 1}->{n} r={r}", sent / seconds / 1e9,
                                       "GB/s", name, rate))
        # A copy is durable when answered (F17): the receivers' disk bounds the rate. The same bytes written
        # and fsync'd in the same batches by as many writers as survivors copied (3->2: one sends, one takes
        # what it lacks), in the nodes' folder, same run.
        senders = max(1, sum(copied(repairs, {s}) > copied(before_repairs, {s}) for s in survivors))
        disk = _durable_write_rate(self.folder, measured, senders)
        self.report.add(Figure.against(f"re-replication vs durable writes {n + 1}->{n} r={r}", sent / seconds / 1e9,
                                       "GB/s", f"{senders} writer{'s' * (senders > 1)}, write + fsync of 16 MiB "
                                       "batches, same disk, same bytes", disk))
        # The same bytes into plain LMDB (one environment a writer, as each receiver has its own store), one
        # fsync'd transaction per batch: where a disk's LMDB takes less than the network baseline carries, the
        # copies cannot reach that baseline, and this figure says how near they come to the store's own limit.
        lmdb_rate = _lmdb_durable_rate(self.folder, measured, len(self.data.blocks[0]), senders)
        self.report.add(Figure.against(f"re-replication vs raw LMDB durable puts {n + 1}->{n} r={r}",
                                       sent / seconds / 1e9, "GB/s",
                                       f"{senders} raw LMDB writer{'s' * (senders > 1)}, one fsync'd transaction "
                                       "per 16 MiB batch, same disk, same blocks", lmdb_rate))
        bulk = sum(int(repairs[s].get("bulk_bytes", 0)) - int(before_repairs.get(s, {}).get("bulk_bytes", 0))  # type: ignore[call-overload]
                   for s in survivors)
        self.report.notes[f"re-replication {n + 1}->{n}"] = (f"{sent:,} bytes in {seconds:.2f} s, from the lease's "
                                                             "end to the last survivor's pass done; "
                                                             f"{bulk:,} of them over the bulk transport")
        return survivors

    def _join_set(self, address: str, r: int, live: set[str], label: str) -> list[bytes]:
        """Store the one-run prompts whose copies a joining node's share is counted over; their keys."""
        from kvstore.prefix import BlockScope

        data = self.data
        scope = BlockScope(V4_1_FLASH.fingerprint, "default")
        keys: list[bytes] = []
        with self._client(address, r, live) as fleet, \
                self.progress.bar(f"{label}: {len(data.join_tokens):,} one-run prompts", len(data.join_tokens),
                                  "prompt") as bar:
            for tokens in data.join_tokens:
                keys.extend(scope.key(h) for h in fleet.put(tokens, data.blocks[:1]).block_hashes)
                bar.update(1)
        return keys

    def _lookup(self, address: str, live: set[str], r: int, label: str) -> None:
        data = self.data
        fleet = self._client(address, r, live, TINY.name)
        with fleet:
            _put(fleet, data.lookup_tokens, data.lookup_blocks, f"{label}: lookup's prompt", self.progress)
            # The copies a Lookup did not ask are refreshed in the background: sent between Lookups, untimed.
            seconds, medians = _lookups_s(fleet, data, between=lambda: fleet.refresher.flush(30.0))
        tokens = len(data.lookup_tokens)
        for kind, s in seconds.items():
            self.report.add(Figure.against(f"lookup {tokens:,} tokens {kind}{label}", s * 1e3, "ms",
                                           f"single kvstore serve, same {kind}Lookup",
                                           self.single.lookup_s[kind] * 1e3))
        # the medians beside the best: single / fleet ms, each kind
        self.report.notes[f"lookup medians ms {label}"] = ", ".join(
            f"{kind or 'sent again '}{self.single.lookup_median_s[kind] * 1e3:.3f} / {m * 1e3:.3f}"
            for kind, m in medians.items())


def _store_id(seed: int, n: int, r: int, i: int) -> str | None:
    """The id of fleet n, r's node i under `seed` (None for seed -1: the store's own random id).

    Placement is a function of the run and the live ids (docs/FLEET.md F10): fixed ids give every run
    of the bench the same runs on each node, so the bytes a kill loses, and its rate, compare run to run.
    """
    if seed < 0:
        return None
    import hashlib

    return hashlib.sha256(f"kvstore-bench-fleet {seed} n={n} r={r} node{i}".encode()).hexdigest()[:32]


def _runs(blocks: int, run_blocks: int) -> int:
    return -(-blocks // run_blocks)


def _held(target: str, keys: list[bytes]) -> int:
    """How many of `keys` the node at `target` holds (its Fleet service, asked directly)."""
    import grpc

    from kvstore.v1 import fleet_pb2 as pb
    from kvstore.v1 import fleet_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        return sum(fleet_pb2_grpc.FleetStub(channel).HeldBlocks(pb.HeldBlocksRequest(keys=keys), timeout=60).held)


def _bulk_rate(nbytes: int, block_bytes: int, progress: Progress) -> tuple[str, float]:
    """(baseline name, GB/s) of the bulk transport moving `nbytes` between two processes on this host."""
    from kvstore.bench.transfer_baselines import mooncake_missing, mooncake_read_s

    n = max(nbytes // block_bytes, 1)
    if not mooncake_missing():
        source = np.random.default_rng(1).integers(0, 256, n * block_bytes, dtype=np.uint8)
        with progress.bar("bulk transport: Mooncake batch read", 1, "step"):
            seconds = mooncake_read_s(memoryview(source.data), block_bytes, 64, REPEAT)
        return "Mooncake TCP batch read between two processes, same block size", n * block_bytes / seconds / 1e9
    with raw_stream_server(n, block_bytes) as stream, progress.bar("bulk baseline: raw gRPC stream", REPEAT,
                                                                   "round") as bar:
        best = float("inf")
        for _ in range(REPEAT):
            best = min(best, timed(lambda: _drain(stream(lo, min(lo + 1024, n)) for lo in range(0, n, 1024))))
            bar.update(1)
    return ("raw gRPC stream between two processes, same block size (Mooncake not importable)",
            n * block_bytes / best / 1e9)


def _durable_write_rate(folder: Path, nbytes: int, writers: int) -> float:
    """GB/s of `writers` threads writing `nbytes` between them to files in `folder`, each 16 MiB batch
    fsync'd before the next (as a CopyBlocks is committed before its answer); the best of REPEAT."""
    batch = os.urandom(DURABLE_BATCH_BYTES)
    share = -(-nbytes // writers)

    def write(i: int) -> None:
        path = folder / f"durable-{i}.bench"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = share
            while left > 0:
                left -= os.write(fd, batch[:min(left, DURABLE_BATCH_BYTES)])
                os.fsync(fd)
        finally:
            os.close(fd)
            path.unlink()

    return share * writers / _best_parallel_s(write, range(writers)) / 1e9


def _lmdb_durable_rate(folder: Path, nbytes: int, block_bytes: int, writers: int) -> float:
    """GB/s of `writers` threads, each with its own plain LMDB environment in `folder`, putting `nbytes` between
    them in blocks of `block_bytes`, one fsync'd transaction per DURABLE_BATCH_BYTES (a CopyBlocks batch); the
    best of REPEAT. The environments are removed after."""
    import shutil

    block = os.urandom(block_bytes)
    per_writer = max(1, -(-nbytes // writers) // block_bytes)
    batch = max(1, DURABLE_BATCH_BYTES // block_bytes)
    paths = [folder / f"raw-lmdb-{i}.bench" for i in range(writers)]
    envs = [RawLmdb(path, per_writer * block_bytes * REPEAT) for path in paths]
    try:
        best = _best_parallel_s(lambda env: env.put([block] * per_writer, batch), envs)
        return per_writer * writers * block_bytes / best / 1e9
    finally:
        for env in envs:
            env.close()
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)


def _best_parallel_s(write: Callable[[T], object], writers: Iterable[T]) -> float:
    """The best of REPEAT seconds for `write` of every item of `writers` at once, a thread each."""
    from concurrent.futures import ThreadPoolExecutor

    items = list(writers)
    with ThreadPoolExecutor(len(items)) as pool:
        return min(timed(lambda: list(pool.map(write, items))) for _ in range(REPEAT))


def _drain(streams: Iterator[Iterator[bytes]]) -> None:
    for s in streams:
        for _ in s:
            pass


def _targets(report: Report) -> None:
    """Each figure with a target: its ratio against it, met or not met (in the notes)."""
    for f in report.figures:
        for prefix, (least, text) in TARGETS.items():
            if f.name.startswith(prefix) and f.ratio is not None:
                verdict = "no target" if least is None else "met" if f.ratio >= least else "NOT MET"
                report.notes[f"target {f.name}"] = f"{f.ratio:.2f}x, target {text}: {verdict}"
                break
