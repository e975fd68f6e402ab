"""deploy/kvstore.toml starts a real server that demands TLS and tokens (issue 12 item 6), and
deploy/docker/kvstore-fleet.toml a real fleet node (issue 23 item 8).

`kvstore serve --config deploy/kvstore.toml` runs as a child process, with only what
differs on a test machine overridden the way an operator would (KVSTORE_<SECTION>_<FIELD>):
the folders and certificate paths into tmp_path, the ports free, the capacity small.
The certificates come from deploy/docker/make-test-certs.sh; the first token from
`kvstore tenant create --config` (finding the tenants file as the server does). The fleet
node runs against a real etcd and a real Redis Cluster of six redis-servers started with
compose-fleet.yaml's own flags and joined with its create job's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml

from kvstore.bench.redis_server import RedisServer, free_port
from kvstore.client import Client, TlsOptions
from kvstore.errors import KVStoreError, Unauthenticated
from tests.kvstore.fleet.etcd_process import EtcdProcess
from tests.waiting import wait_until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The test machine's differences from the deploy file, as an operator would override them."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    certs = tmp_path / "tls"
    subprocess.run(["bash", str(DEPLOY / "docker" / "make-test-certs.sh"), str(certs)], check=True,
                   capture_output=True, timeout=60)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return base | {
        "KVSTORE_CONFIG": str(DEPLOY / "kvstore.toml"),
        "KVSTORE_STORE_DATA_DIR": str(tmp_path / "data"),
        "KVSTORE_STORE_CAPACITY_BYTES": str(1 << 30),
        "KVSTORE_SERVER_PORT": "0",
        "KVSTORE_METRICS_PORT": "0",
        "KVSTORE_TLS_CERT_FILE": str(certs / "tls.crt"),
        "KVSTORE_TLS_KEY_FILE": str(certs / "tls.key"),
    }


@pytest.fixture
def served(env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """`kvstore serve --config deploy/kvstore.toml`: the loopback address of its port."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--config", env["KVSTORE_CONFIG"]],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"listening on [\d.]+:(\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield f"127.0.0.1:{match.group(1)}"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()


def kvstore(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *argv], capture_output=True, text=True,
                          timeout=60, env=env)


def test_the_deploy_config_serves_tls_and_tokens_only(served: str, env: dict[str, str], tmp_path: Path) -> None:
    ca = str(tmp_path / "tls" / "ca.crt")
    probe = kvstore(env, "health", "--target", served, "--tls-ca", ca, "--tls-server-name", "kvstore")
    assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stderr
    tls = TlsOptions(ca_file=ca, server_name="kvstore")
    with pytest.raises(Unauthenticated):  # auth.required: no token, no call, before any tenant exists
        Client(served, tls=tls, timeout_s=10).close()
    with pytest.raises(KVStoreError):  # plaintext to the TLS port
        Client(served, timeout_s=3).close()
    created = kvstore(env, "tenant", "create", "acme", "--config", env["KVSTORE_CONFIG"])
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    deadline = time.monotonic() + 30  # the server reads the tenants file again within auth.reload_s
    while True:
        try:
            client = Client(served, tls=tls, token=token, timeout_s=10)
            break
        except Unauthenticated:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    with client:
        tokens = list(range(2 * client.block_tokens))
        client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])
        assert client.lookup(tokens).found_blocks == 2


# -- a fleet node: deploy/docker/kvstore-fleet.toml --


@pytest.fixture
def compose_redis_cluster(tmp_path: Path) -> Iterator[str]:
    """Six redis-servers with compose-fleet.yaml's member flags, joined by its job's `--cluster create` flags."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed")
    services = yaml.safe_load((DEPLOY / "docker" / "compose-fleet.yaml").read_text())["services"]
    members = sorted(name for name, s in services.items() if "--cluster-enabled" in s.get("command", []))
    command = services[members[0]]["command"]
    flags = command[command.index("--port") + 2:]  # after `redis-server --port 6379`: this machine's port instead
    script = services["redis-cluster-create"]["command"][-1]
    create = re.search(r"redis-cli --cluster create \$\$addresses (.*)$", script, re.M)
    assert create, script
    nodes = [RedisServer(tmp_path / name, extra_args=tuple(flags)) for name in members]
    try:
        for node in nodes:
            node.start()
        addresses = [n.address for n in nodes]
        subprocess.run(["redis-cli", "--cluster", "create", *addresses, *create.group(1).split()], check=True,
                       capture_output=True, timeout=60)
        for node in nodes:
            with redis.Redis(port=node.port) as probe:
                wait_until(lambda: probe.cluster("info").get("cluster_state") == "ok", f"{node.address} ok")
        yield ",".join(addresses)
    finally:
        for node in nodes:
            node.stop()


def test_the_fleet_config_serves_a_node_registered_in_etcd_with_swa_in_the_cluster(
        env: dict[str, str], compose_redis_cluster: str, tmp_path: Path) -> None:
    etcd = EtcdProcess(tmp_path / "etcd").start()
    port = free_port()
    fleet_env = env | {
        "KVSTORE_CONFIG": str(DEPLOY / "docker" / "kvstore-fleet.toml"),
        "KVSTORE_SERVER_PORT": str(port),
        "KVSTORE_FLEET_ETCD": etcd.endpoint,
        "KVSTORE_FLEET_ADVERTISE": f"127.0.0.1:{port}",  # compose sets it per node, to the node's name
        "KVSTORE_FLEET_TOKEN_FILE": str(tmp_path / "tls" / "fleet-token"),  # made by make-test-certs.sh
        "KVSTORE_SWA_CLUSTER_NODES": compose_redis_cluster,
    }
    log = tmp_path / "node.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--config", fleet_env["KVSTORE_CONFIG"]],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=fleet_env)
    try:
        wait_until(lambda: "listening on" in log.read_text() or proc.poll() is not None, "the node started", 60)
        assert proc.poll() is None, log.read_text()
        status = kvstore(fleet_env, "fleet", "status", "--json")
        assert status.returncode == 0, status.stderr
        assert [n["address"] for n in json.loads(status.stdout)["nodes"]] == [f"127.0.0.1:{port}"]
        created = kvstore(fleet_env, "tenant", "create", "acme")  # into etcd's table: every node takes it
        assert created.returncode == 0, created.stderr
        tls = TlsOptions(ca_file=str(tmp_path / "tls" / "ca.crt"), server_name="kvstore")
        token = created.stdout.strip()
        clients: list[Client] = []

        def connected() -> bool:
            try:
                clients.append(Client(f"127.0.0.1:{port}", tls=tls, token=token, timeout_s=10))
                return True
            except Unauthenticated:
                return False

        wait_until(connected, "the node takes the token made in etcd")
        with clients[0] as client:
            tokens = list(range(2 * client.block_tokens))
            client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])
            assert client.lookup(tokens).found_blocks == 2
            snapshot = os.urandom(client.swa.snapshot_bytes(len(tokens)))
            client.swa.put(tokens, snapshot)
            assert bytes(client.swa.get(tokens) or b"") == snapshot
        stored = 0
        for address in compose_redis_cluster.split(","):
            with redis.Redis(port=int(address.rsplit(":", 1)[1])) as member:
                if member.info("replication")["role"] == "master":
                    stored += sum(1 for _ in member.scan_iter(match="kvstore:swa:*"))
        assert stored >= 1  # the snapshot is in the Redis Cluster, not an in-process pool
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        etcd.stop()
    assert code == 0, log.read_text()
