"""Pins and where a prefix lives, over a fleet of real processes on loopback: one etcd, three `kvstore serve`
nodes (replication 2, runs of 4 blocks of 16 tokens) and a `kvstore gateway` (docs/RETENTION.md R28,
docs/PLANNER.md "Where a prefix lives").

A pin asked through the fleet client or the gateway holds on every copy of every run (each node asked
directly shows it); a Lookup asked for hosts names every replica of every found run, with the block
ranges the placement gives it, the host the node registered in etcd, and the store a reader opens.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

import kvstore
from kvstore.client.fleet import FleetClient
from kvstore.prefix_hosts import host_id
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tiers import datadir

BLOCK_TOKENS = 16
RUN_BLOCKS = 4
HOUR = 3600.0
PIN_MAX_HOURS = 100.0


@dataclass
class Fleet:
    address: str
    nodes: dict[str, Child]
    stores: dict[str, Path]
    gateway: Child


def _node(tmp: Path, etcd: str, cluster: str, i: int) -> tuple[str, Child, Path]:
    store = tmp / f"store{i}"
    cfg = write_config(tmp / f"node{i}.toml", {
        "store": {"data_dir": str(store), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS,
                  "pin_max_hours": PIN_MAX_HOURS, "pin_budget_bytes": 1 << 26},
        "fleet": {"etcd": etcd, "cluster": cluster, "lease_ttl_s": 60, "run_blocks": RUN_BLOCKS},
    })
    child = Child(f"node{i}", ["serve", "--config", str(cfg), "--port", "0"], tmp / "logs")
    return datadir.node_id(store), child, store


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("hosts-pins")
    etcd = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    children: list[Child] = []
    try:
        with ThreadPoolExecutor(3) as pool:
            made = list(pool.map(lambda i: _node(tmp, etcd.endpoint, cluster, i), range(3)))
        children = [child for _, child, _ in made]
        cfg = write_config(tmp / "gateway.toml", {
            "store": {"data_dir": str(tmp / "gateway-none"), "block_tokens": BLOCK_TOKENS},
            "fleet": {"etcd": etcd.endpoint, "cluster": cluster, "run_blocks": RUN_BLOCKS, "replication": 2},
        })
        gateway = Child("gateway", ["gateway", "--config", str(cfg), "--port", "0"], tmp / "logs")
        children.append(gateway)
        yield Fleet(address=f"etcd://{etcd.endpoint}/{cluster}", nodes={n: c for n, c, _ in made},
                    stores={n: s for n, _, s in made}, gateway=gateway)
    finally:
        for child in children:
            child.kill_if_alive()
        etcd.stop()


def fleet_client(fleet: Fleet) -> FleetClient:
    client = kvstore.Client(fleet.address)
    assert isinstance(client, FleetClient)
    client.view.wait_until(lambda nodes: set(fleet.nodes) <= set(nodes), 30.0)
    return client


def prompt(blocks: int) -> list[int]:
    return [random.randrange(50_000) for _ in range(blocks * BLOCK_TOKENS)]


def node_pins(fleet: Fleet) -> dict[str, int]:
    """Each node's live pins of the default tenant, asked of the node itself."""
    out = {}
    for node, child in fleet.nodes.items():
        with kvstore.Client(child.target) as direct:
            tenants = direct.stats(tenant="default").tenants
        out[node] = sum(t.pins for t in tenants if t.tenant == "default")
    return out


def copies(client: FleetClient, chain: list[bytes]) -> dict[str, int]:
    """How many runs of `chain` each node holds a copy of (the placement)."""
    out: dict[str, int] = {}
    for run in client.placement(chain):
        for node in run.replicas:
            out[node] = out.get(node, 0) + 1
    return out


def test_r28_a_fleet_clients_pin_holds_on_every_copy_of_every_run(fleet: Fleet) -> None:
    tokens = prompt(3 * RUN_BLOCKS + 2)  # four runs, the last of two blocks
    with closing(fleet_client(fleet)) as client:
        before = node_pins(fleet)
        asked = time.time() + 10 * HOUR
        put = client.put(tokens, [random.randbytes(client.block_bytes) for _ in range(14)], keep_until_s=asked)
        assert (put.kept_until_s, put.keep_note) == (asked, "")
        chain = client.hashes(tokens)
        added = {n: node_pins(fleet)[n] - before[n] for n in fleet.nodes}
        assert added == {n: copies(client, chain).get(n, 0) for n in fleet.nodes}  # one pin per run per copy
        far = client.pin(tokens, time.time() + 500 * HOUR)  # past the nodes' longest: each copy says so
        assert far.found_blocks == 14 and 0 < far.kept_until_s < time.time() + (PIN_MAX_HOURS + 1) * HOUR
        assert "8 of 8 copies kept less" in far.keep_note and "100 h" in far.keep_note
        assert client.pin(prompt(2), time.time() + HOUR).keep_note == "nothing was found to keep"


def test_r28_a_pin_through_the_gateway_holds_on_every_copy(fleet: Fleet) -> None:
    tokens, more = prompt(2 * RUN_BLOCKS + 1), prompt(RUN_BLOCKS)
    with kvstore.Client(fleet.gateway.target) as plain, closing(fleet_client(fleet)) as routed:
        before = node_pins(fleet)
        asked = time.time() + 3 * HOUR
        put = plain.put(tokens, [random.randbytes(plain.block_bytes) for _ in range(9)], batch_blocks=3,
                        keep_until_s=asked)  # a stream of batches, then one pin of the prompt from block 0
        assert (put.kept_until_s, put.keep_note) == (asked, "")
        added = {n: node_pins(fleet)[n] - before[n] for n in fleet.nodes}
        assert added == {n: copies(routed, routed.hashes(tokens)).get(n, 0) for n in fleet.nodes}
        plain.put(more, [random.randbytes(plain.block_bytes) for _ in range(RUN_BLOCKS)])
        got = plain.pin(more, asked)  # a Lookup's pin through the gateway: both copies of the one run
        assert (got.found_blocks, got.kept_until_s, got.keep_note) == (RUN_BLOCKS, asked, "")
        assert sum(node_pins(fleet).values()) - sum(before.values()) == sum(added.values()) + 2
        # A raw Put through the gateway asking keep_until_s: each replica pins its part in its own Put (R22).
        raw = prompt(RUN_BLOCKS + 1)  # two runs from block 0: each part's last block pinned on both copies
        with grpc.insecure_channel(fleet.gateway.target) as channel:
            reply = pb_grpc.KVStoreStub(channel).Put(pb.PutRequest(
                token_ids=raw, blocks=[random.randbytes(plain.block_bytes) for _ in range(RUN_BLOCKS + 1)],
                keep_until_s=asked))
        assert (reply.written_blocks, reply.kept_until_s, reply.keep_note) == (RUN_BLOCKS + 1, asked, "")
        assert sum(node_pins(fleet).values()) - sum(before.values()) == sum(added.values()) + 2 + 4


def node_lookups(fleet: Fleet) -> int:
    """Lookups every node has answered (its Stats counter)."""
    total = 0
    for child in fleet.nodes.values():
        with kvstore.Client(child.target) as direct:
            total += direct.stats().lookups
    return total


@pytest.mark.parametrize("through", ["fleet-client", "gateway"])
def test_r28_a_put_asking_keep_until_pins_each_copy_in_its_own_put(fleet: Fleet, through: str) -> None:
    """A Put with keep_until_s, by the fleet client or through the gateway (in batches not aligned to runs): each
    copy's Put pins its run's last block itself, so no node is asked a Lookup, and each copy holds one pin per run
    it holds. A Put from a later run pins the runs before it (not in the Put) with one Lookup per copy of them,
    and the answer is the earliest grant over every copy, the copies that kept less named."""
    tokens = prompt(3 * RUN_BLOCKS + 1)  # four runs, the last of one block
    with closing(fleet_client(fleet)) as routed, kvstore.Client(fleet.gateway.target) as plain:
        client = routed if through == "fleet-client" else plain
        payload = [random.randbytes(client.block_bytes) for _ in range(3 * RUN_BLOCKS + 1)]
        pins0, lookups0 = node_pins(fleet), node_lookups(fleet)
        asked = time.time() + 7 * HOUR
        put = client.put(tokens[:2 * RUN_BLOCKS * BLOCK_TOKENS], payload[:2 * RUN_BLOCKS], batch_blocks=3,
                         keep_until_s=asked)
        assert (put.kept_until_s, put.keep_note) == (asked, "")
        assert node_lookups(fleet) == lookups0  # pinned in the Puts themselves: not one Lookup
        first = copies(routed, routed.hashes(tokens[:2 * RUN_BLOCKS * BLOCK_TOKENS]))
        assert {n: node_pins(fleet)[n] - pins0[n] for n in fleet.nodes} == {n: first.get(n, 0) for n in fleet.nodes}
        # From block 8 on (the third run): its runs pin in their Puts, the two before by a Lookup of each copy,
        # asked past the nodes' longest pin, so every copy kept less and says so.
        far = time.time() + 500 * HOUR
        more = client.put(tokens, payload[2 * RUN_BLOCKS:], first_block=2 * RUN_BLOCKS, keep_until_s=far)
        assert 0 < more.kept_until_s < time.time() + (PIN_MAX_HOURS + 1) * HOUR
        assert "100 h" in more.keep_note
        assert node_lookups(fleet) > lookups0  # the runs before block 8 were pinned by Lookups
        assert sum(node_pins(fleet).values()) == sum(pins0.values()) + 8  # 4 runs, 2 copies each, 1 pin a run


def test_a_lookup_names_every_replica_of_every_found_run(fleet: Fleet) -> None:
    tokens = prompt(2 * RUN_BLOCKS + 3)  # three runs; the Lookup finds the first two and a half
    with closing(fleet_client(fleet)) as client, kvstore.Client(fleet.gateway.target) as plain:
        client.put(tokens, [random.randbytes(client.block_bytes) for _ in range(11)])
        asked = tokens[:10 * BLOCK_TOKENS] + prompt(2)  # 10 of its blocks, then two not stored
        found = client.lookup(asked, hosts=True)
        assert found.found_blocks == 10
        expected: dict[str, list[tuple[int, int]]] = {}
        for run in client.placement(client.hashes(asked)):
            for node in run.replicas:
                if run.first_block < 10:
                    expected.setdefault(node, []).append((run.first_block, min(run.end_block, 10)))
        got = {h.node_id: h for h in found.hosts}
        assert set(got) == set(expected)
        for node, host in got.items():
            merged = sorted(expected[node])
            assert host.blocks == sum(e - f for f, e in merged) and host.blocks_below(10) == host.blocks
            assert (host.host, host.host_id, host.colocated) == (socket.gethostname(), host_id(), True)
            assert host.data_dir == str(fleet.stores[node].resolve())
            assert host.address == client.view.nodes[node].address
        assert plain.lookup(asked, hosts=True).hosts == found.hosts  # the gateway names the same
        assert client.lookup(asked).hosts == ()


def test_kvstore_plan_hosts_over_a_fleet(fleet: Fleet, tmp_path: Path) -> None:
    tokens = prompt(2 * RUN_BLOCKS)
    with closing(fleet_client(fleet)) as client:
        client.put(tokens, [random.randbytes(client.block_bytes) for _ in range(8)])
    file = tmp_path / "prompt.json"
    file.write_text(json.dumps([*tokens, 1, 2, 3]))
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "plan", "--tokens", str(file), "--target",
                          fleet.address, "--hosts", "--json", "--no-direct"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    hosts = json.loads(out.stdout)["hosts"]
    # Every node here is on this one machine: one host holding the whole prefix, its runs over gRPC without a
    # reader (a fleet has no shared-memory path, F47), then any other host.
    assert [(h["host_id"], h["path"], h["local_blocks"], h["remote_blocks"]) for h in hosts] == [
        (host_id(), "network", 8, 0), ("", "network", 0, 8)]
    assert set(hosts[0]["nodes"]) <= set(fleet.nodes) and len(hosts[0]["nodes"]) >= 2  # two runs, two copies each


def test_r28_an_operator_sees_and_drops_a_tenants_pins_on_every_node(fleet: Fleet) -> None:
    tokens = prompt(RUN_BLOCKS + 1)
    with closing(fleet_client(fleet)) as client:
        client.put(tokens, [random.randbytes(client.block_bytes) for _ in range(RUN_BLOCKS + 1)],
                   keep_until_s=time.time() + HOUR)
    held = node_pins(fleet)
    assert sum(held.values()) >= 4  # this prompt's two runs on two copies each, and the earlier tests'

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvstore.cli", *args, "--target", fleet.address, "--json"],
                              capture_output=True, text=True, timeout=120)

    stats = json.loads(cli("stats", "--tenant", "default").stdout)
    assert {n["node_id"]: n["pins"] for n in stats["nodes"]} == held and stats["total"]["pins"] == sum(held.values())
    dropped = cli("pins", "--tenant", "default", "--drop", "--yes")
    assert dropped.returncode == 0, dropped.stderr
    assert json.loads(dropped.stdout) == {"tenant": "default", "dropped_pins": sum(held.values()), "nodes": held,
                                          "unreachable": {}}
    assert set(node_pins(fleet).values()) == {0}


def test_the_gateways_hosts_follow_the_tenants_own_replication(fleet: Fleet) -> None:
    """A tenant whose policy keeps 3 copies (F51): the gateway names 3 replicas of each run, as the fleet
    client places them."""
    from kvstore.client.admin import AdminClient
    from tests.waiting import wait_until

    tenant, tokens = f"r3-{uuid.uuid4().hex[:8]}", prompt(RUN_BLOCKS)
    with AdminClient(next(iter(fleet.nodes.values())).target) as admin:
        admin.set_policy(tenant, replication=3)
    client = kvstore.Client(fleet.address, namespace=tenant)
    assert isinstance(client, FleetClient)
    with closing(client), kvstore.Client(fleet.gateway.target, namespace=tenant) as plain:
        wait_until(lambda: client.copies == 3, "the fleet client following the tenant's replication")
        client.put(tokens, [random.randbytes(client.block_bytes) for _ in range(RUN_BLOCKS)])
        wait_until(lambda: len(plain.lookup(tokens, hosts=True).hosts) == 3, "the gateway naming three copies")
        assert plain.lookup(tokens, hosts=True).hosts == client.lookup(tokens, hosts=True).hosts
