"""Worker fixtures: a real kvstore server (tests/conftest.py, 16-token blocks) and a real worker
gRPC server on loopback in the same process, running the tiny model on the CPU.

torch and the model are imported inside the fixtures, so the planner's torch-free
tests beside them never load torch through this file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.client import Client
from kvstore.geometry import TINY


@pytest.fixture(scope="session")
def model() -> Any:
    """The tiny model on the CPU (seeded weights; shared: a model holds no per-sequence state)."""
    pytest.importorskip("torch")
    from replay.model import TINY_MODEL, ReferenceModel

    return ReferenceModel(TINY_MODEL, device="cpu")


@pytest.fixture
def store(server: Any) -> Iterator[Client]:
    """A client of the test server for the tiny geometry, default tenant."""
    with Client(server.target, geometry=TINY.name) as c:
        yield c


@pytest.fixture
def start_worker(loop_thread: Any, server: Any, model: Any) -> Iterator[Callable[..., Any]]:
    """Start a worker against `server` on 127.0.0.1:0 (settings overridable); stopped at the end."""
    from replay.worker.runner import Runner
    from replay.worker.service import start
    from replay.worker.settings import WorkerSettings
    from replay.worker.stores import StoreClients

    running: list[Any] = []

    def _start(**overrides: Any) -> Any:
        settings = WorkerSettings(**{"store_target": server.target, "port": 0, **overrides})
        stores = StoreClients(settings.store_target, geometry=TINY.name)
        worker = loop_thread.run(start(settings, Runner(model, stores, settings)))
        running.append(worker)
        return worker

    yield _start
    for worker in running:
        loop_thread.run(worker.stop(0))


@pytest.fixture
def worker(start_worker: Callable[..., Any]) -> Any:
    """One running worker with the default settings."""
    return start_worker()


@pytest.fixture
def workers(worker: Any) -> Iterator[Any]:
    """A WorkerClient of `worker`."""
    from kvstore.client.worker import WorkerClient

    with WorkerClient(worker.target, timeout_s=60) as w:
        yield w
