"""The same-host paths over a fleet (docs/FLEET.md F62-F64): a fleet transfer session's regions mapped into this
host's nodes, the runs they hold copied by them over shared memory, the rest streamed; `restore`'s shm path per
run; failover when this host's node is killed.

One real etcd and three real `kvstore serve` nodes on loopback, module-scoped. All three run on this host, so a
test names "this host's node" as F48's tests do, by one node (the session's `local`, or a `ColocatedReader` of its
data dir for `restore`); left to the records, every node is this host's. The test that kills a node runs last.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvstore.client.colocated import ColocatedReader
from kvstore.client.fleet import FleetClient
from kvstore.client.fleet_local import local_nodes, on_this_host
from kvstore.client.fleet_transfer import FleetTransferSession
from kvstore.client.restore import restore
from kvstore.client.store import Client
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.fleet.membership import NodeRecord
from kvstore.prefix_hosts import host_id, host_name
from tests.kvstore.client.test_fleet import RUN_TOKENS, Fleet, _start_node, fleet_client, prompt
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until

RUNS = 6


@dataclass
class ShmFleet(Fleet):
    """The module's fleet, with each node's data dir (for a `ColocatedReader` naming it: F48)."""

    data_dirs: dict[str, Path] = field(default_factory=dict)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShmFleet]:
    """One etcd and three nodes, started at once (runs of 4 blocks of 16 tokens, 60 s leases)."""
    tmp = tmp_path_factory.mktemp("fleet-shm")
    etcd = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    with ThreadPoolExecutor(3) as pool:
        nodes = list(pool.map(lambda i: _start_node(tmp, etcd.endpoint, cluster, i), range(3)))
    try:
        yield ShmFleet(address=f"etcd://{etcd.endpoint}/{cluster}", nodes=nodes,
                       data_dirs={n.node_id: tmp / f"store{i}" for i, n in enumerate(nodes)})
    finally:
        for n in nodes:
            n.child.kill_if_alive()
        etcd.stop()


def mixed_prompt(client: FleetClient, local: str) -> tuple[list[int], list[bytes], list[bool]]:
    """A stored prompt of RUNS runs, some held by `local` and some not, and one of those whose read order (F33)
    names another replica first (so only F62's order reads it from `local`); its blocks and which runs `local`
    holds."""
    while True:
        tokens = prompt(RUN_TOKENS * RUNS)
        chain = client.hashes(tokens)
        runs = client.placement(chain)
        mine = [local in r.replicas for r in runs]
        second = [m and client.pool.read_order(chain[r.first_block], r.replicas)[0] != local
                  for m, r in zip(mine, runs, strict=True)]
        if 2 <= sum(mine) < RUNS and any(second):
            break
    payload = [random.randbytes(client.block_bytes) for _ in range(len(tokens) // RUN_TOKENS * 4)]
    client.put(tokens, payload)
    return tokens, payload, mine


def node_transfer(fleet: Fleet, node_id: str) -> tuple[int, int, int]:
    """(regions mapped now, descriptors done, read batches since start) of one node's transfer service."""
    with Client(fleet.node(node_id).child.target) as c:
        stats = c.transfer_stats()
        return stats.regions, stats.descriptors_done, stats.read_batches


def record(host: str, boot: str) -> NodeRecord:
    return NodeRecord(node_id=f"{host}-{boot}", address="a:1", host=host, capacity_bytes=1, started_at=0.0,
                      version="0", host_id=boot)


def test_f62_this_hosts_nodes_are_told_by_boot_id_else_by_name() -> None:
    """F62: a record's boot id decides where both have one (a container's name differs, its kernel does not)."""
    here, elsewhere = record("other-name", host_id()), record(host_name(), "another-boot-id")
    assert on_this_host(here) and not on_this_host(elsewhere)
    assert on_this_host(record(host_name(), "")) and not on_this_host(record("other-name", ""))
    nodes = {"a": here, "b": elsewhere, "c": record(host_name(), "")}
    assert local_nodes(nodes) == ("a", "c")
    assert local_nodes(nodes, only=["b", "gone"]) == ("b",)  # named outright (a reader's node): taken when live


def test_f62_a_fleet_session_reads_this_hosts_nodes_runs_over_shm_and_streams_the_rest(fleet: ShmFleet) -> None:
    """F62: the region is mapped by this host's node only; each run it holds is copied by it into the region
    (counted by the node), every other run streamed from its replicas; every byte in its slot."""
    local = fleet.nodes[0].node_id
    with fleet_client(fleet) as client:
        tokens, payload, mine = mixed_prompt(client, local)
        chain, size = client.hashes(tokens), client.block_bytes
        before = {n.node_id: node_transfer(fleet, n.node_id) for n in fleet.nodes}
        with FleetTransferSession(client, local=[local]) as session:
            region = session.register((len(payload) + 1) * size)
            assert session.shared_with(region) == [local]
            mapped = {n.node_id: node_transfer(fleet, n.node_id)[0] - before[n.node_id][0] for n in fleet.nodes}
            assert mapped == {n.node_id: int(n.node_id == local) for n in fleet.nodes}
            state = session.fetch(chain, region, offset_bytes=size)
            assert state.done_prefix == len(payload)
            assert bytes(region.view[size:(len(payload) + 1) * size]) == b"".join(payload)
            # Every run this host's node holds went over shared memory, from it; the others were streamed.
            assert session.last_paths == ["shm" if m else "stream" for m in mine]
            blocks_here = 4 * sum(mine)
            assert session.blocks_read[local, "shm"] == blocks_here
            assert sum(v for (_, p), v in session.blocks_read.items() if p == "stream") == len(payload) - blocks_here
            after = node_transfer(fleet, local)
            assert after[1] - before[local][1] == blocks_here  # the node copied them
            assert after[2] - before[local][2] == 1  # all its runs in one batch (one group each)
        # Unmapped with the session: the node sees its event stream cancelled, after close returns.
        wait_until(lambda: node_transfer(fleet, local)[0] == before[local][0], "the node unmapped the session's region")
        # Left to the records, every node is this host's (all run here): every run over shared memory.
        with FleetTransferSession(client, path="shm") as session:
            region = session.register(len(payload) * size)
            assert session.shared_with(region) == sorted(n.node_id for n in fleet.nodes)
            assert session.fetch(chain, region).done_prefix == len(payload)
            assert bytes(region.view) == b"".join(payload) and session.last_paths == ["shm"] * RUNS
        with client.transfer(path="stream") as session:  # the fleet client's own: nothing mapped
            region = session.register(len(payload) * size)
            assert session.shared_with(region) == []
            assert session.fetch(chain, region).done_prefix == len(payload) and set(session.last_paths) == {"stream"}


def test_f62_shm_with_no_node_of_this_host_is_refused(fleet: ShmFleet) -> None:
    """F62: path "shm" and no node here to map the region: FAILED_PRECONDITION naming what works; "auto" streams."""
    with fleet_client(fleet) as client:
        with FleetTransferSession(client, path="shm", local=[]) as session, \
                pytest.raises(FailedPrecondition, match="on this host maps this process's regions") as refused:
            session.register(client.block_bytes)
        assert 'path="auto"' in refused.value.hint
        with FleetTransferSession(client, local=[]) as session:
            assert session.shared_with(session.register(client.block_bytes)) == []
        with client.transfer(path="bulk") as session:  # F74: maps nothing; these nodes run no bulk transport
            assert session.shared_with(session.register(client.block_bytes)) == []
        with pytest.raises(InvalidArgument, match="local must be a collection of node ids"):
            FleetTransferSession(client, local="node")


def test_f63_restore_shm_per_run_over_a_fleet(fleet: ShmFleet) -> None:
    """F63: `restore(path="shm")` with the reader of one node (this host's, as F48 decides): that node's runs over
    shared memory, the rest streamed; "auto" without a reader takes shm from every node here (all are)."""
    local = fleet.nodes[1]
    with fleet_client(fleet) as client:
        tokens, payload, mine = mixed_prompt(client, local.node_id)
        before = node_transfer(fleet, local.node_id)[1]
        with ColocatedReader(fleet.data_dirs[local.node_id]) as reader:
            dest = bytearray(len(payload) * client.block_bytes)
            result = restore(client, tokens, dest, path="shm", reader=reader)
        assert (result.path, result.blocks, result.corrupt) == ("shm", len(payload), [])
        said = f"{sum(mine)} of {RUNS} runs over shared memory from this host's node(s) {local.node_id}"
        assert said in result.reason
        assert bytes(dest) == b"".join(payload)
        assert node_transfer(fleet, local.node_id)[1] - before == 4 * sum(mine)
        dest = bytearray(len(dest))
        auto = restore(client, tokens, dest)
        assert (auto.path, auto.blocks) == ("shm", len(payload)) and f"{RUNS} of {RUNS} runs" in auto.reason
        assert bytes(dest) == b"".join(payload)
        streamed = restore(client, tokens, dest := bytearray(len(dest)), path="grpc")
        assert streamed.path == "grpc" and bytes(dest) == b"".join(payload)


def test_f64_this_hosts_node_killed_its_runs_stream_from_the_other_replicas(fleet: ShmFleet) -> None:
    """F64 (runs last: kills a node): a session whose region this host's node maps; the node SIGKILLed, the next
    fetch reads its runs from their other replicas over the stream, every byte, and the region is no longer
    counted as mapped there; a restore forced onto shm with its reader streams every run."""
    local = fleet.nodes[2]
    with fleet_client(fleet) as client:
        tokens, payload, mine = mixed_prompt(client, local.node_id)
        chain, size = client.hashes(tokens), client.block_bytes
        with FleetTransferSession(client, local=[local.node_id]) as session, \
                ColocatedReader(fleet.data_dirs[local.node_id]) as reader:
            region = session.register(len(payload) * size)
            assert session.fetch(chain, region).done_prefix == len(payload)
            assert session.last_paths == ["shm" if m else "stream" for m in mine]
            local.child.kill9()
            region.view[:] = bytes(len(region.view))
            state = session.fetch(chain, region)
            assert state.done_prefix == len(payload) and bytes(region.view) == b"".join(payload)
            assert session.last_paths == ["stream"] * RUNS and session.shared_with(region) == []
            assert client.pool.failures[local.node_id] >= 1
            dest = bytearray(len(payload) * size)
            forced = restore(client, tokens, dest, path="shm", reader=reader)  # its node still in the view
            assert forced.blocks == len(payload) and bytes(dest) == b"".join(payload)
            assert forced.path == "grpc" and f"{local.node_id}: unavailable" in forced.reason
