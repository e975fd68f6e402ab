"""The worker side of batched transfers: regions, descriptor batches, two paths.

    with client.transfer() as session:                  # path="auto"
        region = session.register(n * client.block_bytes)
        region.pin()                                    # page-lock for CUDA, if present
        state = session.fetch(hashes, region)           # lands the blocks in the region
        gpu = region.blocks(client.block_bytes, state.done_prefix).cuda(non_blocking=True)

Paths (one ABC, picked from `PATHS`):
- "shm": the server maps the region (a sealed memfd, `kvstore.region`) and copies
  blocks between LMDB's map and it; only descriptors and results cross the channel.
- "stream": blocks come over `Transfer.Fetch` calls, `streams` in flight at once
  (and go out by Put), and are copied into or out of the region here: the path
  across hosts (`kvstore.client.transfer_stream`).
"auto" registers each region with the server, which proves it can see the
region by reading a nonce from it; a region the server cannot map is served
by "stream". The caller's code is the same on every path.

Every method raises a `kvstore.errors` class, never a bare ValueError or
TypeError: `InvalidArgument` for a bad argument (nothing sent).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import grpc

from kvstore.client import arguments
from kvstore.client.blocks import encode_extra_keys
from kvstore.client.connection import Connection, status_error
from kvstore.client.transfer_path import Transfer, TransferPath, timeout
from kvstore.client.transfer_ring import RingClient, RingUnusable, open_ring
from kvstore.client.transfer_stream import StreamPath, checked_streams
from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound
from kvstore.prefix import HASH_BYTES, ExtraKey
from kvstore.region import Region
from kvstore.transfer import Descriptor, DescriptorGroup, Op, TransferState, group
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc

#: Region ids of stream-path regions: far above any id a server hands out.
_LOCAL_IDS = itertools.count(1 << 62)


def _hashes(values: Any) -> list[bytes]:
    """Block hashes as bytes (one of the wrong length fails its descriptor alone, once sent)."""
    if isinstance(values, str | bytes | bytearray | memoryview) or not isinstance(values, Sequence):
        raise InvalidArgument(f"hashes must be a sequence of {HASH_BYTES}-byte hashes, got {type(values).__name__}")
    out = []
    for i, h in enumerate(values):
        if not isinstance(h, bytes | bytearray | memoryview):
            raise InvalidArgument(f"hashes[{i}] is a {type(h).__name__}; a block hash is {HASH_BYTES} bytes")
        out.append(bytes(h))
    return out


def _state(reply: pb.TransferState, block_bytes: int) -> TransferState:
    # Kept as columns: per-descriptor results are built only if the caller asks.
    return TransferState(transfer_id=reply.transfer_id, done=reply.done, bytes_moved=reply.bytes_moved,
                         statuses=reply.statuses, block_bytes=block_bytes, block_hashes=reply.block_hashes,
                         failures={f.index: (f.code, f.reason) for f in reply.failures})


class _ShmTransfer(Transfer):
    def __init__(self, path: ShmPath, transfer_id: int) -> None:
        self.path = path
        self.transfer_id = transfer_id
        self._final: TransferState | None = None

    def status(self) -> TransferState:
        return self._final or self._get(0)

    def wait(self, timeout_s: float | None = None) -> TransferState:
        timeout_s = timeout(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._final is None:
            left_ms = 10_000 if deadline is None else int(max(deadline - time.monotonic(), 0) * 1000)
            state = self._get(min(left_ms, 10_000))
            if state.done:
                self._final = state
            elif left_ms == 0:
                return state
        return self._final

    def _get(self, wait_ms: int) -> TransferState:
        return _state(self.path.call(self.path.stub.GetTransfer, pb.GetTransferRequest(
            session_id=self.path.session_id, transfer_id=self.transfer_id, wait_ms=wait_ms)), self.path.block_bytes)


class ShmPath(TransferPath):
    """One-sided copies by the server, between LMDB's map and regions it mapped."""

    def __init__(self, session: TransferSession) -> None:
        self.stub = session.stub
        self.call = session.call
        self.session_id = session.session_id
        self.block_bytes = session.connection.block_bytes
        self.timeout_s = session.connection.timeout_s
        self.keep_finished = session.keep_finished
        self.session = session

    def read(self, groups: Sequence[DescriptorGroup], prefix_only: bool) -> Transfer:
        return self._submit(self._read_request(groups, prefix_only))

    def read_many(self, batches: Sequence[Sequence[DescriptorGroup]], prefix_only: bool) -> list[Transfer]:
        """Start several read batches with one SubmitMany per `keep_finished` of them.

        One batch alone (a small fetch) is one Submit that answers when it is done:
        one round trip, where SubmitMany then GetTransfers take two.
        """
        requests = [self._read_request(groups, prefix_only) for groups in batches]
        ring = self.session.ring
        if len(requests) == 1 and ring is not None and sum(len(g) for g in batches[0]) <= ring.max_descriptors:
            try:
                done = _ShmTransfer(self, 0)
                done._final = _state(ring.read(requests[0]), self.block_bytes)
                return [done]
            except RingUnusable:
                pass  # busy with another thread's request, or broken: Submit serves it
        if len(requests) == 1:
            requests[0].wait = True
            reply = self.call(self.stub.Submit, requests[0])
            done = _ShmTransfer(self, reply.transfer_id)
            done._final = _state(reply.state, self.block_bytes)
            return [done]
        step = self.keep_finished or len(requests)
        out: list[Transfer] = []
        for start in range(0, len(requests), step):
            reply = self.call(self.stub.SubmitMany, pb.SubmitManyRequest(
                session_id=self.session_id, batches=requests[start:start + step]))
            out.extend(_ShmTransfer(self, tid) for tid in reply.transfer_ids)
        return out

    def wait_many(self, transfers: Sequence[Transfer], timeout_s: float | None) -> None:
        """Wait with one GetTransfers per `keep_finished` batches rather than a call per batch."""
        if not self.keep_finished:
            return  # not a shared-memory session: nothing of this path to wait for
        waiting = [t for t in transfers if isinstance(t, _ShmTransfer) and t.path is self and t._final is None]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            left_ms = 10_000 if deadline is None else int(max(deadline - time.monotonic(), 0) * 1000)
            for start in range(0, len(waiting), self.keep_finished):
                part = waiting[start:start + self.keep_finished]
                reply = self.call(self.stub.GetTransfers, pb.GetTransfersRequest(
                    session_id=self.session_id, transfer_ids=[t.transfer_id for t in part],
                    wait_ms=min(left_ms, 10_000)))
                # The server answers the first ids whose states fit its reply limit
                # (`omitted` says how many it left out): the rest are asked again.
                for transfer, state in zip(part, reply.states, strict=False):
                    if state.done:
                        transfer._final = _state(state, self.block_bytes)
            waiting = [t for t in waiting if t._final is None]
            if left_ms == 0:
                return

    def _read_request(self, groups: Sequence[DescriptorGroup], prefix_only: bool) -> pb.SubmitRequest:
        return pb.SubmitRequest(session_id=self.session_id, op=pb.TRANSFER_OP_READ, prefix_only=prefix_only,
                                groups=_wire(groups))

    def write(self, groups: Sequence[DescriptorGroup], parent_hash: bytes, token_ids: Sequence[int],
              extra_keys: Sequence[bytes]) -> Transfer:
        return self._submit(pb.SubmitRequest(op=pb.TRANSFER_OP_WRITE, groups=_wire(groups),
                                             parent_hash=parent_hash, token_ids=token_ids, extra_keys=extra_keys))

    def _submit(self, request: pb.SubmitRequest) -> Transfer:
        request.session_id = self.session_id
        reply = self.call(self.stub.Submit, request)
        return _ShmTransfer(self, reply.transfer_id)


def _wire(groups: Sequence[DescriptorGroup]) -> list[pb.DescriptorGroup]:
    return [pb.DescriptorGroup(region_id=g.region_id, length_bytes=g.length_bytes, block_hashes=g.block_hashes,
                               offsets_bytes=g.offsets_bytes.tolist()) for g in groups]


def _descriptors(descriptors: Any, most: int) -> list[Descriptor]:
    """A batch's descriptors, checked to be `Descriptor`s (their fields check themselves), 1 to `most`."""
    if not isinstance(descriptors, Sequence) or isinstance(descriptors, str | bytes):
        raise InvalidArgument(f"descriptors must be a sequence of Descriptor, got {type(descriptors).__name__}")
    for i, d in enumerate(descriptors):
        if not isinstance(d, Descriptor):
            raise InvalidArgument(f"descriptors[{i}] is a {type(d).__name__}, not a Descriptor")
    if not 1 <= len(descriptors) <= most:
        raise InvalidArgument(f"a batch holds 1 to {most} descriptors; got {len(descriptors)}")
    return list(descriptors)


#: Path name -> implementation; "auto" picks per region (see the module doc).
PATHS: dict[str, type[TransferPath]] = {"shm": ShmPath, "stream": StreamPath}


class TransferSession:
    """A transfer session with the server: regions registered in it die with it.

    Args:
        connection: the connection (its tenant and geometry are the session's).
        path: "auto", "shm" (fail if the server cannot map a region) or "stream".
        streams: Fetch calls the stream path keeps in flight at once, 1 to
            `MAX_STREAMS` (None: two per core, 2 to 8).
        ring: read small batches (one `fetch` batch of at most `ring.max_descriptors`)
            through the session's request ring once a region is shared
            (`kvstore.client.transfer_ring`); False: always by Submit.

    Raises:
        InvalidArgument: a bad path or stream count.
    """

    def __init__(self, connection: Connection, *, path: str = "auto", streams: int | None = None,
                 ring: bool = True) -> None:
        if not isinstance(path, str) or path not in (*PATHS, "auto"):
            raise InvalidArgument(f"path must be one of auto, {', '.join(PATHS)}; got {path!r}")
        if not isinstance(ring, bool):
            raise InvalidArgument(f"ring must be a bool, got {type(ring).__name__}")
        #: The request ring once registered (None: small reads go by Submit); `ring_reason` says why not.
        self.ring: RingClient | None = None
        self.ring_reason = "" if ring else "off (ring=False)"
        self._want_ring = ring and path != "stream"
        self.streams = checked_streams(streams)
        self.connection = connection
        self.path = path
        self.stub = pb_grpc.TransferStub(connection.channel)
        self.regions: dict[int, Region] = {}
        self.session_id = ""
        self._events: Any = None
        if path != "stream":
            self._events = self.stub.OpenSession(pb.OpenSessionRequest(
                geometry=connection.geometry, namespace=connection.namespace), metadata=connection.metadata)
            try:
                first = next(self._events)
            except grpc.RpcError as exc:
                raise status_error(exc) from None
            self.session_id = first.session_id
            self.max_descriptors = first.max_descriptors
            self.keep_finished = first.keep_finished
            self.max_session_descriptors = first.max_session_descriptors or first.max_descriptors
        else:
            self.max_descriptors = connection.max_batch_blocks
            self.keep_finished = 0
            self.max_session_descriptors = 0
        self._paths = {name: cls(self) for name, cls in PATHS.items()}

    def call(self, method: Any, request: Any) -> Any:
        """One unary call, its failure raised as a KVStoreError."""
        return self.connection.call(method, request)

    def ended(self) -> bool:
        """Whether the session's stream has ended (closed here, or the server died or dropped it)."""
        return self._events is None or bool(self._events.done())

    # -- regions -----------------------------------------------------------

    def register(self, size_bytes: int) -> Region:
        """Create a region of `size_bytes` (a sealed memfd, `kvstore.region`) and register it;
        on "auto" and "shm" the server maps it.

        Raises:
            InvalidArgument: `size_bytes` is not a positive int.
            FailedPrecondition: path "shm" and the server cannot map the region.
            ResourceExhausted: the session or the server maps its most regions or bytes.
        """
        region = Region(arguments.integer(size_bytes, "size_bytes", least=1))
        try:
            if self.path != "stream":
                nonce = region.write_nonce()
                pid, fd = region.handle
                reply = self.call(self.stub.RegisterRegion, pb.RegisterRegionRequest(
                    session_id=self.session_id, shm_name=region.name, size_bytes=region.size_bytes, nonce=nonce,
                    pid=pid, fd=fd))
                region.view[: len(nonce)] = bytes(len(nonce))
                if reply.shared:
                    region.region_id, region.shared = reply.region_id, True
                    if self._want_ring:  # the server maps this host's memory: the ring will map too
                        self._want_ring = False
                        self.ring, self.ring_reason = open_ring(self)
                elif self.path == "shm":
                    raise FailedPrecondition(f"the server cannot map this host's regions: {reply.reason}",
                                             hint='use path="auto" or "stream" across hosts')
            if not region.shared:
                region.region_id = next(_LOCAL_IDS)
        except BaseException:
            region.close()
            raise
        # Mapped by both ends (or by this one only): the descriptor has done its job.
        region.release_fd()
        self.regions[region.region_id] = region
        return region

    def region(self, region_id: int) -> Region:
        """A region of this session by id."""
        try:
            return self.regions[region_id]
        except KeyError:
            raise NotFound(f"region {region_id} is not registered in this session") from None

    def deregister(self, region: Region) -> None:
        """Unregister and close a region (the server unmaps it first).

        Raises:
            NotFound: `region` is not registered in this session.
        """
        self._own(region)
        if region.shared:
            self.call(self.stub.DeregisterRegion, pb.DeregisterRegionRequest(
                session_id=self.session_id, region_id=region.region_id))
        self.regions.pop(region.region_id, None)
        region.close()

    # -- batches -----------------------------------------------------------

    def _own(self, region: Any) -> Region:
        if not isinstance(region, Region):
            raise InvalidArgument(f"region must be a Region from this session's register(), "
                                  f"got {type(region).__name__}")
        if self.regions.get(region.region_id) is not region:
            raise NotFound(f"region {region.name} is not registered in this session")
        return region

    def _path_for(self, groups: Sequence[DescriptorGroup]) -> TransferPath:
        regions = [self.regions.get(g.region_id) for g in groups]
        shared = all(r is not None and r.shared for r in regions)
        return self._paths["shm" if shared else "stream"]

    def read(self, descriptors: Sequence[Descriptor], *, prefix_only: bool = False) -> Transfer:
        """Start fetching blocks into regions; returns at once.

        Args:
            descriptors: block hash -> region, offset, length (one block each).
            prefix_only: stop at the first block not found; the rest come back SKIPPED.

        Raises:
            InvalidArgument: a descriptor is not a `Descriptor`, or the batch is empty or too long.
        """
        groups = group(_descriptors(descriptors, self.max_descriptors), Op.READ)
        return self._path_for(groups).read(groups, prefix_only)

    def write(self, tokens: Sequence[int], descriptors: Sequence[Descriptor], *, first_block: int = 0,
              extra_keys: Sequence[ExtraKey] = ()) -> Transfer:
        """Start storing blocks from regions; returns at once. Same checks and durability as `Client.put`.

        Args:
            tokens: the prompt's token ids (blocks before `first_block` must be stored).
            descriptors: one per full block of `tokens` from `first_block`, in order.
            first_block: index of the first block written.
            extra_keys: keys mixed into every block's hash.

        Raises:
            InvalidArgument: bad tokens, extra keys, `first_block` or descriptors, or fewer
                full blocks of tokens than descriptors.
        """
        tokens = arguments.token_ids(tokens)
        first_block = arguments.integer(first_block, "first_block")
        extra_keys = arguments.extra_keys(extra_keys)
        descriptors = _descriptors(descriptors, self.max_descriptors)
        bt = self.connection.block_tokens
        if (first_block + len(descriptors)) * bt > len(tokens):
            raise InvalidArgument(f"{len(descriptors)} descriptors from block {first_block} need "
                                  f"{(first_block + len(descriptors)) * bt} tokens; got {len(tokens)}")
        parent = self.connection.hashes(tokens[: first_block * bt], extra_keys=extra_keys)[-1:] or [b""]
        ids = tokens[first_block * bt: (first_block + len(descriptors)) * bt]
        extra = encode_extra_keys(extra_keys)
        groups = group(descriptors, Op.WRITE)
        return self._path_for(groups).write(groups, parent[0], ids, extra)

    def fetch(self, hashes: Sequence[bytes], region: Region, *, offset_bytes: int = 0,
              batch_descriptors: int = 512, prefix_only: bool = True) -> TransferState:
        """Fetch blocks into consecutive slots of `region` and wait: the common case.

        Each batch is one descriptor group. They go out together (on the shm path,
        one SubmitMany call for up to `keep_finished` of them) and are awaited
        together (one GetTransfers), so they overlap. With `prefix_only`, each
        batch stops at its first block not found; a later batch may already have
        loaded blocks past it, so load `done_prefix` blocks.

        Raises:
            InvalidArgument: bad hashes, offset or batch size, or more blocks than fit in `region`.
            NotFound: `region` is not registered in this session.
        """
        hashes = _hashes(hashes)
        region = self._own(region)
        offset_bytes = arguments.integer(offset_bytes, "offset_bytes")
        batch_descriptors = arguments.integer(batch_descriptors, "batch_descriptors", least=1)
        if not isinstance(prefix_only, bool):
            raise InvalidArgument(f"prefix_only must be a bool, got {type(prefix_only).__name__}")
        size = self.connection.block_bytes
        if offset_bytes + len(hashes) * size > region.size_bytes:
            raise InvalidArgument(f"{len(hashes)} blocks of {size} bytes from offset {offset_bytes} do not fit "
                                  f"in region {region.name} of {region.size_bytes} bytes")
        step = max(1, min(batch_descriptors, self.max_descriptors))
        ring = self.ring
        if ring is not None and region.shared and 0 < len(hashes) <= min(step, ring.max_descriptors):
            state = self._ring_fetch(ring, hashes, region, offset_bytes, prefix_only)
            if state is not None:
                return state
        if not region.shared and len(hashes) <= step:  # one stripe's worth: one call, little Python
            stream = self._paths["stream"]
            assert isinstance(stream, StreamPath)
            state = stream.fetch_slots(hashes, region.view, offset_bytes, prefix_only)
            if state is not None:
                return state
        batches = []
        for start in range(0, len(hashes), step):
            chunk = hashes[start:start + step]
            if any(len(h) != HASH_BYTES for h in chunk):
                batches.append(group([Descriptor(block_hash=h, region_id=region.region_id, length_bytes=size,
                                                 offset_bytes=offset_bytes + (start + i) * size)
                                      for i, h in enumerate(chunk)], Op.READ))
            else:
                batches.append([DescriptorGroup.slots(chunk, region_id=region.region_id, length_bytes=size,
                                                      offset_bytes=offset_bytes + start * size)])
        if not batches:
            return TransferState.concat([])
        # Every batch names the one region, so they all take the same path. The
        # server runs at most `keep_finished` batches and `max_session_descriptors`
        # descriptors of a session at once, and remembers no more finished: more
        # are sent only once those have been collected, so none is refused, nor
        # forgotten before it is read.
        path = self._path_for(batches[0])
        window = self.keep_finished or len(batches)
        if self.max_session_descriptors:
            window = max(1, min(window, self.max_session_descriptors // step))
        states: list[TransferState] = []
        for start in range(0, len(batches), window):
            states.extend(self.wait_all(path.read_many(batches[start:start + window], prefix_only)))
        return TransferState.concat(states)

    def _ring_fetch(self, ring: RingClient, hashes: list[bytes], region: Region, offset_bytes: int,
                    prefix_only: bool) -> TransferState | None:
        """A one-batch fetch through the request ring (no numpy, no call); None when the ring cannot
        take it now (another thread's request, a hash of another length): the caller submits it."""
        if any(len(h) != HASH_BYTES for h in hashes):
            return None
        size = self.connection.block_bytes
        request = pb.SubmitRequest(op=pb.TRANSFER_OP_READ, prefix_only=prefix_only, groups=[pb.DescriptorGroup(
            region_id=region.region_id, length_bytes=size, block_hashes=b"".join(hashes),
            offsets_bytes=range(offset_bytes, offset_bytes + len(hashes) * size, size))])
        try:
            return _state(ring.read(request), size)
        except RingUnusable:
            return None

    def wait_all(self, transfers: Sequence[Transfer], timeout_s: float | None = None) -> list[TransferState]:
        """Wait for several batches, in as few calls as their paths allow; their states, in order.

        The server remembers a session's last `keep_finished` finished batches:
        wait for at most that many at a time.
        """
        timeout_s = timeout(timeout_s)
        if not all(isinstance(t, Transfer) for t in transfers):
            raise InvalidArgument("transfers must be Transfer objects from this session's read() or write()")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        for path in self._paths.values():
            path.wait_many(transfers, left())
        return [t.wait(left()) for t in transfers]

    # -- lifetime ----------------------------------------------------------

    def close(self) -> None:
        """End the session: the server unmaps every region; the regions are closed here."""
        for path in self._paths.values():
            path.close()
        if self._events is not None:
            self._events.cancel()
            self._events = None
        if self.ring is not None:  # after the stream: a request waiting on another thread sees it end
            self.ring.close()
            self.ring = None
        for region in list(self.regions.values()):
            region.close()
        self.regions.clear()

    def __enter__(self) -> TransferSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
