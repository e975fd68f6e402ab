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

A fetch into consecutive slots (`fetch_slots`, what `TransferSession.fetch` sends) skips
protobuf on its hot path: its request is the `SubmitRequest` protobuf would write, built
from a per-shape template (`transfer_ring_request.Template`: every byte but the hashes prebuilt), and an
answer that is byte for byte the all-DONE `TransferState` (what the native server
writes for a plain read) is read without parsing. Where `kvstore.native._ring` is built, writing
the request, waking the server and the first spin run natively without the GIL (`ask`);
any other answer is parsed as before.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import TYPE_CHECKING

import grpc

from kvstore.client.transfer_ring_request import TEMPLATES_KEPT, Template, all_done
from kvstore.errors import DeadlineExceeded, Internal, KVStoreError, Unavailable, from_status
from kvstore.native import ring as native_ring
from kvstore.region import NONCE_BYTES, Region
from kvstore.transfer import TransferState
from kvstore.transfer_ring import (
    ANSWER_AT,
    ANSWER_BYTES,
    ANSWERED,
    CLOSED,
    HEADER_AT,
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
    from kvstore.client.transfer_path import SessionView

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
#: Whether requests are written, and answers waited for, natively (`kvstore.native._ring` built): `fetch_list` works.
NATIVE_ASK = native_ring.NATIVE


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

    def __init__(self, session: SessionView) -> None:
        self.session = session
        self.spin_s = SPIN_S
        self.broken = ""
        #: Requests the server answered through the ring (errors included).
        self.answered = 0
        self._lock = threading.Lock()
        self._seq = 0
        self._templates: dict[tuple[int, int, int, int, bool], Template] = {}
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
        self._address = ctypes.addressof(self._header) - HEADER_AT

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

    def fetch_slots(self, hashes: bytes, n: int, region_id: int, offset_bytes: int, block_bytes: int,
                    prefix_only: bool) -> TransferState:
        """Read `n` blocks (`hashes`: n whole hashes, joined) into consecutive slots of a region
        from `offset_bytes`: `read` of that request, without protobuf when all goes well.

        Raises:
            RingUnusable, KVStoreError: as `read`.
        """
        if self.broken or not self._lock.acquire(blocking=False):
            raise RingUnusable(self.broken or "the ring is busy with another thread's request")
        try:
            template = self._template((region_id, offset_bytes, n, block_bytes, prefix_only))
            raw = template.head + hashes + template.tail
            if time.monotonic() > self._renew_at:
                self._renew()
            spin = self.spin_s if n <= SPIN_DESCRIPTORS else 0.0
            code, answer = self._ask_raw(raw, spin, template.answer)
            return self._state(code, answer, raw, spin, template, block_bytes)
        finally:
            self._lock.release()

    def fetch_list(self, hashes: list[bytes], region_id: int, offset_bytes: int, block_bytes: int,
                   prefix_only: bool) -> TransferState | None:
        """`fetch_slots` of a list of hashes where `kvstore.native._ring` is built: the list is checked and
        written into the ring natively (`kvstore.native.ring.ask_slots`), with no join and no pass over it in
        Python. None, with nothing sent, when it is not a list of `bytes` of `HASH_BYTES` each (the
        caller then checks it the long way) or the ring is not native.

        Raises:
            RingUnusable, KVStoreError: as `read`.
        """
        if not NATIVE_ASK:
            return None
        if self.broken or not self._lock.acquire(blocking=False):
            raise RingUnusable(self.broken or "the ring is busy with another thread's request")
        try:
            n = len(hashes)
            template = self._templates.get((region_id, offset_bytes, n, block_bytes, prefix_only))
            if template is None:
                template = self._template((region_id, offset_bytes, n, block_bytes, prefix_only))
            if time.monotonic() > self._renew_at:
                self._renew()
            if self._header is None:
                raise RingUnusable("the ring is closed")
            spin = self.spin_s if n <= SPIN_DESCRIPTORS else 0.0
            self._seq = seq = (self._seq + 1) & 0xFFFFFFFF
            got = native_ring.ask_slots(self._address, template.head, hashes, template.tail, seq,
                                        min(spin, HOT_SPIN_S), spin, template.answer)
            if got == native_ring.ASKED_EXPECTED:  # the hot path: all DONE, nothing to parse
                self.answered += 1
                return all_done(template.statuses, block_bytes)
            if got < 0:
                return None
            header, futex, view = self._header, self._futex, self._view
            assert header is not None and futex is not None and view is not None
            if got == native_ring.ASKED_NONE:
                self._wait(header, futex, seq, 0.0, 0.0)
            code, answer = self._answer(header, view, template.answer)
            return self._state(code, answer, template.head + b"".join(hashes) + template.tail, spin, template,
                               block_bytes)
        finally:
            self._lock.release()

    def _template(self, shape: tuple[int, int, int, int, bool]) -> Template:
        template = self._templates.get(shape)
        if template is None:
            if len(self._templates) >= TEMPLATES_KEPT:
                self._templates.clear()
            template = self._templates[shape] = Template(*shape)
        return template

    def _state(self, code: int, answer: bytes, raw: bytes, spin: float, template: Template, block_bytes: int
               ) -> TransferState:
        """A consecutive-slots read's state from its answer (asked again once if the lease had ended)."""
        if code == RENEW:
            self._renew()
            code, answer = self._ask_raw(raw, spin, template.answer)
        if code:
            raise from_status(_CODES.get(code, grpc.StatusCode.UNKNOWN), answer.decode(errors="replace"))
        if answer is template.answer:  # byte for byte the all-DONE answer: nothing to parse
            return all_done(template.statuses, block_bytes)
        reply = pb.TransferState.FromString(answer)
        return TransferState(transfer_id=reply.transfer_id, done=reply.done, bytes_moved=reply.bytes_moved,
                             statuses=reply.statuses, block_bytes=block_bytes, block_hashes=reply.block_hashes,
                             failures={f.index: (f.code, f.reason) for f in reply.failures})

    def _renew(self) -> None:
        self._register(first=False)
        self._renew_at = time.monotonic() + self.lease_s / 2

    def _ask(self, request: pb.SubmitRequest, spin_s: float) -> tuple[int, bytes]:
        return self._ask_raw(request.SerializeToString(), spin_s, b"")

    def _ask_raw(self, raw: bytes, spin_s: float, expected: bytes) -> tuple[int, bytes]:
        """Send one request's bytes and wait for its answer: (code, answer bytes), the answer being
        `expected` itself (the same object) when it is byte for byte that with code 0."""
        header, futex, view = self._header, self._futex, self._view
        if header is None or futex is None or view is None:
            raise RingUnusable("the ring is closed")
        if len(raw) > REQUEST_BYTES:
            raise RingUnusable("the request does not fit the ring")
        self._seq = seq = (self._seq + 1) & 0xFFFFFFFF
        if native_ring.NATIVE:  # written, woken and spun for without the GIL
            got = native_ring.ask(self._address, raw, seq, min(spin_s, HOT_SPIN_S), spin_s, expected)
            if got == native_ring.ASKED_EXPECTED:
                self.answered += 1
                return 0, expected
            if got == native_ring.ASKED_NONE:
                self._wait(header, futex, seq, 0.0, 0.0)
            return self._answer(header, view, expected)
        view[REQUEST_AT:REQUEST_AT + len(raw)] = raw
        cpu = current_cpu() + 1
        # The server last answered on this CPU: a spin that does not yield would only keep it off.
        hot_s = 0.0 if cpu == header.server_cpu else min(spin_s, HOT_SPIN_S)
        header.seq, header.length, header.client_cpu = seq, len(raw), cpu
        header.state = REQUEST  # after the request's bytes: x86-64 keeps stores in order
        futex.wake()
        self._wait(header, futex, seq, spin_s, hot_s)
        return self._answer(header, view, expected)

    def _answer(self, header: Header, view: memoryview, expected: bytes) -> tuple[int, bytes]:
        """The answered request's code and bytes (`expected` itself when equal to it, with code 0)."""
        self.answered += 1
        n = header.answer_length
        if n > ANSWER_BYTES:
            self._break("the server's answer is past the answer area")
            raise Internal("the ring's answer could not be read (its length is past the answer area)")
        code, answer = header.code, bytes(view[ANSWER_AT:ANSWER_AT + n])
        return (0, expected) if code == 0 and expected and answer == expected else (code, answer)

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


def open_ring(session: SessionView) -> tuple[RingClient | None, str]:
    """The session's ring, or None and why not (the session then reads small batches with Submit)."""
    try:
        return RingClient(session), ""
    except RingUnusable as exc:
        return None, str(exc)
    except (KVStoreError, OSError) as exc:
        return None, f"the ring could not be registered: {exc}"

