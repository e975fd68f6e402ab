"""Re-replication over the bulk transport, with real processes: one etcd, four `kvstore serve` nodes at
replication 2 on 2 s leases, three of them with `[transfer] bulk = "mooncake"` and one without
(docs/FLEET.md F18: "through the bulk transport where both ends have it, gRPC otherwise").

One node that has it is killed with SIGKILL; each run it held has one survivor holding it, which sends it
to the run's new replica: read by the target's engine from the sender's map where both run the bulk
transport, in the call's bytes over gRPC where either does not. Skipped where Mooncake's engine cannot run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest

from gateway.transfer_bulk import engine_missing
from kvstore.client import Client
from kvstore.fleet.placement import replicas
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.kvstore.fleet.test_repair import BLOCK, RUN_BLOCKS, TOKENS, Fleet, K, Stored

if engine_missing():
    pytest.skip(engine_missing(), allow_module_level=True)

CHAINS = 24
#: The nodes that run the bulk transport; "c" copies over gRPC only.
BULK = ("a", "b", "d")


class BulkFleet(Fleet):
    """`test_repair.Fleet`, each node with the bulk transport on or off."""

    def start(self, name: str) -> Child:
        cfg = write_config(self.root / name / "kvstore.toml", {
            "store": {"data_dir": str(self.data_dir(name)), "capacity_bytes": 1 << 28, "block_tokens": TOKENS},
            "fleet": {"etcd": self.etcd, "cluster": self.cluster, "lease_ttl_s": 2, "run_blocks": RUN_BLOCKS,
                      "replication": K, "repair_interval_s": 1.0, "repair_bytes_per_s": 1 << 30},
            "transfer": {"bulk": "mooncake" if name in BULK else "off"},
        })
        child = Child(name, ["serve", "--config", str(cfg), "--port", "0"], self.root / "logs")
        self.children[name] = child
        return child


@pytest.fixture(scope="module")
def fleet(etcd_server: EtcdProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BulkFleet]:
    """Four nodes (c without the bulk transport) holding CHAINS chains of 1 to 3 runs, put through the client."""
    f = BulkFleet(tmp_path_factory.mktemp("fleet-bulk"), etcd_server.endpoint)
    try:
        for name in ("a", "b", "c", "d"):
            f.start(name)
        f.wait_settled(4)
        rng = random.Random(18)
        with Client(f"etcd://{f.etcd}/{f.cluster}") as client:
            for i in range(CHAINS):
                n = rng.randint(1, 3 * RUN_BLOCKS)
                tokens = [i * 10_000 + t for t in range(n * TOKENS)]
                blocks = [os.urandom(BLOCK) for _ in range(n)]
                client.put(tokens, blocks)
                hashes = client.hashes(tokens)
                f.chains += [Stored(hashes=hashes[r:r + RUN_BLOCKS], blocks=blocks[r:r + RUN_BLOCKS])
                             for r in range(0, n, RUN_BLOCKS)]
        yield f
    finally:
        for child in f.children.values():
            child.kill_if_alive()


def test_f18_after_a_kill_copies_between_two_bulk_nodes_go_over_it_the_rest_over_grpc(fleet: BulkFleet) -> None:
    settled = fleet.wait_settled(4)
    ids = {name: fleet.node_id(name) for name in fleet.children}
    name_of = {v: k for k, v in ids.items()}
    before = {c.hashes[0]: {n for n, h in fleet.holders(c).items() if all(h)} for c in fleet.chains}
    assert all(len(nodes) == K for nodes in before.values())
    survivors = [ids[n] for n in ("a", "b", "c")]
    start = {n["node_id"]: n["repair"] for n in settled["nodes"]}
    fleet.children["d"].kill9()
    report = fleet.wait_settled(3)
    repairs = {n["node_id"]: n["repair"] for n in report["nodes"]}

    # Each lost run has one survivor holding it (ranked in the top two of the four, so of the three): it
    # sends the run to the other of the run's two replicas now.
    expected = dict.fromkeys(survivors, 0)
    expected_bulk = dict.fromkeys(survivors, 0)
    lost = [c for c in fleet.chains if ids["d"] in before[c.hashes[0]]]
    for c in lost:
        (sender,) = before[c.hashes[0]] - {ids["d"]}
        (receiver,) = set(replicas(c.hashes[0], survivors, K)) - {sender}
        size = sum(map(len, c.blocks))
        expected[sender] += size
        if name_of[sender] in BULK and name_of[receiver] in BULK:
            expected_bulk[sender] += size
    copied = {n: repairs[n]["copied_bytes"] - start[n]["copied_bytes"] for n in survivors}
    bulk = {n: repairs[n]["bulk_bytes"] - start[n]["bulk_bytes"] for n in survivors}
    assert copied == expected  # each lost copy made once, by the survivor holding it
    assert bulk == expected_bulk  # over the bulk transport exactly where both ends run it
    assert sum(expected_bulk.values()) > 0 and sum(expected.values()) > sum(expected_bulk.values())
    assert bulk[ids["c"]] == 0
    live = fleet.live()
    for chain in fleet.chains:
        held = fleet.holders(chain)
        assert sorted(n for n, h in held.items() if all(h)) == sorted(replicas(chain.hashes[0], survivors, K))
        for node in replicas(chain.hashes[0], survivors, K):
            with Client(live[node]) as client:
                assert client.get_hashes(chain.hashes).blocks == chain.blocks  # byte-identical
