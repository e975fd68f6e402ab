"""A fleet transfer session's `read` and `write` of descriptor batches (docs/FLEET.md F71), the copies a read did
not ask refreshed (F71a), and a region mapped again into this host's node once it restarts (F72).

One real etcd and three real `kvstore serve` nodes on loopback, module-scoped (runs of 4 blocks of 16 tokens, 60 s
leases: a killed node stays in the view). All three run on this host; a test names "this host's node" by the
session's `local`. The tests that kill a node run last.
"""

from __future__ import annotations

import os
import random
import signal
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstore.client.fleet import FleetClient
from kvstore.client.fleet_descriptors import RunDescriptor
from kvstore.client.fleet_transfer import FleetTransferSession
from kvstore.errors import InvalidArgument
from kvstore.transfer import Descriptor, Status
from tests.children import Child
from tests.kvstore.client.test_fleet import (
    BLOCK_TOKENS,
    RUN_BLOCKS,
    RUN_TOKENS,
    Fleet,
    _start_node,
    fleet_client,
    found_on,
    prompt,
    purge_from,
)
from tests.kvstore.client.test_fleet_transfer_shm import node_transfer
from tests.kvstore.fleet.etcd_process import EtcdProcess

RUNS = 5


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One etcd and three nodes, started at once; `tmp` kept on the fleet for a node started again (F72)."""
    tmp = tmp_path_factory.mktemp("fleet-descriptors")
    etcd = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    with ThreadPoolExecutor(3) as pool:
        nodes = list(pool.map(lambda i: _start_node(tmp, etcd.endpoint, cluster, i), range(3)))
    fleet = Fleet(address=f"etcd://{etcd.endpoint}/{cluster}", nodes=nodes)
    fleet.tmp = tmp  # type: ignore[attr-defined]
    try:
        yield fleet
    finally:
        for n in fleet.nodes:
            n.child.kill_if_alive()
        etcd.stop()


def stored(
    client: FleetClient, runs: int = RUNS, until: Callable[[list[bytes]], bool] = lambda chain: True
) -> tuple[list[int], list[bytes], list[bytes]]:
    """A prompt of `runs` runs put on the fleet, drawn until its chain satisfies `until`: its tokens, chain, blocks."""
    while not until(chain := client.hashes(tokens := prompt(RUN_TOKENS * runs))):
        pass
    payload = [random.randbytes(client.block_bytes) for _ in range(runs * RUN_BLOCKS)]
    client.put(tokens, payload)
    return tokens, chain, payload


def first_reader(
    client: FleetClient, session: FleetTransferSession, chain: list[bytes], block: int, region_id: int
) -> str:
    """The node a session asks first for block `block`'s run."""
    return session.order_of(chain[block - block % RUN_BLOCKS], {region_id})[0]


def test_f71_a_fleet_read_sends_each_runs_descriptors_to_its_replicas(fleet: Fleet) -> None:
    """F71: descriptors of a slice from inside a run, at an offset, land every byte, each run's blocks read from the
    first node of its read order only; with `prefix_only` the blocks past the stored chain are MISSING then
    SKIPPED; a plain `Descriptor` is refused naming what to use."""
    with fleet_client(fleet) as client:
        tokens, chain, payload = stored(client)
        size = client.block_bytes
        with client.transfer(path="stream") as session:
            region = session.register(30 * size)
            descriptors = session.descriptors(chain, region, first_block=3, end_block=18, offset_bytes=size)
            assert [d.run_key for d in descriptors[:1]] == [chain[0]] and descriptors[1].run_key == chain[4]
            state = session.read(descriptors).wait()
            assert state.done_prefix == 15 and state.bytes_moved == 15 * size
            assert bytes(region.view[size : 16 * size]) == b"".join(payload[3:18])
            expected: dict[str, int] = {}
            for b in range(3, 18):
                node = first_reader(client, session, chain, b, region.region_id)
                expected[node] = expected.get(node, 0) + 1
            assert dict(session.blocks_read) == {(n, "stream"): k for n, k in expected.items()}
            # Past the stored chain: the first block not stored MISSING, the rest SKIPPED with prefix_only.
            longer = client.hashes(tokens + prompt(RUN_TOKENS))
            tail = session.descriptors(longer, region, first_block=18, end_block=24)
            got = session.read(tail, prefix_only=True).wait()
            assert [r.status for r in got.results] == [Status.DONE] * 2 + [Status.MISSING] + [Status.SKIPPED] * 3
            every = session.wait_all([session.read(tail)])[0]
            assert [r.status for r in every.results] == [Status.DONE] * 2 + [Status.MISSING] * 4
            plain = Descriptor(block_hash=chain[0], region_id=region.region_id, offset_bytes=0, length_bytes=size)
            with pytest.raises(InvalidArgument, match="not a RunDescriptor") as refused:
                session.read([plain])  # type: ignore[list-item]
            assert "session.descriptors(chain, region)" in refused.value.hint
            with pytest.raises(InvalidArgument, match="run_key must be the 32-byte fleet hash"):
                RunDescriptor(
                    block_hash=chain[0], run_key=b"short", region_id=region.region_id, offset_bytes=0, length_bytes=size
                )
            stray = RunDescriptor(
                block_hash=chain[0], run_key=chain[0], run_depth=1, region_id=12345, offset_bytes=0, length_bytes=size
            )
            bad = session.read([stray]).wait().results[0]
            assert (bad.status, bad.code) == (Status.FAILED, "INVALID_ARGUMENT") and "12345" in bad.reason


def test_f71_a_block_a_replica_lacks_is_read_from_the_next(fleet: Fleet) -> None:
    """F71: a run's tail purged on the node its read order names first: those descriptors are asked of the other
    replica, the rest not asked twice; on this host's shared-memory mapping as on the stream."""
    with fleet_client(fleet) as client:
        _, chain, payload = stored(client)
        size = client.block_bytes
        run = client.placement(chain)[2]
        for path, local in (("stream", None), ("auto", run.replicas)):
            with FleetTransferSession(client, path=path, local=local) as session:
                region = session.register(len(payload) * size)
                first = first_reader(client, session, chain, run.first_block, region.region_id)
                if path == "stream":
                    purge_from(fleet.node(first), chain[run.first_block + 1])  # blocks 1-3 of the run
                descriptors = session.descriptors(chain, region, first_block=run.first_block, end_block=run.end_block)
                state = session.read(descriptors).wait()
                assert state.done_prefix == RUN_BLOCKS
                assert bytes(region.view[: RUN_BLOCKS * size]) == b"".join(payload[run.first_block : run.end_block])
                kind = "stream" if path == "stream" else "shm"  # auto: this host's both replicas map the region
                other = next(n for n in run.replicas if n != first)
                assert session.blocks_read == {(first, kind): 1, (other, kind): 3}


def test_f71_a_fleet_write_stores_every_block_on_its_runs_replicas(fleet: Fleet) -> None:
    """F71: a write of descriptors stores the blocks from the region on exactly each run's replicas (F30), answers
    their fleet hashes, and a write past a gap in the prefix is FAILED with FAILED_PRECONDITION, nothing stored."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 3)
        size = client.block_bytes
        payload = [random.randbytes(size) for _ in range(3 * RUN_BLOCKS)]
        with client.transfer() as session:
            region = session.register(len(payload) * size)
            region.view[:] = b"".join(payload)
            descriptors = [
                Descriptor(region_id=region.region_id, offset_bytes=i * size, length_bytes=size)
                for i in range(len(payload))
            ]
            state = session.write(tokens, descriptors).wait()
            chain = client.hashes(tokens)
            assert state.done_prefix == len(payload)
            assert [r.block_hash for r in state.results] == chain
            for run in client.placement(chain):
                held = {
                    n.node_id: found_on(n.child.target, chain[run.first_block : run.end_block]) for n in fleet.nodes
                }
                assert held == {n: RUN_BLOCKS if n in run.replicas else 0 for n in held}
            assert client.get(tokens).blocks == payload
            gap = prompt(RUN_TOKENS * 3)
            refused = session.write(gap, descriptors[:4], first_block=4).wait().results
            assert {(r.status, r.code) for r in refused} == {(Status.FAILED, "FAILED_PRECONDITION")}
            assert client.lookup(gap).found_blocks == 0
            with pytest.raises(InvalidArgument, match="need 80 tokens"):
                session.write(tokens[:70], descriptors[:1], first_block=4)


def test_f71a_a_descriptor_read_refreshes_the_copies_it_did_not_ask(fleet: Fleet) -> None:
    """F71a: a read of descriptors is a use of every copy (F34): each run's replica it did not read is refreshed in
    the background to the deepest block read, from inside a run (run 0 from its block 2: an anchored Lookup of that
    block at its depth) as from a run's first block (a Lookup of the run's hashes); the nodes read are not asked;
    within the minute the same refreshes are not sent again."""
    with fleet_client(fleet) as client:
        _, chain, payload = stored(client)
        size = client.block_bytes
        with client.transfer(path="stream") as session:
            region = session.register(8 * size)
            descriptors = session.descriptors(chain, region, first_block=2, end_block=10)  # runs 0 (from 2), 1, 2 (2)
            assert [d.run_depth for d in descriptors] == [3, 4, 1, 2, 3, 4, 1, 2]
            assert client.refresher.flush(30.0)
            before, sent = client.node_stats(), client.refresher.sent
            state = session.read(descriptors).wait()
            assert state.done_prefix == 8 and bytes(region.view) == b"".join(payload[2:10])
            assert client.refresher.flush(30.0)
            after = client.node_stats()
            lookups = {n: 0 for n in before}
            found = {n: 0 for n in before}
            for r, depth in ((0, 4), (1, 4), (2, 2)):
                run = client.placement(chain)[r]
                first = first_reader(client, session, chain, run.first_block, region.region_id)
                [other] = [n for n in run.replicas if n != first]
                lookups[other] += 1
                found[other] += depth * BLOCK_TOKENS  # found at its depth: the deepest block read, refreshed (R5)
            assert client.refresher.sent == sent + 3
            assert {n: after[n].lookups - before[n].lookups for n in before} == lookups
            assert {n: after[n].lookup_tokens_found - before[n].lookup_tokens_found for n in before} == found
            skipped = client.refresher.skipped
            assert session.read(descriptors).wait().done_prefix == 8
            assert client.refresher.flush(30.0)
            assert client.refresher.skipped == skipped + 3 and client.refresher.sent == sent + 3
            inside = dict(
                block_hash=chain[2], run_key=chain[0], region_id=region.region_id, offset_bytes=0, length_bytes=size
            )
            with pytest.raises(InvalidArgument, match="run_depth must be an int of at least 1"):
                RunDescriptor(**inside)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="run_depth is 1 but block_hash is not run_key"):
                RunDescriptor(**inside, run_depth=1)  # type: ignore[arg-type]
            deep = session.read([RunDescriptor(**inside, run_depth=RUN_BLOCKS + 1)]).wait().results[0]  # type: ignore[arg-type]
            assert (deep.status, deep.code) == (
                Status.FAILED,
                "INVALID_ARGUMENT",
            ) and "runs are 4 blocks" in deep.reason


def test_f71_a_killed_node_during_a_sessions_reads_falls_over_to_the_replica(fleet: Fleet) -> None:
    """F71 (kills a node): a session that has read from a node; the node stopped (SIGSTOP), a read sent, the node
    SIGKILLed while that read waits on it (still in the view): the read is every byte, the victim's runs from their
    other replicas; the next read too."""
    victim = fleet.nodes[0]
    with fleet_client(fleet) as client:

        def read_first(chain: list[bytes]) -> bool:  # some run is read from the victim first
            order = client.pool.read_order
            return any(order(chain[r.first_block], r.replicas)[0] == victim.node_id for r in client.placement(chain))

        _, chain, payload = stored(client, runs=8, until=read_first)
        size = client.block_bytes
        with client.transfer(path="stream") as session:
            region = session.register(len(payload) * size)
            descriptors = session.descriptors(chain, region)
            assert session.read(descriptors).wait().done_prefix == len(payload)
            assert session.blocks_read[victim.node_id, "stream"] > 0
            region.view[:] = bytes(len(region.view))
            os.kill(victim.child.proc.pid, signal.SIGSTOP)  # its reads hang until it is killed
            pending = session.read(descriptors)
            victim.child.kill9()
            state = pending.wait()
            assert state.done_prefix == len(payload) and bytes(region.view) == b"".join(payload)
            assert client.pool.failures[victim.node_id] >= 1
            region.view[:] = bytes(len(region.view))
            assert session.read(descriptors).wait().done_prefix == len(payload)
            assert bytes(region.view) == b"".join(payload)
        restart(fleet, 0, client)  # for the next test, which kills another


def restart(fleet: Fleet, i: int, client: FleetClient) -> None:
    """Start node `i` again on its data dir (a new port; F2: it takes its record over at once) and wait until the
    client's view holds its new record."""
    tmp: Path = fleet.tmp  # type: ignore[attr-defined]
    node = fleet.nodes[i]
    old = client.view.nodes[node.node_id].started_at
    node.child.kill_if_alive()
    node.child = Child(f"node{i}", ["serve", "--config", str(tmp / f"node{i}.toml"), "--port", "0"], tmp / "logs")
    client.view.wait_until(lambda nodes: node.node_id in nodes and nodes[node.node_id].started_at != old, 30.0)


def test_f72_a_region_is_mapped_again_into_this_hosts_node_once_it_restarts(fleet: Fleet) -> None:
    """F72 (kills a node): the region mapped into this host's node, its runs over shm; the node SIGKILLed (its runs
    stream, F64); started again on its data dir, the next fetch maps the region into it again (once) and reads its
    runs over shm, every byte, the bytes the nonce passed over kept; a read of descriptors too."""
    local = fleet.nodes[1]
    with fleet_client(fleet) as client:
        _, chain, payload = stored(
            client,
            runs=6,
            until=lambda chain: 0 < sum(local.node_id in r.replicas for r in client.placement(chain)) < 6,
        )
        mine = [local.node_id in r.replicas for r in client.placement(chain)]
        size = client.block_bytes
        marker = random.randbytes(size)  # slot 0: what the application keeps at the region's start
        with FleetTransferSession(client, local=[local.node_id]) as session:
            region = session.register((len(payload) + 1) * size)
            region.view[:size] = marker
            assert session.fetch(chain, region, offset_bytes=size).done_prefix == len(payload)
            assert session.last_paths == ["shm" if m else "stream" for m in mine]
            local.child.kill9()
            assert session.fetch(chain, region, offset_bytes=size).done_prefix == len(payload)
            assert session.last_paths == ["stream"] * len(mine) and session.shared_with(region) == []
            restart(fleet, 1, client)
            state = session.fetch(chain, region, offset_bytes=size)
            assert state.done_prefix == len(payload) and bytes(region.view[size:]) == b"".join(payload)
            assert session.shared_with(region) == [local.node_id] and bytes(region.view[:size]) == marker
            assert session.last_paths == ["shm" if m else "stream" for m in mine]
            region.view[size:] = bytes(len(payload) * size)
            descriptors = session.descriptors(chain, region, offset_bytes=size)
            assert session.read(descriptors).wait().done_prefix == len(payload)
            assert bytes(region.view[size:]) == b"".join(payload)
            assert node_transfer(fleet, local.node_id)[0] == 1  # mapped once into the new process, not per fetch
