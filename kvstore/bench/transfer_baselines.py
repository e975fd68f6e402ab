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

from kvstore.bench.harness import RAW_SERVER


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
