"""A probe of the Lookup's tail inside `kvstore serve` under `kvstore bench load` (docs/BENCHMARKS.md, `bench load`,
"Lookup's tail under load"): where a Lookup's time goes on the server, to split the clients' p99 into the handler's
own time and the wait in the event loop's queue before it runs.

Loaded by Python at start from PYTHONPATH (as `sitecustomize`), so it reaches the `kvstore serve` child that the
bench starts, and the bench's client processes (each writes LOOKUP_PROBE_OUT.client-PID); it does nothing in any
other process, nor without LOOKUP_PROBE_OUT. Use a fresh path each run (the clients' files of an earlier run would
join with this one's, the prompts being the same):

    rm -f /tmp/probe.json*
    PYTHONPATH=scripts/lookup_tail_probe LOOKUP_PROBE_OUT=/tmp/probe.json kvstore bench load --clients 16 --seconds 5
    python scripts/lookup_tail_probe/summarize.py /tmp/probe.json

Per Lookup: the handler's wall time; its index read's wall, CPU and run-queue wait (/proc schedstat: preempted), the
rest of that wall being asleep (the GIL taken back, page faults); whether a group commit was running when it began;
whether it called the tier's executor or awaited a refresh. Also the event loop's lag (a 1 ms sleep's overshoot) and
each group commit's time and size; and each Lookup from the first interceptor's start (its headers in) to its
handler's return, which summarize.py joins with the clients' send and answer times. Written every second to
LOOKUP_PROBE_OUT (the server is terminated, not stopped, by the bench). A diagnostic: it wraps private methods and
may need updating as they move.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if os.environ.get("LOOKUP_PROBE_OUT") and "serve" in sys.argv[1:3]:
    import asyncio
    import contextvars
    import json
    import threading
    import time

    import grpc

    from gateway import call_outcome, kvstore_servicer, put_group
    from tiers import lmdb_tier

    _OUT = os.environ["LOOKUP_PROBE_OUT"]
    _current: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("probe_lookup", default=None)
    _lookups: list[dict[str, Any]] = []
    _lags: list[float] = []
    _commits: list[tuple[float, int]] = []
    _started = threading.Event()
    _schedstat: dict[str, Any] = {}

    _Servicer, _Groups, _Tier = kvstore_servicer.KVStoreServicer, put_group.PutGroups, lmdb_tier.LmdbBlockTier
    _calls: list[dict[str, Any]] = []  # each Lookup from the first interceptor's start to its handler's return
    _lookup, _index_read, _commit = _Servicer.Lookup, _Servicer._index_read, _Groups._commit
    _call, _touch_soon = _Tier.call, _Tier.touch_soon

    def _runqueue_s() -> float:
        """This thread's time spent runnable but not running (the second field of its schedstat)."""
        f = _schedstat.get("f")
        if f is None:  # the loop thread's own, kept open: a read per Lookup, not an open
            path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
            f = _schedstat["f"] = open(path, "rb", buffering=0)  # noqa: SIM115
        f.seek(0)
        return int(f.read().split()[1]) / 1e9

    def _dump() -> None:
        while True:
            time.sleep(1.0)
            with open(_OUT + ".tmp", "w") as out:
                json.dump({"lookups": list(_lookups), "lags_s": list(_lags), "commits": list(_commits),
                           "calls": list(_calls)}, out)
            os.replace(_OUT + ".tmp", _OUT)

    async def _lag_probe() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            _lags.append(time.perf_counter() - t - 0.001)

    def commit(self: Any, group: list[Any]) -> None:
        t0 = time.perf_counter()
        _commit(self, group)
        _commits.append((time.perf_counter() - t0, len(group)))

    async def lookup(self: Any, request: Any, context: Any) -> Any:
        if not _started.is_set():
            _started.set()
            asyncio.get_running_loop().create_task(_lag_probe())
            threading.Thread(target=_dump, daemon=True).start()
        record: dict[str, Any] = {"committing": self.put_groups._committing, "executor": 0, "refresh": 0,
                                  "key": _key(request)}
        token = _current.set(record)
        t0 = time.perf_counter()
        try:
            return await _lookup(self, request, context)
        finally:
            record["wall_s"] = time.perf_counter() - t0
            record["began"] = t0
            _current.reset(token)
            _lookups.append(record)

    async def index_read(self: Any, blocks: int, read: Any) -> Any:
        record = _current.get()
        q0, c0, t0 = _runqueue_s(), time.thread_time(), time.perf_counter()
        try:
            return await _index_read(self, blocks, read)
        finally:
            if record is not None:
                record["read_s"] = time.perf_counter() - t0
                record["read_cpu_s"] = time.thread_time() - c0
                record["read_runqueue_s"] = _runqueue_s() - q0

    async def call(self: Any, fn: Any, *args: Any) -> Any:
        record = _current.get()
        if record is not None:
            record["executor"] += 1
        return await _call(self, fn, *args)

    def touch_soon(self: Any, keys: Any) -> Any:
        record = _current.get()
        if record is not None:
            record["refresh"] += 1
        return _touch_soon(self, keys)

    def _key(request: Any) -> str:
        """The request's last block hash: the client's side records the same, so the two sides join."""
        packed = request.block_hashes_packed
        return (packed[-32:] if packed else (request.block_hashes[-1] if request.block_hashes else b"")).hex()

    _intercept = call_outcome.OutcomeInterceptor.intercept_service

    async def intercept_service(self: Any, continuation: Any, details: Any) -> Any:
        arrived = time.perf_counter()  # the call's headers are in: its message is read after this
        handler = await _intercept(self, continuation, details)
        if handler is None or not details.method.endswith("/Lookup") or handler.unary_unary is None \
                or getattr(self, "_probe_outer", None) is not True:
            return handler
        inner = handler.unary_unary

        async def timed(request: Any, context: Any) -> Any:
            began = time.perf_counter()
            try:
                return await inner(request, context)
            finally:
                _calls.append({"key": _key(request), "arrived": arrived, "began": began, "ended": time.perf_counter()})
        return grpc.unary_unary_rpc_method_handler(timed, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)

    call_outcome.OutcomeInterceptor.intercept_service = intercept_service  # type: ignore[method-assign, assignment]
    from gateway import metrics as _metrics
    _metrics.MetricsInterceptor._probe_outer = True  # the first interceptor of the chain: its span is the call's
    _Servicer.Lookup = lookup  # type: ignore[method-assign]
    _Servicer._index_read = index_read  # type: ignore[method-assign]
    _Groups._commit = commit  # type: ignore[method-assign]
    _Tier.call = call  # type: ignore[method-assign]
    _Tier.touch_soon = touch_soon  # type: ignore[method-assign]


if os.environ.get("LOOKUP_PROBE_OUT") and any("multiprocessing" in a for a in sys.argv):
    # A `bench load` client (a spawned process): each Lookup's send and answer on the same clock as the server's
    # (perf_counter is CLOCK_MONOTONIC on Linux), keyed by the chain's last hash.
    import atexit
    import json
    import time

    from kvstore.client import store as _store

    _mine: list[tuple[str, float, float]] = []
    _client_lookup = _store.Client.lookup

    def client_lookup(self: Any, tokens: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        hit = _client_lookup(self, tokens, **kwargs)
        t1 = time.perf_counter()
        _mine.append((bytes(hit.block_hashes[-1]).hex() if len(hit.block_hashes) else "", t0, t1))
        if len(_mine) % 200 == 0:
            _save()
        return hit

    def _save() -> None:
        path = f"{os.environ['LOOKUP_PROBE_OUT']}.client-{os.getpid()}"
        with open(path + ".tmp", "w") as out:
            json.dump(_mine, out)
        os.replace(path + ".tmp", path)

    _store.Client.lookup = client_lookup  # type: ignore[method-assign]
    atexit.register(_save)
