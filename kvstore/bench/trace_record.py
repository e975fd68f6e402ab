"""What recording the server's own trace (`[trace]`, gateway/trace_recorder.py) costs a call.

In one run, two `kvstore serve` processes hold the same conversation of --tokens, one
recording its trace and one not, and the client asks each in turn for the whole prompt
(`lookup_hashes`: the whole chain found, the recorded Lookup holding every hash): the
recording's Lookup beside the other's, best and median of --repeat calls, interleaved so
that the machine's other work falls on both alike. Then, in this process, the two parts
of a record's cost beside that Lookup: what the call pays on the event loop (the
hashes cut to `hash_bytes` and the record queued) and what the writer's thread pays per
record (the JSON line, the hex, its share of a zstd frame). The writer's files go to the
scratch folder and are removed with it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from kvstore.bench.harness import scratch, serve_process
from kvstore.bench.report import Figure, Progress, Report
from kvstore.geometry import TINY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench trace-record`."""
    parser.add_argument("--tokens", type=int, default=65_536, help="the prompt's length (default 65,536)")
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default 64)")
    parser.add_argument("--repeat", type=int, default=200, help="Lookups per server (default 200)")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the benchmark; see the module docstring."""
    from kvstore.client import Client

    bt = args.block_tokens
    blocks = max(args.tokens // bt, 1)
    tokens = list(range(blocks * bt))
    block_bytes = TINY.block_bytes(bt)
    report = Report(bench="trace-record")
    report.notes.update(tokens=len(tokens), blocks=blocks, block_tokens=bt, repeat=args.repeat, cpus=os.cpu_count())
    with scratch(args.dir) as folder:
        trace_env = {"KVSTORE_TRACE_ENABLED": "true", "KVSTORE_TRACE_DIR": str(folder / "trace")}
        with serve_process(folder / "off", blocks * block_bytes, bt) as off_target, \
                serve_process(folder / "on", blocks * block_bytes, bt, extra_env=trace_env) as on_target, \
                Client(off_target, geometry=TINY.name) as off, Client(on_target, geometry=TINY.name) as on:
            pool = [os.urandom(block_bytes) for _ in range(16)]
            for client in (off, on):
                client.put(tokens, [pool[i % 16] for i in range(blocks)])
            hashes = off.hashes(tokens)
            samples: dict[str, list[float]] = {"off": [], "on": []}
            with progress.bar("Lookups", 2 * args.repeat, "call", scale=False) as bar:
                for _ in range(max(args.repeat, 1)):
                    for name, client in (("off", off), ("on", on)):
                        start = time.perf_counter()
                        found = client.lookup_hashes(hashes)
                        samples[name].append(time.perf_counter() - start)
                        if found.found_blocks != blocks:
                            raise RuntimeError(f"a Lookup found {found.found_blocks} blocks, expected {blocks}")
                        bar.update(1)
        loop_s, writer_s = asyncio.run(_record_costs(folder / "local", blocks, args.repeat))
        report.notes["trace_files_bytes"] = sum(p.stat().st_size for p in (folder / "trace").glob("*"))
    what = f"Lookup of {len(tokens):,} tokens over gRPC"
    off_best, on_best = min(samples["off"]), min(samples["on"])
    report.add(Figure.against(f"{what}, trace on (best)", on_best * 1e3, "ms", f"{what}, trace off (best)",
                              off_best * 1e3))
    report.add(Figure.against(f"{what}, trace on (median)", statistics.median(samples["on"]) * 1e3, "ms",
                              f"{what}, trace off (median)", statistics.median(samples["off"]) * 1e3))
    report.add(Figure.against(f"recording that Lookup, on the event loop ({blocks:,} hashes)", loop_s * 1e3, "ms",
                              f"{what}, trace off (best)", off_best * 1e3))
    report.add(Figure.against(f"writing its record, on the writer's thread ({blocks:,} hashes)", writer_s * 1e3,
                              "ms", f"{what}, trace off (best)", off_best * 1e3))
    return report


async def _record_costs(folder: Path, blocks: int, repeat: int) -> tuple[float, float]:
    """Seconds a Lookup's record costs the event loop (best of `repeat`) and the writer's thread (per record)."""
    from gateway.trace_recorder import TraceRecorder
    from kvstore.clock import SystemClock
    from kvstore.config import TraceSettings
    from kvstore.prefix import FINGERPRINT_BYTES, BlockScope
    from tiers.chains import PackedHashes

    hashes = PackedHashes(os.urandom(32 * blocks))  # what a Lookup's packed hashes arrive as
    scope = BlockScope(b"\x01" * FINGERPRINT_BYTES, "bench")
    n = max(repeat, 1)
    rec = TraceRecorder(TraceSettings(enabled=True, queue_records=n, queue_bytes=1 << 40, flush_s=3600),
                        folder=folder, block_tokens=64, node="bench", clock=SystemClock())
    await rec.start()
    loop_s = float("inf")
    for _ in range(n):  # the writer gathers for flush_s: nothing else runs meanwhile
        start = time.perf_counter()
        rec.lookup(scope, hashes, blocks, lease_ms=30_000, swa_asked=4, swa=(0, 1024, 1024))
        loop_s = min(loop_s, time.perf_counter() - start)
    batch = list(rec._queue)
    start = time.perf_counter()
    rec._encode(batch)
    writer_s = (time.perf_counter() - start) / len(batch)
    await rec.close()
    return loop_s, writer_s
