"""Concurrent clients doing lookup -> get -> put on loopback, against a raw gRPC echo of the same sizes.

In one run: a `kvstore serve` process on a scratch data dir, and N client
processes (default: one per CPU, at least 2) each repeating a worker's cycle for
a bounded time: Lookup of a prompt whose first half is stored, Get of that half,
Put of the second half (a new chain each cycle, so every Put writes). Reported:
cycles per second, Get and Put GB/s, p50/p99 latency of each RPC and p99 over
p50, the errors, and the CPU a cycle costs the server (in all, and its event
loop's thread alone) and the clients, and the server's LMDB commits per Put (group
commit: several Puts a commit under load). The baseline is a bare gRPC echo server
(generic handlers, no protobuf, no storage, grpc.aio in its own process, as
the kvstore server) called by the same number of client processes with
messages of the same sizes: what gRPC alone costs on this machine. Also the
kvstore server's RSS before and after the load (and,
with `--soak-minutes`, sampled through a long run: issue 25 item 4 asks it flat).
`--clients 16,64` runs each count in turn, each against its own echo run.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import queue
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np

from kvstore.bench.harness import GiB, process_cpu_s, process_run_queue_s, schedstat_wait_ns, scratch
from kvstore.bench.report import Figure, Progress, Report
from kvstore.geometry import V4_1_FLASH
from tiers.retention import TOUCH_GRANULARITY_S

T = TypeVar("T")

BASELINE = "raw gRPC echo, same sizes, same clients"
RPCS = ("lookup", "get", "put")
#: Stored prompt prefixes each client cycles through (its Lookups and Gets hit them).
PREFIXES = 8
#: Bytes of a hash and its protobuf tag in a repeated bytes field.
_HASH_WIRE = 34
#: Seconds between samples of the server's RSS in a soak.
RSS_EVERY_S = 10.0


def _counts(text: str) -> list[int]:
    """`--clients`: one count or several, comma-separated."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--clients takes counts like 16 or 16,64, not {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--clients takes counts of at least 1, not {text!r}")
    return counts

# A generic echo server with no protobuf and no logic. Unary: the request's first
# 8 bytes give the reply size. Stream: they give the message count, the next 8 the size.
_ECHO_SERVER = """
import asyncio, os
import grpc
cache = {}
def payload(size):
    if size not in cache:
        cache[size] = os.urandom(size)
    return cache[size]
def unary(req, ctx):
    return payload(int.from_bytes(req[:8], 'big'))
def stream(req, ctx):
    count, size = int.from_bytes(req[:8], 'big'), int.from_bytes(req[8:16], 'big')
    data = payload(size)
    for _ in range(count):
        yield data
async def main():
    server = grpc.aio.server(options=[('grpc.max_send_message_length', -1),
                                      ('grpc.max_receive_message_length', -1)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler('bench.Echo', {
        'Unary': grpc.unary_unary_rpc_method_handler(unary),
        'Stream': grpc.unary_stream_rpc_method_handler(stream)}),))
    port = server.add_insecure_port('127.0.0.1:0')
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench load`."""
    parser.add_argument("--clients", type=_counts, default=[max(2, os.cpu_count() or 1)],
                        help="client processes, or several counts run in turn (16,64) (default: one per CPU, "
                             "at least 2)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of load on each side (default 5)")
    parser.add_argument("--soak-minutes", type=float, default=0.0,
                        help=f"run the kvstore side this many minutes instead of --seconds, sampling the server's "
                             f"RSS every {RSS_EVERY_S:g} s (issue 25 item 4: 10; the echo side keeps --seconds)")
    parser.add_argument("--rss-every-s", type=float, default=RSS_EVERY_S,
                        help=f"seconds between samples of the server's memory (default {RSS_EVERY_S:g})")
    parser.add_argument("--prompt-blocks", type=int, default=8,
                        help="blocks per prompt: the first half is looked up and fetched, the second put (default 8)")
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default 64)")


@dataclass(frozen=True, kw_only=True)
class _Spec:
    """What one client process does."""

    kind: str  # "kvstore" or "raw"
    target: str
    index: int
    seconds: float
    half: int  # blocks looked up and fetched; as many are put
    block_tokens: int
    block_bytes: int


@dataclass(frozen=True, kw_only=True)
class _Side:
    """What one side's clients measured, together."""

    seconds: float
    cycles: int
    latencies_s: dict[str, list[float]]
    errors: int
    misses: int
    #: CPU seconds the clients spent in the timed loop, together.
    client_cpu_s: float
    #: CPU seconds the server spent while the clients ran (None: not readable here).
    server_cpu_s: float | None
    #: Of those, its main thread's: the event loop's, which grpc.aio and the handlers share (None: not readable).
    server_loop_cpu_s: float | None
    #: The server's memory sampled while the load ran: (seconds from the start, VmRSS/RssAnon/RssFile MiB).
    memory: list[tuple[float, dict[str, float]]]
    #: LMDB write transactions the server committed while the clients ran (None: no store read, the echo).
    commits: int | None = None
    #: Per RPC, the seconds each call's client process spent runnable but not running (its threads' run-queue
    #: wait, from /proc's schedstat; empty where it cannot be read): the part of a latency that is the client's host.
    client_waits_s: dict[str, list[float]] | None = None
    #: Seconds the server's threads waited for a CPU while the clients ran, together (None: not readable).
    server_run_queue_s: float | None = None


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the benchmark; see the module docstring."""
    if args.seconds <= 0 or args.prompt_blocks < 2 or args.soak_minutes < 0 or args.rss_every_s <= 0:
        raise SystemExit("--seconds > 0, --soak-minutes >= 0, --rss-every-s > 0 and --prompt-blocks >= 2, please")
    half = args.prompt_blocks // 2
    block_bytes = V4_1_FLASH.block_bytes(args.block_tokens)
    report = Report(bench="load")
    several = len(args.clients) > 1
    for clients in args.clients:
        _measure(report, args, clients, half, block_bytes, progress, suffix=f" at {clients} clients" if several else "")
    report.notes.update(clients=args.clients if several else args.clients[0], seconds=args.seconds,
                        soak_minutes=args.soak_minutes, prompt_blocks=2 * half, block_bytes=block_bytes,
                        cpus=os.cpu_count())
    return report


def _measure(report: Report, args: argparse.Namespace, clients: int, half: int, block_bytes: int,
             progress: Progress, *, suffix: str) -> None:
    """One client count: the kvstore side, then the echo side, their figures added with `suffix`."""
    kv_seconds = args.soak_minutes * 60.0 if args.soak_minutes else args.seconds
    load_before = os.getloadavg()
    with scratch() as folder:
        capacity = max(min(shutil.disk_usage(folder).free // 2, 64 * GiB), 1 << 26)
        with _kvstore_server(folder / "store", capacity, args.block_tokens) as (target, pid):
            before = _memory_mib(pid)
            kv = _load("kvstore", target, clients, kv_seconds, args.block_tokens, half, block_bytes, progress, pid,
                       rss_every_s=args.rss_every_s, commits=_commit_counter(folder / "store"))
            after = _memory_mib(pid)
    with _echo_server() as (target, pid):
        raw = _load("raw", target, clients, args.seconds, args.block_tokens, half, block_bytes, progress, pid,
                    rss_every_s=args.rss_every_s)
    # A shared box's load average beside the ratios: on fewer cores than clients, they follow it.
    report.notes[f"load_average{suffix}"] = {"before": [round(x, 2) for x in load_before],
                                             "after": [round(x, 2) for x in os.getloadavg()]}
    if kv.cycles == 0 or raw.cycles == 0:
        raise RuntimeError(f"no cycle finished (kvstore {kv.cycles}, raw {raw.cycles}): raise --seconds")
    moved_gb = 2 * half * block_bytes / 1e9  # fetched and stored per cycle
    report.add(Figure.against(f"lookup -> get -> put cycles per second{suffix}", kv.cycles / kv.seconds, "cycle/s",
                              BASELINE, raw.cycles / raw.seconds))
    report.add(Figure.against(f"block bytes moved (get + put){suffix}", kv.cycles * moved_gb / kv.seconds, "GB/s",
                              BASELINE, raw.cycles * moved_gb / raw.seconds))
    for rpc in RPCS:
        pcts = {}
        for pct in (50, 99):
            ours = pcts[pct] = float(np.percentile(kv.latencies_s[rpc], pct)) * 1e3
            base = float(np.percentile(raw.latencies_s[rpc], pct)) * 1e3
            report.add(Figure.against(f"{rpc} p{pct}{suffix}", ours, "ms", BASELINE, base))
        # Issue 25 item 4 asks p99 <= 3x p50 for every call: the spread, beside the echo's own.
        report.add(Figure(name=f"{rpc} p99 / p50{suffix}", value=pcts[99] / pcts[50], unit="x", baseline=BASELINE,
                          baseline_value=_spread(raw.latencies_s[rpc])))
        _client_wait_figures(report, rpc, kv, raw, suffix)
    # What a cycle costs in CPU (ms), each side: on a box with fewer cores than clients, the cycles per second
    # are the cores' time divided by these.
    report.add(Figure.against(f"server CPU per cycle{suffix}", _per_cycle_ms(kv.server_cpu_s, kv.cycles), "ms",
                              BASELINE, _per_cycle_ms(raw.server_cpu_s, raw.cycles)))
    # The loop's thread alone: at as many cores as clients the server is loop-bound (its cycles follow this one),
    # and the rest (the tier's executor, grpc's own threads) runs beside it.
    report.add(Figure.against(f"server event-loop thread CPU per cycle{suffix}",
                              _per_cycle_ms(kv.server_loop_cpu_s, kv.cycles), "ms", BASELINE,
                              _per_cycle_ms(raw.server_loop_cpu_s, raw.cycles)))
    if kv.server_run_queue_s is not None and raw.server_run_queue_s is not None:
        # With as many clients as cores the server's threads wait for a CPU too: how long, a cycle, each side.
        report.add(Figure.against(f"server run-queue wait per cycle{suffix}",
                                  _per_cycle_ms(kv.server_run_queue_s, kv.cycles), "ms", BASELINE,
                                  _per_cycle_ms(raw.server_run_queue_s, raw.cycles)))
    report.add(Figure.against(f"client CPU per cycle{suffix}", _per_cycle_ms(kv.client_cpu_s, kv.cycles), "ms",
                              BASELINE, _per_cycle_ms(raw.client_cpu_s, raw.cycles)))
    if kv.commits is not None:
        # Group commit (gateway/put_group.py): the Puts waiting while one commit runs share the next, so under load
        # a commit (one write txn, LMDB's two flushes) serves several Puts; each cycle's Put writes a new chain.
        report.add(Figure(name=f"server commits per Put{suffix}", value=kv.commits / max(kv.cycles, 1), unit="x"))
        report.notes[f"server_commits_per_s{suffix}"] = round(kv.commits / kv.seconds, 1)
    report.add(Figure(name=f"errors{suffix}", value=float(kv.errors), unit="calls", baseline=BASELINE,
                      baseline_value=float(raw.errors)))
    if before.get("VmRSS") is not None and after.get("VmRSS") is not None:
        report.add(Figure(name=f"server RSS before{suffix}", value=before["VmRSS"], unit="MiB"))
        report.add(Figure(name=f"server RSS after{suffix}", value=after["VmRSS"], unit="MiB"))
        # RssAnon is what the server holds; RssFile is mostly LMDB's map, pages the kernel may drop.
        report.add(Figure(name=f"server anonymous RSS before{suffix}", value=before.get("RssAnon", 0.0), unit="MiB"))
        report.add(Figure(name=f"server anonymous RSS after{suffix}", value=after.get("RssAnon", 0.0), unit="MiB"))
    # The samples of a soak: growth after the first tenth of the run is what "flat" is judged on (the first
    # minutes fill the allocator's arenas and LMDB's pages).
    growth = _settled_growth(kv.memory, kv.seconds)
    if growth is not None:
        report.add(Figure(name=f"server anonymous RSS growth after the first tenth{suffix}", value=growth,
                          unit="MiB"))
    report.notes[f"server_memory_mib{suffix}"] = {"before": before, "after": after,
                                                  "samples": [(round(t, 1), m) for t, m in kv.memory]}
    report.notes[f"cycles{suffix}"] = {"kvstore": kv.cycles, "raw": raw.cycles, "kvstore_seconds": round(kv.seconds, 1)}
    report.notes[f"errors{suffix}"] = kv.errors
    report.notes[f"raw_errors{suffix}"] = raw.errors
    report.notes[f"lookup_misses{suffix}"] = kv.misses
    # Each client's prefixes are stored just before the clock starts, and a block is due R5's refresh only
    # TOUCH_GRANULARITY_S after its recorded use: in a shorter run no Lookup or Get waits for a refresh, so
    # its tails are the loop's and the box's, not refreshes queued behind Put commits.
    report.notes[f"refreshes_exercised{suffix}"] = kv.seconds > TOUCH_GRANULARITY_S


def _client_wait_figures(report: Report, rpc: str, kv: _Side, raw: _Side, suffix: str) -> None:
    """How much of `rpc`'s latencies was the client processes waiting for a CPU, and its spread without that wait:
    with as many clients as cores, the server's threads and the clients share them, and the shortest call's p99
    can be a client's wake-up more than the server (docs/BENCHMARKS.md, `bench load`). Nothing where schedstat
    could not be read on either side."""
    ours, base = _net(kv, rpc), _net(raw, rpc)
    if ours is None or base is None:
        return
    report.add(Figure.against(f"{rpc} client run-queue wait p99{suffix}", _p99_ms(_waits(kv, rpc)), "ms", BASELINE,
                              _p99_ms(_waits(raw, rpc))))
    report.add(Figure(name=f"{rpc} p99 / p50, the client's run-queue wait taken out{suffix}", value=_spread(ours),
                      unit="x", baseline=BASELINE, baseline_value=_spread(base)))


def _waits(side: _Side, rpc: str) -> list[float]:
    return (side.client_waits_s or {}).get(rpc, [])


def _p99_ms(values: list[float]) -> float:
    return float(np.percentile(values, 99)) * 1e3


def _net(side: _Side, rpc: str) -> list[float] | None:
    """`rpc`'s latencies, each less its client's run-queue wait; None when the waits were not read for each call."""
    waits = _waits(side, rpc)
    latencies = side.latencies_s[rpc]
    if not latencies or len(waits) != len(latencies):
        return None
    return [max(t - w, 1e-9) for t, w in zip(latencies, waits, strict=True)]


def _settled_growth(memory: list[tuple[float, dict[str, float]]], seconds: float) -> float | None:
    """RssAnon's growth (MiB) from the first sample at or past a tenth of the load to the last one; None
    with fewer than two such samples (a short run: nothing to judge "flat" on)."""
    settled = [m["RssAnon"] for t, m in memory if t >= seconds / 10 and "RssAnon" in m]
    return round(settled[-1] - settled[0], 1) if len(settled) >= 2 else None


def _spread(latencies: list[float]) -> float:
    """p99 over p50 of `latencies`."""
    return float(np.percentile(latencies, 99) / np.percentile(latencies, 50))


def _per_cycle_ms(cpu_s: float | None, cycles: int) -> float:
    return (cpu_s or 0.0) * 1e3 / max(cycles, 1)


def _load(kind: str, target: str, clients: int, seconds: float, block_tokens: int, half: int, block_bytes: int,
          progress: Progress, server_pid: int | None = None, *, rss_every_s: float = RSS_EVERY_S,
          commits: Callable[[], int | None] | None = None) -> _Side:
    """Start the clients, let them warm up, run them together for `seconds`, and gather what they measured
    (with the CPU and, every `rss_every_s`, the memory of the server `server_pid`; `commits`: the server's
    count of write transactions, read as the clock starts and once the clients are done)."""
    ctx = multiprocessing.get_context("spawn")  # grpc does not survive fork
    ready, results = ctx.Queue(), ctx.Queue()
    start = ctx.Event()
    procs = [ctx.Process(target=_client_process, daemon=True, args=(_Spec(
        kind=kind, target=target, index=i, seconds=seconds, half=half, block_tokens=block_tokens,
        block_bytes=block_bytes), ready, start, results)) for i in range(clients)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            _gather(ready, procs, 300)
        cpu0, loop0 = process_cpu_s(server_pid), process_cpu_s(server_pid, thread=server_pid)
        waited0 = process_run_queue_s(server_pid)
        txn0 = commits() if commits is not None else None
        start.set()
        began = time.perf_counter()
        memory = [(0.0, _memory_mib(server_pid))] if server_pid is not None else []
        with progress.bar(f"load: {kind}", seconds, unit="s") as bar:
            while (now := time.perf_counter() - began) < seconds:
                time.sleep(0.1)
                if server_pid is not None and now - memory[-1][0] >= rss_every_s:
                    memory.append((now, _memory_mib(server_pid)))
                bar.update(min(now, seconds) - bar.n)
        done = [_gather(results, procs, seconds + 300) for _ in procs]
        cpu1, loop1 = process_cpu_s(server_pid), process_cpu_s(server_pid, thread=server_pid)
        waited1 = process_run_queue_s(server_pid)
        txn1 = commits() if commits is not None else None
        if server_pid is not None:  # the last sample at the end of the load, where "flat" is judged
            memory.append((time.perf_counter() - began, _memory_mib(server_pid)))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return _Side(seconds=max(d["seconds"] for d in done), cycles=sum(d["cycles"] for d in done),
                 latencies_s={rpc: [x for d in done for x in d["latencies_s"][rpc]] for rpc in RPCS},
                 errors=sum(d["errors"] for d in done), misses=sum(d["misses"] for d in done),
                 client_cpu_s=sum(d["cpu_s"] for d in done),
                 server_cpu_s=cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None,
                 server_loop_cpu_s=loop1 - loop0 if loop0 is not None and loop1 is not None else None, memory=memory,
                 commits=txn1 - txn0 if txn0 is not None and txn1 is not None else None,
                 client_waits_s={rpc: [x for d in done for x in d["waits_s"][rpc]] for rpc in RPCS},
                 server_run_queue_s=waited1 - waited0 if waited0 is not None and waited1 is not None else None)


def _gather(q: Any, procs: list[Any], timeout_s: float) -> Any:
    """The next message from the clients; a client's failure is raised here."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            item = q.get(timeout=1)
        except queue.Empty:
            if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                raise RuntimeError("the load clients stopped without answering") from None
            continue
        if isinstance(item, dict) and "failed" in item:
            raise RuntimeError(f"load client failed: {item['failed']}")
        return item


def _client_process(spec: _Spec, ready: Any, start: Any, results: Any) -> None:
    """One client: warm up, say so, wait for the start, repeat the cycle until the time is up."""
    try:
        clock = _CallClock()
        cycle = _kvstore_cycle(spec, clock) if spec.kind == "kvstore" else _raw_cycle(spec, clock)
        cycle(0)  # warm: connection, first calls
        clock.find_threads()  # grpc's own threads exist now
        ready.put(spec.index)
        start.wait()
        latencies: dict[str, list[float]] = {rpc: [] for rpc in RPCS}
        waits: dict[str, list[float]] = {rpc: [] for rpc in RPCS}
        errors = misses = cycles = 0
        began, cpu = time.perf_counter(), time.process_time()
        while time.perf_counter() - began < spec.seconds:
            try:
                times, missed = cycle(cycles + 1)
            except Exception:  # a failed call is counted, the load goes on
                errors += 1
                clock.take_waits()  # the failed cycle's calls are not counted
                continue
            for rpc, t in zip(RPCS, times, strict=True):
                latencies[rpc].append(t)
            for rpc, w in zip(RPCS, clock.take_waits(), strict=False):
                waits[rpc].append(w)
            misses += missed
            cycles += 1
        clock.close()
        results.put({"seconds": time.perf_counter() - began, "cycles": cycles, "latencies_s": latencies,
                     "waits_s": waits, "errors": errors, "misses": misses, "cpu_s": time.process_time() - cpu})
    except BaseException as exc:  # reported to the parent, which raises it
        results.put({"failed": f"{type(exc).__name__}: {exc}"})
        ready.put({"failed": f"{type(exc).__name__}: {exc}"})


class _CallClock:
    """Times each call of a cycle with this process's run-queue wait over it (the sum over its threads of the time
    runnable but not running, from /proc/self/task/*/schedstat): how much of a latency was the client's host (its
    CPUs busy), not the server. `waits` holds the calls' since the last `take_waits`; none where schedstat cannot
    be read."""

    def __init__(self) -> None:
        self._fds: list[int] = []
        self.waits: list[float] = []

    def find_threads(self) -> None:
        """Keep a handle on each of this process's threads (after warm-up, once grpc has started its own)."""
        self.close()
        try:
            tasks = os.listdir("/proc/self/task")
        except OSError:
            return
        for task in tasks:
            try:
                self._fds.append(os.open(f"/proc/self/task/{task}/schedstat", os.O_RDONLY))
            except OSError:
                continue

    def _run_queue_s(self) -> float:
        total = 0
        for fd in self._fds:
            try:
                total += schedstat_wait_ns(os.pread(fd, 128, 0))
            except (OSError, IndexError, ValueError):  # a thread gone: its wait no longer counts
                continue
        return total / 1e9

    def timed(self, call: Callable[[], T]) -> tuple[T, float]:
        """`call()`'s result and its wall seconds; its run-queue wait goes to `waits` (the schedstat reads are
        outside the time)."""
        waited = self._run_queue_s() if self._fds else None
        began = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - began
        if waited is not None:
            self.waits.append(self._run_queue_s() - waited)
        return result, seconds

    def take_waits(self) -> list[float]:
        """The waits since the last call, cleared."""
        waits, self.waits = self.waits, []
        return waits

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _kvstore_cycle(spec: _Spec, clock: _CallClock) -> Any:
    """A function doing one lookup -> get -> put cycle against kvstore; returns (seconds per RPC, misses)."""
    from kvstore.client import Client

    client = Client(spec.target)
    span = spec.half * spec.block_tokens
    prefixes = [[((spec.index * 1000 + p) * 1000 + j) % 2**32 for j in range(span)] for p in range(PREFIXES)]
    blocks = [os.urandom(client.block_bytes)] * spec.half
    for prefix in prefixes:
        client.put(prefix, blocks)

    def cycle(i: int) -> tuple[list[float], int]:
        tokens = prefixes[i % PREFIXES] + [i] * span  # a new second half each cycle: every Put writes
        hit, looked = clock.timed(lambda: client.lookup(tokens))
        got, fetched = clock.timed(lambda: client.get_hashes(hit.block_hashes[:hit.found_blocks]))
        stored = clock.timed(lambda: client.put(tokens, blocks, first_block=spec.half,
                                                parent=hit.block_hashes[spec.half - 1]))[1]
        missed = spec.half - got.found_prefix_blocks
        return [looked, fetched, stored], missed

    return cycle


def _raw_cycle(spec: _Spec, clock: _CallClock) -> Any:
    """The same cycle against the echo server, with messages of the sizes kvstore's carry."""
    import grpc

    channel = grpc.insecure_channel(spec.target, options=[("grpc.max_receive_message_length", -1),
                                                          ("grpc.max_send_message_length", -1)])
    unary, stream = channel.unary_unary("/bench.Echo/Unary"), channel.unary_stream("/bench.Echo/Stream")
    half, span = spec.half, spec.half * spec.block_tokens

    def message(size: int, *header: int) -> bytes:
        head = b"".join(h.to_bytes(8, "big") for h in header)
        return head + bytes(max(size - len(head), 0))

    # Sizes of kvstore's messages: hashes and token ids as the protobuf fields carry them.
    lookup = message(2 * half * _HASH_WIRE + 64, 24)  # reply: counts and a lease id
    get = message(half * _HASH_WIRE + 64, half, spec.block_bytes + 8)  # one reply per block
    put = message(half * (spec.block_bytes + 4) + span * 5 + 100, half * _HASH_WIRE + 8)

    def cycle(_: int) -> tuple[list[float], int]:
        looked = clock.timed(lambda: unary(lookup))[1]
        fetched = clock.timed(lambda: collections.deque(stream(get), maxlen=0))[1]  # drained, not kept
        stored = clock.timed(lambda: unary(put))[1]
        return [looked, fetched, stored], 0

    return cycle


@contextmanager
def _kvstore_server(data_dir: Path, capacity_bytes: int, block_tokens: int) -> Iterator[tuple[str, int]]:
    """A `kvstore serve` child process; yields its target and pid (for its RSS)."""
    env = {**os.environ, "KVSTORE_STORE_CAPACITY_BYTES": str(capacity_bytes),
           "KVSTORE_STORE_BLOCK_TOKENS": str(block_tokens)}
    log = data_dir.parent / "serve.log"  # a file, not a pipe nobody drains while the load runs
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir",
                                 str(data_dir)], stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        assert proc.stdout is not None
        match = re.search(r":(\d+)$", proc.stdout.readline().strip())
        if not match:
            proc.wait(timeout=60)
            raise RuntimeError(f"kvstore serve did not start: {log.read_text().strip()}")
        yield f"127.0.0.1:{match.group(1)}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@contextmanager
def _echo_server() -> Iterator[tuple[str, int]]:
    """The bare gRPC echo server in its own process; yields its target and pid."""
    proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"127.0.0.1:{int(proc.stdout.readline())}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _commit_counter(data_dir: Path) -> Callable[[], int | None]:
    """Reads the id of the last transaction committed to the LMDB environment in `data_dir` (a second,
    read-only handle beside the server's: LMDB's meta pages, no lock taken), None when unreadable."""
    def last_txnid() -> int | None:
        try:
            env = lmdb.open(str(data_dir), readonly=True, lock=False, max_dbs=0)
        except lmdb.Error:
            return None
        try:
            return int(env.info()["last_txnid"])
        finally:
            env.close()

    return last_txnid


def _memory_mib(pid: int | None) -> dict[str, float]:
    """Resident memory of process `pid` in MiB: VmRSS, RssAnon, RssFile (Linux /proc; empty elsewhere)."""
    if pid is None:
        return {}
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    found = re.findall(r"^(VmRSS|RssAnon|RssFile):\s+(\d+) kB", status, re.MULTILINE)
    return {name: round(int(kb) / 1024, 1) for name, kb in found}
