"""A stale copy's drop in the repairer's pass (gateway/fleet_repair.py, docs/FLEET.md F79) against a real etcd and
three in-process nodes on loopback (real LMDB, real gRPC): every run stored on all three, so each node holds the
runs it is not a replica of at replication 2, whose two replicas hold them whole with the same last uses."""

from __future__ import annotations

from kvstore.fleet.placement import replicas
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import RUN_BLOCKS, SCOPE, chain, put
from tiers import run_index


def test_f79_a_stale_copy_is_kept_in_a_pass_whose_etcd_did_not_answer(fleet: Fleet) -> None:
    tiers, _, view = fleet.start(["a", "b", "c"])
    chains = [chain(n, seed=i) for i, n in enumerate([4, 3, 2, 4, 1, 4, 2, 3, 4, 4, 2, 1])]
    assert all(len(hashes) <= RUN_BLOCKS for hashes, _ in chains)  # one run each, placed by its first hash
    for hashes, blocks in chains:
        for tier in tiers.values():
            put(tier, hashes, blocks)
    live = ["a", "b", "c"]
    stale = [(h, b) for h, b in chains if "a" not in replicas(h[0], live, 2)]
    assert stale and len(stale) < len(chains)
    r = fleet.repairer("a", view)

    async def etcd_away() -> bool | None:
        return None  # the drain check's answer when etcd does not answer

    async def no_drain() -> bool | None:
        return False

    r.drain_requested = etcd_away
    assert fleet.one_pass(r).stale_dropped_runs == 0  # in doubt: kept
    assert len(run_index.list_runs(tiers["a"].env)) == len(chains)
    r.drain_requested = no_drain
    progress = fleet.one_pass(r)
    assert (progress.stale_dropped_runs, progress.stale_dropped_bytes) == (
        len(stale), sum(len(x) for _, blocks in stale for x in blocks))
    for hashes, blocks in chains:  # a keeps what it is a replica of; b and c keep everything
        keys = [SCOPE.key(h) for h in hashes]
        assert run_index.held(tiers["a"].env, keys) == [(hashes, blocks) not in stale] * len(keys)
        assert all(run_index.held(tiers["b"].env, keys)) and all(run_index.held(tiers["c"].env, keys))
