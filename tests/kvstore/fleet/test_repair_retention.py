"""Each tenant's retention in re-replication, with real processes: one etcd, three `kvstore serve` nodes at
replication 2, 2 s leases, a pass a second (docs/FLEET.md F19).

Tenant acme keeps its blocks 7 days (set with `kvstore policy set`, as an operator would: the fleet's one policy
table, in etcd), the default tenant the floor's 3. The nodes run on one skewed clock (tests/children.py's
SKEWED_CLOCK: the tier's retention clock reads `SystemClock`; etcd's leases and the nodes' timers do not), so
four days pass for the nodes' stores at once, between the old blocks' Puts and the fresh ones'. A node holding
runs of each kind is SIGKILLed and its lease ends; the survivor left holding each of its runs copies it to the
other survivor when its tenant's window holds it: acme's old runs and the fresh ones, not the default tenant's
old ones. The receiver's digests count what it received the same way, so the passes after send nothing.

Both of gateway/server.py's `retention_of` wirings are needed: without the repairer's (line `repair.retention_of =`)
acme's old runs are not copied; without the Fleet service's (`add_fleet_service(retention_of=...)`) the receiver's
digests miss acme's old blocks it was sent, and its sender sends them again on every pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.cli import main
from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope
from kvstore.v1 import fleet_pb2 as pb
from kvstore.v1 import fleet_pb2_grpc
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.kvstore.fleet.skewed_nodes import SkewedNodes
from tests.waiting import wait_until

TOKENS = 16
RUN_BLOCKS = 4
K = 2
#: Runs of each kind (one chain of one run each): enough that some node holds one of every kind.
RUNS = 6
BLOCK = V4_1_FLASH.block_bytes(TOKENS)
DAY = 86400.0
#: acme's retention; the default tenant's is the floor, store.retention_hours = 72.
ACME_HOURS = 168.0


@dataclass(frozen=True)
class Run:
    """One run stored through the fleet client: its tenant, fleet hashes and bytes."""

    namespace: str
    hashes: list[bytes]
    blocks: list[bytes]

    @property
    def keys(self) -> list[bytes]:
        scope = BlockScope(V4_1_FLASH.fingerprint, self.namespace)
        return [scope.key(h) for h in self.hashes]

    @property
    def size_bytes(self) -> int:
        return sum(len(b) for b in self.blocks)


class Nodes(SkewedNodes):
    """The test's nodes, by name, on one skewed clock."""

    def __init__(self, root: Path, etcd: str) -> None:
        super().__init__(root, etcd, tokens=TOKENS, run_blocks=RUN_BLOCKS, replication=K)

    def holds(self, name: str, run: Run) -> bool:
        """Whether node `name` holds every block of `run` (HeldBlocks: it does not touch their last use)."""
        with grpc.insecure_channel(self.children[name].target) as channel:
            held = fleet_pb2_grpc.FleetStub(channel).HeldBlocks(pb.HeldBlocksRequest(keys=run.keys)).held
        assert all(held) or not any(held), "a run held in part"
        return all(held)

    def put_runs(self, namespace: str, seed: int) -> list[Run]:
        """RUNS chains of one run each, of tenant `namespace`, through the fleet client (each on its K replicas)."""
        runs = []
        with Client(f"etcd://{self.etcd}/{self.cluster}", namespace=namespace) as client:
            for i in range(RUNS):
                tokens = [seed * 1_000_000 + i * 10_000 + t for t in range(RUN_BLOCKS * TOKENS)]
                blocks = [os.urandom(BLOCK) for _ in range(RUN_BLOCKS)]
                client.put(tokens, blocks)  # acknowledged once durable on both replicas
                runs.append(Run(namespace=namespace, hashes=client.hashes(tokens), blocks=blocks))
        return runs

    def wait_passes(self, live: list[str], after: dict[str, int], more: int, what: str) -> dict[str, dict[str, Any]]:
        """The members' records once the membership is `live` and each finished `more` passes over it after
        `after` (its passes then)."""
        want = sorted(live)
        found: dict[str, dict[str, Any]] = {}

        def done() -> bool:
            found.clear()
            found.update(self.repairs())
            return sorted(found) == want and all(
                not r["running"] and r["planned_nodes"] == want and r["passes"] >= after.get(n, 0) + more
                for n, r in found.items())

        wait_until(done, what)
        return found


@pytest.fixture
def nodes(etcd_server: EtcdProcess, tmp_path: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path, etcd_server.endpoint)
    try:
        yield n
    finally:
        for child in n.children.values():
            child.kill_if_alive()


def test_f19_a_killed_nodes_runs_are_copied_within_each_tenants_own_retention(nodes: Nodes) -> None:
    for name in ("a", "b", "c"):
        nodes.start(name)
    ids = {name: nodes.node_id(name) for name in nodes.children}
    nodes.wait_passes(list(ids.values()), {}, 1, "three nodes planning over each other")
    assert main(["policy", "set", "acme", "--retention-hours", str(ACME_HOURS),
                 "--target", nodes.children["a"].target]) == 0
    for child in nodes.children.values():  # one table in etcd: every node's policies see it
        with AdminClient(child.target, timeout_s=10) as admin:
            wait_until(lambda: admin.get_policy("acme").policy.policy.retention_hours == ACME_HOURS,
                       f"node {child.name} serving acme's retention")

    kept, old = nodes.put_runs("acme", seed=1), nodes.put_runs("default", seed=2)
    nodes.clock.advance(4 * DAY)  # past the floor's 72 h, inside acme's 168 h
    fresh = nodes.put_runs("default", seed=3)
    holders = {id(r): {n for n in nodes.children if nodes.holds(n, r)} for r in kept + old + fresh}
    assert all(len(h) == K for h in holders.values())  # placed: two copies each, nothing for a pass to copy
    # The node to kill holds a run of each kind; each run it held has one holder left, which acts.
    victim = next(n for n in sorted(nodes.children)
                  if all(any(n in holders[id(r)] for r in runs) for runs in (kept, old, fresh)))
    survivors = sorted(n for n in nodes.children if n != victim)
    live = [ids[n] for n in survivors]
    before = nodes.repairs()
    sent_before = sum(before[n]["sent_bytes"] for n in live)
    nodes.children[victim].kill9()  # its lease ends 2 s later: the survivors plan over themselves

    after = nodes.wait_passes(live, {n: before[n]["passes"] for n in live}, 2, "the survivors' passes after the loss")
    lost = {id(r) for r in kept + old + fresh if victim in holders[id(r)]}
    for runs, copied in ((kept, True), (fresh, True), (old, False)):
        for r in runs:
            held = {n for n in survivors if nodes.holds(n, r)}
            if id(r) not in lost:
                assert held == set(survivors)
            elif copied:  # used within its tenant's window: on both survivors
                assert held == set(survivors), f"a {r.namespace} run used within its retention was not copied"
            else:  # past its tenant's window: left to retention on the one holder left
                assert held == holders[id(r)] - {victim}, "a default run past its retention was copied"
    expected = sum(r.size_bytes for r in kept + fresh if id(r) in lost)
    sent = sum(after[n]["sent_bytes"] for n in live) - sent_before
    assert sent == expected  # each copy sent once
    assert all(after[n]["under_replicated_bytes"] == 0 for n in live)

    # The receiver's digests count acme's old blocks it was sent (its tenant's window, as the sender's): the
    # passes after send nothing.
    again = nodes.wait_passes(live, {n: after[n]["passes"] for n in live}, 1, "one more pass each")
    assert sum(again[n]["sent_bytes"] for n in live) - sent_before == expected, "the copies were sent again"
