"""A real fleet for the engine adapters' tests (docs/FLEET.md F58-F61): one etcd and three `kvstore serve` nodes on
loopback at replication 2, started at once, and what the tests ask of it; with `swa_nodes`, the nodes' SWA pool is
that one Redis Cluster (F44), and with `gateway`, a `kvstore gateway` in front of them (F36-F40).

The nodes are the same children as tests/kvstore/client/test_fleet.py's (tests/children.py), with a lease long
enough that a node killed with SIGKILL stays in the membership for the rest of a module: a read must then fail
over to the run's other replica (F33), which is the case an engine meets between a node's death and its lease's
end. Runs are short (`RUN_BLOCKS` blocks), so a test's prompt spans several runs, placed on different nodes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import REGISTRY

import kvstore
from kvstore.client.fleet import FleetClient
from kvstore.client.fleet_metrics import FAILOVERS
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tiers import datadir

#: Blocks per run (by default): a prompt of a few hundred tokens spans several runs, on different nodes.
RUN_BLOCKS = 2
#: Copies of every run ([fleet] replication's default, said here so the tests name it).
REPLICATION = 2
#: A killed node stays in the view this long: its runs' reads must fail over, not wait for the lease to end.
LEASE_TTL_S = 60


@dataclass
class Node:
    """One `kvstore serve` of the fleet."""

    node_id: str
    child: Child


@dataclass
class Fleet:
    """The module's fleet: its etcd:// address (what an engine is configured with), its nodes and, when started
    with one, its gateway (`target` its host:port) and the stores' data dirs (node id -> dir)."""

    address: str
    nodes: list[Node]
    run_blocks: int = RUN_BLOCKS
    gateway: Child | None = None
    data_dirs: dict[str, Path] = field(default_factory=dict)

    def node(self, node_id: str) -> Node:
        """The node of that id."""
        return next(n for n in self.nodes if n.node_id == node_id)

    @property
    def live(self) -> list[Node]:
        """The nodes still running."""
        return [n for n in self.nodes if n.child.alive]

    def client(self, **kwargs: object) -> FleetClient:
        """A fleet client that sees every live node (as the adapters' clients do once the nodes registered)."""
        client = kvstore.Client(self.address, **kwargs)  # type: ignore[arg-type]
        assert isinstance(client, FleetClient)
        want = {n.node_id for n in self.live}
        client.view.wait_until(lambda nodes: want <= set(nodes), 30.0)
        return client

    def held_by(self, chain: Sequence[bytes], geometry: str = "") -> dict[str, list[int]]:
        """Each node's leading blocks of every run of `chain` (fleet hashes from block 0), asked of the node
        directly: {node id: [found blocks of run 0, of run 1, ...]} (live nodes only)."""
        rb = self.run_blocks
        runs = [list(chain[i:i + rb]) for i in range(0, len(chain), rb)]
        held = {}
        for node in self.live:
            with kvstore.Client(node.child.target, geometry=geometry) as direct:
                held[node.node_id] = [direct.lookup_hashes(run).found_blocks for run in runs]
        return held


def failovers() -> float:
    """Reads of a run this process's fleet clients moved on to another replica (F33; every operation): 0 more
    while every run is read from the first node of its read order, the one that holds it."""
    return sum(s.value for m in FAILOVERS.collect() for s in m.samples if s.name.endswith("_total"))


def node_errors(node_id: str) -> float:
    """Calls this process's fleet clients made to `node_id` that failed (unreachable, refused)."""
    return REGISTRY.get_sample_value("kvstore_fleet_client_node_errors_total", {"node": node_id}) or 0.0


def start_fleet(tmp: Path, *, block_tokens: int, run_blocks: int = RUN_BLOCKS, nodes: int = 3,
                swa_nodes: str | None = None, gateway: bool = False) -> tuple[EtcdProcess, Fleet]:
    """One etcd and `nodes` nodes of a fleet of its own (a fresh cluster name), every node registered; `swa_nodes`
    (a Redis Cluster's startup nodes): every node's SWA pool is that cluster (F44); `gateway`: and a gateway."""
    etcd = EtcdProcess(tmp / "etcd")
    etcd.start()
    cluster = f"engines-{uuid.uuid4().hex[:12]}"
    fleet_section = {"etcd": etcd.endpoint, "cluster": cluster, "lease_ttl_s": LEASE_TTL_S, "run_blocks": run_blocks,
                     "replication": REPLICATION}
    swa = {} if swa_nodes is None else {"swa": {"backend": "redis-cluster", "cluster_nodes": swa_nodes,
                                                "cap_bytes": 256 << 20}}

    def node(i: int) -> Node:
        cfg = write_config(tmp / f"node{i}.toml", {
            "store": {"data_dir": str(tmp / f"store{i}"), "capacity_bytes": 1 << 28, "block_tokens": block_tokens},
            "fleet": fleet_section, **swa})
        child = Child(f"node{i}", ["serve", "--config", str(cfg), "--port", "0"], tmp / "logs")
        return Node(node_id=datadir.node_id(tmp / f"store{i}"), child=child)

    def front() -> Child:
        cfg = write_config(tmp / "gateway.toml", {
            "store": {"data_dir": str(tmp / "gateway-none"), "block_tokens": block_tokens}, "fleet": fleet_section})
        return Child("gateway", ["gateway", "--config", str(cfg), "--port", "0"], tmp / "logs")

    with ThreadPoolExecutor(nodes) as pool:
        started = list(pool.map(node, range(nodes)))
    gate = front() if gateway else None  # after the nodes: it reads the layout the first node recorded (F8)
    fleet = Fleet(address=f"etcd://{etcd.endpoint}/{cluster}", nodes=started, run_blocks=run_blocks, gateway=gate,
                  data_dirs={n.node_id: tmp / f"store{i}" for i, n in enumerate(started)})
    fleet.client().close()  # every node is in etcd's view before a test configures an engine
    return etcd, fleet


def fleet_fixture(tmp: Path, *, block_tokens: int, run_blocks: int = RUN_BLOCKS, swa_nodes: str | None = None,
                  gateway: bool = False) -> Iterator[Fleet]:
    """A module fixture's body: the fleet, then every process stopped."""
    etcd, fleet = start_fleet(tmp, block_tokens=block_tokens, run_blocks=run_blocks, swa_nodes=swa_nodes,
                              gateway=gateway)
    try:
        yield fleet
    finally:
        if fleet.gateway is not None:
            fleet.gateway.kill_if_alive()
        for n in fleet.nodes:
            n.child.kill_if_alive()
        etcd.stop()


def spread_prompt(fleet: Fleet, make: Callable[[int], list[int]], hashes: Callable[[list[int]], list[bytes]], *,
                  also: Callable[[list[bytes]], bool] | None = None) -> tuple[int, list[int]]:
    """A seed and its prompt whose runs' replicas, taken together, are every node of the fleet (placement is by
    the nodes' random ids, so a few seeds are tried), so a test sees blocks land on more than one node pair;
    `also`: and whose chain (fleet hashes from block 0) it accepts."""
    with fleet.client() as client:
        every = {n.node_id for n in fleet.nodes}
        for seed in range(200):
            tokens = make(seed)
            chain = hashes(tokens)
            if {r for run in client.placement(chain) for r in run.replicas} == every and (also is None or also(chain)):
                return seed, tokens
    raise AssertionError("no prompt of 200 seeds has runs on every node")


def first_reads(client: FleetClient, chain: Sequence[bytes]) -> list[str]:
    """The node `client` reads each run of `chain` from first (its read order, F33)."""
    return [client.pool.read_order(chain[run.first_block], list(run.replicas))[0] for run in client.placement(chain)]
