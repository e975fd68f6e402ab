"""The ceiling of a one-copy socket transport, for the cross-host fetch (issue 25 item 6).

LMCache's `resp://` moves a value with one copy on each side: redis-server writes it from its
memory into the socket, the C++ client reads it into the destination. kvstore's bulk path is
bounded by Mooncake's TCP engine and its gRPC path by grpc Python's copies (docs/BENCHMARKS.md,
"Against LMCache `resp://` and Mooncake"). This measures what the `resp://` shape reaches on
the same box: one process holds the blocks and, per request of `--batch` blocks, optionally
checks each against its xxh3-64 (kvstore's rule: every block verified before it leaves) and
sends them with `sendmsg` from its memory; another process sends the requests and `recv_into`s
the replies straight into a region. No kvstore code: a prototype's ceiling, not a kvstore path.

    python -m kvstore.bench.transfer_socket [--total-mib 1024] [--value-bytes 227840] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import sys
import time
from typing import Any

import numpy as np

from kvstore.transfer_tcp_wire import send_views

_send_all = send_views  # the transport's own scatter send (kvstore/transfer_tcp_wire.py)


def serve(conn: socket.socket, source: memoryview, value_bytes: int, verify: bool) -> None:
    """Answer requests (first and end block, 8 bytes each) until the peer closes."""
    digest: Any = None
    if verify:
        import xxhash

        digest = xxhash.xxh3_64_intdigest
    while True:
        request = conn.recv(16, socket.MSG_WAITALL)
        if len(request) < 16:
            return
        lo, hi = int.from_bytes(request[:8], "little"), int.from_bytes(request[8:], "little")
        views = [source[i * value_bytes:(i + 1) * value_bytes] for i in range(lo, hi)]
        if digest is not None:
            for v in views:
                digest(v)
        _send_all(conn, views)


def fetch(conn: socket.socket, region: memoryview, n: int, value_bytes: int, batch: int) -> None:
    """Blocks 0..n-1 into `region`, `batch` a request, each reply read straight into its slots."""
    for lo in range(0, n, batch):
        hi = min(lo + batch, n)
        conn.sendall(lo.to_bytes(8, "little") + hi.to_bytes(8, "little"))
        at, end = lo * value_bytes, hi * value_bytes
        while at < end:
            got = conn.recv_into(region[at:end])
            if not got:
                raise ConnectionError("the sender closed mid-reply")
            at += got


def run(total_bytes: int, value_bytes: int, batch: int, repeat: int, verify: bool) -> dict[str, Any]:
    """Best GB/s of `repeat` whole fetches between two processes on loopback; the bytes are checked."""
    n = max(total_bytes // value_bytes, 1)
    source = np.random.default_rng(0).integers(0, 256, size=n * value_bytes, dtype=np.uint8)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the sender: its own process, as a server's would be
        try:
            conn, _ = listener.accept()
            serve(conn, source.data, value_bytes, verify)
        finally:
            os._exit(0)
    listener.close()
    region = mmap.mmap(-1, n * value_bytes)
    view = memoryview(region)
    try:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            view[:] = b"\1" * len(view)  # pre-faulted, as the other figures' regions are
            times = []
            for _ in range(max(repeat, 1)):
                began = time.perf_counter()
                fetch(conn, view, n, value_bytes, batch)
                times.append(time.perf_counter() - began)
            landed = np.frombuffer(view, dtype=np.uint8)
            intact = bool(np.array_equal(landed, source))
            del landed
    finally:
        os.waitpid(pid, 0)
        view.release()
        region.close()
    if not intact:
        raise RuntimeError("the socket fetch landed the wrong bytes")
    return {"gbps_best": n * value_bytes / min(times) / 1e9, "gbps_runs": [n * value_bytes / t / 1e9 for t in times],
            "verify": verify, "blocks": n, "value_bytes": value_bytes, "batch": batch,
            "load_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    """Both variants (without and with the checksum pass), printed as JSON or lines."""
    parser = argparse.ArgumentParser(prog="kvstore.bench.transfer_socket", description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--value-bytes", type=int, default=227_840)
    parser.add_argument("--batch", type=int, default=256, help="blocks a request (default 256, as the peers')")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = {("verified" if verify else "unverified"): run(args.total_mib << 20, args.value_bytes, args.batch,
                                                         args.repeat, verify) for verify in (False, True)}
    if args.json:
        print(json.dumps(out))
    else:
        for name, r in out.items():
            print(f"one-copy socket, {name}: best {r['gbps_best']:.3f} GB/s (load {r['load_after']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
