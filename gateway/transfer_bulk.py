"""The bulk transport: blocks written by Mooncake's transfer engine straight into a client's memory.

A client whose regions this server cannot map (another host) fetches over gRPC
(`Transfer.Fetch`, its bytes in the reply) or, when both ends agree, over the bulk
transport (docs/TRANSFER.md "Bulk transport"):

1. `OpenBulk`: the client names its engine ("host:port"); the server answers yes,
   or no and why (`transfer.bulk` is off, Mooncake cannot run here). A client with
   several engines calls it once per engine: each is a lane of the session, tied to one
   of the server's engines (`ENGINES`), and each write goes through the lane with the
   fewest writes running (one Mooncake 0.3.13 engine moves all its TCP bytes on one io thread).
2. `BulkFetch`: the server finds the blocks in LMDB's map under a read txn, verifies each
   against its checksum in place, and its engine writes the found blocks from the map to
   the client's addresses in one batch (`batch_transfer_sync_write`), the txn held until
   the write returns (`gateway/transfer_bulk_map.py`); the reply carries statuses only.
   No ack: the txn ends once the write returns.

Staging, the fallback: a call the map path cannot answer exactly (a corrupt or damaged
block; the map gone stale; the native lookups not built) looks its blocks up and
verify-copies them into a staging slot (Fetch's loop), and the engine writes from the
slot. Staging is bounded: `bulk_staging_bytes` cut into slots of `bulk_max_blocks`
blocks; a call waits for a free slot. The pool and the map's registration are made at
the first accepted OpenBulk and the first BulkFetch, so a server that never serves one
pays nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.transfer_bulk_lanes import Lane, Lanes, checked_segment, peer_host, same_host
from gateway.transfer_bulk_map import MapSource, Resolved, missing
from gateway.transfer_fetch import batch_results, copy_blocks
from kvstore.config import TransferSettings
from kvstore.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvstore.host import usable_cpus
from kvstore.native import blockcopy
from kvstore.transfer import BatchResults
from tiers.store import MappedStore

log = logging.getLogger("kvstore.transfer")

#: Transfer engines the server runs: Mooncake 0.3.13's TCP transport moves all of an engine's
#: bytes on one io thread, which held one engine pair at 2.1-2.8 GB/s on the 16-core H200 host
#: (however many batches were in flight); one engine per 4 CPUs, 1 to 4.
ENGINES = max(1, min(4, usable_cpus() // 4))
#: Most client engines (lanes) one session may name.
MAX_LANES = 16

def engine_missing() -> str:
    """Why Mooncake's transfer engine cannot run in this process ("" when it can)."""
    # Mooncake logs a line at INFO for every batch waited on (`write_blocks`): from WARNING up
    # unless set (read when its library loads: no effect once imported).
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError, or its native library (libibverbs) failing to load
        return (f"mooncake-transfer-engine cannot run on the server ({type(exc).__name__}: {exc}); "
                "fix: apt-get install -y libibverbs1 && pip install mooncake-transfer-engine-non-cuda")
    return ""


@dataclass(frozen=True, kw_only=True)
class BulkFetched:
    """A BulkFetch's results: statuses and failures per block (the bytes went by the engine).

    Attributes:
        staged: True when the blocks went through a staging slot, False when from the map.
    """

    results: BatchResults
    found: int
    staged: bool


class _Staging:
    """The registered staging pool and its free slots (each `slot_bytes`)."""

    def __init__(self, engines: list[Any], slots: int, slot_bytes: int) -> None:
        self.buffer = np.empty(slots * slot_bytes, dtype=np.uint8)  # pages committed as slots are used
        self.address = int(self.buffer.ctypes.data)
        self.slot_bytes = slot_bytes
        if any(engine.register_memory(self.address, self.buffer.nbytes) for engine in engines):
            raise Unavailable("bulk: the server's transfer engine could not register its staging pool")
        self.free = list(range(slots))
        self.ready = asyncio.Semaphore(slots)

    def view(self, slot: int) -> memoryview:
        return self.buffer.data[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]


class BulkServer:
    """The server's transfer engine, staging pool and the sessions that negotiated bulk.

    Args:
        settings: the transfer section (`bulk`, `bulk_host`, `bulk_staging_bytes`, `bulk_max_blocks`).
        block_bytes: the largest block of the served geometries (a slot's size is counted in them).
    """

    def __init__(self, settings: TransferSettings, block_bytes: int) -> None:
        self.settings = settings
        # A slot never outgrows the pool: the pool stays within bulk_staging_bytes.
        self.max_blocks = max(1, min(settings.bulk_max_blocks, settings.bulk_staging_bytes // block_bytes))
        self.slot_bytes = self.max_blocks * block_bytes
        self.slots = max(1, settings.bulk_staging_bytes // self.slot_bytes)
        #: Session id -> its lanes (client engines), for sessions whose OpenBulk was accepted.
        self.segments: dict[str, Lanes] = {}
        #: BulkFetch calls answered since start, and of them those served through staging.
        self.fetches = 0
        self.staged = 0
        self._engines: list[Any] = []
        self._load: list[int] = []  # lanes tied to each engine now
        self._staging: _Staging | None = None
        self._map: MapSource | None = None
        #: Why calls are not served from the map ("" while they may be, or until first tried).
        self.map_reason = "" if settings.bulk_from_map else "off (transfer.bulk_from_map = false)"
        self._map_lock = asyncio.Lock()
        # Calls writing from the map at once: as many as staging slots (each holds a read txn).
        self._writing = asyncio.Semaphore(self.slots)
        self._start_lock = threading.Lock()
        # The engine's writes block for the time of a transfer: on threads of their own, one per
        # slot (what bounds them), so they never hold up asyncio.to_thread's other users.
        self._writers = ThreadPoolExecutor(self.slots, thread_name_prefix="kvstore-bulk-write")
        self._refused = "" if settings.bulk == "mooncake" else "transfer.bulk is off on this server"
        #: What OpenSession's first event offers: the transport named by `transfer.bulk`, if any.
        # "mooncake-lanes": several OpenBulk calls of one session name as many engines (lanes).
        self.offered = [] if settings.bulk == "off" else [settings.bulk, f"{settings.bulk}-lanes"]

    async def open(self, session_id: str, transport: str, segment: str, peer: str) -> str:
        """Accept a session's bulk transport ("") or say why not (the client uses gRPC).

        Args:
            peer: the calling connection's address (grpc's `context.peer()`): the segment's
                host must be its host, so the server's engine dials only the hosts that call it.

        Raises:
            InvalidArgument: a segment that is not host:port.
        """
        segment = checked_segment(segment)
        if transport != "mooncake":
            return f"transport {transport[:32]!r} is not served here (only 'mooncake')"
        host, caller = segment.rpartition(":")[0].strip("[]"), peer_host(peer)
        if not same_host(host, caller):
            return (f"segment host {host} is not the address this session's calls come from ({caller or peer}); "
                    "the server writes only to an engine on the calling host")
        if not self._refused and self._staging is None:
            await asyncio.to_thread(self._start)  # off the loop: registering may pin memory (RDMA)
        if self._refused:
            return self._refused
        if int(segment.rpartition(":")[2]) in {e.get_rpc_port() for e in self._engines}:
            # Never its own engine: a write there could land in another call's staging slot.
            return f"segment {segment} names this server's own transfer engine"
        lanes = self.segments.setdefault(session_id, Lanes())
        if all(lane.segment != segment for lane in lanes.lanes):
            if len(lanes.lanes) >= MAX_LANES:
                return f"this session names {MAX_LANES} engines already (the most it may)"
            # The least loaded of the server's engines writes to this lane.
            i = min(range(len(self._engines)), key=self._load.__getitem__)
            self._load[i] += 1
            lanes.lanes.append(Lane(segment, self._engines[i], i))
        return ""

    def _start(self) -> None:
        """Import and start the engine and register the staging pool, once (P2P handshake: no
        metadata server)."""
        with self._start_lock:
            if self._engines or self._refused:
                return
            self._refused = engine_missing()
            if self._refused:
                return
            from mooncake.engine import TransferEngine

            engines: list[Any] = []
            for _ in range(ENGINES):
                try:
                    engine = TransferEngine()
                    failed = engine.initialize(self.settings.bulk_host, "P2PHANDSHAKE", "tcp", "")
                except Exception as exc:  # the native engine's own errors: bulk stays off, gRPC serves
                    failed = f"{type(exc).__name__}: {exc}"
                if failed:
                    if not engines:
                        self._refused = (f"the server's transfer engine did not start on {self.settings.bulk_host} "
                                         f"({failed})")
                        return
                    log.warning("bulk transport: %d of %d engines started (%s)", len(engines), ENGINES, failed)
                    break
                engines.append(engine)
            try:
                self._staging = _Staging(engines, self.slots, self.slot_bytes)
            except Unavailable as exc:
                self._refused = exc.message
                return
            self._engines, self._load = engines, [0] * len(engines)

    def close(self) -> None:
        """Stop the write threads (after the server stopped taking calls), then drop the map's registration."""
        self._writers.shutdown(wait=True)
        if self._map is not None:
            self._map.close()

    def forget(self, session_id: str) -> None:
        """The session ended: its engines are no longer written to."""
        lanes = self.segments.pop(session_id, None)
        for lane in lanes.lanes if lanes is not None else ():
            self._load[lane.index] -= 1

    def segment(self, session_id: str) -> Lanes:
        """The session's lanes (its client engines).

        Raises:
            FailedPrecondition: the session did not negotiate bulk.
        """
        try:
            return self.segments[session_id]
        except KeyError:
            raise FailedPrecondition("this session has no bulk transport (OpenBulk first, or it was refused)",
                                     hint="fetch over gRPC (Transfer.Fetch)") from None

    def checked_offsets(self, n: int, offsets: Any, address: int, size_bytes: int, block_bytes: int) -> np.ndarray:
        """The offsets of a BulkFetch: one per block, each block inside [address, address + size_bytes).

        Raises:
            InvalidArgument: naming the first bad one.
        """
        if not address:
            raise InvalidArgument("address must be the start of a buffer the client's engine registered")
        at = np.array(offsets, dtype=np.uint64)
        if len(at) != n:
            raise InvalidArgument(f"{len(at)} offsets for {n} blocks: send one per block")
        if size_bytes < block_bytes or address + size_bytes >= 1 << 64:
            raise InvalidArgument(f"size_bytes {size_bytes} at address {address:#x} holds no {block_bytes}-byte block")
        bad = np.flatnonzero(at > np.uint64(size_bytes - block_bytes))
        if len(bad):
            i = int(bad[0])
            raise InvalidArgument(f"offsets_bytes[{i}] = {int(at[i])}: block {i} of {block_bytes} bytes does not "
                                  f"fit in the {size_bytes}-byte buffer")
        return at

    async def fetch(self, tier: MappedStore, keys: list[bytes], lanes: Lanes, offsets: np.ndarray, address: int,
                    block_bytes: int, prefix_only: bool) -> BulkFetched:
        """Write the found blocks into the client's memory (from the map, else through a staging
        slot), then restart their retention clocks durably (a failed refresh fails the call, as
        it fails a Get).

        Raises:
            Unavailable: the engine's write failed (the client falls back to gRPC).
        """
        assert self._staging is not None  # a session has lanes only once started
        source = await self._source(tier)
        codes: bytes | None = None
        if source is not None:
            async with self._writing:
                resolved = await tier.call(source.resolve, keys, block_bytes, prefix_only)
                if resolved is not None:
                    codes, due = resolved.codes, resolved.due
                    await self._write_from_map(resolved, lanes, offsets, address, block_bytes)
        staged = codes is None
        if codes is None:
            codes, due = await self._write_staged(tier, keys, lanes, offsets, address, block_bytes, prefix_only)
        if due:
            await asyncio.wrap_future(tier.touch_soon(due))
        results = batch_results(codes, block_bytes)
        self.fetches += 1  # on the event loop: no lock
        self.staged += staged
        return BulkFetched(results=results, found=codes.count(blockcopy.FOUND), staged=staged)

    async def _source(self, tier: MappedStore) -> MapSource | None:
        """The map registered with the engine, made at the first call; None: staging serves."""
        if self._map is None and not self.map_reason:
            async with self._map_lock:
                if self._map is None and not self.map_reason:
                    self.map_reason = missing()
                    try:
                        self._map = None if self.map_reason else await tier.call(MapSource, self._engines, tier)
                    except LookupError:  # an empty store: nothing to find it by yet; next call
                        pass
                    except (Unavailable, OSError, ValueError) as exc:
                        self.map_reason = str(getattr(exc, "message", exc))
                    if self.map_reason:
                        log.warning("bulk transport: serving through staging (%s)", self.map_reason)
        source = self._map
        if source is None or not source.usable():
            return None
        return source

    async def _write_from_map(self, resolved: Resolved, lanes: Lanes, offsets: np.ndarray, address: int,
                              block_bytes: int) -> None:
        """Have the engine write the resolved blocks; their txn ends once the write returns."""
        remote = (offsets[resolved.found] + np.uint64(address)).tolist()
        # The txn ends on the write's thread, after the write: even when this call is
        # cancelled meanwhile, LMDB reuses no page the engine may still be reading.
        with lanes.pick() as lane:
            rc = await lanes.submit(self._writers, _write_then_end, lane.engine, lane.segment, resolved.addresses,
                                    remote, block_bytes, resolved.txn)
        if rc:
            raise _write_failed(lane.segment, len(remote), rc)

    async def _write_staged(self, tier: MappedStore, keys: list[bytes], lanes: Lanes, offsets: np.ndarray,
                            address: int, block_bytes: int, prefix_only: bool) -> tuple[bytes, list[bytes]]:
        """Verify-copy the blocks into a staging slot and write the found ones from it."""
        staging = self._staging
        assert staging is not None
        async with staging.ready:
            slot = staging.free.pop()
            try:
                codes, due = await tier.call(copy_blocks, tier, keys, staging.view(slot), block_bytes, prefix_only)
                found = np.flatnonzero(np.frombuffer(codes, dtype=np.uint8) == blockcopy.FOUND)
                if len(found):
                    base = staging.address + slot * staging.slot_bytes
                    local = (found * block_bytes + base).tolist()
                    remote = (offsets[found] + np.uint64(address)).tolist()
                    with lanes.pick() as lane:
                        write = lanes.submit(self._writers, write_blocks, lane.engine, lane.segment, local, remote,
                                             block_bytes)
                        try:
                            rc = await asyncio.shield(write)
                        except asyncio.CancelledError:
                            # The engine may still be reading the slot: it is freed once the write returns.
                            await asyncio.wait([write])
                            raise
                    if rc:
                        raise _write_failed(lane.segment, len(local), rc)
            finally:
                staging.free.append(slot)
        return codes, due


def write_blocks(engine: Any, segment: str, local: list[int], remote: list[int], block_bytes: int) -> int:
    """The engine's batch write of `block_bytes` from each local address to its remote one (0: done):
    on a host short of cores submitted, slept through most of the time the engine's last writes
    took, then waited for."""
    if not SLEEP_SHARE:
        return int(engine.batch_transfer_sync_write(segment, local, remote, [block_bytes] * len(local)))
    nbytes = len(local) * block_bytes
    start = time.perf_counter()
    batch = engine.batch_transfer_async_write(segment, local, remote, [block_bytes] * len(local))
    if not batch:
        return -1
    time.sleep(SLEEP_SHARE * _PACE.get(id(engine), 0.0) * nbytes)
    rc = int(engine.get_batch_transfer_status([batch]))
    _PACE[id(engine)] = (time.perf_counter() - start) / max(nbytes, 1)
    return rc


#: Of a write's expected time (its bytes at its engine's last pace), the part slept before
#: Mooncake's wait, which polls without sleeping: a core per write in flight, which on the
#: 2-core dev box took the cores the engines' io threads need (bulk / Mooncake's raw read,
#: paired runs: 0.43-0.71x polling, 0.69-1.01x sleeping first). A write faster than
#: expected is seen late by at most this share; the pace then follows it down. 0 (Mooncake's
#: own polling wait, as measured on the 16-core H200 host) where cores are not short.
SLEEP_SHARE = 0.7 if usable_cpus() < 8 else 0.0
#: Seconds a byte each server engine's last write took, submit to done (by `id(engine)`).
_PACE: dict[int, float] = {}


def _write_then_end(engine: Any, segment: str, local: list[int], remote: list[int], block_bytes: int,
                    txn: Any) -> int:
    """`write_blocks` (none when `local` is empty), then end the read txn the blocks are read under."""
    try:
        return write_blocks(engine, segment, local, remote, block_bytes) if local else 0
    finally:
        txn.abort()


def _write_failed(segment: str, blocks: int, rc: int) -> Unavailable:
    return Unavailable(f"bulk: writing {blocks} blocks into {segment} failed (Mooncake returned {rc})",
                       hint="fetch over gRPC (Transfer.Fetch)")
