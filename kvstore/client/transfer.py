"""The worker side of batched transfers: the session, its regions, its paths.

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
"stream". The caller's code is the same on every path. The session's batches
(`read`, `write`, `fetch`, `wait_all`) are its base class's,
`kvstore.client.transfer_batches.SessionBatches`.

Every method raises a `kvstore.errors` class, never a bare ValueError or
TypeError: `InvalidArgument` for a bad argument (nothing sent).
"""

from __future__ import annotations

import itertools
from typing import Any, cast

import grpc

from kvstore.client import arguments
from kvstore.client.connection import Connection, status_error
from kvstore.client.transfer_batches import SessionBatches
from kvstore.client.transfer_bulk import BulkPath
from kvstore.client.transfer_path import TransferPath
from kvstore.client.transfer_ring import RingClient, open_ring
from kvstore.client.transfer_shm import ShmPath
from kvstore.client.transfer_stream import StreamPath, checked_streams
from kvstore.client.transfer_tcp import open_tcp
from kvstore.client.transfer_tcp import wanted as tcp_wanted
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, NotFound
from kvstore.region import Region
from kvstore.v1 import transfer_pb2 as pb
from kvstore.v1 import transfer_pb2_grpc as pb_grpc

#: Region ids of stream-path regions: far above any id a server hands out.
_LOCAL_IDS = itertools.count(1 << 62)


#: Path name -> implementation; "auto" picks per region (see the module doc).
PATHS: dict[str, type[TransferPath]] = {"shm": ShmPath, "stream": StreamPath}


class TransferSession(SessionBatches):
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
        if tcp_wanted(self.bulk_offered):  # the one-copy TCP transport where offered (kvstore/client/transfer_tcp.py)
            tcp, self.bulk_reason = open_tcp(self, cast(StreamPath, self._paths["stream"]))
            if tcp is not None or "mooncake" not in self.bulk_offered:
                self.bulk = tcp
                return
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
                reply = self.ask_to_map(region)
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

    def ask_to_map(self, region: Region) -> pb.RegisterRegionResponse:
        """Ask the server to map `region` (fresh: its first bytes carry the nonce, cleared after), its answer.

        Raises:
            KVStoreError: the server refused the call (Unavailable when it does not answer).
        """
        nonce = region.write_nonce()
        pid, fd = region.handle
        reply: pb.RegisterRegionResponse = self.call(self.stub.RegisterRegion, pb.RegisterRegionRequest(
            session_id=self.session_id, shm_name=region.name, size_bytes=region.size_bytes, nonce=nonce,
            pid=pid, fd=fd))
        region.view[: len(nonce)] = bytes(len(nonce))
        return reply

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
