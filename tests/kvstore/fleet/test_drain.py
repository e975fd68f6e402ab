"""A drain that keeps the replication factor throughout, with real processes: one etcd, `kvstore serve` nodes at
replication 2 on 2 s leases (docs/FLEET.md F21).

`kvstore fleet drain NODE` marks the node draining in its membership record: it keeps its lease (a member,
serving), no one places on it, and it leaves only once the other nodes hold every run it holds at the
replication, as they answer. The first test drains one of two nodes: the drain cannot end (one other node, two
copies asked) until a third joins; meanwhile every run keeps its two live copies, and the draining node stays a
member. The second kills a draining node (one of two: its drain cannot have ended) and repairs the loss onto a
third: handled as a loss. Waits are on `kvstore fleet status --json` and the
nodes' answers, with deadlines.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.cli import main
from kvstore.client import Client
from kvstore.client.fleet import FleetClient
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope
from kvstore.v1 import fleet_pb2 as pb
from kvstore.v1 import fleet_pb2_grpc
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until
from tiers import datadir

TOKENS = 16
RUN_BLOCKS = 4
K = 2
CHAINS = 12
DEADLINE_S = 60.0
SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
BLOCK = V4_1_FLASH.block_bytes(TOKENS)


@dataclass
class Run:
    """One run of a chain the test stored through the fleet client: its fleet hashes and bytes."""

    hashes: list[bytes]
    blocks: list[bytes]

    @property
    def keys(self) -> list[bytes]:
        return [SCOPE.key(h) for h in self.hashes]


class Fleet:
    """The nodes of one test's cluster, by name."""

    def __init__(self, root: Path, etcd: str) -> None:
        self.root = root
        self.etcd = etcd
        self.cluster = f"t-{uuid.uuid4().hex[:12]}"
        self.children: dict[str, Child] = {}
        self.runs: list[Run] = []

    def start(self, name: str, *, interval_s: float = 1.0) -> Child:
        cfg = write_config(
            self.root / name / "kvstore.toml",
            {
                "store": {
                    "data_dir": str(self.root / name / "store"),
                    "capacity_bytes": 1 << 28,
                    "block_tokens": TOKENS,
                },
                "fleet": {
                    "etcd": self.etcd,
                    "cluster": self.cluster,
                    "lease_ttl_s": 2,
                    "run_blocks": RUN_BLOCKS,
                    "replication": K,
                    "repair_interval_s": interval_s,
                    "repair_bytes_per_s": 1 << 30,
                },
            },
        )
        child = self.children[name] = Child(name, ["serve", "--config", str(cfg), "--port", "0"], self.root / "logs")
        return child

    def node_id(self, name: str) -> str:
        node = datadir.node_id(self.root / name / "store")
        assert node is not None
        return node

    def target(self, node_id: str) -> str:
        return next(c.target for n, c in self.children.items() if self.node_id(n) == node_id)

    def cli(self, *args: str, code: int = 0) -> str:
        """`kvstore fleet ARGS` against this cluster: its stdout and stderr (its exit code must be `code`)."""
        # Each etcd call may take up to 30 s, not the default 3: a loaded machine answers later, not otherwise.
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            got = main(["fleet", *args, "--etcd", self.etcd, "--cluster", self.cluster, "--timeout", "30"])
        assert got == code, f"kvstore fleet {' '.join(args)}: exit {got}: {out.getvalue()}"
        return out.getvalue()

    def drain_requests(self) -> list[bytes]:
        """The drain requests' keys in etcd."""
        import asyncio

        from kvstore.config_sections import FleetSettings
        from kvstore.fleet.membership import session_for
        from kvstore.fleet.repair_progress import drain_prefix

        async def read() -> list[bytes]:
            session = session_for(FleetSettings(etcd=self.etcd, cluster=self.cluster), timeout_s=30)
            try:
                return [kv.key for kv in await session.call(lambda c: c.get_prefix(drain_prefix(self.cluster)))]
            finally:
                await session.close()

        return asyncio.run(read())

    def status(self) -> dict[str, Any]:
        return json.loads(self.cli("status", "--json"))

    def draining(self, node_id: str) -> dict[str, Any] | None:
        """The status's drain entry of `node_id` (None: it has none)."""
        return next((d for d in self.status()["draining"] if d["node_id"] == node_id), None)

    def wait_settled(self, n_nodes: int) -> dict[str, Any]:
        def settled() -> dict[str, Any] | None:
            r = self.status()
            rep = r["replication"]
            return r if len(r["nodes"]) == n_nodes and rep["settled"] and rep["under_replicated_bytes"] == 0 else None

        found: dict[str, Any] = wait_for(settled, "re-replication settled")
        return found

    def held(self, target: str, keys: list[bytes]) -> list[bool]:
        with grpc.insecure_channel(target) as channel:
            return list(fleet_pb2_grpc.FleetStub(channel).HeldBlocks(pb.HeldBlocksRequest(keys=keys)).held)

    def holders(self, run: Run, nodes: list[str]) -> list[str]:
        """Of `nodes`, those that hold every block of `run`."""
        return [n for n in nodes if all(self.held(self.target(n), run.keys))]

    def put_chains(self, count: int, seed: int) -> list[Run]:
        """`count` chains of 1 to 3 runs stored through the fleet client; their runs."""
        rng, runs = random.Random(seed), []
        with Client(f"etcd://{self.etcd}/{self.cluster}") as client:
            for i in range(count):
                n = rng.randint(1, 3 * RUN_BLOCKS)
                tokens = [seed * 1_000_000 + i * 10_000 + t for t in range(n * TOKENS)]
                blocks = [os.urandom(BLOCK) for _ in range(n)]
                client.put(tokens, blocks)  # every run on its replicas, acknowledged when durable
                hashes = client.hashes(tokens)
                runs += [
                    Run(hashes=hashes[r : r + RUN_BLOCKS], blocks=blocks[r : r + RUN_BLOCKS])
                    for r in range(0, n, RUN_BLOCKS)
                ]
        self.runs += runs
        return runs


def wait_for(probe: Callable[[], Any], what: str) -> Any:
    """What `probe` returns once it is truthy (tests.waiting's wait_until, keeping the value)."""
    found: list[Any] = [None]

    def holds() -> bool:
        found[0] = probe()
        return bool(found[0])

    wait_until(holds, what, DEADLINE_S)
    return found[0]


@pytest.fixture
def fleet(etcd_server: EtcdProcess, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, etcd_server.endpoint)
    try:
        yield f
    finally:
        for child in f.children.values():
            child.kill_if_alive()


def check_two_live_copies(fleet: Fleet, a: str) -> dict[str, Any]:
    """F21's promise at one moment: a member until drained, and every run with K copies on the members (the
    draining node's among them). Returns the status read."""
    report = fleet.status()
    entry = next((d for d in report["draining"] if d["node_id"] == a), None)
    members = [n["node_id"] for n in report["nodes"]]
    drained = entry is not None and entry["drained"]
    assert drained or a in members, f"node {a} left the membership before it was drained: {report}"
    for run in fleet.runs:
        assert len(fleet.holders(run, members)) >= K, f"a run had fewer than {K} copies on the members {members}"
    return report


def test_f21_a_drain_keeps_every_run_at_its_factor_until_the_others_hold_it(fleet: Fleet) -> None:
    for name in ("a", "b"):
        fleet.start(name)
    fleet.wait_settled(2)
    fleet.put_chains(CHAINS, seed=1)  # each run on both nodes
    a, b = fleet.node_id("a"), fleet.node_id("b")
    passes = next(n["repair"]["passes"] for n in fleet.status()["nodes"] if n["node_id"] == a)
    assert f"node {a}: drain requested" in fleet.cli("drain", a)

    # One other node for two copies: the drain cannot end. The node stays a member, marked draining, serving,
    # and says how much is left after a whole pass over the marked view.
    def stuck() -> dict[str, Any] | None:
        report = check_two_live_copies(fleet, a)
        entry = next((d for d in report["draining"] if d["node_id"] == a), None)
        row = next(n for n in report["nodes"] if n["node_id"] == a)
        return entry if row["draining"] and entry and entry["repair"]["passes"] >= passes + 2 else None

    entry = wait_for(stuck, "the draining node finished passes over the marked view")
    assert not entry["drained"] and entry["member"]
    assert entry["left_runs"] == len(fleet.runs)  # each run short of its second copy among the others
    assert entry["left_bytes"] == sum(len(x) for r in fleet.runs for x in r.blocks)
    assert "is draining: " in fleet.cli("status")
    with Client(f"etcd://{fleet.etcd}/{fleet.cluster}") as client:  # reads: from b (the placement), a after
        for run in fleet.runs[::RUN_BLOCKS]:
            assert client.get_hashes(run.hashes).blocks == run.blocks
        assert isinstance(client, FleetClient)
        client.view.wait_until(lambda nodes: nodes[a].draining, DEADLINE_S)
        new = [os.urandom(BLOCK) for _ in range(RUN_BLOCKS)]
        tokens = list(range(77_000_000, 77_000_000 + RUN_BLOCKS * TOKENS))
        client.put(tokens, new)  # placed over b alone: not on the draining node
        late = Run(hashes=client.hashes(tokens), blocks=new)
    assert fleet.holders(late, [a, b]) == [b]

    # A third node joins: the others copy every run to it; the draining node leaves once c answers for them.
    copied_before = sum(n["repair"]["copied_bytes"] for n in fleet.status()["nodes"])
    fleet.start("c")
    c = fleet.node_id("c")

    def drained() -> bool:
        check_two_live_copies(fleet, a)
        entry = fleet.draining(a)
        return entry is not None and entry["drained"]

    wait_for(drained, "the node drained")
    report = fleet.wait_settled(2)
    assert sorted(n["node_id"] for n in report["nodes"]) == sorted([b, c])
    assert fleet.children["a"].alive  # still serving: stopping it is the operator's call
    assert f"node {a} is out of the membership, drained: it may be stopped" in fleet.cli("status")
    fleet.runs.append(late)
    for run in fleet.runs:  # each run at its two copies among the others, byte-identical
        assert fleet.holders(run, [b, c]) == [b, c]
        for node in (b, c):
            with Client(fleet.target(node)) as client:
                assert client.get_hashes(run.hashes).blocks == run.blocks
    # Each missing copy was made once: c's copy of every run.
    last = fleet.draining(a)
    assert last is not None
    copied = sum(n["repair"]["copied_bytes"] for n in report["nodes"]) + last["repair"]["copied_bytes"]
    assert copied - copied_before == sum(len(x) for r in fleet.runs for x in r.blocks)
    # F85: a drained node is out of the membership, but its drain may still be cancelled by a prefix of its id.
    assert f"node {a}: drain cancelled" in fleet.cli("drain", a[:8], "--cancel")
    assert fleet.drain_requests() == [] and fleet.draining(a) is None


def test_f21_a_node_killed_while_it_drains_is_a_loss(fleet: Fleet) -> None:
    # Two nodes at two copies: the drain cannot end (one other node), so the kill lands while it drains, however
    # slowly the status is read (with three nodes the drain could end before the first status came back).
    for name in ("a", "b"):
        fleet.start(name)
    fleet.wait_settled(2)
    fleet.put_chains(CHAINS, seed=2)
    a, b = fleet.node_id("a"), fleet.node_id("b")
    fleet.cli("drain", a)
    wait_for(lambda: any(n["draining"] for n in fleet.status()["nodes"] if n["node_id"] == a), "a marked draining")
    fleet.children["a"].kill9()
    fleet.start("c")  # the loss is repaired onto a new node, from b's copies
    c = fleet.node_id("c")

    def settled_without_a() -> bool:
        r = fleet.status()
        rep = r["replication"]
        return sorted(n["node_id"] for n in r["nodes"]) == sorted([b, c]) and bool(rep["settled"]) \
            and rep["under_replicated_bytes"] == 0

    wait_for(settled_without_a, "re-replication settled on b and c")
    assert fleet.draining(a) is None  # its progress went with its lease: a loss, not a drain left standing
    # F85: the request itself stands (a restarted a drains again), and the status says so.
    assert [(d["node_id"], d["member"]) for d in fleet.status()["drain_requested"]] == [(a, False)]
    assert f"node {a}: drain requested, not started: the node is not a member" in fleet.cli("status")
    for run in fleet.runs:
        assert fleet.holders(run, [b, c]) == [b, c]


def test_f21_a_drain_cancelled_before_it_ends_places_on_the_node_again(fleet: Fleet) -> None:
    for name in ("a", "b"):
        fleet.start(name)
    fleet.wait_settled(2)
    fleet.put_chains(4, seed=3)
    a, b = fleet.node_id("a"), fleet.node_id("b")
    fleet.cli("drain", a)  # one other node for two copies: it cannot end
    wait_for(lambda: any(n["draining"] for n in fleet.status()["nodes"] if n["node_id"] == a), "a marked draining")
    assert "drain cancelled" in fleet.cli("drain", a, "--cancel")
    wait_for(lambda: not any(n["draining"] for n in fleet.status()["nodes"]), "a unmarked")
    assert fleet.draining(a) is None
    with Client(f"etcd://{fleet.etcd}/{fleet.cluster}") as client:
        assert isinstance(client, FleetClient)
        client.view.wait_until(lambda nodes: not nodes[a].draining, DEADLINE_S)
        blocks = [os.urandom(BLOCK) for _ in range(RUN_BLOCKS)]
        tokens = list(range(88_000_000, 88_000_000 + RUN_BLOCKS * TOKENS))
        client.put(tokens, blocks)
        run = Run(hashes=client.hashes(tokens), blocks=blocks)
    assert fleet.holders(run, [a, b]) == [a, b]  # placed on both again


def test_f85_a_drain_starts_and_ends_within_seconds_of_the_request_not_at_the_next_periodic_pass(
        fleet: Fleet) -> None:
    # An hour between periodic passes: only the watch of the node's drain key can start the drain, or its cancel,
    # within the test's deadline.
    for name in ("a", "b"):
        fleet.start(name, interval_s=3600)
    fleet.wait_settled(2)
    fleet.put_chains(4, seed=4)
    a = fleet.node_id("a")
    assert f"node {a}: drain requested" in fleet.cli("drain", a[:6])  # a prefix of one member's id names it
    wait_for(lambda: any(n["draining"] for n in fleet.status()["nodes"] if n["node_id"] == a), "a marked draining")
    assert "drain cancelled" in fleet.cli("drain", a, "--cancel")
    wait_for(lambda: not any(n["draining"] for n in fleet.status()["nodes"]), "a unmarked")


def test_f85_a_drain_of_a_node_the_fleet_does_not_have_is_refused_and_asks_nothing(fleet: Fleet) -> None:
    fleet.start("a")
    fleet.wait_settled(1)
    a = fleet.node_id("a")
    out = fleet.cli("drain", "zz" + a[2:], code=2)
    assert "NotFound" in out and f"its members: {a}" in out
    assert fleet.drain_requests() == []  # nothing was written: no node would ever read that request
