"""Batched fetch of a 1M-token prompt's blocks into a registered region, per path.

In one run, a `kvstore serve` process holds the prompt's blocks (890 MB at full
size) and a client fetches them into a registered region, each path beside its
baseline measured in the same run on the same bytes:

- shared memory (the server copies from LMDB's map into the client's sealed memfd
  pages), a sweep of descriptors per batch: against a plain memcpy into a
  pre-faulted buffer;
- the striped gRPC path (`Transfer.Fetch`, `--streams` calls in flight): against
  one bare gRPC stream and the same number of bare streams at once, block-sized
  messages copied into a region, no kvstore logic;
- the bulk transport (the server's Mooncake engines write into the region), when
  the server and this host can run it: against Mooncake's own batch read of the
  same bytes (TCP on loopback, another process), taken in turns with it; the
  gRPC path is set against that read too. Without Mooncake these figures are
  skipped and the report's notes say why;
- the one-copy TCP transport (`transfer.tcp_bulk`: the server sends verified blocks from its
  map over a socket, the client reads them into the region), taken in turns with the bulk
  fetch and Mooncake's raw read: against that read, the bulk fetch and the gRPC fetch;
- small fetches of 1, 8 and 64 descriptors (`--small`), p50 of `--small-calls`:
  through the session's request ring, by Submit, and over gRPC, against memcpy of
  the same bytes and one raw unary gRPC call answering them.

With CUDA: copying the pinned region to the GPU against a pinned torch buffer of
the same size, and the direct GPU restore (see `--direct-*`).
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import ExitStack
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from kvstore.bench.harness import best_of, raw_stream_server, scratch, serve_process
from kvstore.bench.report import Figure, Progress, Report
from kvstore.bench.transfer_baselines import mooncake_missing, mooncake_read_s, mooncake_reader, p50_s, raw_server
from kvstore.bench.transfer_tcp import mooncake_session, tcp_alone, tcp_checked, tcp_figures, tcp_session, tcp_turn
from kvstore.client.transfer import TransferSession
from kvstore.client.transfer_stream import checked_streams
from kvstore.counted import counted
from kvstore.geometry import V4_1_FLASH

if TYPE_CHECKING:
    from kvstore.client import Client



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench transfer`."""
    parser.add_argument("--tokens", type=int, default=1_000_000, help="prompt length (default 1M: 890 MB)")
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens per block (default 64)")
    parser.add_argument("--batches", default="1,8,64,512", help="descriptors per batch to sweep (default 1,8,64,512)")
    parser.add_argument("--small-batch-blocks", type=int, default=256,
                        help="blocks fetched per descriptor of batch size (caps the slow small-batch points)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept (default 3)")
    parser.add_argument("--small", default="1,8,64",
                        help="descriptors per fetch for the small-batch latency figures (default 1,8,64; '' skips)")
    parser.add_argument("--small-calls", type=int, default=200, help="fetches per small-batch figure (p50 of them)")
    parser.add_argument("--streams", type=int, default=None,
                        help="Fetch calls in flight on the gRPC path (default: two per core, 2 to 8)")
    parser.add_argument("--gpu", choices=("auto", "on", "off"), default="auto",
                        help="region -> GPU copy and direct GPU restore figures (auto: when CUDA is available)")
    from kvstore.bench import transfer_direct

    transfer_direct.add_arguments(parser)



def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Run the benchmark; see the module docstring."""
    from kvstore.client import Client

    block_bytes = V4_1_FLASH.block_bytes(args.block_tokens)
    n = max(args.tokens // args.block_tokens, 1)
    total = n * block_bytes
    batches = [int(b) for b in args.batches.split(",")]
    report = Report(bench="transfer")
    report.notes.update(blocks=n, block_bytes=block_bytes, total_bytes=total, cpus=os.cpu_count(),
                        repeat=args.repeat)
    source = np.random.default_rng(0).integers(0, 256, size=total, dtype=np.uint8)
    memcpy_s = _memcpy(source, args.repeat)
    gb = total / 1e9
    # The bulk transport on (it is off by default): refused, with the reason noted, where Mooncake cannot run.
    # And the one-copy TCP transport beside it (a session asks for it first; the Mooncake one is asked for
    # by KVSTORE_CLIENT_BULK=mooncake, kvstore.bench.transfer_tcp).
    bulk_env = {"KVSTORE_TRANSFER_BULK": "mooncake", "KVSTORE_TRANSFER_TCP_BULK": "true"}
    bulk_gbs: float | None = None
    beside_gbs: float | None = None
    tcp_gbs: float | None = None
    with scratch() as folder, serve_process(folder / "store", total, args.block_tokens, bulk_env) as target:
        with Client(target) as client:
            tokens = list(range(n * args.block_tokens))
            with progress.bar("put", total) as bar:
                step = 1024
                for lo in range(0, n, step):
                    hi = min(lo + step, n)
                    client.put(tokens[: hi * args.block_tokens],
                               [source[i * block_bytes:(i + 1) * block_bytes].tobytes() for i in range(lo, hi)],
                               first_block=lo)
                    bar.update((hi - lo) * block_bytes)
            hashes = client.hashes(tokens)
            if args.small:
                _small_batches(report, client, hashes, [int(b) for b in args.small.split(",")], args.small_calls,
                               source, progress)
            for path in ("shm", "stream"):
                _fetch_path(report, client, path, hashes, batches, args, source, memcpy_s, progress)
            bulk_gbs, beside_gbs, tcp_gbs = _bulk(report, client, hashes, max(batches), args, source, progress)
        if args.gpu != "off":  # direct GPU restore vs pinned H2D and shm + H2D; a note without CUDA
            from kvstore.bench import transfer_direct

            for figure in transfer_direct.figures(args, progress, target=target, data_dir=folder / "store",
                                                  notes=report.notes):
                report.add(figure)
        raw_s = _raw_grpc(n, block_bytes, args.repeat, progress)
        streams = checked_streams(args.streams)
        striped_s = _raw_striped(n, block_bytes, streams, args.repeat, progress)
    stream_full = next(f for f in report.figures if f.name == f"grpc fetch batch={max(batches)}")
    report.add(Figure.against(f"grpc fetch batch={max(batches)} vs raw gRPC", stream_full.value, "GB/s",
                              "raw gRPC stream, same bytes, copied into a region", gb / raw_s))
    report.add(Figure.against(f"grpc fetch batch={max(batches)} vs {streams} raw gRPC streams", stream_full.value,
                              "GB/s", f"{streams} raw gRPC streams at once, same bytes, copied into a region",
                              gb / striped_s))
    report.notes["streams"] = streams
    mooncake_gbs = _mooncake(report, source, block_bytes, max(batches), args.repeat, stream_full.value, progress,
                             beside_gbs)
    if bulk_gbs is not None:
        report.add(Figure.against("bulk fetch vs grpc fetch", bulk_gbs, "GB/s",
                                  f"grpc fetch batch={max(batches)}, same run", stream_full.value))
        if mooncake_gbs is not None:
            report.add(Figure.against("bulk fetch vs mooncake", bulk_gbs, "GB/s",
                                      "Mooncake transfer engine TCP batch read, same bytes", mooncake_gbs))
    tcp_figures(report, tcp_gbs, stream_full.value, bulk_gbs, mooncake_gbs)
    if args.gpu == "on" or (args.gpu == "auto" and _cuda()):
        _gpu(report, total, args.repeat)
    return report


def _memcpy(source: np.ndarray, repeat: int) -> float:
    dest = np.ones_like(source)  # pre-faulted, like the region
    return best_of(lambda: np.copyto(dest, source), repeat)


def _fetch_path(report: Report, client: Client, path: str, hashes: list[bytes], batches: list[int],
                args: argparse.Namespace, source: np.ndarray, memcpy_s: float, progress: Progress) -> None:
    block_bytes = client.block_bytes
    name = "shm" if path == "shm" else "grpc"
    with TransferSession(client.connection, path=path, streams=args.streams) as session:
        region = session.register(len(hashes) * block_bytes)
        region.tensor().fill_(1)  # pre-fault the pages, as the memcpy baseline's are
        for batch in batches:
            count = min(len(hashes), batch * args.small_batch_blocks)
            nbytes = count * block_bytes
            with progress.bar(f"{name} fetch batch={batch}", nbytes * args.repeat) as bar:
                def fetch(count: int = count, batch: int = batch) -> None:
                    state = session.fetch(hashes[:count], region, batch_descriptors=batch)
                    if state.done_prefix != count:
                        raise RuntimeError(f"{path} fetch loaded {state.done_prefix} of {count} blocks")
                    bar.update(state.bytes_moved)
                seconds = best_of(fetch, args.repeat)
            if count == len(hashes):
                view = np.frombuffer(region.view, dtype=np.uint8)
                if not np.array_equal(view, source):
                    raise RuntimeError(f"{path} fetch landed the wrong bytes")
                del view
            label = f"{name} fetch batch={batch}" + ("" if count == len(hashes) else f" ({counted(count, 'block')})")
            rate = nbytes / seconds / 1e9
            if path == "shm":
                # memcpy's rate does not depend on the size past a few MB: one baseline for every point.
                report.add(Figure.against(label, rate, "GB/s", "memcpy of the same bytes",
                                          source.nbytes / memcpy_s / 1e9))
            else:
                report.add(Figure(name=label, value=rate, unit="GB/s"))


def _small_batches(report: Report, client: Client, hashes: list[bytes], sizes: list[int], calls: int,
                   source: np.ndarray, progress: Progress) -> None:
    """p50 latency and GB/s of one fetch of 1, 8, 64 descriptors per path, beside memcpy of the
    same bytes (shm) and one raw unary gRPC call answering the same bytes (the gRPC path).

    The shm path is measured twice: through the session's request ring (the default) and
    by Submit with wait (`ring=False`). Each figure's baseline is measured right after it.
    """
    size = client.block_bytes
    variants = (("shm", "shm", True), ("shm submit", "shm", False), ("grpc", "stream", True))
    with raw_server(size) as raw:
        for name, path, ring in variants:
            with TransferSession(client.connection, path=path, ring=ring) as session:
                region = session.register(max(sizes) * size)
                region.tensor().fill_(1)
                if name == "shm":
                    report.notes["ring"] = "on" if session.ring is not None else f"off: {session.ring_reason}"
                for n in sizes:
                    nbytes = n * size
                    with progress.bar(f"{name} fetch of {n} (p50)", calls):
                        fetch_s = p50_s(partial(session.fetch, hashes[:n], region, batch_descriptors=n), calls)
                    if path == "shm":
                        dest = np.ones(nbytes, dtype=np.uint8)
                        base_s = p50_s(partial(np.copyto, dest, source[:nbytes]), calls)
                        base = "memcpy of the same bytes"
                    else:
                        base_s = p50_s(partial(raw.unary, nbytes), calls)
                        base = "one raw unary gRPC call answering the same bytes"
                    report.add(Figure.against(f"{name} fetch of {n} p50", fetch_s * 1e6, "us", base, base_s * 1e6))
                    if path == "shm":  # the latency target is against a round trip on either path
                        unary_s = p50_s(partial(raw.unary, nbytes), calls)
                        report.add(Figure.against(f"{name} fetch of {n} p50 vs unary", fetch_s * 1e6, "us",
                                                  "one raw unary gRPC call answering the same bytes", unary_s * 1e6))
                    report.add(Figure.against(f"{name} fetch of {n} rate", nbytes / fetch_s / 1e9, "GB/s", base,
                                              nbytes / base_s / 1e9))


def _raw_striped(n: int, size: int, streams: int, repeat: int, progress: Progress) -> float:
    """Best seconds to stream n block-sized messages over `streams` raw gRPC streams at once into a region."""
    from kvstore.region import Region

    with raw_server(size) as raw, Region(n * size) as region:
        view = region.view
        view[:] = b"\1" * len(view)
        with progress.bar(f"raw gRPC, {streams} streams", n * size):
            seconds = best_of(lambda: raw.striped(view, n, streams), repeat)
        view.release()
    return seconds


def _mooncake(report: Report, source: np.ndarray, block_bytes: int, batch: int, repeat: int, grpc_gbs: float,
              progress: Progress, measured_gbs: float | None = None) -> float | None:
    """Mooncake's transfer engine (TCP, loopback, another process) reading the same bytes in batches
    of `batch` block-sized reads, beside the gRPC path's figure; its GB/s (`measured_gbs` when it
    was measured already, in turns with the bulk fetch), or None and a note when it cannot run."""
    missing = mooncake_missing()
    if missing:
        report.notes["mooncake"] = f"skipped: {missing}; no figure against it"
        return None
    if measured_gbs is None:
        with progress.bar("mooncake batch read", source.nbytes):
            seconds = mooncake_read_s(source.data, block_bytes, batch, repeat)
        measured_gbs = source.nbytes / seconds / 1e9
    gbs = measured_gbs
    report.add(Figure.against("grpc fetch vs mooncake", grpc_gbs, "GB/s",
                              "Mooncake transfer engine TCP batch read, same bytes", gbs))
    report.notes["mooncake"] = f"TCP on loopback, P2P handshake, batches of {batch} block-sized reads"
    return gbs


def _bulk(report: Report, client: Client, hashes: list[bytes], batch: int, args: argparse.Namespace,
          source: np.ndarray, progress: Progress) -> tuple[float | None, float | None, float | None]:
    """The whole fetch over the bulk transport (the server's Mooncake engine writes into the region),
    in turns with Mooncake's raw read of the same bytes and the one-copy TCP transport's fetch (so
    load that comes and goes on the box weighs on all three); their GB/s (bulk, raw read, tcp), or
    None and a note saying why one could not run."""
    block_bytes = client.block_bytes
    nbytes = len(hashes) * block_bytes
    with mooncake_session(client.connection, args.streams) as session, ExitStack() as stack:
        tcp = tcp_session(stack, report, client.connection, args.streams, nbytes)
        if session.bulk is None:
            report.notes["bulk"] = f"skipped: {session.bulk_reason}; no figure"
            return None, None, (None if tcp is None else tcp_alone(tcp, hashes, batch, args.repeat, source))
        region = session.register(nbytes)
        region.tensor().fill_(1)  # pre-fault the pages, as the other figures' regions are
        raw = None if mooncake_missing() else stack.enter_context(mooncake_reader(source.data, block_bytes, batch))
        bulk_s = raw_s = float("inf")
        tcp_s = [float("inf")]
        with progress.bar(f"bulk fetch batch={batch}, mooncake read in turns", nbytes * args.repeat) as bar:
            for _ in range(max(args.repeat, 1)):
                if tcp is not None:
                    tcp_turn(tcp, hashes, batch, tcp_s)
                t0 = time.perf_counter()
                state = session.fetch(hashes, region, batch_descriptors=batch)
                bulk_s = min(bulk_s, time.perf_counter() - t0)
                if state.done_prefix != len(hashes):
                    raise RuntimeError(f"bulk fetch loaded {state.done_prefix} of {len(hashes)} blocks")
                if raw is not None:
                    t0 = time.perf_counter()
                    raw()
                    raw_s = min(raw_s, time.perf_counter() - t0)
                bar.update(state.bytes_moved)
        if session.bulk is None:
            raise RuntimeError(f"the bulk transport failed during the run: {session.bulk_reason}")
        if not np.array_equal(np.frombuffer(region.view, dtype=np.uint8), source):
            raise RuntimeError("bulk fetch landed the wrong bytes")
        lanes = len(session.bulk.lanes)
        report.notes["bulk"] = (f"Mooncake TCP on loopback, {session.bulk.max_blocks} blocks a BulkFetch, "
                                f"{session.bulk.in_flight()} in flight over {lanes} lane{'s' * (lanes > 1)} "
                                "(client engines, each written by one server engine); each round a bulk "
                                "fetch, then Mooncake's raw read (one engine each side, one batch at a time)")
        tcp_gbs = None if tcp is None else tcp_checked(tcp, source, tcp_s[0])
    gbs = nbytes / bulk_s / 1e9
    report.add(Figure(name=f"bulk fetch batch={batch}", value=gbs, unit="GB/s"))
    return gbs, (None if raw is None else source.nbytes / raw_s / 1e9), tcp_gbs


def _raw_grpc(n: int, size: int, repeat: int, progress: Progress) -> float:
    """Best seconds to stream n block-sized messages from a bare gRPC server and copy them into a region."""
    from kvstore.region import Region

    with raw_stream_server(n, size) as stream, Region(n * size) as region:
        view = region.view
        view[:] = b"\1" * len(view)

        def fetch() -> None:
            for lo in range(0, n, 512):  # the same per-call batch as the kvstore figure
                for i, msg in enumerate(stream(lo, min(lo + 512, n)), lo):
                    view[i * size:(i + 1) * size] = msg

        with progress.bar("raw gRPC stream", n * size):
            seconds = best_of(fetch, repeat)
        view.release()
    return seconds


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _gpu(report: Report, total: int, repeat: int) -> None:
    """Copy a pinned region to the GPU against a pinned torch buffer of the same size."""
    import torch

    from kvstore.region import Region

    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.ones(total, dtype=torch.uint8).pin_memory()

    def copy(src: torch.Tensor) -> None:
        device.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    with Region(total) as region:
        pages = region.tensor()
        pages.fill_(1)
        if not region.pin():
            return
        copy(pages)
        copy(pinned)
        region_s = best_of(lambda: copy(pages), repeat)
        pinned_s = best_of(lambda: copy(pinned), repeat)
        report.add(Figure.against("shm region -> gpu copy", total / region_s / 1e9, "GB/s",
                                  "pinned torch buffer -> gpu copy", total / pinned_s / 1e9))
    report.notes["gpu"] = torch.cuda.get_device_name()
