"""etcd's JWT tokens (docs/FLEET.md F70c): a real etcd with `--auth-token jwt,...,sign-method=RS256,ttl=...` (RSA keys
made here by the openssl CLI), a node and a gateway from [fleet], a client from its address, each working on
across its token's expiry; a password changed in etcd and in its file seen as with simple tokens (F70a)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest

import kvstore
from kvstore.cli import main
from kvstore.client.fleet import FleetClient
from kvstore.errors import Unauthenticated
from kvstore.fleet.endpoints import EtcdAuth, parse_endpoints
from kvstore.fleet.etcd import EtcdSession
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.kvstore.fleet.test_etcd_auth import AuthEtcd, _add_user, _etcdctl, _joined
from tests.waiting import wait_until

BLOCK_TOKENS = 16
PASSWORD = f"pw-{uuid.uuid4().hex}"
#: A token's life: short, so that every part's first token expires while the test runs.
TOKEN_TTL_S = 3


def _rsa_keys(tmp: Path) -> tuple[Path, Path]:
    """An RS256 key pair by the openssl CLI (the project does not depend on `cryptography`)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH")
    private, public = tmp / "jwt.key", tmp / "jwt.pub"
    for args in (
        ["genrsa", "-out", str(private), "2048"],
        ["rsa", "-in", str(private), "-pubout", "-out", str(public)],
    ):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    return private, public


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthEtcd]:
    tmp = tmp_path_factory.mktemp("etcd-jwt")
    private, public = _rsa_keys(tmp)
    token = f"jwt,pub-key={public},priv-key={private},sign-method=RS256,ttl={TOKEN_TTL_S}s"
    process = EtcdProcess(tmp / "etcd", auth_token=token).start()
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    root_pw = uuid.uuid4().hex
    ep = process.endpoint
    try:
        _etcdctl(ep, "user", "add", "root", "--interactive=false", stdin=root_pw + "\n")
        _etcdctl(ep, "role", "add", "root")
        _etcdctl(ep, "user", "grant-role", "root", "root")
        _etcdctl(ep, "user", "add", "kvnode", "--interactive=false", stdin=PASSWORD + "\n")
        _etcdctl(ep, "role", "add", "kvnode")
        _etcdctl(ep, "role", "grant-permission", "kvnode", "--prefix=true", "readwrite", f"/kvstore/{cluster}/")
        _etcdctl(ep, "user", "grant-role", "kvnode", "kvnode")
        _etcdctl(ep, "auth", "enable")
        password_file = tmp / "pw.txt"
        password_file.write_text(PASSWORD + "\n")
        yield AuthEtcd(
            endpoint=ep,
            cluster=cluster,
            password_file=password_file,
            wrong_file=tmp / "none",
            outsider_file=tmp / "none",
            root_password=root_pw,
        )
    finally:
        process.stop()


def _token_expiry(client: object) -> float:
    """The unix time a connected aetcd client's JWT expires (its `exp` claim)."""
    token = dict(client.metadata)["token"]  # type: ignore[attr-defined]
    payload = token.split(".")[1]
    return float(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["exp"])


def _wait_expired(expiry: float) -> None:
    """Wait until a token with this `exp` is past (etcd checks it in whole seconds)."""
    wait_until(lambda: time.time() > expiry + 1, "the JWT expired", timeout_s=TOKEN_TTL_S + 30)


def _session_token_expiry(etcd: AuthEtcd) -> float:
    """The expiry of a token issued now (a part's token issued before it expires no later)."""

    async def run() -> float:
        session = EtcdSession(
            parse_endpoints(etcd.endpoint),
            timeout_s=5.0,
            auth=EtcdAuth(user="kvnode", password_file=str(etcd.password_file)),
        )
        try:
            client = await session.client()
            return _token_expiry(client)
        finally:
            await session.close()

    return asyncio.run(run())


def _serves(target: str, token: str, tokens: list[int]) -> bool:
    """A Put and Get through `target` with a tenant's token go through (False while it is refused)."""
    try:
        with kvstore.Client(target, token=token, timeout_s=5) as client:
            data = [random.randbytes(client.block_bytes) for _ in range(len(tokens) // BLOCK_TOKENS)]
            client.put(tokens, data)
            return client.get(tokens).blocks == data
    except Unauthenticated:
        return False


def test_f70c_a_node_a_gateway_and_a_client_work_on_across_their_jwt_tokens_expiry(
    etcd: AuthEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = {
        "etcd": etcd.endpoint,
        "cluster": etcd.cluster,
        "run_blocks": 4,
        "lease_ttl_s": 10,
        "etcd_user": "kvnode",
        "etcd_password_file": str(etcd.password_file),
    }
    address = f"etcd://{etcd.endpoint}/{etcd.cluster}?" + urlencode(
        {"user": "kvnode", "password_file": str(etcd.password_file)}
    )
    children: list[Child] = []
    try:
        cfg = write_config(
            tmp_path / "node.toml",
            {
                "store": {"data_dir": str(tmp_path / "store"), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
                "fleet": fleet,
            },
        )
        children.append(Child("node", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs"))
        wait_until(lambda: _joined(address), "the node registered in etcd with a JWT")
        gw_cfg = write_config(
            tmp_path / "gw.toml",
            {"store": {"data_dir": str(tmp_path / "none"), "block_tokens": BLOCK_TOKENS}, "fleet": fleet},
        )
        children.append(Child("gateway", ["gateway", "--config", str(gw_cfg), "--port", "0"], tmp_path / "logs"))
        tokens = [random.randrange(50_000) for _ in range(12 * BLOCK_TOKENS)]  # 3 runs
        with kvstore.Client(address) as client, kvstore.Client(children[-1].target) as through_gateway:
            assert isinstance(client, FleetClient)
            data = [random.randbytes(client.block_bytes) for _ in range(12)]
            client.put(tokens, data)
            assert through_gateway.get(tokens).blocks == data
        _wait_expired(_session_token_expiry(etcd))  # every token issued so far is past
        # A table written now (tenant auth turns on) is seen by the node and the gateway only through their
        # sessions' next etcd calls and watches, made with tokens etcd no longer takes.
        assert main(["tenant", "create", "bolt", "--target", address]) == 0
        tenant_token = capsys.readouterr().out.strip().splitlines()[-1]
        more = [random.randrange(50_000) for _ in range(8 * BLOCK_TOKENS)]
        wait_until(lambda: _serves(children[-1].target, tenant_token, more), "the gateway took bolt's token")
        with kvstore.Client(address, token=tenant_token) as client:
            assert client.lookup(more).found_blocks == 8  # from the node, which took the token too
        # The node's record still stands: its lease was kept alive throughout.
        with kvstore.Client(address, token=tenant_token) as fresh:
            assert len(fresh.view.nodes) == 1  # type: ignore[attr-defined]
        for child in children:
            assert child.alive and PASSWORD not in child.log()
    finally:
        for child in children:
            child.kill_if_alive()


def test_f70c_a_sessions_expired_jwt_is_renewed_without_failing_its_call(etcd: AuthEtcd) -> None:
    async def run() -> None:
        session = EtcdSession(
            parse_endpoints(etcd.endpoint),
            timeout_s=5.0,
            auth=EtcdAuth(user="kvnode", password_file=str(etcd.password_file)),
        )
        key = f"/kvstore/{etcd.cluster}/jwt-probe".encode()
        try:
            await session.call(lambda c: c.put(key, b"1"))
            first = await session.client()
            expiry = _token_expiry(first)
            await asyncio.to_thread(_wait_expired, expiry)
            got = await session.call(lambda c: c.get(key))
            assert got is not None and got.value == b"1"
            assert _token_expiry(await session.client()) > expiry  # a new token, issued by authenticating again
        finally:
            await session.close()

    asyncio.run(run())


def test_f70c_a_password_changed_in_etcd_and_its_file_is_used_from_the_next_connect(
    etcd: AuthEtcd, tmp_path: Path
) -> None:
    """As F70a with simple tokens: with JWT etcd keeps no tokens to drop, a password change makes every token
    older than the auth store's revision; the session authenticates again with the file's new password."""
    first, second = f"pw-{uuid.uuid4().hex}", f"pw-{uuid.uuid4().hex}"
    _add_user(etcd, "rotor", first, "readwrite")
    password_file = tmp_path / "rotor.txt"
    password_file.write_text(first + "\n")

    async def run() -> None:
        session = EtcdSession(
            parse_endpoints(etcd.endpoint), timeout_s=5.0, auth=EtcdAuth(user="rotor", password_file=str(password_file))
        )
        key = f"/kvstore/{etcd.cluster}/rotated".encode()
        try:
            await session.call(lambda c: c.put(key, b"1"))
            password_file.write_text(second + "\n")
            await asyncio.to_thread(
                _etcdctl,
                etcd.endpoint,
                "user",
                "passwd",
                "rotor",
                "--interactive=false",
                stdin=second + "\n",
                user=f"root:{etcd.root_password}",
            )
            got = await session.call(lambda c: c.get(key))
            assert got is not None and got.value == b"1"
            password_file.write_text("not-" + second + "\n")  # a wrong password at a reconnect: refused, named
            await session.reset()
            with pytest.raises(Unauthenticated, match="refused user 'rotor'"):
                await session.call(lambda c: c.get(key))
            password_file.write_text(second + "\n")
            assert (await session.call(lambda c: c.get(key))).value == b"1"
        finally:
            await session.close()

    asyncio.run(run())
