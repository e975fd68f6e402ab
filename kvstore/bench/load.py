"""Concurrent clients doing lookup -> get -> put on loopback, against a raw gRPC echo of the same sizes.

In one run: a `kvstore serve` process on a scratch data dir, and N client
processes (default: one per CPU, at least 2) each repeating a worker's cycle for
a bounded time: Lookup of a prompt whose first half is stored, Get of that half,
Put of the second half (a new chain each cycle, so every Put writes). Reported:
cycles per second, Get and Put GB/s, and p50/p99 latency of each RPC. The
baseline is a bare gRPC echo server (generic handlers, no protobuf, no storage,
grpc.aio in its own process, as the kvstore server) called by the same number
of client processes with messages of the same sizes: what gRPC alone costs on
this machine. Also the kvstore server's RSS before and after the load.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import GiB, scratch
from kvstore.bench.report import Figure, Progress, Report
from kvstore.geometry import V4_1_FLASH

BASELINE = "raw gRPC echo, same sizes, same clients"
RPCS = ("lookup", "get", "put")
#: Stored prompt prefixes each client cycles through (its Lookups and Gets hit them).
PREFIXES = 8
#: Bytes of a hash and its protobuf tag in a repeated bytes field.
_HASH_WIRE = 34

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
    parser.add_argument("--clients", type=int, default=max(2, os.cpu_count() or 1),
                        help="client processes (default: one per CPU, at least 2)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of load on each side (default 5)")
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


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the benchmark; see the module docstring."""
    if args.clients < 1 or args.seconds <= 0 or args.prompt_blocks < 2:
        raise SystemExit("--clients >= 1, --seconds > 0 and --prompt-blocks >= 2, please")
    half = args.prompt_blocks // 2
    block_bytes = V4_1_FLASH.block_bytes(args.block_tokens)
    report = Report(bench="load")
    with scratch() as folder:
        capacity = max(min(shutil.disk_usage(folder).free // 2, 64 * GiB), 1 << 26)
        with _kvstore_server(folder / "store", capacity, args.block_tokens) as (target, pid):
            before = _memory_mib(pid)
            kv = _load("kvstore", target, args, half, block_bytes, progress)
            after = _memory_mib(pid)
    with _echo_server() as target:
        raw = _load("raw", target, args, half, block_bytes, progress)
    if kv.cycles == 0 or raw.cycles == 0:
        raise RuntimeError(f"no cycle finished (kvstore {kv.cycles}, raw {raw.cycles}): raise --seconds")
    moved_gb = 2 * half * block_bytes / 1e9  # fetched and stored per cycle
    report.add(Figure.against("lookup -> get -> put cycles per second", kv.cycles / kv.seconds, "cycle/s",
                              BASELINE, raw.cycles / raw.seconds))
    report.add(Figure.against("block bytes moved (get + put)", kv.cycles * moved_gb / kv.seconds, "GB/s", BASELINE,
                              raw.cycles * moved_gb / raw.seconds))
    for rpc in RPCS:
        for pct in (50, 99):
            ours = float(np.percentile(kv.latencies_s[rpc], pct)) * 1e3
            base = float(np.percentile(raw.latencies_s[rpc], pct)) * 1e3
            report.add(Figure.against(f"{rpc} p{pct}", ours, "ms", BASELINE, base))
    if before.get("VmRSS") is not None and after.get("VmRSS") is not None:
        report.add(Figure(name="server RSS before", value=before["VmRSS"], unit="MiB"))
        report.add(Figure(name="server RSS after", value=after["VmRSS"], unit="MiB"))
    # RssAnon is what the server holds; RssFile is mostly LMDB's map, pages the kernel may drop.
    report.notes["server_memory_mib"] = {"before": before, "after": after}
    report.notes.update(clients=args.clients, seconds=args.seconds, prompt_blocks=2 * half, block_bytes=block_bytes,
                        cycles=kv.cycles, raw_cycles=raw.cycles, errors=kv.errors, raw_errors=raw.errors,
                        lookup_misses=kv.misses, cpus=os.cpu_count())
    return report


def _load(kind: str, target: str, args: argparse.Namespace, half: int, block_bytes: int,
          progress: Progress) -> _Side:
    """Start the clients, let them warm up, run them together for `args.seconds`, and gather what they measured."""
    ctx = multiprocessing.get_context("spawn")  # grpc does not survive fork
    ready, results = ctx.Queue(), ctx.Queue()
    start = ctx.Event()
    procs = [ctx.Process(target=_client_process, daemon=True, args=(_Spec(
        kind=kind, target=target, index=i, seconds=args.seconds, half=half, block_tokens=args.block_tokens,
        block_bytes=block_bytes), ready, start, results)) for i in range(args.clients)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            _gather(ready, procs, 300)
        start.set()
        began = time.perf_counter()
        with progress.bar(f"load: {kind}", args.seconds, unit="s") as bar:
            while time.perf_counter() - began < args.seconds:
                time.sleep(0.1)
                bar.update(min(time.perf_counter() - began, args.seconds) - bar.n)
        done = [_gather(results, procs, args.seconds + 300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return _Side(seconds=max(d["seconds"] for d in done), cycles=sum(d["cycles"] for d in done),
                 latencies_s={rpc: [x for d in done for x in d["latencies_s"][rpc]] for rpc in RPCS},
                 errors=sum(d["errors"] for d in done), misses=sum(d["misses"] for d in done))


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
        cycle = _kvstore_cycle(spec) if spec.kind == "kvstore" else _raw_cycle(spec)
        cycle(0)  # warm: connection, first calls
        ready.put(spec.index)
        start.wait()
        latencies: dict[str, list[float]] = {rpc: [] for rpc in RPCS}
        errors = misses = cycles = 0
        began = time.perf_counter()
        while time.perf_counter() - began < spec.seconds:
            try:
                times, missed = cycle(cycles + 1)
            except Exception:  # a failed call is counted, the load goes on
                errors += 1
                continue
            for rpc, t in zip(RPCS, times, strict=True):
                latencies[rpc].append(t)
            misses += missed
            cycles += 1
        results.put({"seconds": time.perf_counter() - began, "cycles": cycles, "latencies_s": latencies,
                     "errors": errors, "misses": misses})
    except BaseException as exc:  # reported to the parent, which raises it
        results.put({"failed": f"{type(exc).__name__}: {exc}"})
        ready.put({"failed": f"{type(exc).__name__}: {exc}"})


def _kvstore_cycle(spec: _Spec) -> Any:
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
        t0 = time.perf_counter()
        hit = client.lookup(tokens)
        t1 = time.perf_counter()
        got = client.get_hashes(hit.block_hashes[:hit.found_blocks])
        t2 = time.perf_counter()
        client.put(tokens, blocks, first_block=spec.half, parent=hit.block_hashes[spec.half - 1])
        t3 = time.perf_counter()
        missed = spec.half - got.found_prefix_blocks
        return [t1 - t0, t2 - t1, t3 - t2], missed

    return cycle


def _raw_cycle(spec: _Spec) -> Any:
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
        t0 = time.perf_counter()
        unary(lookup)
        t1 = time.perf_counter()
        for _msg in stream(get):
            pass
        t2 = time.perf_counter()
        unary(put)
        t3 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2], 0

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
def _echo_server() -> Iterator[str]:
    """The bare gRPC echo server in its own process; yields its target."""
    proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _memory_mib(pid: int) -> dict[str, float]:
    """Resident memory of process `pid` in MiB: VmRSS, RssAnon, RssFile (Linux /proc; empty elsewhere)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    found = re.findall(r"^(VmRSS|RssAnon|RssFile):\s+(\d+) kB", status, re.MULTILINE)
    return {name: round(int(kb) / 1024, 1) for name, kb in found}
