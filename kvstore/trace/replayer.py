"""`kvstore trace replay`: drive a running server (or fleet) with a trace slice through the real client.

Each request does what a worker does: the planner's leased Lookup with its SWA probes
(`replay.planner.Planner.plan`), a Get of the blocks the plan fetches, the lease's
release, a Put of the prompt's new blocks (real block-sized bytes) and a snapshot at the
prompt's end (`client.swa.put`, live for the SWA TTL) — the same steps the simulation
takes (`kvstore.trace.simulate`), so the two can be set side by side. Sessions run
concurrently (`concurrency` at once), each one's requests in order, each sent at its
arrival time scaled by `speed` (0: as soon as the one before it is done). Bounded:
at most `max_requests` requests (the first arrivals) and `max_seconds` of wall time;
then it stops by itself. Errors are counted by kind, never raised.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

from kvstore.client import Client
from kvstore.client.store import GetResult
from kvstore.errors import KVStoreError
from kvstore.trace.requests import Trace, TraceRequest
from kvstore.trace.tokens import prompt_tokens


@dataclass(kw_only=True)
class ReplayTally:
    """What a replay measured."""

    requests: int = 0
    prompt_tokens: int = 0
    found_tokens: int = 0
    usable_tokens: int = 0
    put_blocks: int = 0
    wall_s: float = 0.0
    latencies_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter[str] = field(default_factory=Counter)
    done: list[TraceRequest] = field(default_factory=list)

    @property
    def lookup_hit_rate(self) -> float:
        """Found tokens over prompt tokens."""
        return self.found_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def usable_hit_rate(self) -> float:
        """Tokens the plans served from cache over prompt tokens."""
        return self.usable_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def percentile_ms(self, call: str, q: float) -> float:
        """The q-quantile (0..1) of one call's latency, in ms (nearest rank)."""
        xs = sorted(self.latencies_s.get(call, []))
        if not xs:
            return 0.0
        return 1000 * xs[min(len(xs) - 1, max(0, round(q * len(xs) + 0.5) - 1))]


def first_arrivals(trace: Trace, max_requests: int) -> list[TraceRequest]:
    """The slice a replay drives: the first `max_requests` arrivals."""
    return trace.requests[:max_requests]


class _Run:
    """One replay in progress: its bounds, its tally and the lock guarding it."""

    def __init__(self, *, target: str, token: str | None, swa_ttl_s: float, speed: float, max_seconds: float) -> None:
        self.target, self.token = target, token
        self.swa_ttl_s, self.speed, self.max_seconds = swa_ttl_s, speed, max_seconds
        self.tally = ReplayTally()
        self.lock = threading.Lock()
        self.start = time.monotonic()
        self.t0 = 0.0

    def timed(self, call: str, fn: Callable[[], object]) -> object:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            with self.lock:
                self.tally.latencies_s[call].append(time.perf_counter() - start)

    def session(self, requests: list[TraceRequest]) -> None:
        from replay.planner import Planner

        with Client(self.target, token=self.token) as client, Planner(client, report=False) as planner:
            block = bytes(client.block_bytes)
            for r in requests:
                due = self.start + (r.arrival_s - self.t0) / self.speed if self.speed > 0 else 0.0
                if (due - self.start if self.speed > 0 else time.monotonic() - self.start) > self.max_seconds:
                    return
                if due > time.monotonic():
                    time.sleep(due - time.monotonic())  # the load generator's own pacing, not a test's wait
                try:
                    self.request(client, planner, block, r)
                except KVStoreError as exc:
                    with self.lock:
                        self.tally.errors[type(exc).__name__] += 1

    def request(self, client: Client, planner: object, block: bytes, r: TraceRequest) -> None:
        tokens = list(prompt_tokens(r))
        if not tokens:
            return
        plan = planner.plan(tokens)  # type: ignore[attr-defined]
        with self.lock:
            self.tally.latencies_s["lookup"].append(plan.lookup_s)
        bt = client.block_tokens
        fetch = -(-plan.fetch_tokens // bt)
        if fetch:
            got = cast(GetResult, self.timed("get", lambda: client.get_hashes(plan.block_hashes[:fetch])))
            missing = sum(1 for b in got.blocks if b is None)
            if missing:
                with self.lock:
                    self.tally.errors["get_missing_blocks"] += missing
        if plan.lease_id:
            client.release(plan.lease_id)
        n, first = len(tokens) // bt, plan.found_tokens // bt
        if n > first:
            parent = plan.block_hashes[first - 1] if first else None
            self.timed("put", lambda: client.put(tokens[: n * bt], [block] * (n - first), first_block=first,
                                                 parent=parent))
        if self.swa_ttl_s and n:
            p = n * bt
            self.timed("swa_put", lambda: client.swa.put(tokens[:p], bytes(client.swa.snapshot_bytes(p)),
                                                         position=p, ttl_s=self.swa_ttl_s))
        with self.lock:
            t = self.tally
            t.requests += 1
            t.prompt_tokens += len(tokens)
            t.found_tokens += plan.found_tokens
            t.usable_tokens += plan.usable_tokens
            t.put_blocks += max(n - first, 0)
            t.done.append(r)


def replay(trace: Trace, *, target: str, token: str | None = None, swa_ttl_s: float = 300.0, speed: float = 0.0,
           concurrency: int = 8, max_requests: int = 200, max_seconds: float = 300.0) -> ReplayTally:
    """Replay the first `max_requests` arrivals of `trace` against `target` (see the module docstring)."""
    chosen = first_arrivals(trace, max_requests)
    sessions: dict[str, list[TraceRequest]] = defaultdict(list)
    for r in chosen:
        sessions[r.session].append(r)
    run = _Run(target=target, token=token, swa_ttl_s=swa_ttl_s, speed=speed, max_seconds=max_seconds)
    run.t0 = chosen[0].arrival_s if chosen else 0.0
    with ThreadPoolExecutor(max_workers=max(concurrency, 1), thread_name_prefix="trace-replay") as pool:
        for f in [pool.submit(run.session, reqs) for reqs in sessions.values()]:
            f.result()
    run.tally.wall_s = time.monotonic() - run.start
    run.tally.done.sort(key=lambda r: r.arrival_s)
    return run.tally
