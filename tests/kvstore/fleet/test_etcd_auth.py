"""etcd's user authentication (docs/FLEET.md F70) against a real etcd with auth enabled (etcdctl user add, role
grant-permission, auth enable): a node and a gateway from [fleet] etcd_user/etcd_password_file, a client from an
etcd:// address's user=&password_file=, `kvstore fleet status` from flags and `kvstore tenant` through the address;
a wrong password and a missing user UNAUTHENTICATED, a role without the fleet's keys PERMISSION_DENIED, each
naming what to set; the password in no log or output."""

from __future__ import annotations

import json
import os
import random
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import pytest

import kvstore
from kvstore.cli import main
from kvstore.client.fleet import FleetClient
from kvstore.errors import ConfigError, PermissionDenied, Unauthenticated, Unavailable
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until

BLOCK_TOKENS = 16
#: The node's password: never on a command line, in a config, a log or an output (the fixture's etcdctl reads
#: every password from its stdin too).
PASSWORD = f"pw-{uuid.uuid4().hex}"


@dataclass
class AuthEtcd:
    """An etcd with auth on: `kvnode` may read and write the cluster's keys, `outsider` only /other/."""

    endpoint: str
    cluster: str
    password_file: Path
    wrong_file: Path
    outsider_file: Path
    root_password: str


def _etcdctl(endpoint: str, *args: str, stdin: str = "", user: str | None = None) -> None:
    command = ["etcdctl", "--endpoints", endpoint, *(["--user", user] if user else []), *args]
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=30,
                          env={**os.environ, "ETCDCTL_API": "3"})
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthEtcd]:
    tmp = tmp_path_factory.mktemp("etcd-auth")
    process = EtcdProcess(tmp / "etcd").start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    root_pw, outsider_pw = uuid.uuid4().hex, uuid.uuid4().hex
    ep = process.endpoint
    try:
        _etcdctl(ep, "user", "add", "root", "--interactive=false", stdin=root_pw + "\n")
        _etcdctl(ep, "role", "add", "root")
        _etcdctl(ep, "user", "grant-role", "root", "root")
        for user, password, prefix in (("kvnode", PASSWORD, f"/kvstore/{cluster}/"), ("outsider", outsider_pw,
                                                                                      "/other/")):
            _etcdctl(ep, "user", "add", user, "--interactive=false", stdin=password + "\n")
            _etcdctl(ep, "role", "add", user)
            _etcdctl(ep, "role", "grant-permission", user, "--prefix=true", "readwrite", prefix)
            _etcdctl(ep, "user", "grant-role", user, user)
        _etcdctl(ep, "auth", "enable")
        files = {}
        for name, text in (("pw", PASSWORD), ("wrong", "not-" + PASSWORD), ("outsider", outsider_pw)):
            files[name] = tmp / f"{name}.txt"
            files[name].write_text(text + "\n")
            files[name].chmod(0o600)
        yield AuthEtcd(endpoint=ep, cluster=cluster, password_file=files["pw"], wrong_file=files["wrong"],
                       outsider_file=files["outsider"], root_password=root_pw)
    finally:
        process.stop()


def _address(etcd: AuthEtcd, user: str = "kvnode", password_file: Path | None = None) -> str:
    query = urlencode({"user": user, "password_file": str(password_file or etcd.password_file)})
    return f"etcd://{etcd.endpoint}/{etcd.cluster}?{query}"


def _joined(address: str) -> bool:
    try:
        with kvstore.Client(address, timeout_s=5) as client:
            return bool(client.view.nodes)  # type: ignore[attr-defined]
    except Unavailable:
        return False


def test_f70_nodes_gateways_clients_and_commands_authenticate_to_etcd(etcd: AuthEtcd, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    fleet = {"etcd": etcd.endpoint, "cluster": etcd.cluster, "run_blocks": 4, "lease_ttl_s": 10,
             "etcd_user": "kvnode", "etcd_password_file": str(etcd.password_file)}
    children: list[Child] = []
    try:
        cfg = write_config(tmp_path / "node.toml", {"store": {"data_dir": str(tmp_path / "store"),
                                                              "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
                                                    "fleet": fleet})
        children.append(Child("node", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs"))
        address = _address(etcd)
        wait_until(lambda: _joined(address), "the node registered in etcd as kvnode")
        tokens = [random.randrange(50_000) for _ in range(12 * BLOCK_TOKENS)]  # 3 runs
        with kvstore.Client(address) as client:
            assert isinstance(client, FleetClient)
            data = [random.randbytes(client.block_bytes) for _ in range(12)]
            client.put(tokens, data)
            assert client.lookup(tokens).found_blocks == 12
        gw_cfg = write_config(tmp_path / "gw.toml", {"store": {"data_dir": str(tmp_path / "none"),
                                                               "block_tokens": BLOCK_TOKENS}, "fleet": fleet})
        children.append(Child("gateway", ["gateway", "--config", str(gw_cfg), "--port", "0"], tmp_path / "logs"))
        with kvstore.Client(children[-1].target) as through_gateway:  # its view and tables follow etcd as kvnode
            assert through_gateway.get(tokens).blocks == data

        assert main(["fleet", "status", "--etcd", etcd.endpoint, "--cluster", etcd.cluster, "--json",
                     "--etcd-user", "kvnode", "--etcd-password-file", str(etcd.password_file)]) == 0
        assert len(json.loads(capsys.readouterr().out)["nodes"]) == 1
        assert main(["tenant", "create", "acme", "--target", address]) == 0
        assert main(["tenant", "list", "--target", address]) == 0
        out = capsys.readouterr().out
        assert "acme" in out and PASSWORD not in out
        for child in children:
            assert PASSWORD not in child.log()
    finally:
        for child in children:
            child.kill_if_alive()


def test_f70_a_wrong_password_or_no_user_is_unauthenticated_and_a_role_without_the_keys_permission_denied(
        etcd: AuthEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(Unauthenticated, match=r"refused user 'kvnode': etcdserver: authentication failed") as wrong:
        kvstore.Client(_address(etcd, password_file=etcd.wrong_file), timeout_s=3)
    assert "etcd_password_file" in wrong.value.hint and PASSWORD not in str(wrong.value)
    with pytest.raises(Unauthenticated, match="has authentication on and this process gave no user") as none:
        kvstore.Client(f"etcd://{etcd.endpoint}/{etcd.cluster}", timeout_s=3)
    assert "user=NAME&password_file=PATH" in none.value.hint
    with pytest.raises(PermissionDenied, match="denied user 'outsider'") as denied:
        kvstore.Client(_address(etcd, user="outsider", password_file=etcd.outsider_file), timeout_s=3)
    assert "readwrite /kvstore/CLUSTER/" in denied.value.hint
    with pytest.raises(ConfigError, match=r"password file '.*missing.txt' cannot be read"):
        kvstore.Client(_address(etcd, password_file=tmp_path / "missing.txt"), timeout_s=3)

    assert main(["fleet", "status", "--etcd", etcd.endpoint, "--cluster", etcd.cluster, "--etcd-user", "kvnode",
                 "--etcd-password-file", str(etcd.wrong_file)]) == 2
    err = capsys.readouterr().err
    assert "refused user 'kvnode'" in err and len(err.strip().splitlines()) <= 2
    cfg = write_config(tmp_path / "node.toml", {
        "store": {"data_dir": str(tmp_path / "store"), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
        "fleet": {"etcd": etcd.endpoint, "cluster": etcd.cluster, "etcd_user": "kvnode",
                  "etcd_password_file": str(etcd.wrong_file)}})
    with pytest.raises(AssertionError, match=r"did not start \(exit 2\)(.|\n)*refused user 'kvnode'"):
        Child("node", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs")


def test_f70_a_token_etcd_forgot_is_answered_by_authenticating_again(etcd: AuthEtcd) -> None:
    """F70: a session whose token etcd no longer knows (here: auth disabled and enabled again, which drops every
    token, as its expiry while idle or a restart does) authenticates again, once, and the call goes through."""
    import asyncio

    from kvstore.fleet.endpoints import EtcdAuth, parse_endpoints
    from kvstore.fleet.etcd import EtcdSession

    async def run() -> None:
        session = EtcdSession(parse_endpoints(etcd.endpoint), timeout_s=5.0,
                              auth=EtcdAuth(user="kvnode", password_file=str(etcd.password_file)))
        key = f"/kvstore/{etcd.cluster}/probe".encode()
        try:
            await session.call(lambda c: c.put(key, b"1"))
            root = f"root:{etcd.root_password}"
            await asyncio.to_thread(_etcdctl, etcd.endpoint, "auth", "disable", user=root)
            await asyncio.to_thread(_etcdctl, etcd.endpoint, "auth", "enable", user=root)
            got = await session.call(lambda c: c.get(key))
            assert got is not None and got.value == b"1"
        finally:
            await session.close()

    asyncio.run(run())


def _add_user(etcd: AuthEtcd, user: str, password: str, permission: str, cluster: str | None = None) -> None:
    """An etcd user with a role of its own name holding `permission` (read, readwrite) on a cluster's keys (the
    fixture's by default)."""
    root = f"root:{etcd.root_password}"
    _etcdctl(etcd.endpoint, "user", "add", user, "--interactive=false", stdin=password + "\n", user=root)
    _etcdctl(etcd.endpoint, "role", "add", user, user=root)
    _etcdctl(etcd.endpoint, "role", "grant-permission", user, "--prefix=true", permission,
             f"/kvstore/{cluster or etcd.cluster}/", user=root)
    _etcdctl(etcd.endpoint, "user", "grant-role", user, user, user=root)


def test_f70a_a_password_changed_in_etcd_and_its_file_is_used_from_the_next_connect(
        etcd: AuthEtcd, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """F70a: the password file is read again at each connect of a session (a reconnect), so a password changed in
    etcd (`etcdctl user passwd`) and in the file is used without a restart; a file unreadable at a reconnect keeps
    the password read before (logged, never shown); refused credentials make the next call connect, and read, again."""
    import asyncio

    from kvstore.fleet.endpoints import EtcdAuth, parse_endpoints
    from kvstore.fleet.etcd import EtcdSession

    first, second = f"pw-{uuid.uuid4().hex}", f"pw-{uuid.uuid4().hex}"
    _add_user(etcd, "rotor", first, "readwrite")
    password_file = tmp_path / "rotor.txt"
    password_file.write_text(first + "\n")

    async def run() -> None:
        session = EtcdSession(parse_endpoints(etcd.endpoint), timeout_s=5.0,
                              auth=EtcdAuth(user="rotor", password_file=str(password_file)))
        key = f"/kvstore/{etcd.cluster}/rotated".encode()
        try:
            await session.call(lambda c: c.put(key, b"1"))
            password_file.write_text(second + "\n")  # the operator's rotation: the file, then etcd
            await asyncio.to_thread(_etcdctl, etcd.endpoint, "user", "passwd", "rotor", "--interactive=false",
                                    stdin=second + "\n", user=f"root:{etcd.root_password}")
            got = await session.call(lambda c: c.get(key))  # etcd dropped the user's token, or it still holds
            assert got is not None and got.value == b"1"
            await session.reset()  # a reconnect (the next endpoint: here the one again) authenticates anew
            assert (await session.call(lambda c: c.get(key))).value == b"1"
            password_file.unlink()  # mid-rotation: the file gone at a reconnect
            await session.reset()
            assert (await session.call(lambda c: c.get(key))).value == b"1"
            password_file.write_text("not-" + second + "\n")  # a wrong password at a reconnect: refused, named
            await session.reset()
            with pytest.raises(Unauthenticated, match="refused user 'rotor'"):
                await session.call(lambda c: c.get(key))
            password_file.write_text(second + "\n")  # put right: the next call connects and reads it again
            assert (await session.call(lambda c: c.get(key))).value == b"1"
        finally:
            await session.close()

    asyncio.run(run())
    assert "authenticating with the password read before" in caplog.text
    assert first not in caplog.text and second not in caplog.text


def test_f70b_a_read_only_role_serves_gateways_and_clients(etcd: AuthEtcd, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """F70b: gateways and clients only read the fleet's keys: a user whose role has `read` on them (no write) is
    enough for a client that puts and reads through the nodes, a gateway serving a plain client, and `kvstore fleet
    status`; `kvstore tenant create` as that user (a write) is PERMISSION_DENIED."""
    cluster = f"t-{uuid.uuid4().hex[:12]}"  # a fleet of its own: no tenants yet (so tenant auth is off)
    reader, writer = f"pw-{uuid.uuid4().hex}", f"pw-{uuid.uuid4().hex}"
    _add_user(etcd, "reader", reader, "read", cluster)
    _add_user(etcd, "writer", writer, "readwrite", cluster)
    reader_file, writer_file = tmp_path / "reader.txt", tmp_path / "writer.txt"
    reader_file.write_text(reader + "\n")
    writer_file.write_text(writer + "\n")
    node_fleet = {"etcd": etcd.endpoint, "cluster": cluster, "run_blocks": 4, "lease_ttl_s": 10,
                  "etcd_user": "writer", "etcd_password_file": str(writer_file)}
    children: list[Child] = []
    try:
        cfg = write_config(tmp_path / "node.toml", {"store": {"data_dir": str(tmp_path / "store"),
                                                              "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
                                                    "fleet": node_fleet})
        children.append(Child("node", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs"))
        query = urlencode({"user": "reader", "password_file": str(reader_file)})
        address = f"etcd://{etcd.endpoint}/{cluster}?{query}"
        wait_until(lambda: _joined(address), "a node registered, seen by the read-only user")
        tokens = [random.randrange(50_000) for _ in range(12 * BLOCK_TOKENS)]  # 3 runs
        with kvstore.Client(address) as client:
            assert isinstance(client, FleetClient)
            data = [random.randbytes(client.block_bytes) for _ in range(12)]
            client.put(tokens, data)
            assert client.lookup(tokens).found_blocks == 12 and client.get(tokens).blocks == data
        gw_fleet = {**node_fleet, "etcd_user": "reader", "etcd_password_file": str(reader_file)}
        gw_cfg = write_config(tmp_path / "gw.toml", {"store": {"data_dir": str(tmp_path / "none"),
                                                               "block_tokens": BLOCK_TOKENS}, "fleet": gw_fleet})
        children.append(Child("gateway", ["gateway", "--config", str(gw_cfg), "--port", "0"], tmp_path / "logs"))
        more = [random.randrange(50_000) for _ in range(8 * BLOCK_TOKENS)]
        with kvstore.Client(children[-1].target) as through_gateway:
            assert through_gateway.get(tokens).blocks == data
            stored = [random.randbytes(through_gateway.block_bytes) for _ in range(8)]
            through_gateway.put(more, stored)
            assert through_gateway.get(more).blocks == stored
        assert main(["fleet", "status", "--etcd", etcd.endpoint, "--cluster", cluster, "--json",
                     "--etcd-user", "reader", "--etcd-password-file", str(reader_file)]) == 0
        assert len(json.loads(capsys.readouterr().out)["nodes"]) == 1
        assert main(["tenant", "create", "readers-tenant", "--target", address]) == 2
        err = capsys.readouterr().err
        assert "PermissionDenied" in err and "denied user 'reader'" in err and reader not in err
        for child in children:
            assert reader not in child.log()
    finally:
        for child in children:
            child.kill_if_alive()
