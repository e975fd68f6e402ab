"""Put, get and lookup of V4.1-Flash blocks through the service, against raw LMDB and raw gRPC.

In one run: a `kvstore serve` process takes >= 1 GiB of blocks as one long chain
(Put, by the path `Client.put` takes by default: the one-copy TCP transport where the
server offers it, docs/TRANSFER.md) and streams them back (Get); each round the same
blocks are put again as another chain by gRPC's PutStream (the second put figure, the
path before the TCP transport and the one a server without it gets); the same bytes go
through raw LMDB with the
same durability (one fsync'd transaction per batch) and through a raw gRPC
stream with no kvstore logic (a generic handler sending the same block-sized
messages). The service's group commit lets one fsync serve the batches waiting for
it, so it makes fewer commits than batches: the notes count both, and a second put
figure sets it against raw LMDB making as many commits as the service made (the
same blocks, after each service round); the notes also say where the put phase's
CPU went (the server, its event loop's thread, the client, raw LMDB) and how many
pages each faulted in. Then a Lookup of a 1M-token prompt: all its block hashes,
timed at the server (the tier's lookup over the stored chain) and over the wire.

Last, what auth costs: the store and a copy of it served by two `kvstore serve`
processes at once, one without tokens, one with a tenants file (the default
tenant's token, carried by every call), called in turn, the copies swapping
roles each round: Get of every block, the 1M-token Lookup, and a one-block
Lookup (where a call's fixed cost shows most). Best of each (the median of
the one-block Lookups); a ratio >= 0.95 meets the target (auth costs at most 5%).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.bench import store_events
from kvstore.bench.harness import (
    GiB,
    RawLmdb,
    process_stat,
    raw_stream_server,
    scratch,
    serve_process,
    stat_cpu_s,
    timed,
)
from kvstore.bench.report import Figure, Progress, Report
from kvstore.geometry import V4_1_FLASH


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench store`."""
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of blocks to put and get (default 1)")
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default 64)")
    parser.add_argument("--batch-blocks", type=int, default=64, help="blocks per Put/transaction (default 64)")
    parser.add_argument("--lookup-tokens", type=int, default=1_000_000, help="prompt length for the lookup figure")
    parser.add_argument("--auth-rounds", type=int, default=4,
                        help="rounds of the with/without auth comparison, each with two fresh servers (0: skip)")
    parser.add_argument("--auth-one-calls", type=int, default=1000,
                        help="one-block Lookups to each server per auth round, their median the figure (default 1000)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="scratch folder on the disk under test (default: a temp folder, removed after)")
    store_events.add_arguments(parser)


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the benchmark; see the module docstring."""
    block_bytes = V4_1_FLASH.block_bytes(args.block_tokens)
    n_blocks = max(int(args.gib * GiB) // block_bytes, 1)
    lookup_blocks = min(args.lookup_tokens // args.block_tokens, n_blocks)
    report = Report(bench="store")
    report.notes.update(blocks=n_blocks, block_bytes=block_bytes, total_bytes=n_blocks * block_bytes,
                        batch_blocks=args.batch_blocks, cpus=os.cpu_count())
    if lookup_blocks * args.block_tokens != args.lookup_tokens:
        report.notes["lookup_tokens"] = lookup_note(args.lookup_tokens, lookup_blocks, n_blocks, args)
    pool = np.random.default_rng(0).integers(0, 256, size=n_blocks * block_bytes, dtype=np.uint8).tobytes()
    blocks = [pool[i * block_bytes:(i + 1) * block_bytes] for i in range(n_blocks)]
    tokens = list(range(n_blocks * args.block_tokens))
    with scratch(args.dir) as folder:
        # Room for the chain twice: each round's blocks are put again by gRPC, as another chain.
        with serve_process(folder / "store", 2 * n_blocks * block_bytes, args.block_tokens) as target:
            puts, get_s, hashes, wire_lookup_s = _service(target, folder, tokens, blocks, args, lookup_blocks,
                                                          progress)
        server_lookup_s, cold_lookup_s, raw_scan_s = _server_lookup(
            folder / "store", args.block_tokens, n_blocks * block_bytes, hashes[:lookup_blocks])
        raw_get = _raw_grpc_get(n_blocks, block_bytes, progress)
        auth = _auth_cost(folder / "store", n_blocks * block_bytes, args, hashes, lookup_blocks, progress)
        # Events on against off (docs/EVENTS.md): a quarter of the blocks to each of two more servers.
        events = store_events.run(report, args, folder, blocks[:max(n_blocks // 4, 1)], progress)
    total = n_blocks * block_bytes / 1e9
    report.notes.update(put_batches=puts.batches, put_commits=puts.commits, raw_commits=puts.raw_commits)
    # Where the put phase's CPU went (docs/BENCHMARKS.md, `bench store`): None where /proc is not there.
    report.notes.update({f"put_{name}": value for name, value in puts.usage.as_notes().items()})
    report.notes["put_transport"] = puts.transport
    report.add(Figure.against("put", total / puts.put_s, "GB/s", "raw LMDB put, fsync per batch",
                              total / puts.raw_s))
    report.add(Figure.against("put over gRPC (PutStream)", total / puts.grpc_s, "GB/s",
                              "raw LMDB put, fsync per batch", total / puts.raw_s))
    # The service's group commit makes one fsync serve the batches that wait for it: fewer fsyncs than
    # batches (put_commits in the notes). Against raw LMDB making as many commits, same sizes, same run:
    report.add(Figure.against("put, raw LMDB at the service's commit count", total / puts.put_s, "GB/s",
                              "raw LMDB put, one fsync per service commit", total / puts.grouped_s))
    report.add(Figure.against("get", total / get_s, "GB/s", "raw gRPC stream, same messages", total / raw_get))
    label = f"lookup {lookup_blocks * args.block_tokens:,} tokens"
    report.add(Figure.against(f"{label} at server", server_lookup_s * 1e3, "ms",
                              f"raw LMDB get of all {lookup_blocks:,} hashes", raw_scan_s * 1e3))
    report.add(Figure.against(f"{label} at server, first sight (walks every record)", cold_lookup_s * 1e3, "ms",
                              f"raw LMDB get of all {lookup_blocks:,} hashes", raw_scan_s * 1e3))
    report.add(Figure(name=f"{label} over gRPC", value=wire_lookup_s * 1e3, unit="ms"))
    if auth:
        (get_on, get_off), (look_on, look_off), (one_on, one_off) = auth["get"], auth["lookup"], auth["one"]
        report.add(Figure.against("get with auth", total / get_on, "GB/s", "get without auth", total / get_off))
        report.add(Figure.against(f"{label} over gRPC with auth", look_on * 1e3, "ms",
                                  "same without auth", look_off * 1e3))
        report.add(Figure.against("lookup 1 block over gRPC with auth (median)", one_on * 1e6, "us",
                                  "same without auth", one_off * 1e6))
    for figure in events:
        report.add(figure)
    return report


def lookup_note(asked: int, lookup_blocks: int, n_blocks: int, args: argparse.Namespace) -> str:
    """Why the lookup figure's prompt is not the --lookup-tokens asked: whole blocks only, and no more
    than the bench stores."""
    bt = args.block_tokens
    why = (f"only {n_blocks:,} blocks are stored (--gib {args.gib:g}): raise --gib for a longer lookup"
           if lookup_blocks == n_blocks and asked // bt > n_blocks else
           f"a lookup covers whole {bt}-token blocks only")
    return f"{lookup_blocks * bt:,} of the {asked:,} asked: {why}"


def _auth_cost(data_dir: Path, data_bytes: int, args: argparse.Namespace, hashes: list[bytes], lookup_blocks: int,
               progress: Progress) -> dict[str, tuple[float, float]]:
    """{figure: (seconds with auth, without)}: two servers on copies of one store, called in turn.

    One copy holds a tenants file with the default tenant's token, so both serve the
    same blocks to the same tenant. Calls alternate between the two, one by one, so
    whatever else the machine does weighs on both alike; rounds swap which copy has
    auth and which goes first, so neither a copy's place on the disk nor the order
    favours one side.
    """
    import contextlib
    import shutil
    import statistics

    from kvstore.api_tokens import READ, WRITE, create
    from kvstore.client import Client

    if args.auth_rounds <= 0:
        return {}
    twin = data_dir.with_name(data_dir.name + "-twin")
    shutil.copytree(data_dir, twin)
    calls = {
        "get": (1, lambda c: sum(len(d) for _, _, d in c.stream(hashes))),
        "lookup": (5, lambda c: c.lookup_hashes(hashes[:lookup_blocks])),
        "one": (max(args.auth_one_calls, 1), lambda c: c.lookup_hashes(hashes[:1])),
    }
    samples: dict[tuple[str, bool], list[float]] = {}
    with progress.bar("auth: get and lookup, with and without", args.auth_rounds, "round") as bar:
        for r in range(args.auth_rounds):
            plain_dir, auth_dir = (data_dir, twin) if r % 2 == 0 else (twin, data_dir)
            (plain_dir / "tenants.json").unlink(missing_ok=True)
            token = create(auth_dir / "tenants.json", "default", frozenset({READ, WRITE}))[1]
            # Which server starts (and is called) first swaps too: the second of two
            # identical servers measured a few percent slower on a busy machine.
            sides = [(False, plain_dir, None), (True, auth_dir, token)][::1 if r % 2 == 0 else -1]
            with contextlib.ExitStack() as stack:
                clients = [(auth, stack.enter_context(Client(stack.enter_context(
                    serve_process(folder, data_bytes, args.block_tokens)), token=tok)))
                    for auth, folder, tok in sides]
                for _, client in clients:
                    calls["lookup"][1](client)  # a fresh server walks the chain once
                for name, (repeat, call) in calls.items():
                    for i in range(repeat):
                        for auth, client in clients[::1 if i % 2 == 0 else -1]:
                            seconds = timed(lambda call=call, client=client: call(client))  # type: ignore[misc]
                            samples.setdefault((name, auth), []).append(seconds)
            (auth_dir / "tenants.json").unlink()
            bar.update(1)
    shutil.rmtree(twin, ignore_errors=True)
    # Best of the large calls; the median of the one-block Lookups, whose spread (a
    # millisecond's worth of scheduling) dwarfs what is compared.
    pick: dict[str, Callable[[list[float]], float]] = {"get": min, "lookup": min, "one": statistics.median}
    return {name: (pick[name](samples[name, True]), pick[name](samples[name, False])) for name in calls}


@dataclass(frozen=True)
class _Puts:
    """The put phase: seconds of the service (by `Client.put`'s default path, and by gRPC), of raw LMDB with a
    commit per batch, of raw LMDB with the service's commit count; the counts (batches sent, the service's
    commits, raw's); and the default path's transport ("tcp", or why gRPC)."""

    put_s: float
    grpc_s: float
    raw_s: float
    grouped_s: float
    batches: int
    commits: int
    raw_commits: int
    usage: _PutUsage
    transport: str


@dataclass(kw_only=True)
class _PutUsage:
    """CPU seconds (user + system) and minor page faults of the put phase, summed over its rounds: the server
    process and its event loop's thread during the service's rounds, this process (the client, with gRPC's
    threads) during them, and this process during the raw LMDB rounds. None where it cannot be read."""

    server_cpu_s: float | None = 0.0
    server_loop_cpu_s: float | None = 0.0
    server_minor_faults: int | None = 0
    client_cpu_s: float = 0.0
    client_minor_faults: int = 0
    raw_cpu_s: float = 0.0
    raw_minor_faults: int = 0

    def as_notes(self) -> dict[str, float | int | None]:
        """The report's notes: each field by its name, seconds to the millisecond."""
        return {name: round(value, 3) if isinstance(value, float) else value for name, value in vars(self).items()}

    def add_server(self, before: tuple[float, float, int] | None, after: tuple[float, float, int] | None) -> None:
        """Add the server's usage between two `_server_usage` readings (None: unknown from then on)."""
        if before is None or after is None or self.server_cpu_s is None:
            self.server_cpu_s = self.server_loop_cpu_s = self.server_minor_faults = None
            return
        assert self.server_loop_cpu_s is not None and self.server_minor_faults is not None
        self.server_cpu_s += after[0] - before[0]
        self.server_loop_cpu_s += after[1] - before[1]
        self.server_minor_faults += after[2] - before[2]


def _self_usage() -> tuple[float, int]:
    """This process's CPU seconds (every thread's, user + system) and minor faults so far."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime, used.ru_minflt


def _server_pid(store: Path) -> int | None:
    """The pid of the `kvstore serve` holding the store at `store` (its lock file says it), None if unreadable."""
    import json

    from tiers.datadir import LOCK_NAME

    try:
        return int(json.loads((store / LOCK_NAME).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _server_usage(pid: int | None) -> tuple[float, float, int] | None:
    """(CPU seconds of process `pid`, of its main thread, which runs the event loop, its minor faults), from
    Linux's /proc; None elsewhere."""
    whole = process_stat(pid) if pid is not None else None
    loop = process_stat(pid, thread=pid) if pid is not None else None
    if whole is None or loop is None:
        return None
    return stat_cpu_s(whole), stat_cpu_s(loop), int(whole[7])


def _last_txn(store: Path) -> int:
    """The id of the last transaction committed in the LMDB environment at `store` (another process's)."""
    import lmdb

    env = lmdb.open(str(store), readonly=True, lock=False, max_dbs=8)
    try:
        return int(env.info()["last_txnid"])
    finally:
        env.close()


def _service(target: str, scratch: Path, tokens: list[int], blocks: list[bytes], args: argparse.Namespace,
             lookup_blocks: int, progress: Progress) -> tuple[_Puts, float, list[bytes], float]:
    from kvstore.client import Client, put_tcp
    from kvstore.prefix import ExtraKey

    batch = args.batch_blocks
    raw = RawLmdb(scratch / "raw-lmdb", len(blocks) * len(blocks[0]))
    grouped = RawLmdb(scratch / "raw-lmdb-grouped", len(blocks) * len(blocks[0]))
    # Rounds alternate the baselines and the service on the same disk, so drift in
    # the disk's speed (write-back, other tenants) hits all alike.
    rounds = 8
    step = -(-len(blocks) // rounds)
    raw_s = put_s = grouped_s = 0.0
    batches = commits = raw_commits = 0
    hashes: list[bytes] = []
    store = scratch / "store"
    usage, server = _PutUsage(), _server_pid(store)
    grpc_s, grpc_hashes, tcp_rounds, why = 0.0, list[bytes](), 0, ""
    with Client(target) as client, Client(target) as by_grpc:
        put_tcp.refuse(by_grpc.connection, "bench store: the gRPC put figure")
        # The same blocks as another chain (another extra key): all written, none found existing.
        other: list[ExtraKey] = ["bench-store-grpc"]
        with progress.bar("put: raw LMDB and kvstore", 3 * len(blocks) * len(blocks[0])) as bar:
            for lo in range(0, len(blocks), step):
                part = blocks[lo:lo + step]
                cpu, faults = _self_usage()
                start = time.perf_counter()
                raw_commits += raw.put(part, batch)
                raw_s += time.perf_counter() - start
                cpu_after, faults_after = _self_usage()
                usage.raw_cpu_s += cpu_after - cpu
                usage.raw_minor_faults += faults_after - faults
                bar.update(len(part) * len(part[0]))

                def by_grpc_put(lo: int = lo, part: list[bytes] = part) -> None:
                    nonlocal grpc_hashes, grpc_s
                    start = time.perf_counter()
                    grpc_hashes += by_grpc.put(tokens[: (lo + len(part)) * args.block_tokens], part, first_block=lo,
                                               parent=grpc_hashes[-1] if grpc_hashes else None, batch_blocks=batch,
                                               extra_keys=other).block_hashes
                    grpc_s += time.perf_counter() - start

                # The gRPC put goes first in odd rounds, last in even ones: neither comes always after the other.
                if lo // step % 2:
                    by_grpc_put()
                before = _last_txn(store)
                server_before, (cpu, faults) = _server_usage(server), _self_usage()
                by = put_tcp.why_not(client.connection, len(part) * len(part[0]))  # "": over TCP
                start = time.perf_counter()
                result = client.put(tokens[: (lo + len(part)) * args.block_tokens], part, first_block=lo,
                                    parent=hashes[-1] if hashes else None, batch_blocks=batch,
                                    on_batch=lambda n: bar.update(n * client.block_bytes))
                put_s += time.perf_counter() - start
                by = by or put_tcp.refused(client.connection)  # tried, and refused: by gRPC
                tcp_rounds += not by
                why = by or why
                cpu_after, faults_after = _self_usage()
                usage.client_cpu_s += cpu_after - cpu
                usage.client_minor_faults += faults_after - faults
                usage.add_server(server_before, _server_usage(server))
                made = _last_txn(store) - before  # the round's commits: nothing else writes meanwhile
                hashes.extend(result.block_hashes)
                batches += -(-len(part) // batch)
                commits += made
                # The same blocks again, in as many transactions as the service committed them in.
                grouped_s += timed(lambda part=part, made=made: grouped.put(  # type: ignore[misc]
                    part, -(-len(part) // max(made, 1))))
                bar.update(len(part) * len(part[0]))
                if not lo // step % 2:
                    by_grpc_put()
        raw.close()
        grouped.close()
        with progress.bar("kvstore get", len(blocks) * client.block_bytes) as bar:
            start = time.perf_counter()
            got = 0
            for _, _, data in client.stream(hashes):
                got += len(data)
                bar.update(len(data))
            get_s = time.perf_counter() - start
        if got != len(blocks) * client.block_bytes:
            raise RuntimeError(f"get returned {got} bytes, expected {len(blocks) * client.block_bytes}")
        wire_lookup_s = min(timed(lambda: client.lookup_hashes(hashes[:lookup_blocks])) for _ in range(5))
        # Which path `Client.put` took: the TCP transport in every round, or gRPC in some and why.
        transport = "tcp" if tcp_rounds == rounds else f"grpc in {rounds - tcp_rounds} of {rounds} rounds ({why})"
    return _Puts(put_s=put_s, grpc_s=grpc_s, raw_s=raw_s, grouped_s=grouped_s, batches=batches, commits=commits,
                 raw_commits=raw_commits, usage=usage, transport=transport), get_s, hashes, wire_lookup_s


def _server_lookup(data_dir: Path, block_tokens: int, capacity: int,
                   hashes: list[bytes]) -> tuple[float, float, float]:
    """(tier lookup of a chain seen before, of one never seen, raw per-hash LMDB scan) seconds, best of 5.

    A chain seen before is found by binary search (tiers/chains.py); one
    never seen is walked record by record, as a fresh server does.
    """
    from kvstore.config import StoreSettings
    from kvstore.native.records import meta_key
    from kvstore.prefix import BlockScope
    from tiers.lmdb_tier import LmdbBlockTier

    tier = LmdbBlockTier(StoreSettings(data_dir=data_dir, capacity_bytes=int(capacity * 1.2) + GiB,
                                       block_tokens=block_tokens))
    try:
        scope = BlockScope(V4_1_FLASH.fingerprint, "default")
        found = tier.lookup(scope, hashes)[0]
        if found != len(hashes):
            raise RuntimeError(f"lookup found {found} of {len(hashes)} blocks")
        lookup_s = min(timed(lambda: tier.lookup(scope, hashes)) for _ in range(5))

        def first_sight() -> None:
            tier.chains.forget()
            tier.lookup(scope, hashes)

        cold_s = min(timed(first_sight) for _ in range(5))

        def scan() -> None:
            with tier.env.begin() as txn:
                for h in hashes:
                    txn.get(meta_key(scope.key(h)), db=tier._records)

        scan_s = min(timed(scan) for _ in range(5))
    finally:
        tier.close()
    return lookup_s, cold_s, scan_s


def _raw_grpc_get(n: int, size: int, progress: Progress) -> float:
    """Seconds to stream n block-sized messages from a bare gRPC server in another process."""
    step = 1024  # the same per-call batch the kvstore client uses
    with raw_stream_server(n, size) as stream, progress.bar("raw gRPC stream", n * size) as bar:
        start = time.perf_counter()
        for lo in range(0, n, step):
            for msg in stream(lo, min(lo + step, n)):
                bar.update(len(msg))
        return time.perf_counter() - start
