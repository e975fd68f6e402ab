"""The repairer's pass (gateway/fleet_repair.py, docs/FLEET.md F18) against a real etcd, two in-process nodes
on loopback (real LMDB, real gRPC), and a copy rate counted on a moved clock."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.fleet_repair import FleetRepairer, Peers, peer_credentials
from gateway.fleet_servicer import add_fleet_service
from kvstore.bench import fleet_processes
from kvstore.clock import ManualClock
from kvstore.config import Settings
from kvstore.config_sections import FleetSettings, StoreSettings, TlsSettings
from kvstore.errors import ConfigError
from kvstore.fleet.membership import Membership, register_node, session_for
from kvstore.fleet.placement import replicas
from tests.conftest import LoopThread
from tests.gateway.test_fleet_copy import RUN_BLOCKS, SCOPE, TOKENS, chain, put
from tests.gateway.test_token_bucket import Recorded
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tiers import run_index
from tiers.lmdb_tier import LmdbBlockTier


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[fleet_processes.EtcdProcess]:
    server = EtcdProcess(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture
def fleet_nodes(tmp_path: Path, loop_thread: LoopThread, etcd: fleet_processes.EtcdProcess) -> Iterator[Any]:
    """make(names, tls=None): nodes of one cluster (TLS with `tls`'s server certificate), each a store
    served by the Fleet service and registered in etcd; returns their tiers, addresses and a view of them all."""
    fleet = FleetSettings(etcd=etcd.endpoint, cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=2,
                          run_blocks=RUN_BLOCKS, replication=2)
    clock = ManualClock()
    opened: list[Any] = []
    views: list[Membership] = []

    async def node(name: str, tls: Any) -> tuple[LmdbBlockTier, str]:
        store = StoreSettings(data_dir=tmp_path / name, capacity_bytes=1 << 28, block_tokens=TOKENS)
        tier = LmdbBlockTier(store, clock=clock)
        server = grpc.aio.server()
        add_fleet_service(server, Settings(store=store, fleet=fleet), tier, auth_on=lambda: False)
        if tls is None:
            port = server.add_insecure_port("127.0.0.1:0")
        else:
            pair = (tls.server.key.read_bytes(), tls.server.cert.read_bytes())
            port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([pair]))
        await server.start()
        registration = await register_node(fleet, node_id=name, address=f"127.0.0.1:{port}",
                                           capacity_bytes=store.capacity_bytes, block_tokens=TOKENS)
        opened.append((tier, server, registration))
        return tier, f"127.0.0.1:{port}"

    async def start(names: list[str], tls: Any) -> tuple[dict[str, LmdbBlockTier], dict[str, str], Membership]:
        made = {n: await node(n, tls) for n in names}
        view = Membership(session_for(fleet), fleet.cluster)
        views.append(view)
        await view.start()
        await view.wait_until(lambda m: len(m.nodes) == len(names), 10)
        return {n: t for n, (t, _) in made.items()}, {n: a for n, (_, a) in made.items()}, view

    yield lambda names, tls=None: loop_thread.run(start(names, tls))
    for view in views:
        loop_thread.run(view.close())
    for tier, server, registration in opened:
        loop_thread.run(registration.stop())
        loop_thread.run(server.stop(0))
        tier.close()


def repairer(tier: LmdbBlockTier, name: str, view: Membership, bucket: Any = None,
             credentials: Any = None) -> FleetRepairer:
    return FleetRepairer(tier, node_id=name, membership=view, replication=2, run_blocks=RUN_BLOCKS,
                         window_s=tier.settings.retention_s, bucket=bucket or Recorded(rate=1e12, burst=1e12),
                         peers=Peers(None, 1 << 26, credentials), interval_s=60, publish=None)


def test_f18_a_pass_copies_every_run_to_the_replica_lacking_it_at_the_bucket_rate(
        fleet_nodes: Any, loop_thread: LoopThread) -> None:
    tiers, _, view = fleet_nodes(["a", "b"])
    a, b = tiers["a"], tiers["b"]
    chains = [chain(n, seed=i) for i, n in enumerate([4, 3, 2, 4, 1, 4, 2, 3])]
    for hashes, blocks in chains:
        put(a, hashes, blocks)
    total = sum(len(x) for _, blocks in chains for x in blocks)
    bucket = Recorded(rate=total / 10, burst=total / 40)  # ten seconds of the clock for the whole copy
    r = repairer(a, "a", view, bucket)

    async def one_pass() -> Any:
        try:
            return await r.run_pass()
        finally:
            await r.peers.close()

    progress = loop_thread.run(one_pass())
    assert (progress.copied_bytes, progress.sent_bytes, progress.under_replicated_bytes) == (total, total, 0)
    assert progress.planned_nodes == ["a", "b"] and progress.under_replicated_runs == 0
    for hashes, blocks in chains:
        assert [data for _, data in b.read([SCOPE.key(h) for h in hashes])] == blocks
    # What went, counted per grant on the bucket's clock: never above the burst plus the rate's worth.
    sent = 0
    for t, n in bucket.grants:
        sent += n
        assert sent <= bucket.burst_bytes + bucket.rate_bytes_per_s * t + 1e-6
    assert sent == total and bucket.grants[-1][0] >= (total - bucket.burst_bytes) / bucket.rate_bytes_per_s - 1e-6
    # A second pass finds nothing to do: b's digests equal a's.
    again = loop_thread.run(one_pass())
    assert again.sent_bytes == total and again.passes == 2
    assert len(run_index.list_runs(b.env)) == len(chains)


def test_f18_of_two_holders_only_the_one_ranked_first_copies(fleet_nodes: Any, loop_thread: LoopThread) -> None:
    tiers, addresses, view = fleet_nodes(["a", "b", "c"])
    chains = [chain(n, seed=i) for i, n in enumerate([4, 3, 2, 4, 1, 4, 2, 3, 4, 4, 2, 1])]
    for hashes, blocks in chains:  # a and b both hold every run: c, where it is a replica, lacks it
        put(tiers["a"], hashes, blocks)
        put(tiers["b"], hashes, blocks)
    live = ["a", "b", "c"]
    runs = run_index.list_runs(tiers["a"].env)

    async def plans(name: str) -> set[bytes]:
        r = repairer(tiers[name], name, view)
        try:  # both plan against the same state, before any copy: the race the rank order settles
            return {p.entry.run_key for p in await r.plan(runs, live, addresses)}
        finally:
            await r.peers.close()

    by_a, by_b = loop_thread.run(plans("a")), loop_thread.run(plans("b"))
    lacking = {e.run_key for e in runs if "c" in replicas(e.run_key, live, 2)}
    first = {k for k in lacking if next(n for n in replicas(k, live, 3) if n != "c") == "a"}
    assert lacking and first and first != lacking  # both cases are met
    assert (by_a, by_b) == (first, lacking - first)


def test_f20_nodes_copy_over_tls_checking_each_other_against_the_fleet_ca(fleet_nodes: Any, loop_thread: LoopThread,
                                                                       certs: Any, tmp_path: Path) -> None:
    tiers, _, view = fleet_nodes(["a", "b"], tls=certs)
    hashes, blocks = chain(6)
    put(tiers["a"], hashes, blocks)
    tls = TlsSettings(cert_file=str(certs.server.cert), key_file=str(certs.server.key))
    plain = peer_credentials(Settings(store=tiers["a"].settings, tls=TlsSettings()))
    wrong_ca = peer_credentials(Settings(store=tiers["a"].settings, tls=tls,
                                         fleet=FleetSettings(ca_file=str(certs.other_ca.cert))))
    good = peer_credentials(Settings(store=tiers["a"].settings, tls=tls,
                                     fleet=FleetSettings(ca_file=str(certs.ca.cert))))
    assert plain is None

    def run(credentials: Any) -> Any:
        r = repairer(tiers["a"], "a", view, credentials=credentials)

        async def one_pass() -> Any:
            try:
                return await r.run_pass()
            finally:
                await r.peers.close()

        return loop_thread.run(one_pass())

    refused = run(wrong_ca)  # b's certificate does not chain to that CA: nothing is sent, the runs count failed
    assert refused.copied_bytes == 0 and not any(run_index.held(tiers["b"].env, [SCOPE.key(h) for h in hashes]))
    assert run(good).copied_bytes == sum(map(len, blocks))
    assert [data for _, data in tiers["b"].read([SCOPE.key(h) for h in hashes])] == blocks
    with pytest.raises(ConfigError, match=r"fleet\.ca_file"):
        peer_credentials(Settings(store=tiers["a"].settings, tls=tls,
                                  fleet=FleetSettings(ca_file=str(tmp_path / "absent.pem"))))


def test_f17_a_copy_encoded_by_hand_is_the_message_protobuf_builds() -> None:
    """The repairer encodes CopyBlocks requests itself (one copy of each block's bytes, no message per
    block): they parse to the message protobuf would build, field for field, and serialize to the same bytes."""
    from gateway.fleet_repair import encode_copy
    from kvstore.v1 import fleet_pb2 as pb
    from tiers.records import BlockMeta
    from tiers.run_index import RunBlock

    blocks = []
    for i, (size, depth) in enumerate([(1, 1), (127, 127), (300, 128), (70_000, 300_000)]):
        data = bytes([i]) * size
        meta = BlockMeta(parent_hash=bytes([i + 1]) * 32, depth=depth, size_bytes=size,
                         checksum=(1 << 64) - 1 - i, created_s=0.0,
                         last_access_s=1.75e9 + i / 3)
        blocks.append((RunBlock(key=bytes([i + 2]) * 48, meta=meta), "tenant-é" * (i + 1), data))
    wire = b"".join(piece for b, ns, data in blocks for piece in encode_copy(b, ns, data))
    want = pb.CopyBlocksRequest(blocks=[
        pb.CopiedBlock(key=b.key, namespace=ns, parent_hash=b.meta.parent_hash, depth=b.meta.depth, data=data,
                       checksum=b.meta.checksum, last_use_s=b.meta.last_access_s) for b, ns, data in blocks])
    assert pb.CopyBlocksRequest.FromString(wire) == want
    assert wire == want.SerializeToString()
