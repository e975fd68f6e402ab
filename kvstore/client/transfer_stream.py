"""The transfer path across hosts: block bytes over gRPC, copied into or out of regions here.

Reads go out as `Transfer.Fetch` calls of 16 to 64 blocks each (`stripe_blocks`; fewer of blocks
larger than a 64-token V4.1-Flash block, so a call stays within 0.9 to 3.6 MB),
`streams` of them in flight at once on the session's channel (HTTP/2 streams:
gRPC's C core sends and receives them in parallel, and the server copies each
on its own thread). Each reply carries its blocks' bytes joined in one message,
landed in the region with one copy when its blocks are consecutive slots.
Writes go out as Puts, in chain order.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvstore.client import arguments
from kvstore.client.connection import status_error
from kvstore.client.transfer_path import LocalTransfer, Transfer, TransferPath
from kvstore.errors import Internal, KVStoreError, to_status
from kvstore.host import usable_cpus
from kvstore.prefix import HASH_BYTES
from kvstore.protowire import read_varint
from kvstore.transfer import DONE, SKIPPED, BatchResults, DescriptorGroup, Op, Spans, TransferState, check_spans
from kvstore.v1 import kvstore_pb2
from kvstore.v1 import transfer_pb2 as pb

if TYPE_CHECKING:
    from kvstore.client.transfer_path import SessionView

#: Blocks a Fetch call carries at least, when a fetch has that many (about 0.9 MB): a fetch is
#: cut into `streams` calls or more of STRIPE_BLOCKS to MAX_STRIPE_BLOCKS blocks (`stripe_blocks`).
STRIPE_BLOCKS = 16
#: Most blocks in one Fetch (about 3.6 MB). Since the reply is sent and read without protobuf
#: copies, larger calls cost less per byte: 4,096 blocks over 4 streams on the dev box ran at
#: 0.70 GB/s in 16-block calls, 0.87 in 64-block ones, 0.78 in 128-block ones (means of 3-5 runs).
MAX_STRIPE_BLOCKS = 64
#: The block size STRIPE_BLOCKS and MAX_STRIPE_BLOCKS were measured at (64 tokens of V4.1-Flash):
#: calls of larger blocks hold proportionally fewer (256-token blocks of 227,840 bytes: 4 to 16), so
#: a call stays at 0.9 to 3.6 MB: on the 2-core box 2,048 such blocks over 4 streams ran 1.08x,
#: 1.31x, 1.01x faster (medians of paired rounds) in 16-block calls than in 64-block (14.6 MB) ones.
STRIPE_REFERENCE_BYTES = 56_960
#: Most Fetch calls one session keeps in flight (`streams`).
MAX_STREAMS = 64


def default_streams() -> int:
    """Fetch calls in flight by default: two per core, 2 to 8.

    Each call spends part of its time on the wire and part in the server's copy,
    so more calls than cores keep both busy: on the 2-core dev box a 2,048-block
    fetch ran at 0.20 / 0.24 / 0.28 GB/s with 1 / 2 / 4 calls in flight.
    """
    return max(2, min(2 * usable_cpus(), 8))


def stripe_blocks(n: int, streams: int, most: int, block_bytes: int = STRIPE_REFERENCE_BYTES) -> int:
    """Blocks per Fetch call for a fetch of `n` blocks of `block_bytes` with `streams` calls in
    flight: enough calls to keep them all busy, each of STRIPE_BLOCKS to MAX_STRIPE_BLOCKS blocks
    (fewer, in proportion, of blocks larger than STRIPE_REFERENCE_BYTES: the bounds were measured
    in bytes), at most `most` (the server's descriptor and message limits), at least 1."""
    share = -(-n // max(streams, 1))
    scale = max(block_bytes, STRIPE_REFERENCE_BYTES)
    low = max(1, STRIPE_BLOCKS * STRIPE_REFERENCE_BYTES // scale)
    high = max(1, MAX_STRIPE_BLOCKS * STRIPE_REFERENCE_BYTES // scale)
    return max(1, min(max(low, share), high, most))


def checked_streams(streams: Any) -> int:
    """`streams` (None: `default_streams()`) checked to be an int in [1, MAX_STREAMS].

    Raises:
        InvalidArgument: naming it and the range.
    """
    if streams is None:
        return default_streams()
    return arguments.integer(streams, "streams", least=1, most=MAX_STREAMS)


@dataclass(frozen=True, kw_only=True)
class FetchReply:
    """A `kvstore.v1.FetchReply` read from its wire bytes, its `data` a view of them (no copy).

    Zero-copy contract: `data` is valid as long as the object (it keeps the message alive).
    """

    statuses: bytes
    data: memoryview
    failures: list[pb.DescriptorFailure]

    @classmethod
    def parse(cls, message: bytes) -> FetchReply:
        """Read the protobuf wire format: field 1 statuses, 2 data, 3 failures (others skipped).

        Raises:
            Internal: the message is not a well-formed FetchReply.
        """
        view = memoryview(message)
        statuses, data, failures = b"", view[:0], []
        at, end = 0, len(message)
        try:
            while at < end:
                key, at = read_varint(message, at)
                field, kind = key >> 3, key & 7
                if kind == 2:
                    size, at = read_varint(message, at)
                    if at + size > end:
                        raise ValueError("a field runs past the message")
                    if field == 1:
                        statuses = bytes(view[at:at + size])
                    elif field == 2:
                        data = view[at:at + size]
                    elif field == 3:
                        failures.append(pb.DescriptorFailure.FromString(bytes(view[at:at + size])))
                    at += size
                elif kind == 0:
                    _, at = read_varint(message, at)
                elif kind in (1, 5):
                    at += 8 if kind == 1 else 4
                else:
                    raise ValueError(f"wire type {kind}")
        except (ValueError, IndexError, DecodeError) as exc:
            raise Internal(f"a Fetch reply could not be read: {exc}") from None
        return cls(statuses=statuses, data=data, failures=failures)


@dataclass(kw_only=True)
class _Batch:
    """A read batch being fetched: its checked spans and results."""

    spans: Spans
    results: BatchResults
    prefix_only: bool
    stopped: bool = False


@dataclass(frozen=True, kw_only=True)
class _Stripe:
    """Descriptors [lo, hi) of one group of a batch, all passing their checks: one Fetch call."""

    batch: _Batch
    group: int
    lo: int
    hi: int


class StreamPath(TransferPath):
    """Blocks over `Transfer.Fetch` (striped, `streams` calls at once) and Put, copied here."""

    def __init__(self, session: SessionView) -> None:
        self.session = session
        self.connection = session.connection
        # Fetch's reply is parsed here (`FetchReply.parse`), not by protobuf: its block
        # bytes are then sliced from the received message rather than copied twice more.
        self._fetch = session.connection.channel.unary_unary(
            "/kvstore.v1.Transfer/Fetch", request_serializer=pb.FetchRequest.SerializeToString)
        self.streams = session.streams
        self._ids = itertools.count(1)
        # Two threads: one batch streams while the next one starts (read/write return at once).
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="kvstore-stream")

    def close(self) -> None:
        """Finish running batches and stop the threads."""
        self._pool.shutdown(wait=True)

    # -- reads ---------------------------------------------------------------

    def read(self, groups: Sequence[DescriptorGroup], prefix_only: bool) -> Transfer:
        batch = self._batch(groups, prefix_only)
        return self._start(batch.results, self._fetch_all, [batch])

    def read_many(self, batches: Sequence[Sequence[DescriptorGroup]], prefix_only: bool) -> list[Transfer]:
        """Fetch several batches on this thread, their stripes `streams` at a time; they are done on return.

        No thread hop: a small fetch is one call from the caller's thread.
        """
        ready = [self._batch(groups, prefix_only) for groups in batches]
        self._fetch_all(ready)
        out: list[Transfer] = []
        for batch in ready:
            done: Future[None] = Future()
            done.set_result(None)
            out.append(LocalTransfer(next(self._ids), batch.results, self.connection.block_bytes, done))
        return out

    def fetch_slots(self, hashes: list[bytes], view: memoryview, offset_bytes: int, prefix_only: bool
                    ) -> TransferState | None:
        """A fetch of one stripe into consecutive slots of a local region: one Fetch call, its
        blocks landed with one copy, no spans or numpy (what `read_many` gives, for less Python).
        None when it is no such fetch (more than a stripe, a hash of another length)."""
        c = self.connection
        size = c.block_bytes
        if not 0 < len(hashes) <= min(STRIPE_BLOCKS, c.batch_blocks) or any(len(h) != HASH_BYTES for h in hashes):
            return None
        reply = FetchReply.parse(self._reply_for(self._fetch, b"".join(hashes), prefix_only))
        statuses, data = reply.statuses, reply.data
        if len(statuses) != len(hashes):
            raise Internal(f"a Fetch reply holds {len(statuses)} statuses for {len(hashes)} blocks")
        done = statuses.count(DONE)
        if len(data) != done * size:
            raise Internal(f"a Fetch reply holds {len(data)} bytes for {done} blocks")
        loaded = len(statuses) - len(statuses.lstrip(bytes([DONE])))
        if loaded == done:  # the usual case: the DONE blocks lead, consecutive slots, one copy
            view[offset_bytes:offset_bytes + done * size] = data
        else:
            taken = 0
            for j, status in enumerate(statuses):
                if status == DONE:
                    at = offset_bytes + j * size
                    view[at:at + size] = data[taken * size:(taken + 1) * size]
                    taken += 1
        return TransferState(transfer_id=next(self._ids), done=True, statuses=bytes(statuses),
                             bytes_moved=done * size, block_bytes=size,
                             failures={f.index: (f.code, f.reason) for f in reply.failures})

    def _batch(self, groups: Sequence[DescriptorGroup], prefix_only: bool) -> _Batch:
        results = BatchResults(sum(len(g) for g in groups))
        # The same checks the server makes, so a descriptor fails the same way on either path.
        spans = check_spans(groups, Op.READ, self.connection.block_bytes, results,
                            lambda rid: self.session.region(rid).view)
        return _Batch(spans=spans, results=results, prefix_only=prefix_only)

    def _stripes(self, batch: _Batch, step: int) -> list[_Stripe]:
        """The batch cut into runs of good descriptors, at most `step` each (up to its first bad
        one with `prefix_only`)."""
        spans = batch.spans
        out: list[_Stripe] = []
        end = len(spans)
        first_bad = spans.first_failed()
        if batch.prefix_only and first_bad is not None:
            end = first_bad
        for k in range(len(spans.groups)):
            lo, hi = spans.starts[k], min(spans.starts[k + 1], end)
            good = np.flatnonzero(spans.ok[lo:hi]) + lo
            # Runs of consecutive good descriptors, each cut into stripes.
            for run in np.split(good, np.flatnonzero(np.diff(good) != 1) + 1) if len(good) else []:
                a, b = int(run[0]), int(run[-1]) + 1
                out.extend(_Stripe(batch=batch, group=k, lo=s, hi=min(s + step, b)) for s in range(a, b, step))
        return out

    def _fetch_all(self, batches: Sequence[_Batch]) -> None:
        """Fetch every stripe of `batches`, `streams` calls in flight, landing each in order.

        A lone stripe is one blocking call: a future completes on gRPC's polling
        thread and wakes this one, a hop a small fetch's latency should not pay.
        """
        most = min(self.session.max_descriptors or MAX_STRIPE_BLOCKS, self.connection.batch_blocks)
        step = stripe_blocks(sum(len(b.spans) for b in batches), self.streams, most, self.connection.block_bytes)
        stripes = [s for b in batches for s in self._stripes(b, step)]
        if len(stripes) == 1:
            self._land(stripes[0], FetchReply.parse(self._reply(self._fetch, stripes[0])))
        flying: deque[tuple[_Stripe, Any]] = deque()
        try:
            for stripe in stripes if len(stripes) > 1 else []:
                if len(flying) >= self.streams:
                    self._land(*self._result(*flying.popleft()))
                flying.append((stripe, self._reply(self._fetch.future, stripe)))
            while flying:
                self._land(*self._result(*flying.popleft()))
        finally:
            for _, call in flying:
                call.cancel()
        for batch in batches:
            pending = batch.results.pending()
            if batch.prefix_only:
                np.frombuffer(batch.results.statuses, dtype=np.uint8)[pending] = SKIPPED
            else:  # reached only for a bug: every good descriptor was in a stripe
                batch.results.fail_pending(pending.tolist(), "INTERNAL", "not reached")

    def _reply(self, send: Any, stripe: _Stripe) -> Any:
        """`send` (the blocking call or its future form) with the stripe's Fetch request."""
        g, base = stripe.batch.spans.groups[stripe.group], stripe.batch.spans.starts[stripe.group]
        return self._reply_for(send, g.block_hashes[(stripe.lo - base) * HASH_BYTES:(stripe.hi - base) * HASH_BYTES],
                               stripe.batch.prefix_only)

    def _reply_for(self, send: Any, block_hashes: bytes, prefix_only: bool) -> Any:
        c = self.connection
        request = pb.FetchRequest(geometry=c.geometry, namespace=c.namespace, prefix_only=prefix_only,
                                  block_hashes=block_hashes)
        try:
            return send(request, timeout=c.timeout_s, metadata=c.metadata)
        except grpc.RpcError as exc:
            raise status_error(exc) from None

    @staticmethod
    def _result(stripe: _Stripe, call: Any) -> tuple[_Stripe, FetchReply]:
        try:
            return stripe, FetchReply.parse(call.result())
        except grpc.RpcError as exc:
            raise status_error(exc) from None

    def _land(self, stripe: _Stripe, reply: FetchReply) -> None:
        """Copy one Fetch reply's blocks into the region and record their statuses."""
        batch = stripe.batch
        if batch.stopped:
            return  # a prefix read stopped before this stripe: its blocks stay SKIPPED
        results, size = batch.results, self.connection.block_bytes
        statuses = reply.statuses
        loaded = len(statuses) - len(statuses.lstrip(bytes([DONE])))
        spans = batch.spans
        g, base = spans.groups[stripe.group], spans.starts[stripe.group]
        view = spans.views[stripe.group]
        assert view is not None  # a stripe holds only descriptors that passed their checks
        offsets = g.offsets_bytes[stripe.lo - base:stripe.lo - base + loaded]
        data = reply.data
        if loaded and bool(np.all(np.diff(offsets) == size)):
            first = int(offsets[0])
            view[first:first + loaded * size] = data[:loaded * size]  # consecutive slots: one copy
        else:
            for j, offset in enumerate(offsets.tolist()):
                view[offset:offset + size] = data[j * size:(j + 1) * size]
        results.statuses[stripe.lo:stripe.lo + len(statuses)] = statuses
        results.bytes_moved += loaded * size
        if loaded < len(statuses):
            # Past the first block not DONE (with prefix_only the server SKIPPED the rest):
            # DONE ones still carry their bytes, in order.
            taken = loaded
            for j in range(loaded, len(statuses)):
                if statuses[j] == DONE:
                    offset = int(g.offsets_bytes[stripe.lo - base + j])
                    view[offset:offset + size] = data[taken * size:(taken + 1) * size]
                    taken += 1
                    results.bytes_moved += size
            for f in reply.failures:
                results.fail(stripe.lo + f.index, f.code, f.reason)
            # A prefix read stops here: its later stripes stay PENDING and are SKIPPED at the end.
            batch.stopped = batch.prefix_only

    # -- writes --------------------------------------------------------------

    def write(self, groups: Sequence[DescriptorGroup], parent_hash: bytes, token_ids: Sequence[int],
              extra_keys: Sequence[bytes]) -> Transfer:
        results = BatchResults(sum(len(g) for g in groups), writes=True)
        spans = check_spans(groups, Op.WRITE, self.connection.block_bytes, results,
                            lambda rid: self.session.region(rid).view)
        return self._start(results, self._write, spans.cut(0, len(spans)), results, parent_hash, token_ids,
                           extra_keys)

    def _start(self, results: BatchResults, fn: Any, *args: Any) -> Transfer:
        return LocalTransfer(next(self._ids), results, self.connection.block_bytes, self._pool.submit(fn, *args))

    def _write(self, spans: list[memoryview | None], results: BatchResults, parent_hash: bytes,
               token_ids: Sequence[int], extra_keys: Sequence[bytes]) -> None:
        n = len(spans)
        end = spans.index(None) if None in spans else n
        c = self.connection
        bt = c.block_tokens
        step = c.batch_blocks
        parent = parent_hash
        for start in range(0, end, step):
            stop = min(start + step, end)
            blocks = [bytes(s) for s in spans[start:stop] if s is not None]
            try:
                reply = c.call(c.kvstore.Put, kvstore_pb2.PutRequest(
                    geometry=c.geometry, namespace=c.namespace, parent_hash=parent,
                    token_ids=token_ids[start * bt: stop * bt], extra_keys=extra_keys, blocks=blocks))
            except KVStoreError as exc:
                results.fail_pending(range(start, n), to_status(exc).name, exc.message)
                return
            results.statuses[start:stop] = bytes([DONE]) * (stop - start)
            results.block_hashes[start * HASH_BYTES: stop * HASH_BYTES] = b"".join(reply.block_hashes)
            results.bytes_moved += sum(len(b) for b in blocks)
            parent = reply.block_hashes[-1]
        results.fail_pending(range(end, n), "FAILED_PRECONDITION",
                             f"not stored: descriptor {end} before it failed, so its parent block is missing")
