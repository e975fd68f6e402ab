"""Re-replication at each tenant's own replication (docs/FLEET.md F51): a real etcd, three in-process nodes on
loopback (real LMDB, real gRPC), the repairer's copy count per run from the tenants' policies."""

from __future__ import annotations

from pathlib import Path

from gateway.audit import AuditLog
from gateway.policies import Policies, Policy
from kvstore.clock import ManualClock
from kvstore.fleet.placement import replicas
from kvstore.geometry import TINY
from kvstore.prefix import BlockScope, root_hash
from tests.conftest import LoopThread
from tests.gateway.fleet_nodes import Fleet, etcd_fixture, fleet_fixture  # noqa: F401 (the fixtures)
from tests.gateway.test_fleet_copy import TOKENS, chain
from tiers.lmdb_tier import LmdbBlockTier


class FleetPolicies(Policies):
    """The fleet's policy rules (EtcdPolicies' `fleet`), on the file's storage: what the repairer reads."""

    fleet = True


def _holders(tiers: dict[str, LmdbBlockTier], scope: BlockScope, hashes: list[bytes]) -> set[str]:
    return {name for name, tier in tiers.items() if tier.lookup(scope, hashes)[0] == len(hashes)}


def test_f51_a_pass_copies_each_run_to_its_tenants_replication(fleet: Fleet, tmp_path: Path) -> None:
    """A tenant at 3 copies gets every run on all three nodes; the other tenant's runs go to their 2 replicas."""
    tiers, _, view = fleet.start(["a", "b", "c"])
    policies = FleetPolicies(tmp_path / "policies", defaults=Policy(retention_hours=72.0, swa_ttl_s=300.0,
                                                                      replication=2),
                             max_swa_ttl_s=300.0, audit=AuditLog(tmp_path / "policies", clock=ManualClock()))
    policies.set("acme", {"replication": 3}, actor="ops")
    acme, plain = BlockScope(TINY.fingerprint, "acme"), BlockScope(TINY.fingerprint, "default")
    root = root_hash(TINY.fingerprint, TOKENS)
    stored = {scope.namespace: [chain(4, seed=seed) for seed in range(base, base + 6)]
              for scope, base in ((acme, 0), (plain, 100))}
    for scope in (acme, plain):
        for hashes, blocks in stored[scope.namespace]:
            tiers["a"].put(scope, root, hashes, blocks, True)  # on a alone: every other copy is the pass's
    r = fleet.repairer("a", view)
    r.copies = policies.replication_of_key
    fleet.one_pass(r)
    live = ["a", "b", "c"]
    for hashes, _ in stored["acme"]:
        assert _holders(tiers, acme, hashes) == set(live)
    twos = 0
    for hashes, _ in stored["default"]:
        held = _holders(tiers, plain, hashes)
        assert held == {*replicas(hashes[0], live, 2), "a"}  # its two replicas (a keeps its own copy)
        twos += len(held) == 2
    assert twos  # some run of the other tenant is on two nodes only: the counts differ by tenant


def test_f19_a_pass_copies_each_tenants_blocks_used_within_its_own_retention(fleet: Fleet, tmp_path: Path,
                                                                             loop_thread: LoopThread) -> None:
    """Tenant acme keeps its blocks 7 days, the others the floor's 3. Four days after their last use, a node is
    killed: the survivor copies acme's runs to the new replica (inside acme's window, past the floor), not the old
    runs of the others (past their window), and the others' runs used since; the new replica's digests count what
    was copied, so a second pass sends nothing."""
    policies = FleetPolicies(tmp_path / "policies", defaults=Policy(retention_hours=72.0, swa_ttl_s=300.0,
                                                                      replication=2),
                             max_swa_ttl_s=300.0, audit=AuditLog(tmp_path / "policies", clock=ManualClock()))
    acme, plain = BlockScope(TINY.fingerprint, "acme"), BlockScope(TINY.fingerprint, "default")
    assert policies.retention_of_key(acme.key(bytes(32))) == 72 * 3600.0  # the defaults' until acme has its own
    policies.set("acme", {"retention_hours": 168.0}, actor="ops")
    assert policies.retention_of_key(acme.key(bytes(32))) == 168 * 3600.0  # the file's table changes in place
    fleet.retention_of = policies.retention_of_key  # every node's digests (a fleet's policies are one table)
    tiers, _, view = fleet.start(["a", "b", "c"])
    root = root_hash(TINY.fingerprint, TOKENS)

    def store(scope: BlockScope, seeds: range) -> list[tuple[list[bytes], list[bytes]]]:
        chains = [chain(4, seed=seed) for seed in seeds]
        for hashes, blocks in chains:
            for name in ("a", "b"):  # a and b hold every run; c none
                tiers[name].put(scope, root, hashes, blocks, True)
        return chains

    kept, old = store(acme, range(0, 6)), store(plain, range(100, 106))
    fleet.clock.advance(4 * 86400.0)  # past the floor's 72 h, inside acme's 168 h
    fresh = store(plain, range(200, 203))
    b = fleet.nodes["b"]
    assert b.registration is not None
    loop_thread.run(b.registration.stop())  # b is killed: its lease is gone, and so is its server
    b.registration = None
    loop_thread.run(b.halt())
    loop_thread.run(view.wait_until(lambda m: set(m.nodes) == {"a", "c"}, 10))
    r = fleet.repairer("a", view)
    r.retention_of = policies.retention_of_key
    progress = fleet.one_pass(r)
    # Every run's replicas are a and c now: a, the one holder left, copies what is in its tenant's window.
    for scope, chains in ((acme, kept), (plain, fresh)):
        for hashes, _ in chains:
            assert "c" in _holders(tiers, scope, hashes)
    for hashes, _ in old:
        assert "c" not in _holders(tiers, plain, hashes)  # past its tenant's window: left to retention
    sent = progress.sent_bytes
    assert sent == sum(len(x) for _, blocks in kept + fresh for x in blocks)
    assert fleet.one_pass(r).sent_bytes == sent  # c's digests count acme's copies as a does: nothing sent again
