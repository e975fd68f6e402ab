"""The bulk transport, client side: the server's transfer engine writes blocks into our regions.

For regions the server cannot map (another host), a session may negotiate the
bulk transport (`Transfer.OpenBulk`, docs/TRANSFER.md "Bulk transport"): this
process runs one Mooncake transfer engine (TCP, or RDMA where the hardware has it;
P2P handshake, no metadata server), registers each such region with it, and
fetches with `Transfer.BulkFetch` calls that carry hashes and offsets only. The
server verifies the blocks and its engine writes them straight into the region;
the reply carries their statuses. Nothing is copied here.

On a host with many cores the session runs several engines (`LANES`: Mooncake 0.3.13's
TCP transport moves all of one engine's bytes on one io thread) and names each with its
own `OpenBulk`; the server ties each to one of its engines and spreads the calls over them.

A region is registered with an engine once however many sessions hold it (`register_counted`: a fleet
session's region is read by one session per node), and unregistered when the last lets it go.

Any failure of the bulk transport (the engine cannot start here, the server
refuses, a BulkFetch fails) turns it off for the session, says why in
`session.bulk_reason`, and the batch is fetched over gRPC (`StreamPath`) instead.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvstore.client.connection import status_error
from kvstore.client.transfer_path import LocalTransfer, Transfer, TransferPath, timeout
from kvstore.client.transfer_stream import FetchReply, StreamPath
from kvstore.errors import Internal, KVStoreError, Unavailable
from kvstore.host import usable_cpus
from kvstore.prefix import HASH_BYTES
from kvstore.region import Region
from kvstore.transfer import DONE, SKIPPED, BatchResults, DescriptorGroup, Op, Spans, TransferState, check_spans
from kvstore.v1 import transfer_pb2 as pb

if TYPE_CHECKING:
    from kvstore.client.transfer_path import SessionView

#: What makes Mooncake's transfer engine run on a host, for the reason when it cannot.
FIX = "apt-get install -y libibverbs1 && pip install mooncake-transfer-engine-non-cuda"

#: BulkFetch calls a session keeps in flight per lane (fewer when its `streams` is lower): while
#: the engine writes one call's blocks the server finds and verifies the next's (one engine
#: pair on the H200 host: 1.75 against 1.23 GB/s one at a time). On the 2-core dev box one
#: at a time was tried too: `kvstore bench transfer` bulk / Mooncake 0.58-0.73x in four
#: runs, against 0.75-1.08x two at a time.
IN_FLIGHT = 2
#: What a server that takes several engines (lanes) per session offers beside "mooncake".
LANES_OFFER = "mooncake-lanes"
#: Engines (lanes) a session fetches through: one Mooncake 0.3.13 engine moves all its TCP
#: bytes on one io thread (2.1-2.8 GB/s for a pair on the H200 host); one per 4 CPUs, 1 to 4
#: (each lane takes about three cores at full speed: two io threads and the server's wait).
LANES = max(1, min(4, usable_cpus() // 4))
#: Deadline of the BulkDrain asked before falling back to gRPC (the server waits up to 30 s).
DRAIN_S = 35.0
#: BulkDrain's answers that leave nothing to wait for: a server from before it, a session it ended.
_CANNOT_DRAIN = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)

_ENGINES: dict[str, list[tuple[Any, str]]] = {}
_ENGINES_LOCK = threading.Lock()


def local_engines(host: str, count: int) -> list[tuple[Any, str]]:
    """`count` Mooncake engines of this process naming themselves `host` (each started once and
    shared by the process's sessions), and their segment names.

    Raises:
        Unavailable: Mooncake cannot run here (naming the fix), or its first engine did not start.
    """
    with _ENGINES_LOCK:
        started = _ENGINES.setdefault(host, [])
        while len(started) < count:
            try:
                from mooncake.engine import TransferEngine
            except Exception as exc:  # ImportError, or its native library (libibverbs) failing to load
                del _ENGINES[host]
                raise Unavailable(f"mooncake-transfer-engine cannot run here ({type(exc).__name__}: {exc})",
                                  hint=FIX) from None
            engine = TransferEngine()
            if engine.initialize(host, "P2PHANDSHAKE", "tcp", ""):
                if started:  # fewer lanes: the ones that started serve
                    break
                del _ENGINES[host]
                raise Unavailable(f"Mooncake's transfer engine did not start on {host}")
            started.append((engine, f"{host}:{engine.get_rpc_port()}"))
        return started[:count]


#: (engine, address) -> how many of this process's bulk paths hold that region registered with the engine (F73).
_REGISTERED: dict[tuple[int, int], int] = {}
_REGISTERED_LOCK = threading.Lock()


def register_counted(engine: Any, address: int, size_bytes: int) -> bool:
    """Register [address, address + size_bytes) with `engine` for one more holder (False: the engine refused).

    The engines are the process's (`local_engines`), and one region may be registered by several sessions (a
    fleet session's, one per node, docs/FLEET.md F73): Mooncake refuses a second registration of the same memory
    ("overlapped memory region") and one unregistration drops it for all, so the engine is asked at the first
    holder only and told at the last one's `unregister_counted`.
    """
    key = (id(engine), address)  # the engines live as long as the process: their ids are never reused
    with _REGISTERED_LOCK:
        held = _REGISTERED.get(key, 0)
        if not held and engine.register_memory(address, size_bytes):
            return False
        _REGISTERED[key] = held + 1
        return True


def unregister_counted(engine: Any, address: int) -> None:
    """One holder of `address` lets it go; the last unregisters it from `engine` (no write may land after)."""
    key = (id(engine), address)
    with _REGISTERED_LOCK:
        held = _REGISTERED.pop(key, 0)
        if held > 1:
            _REGISTERED[key] = held - 1
        elif held == 1:
            engine.unregister_memory(address)


def local_engine(host: str) -> tuple[Any, str]:
    """This process's first Mooncake engine naming itself `host`, and its segment name (see `local_engines`)."""
    return local_engines(host, 1)[0]


def bulk_host(target: str) -> str:
    """This host's address on the route to `target` ("host:port"): what the server's engine dials."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    if host in ("localhost", "") or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port or 0)))  # no packet is sent: this only picks the route
            return str(probe.getsockname()[0])
    except (OSError, ValueError):
        return "127.0.0.1"


def region_address(region: Region) -> int:
    """The address of a region's first byte in this process (valid until the region closes)."""
    # A numpy view, dropped at once: the buffer is exported only for this line.
    return int(np.frombuffer(region.view, dtype=np.uint8).ctypes.data)


@dataclass(frozen=True, kw_only=True)
class _Call:
    """One BulkFetch: descriptors `index` of a batch (in order), all passing their checks."""

    results: BatchResults
    index: np.ndarray
    request: pb.BulkFetchRequest


class _Running(Transfer):
    """A batch `read` started on the path's thread: PENDING until it is done, then its results."""

    def __init__(self, transfer_id: int, future: Future[list[Transfer]], n: int, block_bytes: int) -> None:
        self.transfer_id = transfer_id
        self._future = future
        self._n = n
        self._block_bytes = block_bytes

    def status(self) -> TransferState:
        if not self._future.done():
            return BatchResults(self._n).state(self.transfer_id, False, self._block_bytes)
        return self._future.result()[0].status()

    def wait(self, timeout_s: float | None = None) -> TransferState:
        with contextlib.suppress(TimeoutError):
            self._future.result(timeout(timeout_s))
        return self.status()


class BulkPath(TransferPath):
    """Reads by `Transfer.BulkFetch` (the server's engine writes into registered regions); writes
    and every fallback by the session's `StreamPath`.

    Args:
        session: the session (its id, regions, `streams`).
        stream: the session's gRPC path, used for writes and whenever bulk fails.
        max_blocks: most blocks in one BulkFetch (the server's OpenBulk answer).
    """

    def __init__(self, session: SessionView, stream: StreamPath, max_blocks: int) -> None:
        self.session = session
        self.stream = stream
        self.connection = session.connection
        self.max_blocks = max(1, max_blocks)
        # Lanes only with a server that takes them (one that does not would write every call to
        # the last engine named, past what Mooncake queues for one peer).
        wanted = LANES if LANES_OFFER in session.bulk_offered else 1
        #: The engines every region is registered with; `lanes`: those the server writes to.
        self.engines = local_engines(bulk_host(self.connection.target), wanted)
        self.lanes = list(self.engines)
        self.engine, self.segment = self.engines[0]
        self._named = False  # whether the lanes past the first were named to the server (first fetch)
        #: Region id -> its address in this process, for regions registered with the engine.
        self.addresses: dict[int, int] = {}
        self._call = session.connection.channel.unary_unary(
            "/kvstore.v1.Transfer/BulkFetch", request_serializer=pb.BulkFetchRequest.SerializeToString)
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-bulk")

    def register(self, region: Region) -> bool:
        """Register a region with every lane's engine (False: it could not be, the region streams)."""
        if region.region_id in self.addresses:
            return True
        address = region_address(region)
        for i, (engine, _) in enumerate(self.engines):
            if not register_counted(engine, address, region.size_bytes):
                for done, _ in self.engines[:i]:
                    unregister_counted(done, address)
                return False
        self.addresses[region.region_id] = address
        return True

    def unregister(self, region: Region) -> None:
        """Unregister a region from the engines: before it is unmapped, so no write can land in it."""
        address = self.addresses.pop(region.region_id, None)
        if address is not None:
            for engine, _ in self.engines:
                unregister_counted(engine, address)

    def covers(self, groups: Sequence[DescriptorGroup]) -> bool:
        """Whether every region of `groups` is registered with the engine."""
        return all(g.region_id in self.addresses for g in groups)

    def close(self) -> None:
        """Finish running batches and unregister every region."""
        self._pool.shutdown(wait=True)
        for address in self.addresses.values():
            for engine, _ in self.engines:
                unregister_counted(engine, address)
        self.addresses.clear()

    # -- reads ---------------------------------------------------------------

    def read(self, groups: Sequence[DescriptorGroup], prefix_only: bool) -> Transfer:
        future = self._pool.submit(self.read_many, [groups], prefix_only)
        return _Running(next(self._ids), future, sum(len(g) for g in groups), self.connection.block_bytes)

    def read_many(self, batches: Sequence[Sequence[DescriptorGroup]], prefix_only: bool) -> list[Transfer]:
        """Fetch the batches (`IN_FLIGHT` BulkFetch calls at once at most); they are done on return.

        On any failure of the bulk transport the session turns it off (`bulk_reason`)
        and the batches are fetched over gRPC instead.
        """
        try:
            results = self._fetch(batches, prefix_only)
        except KVStoreError as exc:
            self.session.bulk_failed(f"a BulkFetch failed ({type(exc).__name__}: {exc.message}); fetching over gRPC")
            self._drain()
            return self.stream.read_many(batches, prefix_only)
        out: list[Transfer] = []
        for r in results:
            done: Future[None] = Future()
            done.set_result(None)
            out.append(LocalTransfer(next(self._ids), r, self.connection.block_bytes, done))
        return out

    def _fetch(self, batches: Sequence[Sequence[DescriptorGroup]], prefix_only: bool) -> list[BatchResults]:
        size = self.connection.block_bytes
        out, calls = [], []
        for groups in batches:
            results = BatchResults(sum(len(g) for g in groups))
            # The same checks the server's paths make, so a descriptor fails the same way on each.
            spans = check_spans(groups, Op.READ, size, results, lambda rid: self.session.region(rid).view)
            out.append(results)
            calls.extend(self._calls(spans, results, prefix_only))
        self._name_lanes()
        stopped: set[int] = set()
        flying: deque[tuple[_Call, Any]] = deque()
        try:
            for call in calls:
                if len(flying) >= self.in_flight():
                    self._land(*flying.popleft(), stopped, prefix_only)
                flying.append((call, self._send(call.request)))
            while flying:
                self._land(*flying.popleft(), stopped, prefix_only)
        finally:
            for _, future in flying:
                future.cancel()
        for results in out:
            pending = results.pending()
            # With prefix_only, a batch's calls past its first block not loaded stay PENDING: SKIPPED.
            np.frombuffer(results.statuses, dtype=np.uint8)[pending] = SKIPPED
        return out

    def _drain(self) -> None:
        """Wait until none of the session's engine writes can still land (a BulkFetch given up on, or
        cancelled with the others when one failed, goes on writing in the server), so gRPC may fill the
        same memory. A server from before BulkDrain is not asked, and one that no longer knows the
        session (it ended there) cannot tell: the fallback goes ahead, as before BulkDrain.

        Raises:
            Unavailable: the server could not say so (unreachable, or a write stuck past its wait):
                the regions' bytes may still change, so the batches are not fetched.
        """
        request = pb.BulkDrainRequest(session_id=self.session.session_id)
        try:
            reply = self.session.stub.BulkDrain(request, timeout=DRAIN_S, metadata=self.connection.metadata)
        except grpc.RpcError as exc:
            if exc.code() in _CANNOT_DRAIN:
                return
            error = status_error(exc)
            raise Unavailable(f"bulk: after a failed BulkFetch the server could not say that its writes have "
                              f"ended ({type(error).__name__}: {error.message}); the regions may still change",
                              hint="fetch them again once the server answers") from None
        if reply.writing:
            raise Unavailable(f"bulk: after a failed BulkFetch {reply.writing} of the server's writes into this "
                              "session's regions still run; the regions may still change",
                              hint="fetch them again later; the server's transfer engine may be stuck")

    def in_flight(self) -> int:
        """BulkFetch calls kept in flight: `IN_FLIGHT` per lane, at most the session's `streams`."""
        return max(1, min(self.session.streams, IN_FLIGHT * len(self.lanes)))

    def _name_lanes(self) -> None:
        """Name the lanes past the first to the server (once): an OpenBulk each. A lane it refuses
        is dropped (its calls go through the others)."""
        if self._named:
            return
        self._named = True
        kept = self.lanes[:1]
        for engine, segment in self.lanes[1:]:
            try:
                reply = self.session.call(self.session.stub.OpenBulk, pb.OpenBulkRequest(
                    session_id=self.session.session_id, transport="mooncake", segment=segment))
            except KVStoreError:
                reply = None
            if reply is not None and reply.accepted:
                kept.append((engine, segment))
        self.lanes = kept

    def _calls(self, spans: Spans, results: BatchResults, prefix_only: bool) -> list[_Call]:
        """The batch's good descriptors (up to its first bad one with `prefix_only`), `max_blocks` a call."""
        end = len(spans)
        first_bad = spans.first_failed()
        if prefix_only and first_bad is not None:
            end = first_bad
        out = []
        for k, g in enumerate(spans.groups):
            base = spans.starts[k]
            good = np.flatnonzero(spans.ok[base:min(spans.starts[k + 1], end)])
            hashes = np.frombuffer(g.block_hashes, dtype=np.uint8).reshape(-1, HASH_BYTES) if len(good) else None
            for lo in range(0, len(good), self.max_blocks):
                rel = good[lo:lo + self.max_blocks]
                assert hashes is not None
                out.append(_Call(results=results, index=rel + base, request=pb.BulkFetchRequest(
                    session_id=self.session.session_id, block_hashes=hashes[rel].tobytes(),
                    address=self.addresses[g.region_id], size_bytes=self.session.region(g.region_id).size_bytes,
                    offsets_bytes=g.offsets_bytes[rel].tolist(), prefix_only=prefix_only)))
        return out

    def _send(self, request: pb.BulkFetchRequest) -> Any:
        c = self.connection
        try:
            return self._call.future(request, timeout=c.timeout_s, metadata=c.metadata)
        except grpc.RpcError as exc:
            raise status_error(exc) from None

    def _land(self, call: _Call, future: Any, stopped: set[int], prefix_only: bool) -> None:
        """Record one reply's statuses (the bytes are in the region already)."""
        try:
            reply = FetchReply.parse(future.result())
        except grpc.RpcError as exc:
            raise status_error(exc) from None
        results, index = call.results, call.index
        if id(results) in stopped:
            return  # a prefix read stopped before this call: its blocks stay PENDING, then SKIPPED
        statuses = reply.statuses
        if len(statuses) != len(index):
            raise Internal(f"a BulkFetch reply holds {len(statuses)} statuses for {len(index)} blocks")
        np.frombuffer(results.statuses, dtype=np.uint8)[index] = np.frombuffer(statuses, dtype=np.uint8)
        done = statuses.count(DONE)
        results.bytes_moved += done * self.connection.block_bytes
        for f in reply.failures:
            results.fail(int(index[f.index]), f.code, f.reason)
        if prefix_only and done < len(statuses):
            stopped.add(id(results))

    # -- writes --------------------------------------------------------------

    def write(self, groups: Sequence[DescriptorGroup], parent_hash: bytes, token_ids: Sequence[int],
              extra_keys: Sequence[bytes]) -> Transfer:
        return self.stream.write(groups, parent_hash, token_ids, extra_keys)

