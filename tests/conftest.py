"""Shared fixtures: real LMDB stores in temporary folders, a real gRPC server on
loopback (port 0), a manual clock to move time instead of sleeping."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from kvstore.clock import ManualClock
from kvstore.config import ServerSettings, Settings, StoreSettings


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Say the seed of the run's random test order (pytest-randomly), which -q keeps out of the header:
    an outcome that one order alone shows comes back with `-p randomly --randomly-seed=SEED`."""
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.hasplugin("randomly") and isinstance(seed, int):
        terminalreporter.write_line(f"test order: pytest-randomly --randomly-seed={seed} (fixed order: -p no:randomly)")


#: The main run's slowest test files (CI's --durations, summed per file), longest first. scripts/test.sh runs
#: them first: its two workers take whole files (--dist loadfile) in collection order (--no-loadscope-reorder;
#: xdist's default order, most tests first, put these one-test benches last, where one of them could keep a
#: worker busy while the other had nothing left). A file not named keeps its place after them.
SLOW_FILES_FIRST = (
    "tests/kvstore/fleet/test_failures.py",
    "tests/test_readme.py",
    "tests/kvstore/fleet/test_fleet_operators.py",
    "tests/kvstore/test_bench_fleet.py",
    "tests/kvstore/test_bench_store.py",
    "tests/kvstore/test_bench_replay_intervals.py",
    "tests/kvstore/test_bench_load.py",
    "tests/replay/worker/test_service.py",
    "tests/e2e/test_conversation.py",
    "tests/kvstore/fleet/test_gateway.py",
    "tests/faults/test_redis_outage.py",
    "tests/faults/test_kill_during_put.py",
    "tests/kvstore/test_bench_fleet_swa.py",
    "tests/faults/test_disk_full.py",
    "tests/kvstore/fleet/test_repair.py",
    "tests/gateway/test_transfer_bulk_bench.py",
    "tests/kvstore/client/test_fleet.py",
    "tests/kvstore/test_bench_swa.py",
    "tests/kvstore/test_bench_transfer.py",
    "tests/kvstore/trace/test_replay_fleet.py",
    "tests/kvstore/fleet/test_repair_bulk.py",
    "tests/kvstore/fleet/test_repair_pins.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of SLOW_FILES_FIRST first, in its order; every other file after them, as collected (a stable
    sort: each file's tests keep their order)."""
    rank = {path: i for i, path in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


class LoopThread:
    """An asyncio loop on a background thread, to host a grpc.aio server for sync tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the loop and wait for its result."""
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout=60)

    def close(self) -> None:
        """Stop the loop and join the thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def clock() -> ManualClock:
    """A clock that moves only when a test says so."""
    return ManualClock()


@pytest.fixture
def store_settings(tmp_path: Path) -> StoreSettings:
    """Store settings on a fresh folder, small blocks so tests stay fast."""
    return StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 30, block_tokens=16)


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    """A background event loop for servers under test."""
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def start_server(loop_thread: LoopThread, clock: ManualClock) -> Iterator[Callable[..., Any]]:
    """Start a real kvstore server on 127.0.0.1:0; every server started is stopped at the end."""
    from gateway.server import start

    running: list[Any] = []

    def _start(store: StoreSettings, *, server: ServerSettings | None = None, **kwargs: Any) -> Any:
        settings = Settings(server=server or ServerSettings(port=0), store=store, **kwargs)
        srv = loop_thread.run(start(settings, clock=clock))
        running.append(srv)
        return srv

    yield _start
    for srv in running:
        loop_thread.run(srv.stop(0))


@pytest.fixture
def server(start_server: Callable[..., Any], store_settings: StoreSettings) -> Any:
    """One running server with the default test store."""
    return start_server(store_settings)


@pytest.fixture
def client(server: Any) -> Iterator[Any]:
    """A client of `server` for the default tenant."""
    from kvstore.client import Client

    with Client(server.target) as c:
        yield c


# -- Redis: real redis-server processes on loopback (the SWA pool's backends) --


def _need_redis() -> None:
    """Skip without redis-server, except in CI (CI=true), where its absence is a failure."""
    import os

    from kvstore.bench.redis_server import redis_server_path

    if redis_server_path() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is not on PATH and CI=true: install redis-server")
        pytest.skip("redis-server is not on PATH")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Any]:
    """A fresh redis-server on a free loopback port (a `RedisServer`: url, stop(), start())."""
    from kvstore.bench.redis_server import RedisServer

    _need_redis()
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real Redis Cluster of 3 masters, created once per session."""
    from kvstore.bench.redis_server import RedisClusterProcesses

    _need_redis()
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(redis_cluster_session: Any) -> Any:
    """The session's Redis Cluster, emptied (keys and counters) for this test."""
    redis_cluster_session.flush()
    return redis_cluster_session
