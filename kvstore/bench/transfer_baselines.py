"""The transfer benchmark's peers: a bare gRPC server (unary calls and streams of
raw bytes, no protobuf, no kvstore logic) in its own process, and latency timers.

Each kvstore figure is set beside one of these, measured in the same run on the
same bytes, so the ratio holds on whatever box runs it.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from kvstore.bench.harness import RAW_SERVER, best_of


def p50_s(fn: Callable[[], object], calls: int) -> float:
    """The median seconds of `calls` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(max(calls, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class RawServer:
    """A bare gRPC server process and a channel to it.

    Args:
        block_bytes: the size of each streamed message.
    """

    def __init__(self, block_bytes: int) -> None:
        import grpc

        self.block_bytes = block_bytes
        self._proc = subprocess.Popen([sys.executable, "-c", RAW_SERVER, "0", str(block_bytes)],
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        port = int(self._proc.stdout.readline())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1)])
        self._unary = self.channel.unary_unary("/bench.Raw/Unary")
        self._stream = self.channel.unary_stream("/bench.Raw/Stream")

    def unary(self, size_bytes: int) -> bytes:
        """One unary call answering `size_bytes` bytes."""
        return self._unary(size_bytes.to_bytes(8, "big"))  # type: ignore[no-any-return]

    def stream(self, lo: int, hi: int) -> Iterator[bytes]:
        """Messages lo..hi-1 over one stream."""
        return iter(self._stream(lo.to_bytes(8, "big") + hi.to_bytes(8, "big")))

    def striped(self, view: memoryview, n: int, streams: int) -> None:
        """Blocks 0..n-1 over `streams` streams at once, each copied into its slot of `view`."""
        size = self.block_bytes
        share = -(-n // streams)

        def one(lo: int) -> None:
            for i, msg in enumerate(self.stream(lo, min(lo + share, n)), lo):
                view[i * size:(i + 1) * size] = msg

        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(one, range(0, n, share)))

    def close(self) -> None:
        """Close the channel and stop the process."""
        self.channel.close()
        self._proc.terminate()
        self._proc.wait(timeout=30)


@contextmanager
def raw_server(block_bytes: int) -> Iterator[RawServer]:
    """A `RawServer`, stopped on exit."""
    server = RawServer(block_bytes)
    try:
        yield server
    finally:
        server.close()


#: How to make Mooncake's transfer engine run here, for the note when it cannot.
MOONCAKE_FIX = "apt-get install -y libibverbs1 && pip install mooncake-transfer-engine-non-cuda"

#: A Mooncake transfer engine (TCP, P2P handshake: no metadata server) holding a memfd the
#: bench passed it (argv: its descriptor and size), registered: the target of the reads.
MOONCAKE_TARGET = """
import ctypes, mmap, sys
from mooncake.engine import TransferEngine
fd, size = int(sys.argv[1]), int(sys.argv[2])
mem = mmap.mmap(fd, size)
addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
engine = TransferEngine()
if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") or engine.register_memory(addr, size):
    print("failed", flush=True)
    sys.exit(1)
print(f"127.0.0.1:{engine.get_rpc_port()} {addr}", flush=True)
sys.stdin.read()  # until the bench closes our stdin
"""


def mooncake_missing() -> str:
    """Why Mooncake's transfer engine cannot run here ("" when it can)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError, or its native library (libibverbs) failing to load
        return f"mooncake-transfer-engine cannot run here ({type(exc).__name__}: {exc}); fix: {MOONCAKE_FIX}"
    return ""


def buffer_address(view: memoryview) -> int:
    """The address of a writable buffer's first byte (what Mooncake registers and transfers)."""
    import numpy as np

    # A numpy view, dropped at once: it exports the buffer only for this line (a ctypes
    # view would keep it exported, and `view.release()` would then fail).
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@contextmanager
def mooncake_target(source: memoryview) -> Iterator[tuple[str, int]]:
    """A child process whose Mooncake engine registers a memfd holding `source`'s bytes.

    Yields:
        Its segment name ("127.0.0.1:<port>") and the address of the bytes in it.
    """
    from kvstore.region import Region

    with Region(len(source)) as region:
        region.view[:] = source
        _, fd = region.handle
        proc = subprocess.Popen([sys.executable, "-c", MOONCAKE_TARGET, str(fd), str(len(source))],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                pass_fds=(fd,), text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            if len(line) != 2:
                raise RuntimeError("the Mooncake target process did not start")
            yield line[0], int(line[1])
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)


@contextmanager
def mooncake_reader(source: memoryview, block_bytes: int, batch: int) -> Iterator[Callable[[], None]]:
    """A call that has this process's Mooncake engine read `source`'s bytes, held registered by
    another process, into a registered region here: batches of `batch` block-sized reads
    (`batch_transfer_sync_read`, TCP on loopback). The bytes are checked once, as the block ends.

    Raises:
        RuntimeError: the engine failed, or the bytes landed wrong.
    """
    from mooncake.engine import TransferEngine

    from kvstore.region import Region

    n = len(source) // block_bytes
    with mooncake_target(source) as (segment, remote), Region(n * block_bytes) as region:
        view = region.view
        view[:] = b"\1" * len(view)  # pre-faulted, as the gRPC figures' regions are
        engine = TransferEngine()
        local = buffer_address(view)
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") or engine.register_memory(local, len(view)):
            raise RuntimeError("Mooncake's transfer engine did not start here")

        def read() -> None:
            for lo in range(0, n, batch):
                at = range(lo * block_bytes, min(lo + batch, n) * block_bytes, block_bytes)
                rc = engine.batch_transfer_sync_read(segment, [local + a for a in at], [remote + a for a in at],
                                                     [block_bytes] * len(at))
                if rc:
                    raise RuntimeError(f"Mooncake batch_transfer_sync_read failed ({rc})")

        try:
            yield read
            if view[:n * block_bytes] != source[:n * block_bytes]:
                raise RuntimeError("Mooncake's reads landed the wrong bytes")
        finally:
            engine.unregister_memory(local)
            view.release()


def mooncake_read_s(source: memoryview, block_bytes: int, batch: int, repeat: int) -> float:
    """Best seconds of `repeat` whole reads by `mooncake_reader`.

    Raises:
        RuntimeError: the engine failed, or the bytes landed wrong.
    """
    with mooncake_reader(source, block_bytes, batch) as read:
        return best_of(read, repeat)
