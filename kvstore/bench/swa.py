"""SWA snapshot put/get through the kvstore service, on the direct paths, against their raw peers.

Two backends (`--backend`, both by default), each against its own raw peer in
the same run:

Redis (`redis`):
Every side talks to the same Redis in one run: the gateway path (client -> gRPC
-> SwaPool servicer -> checksum and seal -> Redis pipeline), the direct path
(the client seals and checks records itself and talks to Redis as the ACL user
the gateway handed it: kvstore.client.swa_direct) and the baseline (redis-py
pipelined SET PX / GET of the same snapshots, in the same batch size). A ratio
below 1 is what a path costs over talking to Redis directly. The sides take
turns within each round (best of the passes is kept), so a loaded machine slows
them alike: the gateway last in each group, each phase after a pause, the direct
and raw sides swapping places every round. A single-snapshot fetch's p50 (direct
get of one key against one raw GET, alternating) is measured too. Snapshots are
taken at prompt lengths window, window + 1, ...: half even (a full window of
rows, 2,703,360 B on V4.1-Flash), half odd (plus the raw tail, 12,288 B more).
Starts its own redis-server (loopback, free port, temp dir) unless --redis-url
is given, and a `kvstore serve` process on port 0.

Embedded pool (`memory`): the shared-memory path (kvstore.client.swa_shm: the
client copies each snapshot into or out of its tenant's arena in the server's
shared memory, and a control request on a unix socket moves only keys and
offsets) and the gateway path, against the fair raw peer of a pool in another
process on the same host: one raw unary gRPC round trip (an empty reply from a
bare generic-handler server, harness.RAW_SERVER) per batch plus a same-process
memcpy of each snapshot (into a slot of a shared mapping for a put; out of it
into new bytes for a get, as the client returns). The single-fetch p50 is one
such round trip plus one snapshot's copy. "shm+verify" is
SwaClient(verify=True): puts copied into the sealed arena and checksummed by
the server as the client writes them (WRITTEN notes), sealed when COMMIT
answers, where a plain shm put's records are copied and checksummed by the
server's sealing thread just after (within the pause between phases here).
Gets are the same on both: every shm get checks its copy against the server's
checksum, verify or not."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore import geometry as geometries
from kvstore.bench.harness import best_of, serve_process
from kvstore.bench.report import Figure, Progress, Report
from kvstore.swa_snapshot import snapshot_shape

if TYPE_CHECKING:
    from kvstore.client import SwaClient

BASELINE = "redis-py pipelined SET/GET, same bytes, same Redis"
RAW_GET = "one raw redis-py GET of a snapshot's bytes, same Redis"
EMBEDDED_BASELINE = "one raw unary gRPC round trip per batch + memcpy of each snapshot"
EMBEDDED_RAW_GET = "one raw unary gRPC round trip + memcpy of the snapshot"
BACKENDS = ("both", "redis", "memory")
#: Passes per round of the phases that take tens of milliseconds to 0.3 s (all but the Redis gateway's).
FAST_PASSES = 3
#: Pause before each embedded phase (the server finishes what the last phase left it).
SETTLE_S = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench swa`."""
    parser.add_argument("--backend", choices=BACKENDS, default="both",
                        help="which pool to measure: redis (direct path), memory (shared-memory path) or both")
    parser.add_argument("--redis-url", help="an existing Redis to use (default: start a throwaway redis-server)")
    parser.add_argument("--snapshots", type=int, default=48, help="snapshots per round (default 48)")
    parser.add_argument("--batch", type=int, default=8, help="snapshots per call on both sides (default 8)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds; the best is reported (default 3). The fast phases (direct, raw, shm) take "
                        f"{FAST_PASSES} passes a round, so one stall of a shared machine does not decide a ratio; "
                        "the Redis gateway one pass a round")
    parser.add_argument("--fetches", type=int, default=200, help="single-snapshot fetches timed for the p50 "
                        "(default 200)")
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help=f"pause before each timed phase (default {SETTLE_S}; 0 in the tests, which time nothing)")


@contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    from kvstore.bench.redis_server import RedisServer

    with tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            yield server.url
        finally:
            server.stop()


@contextmanager
def _kvstore(redis_url: str, *, own_redis: bool) -> Iterator[str]:
    """A `kvstore serve` process using `redis_url` as its SWA pool; yields its target."""

    env = {"KVSTORE_SWA_BACKEND": "redis", "KVSTORE_SWA_REDIS_URL": redis_url,
           "KVSTORE_SWA_CAP_BYTES": str(4 << 30), "KVSTORE_SWA_SOCKET_TIMEOUT_S": "30",
           # A Redis we started is ours to configure; someone else's keeps its own limits.
           "KVSTORE_SWA_CONFIGURE_REDIS": "true" if own_redis else "false"}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-swa-") as tmp, \
            serve_process(Path(tmp) / "store", 1 << 28, 64, env) as target:
        yield target



def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Measure put and get of SWA snapshots on each backend's paths against its raw peer; report rates and ratios."""
    report = Report(bench="swa")
    if args.backend in ("both", "memory"):
        _run_embedded(args, progress, report)
    if args.backend in ("both", "redis"):
        _run_redis(args, progress, report)
    return report


def _run_redis(args: argparse.Namespace, progress: Progress, report: Report) -> None:
    """The Redis backend: gateway and direct paths against raw redis-py."""
    import statistics
    import time

    import redis

    from kvstore.client import Client, SwaClient

    with _redis(args.redis_url) as url, _kvstore(url, own_redis=args.redis_url is None) as target, \
            Client(target) as client, redis.Redis.from_url(url) as raw:
        swa = SwaClient(client.connection, path="gateway")
        direct = SwaClient(client.connection, path="direct")
        n, batch = args.snapshots, args.batch
        window = snapshot_shape(geometries.resolve(client.geometry)).window
        positions = [window + i for i in range(n)]
        sizes = [swa.snapshot_bytes(t) for t in positions]
        payload = [os.urandom(size) for size in sizes]
        keys = swa.keys(list(range(positions[-1])), positions)
        raw_keys = [b"kvstore-bench:raw:" + k for k in keys]
        batches = [(start, min(start + batch, n)) for start in range(0, n, batch)]
        total_bytes = sum(sizes)

        put, get = _batched_calls(keys, positions, payload, batches)

        def raw_put() -> None:
            for lo, hi in batches:
                pipe = raw.pipeline(transaction=False)
                for k, d in zip(raw_keys[lo:hi], payload[lo:hi], strict=True):
                    pipe.set(k, d, px=300_000)
                pipe.execute()

        def raw_get() -> None:
            for lo, hi in batches:
                pipe = raw.pipeline(transaction=False)
                for k in raw_keys[lo:hi]:
                    pipe.get(k)
                assert all(g is not None for g in pipe.execute())

        # The gateway's phases go last in each group and every phase starts after a pause: a server still
        # freeing a gateway call's 21 MB messages would otherwise slow the phase after it. The direct and
        # raw sides swap places every round, so neither always runs first.
        groups: list[tuple[tuple[str, Callable[[], None]], ...]] = [
            (("direct put", put(direct)), ("raw put", raw_put), ("gateway put", put(swa))),
            (("direct get", get(direct)), ("raw get", raw_get), ("gateway get", get(swa)))]
        for group in groups:  # warm: connections, the direct path's user and the batch limit before any timing
            for _, fn in group:
                fn()
        seconds: dict[str, float] = {}
        # A direct or raw phase takes 0.1-0.3 s here: FAST_PASSES passes a round for those two (as the
        # embedded section has), so one stall of a shared machine does not decide a ratio; the gateway, ten
        # times slower, runs in the first pass of each round (`--rounds` times in all).
        passes = FAST_PASSES * args.rounds
        with progress.bar("passes", passes * 4 + args.rounds * 2, unit="phase") as bar:
            for pass_ in range(passes):
                for mine, peer, gateway in groups:
                    sides = [peer, mine] if pass_ % 2 else [mine, peer]
                    for name, fn in sides + [gateway] * (pass_ % FAST_PASSES == 0):
                        time.sleep(args.settle_s)  # in turn, so a loaded machine slows every side alike
                        seconds[name] = min(seconds.get(name, float("inf")), best_of(fn, 1))
                        bar.update(1)
        assert direct.last_path == "direct", f"the direct path was not taken: {direct.direct_reason}"
        latency: dict[str, list[float]] = {"direct": [], "gateway": [], "raw": []}
        with progress.bar("single fetches", args.fetches, unit="fetch") as bar:
            for i in range(args.fetches):
                j = i % n
                fetches: tuple[tuple[str, Callable[[], object]], ...] = (
                    ("direct", partial(direct.get_many, [keys[j]])),
                    ("gateway", partial(swa.get_many, [keys[j]])),
                    ("raw", partial(raw.get, raw_keys[j])))
                for name, fetch in fetches:
                    start = time.perf_counter()
                    fetch()
                    latency[name].append(time.perf_counter() - start)
                bar.update(1)
        direct.close()
        raw.delete(*raw_keys)
        swa.delete_many(keys)

    for op in ("put", "get"):
        base = seconds[f"raw {op}"]
        for side in ("gateway", "direct"):
            ours = seconds[f"{side} {op}"]
            report.add(Figure.against(f"{side} {op} throughput", total_bytes / ours / 1e9, "GB/s", BASELINE,
                                      total_bytes / base / 1e9))
            report.add(Figure.against(f"{side} {op} latency per batch", ours / len(batches) * 1e3, "ms", BASELINE,
                                      base / len(batches) * 1e3))
    p50 = {name: statistics.median(values) * 1e3 for name, values in latency.items()}
    for side in ("direct", "gateway"):
        report.add(Figure.against(f"{side} single-snapshot fetch p50", p50[side], "ms", RAW_GET, p50["raw"]))
    from kvstore.client.swa_put import OVERLAP_MIN_CPUS
    from kvstore.host import usable_cpus

    report.notes.update(snapshot_bytes_even=sizes[0], snapshot_bytes_odd=sizes[min(1, n - 1)], snapshots=n,
                        batch=batch, rounds=args.rounds, passes=f"{FAST_PASSES} a round for direct and raw, "
                        "1 for the gateway (best kept)", fetches=args.fetches,
                        redis="given" if args.redis_url else "started by the bench", cpus=os.cpu_count(),
                        # How the direct put took its checksums (kvstore.client.swa_put).
                        direct_put_checksum="overlapped (worker thread)" if usable_cpus() >= OVERLAP_MIN_CPUS
                        else "streamed (after each piece is sent)")


@contextmanager
def _raw_unary() -> Iterator[Callable[[], bytes]]:
    """The cheapest gRPC round trip: a bare generic-handler server in its own process answering
    an empty reply (harness.RAW_SERVER's Unary); yields the call."""
    import subprocess
    import sys

    import grpc

    from kvstore.bench.harness import RAW_SERVER

    proc = subprocess.Popen([sys.executable, "-c", RAW_SERVER, "1", "1"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/bench.Raw/Unary")
            yield partial(call, bytes(8))  # asks for 0 bytes back
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _run_embedded(args: argparse.Namespace, progress: Progress, report: Report) -> None:
    """The embedded pool: the shared-memory and gateway paths against a round trip + memcpy."""
    import mmap
    import statistics
    import time

    from kvstore.client import Client, SwaClient

    env = {"KVSTORE_SWA_BACKEND": "memory", "KVSTORE_SWA_CAP_BYTES": str(4 << 30)}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-swa-") as tmp, \
            serve_process(Path(tmp) / "store", 1 << 28, 64, env) as target, Client(target) as client, \
            _raw_unary() as unary:
        gateway = SwaClient(client.connection, path="gateway")
        shm = SwaClient(client.connection, path="direct")
        checked = SwaClient(client.connection, path="direct", verify=True)
        n, batch = args.snapshots, args.batch
        window = snapshot_shape(geometries.resolve(client.geometry)).window
        positions = [window + i for i in range(n)]
        sizes = [gateway.snapshot_bytes(t) for t in positions]
        payload = [os.urandom(size) for size in sizes]
        keys = gateway.keys(list(range(positions[-1])), positions)
        batches = [(start, min(start + batch, n)) for start in range(0, n, batch)]
        total_bytes = sum(sizes)
        # The raw peer's pool: one slot per snapshot in a shared mapping (as the arena is).
        slot = max(sizes)
        pool = mmap.mmap(-1, slot * n)
        view = memoryview(pool)

        put, get = _batched_calls(keys, positions, payload, batches)

        def raw_put() -> None:
            for lo, hi in batches:
                unary()
                for i in range(lo, hi):
                    view[i * slot:i * slot + sizes[i]] = payload[i]

        def raw_get() -> None:
            for lo, hi in batches:
                unary()
                got = [bytes(view[i * slot:i * slot + sizes[i]]) for i in range(lo, hi)]
                assert len(got) == hi - lo

        def raw_fetch(i: int) -> bytes:
            unary()
            return bytes(view[i * slot:i * slot + sizes[i]])

        # The gateway's phases go last in each group and every phase starts after a pause: a server
        # still freeing a gateway call's 21 MB messages would otherwise slow the phase after it.
        phases: list[tuple[str, Callable[[], None]]] = [
            ("shm put", put(shm)), ("shm+verify put", put(checked)), ("raw put", raw_put),
            ("gateway put", put(gateway)),
            ("shm get", get(shm)), ("shm+verify get", get(checked)), ("raw get", raw_get),
            ("gateway get", get(gateway))]
        seconds: dict[str, float] = {}
        # A phase takes tens of milliseconds here: FAST_PASSES passes a round, so one stall of a shared
        # machine does not decide a figure.
        passes = FAST_PASSES * args.rounds
        with progress.bar("embedded passes", passes * len(phases), unit="phase") as bar:
            for _ in range(passes):
                for name, fn in phases:  # in turn, so a loaded machine slows every side alike
                    time.sleep(args.settle_s)
                    seconds[name] = min(seconds.get(name, float("inf")), best_of(fn, 1))
                    bar.update(1)
        assert shm.last_path == "shm", f"the shared-memory path was not taken: {shm.direct_reason}"
        latency: dict[str, list[float]] = {"shm": [], "gateway": [], "raw": []}
        with progress.bar("embedded single fetches", args.fetches, unit="fetch") as bar:
            for i in range(args.fetches):
                j = i % n
                fetches: tuple[tuple[str, Callable[[], object]], ...] = (
                    ("shm", partial(shm.get_many, [keys[j]])), ("gateway", partial(gateway.get_many, [keys[j]])),
                    ("raw", partial(raw_fetch, j)))
                for name, fetch in fetches:
                    start = time.perf_counter()
                    fetch()
                    latency[name].append(time.perf_counter() - start)
                bar.update(1)
        shm.close()
        checked.close()
        gateway.delete_many(keys)
        view.release()
        pool.close()

    for op in ("put", "get"):
        base = seconds[f"raw {op}"]
        for side in ("shm", "shm+verify", "gateway"):
            if f"{side} {op}" not in seconds:
                continue
            ours = seconds[f"{side} {op}"]
            label = f"embedded {side} {op}"
            report.add(Figure.against(f"{label} throughput", total_bytes / ours / 1e9, "GB/s", EMBEDDED_BASELINE,
                                      total_bytes / base / 1e9))
            report.add(Figure.against(f"{label} latency per batch", ours / len(batches) * 1e3, "ms",
                                      EMBEDDED_BASELINE, base / len(batches) * 1e3))
    p50 = {name: statistics.median(values) * 1e3 for name, values in latency.items()}
    for side in ("shm", "gateway"):
        report.add(Figure.against(f"embedded {side} single-snapshot fetch p50", p50[side], "ms", EMBEDDED_RAW_GET,
                                  p50["raw"]))
    from kvstore.native.swa_digest import NATIVE

    report.notes.update(embedded_snapshots=n, embedded_batch=batch, embedded_rounds=args.rounds,
                        embedded_passes=f"{FAST_PASSES} a round, every phase (best kept)",
                        embedded_raw_fetch_p50_ms=round(p50["raw"], 3), cpus=os.cpu_count(),
                        # Native: non-temporal copies into the arena, one-pass copy and checksum out of it.
                        embedded_native_copies=NATIVE)


def _batched_calls(keys: list[bytes], positions: list[int], payload: list[bytes], batches: list[tuple[int, int]]
                   ) -> tuple[Callable[[SwaClient], Callable[[], None]], Callable[[SwaClient], Callable[[], None]]]:
    """Factories of one pass of batched puts and of batched gets through a client (either path)."""
    def put(side: SwaClient) -> Callable[[], None]:
        def go() -> None:
            for lo, hi in batches:
                side.put_many(list(zip(keys[lo:hi], positions[lo:hi], payload[lo:hi], strict=True)))
        return go

    def get(side: SwaClient) -> Callable[[], None]:
        def go() -> None:
            for lo, hi in batches:
                got = side.get_many(keys[lo:hi])
                assert all(g is not None for g in got), "snapshot missing during the benchmark"
        return go

    return put, get
