"""Tenants in the simulation: each served under its policy by the gateway's own policy table (retention R18,
NVMe quota R19) and SWA ledger (TTL cap, swa_quota_bytes), and reported per tenant; and the index's
vector refresh keeping the LRU index a walk sees."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.audit import AuditLog
from gateway.policies import Policies, Policy
from kvstore.cli import main
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import namespace_id
from kvstore.trace import sim_index
from kvstore.trace.load import load_trace
from kvstore.trace.requests import Trace
from kvstore.trace.sim_policies import parse_policy
from kvstore.trace.sim_report import result_dict, summary
from kvstore.trace.simulate import SimSettings, Simulation
from tiers.retention import TOUCH_GRANULARITY_S

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
BLOCK = V4_1_FLASH.block_bytes(64)


@pytest.fixture(scope="module")
def mooncake() -> Trace:
    return load_trace(FIXTURES / "mooncake.jsonl")


@pytest.fixture(scope="module")
def apart(mooncake: Trace) -> Trace:
    """The Mooncake lines two minutes apart: past R4's extra minute, so a 0 h store may evict."""
    return Trace(name="apart", kind="mooncake",
                 requests=[replace(r, arrival_s=120.0 * i) for i, r in enumerate(mooncake.requests)])


@pytest.fixture(scope="module")
def two_weka() -> Trace:
    """The weka session twice over, as two sessions of their own (two id scopes)."""
    weka = load_trace(FIXTURES / "weka_session.json")
    both = [replace(r, session=f"{tag}/{r.session}", scope=f"{tag}/{r.scope}") for tag in ("a", "b")
            for r in weka.requests]
    return Trace(name="two", kind="weka", requests=sorted(both, key=lambda r: r.arrival_s))


def test_a_tenants_longer_retention_keeps_its_blocks_when_the_store_evicts(apart: Trace) -> None:
    # the store keeps 0 h; tenant-1's policy promises 72 h (R18): only tenant-0's blocks may go
    settings = SimSettings(capacity_bytes=300 * BLOCK, retention_hours=0, swa_ttl_s=0, tenants=2,
                           policies={"tenant-1": {"retention_hours": 72}})
    result = Simulation(settings).run(apart)
    t0, t1 = result.tenants["tenant-0"], result.tenants["tenant-1"]
    assert t1.policy.retention_hours == 72 and t0.policy.retention_hours == 0
    assert t0.evicted_blocks > 0 and t1.evicted_blocks == 0
    # every eviction past the store's 0 h (R4), each within minutes of its last use: a 168 h retention keeps it
    assert result.total.evicted_inside_retention == 0
    assert result.total.evicted_inside_longer == result.total.evicted_blocks == t0.evicted_blocks
    assert t0.tally.requests + t1.tally.requests == result.total.requests == len(apart.requests)
    assert t0.stored_bytes + t1.stored_bytes == result.node_bytes["node-0"] <= 300 * BLOCK


def test_a_tenants_nvme_quota_refuses_its_puts_only(mooncake: Trace) -> None:
    quota = 40 * BLOCK
    result = Simulation(SimSettings(tenants=2, policies={"tenant-1": {"nvme_quota_bytes": quota}})).run(mooncake)
    t0, t1 = result.tenants["tenant-0"], result.tenants["tenant-1"]
    assert 0 < t1.peak_stored_bytes <= quota and t1.tally.refused_puts > 0  # R19, within retention: refused
    assert t0.tally.refused_puts == 0 and t0.stored_bytes > quota
    # tenants never share blocks: each one's keys live in its own namespace
    alone = Simulation(SimSettings(tenants=2)).run(mooncake)
    assert alone.tenants["tenant-0"].tally.found_tokens == t0.tally.found_tokens
    assert sum(t.stored_bytes for t in alone.tenants.values()) == alone.node_bytes["node-0"]


def test_a_tenants_swa_ttl_and_quota_apply_to_its_snapshots(two_weka: Trace) -> None:
    base = Simulation(SimSettings(tenants=2, swa_ttl_s=3600)).run(two_weka)
    assert all(t.tally.snapshot_resumes > 0 for t in base.tenants.values())
    short = Simulation(SimSettings(tenants=2, swa_ttl_s=3600, policies={"tenant-1": {"swa_ttl_s": 1}})).run(two_weka)
    assert short.tenants["tenant-1"].tally.snapshot_resumes == 0  # the TTL capped at the tenant's (1 s)
    assert short.tenants["tenant-0"].tally.snapshot_resumes == base.tenants["tenant-0"].tally.snapshot_resumes
    capped = Simulation(SimSettings(tenants=2, swa_ttl_s=3600,
                                    policies={"tenant-0": {"swa_quota_bytes": 1}})).run(two_weka)
    t0 = capped.tenants["tenant-0"].tally
    assert t0.snapshot_resumes == 0 and t0.swa_refused == t0.requests  # every snapshot past 1 byte: refused
    assert capped.tenants["tenant-1"].tally.swa_refused == 0


def test_policies_are_checked_by_the_gateways_rules(mooncake: Trace) -> None:
    with pytest.raises(InvalidArgument, match="below the 72-hour floor"):
        Simulation(SimSettings(tenants=2, policies={"tenant-1": {"retention_hours": 24}}))
    with pytest.raises(FailedPrecondition, match="may only be raised"):
        Simulation(SimSettings(tenants=2, retention_hours=168, policies={"tenant-1": {"retention_hours": 100}}))
    with pytest.raises(InvalidArgument, match="unknown policy field"):
        Simulation(SimSettings(tenants=2, policies={"tenant-1": {"retention": 100}}))
    assert parse_policy("acme:retention_hours=168,nvme_quota_bytes=0", int) == (
        "acme", {"retention_hours": 168.0, "nvme_quota_bytes": 0.0})
    with pytest.raises(InvalidArgument, match="TENANT:field=value"):
        parse_policy("retention_hours=168", int)


def test_a_servers_policies_file_is_read_by_its_own_reader(mooncake: Trace, tmp_path: Path) -> None:
    admin = tmp_path / "admin"
    table = Policies(admin, defaults=Policy(retention_hours=72, swa_ttl_s=300), max_swa_ttl_s=300,
                     audit=AuditLog(admin))
    table.set("tenant-1", {"nvme_quota_bytes": 40 * BLOCK, "retention_hours": 96}, actor="test")
    table.audit.close()
    result = Simulation(SimSettings(tenants=2, policies_file=admin / "policies.json")).run(mooncake)
    t1 = result.tenants["tenant-1"]
    assert t1.policy.retention_hours == 96 and t1.policy.nvme_quota_bytes == 40 * BLOCK
    assert 0 < t1.peak_stored_bytes <= 40 * BLOCK and t1.tally.refused_puts > 0


def test_kvstore_traces_name_their_tenants(mooncake: Trace) -> None:
    own = Trace(name="own", kind="kvstore", requests=[
        replace(r, scope=f"{'acme' if i % 3 else 'beta'}/{V4_1_FLASH.name}") for i, r in enumerate(mooncake.requests)])
    result = Simulation(SimSettings()).run(own)
    assert sorted(result.tenants) == ["acme", "beta"]
    assert result.tenants["beta"].tally.requests == 20 and result.tenants["acme"].tally.requests == 40


def test_refreshes_noted_as_flags_give_the_same_walks(apart: Trace, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = SimSettings(capacity_bytes=300 * BLOCK, retention_hours=0)
    listed = Simulation(settings).run(apart)
    monkeypatch.setattr(sim_index, "_STALE_LIST_MAX", 4)  # every few refreshed blocks: the array of flags
    sim = Simulation(settings)
    flagged = sim.run(apart)
    assert sim.nodes["node-0"].index._dirty is not None or flagged.total.evicted_blocks > 0
    assert flagged.total == listed.total and flagged.total.evicted_blocks > 0
    index = sim.nodes["node-0"].index
    assert list(index.synced_lru()) == sorted(  # every entry where its block's last use puts it
        sim_index.lru_key(b.last_access_s, b.depth, k) for k, b in index.records())


def test_the_command_reports_each_tenant(capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(FIXTURES / "mooncake.jsonl")
    assert main(["trace", "simulate", trace, "--tenants", "2", "--policy", "tenant-1:nvme_quota_bytes=2MB",
                 "--json"]) == 0
    tenants = json.loads(capsys.readouterr().out)["runs"][0]["tenants"]
    assert tenants["tenant-1"]["policy"]["nvme_quota_bytes"] == 2 * 10**6 and tenants["tenant-1"]["refused_puts"] > 0
    assert tenants["tenant-0"]["policy"]["nvme_quota_bytes"] == 0 and tenants["tenant-0"]["refused_puts"] == 0
    assert main(["trace", "simulate", trace, "--tenants", "2", "--policy", "tenant-1:retention_hours=168"]) == 0
    assert any(line.startswith("tenant-1") and "168h" in line for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize("small", [0, 1000], ids=["vector", "block-by-block"])
def test_a_get_refreshes_the_fetched_prefix_and_its_bytes_move_to_the_hour_of_use(
        mooncake: Trace, small: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # two prompts sharing a prefix, an hour apart: the second's Get records a use of the shared blocks (R5)
    monkeypatch.setattr(sim_index, "_SMALL_REFRESH", small)
    sim = Simulation(SimSettings(swa_ttl_s=0))
    keys = [sim.keys_of(r)[0] for r in mooncake.requests]
    i, j = next((i, j) for i in range(len(keys)) for j in range(i + 1, len(keys))
                if len(keys[i]) > 8 and keys[j][:8] == keys[i][:8])
    first, second = replace(mooncake.requests[i], arrival_s=0.0), replace(mooncake.requests[j], arrival_s=3600.0)
    sim = Simulation(SimSettings(swa_ttl_s=0))
    sim.run(Trace(name="pair", kind="mooncake", requests=[first, second]))
    index = sim.nodes["node-0"].index
    shared = next(n for n, (a, b) in enumerate(zip(keys[i], keys[j], strict=False)) if a != b) if any(
        a != b for a, b in zip(keys[i], keys[j], strict=False)) else min(len(keys[i]), len(keys[j]))
    uses = [index.meta(k).last_access_s for k in keys[i]]  # type: ignore[union-attr]
    assert uses[:shared] == [3600.0] * shared and set(uses[shared:]) <= {0.0}
    assert index.bytes_used_since(3600.0) == BLOCK * sum(1 for _, b in index.records() if b.last_access_s >= 3600)
    assert index.bytes_used_since(0.0) == index.usage.stored_bytes


def _kept_by_the_records(sim: Simulation, tenant: str, retention_s: float, end_s: float) -> int:
    """The tenant's bytes whose last use is within `retention_s` of `end_s` (to a bucket), from every record."""
    index, width = sim.nodes["node-0"].index, sim.settings.bucket_s
    first = int((end_s - retention_s - TOUCH_GRANULARITY_S) // width)
    return sum(b.size_bytes for k, b in index.records()
               if k[8:16] == namespace_id(tenant) and int(b.last_access_s // width) >= first)


@pytest.mark.parametrize("small", [0, 1000], ids=["vector", "block-by-block"])
def test_each_tenants_bytes_within_its_own_retention_are_reported(apart: Trace, small: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # the store keeps 0 h (R4 at its floor here) and evicts under a small capacity; tenant-1's policy keeps 72 h
    monkeypatch.setattr(sim_index, "_SMALL_REFRESH", small)
    settings = SimSettings(capacity_bytes=3000 * BLOCK, retention_hours=0, swa_ttl_s=0, tenants=2, bucket_s=600)
    even = Simulation(settings).run(apart)
    # everyone at the store's retention: the tenants' bytes add up to the store's, bucket by bucket
    assert all(sum(b.tenant_retained_bytes.values()) == b.retained_bytes for b in even.buckets)
    assert even.peak_retained_by_policy_bytes == even.peak_retained_bytes > 0
    sim = Simulation(replace(settings, policies={"tenant-1": {"retention_hours": 72}}))
    result = sim.run(apart)
    t0, t1 = result.tenants["tenant-0"], result.tenants["tenant-1"]
    assert t0.evicted_blocks > 0 and t1.evicted_blocks == 0
    end_s = result.buckets[-1].start_s + settings.bucket_s
    assert t0.retained_bytes == _kept_by_the_records(sim, "tenant-0", 0, end_s) < t0.stored_bytes
    assert t1.retained_bytes == _kept_by_the_records(sim, "tenant-1", 72 * 3600, end_s) == t1.stored_bytes
    assert t1.peak_retained_bytes == max(b.tenant_retained_bytes["tenant-1"] for b in result.buckets)
    # what the store must keep with tenant-1's 72 h: more than the store's own retention says
    assert result.peak_retained_by_policy_bytes == max(sum(b.tenant_retained_bytes.values()) for b in result.buckets)
    assert result.peak_retained_by_policy_bytes > result.peak_retained_bytes
    shown = result_dict(result)
    assert shown["tenants"]["tenant-1"]["peak_retained_bytes"] == t1.peak_retained_bytes
    assert shown["peak_retained_by_policy_bytes"] == result.peak_retained_by_policy_bytes
    assert any("each tenant within its own retention" in line for line in summary(result))


def test_the_sweep_draws_a_png_or_names_what_it_needs(mooncake: Trace, tmp_path: Path) -> None:
    from kvstore.errors import FailedPrecondition
    from kvstore.trace.sim_plot import plot

    results = [(f"cap {c}", Simulation(SimSettings(capacity_bytes=c * BLOCK)).run(mooncake)) for c in (100, 1 << 20)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(FailedPrecondition, match="--png needs matplotlib"):
            plot(results, tmp_path / "sweep.png")
        return
    plot(results, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_pauses_the_cyclic_collector_and_leaves_it_as_it_was(mooncake: Trace) -> None:
    import gc

    seen: list[bool] = []
    Simulation(SimSettings()).run(mooncake, progress=lambda done: seen.append(gc.isenabled()))
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        Simulation(SimSettings()).run(mooncake)
        assert not gc.isenabled()
    finally:
        gc.enable()
