"""A recording `kvstore serve` (`[trace] enabled`) over a real redis-server traces each SWA snapshot put and get a
client makes in Redis itself (the direct path) as it traces SwaPool's own: one record per call, `via`
"redis-direct", at the client's time, with the caller's tenant, the snapshot keys (cut to `hash_bytes`) and what it
found or stored (docs/CAPACITY.md, "What is recorded"; docs/SWA_POOL.md, direct-path rule 5). The client reports
the calls with its counts (SwaPool.ReportDirect), bounded, and only to a server that records: a real child server,
a real SwaClient on the direct path, the records read back from the server's files."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore import api_tokens
from kvstore.client import Client, SwaClient, swa_report
from kvstore.errors import InvalidArgument
from kvstore.trace import recorded
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc
from tests.children import Child, write_config
from tests.waiting import wait_until

RW = frozenset({"read", "write"})
TOKENS = list(range(300))
HASH_BYTES = 8
#: The clients' wall clock starts here (a record's `t` is the client's, not the server's).
T0 = 1_700_000_000.0


class Reports(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Keeps each ReportDirect request a client sends (what goes over the wire), and lets it through."""

    def __init__(self) -> None:
        self.sent: list[pb.SwaReportDirectRequest] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if details.method.endswith("/ReportDirect"):
            self.sent.append(request)
        return continuation(details, request)


@dataclass
class Server:
    child: Child
    tokens: dict[str, str]
    folder: Path

    def client(self, who: str) -> Client:
        return Client(self.child.target, token=self.tokens[who])

    def direct(self, client: Client, reports: Reports | None = None, **kwargs: Any) -> SwaClient:
        """`client`'s SWA client on the Redis direct path only (never the gateway), its reports kept by `reports`."""
        if reports is not None:
            client.connection.channel = grpc.intercept_channel(client.connection.channel, reports)
        clock = itertools.count(T0)
        return SwaClient(client.connection, path="direct", wall_clock=lambda: float(next(clock)), **kwargs)

    def trace(self) -> Any:
        """The running server's trace counters (its Stats answer)."""
        with self.client("admin") as admin:
            return admin.stats().trace

    def swa_stats(self) -> pb.SwaStatsResponse:
        """The SWA pool's counters, as an admin sees them."""
        with self.client("admin") as admin:
            return SwaClient(admin.connection, path="gateway").stats()

    def swa_records(self) -> list[dict[str, Any]]:
        return [r for _, _, r in recorded.records(self.folder) if r["op"] in ("swa_put", "swa_get")]


@pytest.fixture
def serve(tmp_path: Path, redis_server: Any) -> Iterator[Callable[..., Server]]:
    """Starts a `kvstore serve` child on the Redis backend, recording its trace or not."""
    children: list[Child] = []

    def _start(*, trace: bool) -> Server:
        data_dir = tmp_path / "store"
        data_dir.mkdir()
        tenants = data_dir / "tenants.json"
        tokens = {who: api_tokens.create(tenants, f"tenant-{who}", RW)[1] for who in ("a", "b")}
        tokens["admin"] = api_tokens.create(tenants, "ops", frozenset({"read", "write", "admin"}))[1]
        folder = tmp_path / "trace"
        sections: dict[str, Any] = {
            "store": {"data_dir": str(data_dir), "capacity_bytes": 1 << 30},
            "swa": {"backend": "redis", "redis_url": redis_server.url, "cap_bytes": 256 << 20}}
        if trace:
            sections["trace"] = {"enabled": True, "dir": str(folder), "flush_s": 0.05, "hash_bytes": HASH_BYTES}
        cfg = write_config(tmp_path / "kvstore.toml", sections)
        child = Child("serve", ["serve", "--config", str(cfg), "--port", "0"], tmp_path / "logs")
        children.append(child)
        return Server(child=child, tokens=tokens, folder=folder)

    yield _start
    for child in children:
        child.kill_if_alive()


def _hex(*keys: bytes) -> str:
    return "".join(k[:HASH_BYTES].hex() for k in keys)


def _snap(client: Client, position: int) -> bytes:
    return os.urandom(client.swa.snapshot_bytes(position))


def _bare(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "geometry"} for r in records]


def test_each_direct_put_and_get_in_redis_is_one_record_at_the_clients_time(serve: Callable[..., Server]) -> None:
    server = serve(trace=True)
    reports = Reports()
    with server.client("a") as c:
        swa, gateway = server.direct(c, reports), SwaClient(c.connection, path="gateway")
        (k1, d1), (k2, d2) = [(swa.key(TOKENS, t), _snap(c, t)) for t in (127, 200)]
        missing = swa.key(TOKENS, 251)
        assert swa.put_many([(k1, 127, d1), (k2, 200, d2)]).stored == 2 and swa.last_path == "direct"
        assert swa.get_many([k2, missing, k1]) == [d2, None, d1] and swa.last_path == "direct"
        swa.flush_report()
        assert gateway.get_many([k1, missing]) == [d1, None]  # beside them, a SwaPool.Get over gRPC
    with server.client("b") as c:
        swa_b = server.direct(c)
        kb, db = swa_b.key(TOKENS, 200), _snap(c, 200)
        assert swa_b.put_many([(kb, 200, db)]).stored == 1
        assert swa_b.get_many([kb, k1]) == [db, None] and swa_b.last_path == "direct"  # a's key is not b's
        swa_b.flush_report()
    wait_until(lambda: server.trace().written_records == 5, "the five SWA calls' records written")
    got = server.swa_records()
    assert _bare(got) == [
        {"t": T0, "op": "swa_put", "tenant": "tenant-a", "via": "redis-direct", "snapshots": 2, "stored": 2,
         "hashes": _hex(k1, k2)},
        {"t": T0 + 1, "op": "swa_get", "tenant": "tenant-a", "via": "redis-direct", "asked": 3, "found": 2,
         "hashes": _hex(k2, missing, k1)},
        {"t": got[2]["t"], "op": "swa_get", "tenant": "tenant-a", "via": "grpc", "asked": 2, "found": 1,
         "hashes": _hex(k1, missing)},
        {"t": T0, "op": "swa_put", "tenant": "tenant-b", "via": "redis-direct", "snapshots": 1, "stored": 1,
         "hashes": _hex(kb)},
        {"t": T0 + 1, "op": "swa_get", "tenant": "tenant-b", "via": "redis-direct", "asked": 2, "found": 1,
         "hashes": _hex(kb, k1)},
    ]
    assert len({r["geometry"] for r in got}) == 1 and got[2]["t"] > T0 + 1e6  # the server's own time: now
    # One report, or more where a second passed between the calls (each then sent when due).
    assert [(c.put, c.snapshots, c.found) for r in reports.sent for c in r.calls] == [(True, 2, 2), (False, 3, 2)]
    assert {r.geometry for r in reports.sent} == {got[0]["geometry"]}
    assert server.child.stop() == 0
    assert ", 0 dropped" in server.child.log()


def test_a_report_sent_twice_is_traced_once_and_a_bad_call_is_refused(serve: Callable[..., Server]) -> None:
    server = serve(trace=True)
    with server.client("a") as c:
        stub = pb_grpc.SwaPoolStub(c.connection.channel)
        key, marker = bytes(range(32)), bytes(range(1, 33))
        twice = pb.SwaReportDirectRequest(report_id=bytes(16), calls=[
            pb.SwaDirectCall(time_s=T0, keys=[key], snapshots=1, found=1)])
        for request in (twice, twice, pb.SwaReportDirectRequest(calls=[
                pb.SwaDirectCall(time_s=T0 + 1, put=True, keys=[marker], snapshots=1, found=1)])):
            c.connection.call(stub.ReportDirect, request)
        # Records are written in order: once the last one is, the second sending's would have been too.
        wait_until(lambda: server.trace().written_records >= 2
                   and any(r["hashes"] == _hex(marker) for r in server.swa_records()), "the marker written")
        assert [(r["op"], r["t"], r["hashes"]) for r in server.swa_records()] == [
            ("swa_get", T0, _hex(key)), ("swa_put", T0 + 1, _hex(marker))]
        bad = {
            "calls has 1025 entries; report at most 1024":
                [pb.SwaDirectCall(time_s=T0, snapshots=1)] * 1025,
            "calls carry 4160 keys; report at most 4096":
                [pb.SwaDirectCall(time_s=T0, keys=[key] * 64, snapshots=64)] * 65,
            r"calls\[1\] has 65 keys, 65 snapshots, 0 found: keys <= 64":
                [pb.SwaDirectCall(time_s=T0, snapshots=1), pb.SwaDirectCall(time_s=T0, keys=[key] * 65, snapshots=65)],
            r"calls\[0\] has 2 keys, 1 snapshots": [pb.SwaDirectCall(time_s=T0, keys=[key] * 2, snapshots=1)],
            r"calls\[0\] has 1 keys, 1 snapshots, 2 found": [pb.SwaDirectCall(time_s=T0, keys=[key], snapshots=1,
                                                                              found=2)],
            r"calls\[0\].time_s is 0.0": [pb.SwaDirectCall(keys=[key], snapshots=1)],
            r"calls\[0\].keys: each snapshot key is 32 bytes": [pb.SwaDirectCall(time_s=T0, keys=[b"short"],
                                                                                 snapshots=1)],
        }
        for message, calls in bad.items():
            with pytest.raises(InvalidArgument, match=message):
                c.connection.call(stub.ReportDirect, pb.SwaReportDirectRequest(calls=calls))


def test_calls_past_the_bounds_are_cut_and_counted(serve: Callable[..., Server],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys past MAX_CALL_KEYS are left out of a call (its `keys_cut` says how many); calls past
    MAX_REPORTED_CALLS or MAX_REPORTED_KEYS wait for the next report; past MAX_PENDING_CALLS the oldest are
    dropped and the server counts them as dropped records."""
    monkeypatch.setattr(swa_report, "MAX_CALL_KEYS", 2)
    monkeypatch.setattr(swa_report, "MAX_REPORTED_CALLS", 2)
    monkeypatch.setattr(swa_report, "MAX_PENDING_CALLS", 3)
    monkeypatch.setattr(swa_report, "MAX_REPORTED_KEYS", 2)
    server = serve(trace=True)
    reports = Reports()
    with server.client("a") as c:
        # A clock that stands still: nothing is due, so the calls wait for flush_report.
        swa = server.direct(c, reports, clock=lambda: 0.0)
        keys = [swa.key(TOKENS, t) for t in (1, 2, 3)]
        assert swa.get_many([swa.key(TOKENS, 4)]) == [None]  # (its first get asks the batch size: a report)
        assert swa.put_many([(k, t, _snap(c, t)) for k, t in zip(keys, (1, 2, 3), strict=True)]).stored == 3
        for k in keys:
            assert swa.get_many([k]) != [None]
        swa.flush_report()  # five calls, three kept: the miss and the put are dropped
        assert [(len(r.calls), r.calls_dropped) for r in reports.sent] == [(2, 2), (1, 0)]
        put = swa.put_many([(k, t, _snap(c, t)) for k, t in zip(keys, (1, 2, 3), strict=True)])
        assert put.stored == 3 and swa.get_many([keys[0]]) != [None]
        swa.flush_report()  # the put's two keys fill a report (MAX_REPORTED_KEYS): the get goes in the next
        assert [[len(c.keys) for c in r.calls] for r in reports.sent[2:]] == [[2], [1]]
    wait_until(lambda: server.trace().written_records == 5, "five records written")
    assert server.trace().dropped_records == 2
    got = server.swa_records()
    assert [(r["op"], r["hashes"]) for r in got[:3]] == [("swa_get", _hex(k)) for k in keys]
    assert (got[3]["op"], got[3]["snapshots"], got[3]["keys_cut"], got[3]["hashes"]) == (
        "swa_put", 3, 1, _hex(*keys[:2]))
    assert "keys_cut" not in got[4] and got[4]["hashes"] == _hex(keys[0])


def test_a_server_without_a_trace_gets_counts_only(serve: Callable[..., Server]) -> None:
    server = serve(trace=False)
    reports = Reports()
    with server.client("a") as c:
        swa = server.direct(c, reports)
        key = swa.key(TOKENS, 128)
        assert swa.put_many([(key, 128, _snap(c, 128))]).stored == 1
        assert swa.get_many([key, swa.key(TOKENS, 200)])[1] is None and swa.last_path == "direct"
        swa.flush_report()
    stats = server.swa_stats()
    assert (stats.gets, stats.snapshots_asked, stats.hits, stats.puts) == (1, 2, 1, 1)  # counted as before
    assert reports.sent and all(not r.calls and not r.calls_dropped and not r.geometry for r in reports.sent)
