"""The repairer's pass (gateway/fleet_repair.py, docs/FLEET.md F18) against a real etcd, two in-process nodes
on loopback (real LMDB, real gRPC), and a copy rate counted on a moved clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.fleet_repair import peer_credentials
from kvstore.config import Settings
from kvstore.config_sections import FleetSettings, TlsSettings
from kvstore.errors import ConfigError
from kvstore.fleet.placement import replicas
from tests.conftest import LoopThread
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import SCOPE, chain, put
from tests.gateway.test_token_bucket import Recorded
from tiers import run_index


def test_f18_a_pass_copies_every_run_to_the_replica_lacking_it_at_the_bucket_rate(fleet: Fleet) -> None:
    tiers, _, view = fleet.start(["a", "b"])
    a, b = tiers["a"], tiers["b"]
    chains = [chain(n, seed=i) for i, n in enumerate([4, 3, 2, 4, 1, 4, 2, 3])]
    for hashes, blocks in chains:
        put(a, hashes, blocks)
    total = sum(len(x) for _, blocks in chains for x in blocks)
    bucket = Recorded(rate=total / 10, burst=total / 40)  # ten seconds of the clock for the whole copy
    r = fleet.repairer("a", view, bucket)
    progress = fleet.one_pass(r)
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
    again = fleet.one_pass(r)
    assert again.sent_bytes == total and again.passes == 2
    assert len(run_index.list_runs(b.env)) == len(chains)


def test_f18_of_two_holders_only_the_one_ranked_first_copies(fleet: Fleet, loop_thread: LoopThread) -> None:
    tiers, addresses, view = fleet.start(["a", "b", "c"])
    chains = [chain(n, seed=i) for i, n in enumerate([4, 3, 2, 4, 1, 4, 2, 3, 4, 4, 2, 1])]
    for hashes, blocks in chains:  # a and b both hold every run: c, where it is a replica, lacks it
        put(tiers["a"], hashes, blocks)
        put(tiers["b"], hashes, blocks)
    live = ["a", "b", "c"]
    runs = run_index.list_runs(tiers["a"].env)

    async def plans(name: str) -> set[bytes]:
        r = fleet.repairer(name, view)
        try:  # both plan against the same state, before any copy: the race the rank order settles
            return {p.entry.run_key for p in await r.plan(runs, live, addresses)}
        finally:
            await r.peers.close()

    by_a, by_b = loop_thread.run(plans("a")), loop_thread.run(plans("b"))
    lacking = {e.run_key for e in runs if "c" in replicas(e.run_key, live, 2)}
    first = {k for k in lacking if next(n for n in replicas(k, live, 3) if n != "c") == "a"}
    assert lacking and first and first != lacking  # both cases are met
    assert (by_a, by_b) == (first, lacking - first)


def test_f20_nodes_copy_over_tls_checking_each_other_against_the_fleet_ca(fleet: Fleet, certs: Any,
                                                                       tmp_path: Path) -> None:
    tiers, _, view = fleet.start(["a", "b"], tls=certs)
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
        return fleet.one_pass(fleet.repairer("a", view, credentials=credentials))

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
