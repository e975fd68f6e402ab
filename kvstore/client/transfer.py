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
- "bulk": the server's Mooncake transfer engine writes fetched blocks straight into
  the region (`kvstore.client.transfer_bulk`), negotiated per session, with
  "stream" as the fallback (`session.bulk_reason` says why it is not in use).
"auto" registers each region with the server, which proves it can see the
region by reading a nonce from it; a region the server cannot map is served
by "bulk" when the session negotiated it (at its first such region), else by
"stream". The caller's code is the same on every path.

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
from kvstore.client.transfer_bulk import BulkPath
from kvstore.client.transfer_path import Transfer, TransferPath, timeout
from kvstore.client.transfer_ring import RingClient, RingUnusable, open_ring
from kvstore.client.transfer_shm import ShmPath, state_of
from kvstore.client.transfer_stream import StreamPath, checked_streams
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, NotFound
from kvstore.prefix import HASH_BYTES, ExtraKey
from kvstore.region import Region
from kvstore.transfer import Descriptor, DescriptorGroup, Op, TransferState, group
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc

_WHOLE, _BYTES = {HASH_BYTES}, {bytes}
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
        path: "auto", "shm" (fail if the server cannot map a region), "stream" (gRPC, no
            session) or "bulk" (the bulk transport for every region, gRPC if refused).
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
        if not isinstance(path, str) or path not in (*PATHS, "bulk", "auto"):
            raise InvalidArgument(f"path must be one of auto, {', '.join(PATHS)}, bulk; got {path!r}")
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
        #: Bulk paths turned off (`bulk_failed`) whose regions are still registered with the engine.
        self._closing: list[BulkPath] = []
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
            self.bulk_offered = list(first.bulk_transports)
        else:
            self.max_descriptors = connection.max_batch_blocks
            self.keep_finished = 0
            self.max_session_descriptors = 0
            self.bulk_offered = []
        self._paths = {name: cls(self) for name, cls in PATHS.items()}
        #: The bulk transport once negotiated (None: regions the server cannot map stream over
        #: gRPC); `bulk_reason` says why not.
        self.bulk: BulkPath | None = None
        self.bulk_reason = {"stream": "off: path='stream' opens no session",
                            "shm": "off: path='shm' maps every region"}.get(
            path, "not negotiated yet: asked at the first region the server cannot map")
        self._want_bulk = path not in ("stream", "shm")
        if path == "bulk":
            self._negotiate_bulk()

    def _negotiate_bulk(self) -> None:
        """Ask the server for the bulk transport, once; on any refusal or failure say why and stream."""
        self._want_bulk = False
        if "mooncake" not in self.bulk_offered:  # no engine is started here unless the server offers one
            self.bulk_reason = "off: the server offers no bulk transport (its transfer.bulk is off)"
            return
        stream = self._paths["stream"]
        assert isinstance(stream, StreamPath)
        try:
            bulk = BulkPath(self, stream, 0)
            reply = self.call(self.stub.OpenBulk, pb.OpenBulkRequest(
                session_id=self.session_id, transport="mooncake", segment=bulk.segment))
        except KVStoreError as exc:
            self.bulk_reason = f"off: {exc.message}" + (f" ({exc.hint})" if exc.hint else "")
            return
        if not reply.accepted:
            bulk.close()
            self.bulk_reason = f"off: the server refused it: {reply.reason}"
            return
        bulk.max_blocks = max(1, reply.max_blocks)
        self.bulk, self.bulk_reason = bulk, ""

    def bulk_failed(self, reason: str) -> None:
        """Turn the bulk transport off for this session (its regions stream from now on)."""
        if self.bulk is not None:
            self._closing.append(self.bulk)
        self.bulk, self.bulk_reason = None, f"off: {reason}"

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
            if self.path not in ("stream", "bulk"):
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
                if self._want_bulk:
                    self._negotiate_bulk()
                if self.bulk is not None and not self.bulk.register(region):
                    self.bulk_failed(f"the client's engine could not register region {region.name}")
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
        for bulk in (self.bulk, *self._closing):
            if bulk is not None:  # before it is unmapped: no engine may write into it after
                bulk.unregister(region)
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
        if not shared and self.bulk is not None and self.bulk.covers(groups):
            return self.bulk
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
        ring = self.ring
        if ring is not None:  # the common small fetch, its checks cheap; anything unusual goes the long way
            state = self._ring_fast(ring, hashes, region, offset_bytes, batch_descriptors, prefix_only)
            if state is not None:
                return state
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
        if not region.shared and self.bulk is None and len(hashes) <= step:  # one stripe: one call, little Python
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

    def _ring_fast(self, ring: RingClient, hashes: Any, region: Any, offset_bytes: Any, batch_descriptors: Any,
                   prefix_only: Any) -> TransferState | None:
        """`fetch` through the ring when every argument is plainly good (a list of whole-hash bytes,
        int offset and batch size, a bool, a shared region of this session the blocks fit): the same
        checks as `fetch`'s, in a few cheap tests. None when any is not so plain, or the ring cannot
        take it now: `fetch` then checks (raising its errors) and reads the long way."""
        if (type(hashes) is not list or type(offset_bytes) is not int or type(batch_descriptors) is not int
                or type(prefix_only) is not bool or type(region) is not Region or not region.shared
                or self.regions.get(region.region_id) is not region):
            return None
        n = len(hashes)
        size = self.connection.block_bytes
        if (not 0 < n <= min(batch_descriptors, self.max_descriptors, ring.max_descriptors) or offset_bytes < 0
                or offset_bytes + n * size > region.size_bytes):
            return None
        try:
            joined = b"".join(hashes)
        except TypeError:  # not all bytes-like: `_hashes` names the bad one
            return None
        # Every hash a bytes of HASH_BYTES (two passes in C: cheaper than a generator over them).
        if len(joined) != n * HASH_BYTES or set(map(len, hashes)) != _WHOLE or set(map(type, hashes)) != _BYTES:
            return None
        try:
            return ring.fetch_slots(joined, n, region.region_id, offset_bytes, size, prefix_only)
        except RingUnusable:
            return None

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
            return state_of(ring.read(request), size)
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
        for bulk in (self.bulk, *self._closing):
            if bulk is not None:  # unregisters the regions from the engine before they are unmapped
                bulk.close()
        self.bulk, self._closing = None, []
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
