"""Tokens over a fleet address and mutual TLS over a fleet (docs/FLEET.md F54, F55): one etcd (the session's),
two real `kvstore serve` nodes at replication 2 and a `kvstore gateway`, all on loopback."""

from __future__ import annotations

import contextlib
import io
import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest

import kvstore
from kvstore.cli import main
from kvstore.client.admin import AdminClient
from kvstore.client.connection import TlsOptions
from kvstore.errors import InvalidArgument, Unauthenticated, Unavailable
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until

BLOCK_TOKENS = 16


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _status(etcd: str, cluster: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["fleet", "status", "--etcd", etcd, "--cluster", cluster, "--json"]) == 0
    return json.loads(out.getvalue())


def _refused(target: str, token: str, tls: TlsOptions | None = None) -> bool:
    """Whether `target` refuses `token` (a client's first call, GetInfo, is UNAUTHENTICATED)."""
    try:
        kvstore.Client(target, token=token, tls=tls, timeout_s=5).close()
    except Unauthenticated:
        return True
    return False


def test_f54_tokens_are_made_and_revoked_through_the_fleet_address_and_hold_fleet_wide(
        tmp_path: Path, etcd_server: EtcdProcess, capsys: pytest.CaptureFixture[str]) -> None:
    """F54: `kvstore tenant --target etcd://...` writes the fleet's table, with no config file; a token made so is
    taken by a gateway and both nodes, and once revoked the same way every one of them refuses it (waited on). A
    gateway's address is refused naming the etcd:// form, as is an etcd:// address given to the Admin client."""
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    address = f"etcd://{etcd_server.endpoint}/{cluster}"
    code, admin, _ = _cli(capsys, "tenant", "create", "ops", "--admin", "--target", address)
    assert code == 0
    admin = admin.strip()
    code, acme, _ = _cli(capsys, "tenant", "create", "acme", "--target", address)
    assert code == 0
    acme = acme.strip()
    fleet = {"etcd": etcd_server.endpoint, "cluster": cluster, "run_blocks": 4, "replication": 2, "lease_ttl_s": 60}
    fleet_token = tmp_path / "fleet.token"
    fleet_token.write_text(uuid.uuid4().hex * 2)
    nodes: list[Child] = []
    gateway: Child | None = None
    try:
        for name in ("a", "b"):
            cfg = write_config(tmp_path / f"{name}.toml", {
                "store": {"data_dir": str(tmp_path / name), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
                "fleet": {**fleet, "token_file": str(fleet_token)}})
            nodes.append(Child(name, ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs"))
        gw_cfg = write_config(tmp_path / "gw.toml", {"store": {"data_dir": str(tmp_path / "none"),
                                                               "block_tokens": BLOCK_TOKENS}, "fleet": fleet})
        gateway = Child("gateway", ["gateway", "--config", str(gw_cfg), "--port", "0"], tmp_path / "logs")

        code, _, err = _cli(capsys, "tenant", "create", "beta", "--target", gateway.target)
        assert code == 2 and "FailedPrecondition" in err and "etcd://HOST:PORT" in err, err
        with pytest.raises(InvalidArgument, match="not the fleet address"):
            AdminClient(address, token=admin)
        code, _, err = _cli(capsys, "policy", "get", "acme", "--target", address, "--token", admin)
        assert code == 2 and "gateway" in err, err

        tokens = [random.randrange(50_000) for _ in range(12 * BLOCK_TOKENS)]  # 3 runs
        with kvstore.Client(gateway.target, token=acme) as through:
            data = [random.randbytes(through.block_bytes) for _ in range(12)]
            through.put(tokens, data)
        with kvstore.Client(address, token=acme) as routed:
            assert routed.get(tokens).blocks == data  # straight from the nodes, same token
        targets = [gateway.target, *(n.target for n in nodes)]
        assert not any(_refused(t, acme) for t in targets)

        code, out, _ = _cli(capsys, "tenant", "revoke", "acme", "--target", address, "--json")
        assert code == 0 and len(json.loads(out)["revoked"]) == 1
        wait_until(lambda: all(_refused(t, acme) for t in targets), "the revoked token refused fleet-wide")
        assert not any(_refused(t, admin) for t in targets)  # the others' tokens hold
        code, out, _ = _cli(capsys, "tenant", "list", "--target", address, "--json")
        listed = {r["tenant"]: r for r in json.loads(out)["tokens"]}
        assert listed["acme"]["revoked_at"] and not listed["ops"]["revoked_at"]
    finally:
        if gateway is not None:
            gateway.kill_if_alive()
        for node in nodes:
            node.kill_if_alive()


def test_f55_a_fleet_under_mutual_tls(tmp_path: Path, etcd_server: EtcdProcess) -> None:
    """F55: nodes and a gateway asking for client certificates: a client without one is refused at the gateway and
    at a node; with one it puts through the gateway and reads through etcd://; a node joining is filled by the
    other over mutual TLS (each node shows its own certificate), and the joined node alone serves every block
    once the first is killed."""
    from tests.gateway.conftest import make

    ca = make(tmp_path / "certs", "ca")
    node_cert = make(tmp_path / "certs", "node", ca, server=True, client=True)
    client_cert = make(tmp_path / "certs", "client", ca)
    tls: dict[str, object] = {"cert_file": str(node_cert.cert), "key_file": str(node_cert.key),
                              "client_ca_file": str(ca.cert)}
    cluster = f"t-{uuid.uuid4().hex[:12]}"
    fleet = {"etcd": etcd_server.endpoint, "cluster": cluster, "run_blocks": 4, "replication": 2, "lease_ttl_s": 2,
             "ca_file": str(ca.cert), "repair_interval_s": 1.0, "repair_bytes_per_s": 1 << 30}
    with_cert = TlsOptions(ca_file=str(ca.cert), cert_file=str(client_cert.cert), key_file=str(client_cert.key))
    without = TlsOptions(ca_file=str(ca.cert))

    def node(name: str) -> Child:
        cfg = write_config(tmp_path / f"{name}.toml", {
            "store": {"data_dir": str(tmp_path / name), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
            "fleet": fleet, "tls": tls})
        return Child(name, ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs")

    a = node("a")
    b: Child | None = None
    gateway: Child | None = None
    try:
        gw_cfg = write_config(tmp_path / "gw.toml", {"store": {"data_dir": str(tmp_path / "none"),
                                                               "block_tokens": BLOCK_TOKENS}, "fleet": fleet,
                                                     "tls": tls})
        gateway = Child("gateway", ["gateway", "--config", str(gw_cfg), "--port", "0"], tmp_path / "logs")
        for target in (gateway.target, a.target):  # the handshake fails: gRPC says UNAVAILABLE, no status of ours
            with pytest.raises(Unavailable):
                kvstore.Client(target, tls=without, timeout_s=5)
        tokens = [random.randrange(50_000) for _ in range(12 * BLOCK_TOKENS)]  # 3 runs
        with kvstore.Client(gateway.target, tls=with_cert) as client:
            data = [random.randbytes(client.block_bytes) for _ in range(12)]
            client.put(tokens, data)  # one node: one copy each
        b = node("b")

        def settled() -> bool:
            report = _status(etcd_server.endpoint, cluster)
            rep = report["replication"]
            return len(report["nodes"]) == 2 and rep["settled"] and rep["under_replicated_bytes"] == 0

        wait_until(settled, "b filled by a over mutual TLS")
        copied = {n["address"]: n["repair"]["copied_bytes"] for n in _status(etcd_server.endpoint, cluster)["nodes"]}
        assert copied[a.target] >= 12 * 1024, copied
        a.kill9()
        wait_until(lambda: len(_status(etcd_server.endpoint, cluster)["nodes"]) == 1, "a's lease ended")
        with kvstore.Client(f"etcd://{etcd_server.endpoint}/{cluster}", tls=with_cert) as routed:
            assert routed.get(tokens).blocks == data  # every block from b's copies
    finally:
        for child in (gateway, b, a):
            if child is not None:
                child.kill_if_alive()
