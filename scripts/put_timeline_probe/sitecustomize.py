"""A probe of a durable Put's time inside `kvstore serve` under `kvstore bench store` (docs/BENCHMARKS.md, `bench
store`, helper P5's budget): whether the LMDB writer is busy all the time, what it does beyond raw LMDB's `txn.put`
+ commit, and whether the receive and plan of batch n+1 run beside the commit of batch n.

Loaded by Python at start from PYTHONPATH (as `sitecustomize`), so it reaches the `kvstore serve` child that the
bench starts and the bench itself; it does nothing in any other process, nor without PUT_PROBE_DIR:

    mkdir -p /tmp/probe && PYTHONPATH=scripts/put_timeline_probe PUT_PROBE_DIR=/tmp/probe \\
        kvstore bench store --gib 0.25 --auth-rounds 0 --events-rounds 0
    python scripts/put_timeline_probe/summarize.py /tmp/probe

In the server, one line per event (wall from `time.perf_counter`, one clock across processes on Linux, and the
thread's CPU): each TCP put frame read (`TcpPuts._frame`), each plan, `put_many` (the writer), `_put_all`,
`_put_in`, the commit (from `_save_state`'s return to `Tally.committed`), inside it the wait for the commit before
to be flushed (R35, `before_commit`), and on the flusher's thread each flush and its marker's write (R34); in the
bench, each `Client.put` and the path it took (the TCP rounds are the ones summarized). Lines are written as they
happen (the bench terminates the server). A diagnostic: it wraps private methods and may need updating as they move.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_DIR = os.environ.get("PUT_PROBE_DIR")


def _on_import(module: str, then: Any) -> None:
    """Run `then()` once `module` has been executed (its names exist), the first time it is imported."""
    import importlib.abc
    import importlib.util

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != module:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.loader is not None
            run = spec.loader.exec_module

            def exec_module(m: Any) -> None:
                run(m)
                then()

            spec.loader.exec_module = exec_module  # type: ignore[method-assign, assignment]
            return spec

    sys.meta_path.insert(0, Finder())


if _DIR and "serve" in sys.argv[1:3]:
    import threading
    import time

    _lock = threading.Lock()
    _out = open(os.path.join(_DIR, f"serve-{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115

    def _event(name: str, t0: float, t1: float, cpu_s: float = 0.0, extra: str = "") -> None:
        with _lock:
            _out.write(f"{name} {threading.get_ident()} {t0:.6f} {t1:.6f} {cpu_s:.6f} {extra}\n")

    def _wrap(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                _event(label, t0, time.perf_counter(), time.thread_time() - c0)

        setattr(owner, name, timed)

    def _mark(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def marked(*args: Any, **kwargs: Any) -> Any:
            now = time.perf_counter()
            _event(label, now, now)
            return inner(*args, **kwargs)

        setattr(owner, name, marked)

    def _patch_server() -> None:
        import gateway.kvstore_servicer as servicer
        import gateway.transfer_tcp_put as tcp_put
        import tiers.durable as durable
        import tiers.lmdb_tier as lmdb_tier
        import tiers.puts as puts

        # The writer's transactions (R34: committed, then flushed by the store's flusher, off the write lock).
        _wrap(lmdb_tier.LmdbBlockTier, "commit_many", "put_many")
        _wrap(durable.DurableCommits, "before_commit", "wait_flush")
        _wrap(durable.DurableCommits, "_flush", "flush")
        _wrap(durable, "_write_marker", "marker")
        _wrap(lmdb_tier.LmdbBlockTier, "_save_state", "save_state")
        _mark(lmdb_tier.Tally, "committed", "committed")
        _wrap(puts, "_put_all", "put_all")
        _wrap(puts, "_put_in", "put_in")
        _wrap(servicer.KVStoreServicer, "plan_put", "plan")
        _wrap(tcp_put.TcpPuts, "_frame", "frame")
        _mark(tcp_put.TcpPuts, "_release", "ack")

    _on_import("gateway.server", _patch_server)

elif _DIR and "bench" in sys.argv[1:3]:
    import time

    _BENCH_DIR: str = _DIR

    def _patch_bench() -> None:
        import kvstore.client as client
        from kvstore.client import put_tcp

        inner = client.Client.put
        out = open(os.path.join(_BENCH_DIR, f"bench-{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115

        def put(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(self, *args, **kwargs)
            finally:
                path = "grpc" if put_tcp.refused(self.connection) else "tcp"
                out.write(f"{path} {t0:.6f} {time.perf_counter():.6f}\n")

        client.Client.put = put  # type: ignore[method-assign]

    _on_import("kvstore.bench.store", _patch_bench)
