"""The Admin service end to end: a real server on loopback with tenants' tokens, a real LMDB
store moved by a ManualClock, the AdminClient and `kvstore policy` through kvstore.cli.main."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway import auth
from gateway.admin_servicer import SERVICE_NAME
from kvstore import api_tokens
from kvstore.client import Client
from kvstore.client.admin import AdminClient
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import FailedPrecondition, PermissionDenied, ResourceExhausted, Unauthenticated
from kvstore.geometry import V4_1_FLASH

HOUR = 3600.0
TOKENS = 16
BLOCK_BYTES = V4_1_FLASH.block_bytes(TOKENS)


def make_tokens(data_dir: Path) -> dict[str, str]:
    """Tokens in the store's tenants file: "ops" (admin), "acme" and "other" (read and write)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "tenants.json"
    rights = {"ops": {"read", "write", "admin"}, "acme": {"read", "write"}, "other": {"read", "write"}}
    return {name: api_tokens.create(path, name, frozenset(r))[1] for name, r in rights.items()}


@pytest.fixture
def store(tmp_path: Path) -> StoreSettings:
    """A store of two blocks."""
    return StoreSettings(data_dir=tmp_path / "store", capacity_bytes=2 * BLOCK_BYTES, block_tokens=TOKENS)


@pytest.fixture
def tokens(store: StoreSettings) -> dict[str, str]:
    return make_tokens(store.data_dir)


@pytest.fixture
def running(start_server: Callable[..., Any], store: StoreSettings, tokens: dict[str, str]) -> Any:
    return start_server(store)


@pytest.fixture
def admin(running: Any, tokens: dict[str, str]) -> Iterator[AdminClient]:
    with AdminClient(running.target, token=tokens["ops"]) as a:
        yield a


def put_prompt(target: str, token: str, seed: int, blocks: int = 1) -> list[int]:
    tokens = list(range(seed, seed + TOKENS * blocks))
    with Client(target, token=token) as c:
        c.put(tokens, [os.urandom(BLOCK_BYTES) for _ in range(blocks)])
    return tokens


def found(target: str, token: str, tokens: list[int]) -> int:
    with Client(target, token=token) as c:
        return c.lookup(tokens).found_blocks


def test_admin_calls_need_an_admin_token(running: Any, tokens: dict[str, str]) -> None:
    with AdminClient(running.target) as anonymous, pytest.raises(Unauthenticated):
        anonymous.get_policy("acme")
    with AdminClient(running.target, token=tokens["acme"]) as tenant, pytest.raises(PermissionDenied):
        tenant.set_policy("acme", retention_hours=1000)
    with AdminClient(running.target, token=tokens["ops"]) as ops:
        assert ops.get_policy("acme").policy.is_default


def test_the_servicer_itself_refuses_a_caller_without_the_admin_right(
        start_server: Callable[..., Any], store: StoreSettings, tokens: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for method in ("GetPolicy", "SetPolicy", "ListPolicies", "PolicyLog", "Purge", "ExportTenant", "ImportTenant"):
        monkeypatch.setitem(auth.METHOD_RIGHTS, f"/{SERVICE_NAME}/{method}", auth.ANY)  # the interceptor lets it by
    running = start_server(store)
    with AdminClient(running.target, token=tokens["acme"]) as tenant:
        with pytest.raises(PermissionDenied, match="'admin' right"):
            tenant.set_policy("acme", retention_hours=1000)
        with pytest.raises(PermissionDenied, match="'admin' right"):
            tenant.purge("other", all_blocks=True)


def test_policies_are_set_audited_and_persist_across_a_restart(
        start_server: Callable[..., Any], store: StoreSettings, tokens: dict[str, str],
        clock: ManualClock, loop_thread: Any) -> None:
    first = start_server(store)
    with AdminClient(first.target, token=tokens["ops"]) as ops:
        reply = ops.set_policy("acme", retention_hours=96, requests_per_s=100)
        assert (reply.before.policy.retention_hours, reply.after.policy.retention_hours) == (72, 96)
        with pytest.raises(FailedPrecondition, match="may only be raised: tenant 'acme' has 96 h"):
            ops.set_policy("acme", retention_hours=80)
    loop_thread.run(first.stop(0))
    clock.advance(60)
    again = start_server(store)
    with AdminClient(again.target, token=tokens["ops"]) as ops:
        got = ops.get_policy("acme")
        assert not got.policy.is_default
        assert (got.policy.policy.retention_hours, got.policy.policy.requests_per_s) == (96, 100)
        assert [p.tenant for p in ops.list_policies().policies] == ["acme"]
        [entry] = ops.policy_log(tenant="acme")
    assert (entry.actor, entry.action, entry.tenant, entry.time_s) == ("ops", "set_policy", "acme", clock.now() - 60)
    assert json.loads(entry.old_json) == {"retention_hours": 72.0, "requests_per_s": 0.0}
    assert json.loads(entry.new_json) == {"retention_hours": 96.0, "requests_per_s": 100.0}


def test_a_tenants_retention_governs_the_eviction_of_its_blocks(
        running: Any, admin: AdminClient, tokens: dict[str, str], clock: ManualClock) -> None:
    admin.set_policy("acme", retention_hours=96)
    kept = put_prompt(running.target, tokens["acme"], 0)
    clock.advance(80 * HOUR)  # past the store's 72 h, inside acme's 96 h
    with pytest.raises(ResourceExhausted):
        put_prompt(running.target, tokens["other"], 1000, blocks=2)  # needs acme's room
    assert found(running.target, tokens["acme"], kept) == 1


def test_purge_a_prompt_then_a_whole_tenant_audited(running: Any, admin: AdminClient,
                                                      tokens: dict[str, str]) -> None:
    a = put_prompt(running.target, tokens["acme"], 0)
    b = put_prompt(running.target, tokens["acme"], 500)
    assert admin.purge("acme", token_ids=a) == 1
    assert (found(running.target, tokens["acme"], a), found(running.target, tokens["acme"], b)) == (0, 1)
    assert admin.purge("acme", all_blocks=True) == 1
    assert found(running.target, tokens["acme"], b) == 0
    log = admin.policy_log(tenant="acme")
    assert [(e.actor, e.action) for e in log] == [("ops", "purge"), ("ops", "purge")]
    assert json.loads(log[0].old_json) == {"blocks": 2, "bytes": 2 * BLOCK_BYTES, "pins": 0, "pinned_bytes": 0}
    assert json.loads(log[1].new_json)["purged_blocks"] == 1


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`kvstore ARGV` through kvstore.cli.main: exit code, stdout, stderr."""
    from kvstore import cli as kvcli

    code = kvcli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_kvstore_policy_commands_end_to_end(running: Any, tokens: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    target = ("--target", running.target)
    monkeypatch.setenv("KVSTORE_TOKEN", tokens["ops"])
    code, out, _ = cli(capsys, "policy", "set", "acme", "--retention-hours", "96",
                       "--nvme-quota-bytes", "1MiB", *target)
    assert code == 0
    assert "retention_hours    72 -> 96" in out and "nvme_quota_bytes   0 (unlimited) -> 1,048,576 (1 MiB)" in out
    code, out, _ = cli(capsys, "policy", "get", "acme", "--json", *target)
    assert json.loads(out)["policy"]["nvme_quota_bytes"] == 1 << 20
    code, out, _ = cli(capsys, "policy", "list", *target)
    assert out.splitlines()[2].split()[:2] == ["acme", "96"]
    code, out, _ = cli(capsys, "policy", "log", "--json", *target)
    [entry] = json.loads(out)["entries"]
    assert (entry["actor"], entry["old"]["retention_hours"], entry["new"]["retention_hours"]) == ("ops", 72, 96)
    code, _, err = cli(capsys, "policy", "set", "acme", "--retention-hours", "80", *target)
    assert code == 2 and "FailedPrecondition: retention_hours may only be raised" in err
    code, out, _ = cli(capsys, "policy", "get", "acme", "--json", "--token", tokens["acme"], *target)
    assert code == 2 and json.loads(out)["error"]["code"] == "PERMISSION_DENIED"


def test_export_then_import_a_tenant_audited(running: Any, admin: AdminClient, tokens: dict[str, str],
                                             tmp_path: Path) -> None:
    a = put_prompt(running.target, tokens["acme"], 0)
    path = tmp_path / "acme.kvx"
    exported = admin.export_tenant("acme", path)
    assert exported.records == 1 and exported.bytes == path.stat().st_size
    admin.purge("acme", all_blocks=True)
    imported = admin.import_tenant("", path)  # into the tenant it came from
    assert (imported.tenant, imported.records, imported.written) == ("acme", 1, 1)
    assert found(running.target, tokens["acme"], a) == 1
    log = admin.policy_log(tenant="acme")
    assert [(e.actor, e.action) for e in log] == [("ops", "export"), ("ops", "purge"), ("ops", "import")]
    assert json.loads(log[0].new_json) == {"path": str(path), "records": 1, "bytes": exported.bytes}
    assert json.loads(log[2].new_json)["written"] == 1


def test_without_tenants_on_loopback_the_default_tenant_is_an_admin(start_server: Callable[..., Any],
                                                                    store: StoreSettings) -> None:
    running = start_server(store)  # no tenants file: the two-command start
    with AdminClient(running.target) as anyone:
        assert anyone.set_policy("default", requests_per_s=1000).after.policy.requests_per_s == 1000
        assert anyone.policy_log()[0].actor == "default"
