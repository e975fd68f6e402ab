"""The server's side of a session's request ring (`kvstore/transfer_ring.py` has the layout).

One thread per ring waits on the ring's futex; for each request it checks the
read as Submit checks it (the same `read_batch` span checks, region ownership
and tenant scope: `gateway.transfer_engine`), looks the blocks up, verifies and
copies them straight into the client's region (`StagedReads.copy`, the native
loop without the GIL), restarts their retention clocks durably (a read is use,
as a Get is) and writes the batch's `TransferState` back. No gRPC call is made
per read; the ring lives and dies with its session.

Where `kvstore.native._ring` is built, the thread waits natively (a short spin, then the futex,
without the GIL) and hands each request to `gateway.transfer_ring_native.NativeRing`,
which answers the plain case (one group, every block found, intact and not due a
refresh) in native code and hands any other back, as the bytes it read, to `read` here.

The client is untrusted, and so is every byte of the ring: the thread reads the
header words once, refuses a request length past the request area, copies the
request out of shared memory before parsing it (the client cannot change it
under the checks), and answers a malformed one with INVALID_ARGUMENT. A client
that flips the state word without sending a request only makes this thread
sleep in longer steps (see `_idle`). What one ring may cost is bounded: one
request at a time, at most `limit` descriptors (`RING_DESCRIPTORS`, and no more
than `transfer.chunk_descriptors` or `transfer.max_descriptors`), charged to the
tenant's `requests_per_s` when the server hands over its rate, and the ring
answers only while its lease (`LEASE_S`, renewed through RegisterRegion, so
through auth) runs: a revoked token stops its ring within the lease.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from gateway.transfer_engine import _CODES, _finish, _record, fail_unrefreshed, read_batch
from gateway.transfer_ring_context import RingContext
from gateway.transfer_ring_native import NativeRing, tier_mapping
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, to_status
from kvstore.native import ring as shared_ring
from kvstore.prefix import HASH_BYTES
from kvstore.transfer import DONE, BatchResults, DescriptorGroup
from kvstore.transfer_ring import (
    ANSWER_AT,
    ANSWER_BYTES,
    ANSWERED,
    BUSY,
    CLOSED,
    HEADER_AT,
    IDLE,
    LEASE_S,
    REQUEST,
    REQUEST_AT,
    REQUEST_BYTES,
    Futex,
    Header,
    header_in,
)
from kvstore.v1 import transfer_pb2 as pb
from tiers import ring as native_ring

if TYPE_CHECKING:
    from gateway.transfer_regions import MappedRegion
    from gateway.transfer_sessions import Session

log = logging.getLogger("kvstore.transfer")

#: The answer code that tells the client its lease ended: renew it, then ask again (not a gRPC code).
RENEW = 1000
_RING_NUMBERS = itertools.count(1)
#: Wake-ups without a request, in a row, before the thread sleeps between looks (a client flipping the word).
_SPURIOUS = 64


def _numbers(state: pb.TransferState, results: BatchResults) -> None:
    state.bytes_moved = results.bytes_moved
    state.statuses = bytes(results.statuses)
    for i, (code, reason) in sorted(results.failures.items()):
        state.failures.add(index=i, code=code, reason=reason)


def read(ctx: RingContext, session: Session, raw: bytes, *, charged: bool = False) -> pb.TransferState:
    """Check and run one ring request (a read batch) to its end; its final state.

    Args:
        charged: the request was charged to the tenant's rate already (handed back by the native server).

    Raises:
        InvalidArgument: not a SubmitRequest, not a read, or 0 or more than `ctx.limit` descriptors.
        ResourceExhausted: the tenant is over its request rate.
    """
    if ctx.rate is not None and not charged:
        ctx.rate.take(session.tenant)
    try:
        request = pb.SubmitRequest.FromString(raw)
    except DecodeError:
        raise InvalidArgument("the ring request is not a SubmitRequest") from None
    if request.op != pb.TRANSFER_OP_READ:
        raise InvalidArgument("a ring request reads (TRANSFER_OP_READ); write with Submit")
    if len(request.groups) > ctx.limit:  # each holds a descriptor or more: bounds the work of counting them
        raise InvalidArgument(f"a ring request holds 1 to {ctx.limit} descriptors in as many groups at most; "
                              f"got {len(request.groups)} groups")
    n = sum(len(g.offsets_bytes) for g in request.groups)
    if not 1 <= n <= ctx.limit:
        raise InvalidArgument(f"a ring request holds 1 to {ctx.limit} descriptors; got {n} (use Submit for more)")
    block_bytes = ctx.layouts[session.geometry].block_bytes
    prefix_only = request.prefix_only
    results = BatchResults(n)
    plan = _plain(ctx, session, request, block_bytes)
    if plan is not None:  # one group, every descriptor good: no numpy, no span objects
        keys, dests = plan
        end = n
    else:  # the general checks, exactly Submit's (each bad descriptor fails alone)
        batch = read_batch(ctx.table, session, [_group(g) for g in request.groups], block_bytes, results,
                           prefix_only)
        failed = batch.spans.first_failed()
        end = failed if prefix_only and failed is not None else n
        keys, dests = batch.keys(0, end), batch.spans.cut(0, end)
    found = 0
    due: list[bytes] = []
    if end:
        codes = _copy(ctx, keys, dests, prefix_only, due).translate(_CODES)
        found = codes.count(DONE)
        if found == n:
            results.statuses[:] = codes
        else:
            statuses = np.frombuffer(results.statuses, dtype=np.uint8)
            _record(results, statuses, 0, codes)
            del statuses
            loaded = len(codes) - len(codes.lstrip(bytes([DONE])))
            if prefix_only and loaded < len(codes):
                end = loaded + 1
        results.bytes_moved = found * block_bytes
    if found != n:
        _finish(results, end, prefix_only, session.closed)
    dests.clear()
    ctx.tier.count_get(n, found)
    if ctx.hits is not None:
        ctx.hits.record(session.scope.namespace, "get", n, found)
    if due:
        _refresh(ctx, session, keys, results, due)
    ctx.table.counters.count(results)  # under its lock: no wake of the event loop (a self-pipe write)
    state = pb.TransferState(done=True)
    _numbers(state, results)
    return state


def _plain(ctx: RingContext, session: Session, request: pb.SubmitRequest, block_bytes: int
           ) -> tuple[list[bytes | None], list[memoryview | None]] | None:
    """The keys and destination views of a request of one group whose every descriptor passes
    Submit's checks (its region is the session's, the length is the block size, the hashes are
    whole, every span is inside the region); None when any does not (the general path then
    fails each alone, with Submit's codes and reasons)."""
    if len(request.groups) != 1:
        return None
    g = request.groups[0]
    region = session.regions.get(g.region_id)
    offsets = list(g.offsets_bytes)
    n = len(offsets)
    hashes = g.block_hashes
    if region is None or g.length_bytes != block_bytes or len(hashes) != n * HASH_BYTES:
        return None
    view = region.view
    limit = len(view) - block_bytes
    if not all(0 <= o <= limit for o in offsets):
        return None
    prefix = session.scope.prefix
    keys: list[bytes | None] = [prefix + hashes[i * HASH_BYTES:(i + 1) * HASH_BYTES] for i in range(n)]
    return keys, [view[o:o + block_bytes] for o in offsets]


def _copy(ctx: RingContext, keys: list[bytes | None], dests: list[memoryview | None], prefix_only: bool,
          due: list[bytes]) -> bytes:
    """Look the blocks up and verify-copy them into their views (`StagedReads.copy`); `blockcopy` codes."""
    ctx.take_slot()
    try:
        staged = ctx.tier.stage_reads(keys)
        try:
            return staged.copy(dests, prefix_only, touch_due=due)
        finally:
            staged.close()
    finally:
        if ctx.slots is not None:
            ctx.slots.release()


def _group(g: pb.DescriptorGroup) -> DescriptorGroup:
    return DescriptorGroup(region_id=g.region_id, length_bytes=g.length_bytes, block_hashes=g.block_hashes,
                           offsets_bytes=np.array(g.offsets_bytes, dtype=np.uint64))


def _refresh(ctx: RingContext, session: Session, keys: list[bytes | None], results: BatchResults,
             due: list[bytes]) -> None:
    """Restart `due` blocks' retention clocks durably, before the answer; fail them if that fails
    (as `transfer_engine._refresh` does for a batch)."""
    try:
        ctx.tier.touch_soon(due).result()
    except Exception as exc:
        fail_unrefreshed(exc, session, keys, results, due)


class RingServer:
    """Answers one session's ring on a thread of its own, until `stop`.

    Args:
        mapped: the ring's mapping (checked as a region is: sealed memfd, nonce).
        session: the session it serves (its tenant, geometry and regions).
        answer: runs one request's bytes; returns the answer's state (`read`).
        ctx: what the server's rings share; given, requests are served natively where
            `kvstore.native._ring` is built (`gateway.transfer_ring_native`), else by `answer` only.
    """

    def __init__(self, mapped: MappedRegion, session: Session,
                 answer: Callable[[Session, bytes], pb.TransferState], *, ctx: RingContext | None = None) -> None:
        self.mapped = mapped
        self.name = mapped.name
        self.session = session
        self._answer = answer
        self._view: memoryview | None = mapped.view
        self._header: Header | None = header_in(self._view)
        self._futex: Futex | None = Futex(self._header)
        self._state_at = ctypes.addressof(self._header) + Header.state.offset
        self.native = _native_ring(ctx, session, ctypes.addressof(self._header) - HEADER_AT)
        #: Held while a request runs: a region is not unmapped under it (`Session.drop_region`).
        self.busy = threading.Lock()
        self.expires = time.monotonic() + LEASE_S
        self.requests = 0
        self._stop = False
        # Named by a counter, never by the session id (a secret; thread names show in /proc).
        self._thread = threading.Thread(target=self._run, name=f"ring-{next(_RING_NUMBERS)}", daemon=True)
        self._thread.start()

    def renew(self) -> None:
        """Extend the lease by `LEASE_S` from now (a RegisterRegion the auth interceptor let through)."""
        self.expires = time.monotonic() + LEASE_S

    def stop(self) -> None:
        """Stop the thread (it ends its current request first), tell a waiting client, unmap the ring.

        Blocking (it joins the thread): call it off the event loop.
        """
        self._stop = True
        header, futex = self._header, self._futex
        if header is not None and futex is not None:
            header.state = CLOSED
            futex.wake()
        self._thread.join(timeout=60)
        if self._thread.is_alive():  # pragma: no cover - a request stuck past a minute: a bug
            log.error("ring %s: its thread did not stop; the ring stays mapped", self.name)
            return
        self._header = self._futex = None  # they point into the mapping: dropped before it goes
        self.native = None
        self._view = None
        self.mapped.close()

    def _run(self) -> None:
        header, futex, view = self._header, self._futex, self._view
        assert header is not None and futex is not None and view is not None
        spurious = 0
        held: NativeRing | None = None  # what readied a txn of this thread (kept across requests)
        while not self._stop:
            state = header.state
            native = self.native
            if native is not None and spurious < _SPURIOUS and native.ready(self.busy):
                held = native
                # Readied off the request's path; the spin and the request's first half in one native call
                # (a request already there is taken at once: it is not the IDLE waited on).
                kind, seq, length, value = native.take(IDLE if state == REQUEST else state, self.expires)
                if kind == native_ring.IDLE:  # none within the spin: sleep on the futex
                    native.unready()
                    spurious = self._idle(futex, value, spurious, spin=False)
                    continue
                spurious = 0
                with self.busy:
                    code, answer = self._serve_taken(native, view, kind, seq, length, value)
            else:
                if held is not None:  # its txn would stand in the way of this thread's next one
                    held.unready()
                    held = None
                if state != REQUEST:
                    spurious = self._idle(futex, state, spurious)
                    continue
                spurious = 0
                header.state = BUSY
                seq, length = header.seq, header.length
                with self.busy:
                    code, answer = self._serve(view, seq, length)
            if answer is None:  # answered natively, the client woken
                if self._stop:
                    header.state = CLOSED
                continue
            answer = answer[:ANSWER_BYTES]
            view[ANSWER_AT:ANSWER_AT + len(answer)] = answer
            header.answer_seq, header.code, header.answer_length = seq, code, len(answer)
            header.state = CLOSED if self._stop else ANSWERED
            futex.wake()
        if held is not None:
            held.unready()
        header.state = CLOSED
        futex.wake()
        del header, futex, view

    def _idle(self, futex: Futex, state: int, spurious: int, *, spin: bool = True) -> int:
        """Sleep until the word changes (or a second passes); `spin`: spin briefly first (natively). A
        wake-up that finds no request is spurious; after `_SPURIOUS` in a row, sleep a millisecond
        between looks, so a client flipping the word cannot keep this thread spinning."""
        if self._stop:  # stop() may have stored CLOSED after `state` was read: no sleep on it for a second
            return spurious
        if spurious >= _SPURIOUS:
            time.sleep(0.001)
        start = time.monotonic()
        if self.native is not None and spin and spurious < _SPURIOUS:  # spins briefly first, without the GIL
            shared_ring.wait(self._state_at, state, native_ring.SERVER_HOT_SPIN_S, native_ring.SERVER_SPIN_S, 1.0,
                             self._state_at + Header.client_cpu.offset)
        else:
            futex.wait(state, 1.0)
        return spurious + 1 if time.monotonic() - start < 0.9 else 0

    def _serve_taken(self, native: NativeRing, view: memoryview, kind: int, seq: int, length: int, value: Any
                     ) -> tuple[int, bytes | None]:
        """Answer a request `native.take` took (BUSY is stored): as `_serve`, in its order of checks
        (length and lease, the session, the rate, then the read), from what `take` did."""
        if kind not in (native_ring.PLANNED, native_ring.HANDED_BACK):  # judged and served as without `take`
            native.unready()
            return self._serve(view, seq, length)
        self.requests += 1
        self.session.counters.add_ring_request()
        try:
            if self.session.closed:
                raise FailedPrecondition("the transfer session ended")
            if kind == native_ring.PLANNED and native.answer(seq, value):
                return 0, None  # what was readied is kept for the next request (`NativeRing.ready`)
            native.unready()
            if kind == native_ring.PLANNED or native.regions_moved():
                # The regions or the clock moved since `ready` (a region registered while `take` spun is
                # not in its table, so a request naming it was handed back): afresh, natively.
                raw = native.serve(seq, length)
                if raw is None:
                    return 0, None
                return 0, read(native.ctx, self.session, raw, charged=True).SerializeToString()
            return 0, read(native.ctx, self.session, value).SerializeToString()
        except KVStoreError as exc:
            native.unready()
            return to_status(exc).value[0], exc.message.encode()[:ANSWER_BYTES]
        except Exception:
            native.unready()
            log.exception("ring %s: a request failed", self.name)
            return grpc.StatusCode.INTERNAL.value[0], b"the ring request failed inside the server (see its log)"

    def _serve(self, view: memoryview, seq: int, length: int) -> tuple[int, bytes | None]:
        """Answer one request: (0, None) when the native server answered it and woke the client,
        else the answer's code and bytes for `_run` to write."""
        self.requests += 1
        self.session.counters.add_ring_request()
        try:
            if length > REQUEST_BYTES:
                raise InvalidArgument(f"the ring request's length {length} is past the request area "
                                      f"({REQUEST_BYTES} bytes)")
            if time.monotonic() > self.expires:
                return RENEW, b"the ring's lease ended: renew it (RegisterRegion with ring) and ask again"
            if self.session.closed:
                raise FailedPrecondition("the transfer session ended")
            if self.native is not None:
                raw = self.native.serve(seq, length)  # the bytes read once, when not answered there
                if raw is None:
                    return 0, None
                return 0, read(self.native.ctx, self.session, raw, charged=True).SerializeToString()
            raw = bytes(view[REQUEST_AT:REQUEST_AT + length])  # a snapshot: checked, then read
            return 0, self._answer(self.session, raw).SerializeToString()
        except KVStoreError as exc:
            return to_status(exc).value[0], exc.message.encode()[:ANSWER_BYTES]
        except Exception:
            log.exception("ring %s: a request failed", self.name)
            return grpc.StatusCode.INTERNAL.value[0], b"the ring request failed inside the server (see its log)"


def _native_ring(ctx: RingContext | None, session: Session, address: int) -> NativeRing | None:
    """A native server for the ring at `address`, or None: the Python server answers every request."""
    if ctx is None or not ctx.native:
        return None
    mapping = tier_mapping(ctx)
    return None if mapping is None else NativeRing(ctx, session, mapping, address)
