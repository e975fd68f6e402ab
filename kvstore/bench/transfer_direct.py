"""Direct GPU restore of a 1M-token prompt, against a pinned H2D copy and the shm path, in one run.

`figures(args, progress)` is part of `kvstore bench transfer` (with CUDA; a note
says why it was skipped otherwise). A `kvstore serve` process holds the prompt's
blocks (15,625 blocks of 56,960 bytes at 1M tokens, 890 MB); a
`ColocatedReader` maps the server's data file read-only in this process and
`GpuGather` copies the blocks to the GPU with one kernel and checks their
checksums with a second one over the landed rows (docs/DIRECT_RESTORE.md; the
notes also give the restores with the checksums on CPU threads). Measured in the same run on
the same bytes:

- "direct gpu restore, 1M tokens" (each name gives the prompt's length, `--tokens`): Lookup
  (leased) + read transaction + kernel + checksums, as GB/s, against a contiguous pinned torch buffer copied to the GPU
  (the ceiling of any host -> GPU copy on this link);
- the same restore in ms against today's path: Lookup, shm fetch into a pinned
  region (the server copies), region -> GPU copy;
- the kernel alone (gather, and scatter into per-layer row tensors) against the
  pinned copy;
- the registration cost of the chunks the first restore registered, and the
  pinned budget used.

`python -m kvstore.bench.transfer_direct [--json] [--sweep]` runs it alone;
`--sweep` adds a synthetic mapped file and times the kernel's block sizes
(`kvstore.bench.direct_sweep`).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.harness import best_of, scratch, serve_process
from kvstore.bench.report import Figure, Progress, Report
from kvstore.geometry import V4_1_FLASH
from kvstore.host import usable_cpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the direct GPU figures (`kvstore bench transfer` adds them beside its own)."""
    parser.add_argument("--direct-budget-mib", type=int, default=4096,
                        help="pinned budget of the direct GPU restore in MiB (default 4096)")
    parser.add_argument("--direct-chunk-mib", type=int, default=64,
                        help="registration chunk of the direct GPU restore in MiB (default 64)")
    parser.add_argument("--direct-repeat", type=int, default=None,
                        help="runs per direct GPU figure, the best kept (default: --repeat, at least 5)")


def cuda_available() -> bool:
    """True when torch sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def figures(args: argparse.Namespace, progress: Progress, *, target: str | None = None,
            data_dir: Path | None = None, notes: dict[str, object] | None = None) -> list[Figure]:
    """The direct GPU restore figures (see the module docstring); [] with a note without CUDA.

    Args:
        args: `kvstore bench transfer`'s flags (tokens, block_tokens, repeat, and this module's).
        progress: progress bars.
        target, data_dir: a running `kvstore serve` that already holds the prompt's blocks
            (tokens 0..n*block_tokens-1, as `kvstore.bench.transfer.run` stores them) and
            its data dir; when None, this function starts one and stores them itself.
        notes: where to put the notes (registration, budget, GPU, skips).
    """
    notes = notes if notes is not None else {}
    if not cuda_available():
        notes["direct gpu"] = "skipped: no CUDA device (the direct GPU restore needs one)"
        return []
    block_tokens = getattr(args, "block_tokens", 64)
    n = max(getattr(args, "tokens", 1_000_000) // block_tokens, 1)
    block_bytes = V4_1_FLASH.block_bytes(block_tokens)
    if target is not None and data_dir is not None:
        return _with_store(args, progress, target, data_dir, n, block_bytes, notes)
    with scratch() as folder, serve_process(folder / "store", n * block_bytes, block_tokens) as served:
        _fill(served, n, block_tokens, block_bytes, progress)
        return _with_store(args, progress, served, folder / "store", n, block_bytes, notes)


def _fill(target: str, n: int, block_tokens: int, block_bytes: int, progress: Progress) -> None:
    """Store n random blocks under tokens 0..n*block_tokens-1, as the transfer bench does."""
    from kvstore.client import Client

    source = np.random.default_rng(0).integers(0, 256, size=n * block_bytes, dtype=np.uint8)
    tokens = list(range(n * block_tokens))
    with Client(target) as client, progress.bar("direct: put", n * block_bytes) as bar:
        for lo in range(0, n, 1024):
            hi = min(lo + 1024, n)
            client.put(tokens[: hi * block_tokens],
                       [source[i * block_bytes:(i + 1) * block_bytes].tobytes() for i in range(lo, hi)],
                       first_block=lo)
            bar.update((hi - lo) * block_bytes)


def _repeat(args: argparse.Namespace) -> int:
    chosen = getattr(args, "direct_repeat", None)
    return int(chosen) if chosen else max(getattr(args, "repeat", 3), 5)


def _sync_timed(fn: Callable[[], object]) -> Callable[[], object]:
    import torch

    def run() -> object:
        out = fn()
        torch.cuda.synchronize()
        return out
    return run


def _with_store(args: argparse.Namespace, progress: Progress, target: str, data_dir: Path, n: int,
                block_bytes: int, notes: dict[str, object]) -> list[Figure]:
    import torch

    from kvstore.client import Client
    from kvstore.client.gpu_gather import GpuGather

    try:
        from kvstore.client.colocated import ColocatedReader
    except ImportError as exc:
        notes["direct gpu"] = f"skipped: kvstore.client.colocated is not importable ({exc})"
        return []
    repeat = _repeat(args)
    total = n * block_bytes
    gb = total / 1e9
    block_tokens = getattr(args, "block_tokens", 64)
    out: list[Figure] = []
    device = torch.empty((n, block_bytes), dtype=torch.uint8, device="cuda")
    budget = getattr(args, "direct_budget_mib", 4096) << 20
    chunk = getattr(args, "direct_chunk_mib", 64) << 20
    with Client(target) as client, ColocatedReader(data_dir, threads=usable_cpus()) as reader, \
            GpuGather(budget_bytes=budget, chunk_bytes=chunk) as gather:
        reader.on_close(gather.close)  # no pinned range outlives the mapping
        warm_s = gather.warm_up()  # Triton compiles here, as an engine would at start
        hashes = client.hashes(list(range(n * block_tokens)))
        lookup_s = [0.0]
        plain_lookup = client.lookup_hashes

        def timed_lookup(*a: Any, **k: Any) -> Any:  # the Lookup's share of reader.read
            began = time.perf_counter()
            try:
                return plain_lookup(*a, **k)
            finally:
                lookup_s[0] = time.perf_counter() - began

        client.lookup_hashes = timed_lookup  # type: ignore[method-assign]

        def restore(wait: bool = False) -> dict[str, float]:
            # wait=False, as restore() does on the GPU path: the copy runs while the Lookup is in
            # flight, and the gatherer cuts at its answer after the kernels.
            began = time.perf_counter()
            read = reader.read(client, hashes, lease_ms=10_000, wait=wait)
            opened = time.perf_counter()
            try:
                _, result = gather.gather(read, device)
            finally:
                copied = time.perf_counter()
                read.close()
            if result.blocks != n or result.corrupt:
                raise RuntimeError(f"direct restore used {result.blocks} of {n} blocks (corrupt {result.corrupt})")
            return {"read_ms": (opened - began) * 1e3, "lookup_in_read_ms": lookup_s[0] * 1e3,
                    "gather_ms": (copied - opened) * 1e3,
                    "close_ms": (time.perf_counter() - copied) * 1e3, "kernel_ms": result.copy_s * 1e3,
                    "verify_ms": result.verify_s * 1e3, "register_ms": result.register_s * 1e3}

        with progress.bar("direct gpu restore (cold)", 1, unit="run"):
            start = time.perf_counter()
            cold_phases = restore()
            torch.cuda.synchronize()
            cold = time.perf_counter() - start
        stats = gather.stats
        check = client.get_tensor(list(range(n * block_tokens)))[0]
        if not torch.equal(device.cpu(), check):
            raise RuntimeError("the direct GPU restore landed bytes that differ from the server's Get")
        del check
        times, phases = [], []
        with progress.bar("direct gpu restore", repeat, unit="run") as bar:
            for _ in range(repeat):
                start = time.perf_counter()
                phases.append(restore())
                times.append(time.perf_counter() - start)
                bar.update(1)
        gather.checksums_on = "cpu"  # the same with the checksums on CPU threads beside the copy
        cpu_runs, cpu_phases = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            cpu_phases.append(restore())
            cpu_runs.append(time.perf_counter() - start)
        gather.checksums_on = "auto"
        waited = []  # the same with read() waiting for the Lookup before the copy (no overlap)
        for _ in range(repeat):
            start = time.perf_counter()
            restore(wait=True)
            waited.append(time.perf_counter() - start)
        gc_off = []  # the same with Python's collector paused (an engine may gc.freeze() its heap)
        gc.collect()
        gc.disable()
        try:
            for _ in range(repeat):
                start = time.perf_counter()
                restore()
                gc_off.append(time.perf_counter() - start)
        finally:
            gc.enable()
        lookups = []
        for _ in range(repeat):
            start = time.perf_counter()
            hit = client.lookup_hashes(hashes, lease_ms=10_000)
            lookups.append(time.perf_counter() - start)
            if hit.lease_id:
                client.release(hit.lease_id)
        restore_s = min(times)
        pinned_s = _pinned_h2d(total, repeat)
        kernel_s, scatter_s = _kernel_only(reader, client, hashes, gather, device, repeat, block_tokens)
        read_parts = _read_parts(reader, client, hashes, repeat)
        try:  # today's path is another module's: its failure must not hide the direct figures
            shm_s: float | None = _shm_h2d(client, hashes, total, repeat, progress)
        except Exception as exc:
            shm_s = None
            notes["direct gpu shm baseline"] = f"failed: {type(exc).__name__}: {exc}"
        h2d = gb / pinned_s
        baseline = "contiguous pinned H2D of the same bytes"
        span = tokens_label(n * block_tokens)
        out.append(Figure.against(f"direct gpu restore, {span}", gb / restore_s, "GB/s", baseline, h2d))
        if shm_s is not None:
            out.append(Figure.against(f"direct gpu restore, {span}, lookup included", restore_s * 1e3, "ms",
                                      "lookup + shm fetch into a pinned region + region -> gpu copy", shm_s * 1e3))
        else:
            out.append(Figure(name=f"direct gpu restore, {span}, lookup included", value=restore_s * 1e3,
                              unit="ms"))
        out.append(Figure.against(f"direct gpu gather kernel, {span}", gb / kernel_s, "GB/s", baseline, h2d))
        out.append(Figure.against(f"direct gpu scatter into per-layer rows, {span}", gb / scatter_s, "GB/s",
                                  baseline, h2d))
        out.append(Figure(name=f"direct gpu restore, {span}, first (registers; kernels warmed)", value=cold * 1e3,
                          unit="ms"))
        out.append(Figure(name="direct gpu registration", value=stats.register_s * 1e3, unit="ms"))
        notes["direct gpu"] = {
            "gpu": torch.cuda.get_device_name(), "blocks": n, "bytes": total,
            "warm_up_ms": round(warm_s * 1e3, 3),
            "restore_ms_runs": [round(t * 1e3, 3) for t in times],
            "restore_ms_median": round(statistics.median(times) * 1e3, 3),
            "restore_ms_runs_gc_paused": [round(t * 1e3, 3) for t in gc_off],
            "restore_ms_runs_lookup_waited": [round(t * 1e3, 3) for t in waited],
            "read_resolves": "records looked up over the reader's threads; the Lookup overlaps the copy",
            "checksums_on": "gpu (xxh3 kernel over the landed rows)",
            "restore_ms_runs_cpu_checksums": [round(t * 1e3, 3) for t in cpu_runs],
            "restore_phases_ms_runs_cpu_checksums": {k: [round(p[k], 2) for p in cpu_phases] for k in cpu_phases[0]},
            "restore_phases_best_ms": {k: round(v, 3) for k, v in phases[times.index(min(times))].items()},
            "restore_phases_ms_runs": {k: [round(p[k], 2) for p in phases] for k in phases[0]},
            "restore_phases_cold_ms": {k: round(v, 3) for k, v in cold_phases.items()},
            "lookup_alone_ms_best": round(min(lookups) * 1e3, 3),
            "read_parts_best_ms": read_parts,
            "target_restore_ms": 25.0, "target_ratio_vs_pinned": 0.85,
            "registrations": stats.registrations, "registered_bytes": stats.registered_bytes_total,
            "register_ms": round(stats.register_s * 1e3, 3),
            "register_ms_per_gib": round(stats.register_s * 1e3 / max(stats.registered_bytes_total / 2**30, 1e-9), 3),
            "pinned_budget_bytes": budget, "pinned_peak_bytes": stats.peak_bytes,
            "pinned_used_bytes": gather.registry.used_bytes, "chunk_bytes": chunk,
            "data_file_bytes": os.path.getsize(Path(data_dir) / "data.mdb"),
        }
    return out


def _pinned_h2d(total: int, repeat: int) -> float:
    """Best seconds to copy a contiguous pinned buffer of `total` bytes to the GPU."""
    import torch

    pinned = torch.randint(0, 256, (total,), dtype=torch.uint8).pin_memory()
    dest = torch.empty(total, dtype=torch.uint8, device="cuda")
    copy = _sync_timed(lambda: dest.copy_(pinned, non_blocking=True))
    copy()
    return best_of(copy, repeat)


def _read_parts(reader: Any, client: Any, hashes: list[bytes], repeat: int) -> dict[str, float]:
    """Best milliseconds of what `reader.read` does, each alone: the record searches on one thread
    and over the reader's threads (`kvstore.native.blockcopy.resolve_many`), and sending the Lookup (the
    call made, not answered) and its answer."""
    from kvstore.client.colocated_read import _start_lookup
    from kvstore.native import blockcopy

    parts: dict[str, float] = {}
    with reader.read(client, hashes, lease_ms=10_000) as read:
        txn, psize = read._txn, reader._env.stat()["psize"]
        root = blockcopy.named_root(read.base_address, read.map_length, psize, txn.id(), b"records")
        native = blockcopy.resolve
        if root is not None and native is not None:
            args = (read.base_address, read.map_length, psize, root, read._scope.prefix, hashes)
            parts["resolve_one_thread_ms"] = best_of(lambda: native(*args), repeat) * 1e3
            parts["resolve_threads_ms"] = best_of(lambda: blockcopy.resolve_many(*args, reader.threads), repeat) * 1e3
    sends, answers = [], []
    for _ in range(repeat):
        began = time.perf_counter()
        future = _start_lookup(client, hashes, 10_000)
        sent = time.perf_counter()
        reply = future.result()
        sends.append(sent - began)
        answers.append(time.perf_counter() - began)
        if reply.lease_id:
            client.release(reply.lease_id)
    parts["lookup_send_ms"] = min(sends) * 1e3
    parts["lookup_answer_ms"] = min(answers) * 1e3
    return {k: round(v, 3) for k, v in parts.items()}


def _kernel_only(reader: Any, client: Any, hashes: list[bytes], gather: Any, device: Any, repeat: int,
                 block_tokens: int) -> tuple[float, float]:
    """Best seconds of the gather kernel and of the scatter kernel alone, by CUDA events (one open
    read, chunks registered, no checksums): the copy's own rate."""
    import torch

    geo = V4_1_FLASH
    with reader.read(client, hashes, lease_ms=10_000) as read:
        n = len(read.spans)
        gather.gather(read, device, verify=False)
        kernel_s = min(gather.gather(read, device, verify=False)[1].copy_s for _ in range(repeat))
        layers = {layer: (torch.empty((n, geo.block_rows(layer, block_tokens), geo.compressed_kv_row_bytes),
                                      dtype=torch.uint8, device="cuda"),
                          torch.empty((n, geo.block_rows(layer, block_tokens), geo.indexer_row_bytes),
                                      dtype=torch.uint8, device="cuda"))
                  for layer in geo.kv_source_layers}
        gather.scatter(read, layers, verify=False, block_tokens=block_tokens)
        scatter_s = min(gather.scatter(read, layers, verify=False, block_tokens=block_tokens).copy_s
                        for _ in range(repeat))
        from kvstore.codec.block_codec import split_blocks

        for layer, (kv, index) in split_blocks(geo, device[:n], block_tokens).items():
            if not (torch.equal(kv, layers[layer][0]) and torch.equal(index, layers[layer][1])):
                raise RuntimeError(f"scatter wrote layer {layer}'s rows wrong")
    return kernel_s, scatter_s


def _shm_h2d(client: Any, hashes: list[bytes], total: int, repeat: int, progress: Progress) -> float:
    """Best seconds of today's same-host path to the GPU: leased Lookup, shm fetch into a pinned
    region (the server copies from its map), region -> GPU copy."""
    import torch

    dest = torch.empty(total, dtype=torch.uint8, device="cuda")
    with client.transfer(path="shm") as session:
        region = session.register(total)
        pages = region.tensor()
        pages.fill_(1)
        region.pin()

        def run() -> None:
            hit = client.lookup_hashes(hashes, lease_ms=10_000)
            state = session.fetch(hashes[: hit.found_blocks], region)
            if state.done_prefix != len(hashes):
                raise RuntimeError(f"shm fetch loaded {state.done_prefix} of {len(hashes)} blocks")
            dest.copy_(pages, non_blocking=True)
            torch.cuda.synchronize()
            if hit.lease_id:
                client.release(hit.lease_id)

        with progress.bar("shm fetch + gpu copy", repeat, unit="run"):
            run()
            return best_of(run, repeat)


def main(argv: list[str] | None = None) -> int:
    """Run the figures alone: `python -m kvstore.bench.transfer_direct [--json] [--sweep]`."""
    parser = argparse.ArgumentParser(prog="kvstore.bench.transfer_direct")
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="also the kernel sweep on a synthetic mapped file")
    parser.add_argument("--no-store", action="store_true", help="skip the figures with a kvstore serve process")
    add_arguments(parser)
    args = parser.parse_args(argv)
    report = Report(bench="transfer-direct")
    progress = Progress(enabled=not args.json)
    n = max(args.tokens // args.block_tokens, 1)
    if args.sweep and cuda_available():
        from kvstore.bench.direct_sweep import sweep

        for figure in sweep(n, V4_1_FLASH.block_bytes(args.block_tokens), args.repeat, report.notes):
            report.add(figure)
    if not args.no_store:
        for figure in figures(args, progress, notes=report.notes):
            report.add(figure)
    print(report.to_json() if args.json else report.to_table())
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def tokens_label(tokens: int) -> str:
    """How a figure's name gives the prompt it moved: "1M tokens" at the default, else the count."""
    return "1M tokens" if tokens == 1_000_000 else f"{tokens:,} tokens"
