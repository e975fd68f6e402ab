"""`kvstore serve` with [fleet] set, as a real child process, and `kvstore fleet status` (docs/FLEET.md F1-F4, F14)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench.redis_server import free_port
from kvstore.cli import main
from kvstore.config_sections import FleetSettings
from kvstore.fleet.membership import Membership, RegisteredNode, read_nodes, session_for
from tests.children import START_DEADLINE_S, Child, write_config
from tiers import datadir

EXPIRY_S = 15.0


def nodes_now(fleet: FleetSettings) -> list[RegisteredNode]:
    async def read() -> list[RegisteredNode]:
        session = session_for(fleet)
        try:
            return (await read_nodes(session, fleet.cluster))[0]
        finally:
            await session.close()

    return asyncio.run(read())


def config(tmp_path: Path, fleet: FleetSettings) -> Path:
    return write_config(tmp_path / "kvstore.toml", {
        "store": {"data_dir": str(tmp_path / "store"), "capacity_bytes": 1 << 26, "block_tokens": 16},
        "fleet": {"etcd": fleet.etcd, "cluster": fleet.cluster, "lease_ttl_s": fleet.lease_ttl_s},
    })


def serve(tmp_path: Path, cfg: Path) -> Child:
    return Child("node", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs")


def test_serve_registers_and_deregisters_on_sigterm(tmp_path: Path, fleet: FleetSettings,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, fleet)
    child = serve(tmp_path, cfg)
    try:
        node_id = datadir.node_id(tmp_path / "store")
        assert f"kvstore fleet: node {node_id} of {fleet.cluster!r} at {child.target}" in child.log()
        [node] = nodes_now(fleet)
        assert (node.record.node_id, node.record.address) == (node_id, child.target)
        assert node.record.capacity_bytes == 1 << 26

        assert main(["fleet", "status", "--config", str(cfg)]) == 0
        text = capsys.readouterr().out.splitlines()
        assert text[0] == f"fleet {fleet.cluster!r} in etcd {fleet.etcd}: 1 node"
        assert text[1].split()[:3] == ["NODE", "ADDRESS", "LEASE"]
        row = text[2].split()
        assert row[:2] == [node_id, child.target] and 0 <= int(row[2]) <= 2 and row[3] == "s"
        assert main(["fleet", "status", "--etcd", fleet.etcd, "--cluster", fleet.cluster, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert [(n["node_id"], n["address"]) for n in report["nodes"]] == [(node_id, child.target)]
        assert 0 <= report["nodes"][0]["lease_ttl_left_s"] <= 2 and report["cluster"] == fleet.cluster

        assert child.stop() == 0
        assert nodes_now(fleet) == []  # gone before the process ended: no waiting for the lease
    finally:
        child.kill_if_alive()


def test_serve_keeps_its_id_across_restarts_and_leaves_when_killed(tmp_path: Path, fleet: FleetSettings) -> None:
    cfg = config(tmp_path, fleet)
    first = serve(tmp_path, cfg)
    try:
        node_id = datadir.node_id(tmp_path / "store")
        first.kill9()  # its record stays until its lease ends; a restart on the same address takes it over (F2)
        again = serve(tmp_path, cfg)
        [node] = nodes_now(fleet)
        assert node.record.node_id == node_id and node.record.address == again.target

        async def killed_leaves() -> None:
            membership = Membership(session_for(fleet), fleet.cluster)
            await membership.start()
            try:
                assert set(membership.nodes) == {node_id}
                again.kill9()
                await membership.wait_until(lambda m: not m.nodes, EXPIRY_S)  # the lease ran out (F3)
            finally:
                await membership.close()

        asyncio.run(killed_leaves())
    finally:
        first.kill_if_alive()
        if "again" in locals():
            again.kill_if_alive()


def test_f14_serve_does_not_start_without_etcd(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    cfg = write_config(tmp_path / "kvstore.toml", {
        "store": {"data_dir": str(tmp_path / "store"), "capacity_bytes": 1 << 26},
        "fleet": {"etcd": dead, "lease_ttl_s": 3},
    })
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--config", str(cfg), "--port", "0"],
                          capture_output=True, text=True, timeout=START_DEADLINE_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvstore: ")]
    assert len(errors) == 1 and re.search(rf"Unavailable: etcd does not answer at {dead}\b", errors[0])
    assert "Traceback" not in done.stderr and "listening" not in done.stdout


def test_fleet_status_names_an_unreachable_etcd(capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    assert main(["fleet", "status", "--etcd", dead, "--timeout", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"etcd does not answer at {dead}" in err[0]
    assert main(["fleet", "status", "--etcd", dead, "--timeout", "1", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "UNAVAILABLE"


def test_fleet_status_without_endpoints_says_what_to_give(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_CONFIG", raising=False)
    monkeypatch.delenv("KVSTORE_FLEET_ETCD", raising=False)
    assert main(["fleet", "status"]) == 2
    assert "give --etcd" in capsys.readouterr().err


def test_fleet_status_of_an_empty_cluster(fleet: FleetSettings, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "status", "--etcd", fleet.etcd, "--cluster", fleet.cluster]) == 0
    assert capsys.readouterr().out.splitlines() == [f"fleet {fleet.cluster!r} in etcd {fleet.etcd}: 0 nodes"]



def test_f43_a_leaving_node_answers_a_moment_after_it_left(tmp_path: Path, fleet: FleetSettings) -> None:
    """F43: a SIGTERMed node leaves etcd first and keeps answering for `LEAVE_DRAIN_S` (1 s), so a call
    placed by a client whose view has not yet seen the leave is served, not refused."""
    import signal

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    child = serve(tmp_path, config(tmp_path, fleet))
    try:
        assert nodes_now(fleet)
        with grpc.insecure_channel(child.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected before the stop
            child.proc.send_signal(signal.SIGTERM)
            while nodes_now(fleet):  # polls etcd for the leave; what follows is the assertion
                pass
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # out of the fleet, still answering
        assert child.proc.wait(30) == 0
    finally:
        child.kill_if_alive()


def test_a_metrics_port_in_use_stops_the_node_cleanly_and_it_leaves_etcd(tmp_path: Path,
                                                                         fleet: FleetSettings) -> None:
    """A node whose [metrics] port is taken exits with one line, its gRPC server stopped and its etcd
    record revoked (not left until its lease ends, with a traceback from a server never shut down)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = write_config(tmp_path / "kvstore.toml", {
            "store": {"data_dir": str(tmp_path / "store"), "capacity_bytes": 1 << 26, "block_tokens": 16},
            "fleet": {"etcd": fleet.etcd, "cluster": fleet.cluster, "lease_ttl_s": 30},
            "metrics": {"port": port},
        })
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--config", str(cfg), "--port", "0"],
                              capture_output=True, text=True, timeout=START_DEADLINE_S)
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port} for metrics" in done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert nodes_now(fleet) == []  # revoked at once: the 30 s lease is not what removed it
