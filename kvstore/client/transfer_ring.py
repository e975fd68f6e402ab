"""The client's side of a session's request ring (`kvstore/transfer_ring.py` has the layout).

A small read batch on the shared-memory path is written into the ring and
answered by a server thread, without a gRPC call: the client writes the
request, sets the state word and wakes the futex, then spins briefly (an
answer often comes within microseconds) before sleeping on the futex.

While it waits it looks, every `POLL_S`, whether the session's stream has
ended (the server died, or dropped the connection) and whether the call's
deadline (the connection's `timeout_s`) has passed: a dead server is an
`Unavailable` (or `DeadlineExceeded`), never a hang. Once a wait has failed,
the ring is not used again (its slot may still be answered late); the session
goes on through Submit.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

import grpc

from kvstore.errors import DeadlineExceeded, Internal, KVStoreError, Unavailable, from_status
from kvstore.region import NONCE_BYTES, Region
from kvstore.transfer_ring import (
    ANSWER_AT,
    ANSWER_BYTES,
    ANSWERED,
    CLOSED,
    REQUEST,
    REQUEST_AT,
    REQUEST_BYTES,
    RING_BYTES,
    Futex,
    Header,
    current_cpu,
    header_in,
)
from kvstore.v1 import transfer_pb2 as pb

if TYPE_CHECKING:
    from kvstore.client.transfer import TransferSession

#: How long the client spins on the state word before it sleeps on the futex ...
SPIN_S = 500e-6
#: ... of which the first part without yielding the core: a small request's answer usually comes
#: within it (the server works on the other core), and a yield on a loaded box can hand the core
#: to another process for a whole time slice.
HOT_SPIN_S = 100e-6
#: ... for requests of at most this many descriptors (a larger one takes the server longer
#: than a futex wake-up costs: its client sleeps at once and leaves the core to others).
SPIN_DESCRIPTORS = 16
#: How often a sleeping client looks at the session's stream and its deadline.
POLL_S = 0.05
#: Not a gRPC code: the server's answer when the ring's lease ended (`gateway.transfer_ring.RENEW`).
RENEW = 1000
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class RingUnusable(Exception):
    """The ring cannot take this request now (busy on another thread, too large, or broken): use Submit."""


class RingClient:
    """A session's request ring: registered with the server, then written per small read.

    Args:
        session: the transfer session (its stub, id, connection and event stream).

    Raises:
        KVStoreError: the registration call failed.
        RingUnusable: the server offers no ring (another host, or an older server).
    """

    def __init__(self, session: TransferSession) -> None:
        self.session = session
        self.spin_s = SPIN_S
        self.broken = ""
        #: Requests the server answered through the ring (errors included).
        self.answered = 0
        self._lock = threading.Lock()
        self._seq = 0
        self._region: Region | None = Region(RING_BYTES)
        try:
            reply = self._register(first=True)
        except BaseException:
            self._region.close()
            self._region = None
            raise
        if not reply.ring_descriptors:
            self.close()
            raise RingUnusable(reply.reason or "the server offers no request ring")
        self.max_descriptors = reply.ring_descriptors
        self.lease_s = reply.ring_lease_ms / 1000
        self._renew_at = time.monotonic() + self.lease_s / 2
        self._view: memoryview | None = self._region.view
        self._header: Header | None = header_in(self._view)
        self._futex: Futex | None = Futex(self._header)

    def _register(self, *, first: bool) -> pb.RegisterRegionResponse:
        """Map the ring in the server (first), or renew its lease: through auth either way."""
        region = self._region
        assert region is not None
        s = self.session
        request = pb.RegisterRegionRequest(session_id=s.session_id, shm_name=region.name, size_bytes=RING_BYTES,
                                           ring=True)
        if first:
            request.nonce = region.write_nonce()
            request.pid, request.fd = region.handle
        reply = s.call(s.stub.RegisterRegion, request)
        if first:
            region.view[:NONCE_BYTES] = bytes(NONCE_BYTES)
            region.release_fd()
        return reply  # type: ignore[no-any-return]

    def read(self, request: pb.SubmitRequest) -> pb.TransferState:
        """Run one read batch through the ring and return its final state.

        Raises:
            RingUnusable: the ring cannot take it (the caller uses Submit instead).
            KVStoreError: the server refused it (as Submit would), or the session died.
        """
        if self.broken or not self._lock.acquire(blocking=False):
            raise RingUnusable(self.broken or "the ring is busy with another thread's request")
        try:
            if time.monotonic() > self._renew_at:
                self._renew()
            groups = request.groups
            small = len(groups) == 1 and len(groups[0].offsets_bytes) <= SPIN_DESCRIPTORS
            spin = self.spin_s if small or sum(len(g.offsets_bytes) for g in groups) <= SPIN_DESCRIPTORS else 0.0
            code, answer = self._ask(request, spin)
            if code == RENEW:  # the lease ran out between our look and the server's: renew, ask again
                self._renew()
                code, answer = self._ask(request, spin)
            if code:
                raise from_status(_CODES.get(code, grpc.StatusCode.UNKNOWN), answer.decode(errors="replace"))
            return pb.TransferState.FromString(answer)
        finally:
            self._lock.release()

    def _renew(self) -> None:
        self._register(first=False)
        self._renew_at = time.monotonic() + self.lease_s / 2

    def _ask(self, request: pb.SubmitRequest, spin_s: float) -> tuple[int, bytes]:
        header, futex, view = self._header, self._futex, self._view
        if header is None or futex is None or view is None:
            raise RingUnusable("the ring is closed")
        raw = request.SerializeToString()
        if len(raw) > REQUEST_BYTES:
            raise RingUnusable("the request does not fit the ring")
        self._seq = seq = (self._seq + 1) & 0xFFFFFFFF
        view[REQUEST_AT:REQUEST_AT + len(raw)] = raw
        cpu = current_cpu() + 1
        # The server last answered on this CPU: a spin that does not yield would only keep it off.
        hot_s = 0.0 if cpu == header.server_cpu else min(spin_s, HOT_SPIN_S)
        header.seq, header.length, header.client_cpu = seq, len(raw), cpu
        header.state = REQUEST  # after the request's bytes: x86-64 keeps stores in order
        futex.wake()
        self._wait(header, futex, seq, spin_s, hot_s)
        self.answered += 1
        n = header.answer_length
        if n > ANSWER_BYTES:
            self._break("the server's answer is past the answer area")
            raise Internal("the ring's answer could not be read (its length is past the answer area)")
        return header.code, bytes(view[ANSWER_AT:ANSWER_AT + n])

    def _wait(self, header: Header, futex: Futex, seq: int, spin_s: float, hot_s: float) -> None:
        """Until the server answers request `seq`; raises if the session or the deadline ends first."""
        # Spin a little: first on the word alone, then yielding the core (on a small box the server
        # may need this one), then sleep.
        clock = time.perf_counter
        now = clock()
        hot_end, spin_end = now + hot_s, now + spin_s
        while now < hot_end:
            if header.state == ANSWERED and header.answer_seq == seq:
                return
            now = clock()
        while now < spin_end:
            if header.state == ANSWERED and header.answer_seq == seq:
                return
            os.sched_yield()
            now = clock()
        timeout_s = self.session.connection.timeout_s
        deadline = time.monotonic() + timeout_s if timeout_s else None
        while True:
            state = header.state
            if state == ANSWERED and header.answer_seq == seq:
                return
            if state == CLOSED:
                self._break("the server closed the ring")
                raise Unavailable("the transfer session ended (the server closed its ring)")
            futex.wait(state, POLL_S)
            if self.session.ended():
                self._break("the session's stream ended")
                raise Unavailable("the transfer session ended: the server stopped or dropped the connection",
                                  hint="open a new session once the server is back")
            if deadline is not None and time.monotonic() > deadline:
                self._break("a request was not answered in time")
                raise DeadlineExceeded(f"the ring request was not answered within {timeout_s:g} s")

    def _break(self, why: str) -> None:
        self.broken = why

    def close(self) -> None:
        """Stop using the ring and unmap it here (the server unmaps its side when the session ends)."""
        self.broken = self.broken or "closed"
        # A request in flight on another thread ends first (at its deadline at worst): it reads the mapping.
        locked = self._lock.acquire(timeout=self.session.connection.timeout_s or -1)
        self._header = self._futex = None
        if getattr(self, "_view", None) is not None:
            self._view.release()  # type: ignore[union-attr]
            self._view = None
        if self._region is not None:
            self._region.close()
            self._region = None
        if locked:
            self._lock.release()


def open_ring(session: TransferSession) -> tuple[RingClient | None, str]:
    """The session's ring, or None and why not (the session then reads small batches with Submit)."""
    try:
        return RingClient(session), ""
    except RingUnusable as exc:
        return None, str(exc)
    except (KVStoreError, OSError) as exc:
        return None, f"the ring could not be registered: {exc}"

