"""`kvstore serve` as an operator runs it: a real process, SIGTERM, kill -9."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client import Client
from kvstore.errors import KVStoreError


class ServeProcess:
    """A `kvstore serve` child process on a free port."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir", str(data_dir), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.lines = [self.proc.stdout.readline(), self.proc.stdout.readline()]
        match = re.search(r"listening on ([\d.]+):(\d+)", self.lines[0])
        assert match, f"no address in {self.lines!r}; stderr: {self.proc.stderr.read() if self.proc.stderr else ''}"
        self.target = f"127.0.0.1:{match.group(2)}"

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def serve(data_dir: Path) -> Iterator[list[ServeProcess]]:
    started: list[ServeProcess] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def test_serve_prints_where_it_listens_and_stops_cleanly(serve: list[ServeProcess], data_dir: Path) -> None:
    s = ServeProcess(data_dir)
    serve.append(s)
    assert str(data_dir.resolve()) in s.lines[1]
    with Client(s.target) as client:
        tokens = list(range(client.block_tokens * 2))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])
    assert s.stop(signal.SIGTERM) == 0
    assert s.proc.stderr is not None and "kvstore stopped" in s.proc.stderr.read()
    again = ServeProcess(data_dir)
    serve.append(again)
    with Client(again.target) as client:
        assert client.lookup(tokens).found_blocks == 2


def test_kill_9_loses_nothing_acknowledged(serve: list[ServeProcess], data_dir: Path) -> None:
    s = ServeProcess(data_dir)
    serve.append(s)
    acked: list[tuple[list[int], bytes]] = []
    killed = threading.Event()

    def kill_when_busy() -> None:
        while len(acked) < 40:
            if s.proc.poll() is not None:
                return
            threading.Event().wait(0.005)
        s.proc.kill()  # SIGKILL, mid-stream
        killed.set()

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    with Client(s.target, timeout_s=10) as client:
        bt = client.block_tokens
        tokens: list[int] = []
        try:
            for i in range(100_000):
                tokens = tokens + list(range(i * bt, (i + 1) * bt))
                block = os.urandom(client.block_bytes)
                client.put(tokens, [block], first_block=i)
                acked.append((list(tokens), block))
        except KVStoreError:
            pass
    killer.join()
    assert killed.is_set() and s.proc.wait() == -signal.SIGKILL
    again = ServeProcess(data_dir)
    serve.append(again)
    with Client(again.target) as client:
        last_tokens = acked[-1][0]
        assert client.lookup(last_tokens).found_blocks >= len(acked)
        got = client.get(last_tokens)
        assert got.blocks[: len(acked)] == [block for _, block in acked]
        assert client.stats().corrupt_blocks == 0


def test_port_in_use_is_a_clear_error(serve: list[ServeProcess], data_dir: Path, tmp_path: Path) -> None:
    s = ServeProcess(data_dir)
    serve.append(s)
    port = s.target.rsplit(":", 1)[1]
    other = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--port", port, "--data-dir",
                            str(tmp_path / "other")], capture_output=True, text=True, timeout=60)
    assert other.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in other.stderr
