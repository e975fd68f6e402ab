"""The fault matrix's scaffolding: real `kvstore serve` processes, killed and restarted.

The matrix (issue 9), each scenario asserting outcomes, never timings:
- test_kill_during_put.py: kill -9 during group-committed PutStreams beside
  refused Puts, and during shm transfer writes; SIGTERM under the same load.
- test_kill_during_read.py: kill -9 during Gets and shm fetches that refresh
  retention; a read seen complete keeps its blocks 71 h later.
- test_client_killed.py: the worker killed -9 mid-transfer.
- test_redis_outage.py: the SWA pool's Redis killed or hung, then back.
- test_disk_full.py: the disk fills (small tmpfs, or RLIMIT_FSIZE).
- test_damaged_files.py: truncated, emptied and damaged data files.
After each fault, `census` and `assert_usage_matches` check the store: every
acknowledged block bit-identical, Lookup and Get agreeing (no hole), usage
totals equal to the blocks a client can read.

Each server is a child process on a free loopback port (`--port 0`, read back
from the line it prints) over a data dir the test owns, with its stdout and
stderr in files beside it, so a failing test shows the server's own log. Tests
start servers with the `serve` fixture; every one still running at the end is
killed. Nothing here waits on time to decide an outcome: waits are bounded by a
deadline only so that a hung child fails the test instead of the suite.
"""
from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.errors import FailedPrecondition
from tests.children import SKEWED_CLOCK, Child, ServerClock, fork_safe, write_config

#: Tokens per block for every fault-matrix server: 16 keeps a block at 14 KiB,
#: so a test stores thousands of blocks in a few seconds.
BLOCK_TOKENS = 16

#: RLIMIT_FSIZE of KVSTORE_FAULTS_FSIZE_BYTES, with SIGXFSZ ignored: a write past it fails (EFBIG)
#: instead of killing the process. Set in the child itself, not in a preexec_fn (unsafe with threads).
_FILE_SIZE_LIMIT = fork_safe("""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
_limit = int(os.environ["KVSTORE_FAULTS_FSIZE_BYTES"])
resource.setrlimit(resource.RLIMIT_FSIZE, (_limit, _limit))
""")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "faults: the fault matrix (real processes killed and restarted)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in item.nodeid.replace(os.sep, "/"):
            item.add_marker(pytest.mark.faults)


class ServeProcess(Child):
    """One `kvstore serve` child process.

    Args:
        data_dir: its store.
        logdir: where its stdout and stderr go (one pair of files per start).
        config: a TOML config file, or None.
        clock: a clock the test moves, or None for the real one.
        file_size_limit_bytes: RLIMIT_FSIZE for the process (a disk that fills), or None.
    """

    def __init__(self, data_dir: Path, logdir: Path, *, config: Path | None = None, clock: ServerClock | None = None,
                 file_size_limit_bytes: int | None = None) -> None:
        self.data_dir = data_dir
        args = ["serve", "--port", "0", "--host", "127.0.0.1", "--data-dir", str(data_dir)]
        if config is not None:
            args += ["--config", str(config)]
        env: dict[str, str] = {}
        prelude = ""
        if clock is not None:
            env.update(clock.env)
            prelude += SKEWED_CLOCK
        if file_size_limit_bytes is not None:
            env["KVSTORE_FAULTS_FSIZE_BYTES"] = str(file_size_limit_bytes)
            prelude += _FILE_SIZE_LIMIT
        super().__init__("serve", args, logdir, prelude=prelude or None, env=env)

    def client(self, **kwargs: Any) -> Client:
        """A client of this server (default tenant and geometry)."""
        return Client(self.target, **kwargs)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    """Start `kvstore serve` children: `serve(data_dir, config=..., clock=..., file_size_limit_bytes=...)`.

    Every child still running at the end is killed.
    """
    started: list[ServeProcess] = []

    def _serve(data_dir: Path, **kwargs: Any) -> ServeProcess:
        s = ServeProcess(data_dir, tmp_path / "logs", **kwargs)
        started.append(s)
        return s

    yield _serve
    for s in started:
        s.kill_if_alive()


@pytest.fixture
def config(tmp_path: Path) -> Callable[..., Path]:
    """`config(**sections)`: a TOML file with 16-token blocks plus the sections given."""
    made = [0]

    def _config(**sections: dict[str, object]) -> Path:
        merged: dict[str, dict[str, object]] = {"store": {"block_tokens": BLOCK_TOKENS}}
        for name, values in sections.items():
            merged.setdefault(name, {}).update(values)
        made[0] += 1
        return write_config(tmp_path / f"kvstore-{made[0]}.toml", merged)

    return _config


@dataclass
class Chain:
    """One prompt's blocks as the test sent them; `acked` counts those a reply confirmed stored.

    Block contents are a pure function of (seed, index), so any block can be
    compared with what was sent without keeping it.
    """

    seed: int
    blocks: int
    block_tokens: int
    block_bytes: int
    acked: int = 0
    tokens: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        base = self.seed * 1_000_000  # token ids stay 32-bit for seeds < 4,000
        self.tokens = list(range(base, base + self.blocks * self.block_tokens))

    def block(self, i: int) -> bytes:
        """The bytes sent as block `i`."""
        return random.Random(self.seed * 1_000_003 + i).randbytes(self.block_bytes)

    def payload(self, start: int = 0, stop: int | None = None) -> list[bytes]:
        """Blocks `start` to `stop` (default: the end)."""
        return [self.block(i) for i in range(start, self.blocks if stop is None else stop)]


def make_chains(client: Client, count: int, blocks: int, *, first_seed: int = 1) -> list[Chain]:
    """`count` distinct chains of `blocks` blocks in the client's geometry."""
    return [Chain(seed=first_seed + i, blocks=blocks, block_tokens=client.block_tokens,
                  block_bytes=client.block_bytes) for i in range(count)]


def census(client: Client, chains: Sequence[Chain], *, tail: int | None = None) -> int:
    """Check what each chain holds after a fault and return the blocks readable in all.

    For every chain: Lookup and Get agree (no hole: what Lookup calls found is
    readable, nothing past it is), every acknowledged block is there, and every
    readable block is bit-identical to the one sent at its position (acknowledged
    or not: a batch committed just before a kill may not have been answered).

    Args:
        tail: how many blocks past the found ones to check are absent (None: all
            the chain's), for long chains whose end was never sent.
    """
    total = 0
    for chain in chains:
        found = client.lookup(chain.tokens).found_blocks
        hashes = client.hashes(chain.tokens)
        got = client.get_hashes(hashes if tail is None else hashes[: found + tail])
        readable = [i for i, b in enumerate(got.blocks) if b is not None]
        assert readable == list(range(found)), (
            f"chain {chain.seed}: Lookup finds {found} blocks but Get returns blocks {readable[:5]}... "
            f"({len(readable)} in all; statuses {sorted(set(got.statuses))})")
        assert found >= chain.acked, f"chain {chain.seed}: {chain.acked} blocks must be there, {found} are"
        for i in range(found):
            assert got.blocks[i] == chain.block(i), f"chain {chain.seed} block {i} differs from what was sent"
        total += found
    return total


def assert_usage_matches(client: Client, readable_blocks: int) -> None:
    """The server's usage totals count exactly the blocks a client can read, and nothing is corrupt."""
    stats = client.stats()
    assert (stats.blocks_stored, stats.bytes_stored) == (readable_blocks, readable_blocks * client.block_bytes), (
        f"usage says {stats.blocks_stored} blocks / {stats.bytes_stored} bytes; "
        f"{readable_blocks} blocks of {client.block_bytes} bytes are readable")
    assert stats.corrupt_blocks == 0


def segment_lines() -> set[str]:
    """What of this process names a transfer region: mappings and open files of `kvstore-` segments
    (a /dev/shm file or a memfd, whichever the client uses)."""
    maps = {line.split(None, 5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if "kvstore-" in line.split(None, 5)[-1]}
    fds: set[str] = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if "kvstore-" in target:
                fds.add(f"fd -> {target}")
    return maps | fds


@pytest.fixture
def server_clock(tmp_path: Path) -> ServerClock:
    """A clock for this test's servers, at the real time until the test advances it."""
    return ServerClock(tmp_path / "clock-skew")


@pytest.fixture
def kit() -> SimpleNamespace:
    """This folder's helpers, for test modules (with --import-mode=importlib they cannot import conftest)."""
    return SimpleNamespace(Chain=Chain, make_chains=make_chains, census=census,
                           assert_usage_matches=assert_usage_matches, write_config=write_config,
                           segment_lines=segment_lines, FailedPrecondition=FailedPrecondition,
                           BLOCK_TOKENS=BLOCK_TOKENS)
