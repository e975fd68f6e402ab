"""Two real `kvstore serve` nodes of one fleet sharing tokens, policies and the audit log in a real etcd.

One module-scoped fleet (an etcd of its own, killed and restarted by the last
test, and nodes A and B as child processes); tokens are made and revoked with
`kvstore tenant` against one node's configuration, policies set through one
node's Admin service, and each is awaited on the other node with a deadline
(docs/FLEET.md, "Shared tables").
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstore import Client
from kvstore.cli import main
from kvstore.client.admin import AdminClient
from kvstore.config_sections import FleetSettings
from kvstore.errors import Unauthenticated, Unavailable
from kvstore.fleet.membership import session_for
from kvstore.fleet.tables import create_token
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess

DEADLINE_S = 30.0


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    """Poll `condition` until it holds; fail naming `what` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.02)


def accepted(target: str, token: str) -> bool:
    """Whether the node at `target` takes `token` (connecting asks GetInfo, which needs a valid token)."""
    try:
        Client(target, token=token, timeout_s=10).close()
    except Unauthenticated:
        return False
    return True


@dataclass
class Fleet:
    etcd: EtcdProcess
    settings: FleetSettings
    a: Child
    b: Child
    config_a: Path
    config_b: Path
    admin: str

    def admin_client(self, node: Child) -> AdminClient:
        return AdminClient(node.target, token=self.admin, timeout_s=10)


@pytest.fixture(scope="module")
def fleet2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet2")
    etcd = EtcdProcess(root / "etcd").start()
    settings = FleetSettings(etcd=etcd.endpoint, cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=3)

    async def bootstrap() -> str:  # the first admin token, so auth is on when the nodes start
        session = session_for(settings)
        try:
            return (await create_token(session, settings.cluster, "ops", frozenset({"read", "write", "admin"})))[1]
        finally:
            await session.close()

    admin = asyncio.run(bootstrap())
    fleet: dict[str, object] = {"etcd": settings.etcd, "cluster": settings.cluster, "lease_ttl_s": settings.lease_ttl_s}
    if "token_file" in FleetSettings.__dataclass_fields__:  # with tenant auth on, nodes need the fleet's own token
        (root / "fleet.token").write_text(uuid.uuid4().hex * 2)
        fleet["token_file"] = str(root / "fleet.token")
    configs = [write_config(root / f"{n}.toml", {
        "store": {"data_dir": str(root / n), "capacity_bytes": 1 << 26, "block_tokens": 16}, "fleet": fleet,
    }) for n in ("a", "b")]
    nodes: list[Child] = []
    try:
        for name, cfg in zip("ab", configs, strict=True):
            nodes.append(Child(name, ["serve", "--config", str(cfg), "--port", "0"], root / "logs"))
        yield Fleet(etcd=etcd, settings=settings, a=nodes[0], b=nodes[1], config_a=configs[0],
                    config_b=configs[1], admin=admin)
    finally:
        for node in nodes:
            node.kill_if_alive()
        etcd.stop()


def tenant(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["tenant", *args, "--json"])
    out = capsys.readouterr().out.strip()
    return code, json.loads(out) if out else {}


def test_f22_a_token_made_through_one_node_works_on_the_other_and_its_revocation_too(
        fleet2: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    code, made = tenant(capsys, "create", "acme", "--config", str(fleet2.config_a))
    assert code == 0 and made["tenants_file"].startswith(f"etcd {fleet2.settings.etcd}")
    wait_for("node B taking the token made through A", lambda: accepted(fleet2.b.target, made["token"]))
    assert accepted(fleet2.a.target, made["token"])

    code, gone = tenant(capsys, "revoke", "acme", "--config", str(fleet2.config_b))
    assert code == 0 and gone["revoked"] == [made["token_id"]]
    wait_for("node A refusing the token revoked through B", lambda: not accepted(fleet2.a.target, made["token"]))
    assert not accepted(fleet2.b.target, made["token"])
    code, listed = tenant(capsys, "list", "--config", str(fleet2.config_a))
    assert code == 0 and listed["auth"]
    [row] = [t for t in listed["tokens"] if t["token_id"] == made["token_id"]]
    assert row["tenant"] == "acme" and row["revoked_at"]


def test_f25_policies_set_through_either_node_hold_on_both_and_none_is_lost(
        fleet2: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    with fleet2.admin_client(fleet2.a) as a, fleet2.admin_client(fleet2.b) as b:
        assert main(["policy", "set", "acme", "--retention-hours", "96", "--target", fleet2.a.target,
                     "--token", fleet2.admin]) == 0
        assert "policy changed (audited)" in capsys.readouterr().out
        wait_for("node B serving the policy set through A",
                 lambda: b.get_policy("acme").policy.policy.retention_hours == 96)

        # Two admins at once, through two nodes, on one tenant: both changes land.
        start = threading.Barrier(2)
        errors: list[BaseException] = []

        def set_through(client: AdminClient, fields: dict[str, Any]) -> None:
            try:
                start.wait(timeout=DEADLINE_S)
                client.set_policy("beta", **fields)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=set_through, args=(a, {"nvme_quota_bytes": 1 << 30})),
                   threading.Thread(target=set_through, args=(b, {"requests_per_s": 5.0}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=DEADLINE_S)
        assert errors == []
        for client in (a, b):
            wait_for("both changes served", lambda c=client: (  # type: ignore[misc]
                c.get_policy("beta").policy.policy.nvme_quota_bytes == 1 << 30
                and c.get_policy("beta").policy.policy.requests_per_s == 5.0))

        # One audit log: every change through either node, in both nodes' answers.
        log_a, log_b = a.policy_log(), b.policy_log()
        assert main(["policy", "log", "--tenant", "beta", "--target", fleet2.b.target, "--token", fleet2.admin,
                     "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out)["entries"]) == 2
        assert [(e.tenant, e.action) for e in log_a] == [(e.tenant, e.action) for e in log_b]
        assert sorted((e.tenant, e.new_json) for e in log_a if e.action == "set_policy") == [
            ("acme", '{"retention_hours": 96.0}'), ("beta", '{"nvme_quota_bytes": 1073741824}'),
            ("beta", '{"requests_per_s": 5.0}')]


def test_f24_with_etcd_gone_nodes_serve_their_last_tables_and_refuse_changes(
        fleet2: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    code, made = tenant(capsys, "create", "gamma", "--config", str(fleet2.config_b))
    assert code == 0
    wait_for("node A taking gamma's token", lambda: accepted(fleet2.a.target, made["token"]))
    _, old = tenant(capsys, "create", "delta", "--config", str(fleet2.config_a))
    tenant(capsys, "revoke", "delta", "--config", str(fleet2.config_a))
    wait_for("node B refusing delta's token", lambda: not accepted(fleet2.b.target, old["token"]))

    with Client(fleet2.a.target, token=fleet2.admin, namespace="gamma", timeout_s=10) as writer:
        writer.put(list(range(16)), [bytes(writer.block_bytes)])  # one block of gamma's on node A

    fleet2.etcd.stop()  # SIGKILL
    for node in (fleet2.a, fleet2.b):
        wait_for(f"node {node.name} saying it lost etcd's watch",
                 lambda n=node: "lost etcd's watch of the tenants table" in n.log())  # type: ignore[misc]
        assert accepted(node.target, made["token"]) and not accepted(node.target, old["token"])
        with Client(node.target, token=made["token"], timeout_s=10) as client:
            found = client.lookup(list(range(16))).found_tokens  # the data plane answers
            assert found == 16 or (node is fleet2.b and found == 0)  # B holds it once re-replication copied it
        with fleet2.admin_client(node) as admin, pytest.raises(Unavailable, match=(
                f"etcd does not answer at {fleet2.settings.etcd}")):
            admin.set_policy("gamma", retention_hours=100)
        with fleet2.admin_client(node) as admin:
            assert admin.get_policy("acme").policy.policy.retention_hours == 96  # reads: the last table
            with pytest.raises(Unavailable, match="etcd does not answer"):  # refused before deleting anything
                admin.purge("gamma", all_blocks=True)
    with Client(fleet2.a.target, token=made["token"], timeout_s=10) as client:
        assert client.lookup(list(range(16))).found_tokens == 16  # the purge that could not be audited did nothing
    code = main(["tenant", "create", "epsilon", "--config", str(fleet2.config_a)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"etcd does not answer at {fleet2.settings.etcd}" in err[0]

    fleet2.etcd.start()  # on its data: every table and revision as they were

    def changed(node: Child) -> bool:
        with fleet2.admin_client(node) as admin:
            try:
                admin.set_policy("gamma", retention_hours=100 + (node is fleet2.b))
            except Unavailable:
                return False
        return True

    for node in (fleet2.a, fleet2.b):
        wait_for(f"a change through node {node.name} once etcd is back", lambda n=node: changed(n))  # type: ignore[misc]
    with fleet2.admin_client(fleet2.a) as a:
        wait_for("node A serving B's change", lambda: a.get_policy("gamma").policy.policy.retention_hours == 101)
    assert tenant(capsys, "create", "epsilon", "--config", str(fleet2.config_a))[0] == 0
