"""Direct-path reports counted once (gateway/swa_reports.py, kvstore/client/swa_report.py): a
report the client sends again after losing its answer is not counted twice, on a real server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from gateway.swa_reports import SeenReports
from kvstore.client import Client
from kvstore.client.swa_report import DirectReport
from kvstore.config import StoreSettings
from kvstore.errors import InvalidArgument
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc

ID = bytes(range(16))


def test_an_id_is_new_once_per_tenant_until_it_is_forgotten() -> None:
    now = [0.0]
    seen = SeenReports(clock=lambda: now[0], keep_s=10.0, most=3)
    assert seen.first("a", ID) and not seen.first("a", ID)
    assert seen.first("b", ID), "tenants' ids are apart"
    now[0] = 10.5
    assert seen.first("a", ID), "remembered for keep_s only"
    for i in range(4):
        assert seen.first("a", bytes([i]) * 16)
    assert seen.remembered("a") == 3, "at most `most` per tenant, the oldest forgotten first"
    assert seen.first("a", ID) and seen.remembered("b") == 1


def test_a_report_sent_twice_under_one_id_is_counted_once_and_a_bad_id_is_refused(
        start_server: Callable[..., Any], store_settings: StoreSettings) -> None:
    server = start_server(store_settings)
    with Client(server.target) as client:
        stub = pb_grpc.SwaPoolStub(client.connection.channel)
        named = pb.SwaReportDirectRequest(gets=[pb.SwaDirectGet(asked=2, found=1)], puts=1, snapshots_put=1,
                                          report_id=ID)
        unnamed = pb.SwaReportDirectRequest(gets=[pb.SwaDirectGet(asked=1, found=1)])
        for request in (named, named, unnamed, unnamed):
            client.connection.call(stub.ReportDirect, request)
        with pytest.raises(InvalidArgument, match="report_id is 3 bytes; it must be 16"):
            client.connection.call(stub.ReportDirect, pb.SwaReportDirectRequest(
                gets=[pb.SwaDirectGet(asked=5, found=5)], report_id=b"abc"))
        stats = client.swa.stats()
        assert (stats.gets, stats.snapshots_asked, stats.hits, stats.puts, stats.snapshots_put) == (3, 4, 3, 1, 1)


class LoseFirstAnswer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Lets the first ReportDirect reach the server (which counts it), then fails it here with a retryable
    error, as a connection dropped before the answer came would."""

    def __init__(self) -> None:
        self.lost: list[bytes] = []
        self.sent: list[bytes] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        call = continuation(details, request)
        if details.method.endswith("/ReportDirect"):
            self.sent.append(request.report_id)
            if not self.lost:
                call.result()  # answered: counted
                self.lost.append(request.report_id)
                # The same report under a deadline already past: DEADLINE_EXCEEDED (retryable), and were it
                # to reach the server, its id is counted already.
                return continuation(details._replace(timeout=-1.0), request)
        return call


@pytest.mark.parametrize("due", [False, True], ids=["flushed", "sent-when-due"])
def test_a_report_whose_answer_was_lost_is_sent_again_under_its_id_and_counted_once(
        start_server: Callable[..., Any], store_settings: StoreSettings, due: bool) -> None:
    server = start_server(store_settings)
    now = [0.0]
    with Client(server.target) as client:
        lose = LoseFirstAnswer()
        stub = pb_grpc.SwaPoolStub(grpc.intercept_channel(client.connection.channel, lose))
        report = DirectReport(client.connection, stub, lambda: now[0])
        report.put(1, 100)
        now[0] += 2 if due else 0  # due: the next count sends it without waiting (a future)
        report.got(2, 1, 0)
        if not due:
            report.flush()
        deadline = time.monotonic() + 10
        while not lose.lost:
            assert time.monotonic() < deadline, "the first report was never sent"
            time.sleep(0.01)
        report.got(1, 1, 0)  # newer counts wait behind the report sent again
        report.flush()
        assert lose.sent == [lose.lost[0], lose.lost[0], lose.sent[2]] and lose.sent[2] != lose.lost[0]
        assert report.dropped == 0, "a retryable failure is sent again, never dropped"
        stats = client.swa.stats()
        assert (stats.gets, stats.snapshots_asked, stats.hits, stats.puts, stats.bytes_put) == (2, 3, 2, 1, 100)
