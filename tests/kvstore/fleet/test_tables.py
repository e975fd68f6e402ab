"""The fleet's shared tables against a real etcd: tokens, policies, the audit log, migration (docs/FLEET.md).

Each test runs its coroutine with asyncio.run on the session's etcd, in a cluster
of its own (`fleet`); several tables of one cluster stand for several nodes. Waits
are on the tables' own change events (`WatchedPrefix.wait_until`), with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.policies import Policies, Policy
from gateway.shared_tables import (
    EtcdAudit,
    EtcdPolicies,
    EtcdTenants,
    SharedTablesCollector,
    open_fleet_admin,
    open_fleet_tenants,
    policies_watch,
    tokens_watch,
)
from kvstore import api_tokens
from kvstore.config import Settings, StoreSettings
from kvstore.config_sections import AuthSettings, FleetSettings
from kvstore.errors import ConfigError, FailedPrecondition, NotFound, Unavailable
from kvstore.fleet.endpoints import policies_prefix, policy_key, token_key
from kvstore.fleet.etcd import EtcdSession
from kvstore.fleet.membership import session_for
from kvstore.fleet.tables import create_token, read_tokens, revoke_tokens
from tests.kvstore.fleet.etcd_process import EtcdProcess

WAIT_S = 10.0


def run(coro: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro())  # type: ignore[arg-type]


async def put(fleet: FleetSettings, key: bytes, value: bytes) -> None:
    session = session_for(fleet)
    try:
        await session.call(lambda c: c.put(key, value))
    finally:
        await session.close()


async def tokens_table(fleet: FleetSettings) -> EtcdTenants:
    table = tokens_watch(session_for(fleet), fleet.cluster)
    await table.load()
    tenants = EtcdTenants(table)
    tenants.start(1.0)
    return tenants


async def policies_table(fleet: FleetSettings, *, follow: bool = True, max_entries: int = 100) -> EtcdPolicies:
    session = session_for(fleet)
    table = policies_watch(session, fleet.cluster)
    revision = await table.load()
    if follow:
        table.follow(revision)
    return EtcdPolicies(table, cluster=fleet.cluster, configured=Policy(retention_hours=72.0, swa_ttl_s=300.0),
                        max_swa_ttl_s=300.0, audit=EtcdAudit(session, fleet.cluster, max_entries=max_entries))


# -- tokens ---------------------------------------------------------------------------------------------------


def test_f22_a_token_created_anywhere_is_served_and_its_revocation_follows(fleet: FleetSettings) -> None:
    async def body() -> None:
        node = await tokens_table(fleet)  # a node's table, following etcd
        session = session_for(fleet)
        try:
            assert not node.enabled and node.find("kvst_00000000_x") is None
            record, token = await create_token(session, fleet.cluster, "acme", frozenset({"read"}))
            await node.table.wait_until(lambda t: record.token_id in t.rows, WAIT_S)
            assert node.enabled and node.find(token) is not None and node.find(token).tenant == "acme"  # type: ignore[union-attr]
            other, other_token = await create_token(session, fleet.cluster, "acme", frozenset({"read", "write"}))
            gone = await revoke_tokens(session, fleet.cluster, "acme", record.token_id)
            assert [r.token_id for r in gone] == [record.token_id] and gone[0].revoked_at
            await node.table.wait_until(lambda t: not t.rows[record.token_id].value.active, WAIT_S)
            assert node.find(token) is None and node.find(other_token) is not None
            assert node.enabled  # revoked records stay: auth never turns off
            with pytest.raises(NotFound, match="no active token"):
                await revoke_tokens(session, fleet.cluster, "acme", record.token_id)
            records, keys = await read_tokens(session, fleet.cluster)
            assert keys == 2 and {r.token_id for r, _ in records} == {record.token_id, other.token_id}
        finally:
            await session.close()
            await node.stop()

    run(body)


def test_f22_the_table_misses_no_change_between_its_load_and_its_watch(fleet: FleetSettings) -> None:
    async def body() -> None:
        session = session_for(fleet)
        table = tokens_watch(session_for(fleet), fleet.cluster)
        try:
            revision = await table.load()
            record, _token = await create_token(session, fleet.cluster, "acme", frozenset({"read"}))  # in the gap
            table.follow(revision)
            await table.wait_until(lambda t: record.token_id in t.rows, WAIT_S)
        finally:
            await session.close()
            await table.close()

    run(body)


def test_f23_a_damaged_token_record_is_skipped_logged_once_and_refused(fleet: FleetSettings,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        session = session_for(fleet)
        node = await tokens_table(fleet)
        try:
            good, good_token = await create_token(session, fleet.cluster, "acme", frozenset({"read"}))
            bad, bad_token = await create_token(session, fleet.cluster, "acme", frozenset({"read"}))
            await node.table.wait_until(lambda t: bad.token_id in t.rows, WAIT_S)
            assert node.find(bad_token) is not None
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="kvstore.fleet.tables"):
                await put(fleet, token_key(fleet.cluster, bad.token_id), b"\xff\xfe not json")
                wrong = api_tokens.record_to_json(good).replace(good.token_id.encode(), b"0badc0de")
                await put(fleet, token_key(fleet.cluster, "12345678"), wrong)  # names another id than its key
                await put(fleet, token_key(fleet.cluster, "aaaaaaaa"), b'{"token_id": "aaaaaaaa"}')
                await node.table.wait_until(lambda t: t.skipped == 3, WAIT_S)
                assert node.find(bad_token) is None  # fail closed: a damaged record's token is refused
                await node.table.load()  # a reload sees the same versions: not logged, not counted again
            assert node.table.skipped == 3
            assert node.find(bad_token) is None  # fail closed: a damaged record's token is refused
            assert node.find(good_token) is not None
            lines = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
            assert len(lines) == 3 and all("\n" not in line for line in lines), lines
            assert any(f"tenants/{bad.token_id}" in line and "not JSON" in line for line in lines)
            assert any("names token '0badc0de'" in line for line in lines)
        finally:
            await session.close()
            await node.stop()

    run(body)


# -- policies -------------------------------------------------------------------------------------------------


def test_f25_two_admins_through_two_nodes_lose_no_update(fleet: FleetSettings) -> None:
    async def body() -> None:
        a = await policies_table(fleet)
        b = await policies_table(fleet, follow=False)  # b has not seen a's change when it makes its own
        try:
            await a.change("acme", {"retention_hours": 96}, actor="ops-a")
            before, after = await b.change("acme", {"nvme_quota_bytes": 1 << 30}, actor="ops-b")
            assert before.retention_hours == 96  # checked against the newest policy, not b's stale one
            assert (after.retention_hours, after.nvme_quota_bytes) == (96, 1 << 30)
            await a.table.wait_until(lambda t: t.rows["acme"].value.get("nvme_quota_bytes") == 1 << 30, WAIT_S)
            assert (a.policy("acme").retention_hours, a.policy("acme").nvme_quota_bytes) == (96, 1 << 30)
            entries = await a.audit.read(tenant="acme")
            assert [(e.actor, e.new) for e in entries] == [("ops-a", {"retention_hours": 96.0}),
                                                            ("ops-b", {"nvme_quota_bytes": 1 << 30})]
        finally:
            await a.close()
            await b.close()

    run(body)


def test_f25_the_rules_hold_against_a_change_made_through_another_node(fleet: FleetSettings) -> None:
    async def body() -> None:
        a = await policies_table(fleet)
        b = await policies_table(fleet, follow=False)
        try:
            await a.change("acme", {"retention_hours": 120}, actor="ops")
            with pytest.raises(FailedPrecondition, match="may only be raised: tenant 'acme' has 120 h"):
                await b.change("acme", {"retention_hours": 100}, actor="ops")  # b still thinks 72
            assert len(await a.audit.read()) == 1  # the refused change wrote no entry
        finally:
            await a.close()
            await b.close()

    run(body)


def test_f26_a_change_reads_back_at_once_on_its_node_and_a_no_change_is_not_audited(fleet: FleetSettings) -> None:
    async def body() -> None:
        a = await policies_table(fleet, follow=False)  # no watch: what it reads back is its own write's note
        try:
            before, _ = await a.change("acme", {"swa_ttl_s": 60}, actor="ops")
            assert before is a.defaults and a.policy("acme").swa_ttl_s == 60 and a.has_own("acme")
            await a.change("acme", {"swa_ttl_s": 60}, actor="ops")
            assert len(await a.audit.read()) == 1
        finally:
            await a.close()

    run(body)


def test_f23_a_damaged_policy_keeps_its_last_good_version_while_serving(fleet: FleetSettings) -> None:
    async def body() -> None:
        a = await policies_table(fleet)
        try:
            await a.change("acme", {"retention_hours": 96}, actor="ops")
            await put(fleet, policy_key(fleet.cluster, "acme"), b'{"retention_hours": 1}')  # below the floor
            await a.table.wait_until(lambda t: t.skipped == 1, WAIT_S)
            assert a.policy("acme").retention_hours == 96  # never the shorter defaults
            _, after = await a.change("acme", {"requests_per_s": 5}, actor="ops")  # repairs it
            assert (after.retention_hours, after.requests_per_s) == (96, 5)
        finally:
            await a.close()

    run(body)


def test_f23_a_damaged_policy_in_etcd_stops_the_start(tmp_path: Path, fleet: FleetSettings) -> None:
    async def body() -> None:
        await put(fleet, policy_key(fleet.cluster, "acme"), b"[1, 2, 3]")
        with pytest.raises(ConfigError, match=r"policies/acme are damaged") as raised:
            await open_fleet_admin(settings(tmp_path, fleet))
        assert "\n" not in str(raised.value)

    run(body)


def test_f28_the_audit_log_keeps_its_last_entries(fleet: FleetSettings) -> None:
    async def body() -> None:
        session = session_for(fleet)
        audit = EtcdAudit(session, fleet.cluster, max_entries=5)
        try:
            for i in range(8):
                await audit.record(actor="ops", action="purge", tenant=f"t{i}", old=None, new={"i": i})
            entries = await audit.read()
            assert [e.tenant for e in entries] == [f"t{i}" for i in range(3, 8)]  # the last 5, oldest first
            assert [e.tenant for e in await audit.read(limit=2)] == ["t6", "t7"]
            assert [e.tenant for e in await audit.read(tenant="t4")] == ["t4"]
            await put(fleet, audit.prefix + b"99999999999999999999-x", b"\x00 torn")
            assert len(await audit.read()) == 5  # a damaged entry is skipped
        finally:
            await session.close()

    run(body)


def test_f24_writes_while_etcd_is_away_are_unavailable_naming_it(tmp_path: Path) -> None:
    from kvstore.bench.redis_server import free_port

    dead = f"127.0.0.1:{free_port()}"
    fleet = FleetSettings(etcd=dead, cluster="gone", lease_ttl_s=3)

    async def body() -> None:
        session = session_for(fleet)
        try:
            with pytest.raises(Unavailable, match=f"etcd does not answer at {dead}"):
                await create_token(session, "gone", "acme", frozenset({"read"}))
            with pytest.raises(Unavailable, match=f"etcd does not answer at {dead}"):
                await EtcdAudit(session, "gone").check_writable()
        finally:
            await session.close()
        with pytest.raises(Unavailable, match=f"etcd does not answer at {dead}"):
            await open_fleet_tenants(settings(tmp_path, fleet))

    run(body)


def test_f24_a_table_keeps_its_rows_marked_stale_while_etcd_is_away(own_etcd: EtcdProcess,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    fleet = FleetSettings(etcd=own_etcd.endpoint, cluster="stale", lease_ttl_s=3)

    def current() -> dict[str, float]:
        [family, *_] = SharedTablesCollector(lambda: {"tenants": node.table}).collect()
        return {s.labels["table"]: s.value for s in family.samples}

    async def body() -> None:
        session = session_for(fleet)
        _, token = await create_token(session, "stale", "acme", frozenset({"read"}))
        await session.close()
        node.table.retry_s = 0.05
        await node.table.start()
        assert current() == {"tenants": 1.0}
        with caplog.at_level(logging.WARNING, logger="kvstore.fleet.tables"):
            own_etcd.stop()
            await node.table.wait_until(lambda t: t.stale, WAIT_S)
            assert current() == {"tenants": 0.0} and node.find(token) is not None  # the last rows serve
            own_etcd.start()  # on its data; the table retries every 50 ms meanwhile, saying nothing more
            await node.table.wait_until(lambda t: not t.stale, WAIT_S)
        lost = [r for r in caplog.records if "lost etcd's watch" in r.getMessage()]
        back = [r for r in caplog.records if "etcd answers again" in r.getMessage()]
        assert len(lost) == 1 and len(back) == 1 and current() == {"tenants": 1.0}
        await node.stop()

    node = EtcdTenants(tokens_watch(session_for(fleet), "stale"))
    run(body)


# -- migration ------------------------------------------------------------------------------------------------


def settings(tmp_path: Path, fleet: FleetSettings) -> Settings:
    return Settings(store=StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 26, block_tokens=16),
                    fleet=fleet, auth=AuthSettings())


def test_f27_a_data_dirs_tenants_file_is_imported_once_then_refused_beside_etcds(tmp_path: Path,
                                                                               fleet: FleetSettings) -> None:
    first = settings(tmp_path / "a", fleet)
    second = settings(tmp_path / "b", fleet)
    path = first.auth.tenants_path(first.store.data_dir)
    _record, token = api_tokens.create(path, "acme", frozenset({"read"}))
    api_tokens.create(second.auth.tenants_path(second.store.data_dir), "other", frozenset({"read"}))

    async def body() -> None:
        tenants = await open_fleet_tenants(first)
        try:
            assert tenants.find(token) is not None and tenants.enabled
        finally:
            await tenants.stop()
        assert not path.exists() and path.with_name("tenants.json.imported").exists()
        again = await open_fleet_tenants(first)  # the restarted node: nothing to import
        await again.stop()
        with pytest.raises(ConfigError, match=r"b/store/tenants.json holds tenants for a single node, but fleet") \
                as raised:
            await open_fleet_tenants(second)
        assert "\n" not in str(raised.value)
        assert second.auth.tenants_path(second.store.data_dir).exists()  # left where it was

    run(body)


def test_f27_an_import_never_undoes_a_revocation_made_through_the_fleet(tmp_path: Path, fleet: FleetSettings) -> None:
    node = settings(tmp_path, fleet)
    path = node.auth.tenants_path(node.store.data_dir)
    _record, token = api_tokens.create(path, "acme", frozenset({"read"}))

    async def body() -> None:
        session = session_for(fleet)
        await (await open_fleet_tenants(node)).stop()  # imported
        path.with_name("tenants.json.imported").rename(path)  # the set-aside failed: the file is back
        await revoke_tokens(session, fleet.cluster, "acme")
        tenants = await open_fleet_tenants(node)  # this host's own import, resumed: absent keys only
        try:
            assert tenants.find(token) is None
        finally:
            await tenants.stop()
            await session.close()

    run(body)


def test_f27_a_data_dirs_policies_are_imported_once(tmp_path: Path, fleet: FleetSettings) -> None:
    node = settings(tmp_path, fleet)
    folder = node.store.data_dir / "admin"
    from gateway.audit import AuditLog

    local = Policies(folder, defaults=Policy(retention_hours=80.0, swa_ttl_s=300.0), max_swa_ttl_s=300.0,
                     audit=AuditLog(folder))
    local.set("acme", {"retention_hours": 200}, actor="ops")
    local.audit.close()

    async def body() -> None:
        parts = await open_fleet_admin(node)
        try:
            assert parts.policies.policy("acme").retention_hours == 200
            assert parts.policies.defaults.retention_hours == 80  # the file's floor came along
        finally:
            await parts.close()
        assert not (folder / "policies.json").exists() and (folder / "policies.json.imported").exists()
        session = EtcdSession(session_for(fleet).endpoints, timeout_s=3)
        try:
            found = await session.call(lambda c: c.get(policies_prefix(fleet.cluster) + b".defaults"))
            assert json.loads(found.value) == {"retention_floor_hours": 80.0}
        finally:
            await session.close()

    run(body)
