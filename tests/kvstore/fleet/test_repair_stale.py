"""A stale copy is dropped once the run's replicas confirm theirs, with real processes: one etcd, `kvstore serve`
nodes at replication 2, 2 s leases, a pass a second (docs/FLEET.md F21, F79).

One module-scoped story: three nodes store chains of several runs through the fleet client (each run on its two
replicas). The nodes' clock (tests/children.py's SKEWED_CLOCK) moves two minutes on, past R5's touch minute, so a
use is recorded again. Then, on the nodes a fourth one is about to push out of some run's replicas: one run is
looked up (a use of its last block there, later than its replicas' last use of it), another one leased (an hour),
a third pinned (an hour, R22).
The fourth node joins and is filled; the old holders' later passes drop their stale copies. The tests read what
the story left: every run on exactly its replicas (the leased one on its old holder too), the fleet's bytes back
to replication x data, every block readable, the dropped runs counted; the copy used later was dropped only once
its replicas carried that use; the leased and the pinned copies are kept.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import lmdb
import pytest

from kvstore.client import Client
from kvstore.clock import ManualClock
from kvstore.config_sections import StoreSettings
from kvstore.fleet.placement import replicas
from kvstore.geometry import V4_1_FLASH
from kvstore.native.records import BlockMeta, meta_key
from kvstore.prefix import BlockScope
from kvstore.v1 import fleet_pb2 as pb
from kvstore.v1 import fleet_pb2_grpc
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.kvstore.fleet.skewed_nodes import SkewedNodes
from tests.waiting import wait_until
from tiers.lmdb_tier import LmdbBlockTier

TOKENS = 16
RUN_BLOCKS = 4
K = 2
CHAINS = 16
DEADLINE_S = 60.0
SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
BLOCK = V4_1_FLASH.block_bytes(TOKENS)
#: A lease longer than the story (the store allows it: max_lease_ms below).
LEASE_MS = 3_600_000


@dataclass
class Run:
    """One run of a chain stored through the fleet client: its fleet hashes and bytes."""

    hashes: list[bytes]
    blocks: list[bytes]

    @property
    def keys(self) -> list[bytes]:
        return [SCOPE.key(h) for h in self.hashes]

    @property
    def size_bytes(self) -> int:
        return sum(len(b) for b in self.blocks)


@dataclass
class Story:
    """What the module's story did, for the tests to read."""

    nodes: Nodes
    #: Every run stored, and each chain's tokens and blocks (read back through the fleet client).
    runs: list[Run] = field(default_factory=list)
    chains: list[tuple[list[int], list[bytes]]] = field(default_factory=list)
    #: The node ids before the fourth joined, and after.
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    #: The run used on its old holder after its last use on the replicas, that holder, and a lower bound of that use.
    late: Run | None = None
    late_holder: str = ""
    late_use_s: float = 0.0
    #: The replicas' last use of that run's last block once the old holder's copy was dropped (node id -> it).
    late_replica_uses: dict[str, float | None] = field(default_factory=dict)
    #: The run leased on its old holder, and that holder; the run pinned on its old holder, and that holder.
    leased: Run | None = None
    leased_holder: str = ""
    pinned: Run | None = None
    pinned_holder: str = ""

    def kept(self) -> dict[int, str]:
        """id of each run kept on its old holder (leased, pinned) -> that holder."""
        return {id(self.leased): self.leased_holder, id(self.pinned): self.pinned_holder}


class Nodes(SkewedNodes):
    """The story's nodes, by name, on one skewed clock."""

    def __init__(self, root: Path, etcd: str) -> None:
        super().__init__(root, etcd, tokens=TOKENS, run_blocks=RUN_BLOCKS, replication=K,
                         store={"max_lease_ms": LEASE_MS, "pin_max_hours": 100.0, "pin_budget_bytes": 1 << 26})

    def settled(self, n_nodes: int) -> bool:
        report = self.status()
        rep = report["replication"]
        return len(report["nodes"]) == n_nodes and rep["settled"] and rep["under_replicated_bytes"] == 0

    def held(self, node_id: str, run: Run) -> list[bool]:
        """Which blocks of `run` the node holds (HeldBlocks: it does not touch their last use)."""
        with grpc.insecure_channel(self.target(node_id)) as channel:
            return list(fleet_pb2_grpc.FleetStub(channel).HeldBlocks(pb.HeldBlocksRequest(keys=run.keys)).held)

    def holders(self, run: Run, nodes: list[str]) -> set[str]:
        """The nodes among `nodes` holding every block of `run` (each holds all of it or none)."""
        found = {n: self.held(n, run) for n in nodes}
        assert all(all(h) or not any(h) for h in found.values()), "a run held in part"
        return {n for n, h in found.items() if all(h)}

    def last_use(self, node_id: str, key: bytes) -> float | None:
        """The node's recorded last use of a block, read from its LMDB while it runs (a reader under LMDB's lock
        file, as the node's own readers are), None when it does not hold it."""
        env = lmdb.open(str(self.data_dir(self.name_of(node_id))), readonly=True, max_dbs=8)
        try:
            with env.begin() as txn:
                raw = txn.get(meta_key(key), db=env.open_db(b"records", txn=txn, create=False))
                return None if raw is None else BlockMeta.unpack(raw).last_access_s
        finally:
            env.close()


def stale_holder(run: Run, before: list[str], after: list[str]) -> str | None:
    """The node that holds `run` before the join and is not among its replicas after (None: the join moved none)."""
    gone = set(replicas(run.hashes[0], before, K)) - set(replicas(run.hashes[0], after, K))
    return gone.pop() if gone else None


@pytest.fixture(scope="module")
def story(etcd_server: EtcdProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Story]:
    nodes = Nodes(tmp_path_factory.mktemp("stale"), etcd_server.endpoint)
    s = Story(nodes=nodes)
    leases: list[Client] = []
    try:
        for name in ("a", "b", "c"):
            nodes.start(name)
        wait_until(lambda: nodes.settled(3), "three nodes settled", DEADLINE_S)
        rng = random.Random(77)
        with Client(f"etcd://{nodes.etcd}/{nodes.cluster}") as fleet_client:
            for i in range(CHAINS):
                n = rng.randint(1, 3 * RUN_BLOCKS)
                tokens = [i * 10_000 + t for t in range(n * TOKENS)]
                blocks = [os.urandom(BLOCK) for _ in range(n)]
                fleet_client.put(tokens, blocks)  # every run on its two replicas, acknowledged when durable
                hashes = fleet_client.hashes(tokens)
                s.chains.append((tokens, blocks))
                s.runs += [Run(hashes=hashes[r:r + RUN_BLOCKS], blocks=blocks[r:r + RUN_BLOCKS])
                           for r in range(0, n, RUN_BLOCKS)]
        s.before = [nodes.node_id(n) for n in ("a", "b", "c")]
        nodes.clock.advance(120.0)  # past R5's minute: a use now is recorded
        # The fourth node's id, made before it starts, so the runs it will push out are known first; its store's
        # retention clock on the nodes' time (R13: a store's clock starts from its high-water mark, written here).
        LmdbBlockTier(StoreSettings(data_dir=nodes.data_dir("d"), capacity_bytes=1 << 28, block_tokens=TOKENS),
                      clock=ManualClock(start=time.time() + nodes.clock.skew_s)).close()
        s.after = [*s.before, nodes.node_id("d")]
        moved = [r for r in s.runs if stale_holder(r, s.before, s.after) is not None]
        assert len(moved) >= 3
        late, s.leased, pinned = moved[0], moved[1], moved[2]
        s.late, s.pinned = late, pinned
        s.late_holder = stale_holder(late, s.before, s.after) or ""
        s.leased_holder = stale_holder(s.leased, s.before, s.after) or ""
        s.pinned_holder = stale_holder(pinned, s.before, s.after) or ""
        s.late_use_s = time.time() + nodes.clock.skew_s - 1.0  # a second's slack for the node's own reading
        with Client(nodes.target(s.late_holder)) as client:  # a use of the run's last block there, not elsewhere
            assert client.lookup_hashes(s.late.hashes).found_blocks == len(s.late.hashes)
        last = s.late.keys[-1]
        wait_until(lambda: (nodes.last_use(s.late_holder, last) or 0.0) >= s.late_use_s,
                   "the lookup's use recorded on the old holder", DEADLINE_S)
        assert all((nodes.last_use(n, last) or 0.0) < s.late_use_s
                   for n in replicas(s.late.hashes[0], s.after, K) if n in s.before)  # later than the replica's
        leasing = Client(nodes.target(s.leased_holder))
        leases.append(leasing)
        assert leasing.lookup_hashes(s.leased.hashes, lease_ms=LEASE_MS).lease_id
        with Client(nodes.target(s.pinned_holder)) as client:  # a pin on that copy alone (R22)
            until = time.time() + nodes.clock.skew_s + 3600.0
            assert client.lookup_hashes(pinned.hashes, keep_until_s=until).kept_until_s == until

        nodes.start("d")
        wait_until(lambda: nodes.settled(4), "four nodes settled", DEADLINE_S)
        dropped = len(moved) - 2  # every stale copy but the leased and the pinned ones
        wait_until(lambda: sum(r["stale_dropped_runs"] for r in nodes.repairs().values()) >= dropped,
                   "the old holders' stale copies dropped", DEADLINE_S)
        wait_until(lambda: s.late_holder not in nodes.holders(late, s.after), "the late copy dropped", DEADLINE_S)
        s.late_replica_uses = {n: nodes.last_use(n, last) for n in replicas(s.late.hashes[0], s.after, K)}
        yield s
    finally:
        for client in leases:
            client.close()
        for child in nodes.children.values():
            child.kill_if_alive()


def test_f79_after_a_join_the_old_holders_drop_their_stale_copies_once_the_new_replicas_hold_them(
        story: Story) -> None:
    nodes, after = story.nodes, story.after
    assert story.leased is not None and story.pinned is not None
    kept = story.kept()
    for run in story.runs:  # each run on exactly its replicas, the leased and pinned ones on their old holders too
        want = set(replicas(run.hashes[0], after, K)) | ({kept[id(run)]} if id(run) in kept else set())
        assert nodes.holders(run, after) == want
    held = sum(len(b) for run in story.runs for n in after for b, h in zip(run.blocks, nodes.held(n, run),
                                                                           strict=True) if h)
    data = sum(run.size_bytes for run in story.runs)
    assert held == K * data + story.leased.size_bytes + story.pinned.size_bytes  # back to replication x data
    repairs = nodes.repairs()
    moved = [r for r in story.runs if stale_holder(r, story.before, after) is not None and id(r) not in kept]
    assert sum(r["stale_dropped_runs"] for r in repairs.values()) == len(moved)
    assert sum(r["stale_dropped_bytes"] for r in repairs.values()) == sum(r.size_bytes for r in moved)
    assert repairs[nodes.node_id("d")]["stale_dropped_runs"] == 0  # the new node held no stale copy
    with Client(f"etcd://{nodes.etcd}/{nodes.cluster}") as fleet_client:  # every block still readable
        for tokens, blocks in story.chains:
            assert fleet_client.get(tokens).blocks == blocks
    for run in story.runs:
        for node in replicas(run.hashes[0], after, K):
            with Client(nodes.target(node)) as client:
                assert client.get_hashes(run.hashes).blocks == run.blocks  # byte-identical on each replica


def test_f79_a_copy_used_later_than_its_replicas_is_dropped_only_once_they_carry_that_use(story: Story) -> None:
    assert story.late is not None
    assert story.late_holder not in story.nodes.holders(story.late, story.after)
    for node, used in story.late_replica_uses.items():  # F19: the latest use over the copies survives the drop
        assert used is not None and used >= story.late_use_s, f"replica {node} did not carry the later use"


def test_f79_a_leased_run_is_kept_on_its_old_holder(story: Story) -> None:
    assert story.leased is not None
    assert story.leased_holder in story.nodes.holders(story.leased, story.after)
    passes = {n: r["passes"] for n, r in story.nodes.repairs().items()}
    wait_until(lambda: all(r["passes"] >= passes[n] + 2 for n, r in story.nodes.repairs().items()),
               "two more passes of every node", DEADLINE_S)
    assert story.leased_holder in story.nodes.holders(story.leased, story.after)  # still kept


def test_f79_a_pinned_run_is_kept_on_its_old_holder(story: Story) -> None:
    assert story.pinned is not None
    passes = {n: r["passes"] for n, r in story.nodes.repairs().items()}
    wait_until(lambda: all(r["passes"] >= passes[n] + 2 for n, r in story.nodes.repairs().items()),
               "two more passes of every node", DEADLINE_S)
    assert story.pinned_holder in story.nodes.holders(story.pinned, story.after)  # a live pin here keeps it
