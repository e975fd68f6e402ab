"""The nodes of the repairer's tests (tests/gateway/test_fleet_repair*.py): a real etcd, stores served by the
Fleet service on loopback (real LMDB, real gRPC), each registered in etcd on a fixed port, so a node's server
can be stopped and started again on it while its registration stays (as a killed or SIGSTOPped node's does
until its lease ends).

A test module takes the fixtures by importing them: `from tests.gateway.fleet_nodes import etcd_fixture, fleet_fixture`.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.fleet_bulk import BulkSource
from gateway.fleet_repair import FleetRepairer, Peers
from gateway.fleet_servicer import add_fleet_service
from kvstore.bench import fleet_processes
from kvstore.clock import ManualClock
from kvstore.config import Settings
from kvstore.config_sections import FleetSettings, StoreSettings, TransferSettings
from kvstore.fleet.membership import Membership, Registration, register_node, session_for
from kvstore.fleet.repair_progress import RepairProgress
from tests.conftest import LoopThread
from tests.gateway.test_fleet_copy import RUN_BLOCKS, TOKENS
from tests.gateway.test_token_bucket import Recorded
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tiers.lmdb_tier import LmdbBlockTier


@pytest.fixture(name="etcd", scope="module")
def etcd_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[fleet_processes.EtcdProcess]:
    """One real etcd for the module's tests (each fleet is a cluster of its own in it)."""
    server = EtcdProcess(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@dataclass
class Node:
    """A store served by the Fleet service on a fixed loopback port, registered in etcd.

    Attributes:
        tls: the certificates its port serves with (the `certs` fixture's), or None: plaintext.
    """

    tier: LmdbBlockTier
    port: int
    settings: Settings
    tls: Any = None
    #: Where its Fleet service audits copied pins' grants (an AuditLog), or None.
    audit: Any = None
    #: What its Fleet service's digests take as each tenant's retention (`add_fleet_service`'s), or None.
    retention_of: Any = None
    server: Any = None
    registration: Registration | None = None

    @property
    def address(self) -> str:
        """host:port of the node's server."""
        return f"127.0.0.1:{self.port}"

    async def serve(self) -> None:
        """Start (or start again) the node's server on its port."""
        self.server = grpc.aio.server()
        add_fleet_service(self.server, self.settings, self.tier, auth_on=lambda: False, audit=self.audit,
                          retention_of=self.retention_of)
        if self.tls is None:
            bound = self.server.add_insecure_port(self.address)
        else:
            pair = (self.tls.server.key.read_bytes(), self.tls.server.cert.read_bytes())
            bound = self.server.add_secure_port(self.address, grpc.ssl_server_credentials([pair]))
        assert bound == self.port
        await self.server.start()

    async def halt(self) -> None:
        """Stop the server (the registration stays: the node is in the view but does not answer)."""
        await self.server.stop(0)


class Fleet:
    """Nodes of one cluster (its own name in the one etcd), on one moved clock, at replication 2."""

    def __init__(self, root: Path, etcd: fleet_processes.EtcdProcess, loop: LoopThread) -> None:
        self.root, self.loop = root, loop
        self.settings = FleetSettings(etcd=etcd.endpoint, cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=2,
                                      run_blocks=RUN_BLOCKS, replication=2)
        self.clock = ManualClock()
        self.nodes: dict[str, Node] = {}
        self.views: list[Membership] = []
        #: Each tenant's retention, as the nodes started from now take it (the policies' `retention_of_key`): None,
        #: the store's for every tenant.
        self.retention_of: Any = None

    def node(self, name: str, tls: Any = None, *, bulk: bool = False, audit: Any = None, **store: Any) -> Node:
        """Start a node `name` on a free port and register it (`bulk`: it reads copies over the bulk transport;
        `audit`: its Fleet service's audit log; `store`: StoreSettings fields other than the defaults here, e.g.
        its capacity or pin limits)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        settings = StoreSettings(**{"data_dir": self.root / name, "capacity_bytes": 1 << 28, "block_tokens": TOKENS,
                                    **store})
        node = Node(tier=LmdbBlockTier(settings, clock=self.clock), port=port,
                    settings=Settings(store=settings, fleet=self.settings,
                                      transfer=TransferSettings(bulk="mooncake" if bulk else "off")), tls=tls,
                    audit=audit, retention_of=self.retention_of)

        async def up() -> None:
            await node.serve()
            node.registration = await register_node(self.settings, node_id=name, address=node.address,
                                                    capacity_bytes=settings.capacity_bytes, block_tokens=TOKENS)

        self.loop.run(up())
        self.nodes[name] = node
        return node

    def view(self, count: int) -> Membership:
        """A membership view, once it sees `count` nodes."""
        async def start() -> Membership:
            view = Membership(session_for(self.settings), self.settings.cluster)
            await view.start()
            await view.wait_until(lambda m: len(m.nodes) == count, 10)
            return view

        view = self.loop.run(start())
        self.views.append(view)
        return view

    def start(self, names: list[str], tls: Any = None, *, bulk: bool = False
              ) -> tuple[dict[str, LmdbBlockTier], dict[str, str], Membership]:
        """Nodes `names` and a view of them all: (name -> tier, name -> address, the view)."""
        made = {n: self.node(n, tls, bulk=bulk) for n in names}
        return ({n: x.tier for n, x in made.items()}, {n: x.address for n, x in made.items()},
                self.view(len(self.nodes)))

    def repairer(self, name: str, view: Membership, bucket: Any = None, credentials: Any = None, *,
                 bulk: bool = False) -> FleetRepairer:
        """Node `name`'s repairer over `view` (no rate to speak of unless `bucket`; nothing published; `bulk`:
        it offers its copies over the bulk transport)."""
        tier = self.nodes[name].tier
        return FleetRepairer(tier, node_id=name, membership=view, replication=2, run_blocks=RUN_BLOCKS,
                             window_s=tier.settings.retention_s, bucket=bucket or Recorded(rate=1e12, burst=1e12),
                             peers=Peers(None, 1 << 26, credentials), interval_s=60, publish=None,
                             bulk=BulkSource(tier, "127.0.0.1") if bulk else None)

    def one_pass(self, repairer: FleetRepairer) -> RepairProgress:
        """One `run_pass` of `repairer`, its channels closed after."""
        async def run() -> RepairProgress:
            try:
                return await repairer.run_pass()
            finally:
                await repairer.peers.close()
                if repairer.bulk is not None:
                    repairer.bulk.close()

        return self.loop.run(run())

    def close(self) -> None:
        """Stop every view, registration, server and store."""
        for view in self.views:
            self.loop.run(view.close())
        for node in self.nodes.values():
            if node.registration is not None:
                self.loop.run(node.registration.stop())
            self.loop.run(node.server.stop(0))
            node.tier.close()


@pytest.fixture(name="fleet")
def fleet_fixture(tmp_path: Path, loop_thread: LoopThread, etcd: fleet_processes.EtcdProcess) -> Iterator[Fleet]:
    """A fleet of no nodes yet (`Fleet.node`, `Fleet.start`), stopped after the test."""
    f = Fleet(tmp_path, etcd, loop_thread)
    yield f
    f.close()
