"""SWA snapshot put/get through the kvstore service against raw redis-py SET/GET of the same bytes.

Both sides talk to the same Redis in one run: the service path (client -> gRPC
-> SwaPool servicer -> checksum and seal -> redis.asyncio pipeline) and the
baseline (redis-py pipelined SET PX / GET of the same snapshots, in the same
batch size). A ratio below 1 is what the service costs over talking to Redis
directly. Snapshots are taken at prompt lengths window, window + 1, ...: half
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
from pathlib import Path
from typing import Any

from kvstore import geometry as geometries
from kvstore.bench.harness import best_of, serve_process
from kvstore.bench.report import Figure, Progress, Report
from kvstore.swa_snapshot import snapshot_shape

BASELINE = "redis-py pipelined SET/GET, same bytes, same Redis"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench swa`."""
    parser.add_argument("--redis-url", help="an existing Redis to use (default: start a throwaway redis-server)")
    parser.add_argument("--snapshots", type=int, default=48, help="snapshots per round (default 48)")
    parser.add_argument("--batch", type=int, default=8, help="snapshots per call on both sides (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best is reported (default 3)")


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
    import redis

    from kvstore.client import Client

    report = Report(bench="swa")
    with _redis(args.redis_url) as url, _kvstore(url, own_redis=args.redis_url is None) as target, \
            Client(target) as client, redis.Redis.from_url(url) as raw:
        swa = client.swa
        n, batch = args.snapshots, args.batch
        window = snapshot_shape(geometries.resolve(client.geometry)).window
        positions = [window + i for i in range(n)]
        sizes = [swa.snapshot_bytes(t) for t in positions]
        payload = [os.urandom(size) for size in sizes]
        keys = swa.keys(list(range(positions[-1])), positions)
        raw_keys = [b"kvstore-bench:raw:" + k for k in keys]
        batches = [(start, min(start + batch, n)) for start in range(0, n, batch)]
        total_bytes = sum(sizes)
        total = total_bytes * args.rounds

        def span(lo: int, hi: int) -> int:
            return sum(sizes[lo:hi])

        def service_put(bar: Any) -> Callable[[], None]:
            def go() -> None:
                for lo, hi in batches:
                    swa.put_many(list(zip(keys[lo:hi], positions[lo:hi], payload[lo:hi], strict=True)))
                    bar.update(span(lo, hi))
            return go

        def service_get(bar: Any) -> Callable[[], None]:
            def go() -> None:
                for lo, hi in batches:
                    got = swa.get_many(keys[lo:hi])
                    assert all(g is not None for g in got), "snapshot missing during the benchmark"
                    bar.update(span(lo, hi))
            return go

        def raw_put(bar: Any) -> Callable[[], None]:
            def go() -> None:
                for lo, hi in batches:
                    pipe = raw.pipeline(transaction=False)
                    for k, d in zip(raw_keys[lo:hi], payload[lo:hi], strict=True):
                        pipe.set(k, d, px=300_000)
                    pipe.execute()
                    bar.update(span(lo, hi))
            return go

        def raw_get(bar: Any) -> Callable[[], None]:
            def go() -> None:
                for lo, hi in batches:
                    pipe = raw.pipeline(transaction=False)
                    for k in raw_keys[lo:hi]:
                        pipe.get(k)
                    assert all(g is not None for g in pipe.execute())
                    bar.update(span(lo, hi))
            return go

        seconds: dict[str, float] = {}
        for name, make in (("service put", service_put), ("raw put", raw_put),
                           ("service get", service_get), ("raw get", raw_get)):
            with progress.bar(name, total) as bar:
                seconds[name] = best_of(make(bar), args.rounds)
        raw.delete(*raw_keys)
        swa.delete_many(keys)

    for op in ("put", "get"):
        ours, base = seconds[f"service {op}"], seconds[f"raw {op}"]
        report.add(Figure.against(f"{op} throughput", total_bytes / ours / 1e9, "GB/s", BASELINE,
                                  total_bytes / base / 1e9))
        report.add(Figure.against(f"{op} snapshots per second", n / ours, "snap/s", BASELINE, n / base))
        report.add(Figure.against(f"{op} latency per batch", ours / len(batches) * 1e3, "ms", BASELINE,
                                  base / len(batches) * 1e3))
    report.notes.update(snapshot_bytes_even=sizes[0], snapshot_bytes_odd=sizes[min(1, n - 1)], snapshots=n,
                        batch=batch, rounds=args.rounds,
                        redis="given" if args.redis_url else "started by the bench", cpus=os.cpu_count())
    return report
