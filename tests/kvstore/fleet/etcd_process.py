"""A real etcd member on loopback, started and stopped by PID (Debian's etcd 3.4 on PATH)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from kvstore.bench.redis_server import free_port

#: Longest wait for an etcd to answer after its start.
START_DEADLINE_S = 30.0


def need_etcd() -> str:
    """The etcd binary; skip without it, except in CI (CI=true), where its absence is a failure."""
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("etcd is not on PATH and CI=true: apt-get install etcd-server etcd-client")
        pytest.skip("etcd is not on PATH (apt-get install etcd-server)")
    return binary


class EtcdProcess:
    """One etcd member on 127.0.0.1, in `workdir`, started and stopped by PID.

    Args:
        workdir: its data dir and log live here.
        name: the member's name (a cluster's members differ).
        client_port, peer_port: its ports (0: free ones).
        initial_cluster: `name=http://127.0.0.1:peer,...` of every member, for a cluster of several.
    """

    def __init__(self, workdir: Path, *, name: str = "etcd0", client_port: int = 0, peer_port: int = 0,
                 initial_cluster: str | None = None) -> None:
        self.workdir = workdir
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

    def launch(self) -> EtcdProcess:
        """Start the process without waiting for it (a cluster's members must all be up to answer)."""
        client_url = f"http://{self.endpoint}"
        args = [need_etcd(), "--name", self.name, "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", self.peer_url]
        if self.initial_cluster:
            args += ["--initial-advertise-peer-urls", self.peer_url, "--initial-cluster", self.initial_cluster,
                     "--initial-cluster-state", "new", "--initial-cluster-token", self.workdir.parent.name]
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "etcd.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout_s: float = START_DEADLINE_S) -> EtcdProcess:
        """Block until a linearizable read answers (the member is up and the cluster has a leader)."""
        from aetcd import rpc

        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 200), ("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(self.endpoint, options=options) as channel:
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
            os.kill(self.process.pid, 9)
            self.process.wait(timeout=30)
        self.process = None
