"""Throwaway redis-server processes on loopback, for benchmarks and tests: one server or a cluster.

Each server runs in its own folder with persistence off (`--save '' --appendonly
no`), bound to 127.0.0.1 on a free port, and is killed by `stop`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def free_port(*, with_bus: bool = False) -> int:
    """A free loopback TCP port (and port + 10000 free too when `with_bus`, for a cluster bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not with_bus:
            return port
        if port + 10000 <= 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise OSError("no free loopback port pair for a cluster node")


def redis_server_path() -> str | None:
    """Where redis-server is, or None."""
    return shutil.which("redis-server")


class RedisServer:
    """One redis-server process on 127.0.0.1.

    Args:
        workdir: its folder (created).
        port: its port; 0 picks a free one.
        extra_args: more redis-server flags (for example cluster mode).
    """

    def __init__(self, workdir: Path, port: int = 0, extra_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.port = port or free_port(with_bus="--cluster-enabled" in extra_args)
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None
        # A port picked here may be taken by another process (a parallel test run) before the server binds
        # it: until the server first starts, it may move to another free one.
        self._may_move = not port

    @property
    def url(self) -> str:
        """redis://127.0.0.1:port/0."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        """127.0.0.1:port."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start it (again, on the same port after `stop`) and wait until it answers PING.

        A port this object picked that another process takes first is given up for another free one
        (at most 5 tries), and only this process's answer counts (`INFO server`'s process_id).
        """
        for _ in range(5 if self._may_move else 1):
            if self._start_once(timeout_s):
                self._may_move = False
                return self
            self.port = free_port(with_bus="--cluster-enabled" in self.extra_args)
        raise RuntimeError(f"redis-server found its port taken 5 times; see {self.workdir / 'redis.log'}")

    def _start_once(self, timeout_s: float) -> bool:
        """Start and wait for this process's PING; False when another process holds the port."""
        binary = redis_server_path()
        if binary is None:
            raise FileNotFoundError("redis-server is not on PATH (apt-get install redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        # A read timeout and no retries: whatever else listens on the port may never answer a PING.
        with redis.Redis(port=self.port, socket_connect_timeout=0.2, socket_timeout=1.0,
                         retry=Retry(NoBackoff(), 0)) as probe:
            while True:
                try:
                    if process.poll() is not None:
                        raise redis.exceptions.ConnectionError("exited")  # said below: taken port or failure
                    if int(probe.info("server")["process_id"]) == process.pid:
                        return True
                    self.stop()  # another server answers on this port: ours cannot bind it
                    return False
                except redis.exceptions.RedisError:
                    if process.poll() is not None and self._port_taken():
                        self.stop()
                        return False
                    if process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server on port {self.port} did not start; see "
                                           f"{self.workdir / 'redis.log'}") from None
                    time.sleep(0.02)

    def _port_taken(self) -> bool:
        """Whether the server's log says its port was in use."""
        try:
            return "Address already in use" in (self.workdir / "redis.log").read_text(errors="replace")
        except OSError:
            return False

    def stop(self) -> None:
        """Kill the process (no shutdown save: persistence is off) and wait for it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None


class RedisClusterProcesses:
    """A Redis Cluster of `masters` redis-server processes with no replicas."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.nodes = [
            RedisServer(workdir / f"node{i}", extra_args=(
                "--cluster-enabled", "yes", "--cluster-config-file", str(workdir / f"node{i}" / "nodes.conf"),
                "--cluster-node-timeout", "2000"))
            for i in range(masters)
        ]

    @property
    def startup_nodes(self) -> str:
        """host:port,host:port,... of every node."""
        return ",".join(n.address for n in self.nodes)

    def start(self, timeout_s: float = 20.0) -> RedisClusterProcesses:
        """Start the nodes, create the cluster with redis-cli, wait for cluster_state:ok on every node."""
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli is not on PATH (it creates the cluster)")
        subprocess.run([cli, "--cluster", "create", *(n.address for n in self.nodes), "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=timeout_s)
        return self.wait_ok(timeout_s)

    def wait_ok(self, timeout_s: float = 20.0) -> RedisClusterProcesses:
        """Wait until every node reports cluster_state:ok (after a create, or a node's restart)."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            with redis.Redis(port=node.port) as probe:
                while probe.cluster("info").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster not ok on {node.address} after {timeout_s} s")
                    time.sleep(0.05)
        return self

    def flush(self) -> None:
        """Drop every key on every node and reset the stat counters (between tests)."""
        self.wait_ok()
        for node in self.nodes:
            with redis.Redis(port=node.port) as r:
                r.flushall()
                r.config_resetstat()

    def stop(self) -> None:
        """Kill every node."""
        for node in self.nodes:
            node.stop()
