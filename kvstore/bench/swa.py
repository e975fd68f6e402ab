"""SWA snapshot put/get through the kvstore service, and on the direct path, against raw redis-py.

Every side talks to the same Redis in one run: the gateway path (client -> gRPC
-> SwaPool servicer -> checksum and seal -> Redis pipeline), the direct path
(the client seals and checks records itself and talks to Redis as the ACL user
the gateway handed it: kvstore.client.swa_direct) and the baseline (redis-py
pipelined SET PX / GET of the same snapshots, in the same batch size). A ratio
below 1 is what a path costs over talking to Redis directly. The sides take
turns within each round (best of the rounds is kept), so a loaded machine
slows them alike. A single-snapshot fetch's p50 (direct get of one key against
one raw GET, alternating) is measured too. Snapshots are taken at prompt lengths window, window + 1, ...: half
even (a full window of rows, 2,703,360 B on V4.1-Flash), half odd (plus the raw
tail, 12,288 B more). Starts its own redis-server (loopback, free port, temp dir) unless
--redis-url is given, and an in-process kvstore server on port 0.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from kvstore import geometry as geometries
from kvstore.bench.harness import best_of, serve_process
from kvstore.bench.report import Figure, Progress, Report
from kvstore.swa_snapshot import snapshot_shape

BASELINE = "redis-py pipelined SET/GET, same bytes, same Redis"
RAW_GET = "one raw redis-py GET of a snapshot's bytes, same Redis"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench swa`."""
    parser.add_argument("--redis-url", help="an existing Redis to use (default: start a throwaway redis-server)")
    parser.add_argument("--snapshots", type=int, default=48, help="snapshots per round (default 48)")
    parser.add_argument("--batch", type=int, default=8, help="snapshots per call on both sides (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best is reported (default 3)")
    parser.add_argument("--fetches", type=int, default=200, help="single-snapshot fetches timed for the p50 "
                        "(default 200)")


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
    """Measure put and get of SWA snapshots both ways; report rates and ratios."""
    import statistics
    import time

    import redis

    from kvstore.client import Client, SwaClient

    report = Report(bench="swa")
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

        phases: list[tuple[str, Callable[[], None]]] = [
            ("gateway put", put(swa)), ("direct put", put(direct)), ("raw put", raw_put),
            ("gateway get", get(swa)), ("direct get", get(direct)), ("raw get", raw_get)]
        seconds: dict[str, float] = {}
        with progress.bar("rounds", args.rounds * len(phases), unit="phase") as bar:
            for _ in range(args.rounds):
                for name, fn in phases:  # in turn, so a loaded machine slows every side alike
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
    report.notes.update(snapshot_bytes_even=sizes[0], snapshot_bytes_odd=sizes[min(1, n - 1)], snapshots=n,
                        batch=batch, rounds=args.rounds, fetches=args.fetches,
                        redis="given" if args.redis_url else "started by the bench", cpus=os.cpu_count())
    return report
