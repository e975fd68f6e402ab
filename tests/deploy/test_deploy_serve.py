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
from typing import Any

import pytest
import redis
import yaml

from kvstore.bench.redis_server import RedisServer, free_port
from kvstore.client import Client, TlsOptions
from kvstore.errors import KVStoreError, Unauthenticated
from tests.kvstore.fleet.etcd_process import EtcdProcess, need_etcd
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


def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((DEPLOY / "docker" / "compose-fleet.yaml").read_text())["services"]
    return services


class ComposeEtcd(EtcdProcess):
    """compose-fleet.yaml's etcd command, run by this machine's etcd: its own names and ports for loopback ones."""

    def launch(self) -> ComposeEtcd:
        command = list(compose_services()["etcd"]["command"])
        assert command[0] == "etcd"
        swap = {"http://0.0.0.0:2379": f"http://{self.endpoint}", "http://etcd:2379": f"http://{self.endpoint}",
                "http://0.0.0.0:2380": self.peer_url, "http://etcd:2380": self.peer_url,
                "etcd=http://etcd:2380": f"etcd={self.peer_url}", "/etcd-data": str(self.workdir / "data")}
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "etcd.log", "ab") as log:
            self.process = subprocess.Popen([need_etcd(), *(swap.get(a, a) for a in command[1:])],
                                            stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
        return self


@pytest.fixture
def compose_redis_cluster(tmp_path: Path) -> Iterator[str]:
    """Six redis-servers with compose-fleet.yaml's member flags, joined by its job's `--cluster create` flags."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server is not installed")
    services = compose_services()
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


class FleetNode:
    """`kvstore serve --config deploy/docker/kvstore-fleet.toml` as a compose node runs it: one data dir,
    port and advertised address of its own, the rest from the file."""

    def __init__(self, fleet_env: dict[str, str], workdir: Path) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log = workdir / "node.log"
        env = fleet_env | {"KVSTORE_STORE_DATA_DIR": str(workdir / "data"), "KVSTORE_SERVER_PORT": str(self.port),
                           "KVSTORE_FLEET_ADVERTISE": self.target}  # compose sets it per node, to its name
        workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--config",
                                          env["KVSTORE_CONFIG"]], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env)
        wait_until(lambda: "listening on" in self.log.read_text() or self.proc.poll() is not None,
                   "the node started", 60)
        assert self.proc.poll() is None, self.log.read_text()

    def client(self, tls: TlsOptions, token: str) -> Client:
        """A client with `token`, once the node takes it (tokens made in etcd reach every node within seconds)."""
        clients: list[Client] = []

        def connected() -> bool:
            try:
                clients.append(Client(self.target, tls=tls, token=token, timeout_s=10))
                return True
            except Unauthenticated:
                return False

        wait_until(connected, f"{self.target} takes the token made in etcd")
        return clients[0]

    def stop(self) -> None:
        """SIGTERM, as compose stops it: a clean exit."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0, self.log.read_text()


def test_the_fleet_config_serves_nodes_that_copy_to_each_other_over_tls(
        env: dict[str, str], compose_redis_cluster: str, tmp_path: Path) -> None:
    """Two nodes on deploy/docker/kvstore-fleet.toml, on compose's etcd and a Redis Cluster made with the
    compose file's flags: both registered, a token made in etcd taken by both, SWA in the cluster, and a
    block stored on the first copied to the second over TLS (fleet.ca_file, fleet.token_file)."""
    etcd = ComposeEtcd(tmp_path / "etcd").start()  # the compose file's etcd flags
    fleet_env = env | {
        "KVSTORE_CONFIG": str(DEPLOY / "docker" / "kvstore-fleet.toml"),
        "KVSTORE_FLEET_ETCD": etcd.endpoint,
        "KVSTORE_FLEET_TOKEN_FILE": str(tmp_path / "tls" / "fleet-token"),  # both made by make-test-certs.sh
        "KVSTORE_FLEET_CA_FILE": str(tmp_path / "tls" / "ca.crt"),
        "KVSTORE_SWA_CLUSTER_NODES": compose_redis_cluster,
    }
    tls = TlsOptions(ca_file=str(tmp_path / "tls" / "ca.crt"), server_name="kvstore")
    nodes: list[FleetNode] = []
    try:
        nodes.append(FleetNode(fleet_env, tmp_path / "node-1"))
        created = kvstore(fleet_env, "tenant", "create", "acme")  # into etcd's table: every node takes it
        assert created.returncode == 0, created.stderr
        token = created.stdout.strip()
        with nodes[0].client(tls, token) as client:
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

        nodes.append(FleetNode(fleet_env, tmp_path / "node-2"))  # its join starts a re-replication pass
        status = kvstore(fleet_env, "fleet", "status", "--json")
        assert status.returncode == 0, status.stderr
        assert sorted(n["address"] for n in json.loads(status.stdout)["nodes"]) == sorted(n.target for n in nodes)
        with nodes[1].client(tls, token) as second:  # replication 2 on two nodes: the first copies both blocks to it
            wait_until(lambda: second.lookup(tokens).found_blocks == 2, "the blocks copied to the second node")
    finally:
        for node in nodes:
            node.stop()
        etcd.stop()


def test_the_kubernetes_redis_config_runs_a_cluster_member(tmp_path: Path) -> None:
    """k8s/kvstore-fleet.yaml's redis.conf and command start a cluster member of this machine's redis-server
    (which exits on a directive it does not know), announcing the name it is given."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    docs = {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all((DEPLOY / "k8s" / "kvstore-fleet.yaml").read_text())}
    conf = docs[("ConfigMap", "kvstore-redis-config")]["data"]["redis.conf"]
    (container,) = docs[("StatefulSet", "kvstore-redis")]["spec"]["template"]["spec"]["containers"]
    port = free_port(with_bus=True)
    (tmp_path / "redis.conf").write_text(conf.replace("port 6379", f"port {port}")
                                         .replace("/data/", f"{tmp_path}/"))
    command = [a.replace("$(POD_NAME)", "kvstore-redis-0").replace("$(POD_NAMESPACE)", "kvstore")
               for a in container["command"]]
    assert command[:2] == ["redis-server", "/etc/redis/redis.conf"]
    with open(tmp_path / "redis.log", "wb") as log:  # a refused config is told on stderr
        proc = subprocess.Popen([command[0], str(tmp_path / "redis.conf"), *command[2:], "--bind", "127.0.0.1"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        with redis.Redis(port=port, socket_connect_timeout=0.5) as member:
            def answers() -> bool:
                assert proc.poll() is None, (tmp_path / "redis.log").read_text()
                try:
                    return bool(member.ping())
                except redis.exceptions.ConnectionError:
                    return False

            wait_until(answers, "redis-server answers")
            assert member.info("cluster")["cluster_enabled"] == 1
            assert member.config_get("cluster-announce-hostname")["cluster-announce-hostname"] == \
                "kvstore-redis-0.kvstore-redis.kvstore.svc.cluster.local"
            assert (tmp_path / "nodes.conf").exists()  # on the claim: a restarted member keeps its place
    finally:
        proc.kill()
        proc.wait(timeout=30)


class PodEtcd(EtcdProcess):
    """One member of k8s/kvstore-fleet.yaml's etcd StatefulSet, its args as the kubelet expands them for
    the pod `name`, run by this machine's etcd on loopback: each pod's DNS name swapped for its ports."""

    def __init__(self, workdir: Path, *, name: str, args: list[str], swap: dict[str, str]) -> None:
        super().__init__(workdir, name=name)
        self.args = args
        self.swap = swap

    def launch(self) -> PodEtcd:
        swap = self.swap | {"http://0.0.0.0:2379": f"http://{self.endpoint}", "http://0.0.0.0:2380": self.peer_url,
                            "/var/lib/etcd": str(self.workdir)}
        args = []
        for arg in (a.replace("$(POD_NAME)", self.name) for a in self.args):
            for old, new in swap.items():
                arg = arg.replace(old, new)
            args.append(arg)
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "etcd.log", "ab") as log:
            self.process = subprocess.Popen([need_etcd(), *args], stdout=subprocess.DEVNULL, stderr=log,
                                            stdin=subprocess.DEVNULL)
        return self


def test_the_kubernetes_etcd_args_make_one_cluster_of_three(tmp_path: Path) -> None:
    """Each pod's `--initial-cluster` flags, as the StatefulSet writes them, join the three members into one
    cluster that answers linearizable reads on every member (a member left out would never answer)."""
    docs = {(d["kind"], d["metadata"]["name"]): d
            for d in yaml.safe_load_all((DEPLOY / "k8s" / "kvstore-fleet.yaml").read_text())}
    sts = docs[("StatefulSet", "kvstore-etcd")]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["etcd"]
    pods = [f"kvstore-etcd-{i}" for i in range(sts["spec"]["replicas"])]
    members = [PodEtcd(tmp_path / pod, name=pod, args=container["args"], swap={}) for pod in pods]
    service = sts["spec"]["serviceName"]
    swap = {}
    for pod, member in zip(pods, members, strict=True):
        swap[f"http://{pod}.{service}:2379"] = f"http://{member.endpoint}"
        swap[f"http://{pod}.{service}:2380"] = member.peer_url
    try:
        for member in members:
            member.swap = swap
            member.launch()
        for member in members:
            member.wait_ready()
    finally:
        for member in members:
            member.stop()
