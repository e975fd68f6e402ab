"""kvstore.bench.redis_server: a server whose picked port another process takes first moves to another one.

Two pytest workers pick free ports at once; a port picked and closed can be bound by the other before
redis-server binds it. These hold that the server then moves, and that only its own answer counts.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvstore.bench import redis_server
from kvstore.bench.redis_server import RedisServer

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")


FREE_PORT = redis_server.free_port


def _ports(first: int) -> Iterator[int]:
    yield first
    while True:
        yield FREE_PORT()


def test_a_picked_port_a_listener_took_first_is_given_up_for_another(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = _ports(port)
        monkeypatch.setattr(redis_server, "free_port", lambda **_: next(picks))
        server = RedisServer(tmp_path / "r")
        assert server.port == port
        try:
            server.start()
            assert server.port != port and redis.Redis(port=server.port).ping()
        finally:
            server.stop()


def test_another_servers_answer_on_the_picked_port_is_not_taken_for_its_own(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    other = RedisServer(tmp_path / "other").start()
    try:
        picks = _ports(other.port)
        monkeypatch.setattr(redis_server, "free_port", lambda **_: next(picks))
        server = RedisServer(tmp_path / "r")
        try:
            server.start()
            assert server.port != other.port and server.process is not None
            info = redis.Redis(port=server.port).info("server")
            assert int(info["process_id"]) == server.process.pid
        finally:
            server.stop()
    finally:
        other.stop()


def test_a_port_given_is_kept_and_a_taken_one_is_an_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="port taken"):
            RedisServer(tmp_path / "r", port=taken.getsockname()[1]).start()
