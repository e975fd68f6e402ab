"""What every benchmark needs around its figures: scratch space, a `kvstore serve`
process, a bare gRPC streaming server and plain LMDB as baselines, and timers.

Servers run in their own processes, as in production: a server sharing the
benchmark's interpreter would share its GIL and understate both sides.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

GiB = 1 << 30
RAW_METHOD = "/bench.Raw/Stream"

# A generic handler with no protobuf and no logic (argv: n, size): `Stream` yields
# the messages lo..hi-1 of `size` bytes cut from an in-memory pool; `Unary`
# answers as many bytes as the request names (the transfer bench's small calls).
RAW_SERVER = """
import asyncio, os, sys
import grpc
n, size = int(sys.argv[1]), int(sys.argv[2])
pool = [os.urandom(size) for _ in range(64)]
big = b''
def unary(req, ctx):
    global big
    want = int.from_bytes(req, 'big')
    if len(big) < want:
        big = os.urandom(want)
    return big[:want]
def stream(req, ctx):
    lo, hi = int.from_bytes(req[:8], 'big'), int.from_bytes(req[8:], 'big')
    for i in range(lo, hi):
        yield pool[i % 64]
async def main():
    server = grpc.aio.server(options=[('grpc.max_send_message_length', -1)])
    handler = grpc.method_handlers_generic_handler('bench.Raw', {
        'Unary': grpc.unary_unary_rpc_method_handler(unary),
        'Stream': grpc.unary_stream_rpc_method_handler(stream)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port('127.0.0.1:0')
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` calls, in seconds (the least disturbed by other work)."""
    return min(timed(fn) for _ in range(max(repeat, 1)))


def process_stat(pid: int, *, thread: int | None = None) -> list[str] | None:
    """The fields after the command name of /proc/PID/stat (or of its thread `thread`, a native thread id: the
    main thread's is the pid); None where it cannot be read (not Linux, or the process gone)."""
    stat = Path(f"/proc/{pid}/stat") if thread is None else Path(f"/proc/{pid}/task/{thread}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def stat_cpu_s(fields: list[str]) -> float:
    """CPU seconds (user + system) in `process_stat`'s fields."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int | None, *, thread: int | None = None) -> float | None:
    """CPU seconds (user + system) process `pid` has used, or only its thread `thread` (`process_stat`); None
    where it cannot be read, or for no pid."""
    fields = process_stat(pid, thread=thread) if pid is not None else None
    return stat_cpu_s(fields) if fields is not None else None


def process_run_queue_s(pid: int | None) -> float | None:
    """Seconds the threads of process `pid` alive now have spent runnable but not running (the second field of
    /proc/PID/task/*/schedstat, summed): the part of its time it waited for a CPU. None where it cannot be read."""
    if pid is None:
        return None
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total, read = 0, False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                total += schedstat_wait_ns(f.read())
            read = True
        except (OSError, IndexError, ValueError):  # a thread gone meanwhile
            continue
    return total / 1e9 if read else None


def schedstat_wait_ns(schedstat: bytes) -> int:
    """A thread's time runnable but not running, in ns: the second of schedstat's three fields (on CPU, waiting,
    timeslices).

    Raises:
        IndexError, ValueError: not a schedstat line.
    """
    return int(schedstat.split()[1])


@contextmanager
def scratch(folder: Path | None = None) -> Iterator[Path]:
    """A temporary folder (on the disk under test when `folder` is given), removed after."""
    path = Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=folder))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def serve_process(data_dir: Path, data_bytes: int, block_tokens: int,
                  extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """A `kvstore serve` child process sized for `data_bytes`; yields its target."""
    env = {**os.environ, "KVSTORE_STORE_CAPACITY_BYTES": str(int(data_bytes * 1.2) + GiB),
           "KVSTORE_STORE_BLOCK_TOKENS": str(block_tokens), **(extra_env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir",
                             str(data_dir)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        match = re.search(r":(\d+)$", proc.stdout.readline().strip())
        if not match:
            raise RuntimeError("kvstore serve did not start")
        yield f"127.0.0.1:{match.group(1)}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@contextmanager
def raw_stream_server(n: int, size: int) -> Iterator[Callable[[int, int], Iterator[bytes]]]:
    """A bare gRPC server in its own process; yields `stream(lo, hi)`, the messages lo..hi-1."""
    import grpc

    proc = subprocess.Popen([sys.executable, "-c", RAW_SERVER, str(n), str(size)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1)])
        call = channel.unary_stream(RAW_METHOD)

        def stream(lo: int, hi: int) -> Iterator[bytes]:
            return iter(call(lo.to_bytes(8, "big") + hi.to_bytes(8, "big")))

        try:
            yield stream
        finally:
            channel.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class RawLmdb:
    """Plain LMDB on the same disk: same sync settings, one transaction per batch, no kvstore logic."""

    def __init__(self, path: Path, total_bytes: int) -> None:
        import lmdb

        self.env = lmdb.open(str(path), map_size=total_bytes * 2 + GiB, sync=True, metasync=True,
                             readahead=False, max_dbs=8)
        self.db = self.env.open_db(b"blocks")
        self.next_key = 0

    def put(self, blocks: list[bytes], batch: int) -> int:
        """Write `blocks`, `batch` to a transaction; how many transactions."""
        # Keys shaped like kvstore's (48 bytes, uniformly spread), so the B-tree
        # does the same page work; sequential keys would flatter the baseline less fairly.
        for lo in range(0, len(blocks), batch):
            with self.env.begin(write=True) as txn:
                for block in blocks[lo:lo + batch]:
                    txn.put(hashlib.sha256(self.next_key.to_bytes(8, "big")).digest()[:16] * 3, block, db=self.db)
                    self.next_key += 1
        return -(-len(blocks) // batch)

    def close(self) -> None:
        self.env.close()
