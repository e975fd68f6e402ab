"""`kvstore trace replay` through an etcd:// address: a slice of the Mooncake fixture driven against a real
fleet (one etcd, three `kvstore serve` nodes on loopback, replication 2) through the fleet client, and what
the replay says it found and stored set beside what the nodes hold and the simulation of the same slice."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvstore
from kvstore.client.fleet import FleetClient
from kvstore.trace.load import load_trace
from kvstore.trace.replayer import replay
from kvstore.trace.requests import Trace
from kvstore.trace.simulate import SimSettings, Simulation
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tiers import datadir

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
RUN_BLOCKS = 4
NODES = 3
REPLICATION = 2
REQUESTS = 12


@dataclass
class Fleet:
    """The module's fleet: its etcd:// address and its nodes (id -> process)."""

    address: str
    nodes: dict[str, Child]


def _node(tmp: Path, etcd: str, cluster: str, i: int) -> tuple[str, Child]:
    cfg = write_config(tmp / f"node{i}.toml", {
        "store": {"data_dir": str(tmp / f"store{i}"), "capacity_bytes": 4 << 30},
        "fleet": {"etcd": etcd, "cluster": cluster, "lease_ttl_s": 60, "run_blocks": RUN_BLOCKS,
                  "replication": REPLICATION},
    })
    child = Child(f"node{i}", ["serve", "--config", str(cfg), "--port", "0"], tmp / "logs")
    return datadir.node_id(tmp / f"store{i}"), child


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("trace-fleet")
    etcd = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    nodes: dict[str, Child] = {}
    try:
        with ThreadPoolExecutor(NODES) as pool:
            nodes = dict(pool.map(lambda i: _node(tmp, etcd.endpoint, cluster, i), range(NODES)))
        address = f"etcd://{etcd.endpoint}/{cluster}"
        with kvstore.Client(address) as client:  # every node registered before the replay starts
            assert isinstance(client, FleetClient)
            client.view.wait_until(lambda seen: set(nodes) <= set(seen), 30.0)
        yield Fleet(address=address, nodes=nodes)
    finally:
        for child in nodes.values():
            child.kill_if_alive()
        etcd.stop()


def test_a_replay_through_etcd_stores_on_the_replicas_and_finds_what_the_simulation_finds(fleet: Fleet) -> None:
    trace = load_trace(FIXTURES / "mooncake.jsonl", requests=REQUESTS)
    tally = replay(trace, target=fleet.address, swa_ttl_s=0, concurrency=1, max_requests=REQUESTS)
    logs = "\n".join(child.log() for child in fleet.nodes.values())
    assert not tally.errors, logs
    assert tally.requests == REQUESTS and tally.found_tokens > 0 and tally.put_blocks > 0
    with kvstore.Client(fleet.address) as client:
        assert isinstance(client, FleetClient)
        held = client.node_stats()
    assert set(held) == set(fleet.nodes)
    # every block the replay stored is on its run's REPLICATION replicas, and nothing else is stored
    assert sum(n.blocks_stored for n in held.values()) == REPLICATION * tally.put_blocks
    assert sum(n.blocks_written for n in held.values()) == REPLICATION * tally.put_blocks
    assert sum(1 for n in held.values() if n.blocks_stored) > 1  # runs spread over the nodes
    # the hits it reports are those of the fleet's rules on the same slice, simulated over 3 nodes
    sim = Simulation(SimSettings(swa_ttl_s=0, nodes=NODES, replication=REPLICATION, run_blocks=RUN_BLOCKS)).run(
        Trace(name="slice", kind=trace.kind, requests=tally.done))
    assert sim.total.found_tokens == tally.found_tokens
    assert sim.total.put_blocks == REPLICATION * tally.put_blocks
    assert abs(sim.total.usable_hit_rate - tally.usable_hit_rate) <= 0.01
