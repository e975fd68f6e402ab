"""A direct-path report the gateway refuses for good is dropped, not sent again for ever (docs/SWA_POOL.md,
direct-path rule 5; kvstore/client/swa_report.py): the reports after it still arrive, the client counts it
(`SwaClient.reports_dropped`) and logs the gateway's message once, and the trace counts its calls as dropped
records. A report that fails for now (the gateway stopped) is still kept and sent again once it is back.

A real `kvstore serve` child over a real redis-server, recording its trace, stopped and started again on the
same port: with a lower `swa.max_batch_snapshots` (a config change), the report of a get the client made under
the old limit is INVALID_ARGUMENT, as it will be every time it is sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvstore import api_tokens
from kvstore.bench.redis_server import free_port
from kvstore.client import Client, SwaClient
from kvstore.client.swa_report import DirectReport
from kvstore.errors import Unavailable
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc
from tests.children import Child, write_config
from tests.waiting import wait_until

TOKENS = list(range(300))
#: The server's batch limit before the config change, and after it (below the 4-key get made before).
BEFORE, AFTER = 8, 2
REFUSAL = f"gets[0] asked 4, found 0, corrupt 0: found + corrupt <= asked <= {AFTER} (max_batch_snapshots)"


@dataclass
class Server:
    """One `kvstore serve` on a fixed port, data dir and tokens, started again with other settings."""

    root: Path
    redis_url: str
    port: int = field(default_factory=free_port)
    tokens: dict[str, str] = field(default_factory=dict)
    child: Child | None = None

    def __post_init__(self) -> None:
        tenants = self.data_dir / "tenants.json"
        self.data_dir.mkdir(parents=True)
        self.tokens["a"] = api_tokens.create(tenants, "tenant-a", frozenset({"read", "write"}))[1]
        self.tokens["admin"] = api_tokens.create(tenants, "ops", frozenset({"read", "write", "admin"}))[1]
        # Without `read`, every ReportDirect is PERMISSION_DENIED.
        self.tokens["write-only"] = api_tokens.create(tenants, "tenant-w", frozenset({"write"}))[1]

    @property
    def data_dir(self) -> Path:
        return self.root / "store"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, *, max_batch: int) -> None:
        """Start it (again) on the same port, store and Redis, batches of at most `max_batch` snapshots."""
        cfg = write_config(self.root / f"kvstore-{max_batch}.toml", {
            "store": {"data_dir": str(self.data_dir), "capacity_bytes": 1 << 30},
            "swa": {"backend": "redis", "redis_url": self.redis_url, "cap_bytes": 256 << 20,
                    "max_batch_snapshots": max_batch},
            "trace": {"enabled": True, "dir": str(self.root / "trace"), "flush_s": 0.05}})
        self.child = Child("serve", ["serve", "--config", str(cfg), "--port", str(self.port)], self.root / "logs")
        assert self.child.port == self.port

    def stop(self) -> None:
        assert self.child is not None and self.child.stop() == 0

    def swa_stats(self) -> pb.SwaStatsResponse:
        """The running server's SWA pool counters, as an admin sees them."""
        with Client(self.target, token=self.tokens["admin"]) as admin:
            return SwaClient(admin.connection, path="gateway").stats()

    def gets_when_up(self) -> int | None:
        """The pool's counted get calls, or None while the restarted server cannot be reached yet (channels to
        one target share their connection: one refused while it was down waits out its reconnect backoff)."""
        try:
            return self.swa_stats().gets
        except Unavailable:
            return None

    def trace(self) -> Any:
        """The running server's trace counters."""
        with Client(self.target, token=self.tokens["admin"]) as admin:
            return admin.stats().trace


@pytest.fixture
def server(tmp_path: Path, redis_server: Any) -> Iterator[Server]:
    s = Server(tmp_path, redis_server.url)
    yield s
    if s.child is not None:
        s.child.kill_if_alive()


def _direct(client: Client) -> SwaClient:
    """`client`'s SWA client on the Redis direct path only, on a clock that stands still: its reports go
    when `flush_report` sends them, never on their own."""
    return SwaClient(client.connection, path="direct", clock=lambda: 0.0)


def _after_flush(swa: SwaClient, read: Callable[[], object]) -> object:
    """`read()` once `swa` flushed its reports (a condition to wait on: the flush is tried again until it holds)."""
    swa.flush_report()
    return read()


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvstore.client.swa_report"]


def test_a_report_refused_for_good_is_dropped_and_counted_and_the_next_one_arrives(
        server: Server, caplog: pytest.LogCaptureFixture) -> None:
    server.start(max_batch=BEFORE)
    with Client(server.target, token=server.tokens["a"]) as c:
        swa = _direct(c)
        keys = [swa.key(TOKENS, t) for t in (1, 2, 3, 4)]
        assert swa.get_many(keys) == [None] * 4 and swa.last_path == "direct"  # one get of 4 (4 <= BEFORE)
        server.stop()
        server.start(max_batch=AFTER)  # the config change: that get's report is refused, each time it is sent
        # (Waited on: the first call after the restart may find the channel still reconnecting, a failure for now.)
        wait_until(lambda: _after_flush(swa, lambda: swa.reports_dropped) == 1, "the refused report dropped")
        refusals = _refusals(caplog)
        assert len(refusals) == 1 and REFUSAL in refusals[0], "logged once, with the server's message"
        assert swa.get_many(keys[:1]) == [None]  # a get of 1: its report is the next, taken after the dropped one
        swa.flush_report()
        stats = server.swa_stats()
        assert (stats.gets, stats.snapshots_asked, stats.hits) == (1, 1, 0), "the next report counted"
        assert swa.get_many(keys) == [None] * 4  # refused again for the same reason: counted, not logged again
        swa.flush_report()
        assert swa.reports_dropped == 2 and len(_refusals(caplog)) == 1
        swa.flush_report()  # the second refused report's call, as a dropped record
    wait_until(lambda: server.trace().written_records == 1, "the next report's call traced")
    wait_until(lambda: server.trace().dropped_records == 2, "the refused reports' calls counted as dropped")
    assert server.swa_stats().gets == 1


def test_a_report_that_fails_for_now_is_sent_again_once_the_server_is_back(
        server: Server, caplog: pytest.LogCaptureFixture) -> None:
    server.start(max_batch=BEFORE)
    with Client(server.target, token=server.tokens["a"]) as c:
        swa = _direct(c)
        keys = [swa.key(TOKENS, t) for t in (1, 2)]
        assert swa.get_many(keys) == [None, None] and swa.last_path == "direct"
        server.stop()
        swa.flush_report()  # UNAVAILABLE: kept
        assert swa.reports_dropped == 0
        server.start(max_batch=BEFORE)  # the same server again, its counters from zero
        wait_until(lambda: _after_flush(swa, server.gets_when_up) == 1, "the kept report counted")
        assert server.swa_stats().snapshots_asked == 2 and swa.reports_dropped == 0 and not _refusals(caplog)
    wait_until(lambda: server.trace().written_records == 1, "the kept report's call traced")


def test_a_gateway_refusing_every_report_ends_each_flush(server: Server) -> None:
    """A dropped report's calls make the next report (its `calls_dropped`): refused too, it is dropped in the
    next flush, not at once, or a flush would never end."""
    server.start(max_batch=BEFORE)
    with Client(server.target, token=server.tokens["write-only"]) as c:
        report = DirectReport(c.connection, pb_grpc.SwaPoolStub(c.connection.channel), lambda: 0.0)
        report.got(1, 0, 0, keys=[bytes(32)])
        for flushes in (1, 2):
            flush = threading.Thread(target=report.flush, daemon=True)
            flush.start()
            flush.join(timeout=30)  # only turns a flush that never ends into a failure
            assert not flush.is_alive() and report.dropped == flushes
