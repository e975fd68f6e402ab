"""Real etcd and `kvstore serve` node processes on loopback, for `kvstore bench fleet` and the fleet's tests.

Each process runs in a folder of its own on free loopback ports, is awaited
under a deadline (etcd by a gRPC read with wait_for_ready, a node by the
`listening on HOST:PORT` line it prints), and is stopped by its PID. The
tests import `EtcdProcess` through tests/kvstore/fleet/etcd_process.py, which
skips a test where etcd is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import grpc

from kvstore.bench.redis_server import free_port
from kvstore.fleet.endpoints import EtcdTls

#: Longest wait for an etcd to answer, or a node to listen, after its start.
START_DEADLINE_S = 90.0
ETCD_MISSING = "etcd is not on PATH (apt-get install etcd-server)"


def etcd_binary() -> str:
    """The etcd binary on PATH.

    Raises:
        FileNotFoundError: there is none; the message names the package that has it.
    """
    binary = shutil.which("etcd")
    if binary is None:
        raise FileNotFoundError(ETCD_MISSING)
    return binary


class EtcdProcess:
    """One etcd member on 127.0.0.1, in `workdir`, started and stopped by PID.

    Args:
        workdir: its data dir and log live here.
        name: the member's name (a cluster's members differ).
        client_port, peer_port: its ports (0: free ones).
        initial_cluster: `name=http://127.0.0.1:peer,...` of every member, for a cluster of several.
        tls: TLS on the client port (docs/FLEET.md F57), as the attribute says.
    """

    def __init__(self, workdir: Path, *, name: str = "etcd0", client_port: int = 0, peer_port: int = 0,
                 initial_cluster: str | None = None, tls: EtcdTls | None = None) -> None:
        self.workdir = workdir
        #: Serve clients over TLS with tls.cert_file/key_file; with tls.ca_file, ask each client for a
        #: certificate it signed (--client-cert-auth). The readiness probe shows the same certificate,
        #: so under client auth it must carry client auth too (None: plaintext).
        self.tls = tls
        self.name = name
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.initial_cluster = initial_cluster
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """127.0.0.1:client_port."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """http://127.0.0.1:peer_port."""
        return f"http://127.0.0.1:{self.peer_port}"

    def binary(self) -> str:
        """The etcd binary to run (tests override this to skip where it is missing)."""
        return etcd_binary()

    def launch(self) -> EtcdProcess:
        """Start the process without waiting for it (a cluster's members must all be up to answer)."""
        client_url = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        args = [self.binary(), "--name", self.name, "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", self.peer_url]
        if self.tls is not None:
            args += ["--cert-file", self.tls.cert_file, "--key-file", self.tls.key_file]
            if self.tls.ca_file:
                args += ["--trusted-ca-file", self.tls.ca_file, "--client-cert-auth"]
        if self.initial_cluster:
            args += ["--initial-advertise-peer-urls", self.peer_url, "--initial-cluster", self.initial_cluster,
                     "--initial-cluster-state", "new", "--initial-cluster-token", self.workdir.parent.name]
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "etcd.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout_s: float = START_DEADLINE_S) -> EtcdProcess:
        """Block until a linearizable read answers (the member is up and the cluster has a leader).

        Raises:
            AssertionError: it did not answer within `timeout_s` (the message holds the end of its log).
        """
        from aetcd import rpc

        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 200), ("grpc.use_local_subchannel_pool", 1)]
        with (grpc.insecure_channel(self.endpoint, options=options) if self.tls is None
              else grpc.secure_channel(self.endpoint, self.tls.credentials(), options=options)) as channel:
            try:
                rpc.KVStub(channel).Range(rpc.RangeRequest(key=b"/"), timeout=timeout_s, wait_for_ready=True)
            except grpc.RpcError as exc:
                self.stop()
                log = (self.workdir / "etcd.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"etcd {self.name} on {self.endpoint} did not answer: {exc}\n{log}") from None
        return self

    def start(self) -> EtcdProcess:
        """Launch and wait until it answers."""
        return self.launch().wait_ready()

    def stop(self) -> None:
        """Kill the process by its PID (SIGKILL: nothing of etcd's own shutdown runs) and reap it."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None


class NodeProcess:
    """One `kvstore serve` on a free loopback port, its store in `workdir/store`, its output in `workdir`.

    Args:
        workdir: the node's folder (store and log).
        env: KVSTORE_* settings for it (the caller's own KVSTORE_* variables are dropped, so the
            bench's environment cannot change what it measures).
        store_id: the node's id for a new store (None: the random one its first open writes). The
            fleet places runs by node id (F10), so fixed ids give every run of a bench the same placement.

    Raises:
        RuntimeError: it exited, or did not print where it listens within START_DEADLINE_S.
    """

    def __init__(self, workdir: Path, env: dict[str, str], store_id: str | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.data_dir = workdir / "store"
        if store_id is not None and not self.data_dir.exists():
            seed_store(self.data_dir, store_id)
        self.log_path = workdir / "serve.log"
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        child_env.update(env)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--data-dir", str(self.data_dir)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env)
        try:
            self.target = f"127.0.0.1:{self._wait_for_port()}"
        except BaseException:
            self.kill()
            raise

    def _wait_for_port(self) -> int:
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            text = self.log_path.read_text(errors="replace")
            match = re.search(r"listening on (?:127\.0\.0\.1|localhost|\[::\]|0\.0\.0\.0):(\d+)", text)
            if match:
                return int(match.group(1))
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = " | ".join(text.strip().splitlines()[-3:])
                raise RuntimeError(f"kvstore serve in {self.workdir} did not start "
                                   f"(exit {self.process.poll()}): {tail}")
            time.sleep(0.02)  # polling its log under the deadline above

    @property
    def node_id(self) -> str:
        """The node's stable id (its store's identity, written when the store opened)."""
        from tiers import datadir

        return datadir.node_id(self.data_dir)

    @property
    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL it (no clean-up of any kind runs: its lease in etcd expires on its own) and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=60)

    def stop(self) -> None:
        """SIGTERM it (it deregisters and closes its store), SIGKILL after 30 s, and reap it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def seed_store(data_dir: Path, store_id: str) -> None:
    """Create an empty store in `data_dir` whose identity names `store_id` (docs/FLEET.md F1).

    The identity file is only taken beside its `data.mdb` (tiers.datadir.check_files), so LMDB's
    empty file is created first; the node's own open finds both and keeps the id.
    """
    import json

    import lmdb

    from tiers import datadir

    data_dir.mkdir(parents=True)
    lmdb.open(str(data_dir), map_size=1 << 20, max_dbs=8).close()
    identity = {"store_id": store_id, "format_version": datadir.FORMAT_VERSION,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (data_dir / datadir.IDENTITY_NAME).write_text(json.dumps(identity) + "\n")


def stop_all(nodes: Iterable[NodeProcess]) -> None:
    """NodeProcess.stop for every node at once: SIGTERM each, then reap each.

    A fleet node keeps serving a second after it leaves (gateway/server.py LEAVE_DRAIN_S, F43), so
    stopped one after another each node cost that second; stopped together they cost it once.
    """
    nodes = list(nodes)
    for node in nodes:
        if node.alive:
            node.process.terminate()
    for node in nodes:
        node.stop()
