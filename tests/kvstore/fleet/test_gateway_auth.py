"""`kvstore gateway` with tokens on: callers checked against the fleet's tenants in etcd, nodes called with the
caller's own token (docs/FLEET.md F38), and a clean stop on SIGTERM. One etcd (the session's), one node at
replication 1, one gateway."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvstore
from kvstore.cli import main
from kvstore.errors import PermissionDenied, Unauthenticated
from tests.children import Child, write_config
from tests.kvstore.fleet.etcd_process import EtcdProcess

BLOCK_TOKENS = 16


def _token(capsys: pytest.CaptureFixture[str], cfg: Path, tenant: str, *rights: str) -> str:
    assert main(["tenant", "create", tenant, "--config", str(cfg), *rights]) == 0
    return capsys.readouterr().out.strip()


def test_f38_a_gateway_checks_tokens_in_etcd_and_calls_nodes_with_the_callers_own(
        tmp_path: Path, etcd_server: EtcdProcess, capsys: pytest.CaptureFixture[str]) -> None:
    """F38: no token is refused at the gateway; a tenant sees only its own blocks; a read-only token cannot Put
    (the node refuses it: the gateway forwards the caller's token, so it cannot widen a caller's rights); SIGTERM
    stops the gateway cleanly, the health service saying NOT_SERVING first."""
    fleet = {"etcd": etcd_server.endpoint, "cluster": f"t-{uuid.uuid4().hex[:12]}", "run_blocks": 4,
             "replication": 1}
    fleet_token = tmp_path / "fleet.token"
    fleet_token.write_text(uuid.uuid4().hex * 2)
    node_cfg = write_config(tmp_path / "node.toml", {
        "store": {"data_dir": str(tmp_path / "store"), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
        "fleet": {**fleet, "lease_ttl_s": 60, "token_file": str(fleet_token)}})
    alpha = _token(capsys, node_cfg, "alpha")
    beta = _token(capsys, node_cfg, "beta")
    reader = _token(capsys, node_cfg, "alpha", "--rights", "read")
    node = Child("node", ["serve", "--config", str(node_cfg), "--port", "0"], tmp_path / "logs")
    gw_cfg = write_config(tmp_path / "gw.toml", {"store": {"data_dir": str(tmp_path / "none"),
                                                           "block_tokens": BLOCK_TOKENS}, "fleet": fleet})
    gateway = Child("gateway", ["gateway", "--config", str(gw_cfg), "--port", "0"], tmp_path / "logs")
    try:
        assert "auth tokens" in gateway.out_path.read_text()
        with pytest.raises(Unauthenticated):
            kvstore.Client(gateway.target)
        tokens = [random.randrange(50_000) for _ in range(10 * BLOCK_TOKENS)]
        with kvstore.Client(gateway.target, token=alpha) as a, kvstore.Client(gateway.target, token=beta) as b, \
                kvstore.Client(gateway.target, token=reader) as r:
            data = [random.randbytes(a.block_bytes) for _ in range(10)]
            a.put(tokens, data)
            assert a.get(tokens).blocks == data and r.get(tokens).blocks == data  # same tenant, read right
            assert b.lookup(tokens).found_blocks == 0  # another tenant's blocks are not there for it
            with pytest.raises(PermissionDenied):
                r.put(tokens, data)
        with kvstore.Client(gateway.target, token=beta, namespace="alpha") as other, pytest.raises(PermissionDenied):
            other.lookup(tokens)
        with grpc.insecure_channel(gateway.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert gateway.stop() == 0
        assert "kvstore gateway stopped" in gateway.err_path.read_text()
    finally:
        gateway.kill_if_alive()
        node.kill_if_alive()


def test_f38_a_gateway_speaks_tls_and_dials_nodes_with_tls(tmp_path: Path, etcd_server: EtcdProcess) -> None:
    """F38: with [tls] on, the gateway serves TLS and dials nodes with TLS checked against [fleet] ca_file."""
    from kvstore.client.connection import TlsOptions
    from tests.gateway.conftest import make

    ca = make(tmp_path / "certs", "ca")
    server = make(tmp_path / "certs", "server", ca, server=True)
    tls = {"cert_file": str(server.cert), "key_file": str(server.key)}
    fleet = {"etcd": etcd_server.endpoint, "cluster": f"t-{uuid.uuid4().hex[:12]}", "run_blocks": 4,
             "replication": 1, "ca_file": str(ca.cert)}
    node_cfg = write_config(tmp_path / "node.toml", {
        "store": {"data_dir": str(tmp_path / "store"), "capacity_bytes": 1 << 27, "block_tokens": BLOCK_TOKENS},
        "fleet": {**fleet, "lease_ttl_s": 60}, "tls": tls})
    node = Child("node", ["serve", "--config", str(node_cfg), "--port", "0"], tmp_path / "logs")
    gw_cfg = write_config(tmp_path / "gw.toml", {"store": {"data_dir": str(tmp_path / "none"),
                                                           "block_tokens": BLOCK_TOKENS}, "fleet": fleet, "tls": tls})
    gateway = Child("gateway", ["gateway", "--config", str(gw_cfg), "--port", "0"], tmp_path / "logs")
    try:
        assert "TLS on" in gateway.out_path.read_text()
        tokens = [random.randrange(50_000) for _ in range(6 * BLOCK_TOKENS)]
        with kvstore.Client(gateway.target, tls=TlsOptions(ca_file=str(ca.cert))) as client:
            data = [random.randbytes(client.block_bytes) for _ in range(6)]
            client.put(tokens, data)
            assert client.get(tokens).blocks == data
    finally:
        gateway.kill_if_alive()
        node.kill_if_alive()
