"""SWA snapshots through a fleet client (docs/FLEET.md F44, F45): one real etcd, one real Redis Cluster of 3
masters, three real `kvstore serve` nodes whose `[swa]` pool is that cluster.

The nodes are module-scoped (starting them costs seconds); each test uses prompts of its own (random tokens).
The test that kills a node runs last.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from redis.cluster import RedisCluster

import kvstore
from kvstore.client import colocated
from kvstore.client.admin import AdminClient
from kvstore.client.colocated import ColocatedReader
from kvstore.client.fleet import FleetClient, FleetLookupResult, placeable
from kvstore.client.fleet_swa import FleetSwaClient, pool_nodes, swa_records
from kvstore.client.restore import restore
from kvstore.client.retry import ExponentialBackoff, Retry
from kvstore.client.swa import SwaClient
from kvstore.clock import ManualClock
from kvstore.config_sections import SwaSettings
from kvstore.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvstore.fleet.membership import NodeRecord
from kvstore.fleet.swa_pool import MEMORY, is_shared, pool_name
from kvstore.swa_snapshot import snapshot_key
from replay.plan import Action
from replay.planner import Planner
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tiers import datadir
from tiers.swa_acl import AclUsers

BLOCK_TOKENS = 16
RUN_BLOCKS = 4
RUN_TOKENS = BLOCK_TOKENS * RUN_BLOCKS
#: Long enough that the killed node stays in the view: the SWA client must fail over, not just re-read the view.
LEASE_TTL_S = 60


def record(node_id: str, swa_pool: str) -> NodeRecord:
    return NodeRecord(node_id=node_id, address=f"{node_id}:1", host="h", capacity_bytes=1, started_at=0.0,
                      version="0", swa_pool=swa_pool)


def test_f44_the_pool_is_the_one_the_nodes_share() -> None:
    cluster = pool_name(SwaSettings(backend="redis-cluster", cluster_nodes="10.0.0.2:7000, 10.0.0.1:7000"))
    assert cluster == pool_name(SwaSettings(backend="redis-cluster", cluster_nodes="10.0.0.1:7000,10.0.0.2:7000"))
    assert cluster == "redis-cluster 10.0.0.1:7000,10.0.0.2:7000 kvstore:swa:"
    single = pool_name(SwaSettings(backend="redis", redis_url="redis://user:secret@10.0.0.1:6379/2"))
    assert single == "redis redis://10.0.0.1:6379/2 kvstore:swa:" and "secret" not in single
    assert pool_name(SwaSettings()) == MEMORY and not is_shared(MEMORY) and is_shared(cluster)
    # The nodes recording the shared pool; a node on its own memory is not asked.
    assert pool_nodes([record("b", cluster), record("a", cluster), record("c", MEMORY)]) == ["a", "b"]
    # One node serves its own pool, the embedded one included (the one-node default).
    assert pool_nodes([record("a", MEMORY)]) == ["a"]
    with pytest.raises(FailedPrecondition, match="each of the fleet's 2 nodes keeps its own SWA pool") as own:
        pool_nodes([record("a", MEMORY), record("b", MEMORY)])
    assert "redis-cluster" in own.value.hint
    with pytest.raises(FailedPrecondition, match="2 different SWA pools"):
        pool_nodes([record("a", cluster), record("b", single)])
    with pytest.raises(Unavailable):
        pool_nodes([])
    # A record from a node older than F44 has no pool: it parses, as unrecorded.
    old = json.dumps({"node_id": "x", "address": "x:1", "host": "h", "capacity_bytes": 1, "started_at": 0.0,
                      "version": "0"}).encode()
    assert NodeRecord.from_json(old).swa_pool == ""
    assert NodeRecord.from_json(record("a", cluster).to_json()).swa_pool == cluster


def test_f46_a_node_sweeps_only_the_direct_users_past_their_lifetime(redis_cluster: Any) -> None:
    """F46: two nodes' users on one Redis Cluster: a node's first grant leaves the other's live users alone, and
    deletes a dead node's once their lifetime has ended (and an older kvstore's, whose names carry no end)."""
    host, port = redis_cluster.startup_nodes.split(",")[0].split(":")
    with RedisCluster(host=host, port=int(port)) as redis:
        def command(*args: Any) -> Any:
            return redis.execute_command(*args, target_nodes=RedisCluster.ALL_NODES)

        def users() -> set[str]:
            return {n.decode() if isinstance(n, bytes) else n for per in command("ACL", "USERS").values() for n in per}

        clock = ManualClock(start=time.time())  # the wall face: other tests' nodes share this cluster's users
        command("ACL", "SETUSER", "kvstore-swa-older-1a2b3c4d", "on", ">x")
        a = AclUsers(command, lifetime_s=10.0, clock=clock, cluster=True)
        b = AclUsers(command, lifetime_s=10.0, clock=clock, cluster=True)
        ua = a.grant("t1", b"kvstore:swa:t1:*", writable=False)
        ub = b.grant("t1", b"kvstore:swa:t1:*", writable=True)  # b's first grant sweeps the Redis
        assert {ua.username, ub.username} <= users() and "kvstore-swa-older-1a2b3c4d" not in users()
        clock.advance(11.0)  # a died without deleting its user; its lifetime is over
        assert b.reap() == 1 and not {ua.username, ub.username} & users()


def test_f44_embedded_pools_serve_one_node_and_are_a_miss_for_a_lookup_over_two(tmp_path: Path) -> None:
    """F44, F45: nodes on the default embedded pool: a fleet of one serves SWA from it (the one-node default); once a
    second node joins, `swa` is FAILED_PRECONDITION naming the fix, and a Lookup with candidates still answers its
    blocks, the snapshot a miss saying why (as an unreachable pool on one server: SWA_POOL.md rule 4)."""
    etcd = EtcdProcess(tmp_path / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"

    def node(i: int) -> Child:
        cfg = write_config(tmp_path / f"node{i}.toml", {
            "store": {"data_dir": str(tmp_path / f"store{i}"), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
            "fleet": {"etcd": etcd.endpoint, "cluster": cluster, "lease_ttl_s": 10, "run_blocks": RUN_BLOCKS}})
        return Child(f"node{i}", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs")

    children = [node(0)]
    try:
        with kvstore.Client(f"etcd://{etcd.endpoint}/{cluster}") as client:
            assert isinstance(client, FleetClient)
            tokens = prompt(RUN_TOKENS * 3)
            client.put(tokens, [random.randbytes(client.block_bytes) for _ in range(12)])
            data = snapshot(client, 128)
            assert client.swa.put(tokens, data, position=128).stored == 1 and bytes(client.swa.get(tokens, 128)) == data
            assert client.swa.last_path == "shm"  # the embedded pool's same-host path, through the fleet client
            assert client.lookup(tokens, swa_positions=[128]).swa_position == 128
            children.append(node(1))
            client.view.wait_until(lambda nodes: len(nodes) == 2, 30.0)
            found = client.lookup(tokens, swa_positions=[128], lease_ms=5_000)
            assert isinstance(found, FleetLookupResult) and found.found_tokens == 3 * RUN_TOKENS
            assert found.swa_position is None and "keeps its own SWA pool" in found.swa_error
            assert found.lease_id and client.release(found.lease_id)  # the blocks' answer and lease stand
            with pytest.raises(FailedPrecondition, match="keeps its own SWA pool") as refused:
                client.swa.get(tokens, 128)
            assert "redis-cluster" in refused.value.hint
    finally:
        for child in children:
            child.kill_if_alive()
        etcd.stop()


@dataclass
class Node:
    node_id: str
    child: Child
    data_dir: Path


@dataclass
class Fleet:
    address: str
    nodes: list[Node]
    pool: str


def _start_node(tmp: Path, etcd: str, cluster: str, redis_nodes: str, i: int) -> Node:
    cfg = write_config(tmp / f"node{i}.toml", {
        "store": {"data_dir": str(tmp / f"store{i}"), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
        "fleet": {"etcd": etcd, "cluster": cluster, "lease_ttl_s": LEASE_TTL_S, "run_blocks": RUN_BLOCKS},
        "swa": {"backend": "redis-cluster", "cluster_nodes": redis_nodes, "cap_bytes": 256 << 20},
    })
    child = Child(f"node{i}", ["serve", "--config", str(cfg), "--port", "0"], tmp / "logs")
    return Node(node_id=datadir.node_id(tmp / f"store{i}"), child=child, data_dir=tmp / f"store{i}")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, redis_cluster_session: Any) -> Iterator[Fleet]:
    """One etcd and three nodes sharing the session's Redis Cluster as their SWA pool."""
    tmp = tmp_path_factory.mktemp("fleet-swa")
    etcd = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    redis_nodes = redis_cluster_session.startup_nodes
    with ThreadPoolExecutor(3) as pool:
        nodes = list(pool.map(lambda i: _start_node(tmp, etcd.endpoint, cluster, redis_nodes, i), range(3)))
    try:
        yield Fleet(address=f"etcd://{etcd.endpoint}/{cluster}", nodes=nodes,
                    pool=pool_name(SwaSettings(backend="redis-cluster", cluster_nodes=redis_nodes)))
    finally:
        for n in nodes:
            n.child.kill_if_alive()
        etcd.stop()


def fleet_client(fleet: Fleet, **kwargs: Any) -> FleetClient:
    client = kvstore.Client(fleet.address, **kwargs)
    assert isinstance(client, FleetClient)
    live = {n.node_id for n in fleet.nodes if n.child.alive}
    client.view.wait_until(lambda nodes: live <= set(nodes), 30.0)
    return client


def prompt(n_tokens: int) -> list[int]:
    return [random.randrange(50_000) for _ in range(n_tokens)]


def snapshot(client: FleetClient, position: int) -> bytes:
    return random.randbytes(client.swa.snapshot_bytes(position))


def test_f44_a_snapshot_put_through_one_node_is_found_through_every_other(fleet: Fleet) -> None:
    """F44: every node records the shared pool; a fleet client's snapshot is a hit through every node, on the
    direct path and the gateway path, and for a second fleet client."""
    with fleet_client(fleet) as a, fleet_client(fleet) as b:
        assert {r.swa_pool for r in a.view.nodes.values()} == {fleet.pool}
        tokens = prompt(200)
        data = snapshot(a, 200)
        assert a.swa.put(tokens, data).stored == 1
        assert a.swa.last_path == "direct"  # the client wrote Redis itself, as the node's ACL user
        # Its key is anchored on the fleet hash of the block before it (run 3's last), as FleetClient.hashes gives.
        assert a.swa.key(tokens) == snapshot_key(a.hashes(tokens)[200 // BLOCK_TOKENS - 1], tokens[192:200], 200)
        assert bytes(b.swa.get(tokens)) == data
        for node in fleet.nodes:  # each node's own pool sees it: they share one
            with kvstore.Client(node.child.target) as direct:
                got = direct.swa.get_many([a.swa.key(tokens)])[0]
                assert got is not None and bytes(got) == data
        via = FleetSwaClient(a.pool, lambda: swa_records(a.view.nodes, placeable(a.view.nodes)), retry=a.retry,
                             run_blocks=RUN_BLOCKS, path="gateway")
        other = prompt(130)
        more = snapshot(a, 130)
        assert via.put(other, more).stored == 1 and via.last_path == "gateway"
        assert bytes(b.swa.get(other)) == more and bytes(via.get(tokens)) == data
        assert via.delete_many([via.key(other)]) == 1 and b.swa.get(other) is None
        via.close()


def test_f45_a_fleet_lookup_names_the_snapshot_that_resumes_longest_within_the_found_blocks(fleet: Fleet) -> None:
    """F45: the resume is bounded by the blocks found across the runs' nodes, not by any one node's."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 5 + 10)  # 20 full blocks over 5 runs (on different nodes), a partial one
        client.put(tokens, [random.randbytes(client.block_bytes) for _ in range(20)])
        for t in (192, 320, 330):
            client.swa.put(tokens, snapshot(client, t), position=t)
        positions = [128, 192, 320, 330]  # 128: never stored; 330: past the found 320 tokens, serves nothing
        found = client.lookup(tokens, swa_positions=positions)
        assert found.found_tokens == 320 and (found.swa_position, found.swa_resume_tokens) == (320, 320)
        limited = client.lookup(tokens, swa_positions=positions, swa_resume_limit=319)
        assert (limited.swa_position, limited.swa_resume_tokens) == (320, 319)  # even T: T - 1 too
        leased = client.lookup(tokens, swa_positions=positions, lease_ms=10_000)
        assert leased.lease_id and (leased.swa_position, leased.swa_resume_tokens) == (320, 320)
        assert client.release(leased.lease_id)
        # Only the first three runs stored: T = 320 is past the found 192 tokens; T = 192 serves.
        short = tokens[:RUN_TOKENS * 3] + prompt(RUN_TOKENS * 2 + 10)
        client.put(short[:RUN_TOKENS * 3], [random.randbytes(client.block_bytes) for _ in range(12)])
        keys = client.swa.keys(short, [192, 320])
        client.swa.put_many([(keys[0], 192, snapshot(client, 192)), (keys[1], 320, snapshot(client, 320))])
        partial = client.lookup(short, swa_positions=[192, 320])
        assert partial.found_tokens == 192 and (partial.swa_position, partial.swa_resume_tokens) == (192, 192)
        assert client.lookup(prompt(300), swa_positions=[128, 256]).swa_position is None  # nothing stored


def test_f47_the_planner_and_restore_run_over_a_fleet_client(fleet: Fleet) -> None:
    """F47: a Planner over a fleet client plans from a leased Lookup across the runs' nodes and the shared pool's
    snapshot, and reports the plan to one node; restore streams every run back over gRPC."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 5 + 5)  # 20 blocks over 5 runs
        payload = [random.randbytes(client.block_bytes) for _ in range(20)]
        client.put(tokens, payload)
        client.swa.put(tokens, snapshot(client, 256), position=256)
        before = sum(s.resume_plans for s in client.node_stats().values())
        with Planner(client, snapshot_probes=8) as planner:
            hashes = client.hashes(tokens)
            positions, keys = planner._probes(hashes, len(hashes), ())
            assert keys == client.swa.keys(tokens, positions)  # the planner's probes are the pool's keys
            plan = planner.plan(tokens)
        assert plan.action is Action.FETCH_SNAPSHOT and plan.found_tokens == 320
        assert (plan.snapshot_position, plan.resume_tokens, plan.fetch_tokens) == (256, 256, 256)
        assert plan.lease_id and plan.lease_id.startswith("fleet:") and client.release(plan.lease_id)
        assert planner.background_errors == 0  # the report went to a node (close waited for it)
        assert sum(s.resume_plans for s in client.node_stats().values()) == before + 1
        dest = bytearray(20 * client.block_bytes)
        result = restore(client, tokens, dest, path="grpc")  # "auto" takes shm from this host's nodes: F63
        assert (result.path, result.blocks, result.tokens) == ("grpc", 20, 320) and "a fleet client" in result.reason
        assert bytes(dest) == b"".join(payload)


def test_f48_restore_reads_this_hosts_nodes_runs_directly_and_streams_the_rest(fleet: Fleet) -> None:
    """F48: with the ColocatedReader of one node, restore reads the runs that node holds from its file and
    streams the others from their replicas; every byte comes back, in order."""
    local = fleet.nodes[0]
    with fleet_client(fleet) as client:
        while True:  # a prompt with some runs on the local node and some not (each run: 2 of 3 nodes)
            tokens = prompt(RUN_TOKENS * 6 + 3)
            runs = client.placement(client.hashes(tokens))
            mine = sum(local.node_id in r.replicas for r in runs)
            if 0 < mine < len(runs):
                break
        payload = [random.randbytes(client.block_bytes) for _ in range(24)]
        client.put(tokens, payload)
        assert colocated.IDENTITY_NAME == datadir.IDENTITY_NAME
        reader = ColocatedReader(local.data_dir)
        try:
            assert reader.node_id == local.node_id
            dest = bytearray(24 * client.block_bytes)
            result = restore(client, tokens, dest, reader=reader)
            assert (result.path, result.blocks, result.corrupt) == ("direct-cpu", 24, [])
            assert f"{mine} of 6 runs read from it" in result.reason and bytes(dest) == b"".join(payload)
            rows = restore(client, tokens, dest_rows := torch.zeros((24, client.block_bytes), dtype=torch.uint8),
                           path="direct-cpu", reader=reader)
            assert rows.blocks == 24 and [bytes(r.numpy()) for r in dest_rows] == payload
        finally:
            reader.close()
        with pytest.raises(FailedPrecondition, match="needs a ColocatedReader of this host's node"):
            restore(client, tokens, dest, path="direct-cpu")


def test_f47_a_resumer_plans_over_a_fleet_and_its_worker_stores_to_it(fleet: Fleet, loop_thread: Any) -> None:
    """F47 end to end: a real worker (the tiny model on the CPU) whose store target is the fleet's address, and a
    Resumer whose planner is a fleet client: the second turn fetches the blocks and the snapshot the first turn's
    worker stored past the first run, and its logits are the model's over the whole prompt."""
    from kvstore.client.worker import WorkerClient
    from kvstore.geometry import TINY
    from replay.model import TINY_MODEL, ReferenceModel
    from replay.resume import Resumer
    from replay.worker.runner import Runner
    from replay.worker.service import start
    from replay.worker.settings import WorkerSettings
    from replay.worker.stores import StoreClients

    model = ReferenceModel(TINY_MODEL, device="cpu")
    settings = WorkerSettings(store_target=fleet.address, port=0)
    stores = StoreClients(settings.store_target, geometry=TINY.name)
    worker = loop_thread.run(start(settings, Runner(model, stores, settings)))
    try:
        with fleet_client(fleet, geometry=TINY.name) as client, Planner(client, report=False) as planner, \
                WorkerClient(worker.target, timeout_s=60) as workers:
            resumer = Resumer(planner, workers)
            rng = random.Random(47)
            turn = [rng.randrange(128) for _ in range(RUN_TOKENS * 2 + 22)]  # into the third run
            first = resumer.resume(turn, max_new_tokens=10)
            assert first.ok and first.plan.action is Action.FULL_PREFILL and first.run is not None
            prompt = turn + list(first.run.output_tokens) + [rng.randrange(128) for _ in range(13)]
            second = resumer.resume(prompt)
            assert second.ok and second.plan.action is Action.FETCH_SNAPSHOT, second.plan.reasons
            assert second.plan.snapshot_position is not None and second.plan.snapshot_position > RUN_TOKENS
            assert second.run is not None and second.run.snapshot_loaded
            assert torch.equal(second.run.logits, model.extend(model.new_state(), prompt)[-1])
    finally:
        loop_thread.run(worker.stop(0))
        stores.close()


def test_f49_a_fleet_transfer_session_fetches_every_run_into_one_region(fleet: Fleet) -> None:
    """F49: `transfer().fetch` of a chain over 5 runs lands every block in its slot of one region, each run from its
    own node; blocks past the stored chain are MISSING then SKIPPED; path "bulk" streams from nodes that run none."""
    from kvstore.transfer import Status

    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 5)
        payload = [random.randbytes(client.block_bytes) for _ in range(20)]
        client.put(tokens, payload)
        chain = client.hashes(tokens)
        longer = client.hashes(tokens + prompt(RUN_TOKENS))  # one more run, never stored
        with client.transfer(path="stream") as session:  # every node is this host's: F62 would map
            size = client.block_bytes
            region = session.register(25 * size)
            state = session.fetch(chain, region, offset_bytes=size)
            assert state.done_prefix == 20 and bytes(region.view[size:21 * size]) == b"".join(payload)
            firsts = {client.pool.read_order(chain[r.first_block], r.replicas)[0] for r in client.placement(chain)}
            assert session.nodes_read == firsts  # each run from the first node of its read order only
            whole = session.fetch(longer, region)
            assert whole.done_prefix == 20 and [r.status for r in whole.results[20:]] == (
                [Status.MISSING] + [Status.SKIPPED] * 3)
            every = session.fetch(longer, region, prefix_only=False)
            assert [r.status for r in every.results[20:]] == [Status.MISSING] * 4
            # A run's tail purged on the node its read order names first: the rest comes from the other replica.
            run = client.placement(chain)[1]
            first, other = client.pool.read_order(chain[run.first_block], run.replicas)[:2]
            with AdminClient(next(n for n in fleet.nodes if n.node_id == first).child.target) as admin:
                assert admin.purge("default", block_hashes=[chain[run.first_block + 2]]) == 2
            again = session.register(20 * size)
            assert session.fetch(chain, again).done_prefix == 20 and bytes(again.view) == b"".join(payload)
            assert {first, other} <= session.nodes_read
            with pytest.raises(InvalidArgument, match="a batch holds 1 to"):  # read() of descriptors: F71
                session.read([])
        with client.transfer(path="bulk") as session:  # F74: no node here runs the bulk transport: all streamed
            assert session.fetch(chain, session.register(20 * size)).done_prefix == 20
            assert set(session.last_paths) == {"stream"} and set(session.bulk_reasons) == session.nodes_read


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct-gpu needs CUDA (run on the GPU machine)")
def test_f48_direct_gpu_restore_over_a_fleet(fleet: Fleet) -> None:
    """F48 on a GPU: the local node's runs gathered by the GPU from its file, the rest streamed into the CUDA tensor."""
    local = fleet.nodes[0]
    with fleet_client(fleet) as client:
        while True:
            tokens = prompt(RUN_TOKENS * 6 + 3)
            runs = client.placement(client.hashes(tokens))
            if 0 < sum(local.node_id in r.replicas for r in runs) < len(runs):
                break
        payload = [random.randbytes(client.block_bytes) for _ in range(24)]
        client.put(tokens, payload)
        with ColocatedReader(local.data_dir) as reader:
            dest = torch.zeros((24, client.block_bytes), dtype=torch.uint8, device="cuda")
            result = restore(client, tokens, dest, reader=reader)
            assert (result.path, result.blocks, result.corrupt) == ("direct-gpu", 24, []), result.reason
            assert [bytes(r.cpu().numpy()) for r in dest] == payload


def test_f52_the_swa_pool_through_a_gateway_is_the_nodes_shared_one(fleet: Fleet, tmp_path: Path) -> None:
    """F52: a plain client of a gateway puts, gets and deletes snapshots through it (forwarded to a node of the
    shared pool), and takes the direct path it is offered; the nodes see the same snapshots."""
    etcd, cluster = fleet.address.removeprefix("etcd://").split("/")
    cfg = write_config(tmp_path / "gateway.toml", {
        "store": {"data_dir": str(tmp_path / "none"), "block_tokens": BLOCK_TOKENS},
        "fleet": {"etcd": etcd, "cluster": cluster, "run_blocks": RUN_BLOCKS},
    })
    gateway = Child("gateway", ["gateway", "--config", str(cfg), "--port", "0"], tmp_path / "logs")
    try:
        with fleet_client(fleet) as a, kvstore.Client(gateway.target) as plain, \
                kvstore.Client(fleet.nodes[2].child.target) as node:
            tokens = prompt(200)
            key, data = a.swa.key(tokens), snapshot(a, 200)
            through = SwaClient(plain.connection, path="gateway")
            assert through.key(tokens) == key  # a gateway's client anchors keys on the fleet's hashes
            assert through.put_many([(key, 200, data)]).stored == 1 and through.last_path == "gateway"
            got = node.swa.get_many([key])[0]
            assert got is not None and bytes(got) == data
            assert through.stats().cap_bytes == node.swa.stats().cap_bytes  # the pool's own settings
            offered = SwaClient(plain.connection)  # "auto": the direct path, its grant forwarded from a node
            got = offered.get_many([key])[0]
            assert got is not None and bytes(got) == data and offered.last_path == "direct"
            # A Lookup with SWA candidates through the gateway: blocks on the runs' nodes, the snapshot from
            # the pool within them (F45's rule), as the fleet client answers it.
            plain.put(tokens[:192], [random.randbytes(plain.block_bytes) for _ in range(12)])
            at_blocks = a.swa.key(tokens, 192)
            assert through.put_many([(at_blocks, 192, snapshot(a, 192))]).stored == 1
            found = plain.lookup(tokens, swa_positions=[200, 192])  # 200 resumes past the 192 tokens found
            fleet = a.lookup(tokens, swa_positions=[200, 192])
            assert (found.found_blocks, found.swa_position, found.swa_resume_tokens) == (12, 192, 192) == (
                fleet.found_blocks, fleet.swa_position, fleet.swa_resume_tokens)
            assert plain.lookup(tokens[:64] + prompt(136), swa_positions=[192]).swa_position is None
            assert through.delete_many([at_blocks]) == 1
            assert through.delete_many([key]) == 1 and node.swa.get_many([key]) == [None]
            through.close()
            offered.close()
    finally:
        gateway.kill_if_alive()


def test_f45_the_swa_pool_fails_over_when_its_node_dies(fleet: Fleet) -> None:
    """F45: the node a fleet SWA client talks to SIGKILLed (still in the view, its lease running): the next call
    goes through another node of the pool and finds what was put before."""
    fast = Retry(ExponentialBackoff(base_s=0.001, cap_s=0.01), retries=1)
    with fleet_client(fleet, retry=fast) as client:
        # path "gateway": every call through the node, none straight to Redis.
        swa = FleetSwaClient(client.pool, lambda: swa_records(client.view.nodes, placeable(client.view.nodes)),
                             retry=fast, run_blocks=RUN_BLOCKS, path="gateway")
        tokens = prompt(256)
        client.put(tokens, [random.randbytes(client.block_bytes) for _ in range(16)])  # on both replicas
        data = snapshot(client, 256)
        assert swa.put(tokens, data).stored == 1
        first = swa.node_id
        next(n for n in fleet.nodes if n.node_id == first).child.kill9()
        assert first in client.view.nodes  # the view still names it: the call itself must fall over
        assert bytes(swa.get(tokens)) == data and swa.node_id != first
        found = client.lookup(tokens, swa_positions=[256])
        assert (found.swa_position, found.swa_resume_tokens) == (256, 256)
        swa.close()
