"""What a client did on the SWA direct path in Redis, reported to the gateway's counters (SwaPool.ReportDirect).

The gateway never sees a direct get or put, so the client counts them and
reports them (docs/SWA_POOL.md, direct-path rule 5): when `REPORT_GETS` gets
are pending or `REPORT_EVERY_S` passed since the last report. A report that
falls due during a get or put is sent without waiting for its answer (a gRPC
future, looked at again at the next call): counting never holds up a
snapshot. `flush` sends what is pending and waits (`SwaClient.stats()` and
`close()` use it). A report that fails for now (a retryable error: the gateway
unreachable, a deadline, a rate limit) is kept and sent again, as it was and
under the same id (`report_id`), before any newer counts: the gateway may have
counted it and only its answer was lost, and it counts an id once
(gateway/swa_reports.py). A report the gateway refuses for good (a non-retryable
error: InvalidArgument for a geometry or batch size it no longer takes after a
config change, PermissionDenied) is dropped, counted (`dropped`, the client's
`reports_dropped`) and logged with the gateway's message (once per message): sent
again it would be refused again, and every newer report would wait behind it for
ever. A failure is never raised: counting is not worth failing a get for.

When the gateway records its access trace (the grant's `trace_calls`), each direct call is
reported too, for the trace: its time by this client's clock, put or get, its snapshot keys
(the first `MAX_CALL_KEYS`; `snapshots` says how many it had) and what it found or stored.
A report carries at most `MAX_REPORTED_CALLS` calls and `MAX_REPORTED_KEYS` keys (the rest wait
for the next); at most `MAX_PENDING_CALLS` wait (the oldest are dropped, and the next report
says how many: `calls_dropped`). Without `trace_calls` no call is kept: the report is counts only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvstore.client.connection import Connection, status_error
from kvstore.v1 import swa_pb2 as pb

log = logging.getLogger(__name__)

#: Direct gets are reported when this many are pending or this many seconds passed since the last report.
REPORT_GETS = 256
REPORT_EVERY_S = 1.0
#: Most reported gets kept while the gateway cannot be told (the oldest are dropped).
MAX_PENDING_GETS = 4096
#: Most gets one report carries (the server's limit, gateway.swa_servicer.MAX_REPORTED_GETS).
MAX_REPORTED_GETS = 4096
#: The direct calls kept for the gateway's trace: most pending (the oldest dropped and counted beyond), and
#: the bounds of one report (the server's, gateway.swa_servicer: calls, keys in all, keys of one call).
MAX_PENDING_CALLS = 4096
MAX_REPORTED_CALLS = 1024
MAX_REPORTED_KEYS = 4096
MAX_CALL_KEYS = 64
#: A report id's length, as the wire contract says (proto/kvstore/v1/swa.proto, `report_id`).
REPORT_ID_BYTES = 16

#: One get call: snapshots asked, found, and found corrupt.
Get = tuple[int, int, int]


class DirectReport:
    """The direct path's pending counts, and the report on its way to the gateway (safe to share
    between threads: one lock, held for a count or the start of a report, and across `flush`'s call).

    Args:
        connection: the client's connection (deadline, metadata).
        stub: a SwaPool stub on its channel.
        clock: monotonic seconds (injected in tests).
        wall_clock: Unix seconds, the traced calls' time (injected in tests).
    """

    def __init__(self, connection: Connection, stub: Any, clock: Callable[[], float],
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.connection = connection
        self._stub = stub
        self.clock = clock
        self.wall_clock = wall_clock
        self._gets: list[Get] = []
        self._puts = (0, 0, 0)  # calls, snapshots, bytes
        #: Calls for the gateway's trace (only while it asks for them), and how many were dropped unsent.
        self._calls: list[pb.SwaDirectCall] = []
        self._calls_dropped = 0
        self._sent_at = clock()
        self._lock = threading.Lock()
        #: The report sent without waiting, and its future (kept in `_unsent` if it fails).
        self._in_flight: tuple[Any, pb.SwaReportDirectRequest] | None = None
        #: The report that failed: sent again as it was, before any newer counts (one at most: no
        #: new report is made while it waits; the counts meanwhile wait in `_gets` and `_puts`).
        self._unsent: pb.SwaReportDirectRequest | None = None
        #: Reports the gateway refused for good (a non-retryable error), dropped unsent again.
        self.dropped = 0
        #: The gateway's message for the last report it refused, logged once (the same refusal again is only counted).
        self._refusal = ""

    def got(self, asked: int, found: int, corrupt: int, keys: Sequence[bytes] | None = None) -> None:
        """Count one direct get call; with its `keys`, report it for the gateway's trace too."""
        with self._lock:
            self._gets.append((asked, found, corrupt))
            del self._gets[:-MAX_PENDING_GETS]
            if keys is not None:
                self._keep_call(put=False, keys=keys, snapshots=asked, found=found)
            self._maybe_send()

    def put(self, snapshots: int, nbytes: int, keys: Sequence[bytes] | None = None) -> None:
        """Count one direct put call of `snapshots` snapshots of `nbytes` bytes; with its `keys`, report it for
        the gateway's trace too."""
        with self._lock:
            calls, count, total = self._puts
            self._puts = (calls + 1, count + snapshots, total + nbytes)
            if keys is not None:
                self._keep_call(put=True, keys=keys, snapshots=snapshots, found=snapshots)
            self._maybe_send()

    def _keep_call(self, *, put: bool, keys: Sequence[bytes], snapshots: int, found: int) -> None:
        """Keep one call for the trace (under the lock), its time now (it has just ended)."""
        self._calls.append(pb.SwaDirectCall(time_s=self.wall_clock(), put=put, keys=keys[:MAX_CALL_KEYS],
                                            snapshots=snapshots, found=found))
        excess = len(self._calls) - MAX_PENDING_CALLS
        if excess > 0:  # the gateway is out of reach: the oldest go, counted, as the trace's writer drops
            del self._calls[:excess]
            self._calls_dropped += excess

    def flush(self) -> None:
        """Send what is pending now and wait for the gateway's answer (after the report in flight)."""
        with self._lock:
            self._settle(wait=True)
            self._sent_at = self.clock()
            c = self.connection
            while (request := self._next()) is not None:
                try:
                    self._stub.ReportDirect(request, timeout=c.timeout_s, metadata=c.metadata)
                except grpc.RpcError as exc:
                    # Kept: first again next time, no retry loop here. Dropped: the next report (its calls
                    # counted as dropped) goes next time too, or a gateway refusing every report would loop here.
                    self._failed(request, exc)
                    return

    def _maybe_send(self) -> None:
        """Send a report without waiting when one is due and none is in flight (under the lock)."""
        if (len(self._gets) < REPORT_GETS and len(self._calls) < REPORT_GETS
                and self.clock() - self._sent_at < REPORT_EVERY_S):
            return
        if not self._settle(wait=False):
            return  # the last report is still on its way: the next call sends this one
        self._sent_at = self.clock()
        request = self._next()
        if request is not None:
            c = self.connection
            self._in_flight = (self._stub.ReportDirect.future(request, timeout=c.timeout_s, metadata=c.metadata),
                               request)

    def _settle(self, *, wait: bool) -> bool:
        """Take the answer of the report in flight (waiting for it with `wait`), keeping the report to
        send again when it failed; whether no report is in flight now."""
        if self._in_flight is None:
            return True
        future, request = self._in_flight
        if not wait and not future.done():
            return False
        self._in_flight = None
        try:
            future.result()
        except grpc.RpcError as exc:
            self._failed(request, exc)
        except Exception:  # a call cancelled here (FutureCancelledError): not refused, so sent again, first
            self._unsent = request
        return True

    def _failed(self, request: pb.SwaReportDirectRequest, exc: grpc.RpcError) -> None:
        """Keep a report that failed for now, to send again first under its id, or drop one the gateway refused
        for good (under the lock)."""
        error = status_error(exc)
        if error.retryable:  # UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED: it may be taken later as it is
            self._unsent = request
            return
        # Refused for good: sent again it would be refused again, with every newer report waiting behind it.
        self.dropped += 1
        # Its calls never reach the trace: the next report says so, as it does for calls dropped unsent.
        self._calls_dropped += len(request.calls) + request.calls_dropped
        if error.message != self._refusal:
            self._refusal = error.message
            log.warning("the gateway refused a direct-path report (%s: %s); dropped, with its %d get calls, "
                        "%d put calls and %d traced calls (the same refusal again is only counted: "
                        "SwaClient.reports_dropped, %d so far)", exc.code().name, error.message, len(request.gets),
                        request.puts, len(request.calls), self.dropped)

    def _next(self) -> pb.SwaReportDirectRequest | None:
        """The next report to send: the one that failed, else one of the pending counts (None: nothing)."""
        request, self._unsent = self._unsent, None
        return request if request is not None else self._take()

    def _take(self) -> pb.SwaReportDirectRequest | None:
        """A new report of the pending counts, taken out of them (None: nothing pending)."""
        if not self._gets and not self._puts[0] and not self._calls and not self._calls_dropped:
            return None
        gets, puts = self._gets[:MAX_REPORTED_GETS], self._puts
        del self._gets[:len(gets)]
        self._puts = (0, 0, 0)
        calls = self._take_calls()
        dropped, self._calls_dropped = self._calls_dropped, 0
        return pb.SwaReportDirectRequest(
            gets=[pb.SwaDirectGet(asked=a, found=f, corrupt=c) for a, f, c in gets],
            puts=puts[0], snapshots_put=puts[1], bytes_put=puts[2], report_id=os.urandom(REPORT_ID_BYTES),
            calls=calls, calls_dropped=dropped, geometry=self.connection.geometry if calls else "")

    def _take_calls(self) -> list[pb.SwaDirectCall]:
        """The oldest pending calls that fit one report (MAX_REPORTED_CALLS, MAX_REPORTED_KEYS), taken out: the
        oldest at least (a call's keys are cut to MAX_CALL_KEYS, fewer than a report's), so `flush` ends."""
        keys = n = 0
        for call in self._calls[:MAX_REPORTED_CALLS]:
            if n and keys + len(call.keys) > MAX_REPORTED_KEYS:
                break
            keys += len(call.keys)
            n += 1
        calls = self._calls[:n]
        del self._calls[:n]
        return calls
