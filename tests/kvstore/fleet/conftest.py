"""Real etcd processes on loopback for the fleet's tests (Debian's etcd 3.4 on PATH).

Each etcd runs in its own temporary data dir on free loopback ports, is awaited
by a gRPC read with wait_for_ready under a deadline (no sleeping), and is
stopped by its PID (tests/kvstore/fleet/etcd_process.py). One single-member etcd
serves the whole session; each test gets a cluster name of its own, so tests
never see each other's nodes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.config_sections import FleetSettings
from tests.kvstore.fleet.etcd_process import EtcdProcess


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """One etcd for the session (tests keep apart by cluster name: `fleet`)."""
    server = EtcdProcess(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """An etcd of this test's own (to kill and restart)."""
    server = EtcdProcess(tmp_path / "etcd").start()
    yield server
    server.stop()


@pytest.fixture
def fleet(etcd_server: EtcdProcess) -> FleetSettings:
    """Fleet settings on the session's etcd, with a cluster name no other test uses and a 2 s lease."""
    return FleetSettings(etcd=etcd_server.endpoint, cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=2)
