"""Shared parts of the same-host reader's tests: a real `kvstore serve` child on a real LMDB store,
on a clock the test can advance, and the readers a test opens (closed after it).

Imported by test_colocated*.py and test_restore*.py (tests cannot import a conftest under
--import-mode=importlib). No tests here.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.client.colocated import ColocatedReader
from tests.children import SKEWED_CLOCK, Child, ServerClock, write_config

#: Small blocks keep the stores small: 16 tokens of V4.1-Flash are 14,240 bytes.
BLOCK_TOKENS = 16


@dataclass
class Store:
    """One data dir, its server (restartable) and what the test opened on it."""

    data_dir: Path
    logs: Path
    config: Path
    clock: ServerClock
    server: Child | None = None
    clients: list[kvstore.Client] = field(default_factory=list)
    readers: list[ColocatedReader] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)

    def start(self, port: int = 0) -> Child:
        """Start `kvstore serve` on the data dir (on `port`, or a free one)."""
        args = ["serve", "--port", str(port), "--host", "127.0.0.1", "--data-dir", str(self.data_dir),
                "--config", str(self.config)]
        self.server = Child("serve", args, self.logs, prelude=SKEWED_CLOCK, env=self.clock.env)
        self.children.append(self.server)
        return self.server

    def client(self, **kwargs: object) -> kvstore.Client:
        """A client of the current server (closed after the test)."""
        assert self.server is not None
        c = kvstore.Client(self.server.target, **kwargs)  # type: ignore[arg-type]
        self.clients.append(c)
        return c

    def reader(self, **kwargs: object) -> ColocatedReader:
        """A ColocatedReader of this data dir (closed after the test)."""
        r = ColocatedReader(self.data_dir, **kwargs)  # type: ignore[arg-type]
        self.readers.append(r)
        return r

    def close(self) -> None:
        for r in self.readers:
            r.close()
        for c in self.clients:
            c.close()
        for child in self.children:
            child.kill_if_alive()


def make_store(tmp_path: Path, name: str = "store", capacity_bytes: int = 256 << 20) -> Store:
    config = write_config(tmp_path / f"{name}.toml", {"store": {"block_tokens": BLOCK_TOKENS,
                                                               "capacity_bytes": capacity_bytes}})
    return Store(data_dir=tmp_path / name, logs=tmp_path / f"{name}-logs", config=config,
                 clock=ServerClock(tmp_path / f"{name}-clock"))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A running server on a fresh store (256 MiB capacity)."""
    s = make_store(tmp_path)
    s.start()
    yield s
    s.close()


@pytest.fixture
def new_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    """`new_store(name, capacity_bytes=...)`: more stores, not started (closed after the test)."""
    made: list[Store] = []

    def make(name: str = "store", *, capacity_bytes: int = 256 << 20) -> Store:
        s = make_store(tmp_path, name, capacity_bytes)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def prompt(rng: random.Random, blocks: int) -> list[int]:
    """Random token ids for `blocks` full blocks."""
    return [rng.randrange(1 << 20) for _ in range(blocks * BLOCK_TOKENS)]


def payload(rng: random.Random, blocks: int, block_bytes: int) -> np.ndarray:
    """Random block bytes, uint8 [blocks, block_bytes]."""
    return np.frombuffer(rng.randbytes(blocks * block_bytes), dtype=np.uint8).reshape(blocks, block_bytes)


def damage(data_dir: Path, offset: int, size: int = 64) -> None:
    """Flip bytes of data.mdb at `offset`, as a failing disk would (the server's map sees it)."""
    fd = os.open(data_dir / "data.mdb", os.O_RDWR)
    try:
        old = os.pread(fd, size, offset)
        os.pwrite(fd, bytes(b ^ 0xFF for b in old), offset)
    finally:
        os.close(fd)
