"""The fleet client's data path against real processes on loopback: one etcd, three `kvstore serve` nodes
(docs/FLEET.md, "Data path").

The nodes are module-scoped (starting three servers costs seconds); each test writes prompts of its own
(random tokens), so no test sees another's blocks. The test that kills a node runs last and leaves two.
Runs are 4 blocks of 16 tokens, so a prompt of a few hundred tokens spans many runs.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import kvstore
from kvstore.bench.redis_server import free_port
from kvstore.cli import main
from kvstore.client.admin import AdminClient
from kvstore.client.connection import Connection
from kvstore.client.fleet import FleetClient, FleetLookupResult
from kvstore.client.fleet_chain import fleet_hashes, run_extra_keys
from kvstore.client.fleet_cover import cover_runs
from kvstore.client.fleet_lookup import FoundChains
from kvstore.client.retry import ExponentialBackoff, Retry
from kvstore.client.store import LookupResult
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, PutNotReplicated, Unavailable
from kvstore.fleet.placement import RunPlacement
from kvstore.v1 import kvstore_pb2 as pb
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until
from tiers import datadir

BLOCK_TOKENS = 16
RUN_BLOCKS = 4
RUN_TOKENS = BLOCK_TOKENS * RUN_BLOCKS
#: Long enough that a killed node stays in the view for the rest of the module: its replicas must fail over.
LEASE_TTL_S = 60


@dataclass
class Node:
    """One `kvstore serve` of the fleet."""

    node_id: str
    child: Child


@dataclass
class Fleet:
    """The module's fleet."""

    address: str
    nodes: list[Node]

    def node(self, node_id: str) -> Node:
        return next(n for n in self.nodes if n.node_id == node_id)


def _start_node(tmp: Path, etcd: str, cluster: str, i: int) -> Node:
    cfg = write_config(tmp / f"node{i}.toml", {
        "store": {"data_dir": str(tmp / f"store{i}"), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
        "fleet": {"etcd": etcd, "cluster": cluster, "lease_ttl_s": LEASE_TTL_S, "run_blocks": RUN_BLOCKS},
    })
    child = Child(f"node{i}", ["serve", "--config", str(cfg), "--port", "0"], tmp / "logs")
    return Node(node_id=datadir.node_id(tmp / f"store{i}"), child=child)


@contextmanager
def started_fleet(tmp: Path, count: int) -> Iterator[Fleet]:
    """One etcd and `count` nodes under `tmp`, started at once; every process stopped on exit."""
    etcd = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    with ThreadPoolExecutor(count) as pool:
        nodes = list(pool.map(lambda i: _start_node(tmp, etcd.endpoint, cluster, i), range(count)))
    try:
        yield Fleet(address=f"etcd://{etcd.endpoint}/{cluster}", nodes=nodes)
    finally:
        for n in nodes:
            n.child.kill_if_alive()
        etcd.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One etcd and three nodes, started at once."""
    with started_fleet(tmp_path_factory.mktemp("fleet"), 3) as three:
        yield three


def fleet_client(fleet: Fleet, **kwargs: object) -> FleetClient:
    """A fleet client that sees every live node (the view is read at start; a node registers once it serves)."""
    client = kvstore.Client(fleet.address, **kwargs)  # type: ignore[arg-type]
    assert isinstance(client, FleetClient)
    live = {n.node_id for n in fleet.nodes if n.child.alive}
    client.view.wait_until(lambda nodes: live <= set(nodes), 30.0)
    return client


def prompt(n_tokens: int) -> list[int]:
    return [random.randrange(50_000) for _ in range(n_tokens)]


def blocks_for(client: FleetClient, tokens: list[int], first_block: int = 0) -> list[bytes]:
    n = len(tokens) // BLOCK_TOKENS
    return [random.randbytes(client.block_bytes) for _ in range(n - first_block)]


def second_run_stored(client: FleetClient) -> tuple[list[bytes], RunPlacement, Connection]:
    """A prompt of three runs put through the fleet: its chain, its second run's placement, and a connection to that
    run's first replica (what the node-level Lookup tests ask)."""
    tokens = prompt(RUN_TOKENS * 3)
    client.put(tokens, blocks_for(client, tokens))
    chain = client.hashes(tokens)
    run = client.placement(chain)[1]
    return chain, run, client.pool.connection(run.replicas[0])


def found_on(target: str, run_hashes: list[bytes]) -> int:
    """Leading blocks of a run one node holds, asked of that node directly."""
    with kvstore.Client(target) as direct:
        return direct.lookup_hashes(run_hashes).found_blocks


def test_a_fleet_address_makes_a_fleet_client_and_host_port_stays_one_server(fleet: Fleet) -> None:
    with fleet_client(fleet) as client:
        assert client.run_blocks == RUN_BLOCKS and client.block_tokens == BLOCK_TOKENS
        assert set(client.view.nodes) == {n.node_id for n in fleet.nodes}
    with kvstore.Client(fleet.nodes[0].child.target) as single:
        assert type(single) is kvstore.Client
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable, match=f"etcd does not answer at {dead}") as refused:
        kvstore.Client(f"etcd://{dead}/x")
    assert "etcd:// address" in refused.value.hint
    with pytest.raises(Unavailable, match="no node of fleet 'nobody' has joined"):
        kvstore.Client(fleet.address.rsplit("/", 1)[0] + "/nobody")


def test_f30_puts_land_on_exactly_the_replicas_each_run_names(fleet: Fleet) -> None:
    """F29, F30: each run on its k replicas and nowhere else (every node asked directly), run r > 0 too."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 9 + 2 * BLOCK_TOKENS + 5)  # 9 full runs, a short last one, a partial block
        payload = blocks_for(client, tokens)
        acked: list[int] = []
        result = client.put(tokens, payload, on_batch=acked.append)
        chain = client.hashes(tokens)
        assert result.block_hashes == chain and result.written_blocks == len(chain) == 38
        assert acked == [4] * 9 + [2]
        placement = client.placement(chain)
        assert all(len(run.replicas) == 2 for run in placement)
        for run in placement:
            run_hashes = chain[run.first_block:run.end_block]
            for node in fleet.nodes:
                want = len(run_hashes) if node.node_id in run.replicas else 0
                assert found_on(node.child.target, run_hashes) == want, (run.run, node.node_id)
        assert client.get(tokens).blocks == payload
        again = client.put(tokens, payload)  # idempotent: every copy already stored
        assert (again.written_blocks, again.existing_blocks) == (0, 38)
        with pytest.raises(InvalidArgument, match="parent is not the fleet hash of block 3"):
            client.put(tokens, payload[4:], first_block=4, parent=chain[2])
    with fleet_client(fleet, replication=1) as single_copy:
        tokens = prompt(RUN_TOKENS * 3)
        single_copy.put(tokens, blocks_for(single_copy, tokens))
        chain = single_copy.hashes(tokens)
        for run in single_copy.placement(chain):
            held = [found_on(n.child.target, chain[run.first_block:run.end_block]) for n in fleet.nodes]
            assert sorted(held) == [0, 0, 4] and run.replicas == (fleet.nodes[held.index(4)].node_id,)


def leased_round(client: FleetClient, chain: list[bytes]) -> dict[int, str]:
    """The node a leased Lookup of `chain` asks each run of in its first round (F82's cover of the read orders)."""
    return dict(cover_runs(client.pool, client.placement(chain), chain))


def purge_from(node: Node, block_hash: bytes) -> None:
    """Drop a block and the rest of its run on one node (a purge takes the block's descendants with it)."""
    with AdminClient(node.child.target) as admin:
        assert admin.purge("default", block_hashes=[block_hash]) >= 1


def lookups_by_node(client: FleetClient) -> dict[str, int]:
    """Lookup calls each node answered (its hit counters count calls; its store's `lookups`, runs)."""
    return {k: next(w.counts.lookups for w in s.windows if w.window == "start")
            for k, s in client.node_stats().items()}


def calls_of(client: FleetClient, lookup: Callable[[], LookupResult]) -> tuple[Any, int]:
    """A lookup's result and the Lookup calls it made (every node's counter, less the refreshes it queued)."""
    found, by_node = calls_by_node(client, lookup)
    return found, sum(by_node.values())


def calls_by_node(client: FleetClient, lookup: Callable[[], LookupResult]) -> tuple[Any, dict[str, int]]:
    """A lookup's result and the Lookup calls it made of each node (the refreshes it queued left out)."""
    assert client.refresher.flush(30.0)
    before = lookups_by_node(client)
    refresher = client.refresher
    one, many = refresher.add, refresher.add_many
    refresher.add = refresher.add_many = lambda *a, **k: None  # type: ignore[method-assign, assignment]
    try:
        found = lookup()
    finally:
        refresher.add, refresher.add_many = one, many  # type: ignore[method-assign]
    after = lookups_by_node(client)
    return found, {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_f31_a_lookup_over_many_runs_finds_it_all_asking_a_few_nodes(fleet: Fleet) -> None:
    """F31, F50: the last run first (a prompt sent again: one call); else one call per node for all its runs,
    then the boundary run's other replica."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 20)
        client.put(tokens, blocks_for(client, tokens))
        found, calls = calls_of(client, lambda: client.lookup(tokens))
        assert found.found_blocks == 80 and found.found_tokens == len(tokens)
        assert calls == 1 and len(found.nodes_asked) == 1  # a prompt sent again: its last run, on one node
        client.lookup(tokens)
        assert client.refresher.flush(30.0)
        assert client.refresher.sent == 39  # every other copy of the 20 runs, off the read path (F34)

        longer = tokens + prompt(RUN_TOKENS * 2)  # two more runs, never stored
        found, by_node = calls_by_node(client, lambda: client.lookup(longer))
        assert found.found_blocks == 80
        # The last run's probe, one call per node for every copy of the 22 runs by their last blocks (F76, F77),
        # then the boundary run by its hashes of its replicas and the node ranked next after them (F42).
        assert sum(by_node.values()) <= 1 + 3 + 3 and max(by_node.values()) <= 3
        for cut in (7 * RUN_TOKENS + 3 * BLOCK_TOKENS, 3 * BLOCK_TOKENS, RUN_TOKENS, 19 * RUN_TOKENS + 1):
            cut_prompt = tokens[:cut] + prompt(2 * RUN_TOKENS)
            found, calls = calls_of(client, lambda p=cut_prompt: client.lookup(p))  # type: ignore[misc]
            assert found.found_blocks == cut // BLOCK_TOKENS, cut  # ends inside a run, or at a run's end
            assert calls <= 1 + 3 + 3


def test_f50_a_leased_lookup_asks_each_node_once_for_all_its_runs(fleet: Fleet) -> None:
    """F50: 30 runs leased in one call per node (at most the 3 nodes), each run's lease on the node that found it;
    a run falling short on the replica the round asked (F82) is asked of the other."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 30)
        client.put(tokens, blocks_for(client, tokens))
        found, by_node = calls_by_node(client, lambda: client.lookup(tokens, lease_ms=60_000))
        assert found.found_blocks == 120 and found.lease_id is not None
        assert len(by_node) <= 3 and set(by_node.values()) == {1}  # one call per node, not one per run
        assert sum(s.active_leases for s in client.node_stats().values()) == len(by_node)  # F77: one a node
        assert client.release(found.lease_id)
        # Run 12's tail purged on the replica the round asks it of: that node answers it short, the other
        # replica is asked, and the prefix goes on past it (R6 within the run on each node; across, the client).
        chain = client.hashes(tokens)
        asked = leased_round(client, chain)[12]
        with kvstore.Client(fleet.node(asked).child.target) as direct:
            assert direct.lookup_hashes(chain[48:52]).found_blocks == 4
        purge_from(fleet.node(asked), chain[50])
        found, by_node = calls_by_node(client, lambda: client.lookup(tokens, lease_ms=60_000))
        assert found.found_blocks == 120
        # the round, then run 12 of every node of its order (F77: the one the round asked again, by its hashes)
        assert sum(by_node.values()) <= 3 + 3
        assert client.release(found.lease_id)


def test_f50_a_run_missing_on_every_replica_ends_the_prefix_there(fleet: Fleet) -> None:
    """F50, F31: with later runs complete, a run no replica holds in full ends the prefix at its found blocks,
    without a lease too, once the last run is not complete (the round checks every run)."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 8)
        client.put(tokens, blocks_for(client, tokens))
        chain = client.hashes(tokens)
        placement = client.placement(chain)
        for node in placement[3].replicas:  # run 3 loses its last 2 blocks everywhere (past retention, say)
            purge_from(fleet.node(node), chain[14])
        longer = tokens + prompt(RUN_TOKENS)  # its last run never stored: every run is asked
        assert client.lookup(longer).found_blocks == 14
        leased = client.lookup(longer, lease_ms=60_000)
        assert leased.found_blocks == 14 and leased.lease_id is not None
        assert client.release(leased.lease_id)


def test_f50_a_node_answers_each_run_of_a_multi_run_lookup_and_names_bad_lengths(fleet: Fleet) -> None:
    """F50: a node looks up each run of run_lengths as its own chain (R6, R15 within it), and refuses lengths that
    do not cut the hashes, or run_lengths beside what it cannot be combined with, INVALID_ARGUMENT naming them."""
    with fleet_client(fleet) as client:
        chain, _, node = second_run_stored(client)
        hashes = chain[4:8] + chain[4:6] + chain[6:8] + [bytes(32)]  # run 1; its head; its tail alone; junk
        reply = node.call(node.kvstore.Lookup, pb.LookupRequest(block_hashes_packed=b"".join(hashes),
                                                                run_lengths=[4, 2, 2, 1], lease_ms=60_000))
        assert list(reply.run_found_blocks) == [4, 2, 0, 0] and reply.found_blocks == 6 and not reply.lease_id
        assert [bool(lease) for lease in reply.run_lease_ids] == [True, True, False, False]
        for lease in reply.run_lease_ids[:2]:
            assert node.call(node.kvstore.Release, pb.ReleaseRequest(lease_id=lease)).released
        with pytest.raises(InvalidArgument, match="run_lengths must be runs of at least 1 block summing to the 4"):
            node.call(node.kvstore.Lookup, pb.LookupRequest(block_hashes_packed=b"".join(chain[4:8]),
                                                            run_lengths=[2, 3]))
        with pytest.raises(InvalidArgument, match="run_lengths cannot be combined with keep_until_s"):
            node.call(node.kvstore.Lookup, pb.LookupRequest(block_hashes_packed=b"".join(chain[4:8]),
                                                            run_lengths=[4], keep_until_s=1e10))


def test_f30_f31_a_put_never_strands_a_run_and_a_stranded_one_ends_the_prefix(fleet: Fleet) -> None:
    """F30: a Put from a run's first block needs the run before it; F31, F32: a run stored with the run before
    it missing everywhere (only eviction past retention can do that) ends a leased Lookup and a Get there."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 6)
        payload = blocks_for(client, tokens)
        client.put(tokens[:RUN_TOKENS * 2], payload[:8])  # runs 0-1
        chain = client.hashes(tokens)
        placement = client.placement(chain)
        with pytest.raises(FailedPrecondition, match=r"block 11 .* is not stored on any replica"):
            client.put(tokens, payload[12:], first_block=12)  # run 2 is stored nowhere
        assert all(found_on(n.child.target, chain[12:16]) == 0 for n in fleet.nodes)  # nothing stored
        client.put(tokens[:RUN_TOKENS * 2 + 16], payload[8:9], first_block=8)  # mid-run: the node checks it
        for run in placement[3:]:  # strand runs 3-5: put them on their nodes directly, as the fleet would
            keys = run_extra_keys([], chain[run.first_block - 1])
            for node in run.replicas:
                with kvstore.Client(fleet.node(node).child.target) as direct:
                    direct.put(tokens[run.first_block * BLOCK_TOKENS:run.end_block * BLOCK_TOKENS],
                               payload[run.first_block:run.end_block], extra_keys=keys)
        leased = client.lookup(tokens, lease_ms=60_000)  # every run asked: the prefix ends at run 2
        assert leased.found_blocks == 9 and leased.lease_id is not None
        # Runs 0 and 1 on the nodes the round asked (one lease a node, F77, F82), run 2 (short of full) on both its
        # replicas; runs 3-5's let go at once (or kept in the lease of a node that holds run 0 or 1 too).
        asked = leased_round(client, chain)
        assert sum(s.active_leases for s in client.node_stats().values()) == len({asked[0], asked[1]}) + 2
        assert client.release(leased.lease_id)
        assert client.get(tokens).found_prefix_blocks == 9
        # The search without a lease trusts a stored run's predecessors (true inside retention: F31), so it
        # reports the stranded runs; the Get above is what a worker loads.
        assert client.lookup(tokens).found_blocks == 24


def test_f32_a_leased_lookup_leases_on_every_node_asked_and_one_release_drops_them(fleet: Fleet) -> None:
    """F32: one composite lease id."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 6)
        client.put(tokens, blocks_for(client, tokens))
        found = client.lookup(tokens, lease_ms=60_000)
        assert isinstance(found, FleetLookupResult)
        assert found.found_blocks == 24 and found.lease_id is not None
        leases = {k: s.active_leases for k, s in client.node_stats().items()}
        # one lease on each node asked (its runs found by their last blocks share it, F77)
        assert set(leases.values()) <= {0, 1} and {k for k, v in leases.items() if v} == found.nodes_asked
        assert client.release(found.lease_id) is True
        assert sum(s.active_leases for s in client.node_stats().values()) == 0
        assert client.release(found.lease_id) is False  # already released
        with pytest.raises(NotFound, match="not a lease id of a fleet"):
            client.release("abc")


def test_f34_a_read_refreshes_the_copies_it_did_not_ask_in_the_background(fleet: Fleet) -> None:
    """F34: the last use that counts is the latest over the copies (a Lookup on the other replica, batched)."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS)
        client.put(tokens, blocks_for(client, tokens))
        chain = client.hashes(tokens)
        [run] = client.placement(chain)
        first, other = client.pool.read_order(chain[0], run.replicas)[:2]  # a third, next-ranked node follows (F39)
        before = client.node_stats()
        assert client.get(tokens).found_prefix_blocks == 4
        assert client.refresher.flush(30.0)
        after = client.node_stats()
        assert after[first].gets == before[first].gets + 1 and after[other].gets == before[other].gets
        assert after[other].lookups == before[other].lookups + 1  # the refresh
        assert after[first].lookups == before[first].lookups
        client.get(tokens)  # within the gap: the same refresh is not sent again
        assert client.refresher.flush(30.0)
        assert client.node_stats()[other].lookups == after[other].lookups and client.refresher.skipped == 1


def test_f33_reads_of_a_shared_prefix_spread_over_its_replicas(fleet: Fleet) -> None:
    """F33: each client draws its own order per run, so many readers of one prompt use every replica."""
    with fleet_client(fleet) as writer:
        tokens = prompt(RUN_TOKENS * 12)
        writer.put(tokens, blocks_for(writer, tokens))
        chain = writer.hashes(tokens)
        placement = writer.placement(chain)
        mine = [writer.pool.read_order(chain[r.first_block], r.replicas)[0] for r in placement]
        assert len(set(mine)) > 1  # one client's runs are not all read from one node
        # Another client (another salt) reads some runs from the other replica. Two random salts give the same
        # first replica for all 12 runs once in 4,096 draws (seen once in CI), so up to three clients are drawn:
        # with one salt for all, every one of them would match.
        for _ in range(3):
            other = fleet_client(fleet)
            theirs = [other.pool.read_order(chain[r.first_block], r.replicas)[0] for r in placement]
            if theirs != mine:
                break
            other.close()
        assert theirs != mine
        with other:
            before = {k: s.gets for k, s in other.node_stats().items()}
            assert other.get(tokens).found_prefix_blocks == 48
            after = {k: s.gets for k, s in other.node_stats().items()}
            assert {k: after[k] - before[k] for k in after if after[k] > before[k]} == {
                n: theirs.count(n) for n in set(theirs)}  # one Get per run, each on the node the order named


def test_f33_a_copy_missing_blocks_is_read_around_from_the_block_it_lacks(fleet: Fleet) -> None:
    """F33: the preferred replica lost the tail of a run (purged there): the Get takes the rest of the run from
    the other replica, without asking again for what it delivered; the Lookup finds the run on the other copy."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 2)
        payload = blocks_for(client, tokens)
        client.put(tokens, payload)
        chain = client.hashes(tokens)
        run = client.placement(chain)[1]
        first, other = client.pool.read_order(chain[run.first_block], run.replicas)[:2]
        with AdminClient(fleet.node(first).child.target) as admin:
            assert admin.purge("default", block_hashes=[chain[run.first_block + 2]]) == 2  # blocks 6 and 7
        assert found_on(fleet.node(first).child.target, chain[4:8]) == 2
        before = client.node_stats()
        assert client.get(tokens, first_block=4).blocks == payload[4:]  # run 1 only
        after = client.node_stats()
        assert after[first].get_tokens_returned - before[first].get_tokens_returned == 2 * BLOCK_TOKENS
        assert after[other].get_tokens_returned - before[other].get_tokens_returned == 2 * BLOCK_TOKENS
        assert client.lookup(tokens).found_blocks == 8
        assert client.pool.failures[first] == 0  # a miss is not a failure: the node stays first for other runs


def test_a_stream_in_a_fleet_gives_each_block_in_order(fleet: Fleet) -> None:
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 3 + BLOCK_TOKENS)
        payload = blocks_for(client, tokens)
        client.put(tokens, payload)
        chain = [*client.hashes(tokens), bytes(32)]  # one more hash, stored nowhere
        got = list(client.stream(chain))
        assert [i for i, _, _ in got] == list(range(14))
        assert [d for _, s, d in got if s == pb.BLOCK_STATUS_FOUND] == payload
        assert got[-1][1] == pb.BLOCK_STATUS_MISSING
        assert fleet_hashes(tokens, root=client.root, block_tokens=BLOCK_TOKENS, run_blocks=RUN_BLOCKS) == chain[:-1]
        out, filled = client.get_tensor(tokens)  # Client's own get_tensor, over the fleet's stream
        assert filled == 13 and [bytes(row.numpy()) for row in out] == payload
        part = client.get(tokens, first_block=5, num_blocks=4)  # from inside run 1 into run 2
        assert part.blocks == payload[5:9] and part.statuses == ["found"] * 4


def _failovers() -> float:
    from kvstore.client.fleet_metrics import FAILOVERS

    return FAILOVERS.labels("get")._value.get()  # type: ignore[no-any-return]


def test_f68_a_stream_of_a_slice_is_placed_by_its_first_block_or_refused(fleet: Fleet) -> None:
    """F68: `stream` of a slice of a chain from block `first_block`: from a run boundary each run is placed by its
    own first hash, from inside a run by `run_key`; each run is asked of the node its placement names (one Get
    per run there, no failover). From inside a run without `run_key` it is refused, naming what to pass."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 8)
        payload = blocks_for(client, tokens)
        client.put(tokens, payload)
        chain = client.hashes(tokens)
        placement = client.placement(chain)
        for first in (4, 6, 13):
            start = first - first % RUN_BLOCKS
            run_key = chain[start] if first % RUN_BLOCKS else None
            # The node each run's part is read from: the first of its read order, placed by its first hash.
            wanted = [client.pool.read_order(chain[r.first_block], r.replicas)[0]
                      for r in placement if r.end_block > first]
            before, failovers = client.node_stats(), _failovers()
            got = list(client.stream(chain[first:], first_block=first, run_key=run_key))
            after = client.node_stats()
            assert [i for i, _, _ in got] == list(range(len(chain) - first))
            assert [d for _, _, d in got] == payload[first:], first
            assert _failovers() == failovers, first
            assert {k: after[k].gets - before[k].gets for k in after if after[k].gets > before[k].gets} == {
                n: wanted.count(n) for n in set(wanted)}, first
        with pytest.raises(InvalidArgument, match=r"inside a run of 4 blocks: pass run_key= \(the fleet hash of "
                                                  r"block 4.*stream_part\(chain, 6, end\)"):
            client.stream(chain[6:], first_block=6)
        with pytest.raises(InvalidArgument, match="run_key is 5 bytes"):
            client.stream(chain[6:], first_block=6, run_key=b"short")


def test_f68a_a_stream_from_inside_a_run_refreshes_that_parts_other_copies(fleet: Fleet) -> None:
    """F68a: a stream of a slice from inside a run (blocks 5-6: run 1 from its block 1) is a use of every copy of
    what it read: the run's replica not read sees one Lookup, anchored at the deepest block read, that finds it at
    its depth (3 blocks' tokens: a Lookup's deepest found block, refreshed, R5); the node read sees none."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 3)
        payload = blocks_for(client, tokens)
        client.put(tokens, payload)
        chain = client.hashes(tokens)
        run = client.placement(chain)[1]
        read_from = client.pool.read_order(chain[run.first_block], run.replicas)[0]
        [other] = [n for n in run.replicas if n != read_from]
        assert client.refresher.flush(30.0)
        before, sent = client.node_stats(), client.refresher.sent
        got = list(client.stream(chain[5:7], first_block=5, run_key=chain[4]))
        assert [d for _, _, d in got] == payload[5:7]
        assert client.refresher.flush(30.0)
        after = client.node_stats()
        assert client.refresher.sent == sent + 1
        assert {n: after[n].lookups - before[n].lookups for n in before} == {
            n: int(n == other) for n in before}
        assert after[other].lookup_tokens_found - before[other].lookup_tokens_found == 3 * BLOCK_TOKENS


@dataclass
class PutLog:
    acked: list[tuple[list[int], list[bytes]]]
    failed: list[tuple[list[int], list[bytes], PutNotReplicated]]


def held_by(fleet: Fleet, namespace: str, run_hashes: list[bytes]) -> list[int]:
    """Leading blocks of a run each node holds for `namespace`, asked of every node directly."""
    held = []
    for n in fleet.nodes:
        with kvstore.Client(n.child.target, namespace=namespace) as direct:
            held.append(direct.lookup_hashes(run_hashes).found_blocks)
    return held


def test_f56_a_next_turn_over_the_fleet_hashes_its_new_blocks_only_and_finds_the_last_turn(fleet: Fleet) -> None:
    """F56 on real nodes: turn 2 (turn 1 and more) is looked up with turn 1's runs from the chain memo, finds
    turn 1's blocks, and its hashes equal the cold path's and a memo-less client's."""
    with fleet_client(fleet) as client, fleet_client(fleet, chain_memo_bytes=0) as bare:
        turn1 = prompt(RUN_TOKENS * 5 + 3 * BLOCK_TOKENS)
        client.put(turn1, blocks_for(client, turn1))
        turn2 = turn1 + prompt(RUN_TOKENS * 2 + 5)
        reused = sum(m.stats().reused_blocks for m in client.chains.memos())
        got = client.lookup(turn2)
        assert got.found_blocks == len(turn1) // BLOCK_TOKENS
        assert list(got.block_hashes) == bare.lookup(turn2).block_hashes == cold_fleet_hashes(client, turn2)
        # Runs 0-4 came from the memo (runs are 4 blocks: shorter than the memo's 16-block floor, each whole
        # run is kept); the partial sixth run was hashed again.
        assert sum(m.stats().reused_blocks for m in client.chains.memos()) - reused == 5 * RUN_BLOCKS
        assert bare.chains.memos() == []


def cold_fleet_hashes(client: FleetClient, tokens: list[int]) -> list[bytes]:
    return fleet_hashes(tokens, root=client.root, block_tokens=BLOCK_TOKENS, run_blocks=RUN_BLOCKS)


def test_f51_a_tenants_replication_is_the_copies_its_puts_make(fleet: Fleet,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """F51: a tenant's own replication in its policy (set through any node's Admin, stored in etcd) is what the
    fleet client's Puts make, followed while the client runs; other tenants keep [fleet] replication; a
    replication above the live nodes is set, and the answer says what is done meanwhile."""
    tenant, other = f"r3-{uuid.uuid4().hex[:8]}", f"r4-{uuid.uuid4().hex[:8]}"
    with fleet_client(fleet, namespace=tenant) as client, fleet_client(fleet, namespace=other) as plain:
        assert client.copies == 2 and plain.copies == 2
        with AdminClient(fleet.nodes[0].child.target) as admin:
            reply = admin.set_policy(tenant, replication=3)
            assert reply.after.policy.replication == 3 and reply.before.policy.replication == 2 and not reply.note
            with pytest.raises(InvalidArgument, match=r"replication = 6 .* a whole number from 1 to 5"):
                admin.set_policy(tenant, replication=6)
        more = f"r5-{uuid.uuid4().hex[:8]}"  # through the CLI: `kvstore policy set --replication`
        assert main(["policy", "set", more, "--replication", "4", "--target", fleet.nodes[1].child.target]) == 0
        out = capsys.readouterr().out
        assert "replication        2 -> 4" in out
        assert f"note: tenant {more!r}: 4 copies of each run asked, 3 nodes live now: each run is kept on 3 " \
               "until more nodes join, then copied to them (re-replication)" in out
        wait_until(lambda: client.copies == 3, "the client following its tenant's new replication")
        tokens = prompt(RUN_TOKENS * 2)
        client.put(tokens, blocks_for(client, tokens))
        chain = client.hashes(tokens)
        assert all(run.replicas and len(run.replicas) == 3 for run in client.placement(chain))
        assert held_by(fleet, tenant, chain[4:8]) == [4, 4, 4]  # run 1 on every node
        plain.put(tokens, blocks_for(plain, tokens))  # the same tokens, another tenant: two copies
        assert sorted(held_by(fleet, other, plain.hashes(tokens)[4:8])) == [0, 4, 4]


def test_f51_a_client_naming_no_namespace_follows_the_default_tenants_policy(fleet: Fleet) -> None:
    """An empty namespace is the tenant the nodes resolve it to ("default" without a token), so that is the
    policy whose replication counts, not a tenant named ""."""
    with fleet_client(fleet) as plain, fleet_client(fleet, namespace="named-one") as named:
        assert plain.tenant == "default" and named.tenant == "named-one"
        assert plain.view._policy_tenant == "default"  # the policy key it follows in etcd


def test_f65_refreshes_queued_together_keep_the_deepest_per_copy_and_are_cut_when_sent(fleet: Fleet) -> None:
    """F65: a Lookup queues its unasked copies in one call; per (node, run) the deepest use is the one sent, cut
    from the chain by the refresher's thread; an empty range is no refresh."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS)
        client.put(tokens, blocks_for(client, tokens))
        chain = client.hashes(tokens)
        [run] = client.placement(chain)
        node, other = run.replicas[:2]
        before = client.node_stats()
        client.refresher.add_many([(node, chain, 0, 2), (node, chain, 0, 4), (node, chain, 0, 3), (other, chain, 1, 1)])
        assert client.refresher.flush(30.0)
        after = client.node_stats()
        assert after[node].lookups == before[node].lookups + 1
        assert after[node].lookup_tokens_asked == before[node].lookup_tokens_asked + RUN_TOKENS
        assert after[node].lookup_tokens_found == before[node].lookup_tokens_found + RUN_TOKENS
        assert all(after[n].lookups == before[n].lookups for n in after if n != node)


def test_f76_a_half_stored_prompt_is_asked_of_every_copy_in_one_round_and_refreshes_none_again(
        fleet: Fleet) -> None:
    """F76: a prompt whose last run is short is asked of every node of each run's read order in one call per node
    after the probe (no third round trip for the boundary run's other copies); R6 across runs holds (a run short
    on one replica and whole on the other counts); the copies that answered are not refreshed again (F34)."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 12)
        client.put(tokens, blocks_for(client, tokens))
        half = tokens[:RUN_TOKENS * 6] + prompt(RUN_TOKENS * 6)
        found, by_node = calls_by_node(client, lambda: client.lookup(half))
        assert found.found_blocks == 6 * RUN_BLOCKS
        # the probe, the round of every copy by last blocks (F77), the boundary run's copies by its hashes
        assert sum(by_node.values()) <= 1 + 2 * len(fleet.nodes) and max(by_node.values()) <= 3
        chain = client.hashes(tokens)
        run = client.placement(chain)[2]
        first = client.pool.read_order(chain[run.first_block], run.replicas)[0]
        purge_from(fleet.node(first), chain[run.first_block + 1])  # run 2 short on the replica read first
        client.found_chains = FoundChains()  # F76's round, not F81's guess from the Lookup before
        found, by_node = calls_by_node(client, lambda: client.lookup(half))
        assert found.found_blocks == 6 * RUN_BLOCKS  # whole on its other replica: the prefix goes on
        assert sum(by_node.values()) <= 1 + 2 * len(fleet.nodes)
        assert client.refresher.flush(30.0)
        sent = client.refresher.sent
        client.found_chains = FoundChains()
        assert client.lookup(half).found_blocks == 6 * RUN_BLOCKS
        assert client.refresher.flush(30.0)
        assert client.refresher.sent == sent + 1  # run 2's short copy only: every other copy answered


def test_f76_a_node_that_just_failed_is_not_asked_in_the_round_where_another_copy_comes_first(
        fleet: Fleet) -> None:
    """F76: the round of every copy leaves out a node that failed a call within `suspect_s` (read last, F33) where
    a copy not suspect comes before it: a stopped node would hold the round for its timeout. The walk still asks
    it of the boundary run if it holds a copy (R6 across runs counts every live replica)."""
    with fleet_client(fleet) as client:
        tokens = prompt(RUN_TOKENS * 12)
        client.put(tokens, blocks_for(client, tokens))
        half = tokens[:RUN_TOKENS * 6] + prompt(RUN_TOKENS * 6)
        suspect = fleet.nodes[0].node_id
        client.pool.failed(suspect)
        runs_before = client.node_stats()[suspect].lookups  # the store counts each run asked as a Lookup
        found, by_node = calls_by_node(client, lambda: client.lookup(half))
        assert found.found_blocks == 6 * RUN_BLOCKS
        assert by_node.get(suspect, 0) <= 1 and client.node_stats()[suspect].lookups - runs_before <= 1


def test_f30_f33_kill_9_during_puts_loses_no_acknowledged_block_and_reads_fail_over(fleet: Fleet) -> None:
    """F30, F33: a node SIGKILLed while Puts stream in: every acknowledged block is read back (from the
    replica), a Put it was part of raises PutNotReplicated, reporting stored only what is on every replica."""
    victim = fleet.nodes[0]
    fast = Retry(ExponentialBackoff(base_s=0.001, cap_s=0.01), retries=1)
    log = PutLog(acked=[], failed=[])
    stop = threading.Event()
    killed = threading.Event()
    after_kill = [0]

    def writer() -> None:
        with fleet_client(fleet, retry=fast) as client:
            while not stop.is_set():
                tokens = prompt(RUN_TOKENS * 3)
                payload = blocks_for(client, tokens)
                was_killed = killed.is_set()
                try:
                    client.put(tokens, payload)
                    log.acked.append((tokens, payload))
                except PutNotReplicated as exc:
                    log.failed.append((tokens, payload, exc))
                if was_killed:
                    after_kill[0] += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        wait_until(lambda: len(log.acked) >= 8, "eight puts acknowledged before the kill")
        victim.child.kill9()
        killed.set()
        wait_until(lambda: after_kill[0] >= 8 or not thread.is_alive(), "eight puts after the kill")
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert log.failed, "some put placed a copy on the killed node"
    for _, _, exc in log.failed:
        assert {node for _, node, _ in exc.failures} == {victim.node_id}
        assert exc.stored_blocks % RUN_BLOCKS == 0 and "stored on all their replicas" in exc.message
    # The put in flight at the kill may see its stream cut in any way; every later one finds the node away.
    assert any(exc.retryable and isinstance(exc.failures[0][2], Unavailable) for _, _, exc in log.failed)

    with fleet_client(fleet) as reader:
        assert victim.node_id in reader.view.nodes  # its lease outlives the test: its replicas must fail over
        for tokens, payload in log.acked:
            assert reader.lookup(tokens).found_blocks == 12
            assert reader.get(tokens).blocks == payload  # 0 acknowledged blocks lost
        for tokens, payload, exc in log.failed:  # what it reported stored is stored; no run after it was sent
            n = exc.stored_blocks
            assert reader.get(tokens, num_blocks=n).blocks == payload[:n]
            assert reader.lookup(tokens).found_blocks >= n
            chain = reader.hashes(tokens)
            for run in reader.placement(chain)[exc.failures[0][0] + 1:]:
                for node in fleet.nodes[1:]:
                    assert found_on(node.child.target, chain[run.first_block:run.end_block]) == 0

    with fleet_client(fleet) as fresh:
        fresh.pool.suspect_s = 0  # a failed node is not moved back: the victim stays first in some runs' order

        def victim_first(tokens: list[int]) -> bool:
            chain = fresh.hashes(tokens)
            return any(fresh.pool.read_order(chain[r.first_block], r.replicas)[0] == victim.node_id
                       for r in fresh.placement(chain))

        prefers = [(t, p) for t, p in log.acked if victim_first(t)]
        assert prefers, "some acknowledged run prefers the victim"
        tokens, payload = prefers[0]
        failed = fresh.pool.failures[victim.node_id]
        assert fresh.get(tokens).blocks == payload
        assert fresh.pool.failures[victim.node_id] > failed  # it was asked first, failed, and the replica served
        assert fresh.lookup(tokens).found_blocks == 12

