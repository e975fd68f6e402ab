"""`kvstore gateway` against real processes on loopback: one etcd, three `kvstore serve` nodes, two gateways
(docs/FLEET.md, "Gateway").

A plain `kvstore.Client` of a gateway puts and gets prompts of several runs; the blocks are on the replicas
the placement names (each node asked directly); the fleet client and the gateway find each other's blocks;
gateway A killed with SIGKILL, gateway B serves everything. Runs are 4 blocks of 16 tokens.
"""

from __future__ import annotations

import random
import re
import signal
import socket
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvstore
from kvstore.client.admin import AdminClient
from kvstore.client.fleet import FleetClient
from kvstore.client.fleet_chain import run_extra_keys
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.prefix import chain_hashes
from kvstore.v1 import kvstore_pb2 as pb
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until
from tiers import datadir

BLOCK_TOKENS = 16
RUN_BLOCKS = 4
RUN_TOKENS = BLOCK_TOKENS * RUN_BLOCKS


@dataclass
class Fleet:
    """The module's fleet: its address, nodes (id -> process) and gateways."""

    address: str
    nodes: dict[str, Child]
    gateways: list[Child]


def _node(tmp: Path, etcd: str, cluster: str, i: int) -> tuple[str, Child]:
    cfg = write_config(tmp / f"node{i}.toml", {
        "store": {"data_dir": str(tmp / f"store{i}"), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
        "fleet": {"etcd": etcd, "cluster": cluster, "lease_ttl_s": 60, "run_blocks": RUN_BLOCKS},
    })
    child = Child(f"node{i}", ["serve", "--config", str(cfg), "--port", "0"], tmp / "logs")
    return datadir.node_id(tmp / f"store{i}"), child


def _gateway(tmp: Path, etcd: str, cluster: str, name: str) -> Child:
    cfg = write_config(tmp / f"{name}.toml", {
        "store": {"data_dir": str(tmp / f"{name}-none"), "block_tokens": BLOCK_TOKENS},
        "fleet": {"etcd": etcd, "cluster": cluster, "run_blocks": RUN_BLOCKS, "replication": 2},
    })
    return Child(name, ["gateway", "--config", str(cfg), "--port", "0"], tmp / "logs")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One etcd, three nodes, then two gateways."""
    tmp = tmp_path_factory.mktemp("gateway")
    etcd = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    with ThreadPoolExecutor(3) as pool:
        nodes = dict(pool.map(lambda i: _node(tmp, etcd.endpoint, cluster, i), range(3)))
    gateways: list[Child] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            gateways = list(pool.map(lambda n: _gateway(tmp, etcd.endpoint, cluster, n), ("gatewayA", "gatewayB")))
        yield Fleet(address=f"etcd://{etcd.endpoint}/{cluster}", nodes=nodes, gateways=gateways)
    finally:
        for child in [*gateways, *nodes.values()]:
            child.kill_if_alive()
        etcd.stop()


def fleet_client(fleet: Fleet) -> FleetClient:
    client = kvstore.Client(fleet.address)
    assert isinstance(client, FleetClient)
    client.view.wait_until(lambda nodes: set(fleet.nodes) <= set(nodes), 30.0)
    return client


def prompt(n_tokens: int) -> list[int]:
    return [random.randrange(50_000) for _ in range(n_tokens)]


def blocks(n: int, size: int) -> list[bytes]:
    return [random.randbytes(size) for _ in range(n)]


def test_f36_a_gateway_tells_its_clients_to_hash_as_the_fleet_does(fleet: Fleet) -> None:
    """F36: GetInfo says run_blocks; a client of the gateway hashes run by run, bridged, as the fleet client."""
    tokens = prompt(3 * RUN_TOKENS)
    with kvstore.Client(fleet.gateways[0].target) as plain, fleet_client(fleet) as routed:
        assert plain.connection.run_blocks == RUN_BLOCKS
        assert plain.hashes(tokens) == routed.hashes(tokens)
        second = chain_hashes(tokens[RUN_TOKENS:2 * RUN_TOKENS], block_tokens=BLOCK_TOKENS,
                              parent=plain.connection.root,
                              extra_keys=run_extra_keys([], plain.hashes(tokens)[RUN_BLOCKS - 1]))
        assert plain.hashes(tokens)[RUN_BLOCKS:2 * RUN_BLOCKS] == second
    with kvstore.Client(next(iter(fleet.nodes.values())).target) as node:
        assert node.connection.run_blocks == 0  # one node: one chain from the root (PREFIX_HASHING.md)
        assert node.hashes(tokens) == chain_hashes(tokens, block_tokens=BLOCK_TOKENS, parent=node.connection.root)


def test_f56_a_client_of_a_gateway_hashes_a_next_turn_through_the_chain_memo(fleet: Fleet) -> None:
    """F56 through a gateway: the next turn's runs come from the connection's fleet chain memo, and its hashes and
    answer are a memo-less client's."""
    turn1 = prompt(4 * RUN_TOKENS + 2 * BLOCK_TOKENS)
    turn2 = turn1 + prompt(2 * RUN_TOKENS + 3)
    with kvstore.Client(fleet.gateways[0].target) as plain, \
            kvstore.Client(fleet.gateways[0].target, chain_memo_bytes=0) as bare:
        plain.put(turn1, blocks(18, plain.block_bytes))
        memos = plain.connection.fleet_chains
        assert memos is not None and bare.connection.fleet_chains is not None
        got = plain.lookup(turn2)
        assert got.found_blocks == 18 and list(got.block_hashes) == bare.lookup(turn2).block_hashes
        assert sum(m.stats().reused_blocks for m in memos.memos()) == 4 * RUN_BLOCKS  # runs 0-3 of turn 1
        assert bare.connection.fleet_chains.memos() == []


def test_f37_a_plain_client_of_a_gateway_puts_and_gets_prompts_of_many_runs(fleet: Fleet) -> None:
    """F37: Puts from block 0 and from inside a run, Gets from inside a run, byte-identical, on the replicas
    the placement names and no others."""
    tokens = prompt(5 * RUN_TOKENS + 3 * BLOCK_TOKENS)  # 23 blocks: 6 runs, the last short
    with kvstore.Client(fleet.gateways[0].target) as plain, fleet_client(fleet) as routed:
        data = blocks(23, plain.block_bytes)
        plain.put(tokens[:6 * BLOCK_TOKENS], data[:6], batch_blocks=4)  # a stream whose second batch starts in run 1
        plain.put(tokens, data[6:], first_block=6, batch_blocks=3)  # from inside run 1, crossing runs
        assert plain.get(tokens).blocks == data
        assert plain.get(tokens, first_block=9, num_blocks=7).blocks == data[9:16]
        assert plain.lookup(tokens).found_blocks == 23
        chain = plain.hashes(tokens)
        for run in routed.placement(chain):
            run_hashes = chain[run.first_block:run.end_block]
            for node_id, child in fleet.nodes.items():
                with kvstore.Client(child.target) as direct:
                    found = direct.lookup_hashes(run_hashes).found_blocks
                assert found == (len(run_hashes) if node_id in run.replicas else 0), (run.run, node_id)


def test_f37_the_fleet_client_and_the_gateway_find_each_others_blocks(fleet: Fleet) -> None:
    """F37: the same hashes, the same placement: what one puts the other gets."""
    a, b = prompt(3 * RUN_TOKENS), prompt(2 * RUN_TOKENS + BLOCK_TOKENS)
    with kvstore.Client(fleet.gateways[1].target) as plain, fleet_client(fleet) as routed:
        da, db = blocks(12, plain.block_bytes), blocks(9, plain.block_bytes)
        plain.put(a, da)
        routed.put(b, db)
        assert routed.get(a).blocks == da
        assert plain.get(b).blocks == db
        leased = plain.lookup(b, lease_ms=60_000)
        assert leased.found_blocks == 9 and leased.lease_id
        assert plain.release(leased.lease_id) is True


def test_f37_a_get_through_a_gateway_refreshes_the_copy_it_did_not_read(fleet: Fleet) -> None:
    """F37 (F34 through a gateway): the replica a Get did not read sees a refresh Lookup, in the background."""
    tokens = prompt(RUN_TOKENS)
    with kvstore.Client(fleet.gateways[1].target) as plain, fleet_client(fleet) as routed:
        plain.put(tokens, blocks(RUN_BLOCKS, plain.block_bytes))
        [run] = routed.placement(plain.hashes(tokens))
        before = routed.node_stats()
        assert plain.get(tokens).found_prefix_blocks == RUN_BLOCKS

        def refreshed() -> bool:
            now = routed.node_stats()
            unread = [n for n in run.replicas if now[n].gets == before[n].gets]
            return len(unread) == 1 and now[unread[0]].lookups > before[unread[0]].lookups

        wait_until(refreshed, "the unread replica's refresh Lookup")


def test_f68a_a_get_through_a_gateway_from_inside_a_run_refreshes_the_copy_it_did_not_read(fleet: Fleet) -> None:
    """F68a through a gateway: a Get of blocks 5-6 (run 1 from its block 1) queues, on run 1's replica that
    served none of it, a refresh anchored at the deepest block read: that node's Lookup finds 3 blocks' tokens."""
    tokens = prompt(RUN_TOKENS * 3)
    with kvstore.Client(fleet.gateways[0].target) as plain, fleet_client(fleet) as routed:
        plain.put(tokens, blocks(3 * RUN_BLOCKS, plain.block_bytes))
        run = routed.placement(plain.hashes(tokens))[1]
        before = routed.node_stats()
        assert plain.get(tokens, first_block=5, num_blocks=2).found_prefix_blocks == 2

        def unread_replica_refreshed() -> bool:
            now = routed.node_stats()
            unread = [n for n in run.replicas if now[n].gets == before[n].gets]
            return len(unread) == 1 and now[unread[0]].lookups > before[unread[0]].lookups

        wait_until(unread_replica_refreshed, "run 1's unread replica's anchored refresh Lookup")
        after = routed.node_stats()
        [unread] = [n for n in run.replicas if after[n].gets == before[n].gets]
        assert after[unread].lookup_tokens_found - before[unread].lookup_tokens_found == 3 * BLOCK_TOKENS


def test_f38_bad_requests_through_a_gateway_are_named(fleet: Fleet) -> None:
    """F38: a Put inside a run without its run key is INVALID_ARGUMENT naming it; a Get likewise."""
    tokens = prompt(2 * RUN_TOKENS)
    with kvstore.Client(fleet.gateways[0].target) as plain:
        c = plain.connection
        chain = plain.hashes(tokens)
        request = pb.PutRequest(parent_hash=chain[1], token_ids=tokens[2 * BLOCK_TOKENS:3 * BLOCK_TOKENS],
                                blocks=blocks(1, plain.block_bytes), first_block=2)
        with pytest.raises(InvalidArgument, match="needs run_key"):
            c.call(c.kvstore.Put, request)
        with pytest.raises(InvalidArgument, match="needs run_key"):
            list(c.stream(c.kvstore.Get, pb.GetRequest(block_hashes=chain[2:4], first_block=2)))


def test_f40_what_a_gateway_does_not_serve_is_failed_precondition_naming_where_to_go(fleet: Fleet) -> None:
    """F40: transfer sessions go to a node (Admin, the SWA pool and a Lookup's SWA candidates are the nodes' shared
    pool's: F52, here refused naming the nodes' own pools; Stats are the fleet's: F53)."""
    with kvstore.Client(fleet.gateways[0].target) as plain:
        with pytest.raises(FailedPrecondition, match=r"Transfer is not served by a gateway.*node"):
            plain.transfer_stats()
        # A session opened on a gateway is refused at its opening, naming the fleet address to open it with.
        with pytest.raises(FailedPrecondition, match=re.escape(f"kvstore.Client('{fleet.address}')")), \
                plain.transfer() as session:
            session.register(plain.block_bytes)
        with pytest.raises(FailedPrecondition, match="each of the fleet's 3 nodes keeps its own SWA pool"):
            plain.lookup(prompt(RUN_TOKENS), swa_positions=[RUN_TOKENS - 1])


def test_f60_restore_on_auto_through_a_gateway_streams_and_a_forced_shm_is_refused(fleet: Fleet) -> None:
    """F60: `restore` of a plain client of a gateway on "auto" goes on to Get when the gateway refuses its
    transfer session (F40), byte for byte, saying why; "shm" forced is still refused."""
    from kvstore.client.restore import restore

    tokens = prompt(2 * RUN_TOKENS + BLOCK_TOKENS)
    with kvstore.Client(fleet.gateways[0].target) as plain:
        data = blocks(len(tokens) // BLOCK_TOKENS, plain.block_bytes)
        plain.put(tokens, data)
        dest = bytearray(len(data) * plain.block_bytes)
        result = restore(plain, tokens, dest)
        assert (result.path, result.blocks) == ("grpc", len(data)) and bytes(dest) == b"".join(data)
        assert "no transfer session here" in result.reason, result.reason
        with pytest.raises(FailedPrecondition, match="Transfer is not served by a gateway"):
            restore(plain, tokens, bytearray(len(dest)), path="shm")


def test_f52_admin_through_a_gateway_is_forwarded_to_the_nodes(fleet: Fleet) -> None:
    """F52: policies and the audit log through a gateway are the fleet's (set there, read on a node); a purge and
    GetPolicy's usage span every node (two copies of each block counted); export and import are refused naming
    where to go."""
    tenant = f"fw-{uuid.uuid4().hex[:8]}"
    tokens = prompt(2 * RUN_TOKENS + BLOCK_TOKENS)  # 9 blocks, 3 runs
    node = next(iter(fleet.nodes.values()))
    with AdminClient(fleet.gateways[1].target) as admin, AdminClient(node.target) as direct, \
            kvstore.Client(fleet.gateways[1].target, namespace=tenant) as plain:
        reply = admin.set_policy(tenant, retention_hours=96)
        assert reply.after.policy.retention_hours == 96 and not reply.after.is_default
        assert direct.get_policy(tenant).policy.policy.retention_hours == 96  # one table: etcd's
        assert tenant in {p.tenant for p in admin.list_policies().policies}
        assert [e.action for e in admin.policy_log(tenant=tenant)] == ["set_policy"]
        plain.put(tokens, blocks(9, plain.block_bytes))
        usage = admin.get_policy(tenant).usage
        assert usage.nvme_blocks == 18 and usage.nvme_bytes == 18 * plain.block_bytes  # both copies, 3 nodes
        assert direct.get_policy(tenant).usage.nvme_blocks < 18  # one node holds only its share
        assert admin.purge(tenant, all_blocks=True) == 18
        assert plain.lookup(tokens).found_blocks == 0
        with pytest.raises(FailedPrecondition, match=r"ExportTenant names a file on the server's disk.*fleet "
                                                     r"status lists them"):
            admin.export_tenant(tenant, "/tmp/never-written.kvexport")
    # Each node keeps its own pool here: named.
    with kvstore.Client(fleet.gateways[1].target) as plain, \
            pytest.raises(FailedPrecondition, match="each of the fleet's 3 nodes keeps its own SWA pool"):
        plain.swa.get_many([bytes(32)])


def test_f53_stats_through_a_gateway_are_the_fleets(fleet: Fleet) -> None:
    """F53: an admin's Stats through a gateway are every node's summed (blocks, bytes, capacity, hit windows by
    name, tenants by name); a tenant's own through it are its counters over the nodes."""
    tenant = f"st-{uuid.uuid4().hex[:8]}"
    tokens = prompt(2 * RUN_TOKENS)
    with kvstore.Client(fleet.gateways[1].target) as plain, fleet_client(fleet) as routed, \
            kvstore.Client(fleet.gateways[1].target, namespace=tenant) as mine:
        mine.put(tokens, blocks(8, mine.block_bytes))
        assert mine.get(tokens).found_prefix_blocks == 8  # Gets: a count no background refresh moves
        total, nodes = plain.stats(), routed.node_stats()
        assert total.store_wide and len(nodes) == 3
        for field in ("blocks_stored", "bytes_stored", "capacity_bytes", "puts", "blocks_written"):
            assert getattr(total, field) == sum(getattr(n, field) for n in nodes.values()), field
        assert total.retention_hours == max(n.retention_hours for n in nodes.values())
        [hits] = [t for t in total.tenants if t.tenant == tenant]
        per_node = [t for n in nodes.values() for t in n.tenants if t.tenant == tenant]
        assert hits.blocks_stored == 16 == sum(t.blocks_stored for t in per_node)  # two copies of 8
        window = {w.window: w.counts for w in hits.windows}["all"]
        assert window.gets >= 2 and window.gets == sum({w.window: w.counts for w in t.windows}["all"].gets
                                                       for t in per_node)
        assert [w.window for w in total.windows] == [w.window for w in next(iter(nodes.values())).windows]


def _metrics_gateway(tmp: Path, fleet: Fleet) -> tuple[Child, int]:
    """A gateway of the module's fleet serving /metrics on a free loopback port (another if that one was taken
    meanwhile by another pytest worker)."""
    etcd, cluster = fleet.address.removeprefix("etcd://").split("/")
    for attempt in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        cfg = write_config(tmp / f"metrics{attempt}.toml", {
            "store": {"data_dir": str(tmp / "none"), "block_tokens": BLOCK_TOKENS},
            "fleet": {"etcd": etcd, "cluster": cluster, "run_blocks": RUN_BLOCKS},
            "metrics": {"port": port},
        })
        try:
            return Child(f"gateway-metrics{attempt}", ["gateway", "--config", str(cfg), "--port", "0"],
                         tmp / "logs"), port
        except AssertionError as exc:
            if "in use" not in str(exc):
                raise
    raise AssertionError("no free metrics port in 3 tries")


def test_a_gateway_serves_the_routers_metrics(fleet: Fleet, tmp_path: Path) -> None:
    """docs/METRICS.md "Fleet": a gateway's /metrics has the per-call series of what it routed, its view of the
    membership, the routes it holds, the calls it forwarded (F52) and the routing code's fleet-client counters."""
    gateway, port = _metrics_gateway(tmp_path, fleet)
    try:
        tokens = prompt(RUN_TOKENS)
        with kvstore.Client(gateway.target) as plain, AdminClient(gateway.target) as admin:
            plain.put(tokens, blocks(RUN_BLOCKS, plain.block_bytes))
            assert plain.get(tokens).found_prefix_blocks == RUN_BLOCKS
            admin.list_policies()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("kvstore_gateway_nodes", ())] == 3
        assert samples[("kvstore_gateway_membership_stale", ())] == 0
        assert samples[("kvstore_gateway_routes", ())] >= 1
        forwarded = [v for (name, labels), v in samples.items() if name == "kvstore_gateway_forwarded_calls_total"
                     and ("method", "ListPolicies") in labels and ("service", "Admin") in labels]
        assert forwarded == [1]
        puts = [v for (name, labels), v in samples.items() if name == "kvstore_rpc_requests_total"
                and ("method", "kvstore.v1.KVStore/PutStream") in labels and ("code", "OK") in labels]
        assert sum(puts) >= 1
        assert any(name.startswith("kvstore_fleet_client_") for name, _ in samples)
        _dashboard_gateway_queries_are_served(text)
    finally:
        gateway.kill_if_alive()


def _dashboard_gateway_queries_are_served(text: str) -> None:
    """Every kvstore_gateway_* metric and label the Grafana dashboard queries is on a gateway's /metrics."""
    import json

    from tests.gateway.metrics.test_dashboard import _BY, _LEGEND, _NAME, _SELECTOR_LABEL, TARGET_LABELS, _queries

    served: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            served.setdefault(sample.name, set()).update(sample.labels)
    dashboard = json.loads((Path(__file__).resolve().parents[3] / "deploy" / "grafana" /
                            "kvstore-dashboard.json").read_text())
    doc = (Path(__file__).resolve().parents[3] / "docs" / "METRICS.md").read_text()
    section = doc.split("### The gateway", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(kvstore_gateway_\w+)` \|", section, re.MULTILINE))
    assert documented == {re.sub(r"_total$", "", n) for n in served if n.startswith("kvstore_gateway_")}
    queries = [(w, e, leg) for w, e, leg in _queries(dashboard) if "kvstore_gateway_" in e]
    assert {w for w, _, _ in queries} >= {"Gateways: view and routes", "Gateways: calls forwarded to nodes"}
    for where, expr, legend in queries:
        names = set(_NAME.findall(expr))
        assert not names - served.keys(), f"{where}: {sorted(names - served.keys())} not served (query {expr})"
        used = set(_SELECTOR_LABEL.findall(expr)) | set(_LEGEND.findall(legend))
        for group in _BY.findall(expr):
            used |= {label.strip() for label in group.split(",") if label.strip()}
        have = set().union(*(served[n] for n in names)) | TARGET_LABELS
        assert used <= have, f"{where}: labels {sorted(used - have)} not on {sorted(names)}"


def _held_everywhere(fleet: Fleet, hashes: list[bytes]) -> list[int]:
    """Leading blocks of `hashes` (one run) each node holds, asked of every node directly."""
    held = []
    for child in fleet.nodes.values():
        with kvstore.Client(child.target) as direct:
            held.append(direct.lookup_hashes(hashes).found_blocks)
    return held


def test_f69_a_put_from_a_runs_first_block_needs_the_run_before_complete_on_a_live_replica(fleet: Fleet) -> None:
    """F69: through a gateway, a Put from the first block of run r > 0 is stored only when run r - 1 is complete on
    some live replica (the parent's run, placed by parent_run_key): else FAILED_PRECONDITION and nothing stored, as
    a single node's R6; without parent_run_key INVALID_ARGUMENT naming it."""
    tokens = prompt(3 * RUN_TOKENS)
    with kvstore.Client(fleet.gateways[0].target) as plain, fleet_client(fleet) as routed:
        data = blocks(12, plain.block_bytes)
        chain = plain.hashes(tokens)
        plain.put(tokens[:2 * BLOCK_TOKENS], data[:2])  # half of run 0
        with pytest.raises(FailedPrecondition, match=r"block 3, the last of run 0\) is not stored on any live "
                                                     r"replica of its run; put the prefix first"):
            plain.put(tokens[:2 * RUN_TOKENS], data[4:8], first_block=4)
        assert _held_everywhere(fleet, chain[4:8]) == [0, 0, 0]  # nothing of run 1 stored anywhere
        plain.put(tokens[:RUN_TOKENS], data[2:4], first_block=2)  # run 0 complete
        first, second = routed.placement(chain)[0].replicas
        with AdminClient(fleet.nodes[first].target) as admin:  # run 0's last block gone on one replica
            assert admin.purge("default", block_hashes=[chain[3]]) == 1
        plain.put(tokens[:2 * RUN_TOKENS], data[4:8], first_block=4)  # the other replica holds run 0 whole
        assert plain.lookup(tokens).found_blocks == 8 and plain.get(tokens[:2 * RUN_TOKENS]).blocks == data[:8]
        with AdminClient(fleet.nodes[second].target) as admin:
            assert admin.purge("default", block_hashes=[chain[3]]) == 1
        with pytest.raises(FailedPrecondition, match="not stored on any live replica"):
            plain.put(tokens[:2 * RUN_TOKENS], data[4:8], first_block=4)
        c = plain.connection
        request = pb.PutRequest(parent_hash=chain[7], token_ids=tokens[2 * RUN_TOKENS:], blocks=data[8:],
                                first_block=8)
        with pytest.raises(InvalidArgument, match=r"a Put from block 8, the first of run 2, needs parent_run_key: "
                                                  r"the fleet hash of block 4"):
            c.call(c.kvstore.Put, request)
        request.parent_run_key = chain[4]
        assert len(c.call(c.kvstore.Put, request).block_hashes) == 4  # run 1 is complete on its replicas
        assert _held_everywhere(fleet, chain[8:12]).count(4) == 2


def test_f69_a_gateways_get_reads_the_next_run_while_this_one_is_answered(fleet: Fleet, tmp_path: Path) -> None:
    """F69: a Get of two runs through a gateway (at one copy, so each run has one node) with run 0's node stopped
    (SIGSTOP): run 1's read goes to its node while run 0's is still unanswered; once continued, every block."""
    etcd, cluster = fleet.address.removeprefix("etcd://").rsplit("/", 1)
    cfg = write_config(tmp_path / "one.toml", {
        "store": {"data_dir": str(tmp_path / "none"), "block_tokens": BLOCK_TOKENS},
        "fleet": {"etcd": etcd, "cluster": cluster, "run_blocks": RUN_BLOCKS, "replication": 1},
    })
    gateway = Child("gatewayOne", ["gateway", "--config", str(cfg), "--port", "0"], tmp_path / "logs")
    try:
        with fleet_client(fleet) as routed:
            routed.replication = 1
            while True:  # a prompt whose two runs lie on two nodes
                tokens = prompt(2 * RUN_TOKENS)
                run0, run1 = (r.replicas[0] for r in routed.placement(routed.hashes(tokens)))
                if run0 != run1:
                    break
        with kvstore.Client(gateway.target) as plain:
            data = blocks(8, plain.block_bytes)
            plain.put(tokens, data)
            with kvstore.Client(fleet.nodes[run1].target) as node1:
                before = node1.stats().gets
                stopped = fleet.nodes[run0].proc
                stopped.send_signal(signal.SIGSTOP)
                try:
                    with ThreadPoolExecutor(1) as pool:
                        got = pool.submit(plain.get, tokens)
                        wait_until(lambda: node1.stats().gets > before, "run 1 read while run 0's node is stopped")
                        assert not got.done()  # run 0 is still unanswered
                        stopped.send_signal(signal.SIGCONT)
                        assert got.result(timeout=60).blocks == data
                finally:
                    stopped.send_signal(signal.SIGCONT)
    finally:
        gateway.kill_if_alive()


def test_f39_kill_9_a_gateway_and_the_other_serves_everything(fleet: Fleet) -> None:
    """F39: a gateway holds no state: after SIGKILL of gateway A, gateway B gets every block A acknowledged."""
    prompts = [prompt(random.randrange(1, 4) * RUN_TOKENS + BLOCK_TOKENS) for _ in range(4)]
    with kvstore.Client(fleet.gateways[0].target) as a:
        stored = [(t, blocks(len(t) // BLOCK_TOKENS, a.block_bytes)) for t in prompts]
        for tokens, data in stored:
            a.put(tokens, data)
    fleet.gateways[0].kill9()
    with kvstore.Client(fleet.gateways[1].target) as b:
        for tokens, data in stored:
            assert b.lookup(tokens).found_blocks == len(data)
            assert b.get(tokens).blocks == data


def test_f36_a_gateway_without_a_fleet_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """F36: `kvstore gateway` without [fleet] etcd exits 2 with one line naming it."""
    from kvstore.cli import main

    cfg = write_config(tmp_path / "g.toml", {"store": {"data_dir": str(tmp_path / "d")}})
    assert main(["gateway", "--config", str(cfg), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ConfigError" in err[0] and "[fleet] etcd" in err[0]
