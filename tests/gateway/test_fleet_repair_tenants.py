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
