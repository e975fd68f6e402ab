"""Tenant policies (gateway.policies) and their audit log (gateway.audit) on real files, and
retention per tenant through a real LMDB tier moved by a ManualClock."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from gateway.audit import AuditLog
from gateway.policies import Policies, Policy
from gateway.validate import Layout
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes
from tiers.lmdb_tier import LmdbBlockTier

HOUR = 3600.0
TOKENS = 16
LAYOUT = Layout.of(V4_1_FLASH, TOKENS)
DEFAULTS = Policy(retention_hours=72.0, swa_ttl_s=300.0)


def open_policies(folder: Path, clock: ManualClock, defaults: Policy = DEFAULTS) -> Policies:
    return Policies(folder, defaults=defaults, max_swa_ttl_s=300.0, audit=AuditLog(folder, clock=clock))


def test_retention_may_only_be_raised(tmp_path: Path, clock: ManualClock) -> None:
    policies = open_policies(tmp_path, clock)
    policies.set("acme", {"retention_hours": 96}, actor="ops")
    with pytest.raises(FailedPrecondition, match=r"may only be raised: tenant 'acme' has 96 h"):
        policies.set("acme", {"retention_hours": 80}, actor="ops")
    assert policies.policy("acme").retention_hours == 96
    with pytest.raises(InvalidArgument, match="below the 72-hour floor"):
        policies.set("other", {"retention_hours": 71.9}, actor="ops")
    # A tenant on the defaults was promised the defaults' retention.
    raised = open_policies(tmp_path / "raised", clock, Policy(retention_hours=100.0, swa_ttl_s=300.0))
    with pytest.raises(FailedPrecondition, match="has 100 h"):
        raised.set("new", {"retention_hours": 90}, actor="ops")


def test_policy_values_out_of_range_are_refused_naming_the_field(tmp_path: Path, clock: ManualClock) -> None:
    policies = open_policies(tmp_path, clock)
    with pytest.raises(InvalidArgument, match=r"swa_ttl_s = 301 .* allowed \(0, 300\]"):
        policies.set("acme", {"swa_ttl_s": 301}, actor="ops")
    with pytest.raises(InvalidArgument, match=r"nvme_quota_bytes = 1\.5"):
        policies.set("acme", {"nvme_quota_bytes": 1.5}, actor="ops")
    with pytest.raises(InvalidArgument, match="requests_per_s = -1"):
        policies.set("acme", {"requests_per_s": -1}, actor="ops")
    with pytest.raises(InvalidArgument, match="unknown policy field"):
        policies.set("acme", {"colour": 1}, actor="ops")
    assert not policies.has_own("acme")


def test_policies_persist_across_a_restart(tmp_path: Path, clock: ManualClock) -> None:
    policies = open_policies(tmp_path, clock)
    policies.set("acme", {"retention_hours": 120, "nvme_quota_bytes": 1 << 30, "requests_per_s": 50}, actor="ops")
    policies.audit.close()
    again = open_policies(tmp_path, clock)
    assert again.policy("acme") == Policy(retention_hours=120.0, swa_ttl_s=300.0, nvme_quota_bytes=1 << 30,
                                          requests_per_s=50.0)
    assert again.own().keys() == {"acme"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.jsonl", "policies.json"]  # no temporary left


def test_a_policy_keeps_the_fields_set_and_follows_the_defaults_in_the_others(tmp_path: Path,
                                                                               clock: ManualClock) -> None:
    policies = open_policies(tmp_path, clock)
    policies.set("acme", {"nvme_quota_bytes": 1 << 30}, actor="ops")
    policies.audit.close()
    raised = open_policies(tmp_path, clock, Policy(retention_hours=96.0, swa_ttl_s=250.0))
    assert raised.policy("acme") == Policy(retention_hours=96.0, swa_ttl_s=250.0, nvme_quota_bytes=1 << 30)


def test_the_defaults_keep_the_highest_retention_they_were_served_with(tmp_path: Path, clock: ManualClock) -> None:
    open_policies(tmp_path, clock, Policy(retention_hours=96.0, swa_ttl_s=300.0)).audit.close()
    lowered = open_policies(tmp_path, clock, Policy(retention_hours=72.0, swa_ttl_s=300.0))
    assert lowered.retention_s("anyone") == 96 * HOUR


def test_every_change_is_audited_with_who_when_old_and_new(tmp_path: Path, clock: ManualClock,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    policies = open_policies(tmp_path, clock)
    with caplog.at_level(logging.INFO, logger="kvstore.audit"):
        policies.set("acme", {"retention_hours": 96, "swa_ttl_s": 300}, actor="ops")  # the TTL is unchanged
    clock.advance(60)
    policies.set("acme", {"retention_hours": 96}, actor="ops")  # no change: not audited
    policies.set("acme", {"retention_hours": 100}, actor="root")
    entries = policies.audit.entries()
    assert [(e.actor, e.action, e.tenant, e.old, e.new) for e in entries] == [
        ("ops", "set_policy", "acme", {"retention_hours": 72.0}, {"retention_hours": 96.0}),
        ("root", "set_policy", "acme", {"retention_hours": 96.0}, {"retention_hours": 100.0}),
    ]
    assert entries[1].time_s - entries[0].time_s == 60
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kvstore.audit"]
    assert logged == [{"event": "admin_change", "time_s": entries[0].time_s, "actor": "ops",
                       "action": "set_policy", "tenant": "acme", "old": {"retention_hours": 72.0},
                       "new": {"retention_hours": 96.0}}]


def test_the_audit_log_is_append_only_and_survives_a_torn_line(tmp_path: Path, clock: ManualClock) -> None:
    audit = AuditLog(tmp_path, clock=clock)
    audit.append(actor="ops", action="purge", tenant="a", old={"blocks": 3}, new={"blocks": 0})
    audit.close()
    with (tmp_path / "audit.jsonl").open("ab") as f:
        f.write(b'{"actor": "ops", "acti')  # a crash in the middle of a write
    again = AuditLog(tmp_path, clock=clock)
    again.append(actor="ops", action="purge", tenant="b", old=None, new={"blocks": 0})
    assert [e.tenant for e in again.entries()] == ["a", "b"]
    assert [e.tenant for e in again.entries(tenant="b")] == ["b"]
    assert [e.tenant for e in again.entries(limit=1)] == ["b"]


def test_a_change_that_cannot_be_audited_is_undone(tmp_path: Path, clock: ManualClock) -> None:
    policies = open_policies(tmp_path, clock)
    policies.audit.close()  # every append now fails
    with pytest.raises(OSError):
        policies.set("acme", {"retention_hours": 96}, actor="ops")
    assert not policies.has_own("acme")
    assert not open_policies(tmp_path, clock).has_own("acme")


# -- through the tier: the promise a block was written under ---------------------------


def put_block(tier: LmdbBlockTier, tenant: str, seed: int, blocks: int = 1) -> list[bytes]:
    tokens = list(range(seed, seed + TOKENS * blocks))
    hashes = chain_hashes(tokens, block_tokens=TOKENS, parent=LAYOUT.root)
    scope = BlockScope(V4_1_FLASH.fingerprint, tenant)
    tier.put(scope, LAYOUT.root, hashes, [os.urandom(LAYOUT.block_bytes) for _ in hashes], True)
    return hashes


def stored(tier: LmdbBlockTier, tenant: str, hashes: list[bytes]) -> int:
    return tier.lookup(BlockScope(V4_1_FLASH.fingerprint, tenant), hashes)[0]


def test_a_block_keeps_its_promise_after_the_policy_changes(tmp_path: Path, clock: ManualClock) -> None:
    """A block written under 96 h stays 96 h, then longer once retention is raised, and no longer.

    Retention only rises, so the current policy applied to every block is at least the
    policy each was written under: no block carries the policy it was written under.
    """
    settings = StoreSettings(data_dir=tmp_path / "store", capacity_bytes=2 * LAYOUT.block_bytes, block_tokens=TOKENS)
    tier = LmdbBlockTier(settings, clock=clock)
    try:
        policies = open_policies(tmp_path / "admin", clock)
        tier.set_retention_provider(policies.retention_s)
        policies.set("acme", {"retention_hours": 96}, actor="ops")
        kept = put_block(tier, "acme", 0)
        clock.advance(80 * HOUR)  # past the store's 72 h, inside acme's 96 h
        with pytest.raises(ResourceExhausted):
            put_block(tier, "other", 1000, blocks=2)  # needs acme's room
        policies.set("acme", {"retention_hours": 120}, actor="ops")
        clock.advance(30 * HOUR)  # 110 h: past the 96 h it was written under, inside the 120 h it has now
        with pytest.raises(ResourceExhausted):
            put_block(tier, "other", 1000, blocks=2)
        assert stored(tier, "acme", kept) == 1
        clock.advance(11 * HOUR)  # 121 h (and the minute of touch granularity): it may go
        put_block(tier, "other", 1000, blocks=2)
        assert stored(tier, "acme", kept) == 0
    finally:
        tier.close()


def test_f51_replication_is_one_to_five_copies_and_one_on_a_single_node(tmp_path: Path, clock: ManualClock) -> None:
    """docs/FLEET.md F51: a whole number of copies from 1 to 5; a single node keeps one (FAILED_PRECONDITION
    for more, naming why); the tenant's runs are found by their storage keys' namespace id."""
    policies = open_policies(tmp_path, clock)
    for bad in (0, 6, 2.5):
        with pytest.raises(InvalidArgument, match=rf"replication = {bad!r} .* a whole number from 1 to 5"):
            policies.set("acme", {"replication": bad}, actor="ops")
    with pytest.raises(FailedPrecondition, match=r"this server is a single node .* one copy of every block"):
        policies.set("acme", {"replication": 2}, actor="ops")
    policies.set("acme", {"replication": 1}, actor="ops")
    assert policies.policy("acme").replication == 1 and policies.defaults.replication == 1


def test_f51_the_replication_of_a_runs_key_is_its_tenants(tmp_path: Path, clock: ManualClock) -> None:
    """F51: re-replication asks by storage key; a tenant's own replication, else the defaults'."""
    class FleetPolicies(Policies):  # the fleet's table's rule (EtcdPolicies), on the file's storage
        fleet = True

    policies = FleetPolicies(tmp_path, defaults=Policy(retention_hours=72.0, swa_ttl_s=300.0,
                                                                     replication=2),
                                          max_swa_ttl_s=300.0, audit=AuditLog(tmp_path, clock=clock))
    acme, other = (BlockScope(V4_1_FLASH.fingerprint, t) for t in ("acme", "other"))
    policies.set("acme", {"replication": 3}, actor="ops")
    policies._own = dict(policies._own)  # as the fleet's table replaces them on each change it follows
    assert policies.replication_of_key(acme.key(bytes(32))) == 3
    assert policies.replication_of_key(other.key(bytes(32))) == 2
