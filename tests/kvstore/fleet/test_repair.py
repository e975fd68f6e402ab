"""Re-replication with real processes: one etcd, `kvstore serve` nodes at replication 2, 2 s leases
(docs/FLEET.md, "Node loss, join, drain", F16-F21).

One module-scoped fleet goes through the story in order: three nodes store chains
of several runs through the fleet client (kvstore.Client("etcd://...")), each run
on its two replicas; one is killed with SIGKILL and the survivors copy until every block is
on two live nodes again; the killed node comes back (same data dir: the same node);
a fourth node joins and gets its share of the runs, while one holder's copy of a run
it is to receive was damaged on disk, so the other holder's copy is the one sent.
Waits are on `kvstore fleet status --json` (or the nodes' answers) with deadlines.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.cli import main
from kvstore.client import Client
from kvstore.config_sections import StoreSettings
from kvstore.fleet.placement import replicas
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope
from kvstore.v1 import fleet_pb2 as pb
from kvstore.v1 import fleet_pb2_grpc
from tests.children import Child, write_config
from tests.damage import corrupt
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tiers import datadir
from tiers.lmdb_tier import LmdbBlockTier

TOKENS = 16
RUN_BLOCKS = 4
K = 2
CHAINS = 30
DEADLINE_S = 60.0
SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
BLOCK = V4_1_FLASH.block_bytes(TOKENS)


@dataclass
class Stored:
    """One run of a chain the test stored through the fleet client: its fleet hashes and bytes."""

    hashes: list[bytes]
    blocks: list[bytes]

    @property
    def keys(self) -> list[bytes]:
        return [SCOPE.key(h) for h in self.hashes]


class Fleet:
    """The nodes of the module's cluster, by name."""

    def __init__(self, root: Path, etcd: str) -> None:
        self.root = root
        self.etcd = etcd
        self.cluster = f"t-{uuid.uuid4().hex[:12]}"
        self.children: dict[str, Child] = {}
        #: Every run stored, each placed by its first hash (the fleet's run key).
        self.chains: list[Stored] = []

    def data_dir(self, name: str) -> Path:
        return self.root / name / "store"

    def start(self, name: str) -> Child:
        cfg = write_config(self.root / name / "kvstore.toml", {
            "store": {"data_dir": str(self.data_dir(name)), "capacity_bytes": 1 << 28, "block_tokens": TOKENS},
            "fleet": {"etcd": self.etcd, "cluster": self.cluster, "lease_ttl_s": 2, "run_blocks": RUN_BLOCKS,
                      "replication": K, "repair_interval_s": 1.0, "repair_bytes_per_s": 1 << 30},
        })
        child = Child(name, ["serve", "--config", str(cfg), "--port", "0"], self.root / "logs")
        self.children[name] = child
        return child

    def node_id(self, name: str) -> str:
        node = datadir.node_id(self.data_dir(name))
        assert node is not None
        return node

    def live(self) -> dict[str, str]:
        """node id -> target of every node running."""
        return {self.node_id(n): c.target for n, c in self.children.items() if c.proc.poll() is None}

    def status(self) -> dict[str, Any]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["fleet", "status", "--etcd", self.etcd, "--cluster", self.cluster, "--json",
                       "--timeout", "30"])  # a loaded machine answers later, not otherwise
        assert rc == 0, f"kvstore fleet status exited {rc}: {out.getvalue()}"
        return json.loads(out.getvalue())

    def wait_settled(self, n_nodes: int) -> dict[str, Any]:
        """Wait until etcd lists `n_nodes` and every node finished a pass over them with nothing left."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            report = self.status()
            rep = report["replication"]
            if len(report["nodes"]) == n_nodes and rep["settled"] and rep["under_replicated_bytes"] == 0:
                return report
            assert time.monotonic() < deadline, f"re-replication did not settle: {report}"
            time.sleep(0.2)  # polling etcd's records under a deadline

    def held(self, target: str, keys: list[bytes]) -> list[bool]:
        with grpc.insecure_channel(target) as channel:
            return list(fleet_pb2_grpc.FleetStub(channel).HeldBlocks(pb.HeldBlocksRequest(keys=keys)).held)

    def holders(self, chain: Stored) -> dict[str, list[bool]]:
        return {node: self.held(target, chain.keys) for node, target in self.live().items()}


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(etcd_server: EtcdProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Three nodes at replication 2 holding CHAINS chains of 1 to 3 runs, stored through the fleet client."""
    f = Fleet(tmp_path_factory.mktemp("fleet"), etcd_server.endpoint)
    try:
        for name in ("a", "b", "c"):
            f.start(name)
        f.wait_settled(3)
        rng = random.Random(23)
        with Client(f"etcd://{f.etcd}/{f.cluster}") as fleet_client:
            for i in range(CHAINS):
                n = rng.randint(1, 3 * RUN_BLOCKS)
                tokens = [i * 10_000 + t for t in range(n * TOKENS)]
                blocks = [os.urandom(BLOCK) for _ in range(n)]
                fleet_client.put(tokens, blocks)  # every run on its two replicas, acknowledged when durable
                hashes = fleet_client.hashes(tokens)
                f.chains += [Stored(hashes=hashes[r:r + RUN_BLOCKS], blocks=blocks[r:r + RUN_BLOCKS])
                             for r in range(0, n, RUN_BLOCKS)]
        yield f
    finally:
        for child in f.children.values():
            child.kill_if_alive()


def test_f18_a_killed_nodes_blocks_are_copied_until_every_block_is_on_two_live_nodes(fleet: Fleet) -> None:
    settled = fleet.wait_settled(3)
    before = {c.hashes[0]: {n for n, h in fleet.holders(c).items() if all(h)} for c in fleet.chains}
    assert all(len(nodes) == K for nodes in before.values())  # stored as placed: exactly two copies
    survivors = {fleet.node_id("a"), fleet.node_id("b")}
    copied_before = sum(n["repair"]["copied_bytes"] for n in settled["nodes"] if n["node_id"] in survivors)
    fleet.children["c"].kill9()
    report = fleet.wait_settled(2)
    copied = sum(n["repair"]["copied_bytes"] for n in report["nodes"]) - copied_before
    lost = [c for c in fleet.chains if fleet.node_id("c") in before[c.hashes[0]]]
    assert lost and copied == sum(len(b) for c in lost for b in c.blocks)  # each lost copy made once, no more
    live = fleet.live()
    for chain in fleet.chains:
        held = fleet.holders(chain)
        assert sorted(n for n, h in held.items() if all(h)) == sorted(live)  # both live nodes hold all of it
        assert all(all(h) or not any(h) for h in held.values())
        for target in live.values():
            with Client(target) as c:
                assert c.get_hashes(chain.hashes).blocks == chain.blocks  # byte-identical


def test_f21_a_joining_node_gets_its_share_and_a_damaged_copy_is_not_sent(fleet: Fleet) -> None:
    fleet.start("c")  # the killed node comes back: the same node, holding what it held
    fleet.wait_settled(3)
    # The fourth node's id, made before it starts, so the run it will receive can be damaged first.
    LmdbBlockTier(StoreSettings(data_dir=fleet.data_dir("d"), capacity_bytes=1 << 28, block_tokens=TOKENS)).close()
    d = fleet.node_id("d")
    live = fleet.live()
    after = [*live, d]
    holders = {c.hashes[0]: fleet.holders(c) for c in fleet.chains}
    # A run d will hold, whose first holder in rank order (the one that acts) gets its copy damaged.
    chain = next(c for c in fleet.chains if len(c.blocks) > 1 and d in replicas(c.hashes[0], after, K))
    order = [n for n in replicas(chain.hashes[0], after, len(after)) if n != d and all(holders[chain.hashes[0]][n])]
    first = order[0]
    assert len(order) >= 2  # another holder has a good copy
    name = next(n for n in fleet.children if fleet.node_id(n) == first)
    corrupt(fleet.data_dir(name) / "data.mdb", chain.blocks[1])

    sent_before = sum(n["repair"]["sent_bytes"] for n in fleet.status()["nodes"])
    fleet.start("d")
    report = fleet.wait_settled(4)
    nodes = {n["node_id"]: n["repair"] for n in report["nodes"]}
    assert nodes[first]["damaged_blocks"] >= 1  # found by its checksum where it lay, and not sent
    target = fleet.live()[d]
    top = replicas(chain.hashes[0], after, K)
    healed = [fleet.live()[n] for n in top]  # d, and the damaged holder when it is a replica: both get it
    wait_for(lambda: all(all(fleet.held(t, chain.keys)) for t in healed), "the other holder's copy was sent")
    with Client(target) as c:
        assert c.get_hashes(chain.hashes).blocks == chain.blocks  # the good bytes, from the other holder

    # d holds exactly the runs it ranks in the top two of, about K/N of the runs (1/N of the copies).
    mine = [c for c in fleet.chains if d in replicas(c.hashes[0], after, K)]
    wait_for(lambda: all(all(fleet.held(target, c.keys)) for c in mine), "every run placed on d reached it")
    others = [c for c in fleet.chains if c not in mine]
    assert not any(any(fleet.held(target, c.keys)) for c in others)
    share, n = len(mine) / len(fleet.chains), len(fleet.chains)
    sigma = math.sqrt(n * (K / 4) * (1 - K / 4))
    assert abs(len(mine) - n * K / 4) <= 4 * sigma, f"d got {len(mine)} of {n} runs ({share:.2f}), not about 1/2"
    for c in fleet.chains:  # every block on both of its replicas (old holders keep theirs: F21)
        for node in replicas(c.hashes[0], after, K):
            assert all(fleet.held(fleet.live()[node], c.keys))

    # Exactly one holder sent each copy: what d lacked, and the damaged blocks once more to their holder
    # when it is a replica. Read once every node finished a pass after the last copy.
    passes = {n["node_id"]: n["repair"]["passes"] for n in fleet.status()["nodes"]}
    wait_for(lambda: all(n["repair"]["passes"] > passes[n["node_id"]] and not n["repair"]["running"]
                         for n in fleet.status()["nodes"]), "every node finished one more pass")
    sent = sum(n["repair"]["sent_bytes"] for n in fleet.status()["nodes"]) - sent_before
    damaged = sum(len(b) for b in chain.blocks[1:])
    expected = sum(len(b) for c in mine for b in c.blocks) + damaged * (first in top)
    assert sent == expected


def test_f21_a_drained_node_leaves_once_every_run_it_held_has_its_copies_elsewhere(fleet: Fleet) -> None:
    a = fleet.node_id("a")
    only_a = Stored(hashes=[], blocks=[os.urandom(BLOCK) for _ in range(RUN_BLOCKS)])
    tokens = list(range(900_000, 900_000 + RUN_BLOCKS * TOKENS))
    with Client(fleet.live()[a]) as client:  # one copy, on the node about to drain
        client.put(tokens, only_a.blocks)
        only_a.hashes = client.hashes(tokens)
    fleet.chains.append(only_a)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["fleet", "drain", a, "--etcd", fleet.etcd, "--cluster", fleet.cluster]) == 0
    assert f"node {a}: drain requested" in out.getvalue()
    fleet.wait_settled(3)  # a left the membership; b, c and d planned over themselves
    wait_for(lambda: [d["drained"] for d in fleet.status()["draining"] if d["node_id"] == a] == [True],
             "the drained node's last pass found nothing left to copy")
    assert fleet.children["a"].proc.poll() is None  # still serving: stopping it is the operator's call
    live = {n: t for n, t in fleet.live().items() if n != a}
    for c in fleet.chains:
        for node in replicas(c.hashes[0], list(live), K):
            with Client(live[node]) as client:
                assert client.get_hashes(c.hashes).blocks == c.blocks
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(["fleet", "status", "--etcd", fleet.etcd, "--cluster", fleet.cluster]) == 0
    assert f"node {a} is out of the membership, drained: it may be stopped" in text.getvalue()


