"""Re-replication over the bulk transport: the receiver's engine reads each block from the source's LMDB map.

Where both nodes run Mooncake's transfer engine (`[transfer] bulk = "mooncake"` and the
engine importable, docs/FLEET.md F18, docs/TRANSFER.md "Bulk transport"), a CopyBlocks
carries the blocks' metadata only:

1. the source (`BulkSource`, the repairer's) finds the batch's blocks in its map under a
   read txn and verifies each against its checksum in place (`MapSource.resolve`, the same
   zero-copy source a BulkFetch uses); the request names its engine (`bulk_segment`) and
   each block's address in the map (`source_address`), and the txn stays open until the
   call is answered, so LMDB reuses none of those pages meanwhile;
2. the receiver (`BulkReceiver`, the Fleet service's) reads the blocks with its own engine
   into a registered staging slot (`batch_transfer_async_read`, one batch per call), then
   checks and stores them exactly as bytes that came in the request (F17: namespace, size,
   checksum; one durable transaction), and answers.

Where either end lacks it, the copy goes over gRPC, the bytes in the request: a source
without an engine never names one; a receiver without one (or whose read fails) answers
`bulk_refused` with why, stores nothing, and the source sends that batch and the rest of
its pass to that node over gRPC. A batch the map cannot answer exactly (a damaged block,
one gone since planned, mixed block sizes) goes over gRPC too, where the verified read
reports and drops what is damaged (F17).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gateway.transfer_bulk import SLEEP_SHARE, engine_missing
from gateway.transfer_bulk_lanes import checked_segment, peer_host, same_host
from gateway.transfer_bulk_map import MapSource, Resolved, missing
from kvstore.errors import InvalidArgument, Unavailable
from tiers.store import MappedStore

log = logging.getLogger("kvstore.fleet.bulk")
#: Bytes of block data per CopyBlocks call (`gateway.fleet_repair`'s batches; a receiver's staging slot): a
#: full run of 256 V4.1-Flash blocks (14.6 MB) goes in one call, one fsync'd transaction on the receiver.
BATCH_BYTES = 16 << 20
#: Bulk CopyBlocks one receiver reads at once (a slot each; a repairer keeps up to 4 in flight).
RECEIVER_SLOTS = 8


def _start_engine(host: str) -> tuple[Any, str]:
    """A started Mooncake engine on `host` (TCP, P2P handshake) and its segment name; (None, why not)."""
    reason = engine_missing()
    if reason:
        return None, reason
    from mooncake.engine import TransferEngine

    try:
        engine = TransferEngine()
        failed = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    except Exception as exc:  # the native engine's own errors: gRPC carries the copies
        return None, f"the transfer engine did not start on {host} ({type(exc).__name__}: {exc})"
    if failed:
        return None, f"the transfer engine did not start on {host} (Mooncake returned {failed})"
    return engine, f"{host}:{engine.get_rpc_port()}"


class BulkSource:
    """The repairer's side: its engine, with the store's map registered, from which receivers read.

    Args:
        tier: the node's store.
        host: the address the engine listens on (`[transfer] bulk_host`): receivers dial it.
    """

    def __init__(self, tier: MappedStore, host: str) -> None:
        self.tier = tier
        self.host = host
        #: The engine's segment ("host:port") once started; "" before, or when it cannot run.
        self.segment = ""
        #: Why the bulk transport is not used by this node's copies ("" while it may be).
        self.reason = ""
        self._engine: Any = None
        self._map: MapSource | None = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if self._map is not None or self.reason:
                return
            self.reason = missing()
            if not self.reason and self._engine is None:
                self._engine, found = _start_engine(self.host)
                if self._engine is None:
                    self.reason = found
                else:
                    self.segment = found
            if not self.reason:
                try:
                    self._map = MapSource([self._engine], self.tier)
                except LookupError:  # an empty store: nothing mapped yet to find it by; the next batch tries
                    pass
                except (Unavailable, OSError, ValueError) as exc:
                    self.reason = str(getattr(exc, "message", exc))
            if self.reason:
                log.warning("fleet: re-replication copies go over gRPC: %s", self.reason)

    def resolve(self, keys: list[bytes], block_bytes: int) -> Resolved | None:
        """The blocks, found and verified in the map under a read txn left open (end it once the call is
        answered); None (no txn open) when the map cannot answer them all exactly: send them over gRPC.
        Blocking: on the store's executor."""
        self._start()
        source = self._map
        if source is None or not source.usable():
            return None
        resolved = source.resolve(keys, block_bytes, False)
        if resolved is not None and len(resolved.found) != len(keys):
            resolved.txn.abort()  # one is gone since planned: gRPC's path skips it and its descendants
            return None
        return resolved

    def close(self) -> None:
        """Drop the map's registration (no call may be in flight)."""
        if self._map is not None:
            self._map.close()
            self._map = None


class BulkReceiver:
    """The Fleet service's side: an engine and a staging pool registered with it, read into by each
    bulk CopyBlocks before its blocks are checked and stored.

    Args:
        host: the address the engine listens on (`[transfer] bulk_host`).
        slot_bytes: one slot: the largest CopyBlocks' block bytes (the repairer's batch).
        slots: calls reading at once (the repairer keeps 4 in flight).
    """

    def __init__(self, host: str, slot_bytes: int, slots: int) -> None:
        self.host = host
        self.slot_bytes = slot_bytes
        self.slots = slots
        #: Why this node cannot read copies over the bulk transport ("" while it can, or until first tried).
        self.reason = ""
        self._engine: Any = None
        self._buffer: np.ndarray | None = None
        self._free: list[int] = []
        self._ready = asyncio.Semaphore(slots)
        self._lock = threading.Lock()
        # The reads block for the time of a transfer: on threads of their own, one per slot.
        self._readers = ThreadPoolExecutor(slots, thread_name_prefix="kvstore-fleet-bulk")

    def _start(self) -> str:
        with self._lock:
            if self._engine is None and not self.reason:
                engine, found = _start_engine(self.host)
                if engine is None:
                    self.reason = found
                else:
                    buffer = np.empty(self.slots * self.slot_bytes, dtype=np.uint8)  # pages committed as used
                    if engine.register_memory(int(buffer.ctypes.data), buffer.nbytes):
                        self.reason = "the transfer engine could not register its staging pool"
                    else:
                        self._engine, self._buffer, self._free = engine, buffer, list(range(self.slots))
            return self.reason

    async def refused(self, segment: str, peer: str) -> str:
        """Why this node will not read from `segment` for the caller at `peer` ("" when it will)."""
        try:
            checked_segment(segment)
        except InvalidArgument as exc:
            return exc.message
        host = segment.rpartition(":")[0].strip("[]")
        caller = peer_host(peer)
        if not same_host(host, caller):  # the engine dials only the host the call comes from
            return f"segment host {host} is not the address the call comes from ({caller or peer})"
        if self._engine is None and not self.reason:
            await asyncio.to_thread(self._start)  # off the loop: registering may pin memory (RDMA)
        return self.reason

    async def read(self, segment: str, remote: Sequence[int], sizes: Sequence[int]) -> tuple[memoryview, int]:
        """Read the blocks at `remote` (of `sizes` bytes) from `segment` into a free slot, one after another
        in it; (the slot's view, the slot). Give the slot back with `release` once its bytes are stored.

        Raises:
            InvalidArgument: more bytes than a slot holds.
            Unavailable: the engine's read failed (the slot is free again).
        """
        total = sum(sizes)
        if total > self.slot_bytes:
            raise InvalidArgument(f"a bulk CopyBlocks of {total} bytes; at most {self.slot_bytes}")
        await self._ready.acquire()
        slot = self._free.pop()
        assert self._buffer is not None
        base = int(self._buffer.ctypes.data) + slot * self.slot_bytes
        local = (base + np.concatenate(([0], np.cumsum(sizes[:-1], dtype=np.int64)))).tolist() if sizes else []
        read = asyncio.wrap_future(self._readers.submit(read_blocks, self._engine, segment, local, list(remote),
                                                        list(sizes)))
        try:
            rc = await asyncio.shield(read)
        except asyncio.CancelledError:
            await asyncio.wait([read])  # the engine may still be writing the slot: freed once it returns
            self.release(slot)
            raise
        if rc:
            self.release(slot)
            raise Unavailable(f"bulk: reading {len(local)} blocks from {segment} failed (Mooncake returned {rc})")
        return self._buffer.data[slot * self.slot_bytes:slot * self.slot_bytes + total], slot

    def release(self, slot: int) -> None:
        """The slot's bytes are stored (or dropped): it takes the next read."""
        self._free.append(slot)
        self._ready.release()

    def close(self) -> None:
        """Stop the read threads (after the server stopped taking calls)."""
        self._readers.shutdown(wait=True)


def read_blocks(engine: Any, segment: str, local: list[int], remote: list[int], sizes: list[int]) -> int:
    """The engine's batch read of each remote span into its local address (0: done): on a host short of
    cores submitted, slept through most of the time the engine's last reads took, then waited for
    (Mooncake's own wait polls, a core per read in flight: `transfer_bulk.SLEEP_SHARE`) by one read at a
    time (`_WAITING`); the reads themselves stay in flight together on the engine."""
    if not local:
        return 0
    if not SLEEP_SHARE:
        return int(engine.batch_transfer_sync_read(segment, local, remote, sizes))
    nbytes = sum(sizes)
    start = time.perf_counter()
    batch = engine.batch_transfer_async_read(segment, local, remote, sizes)
    if not batch:
        return -1
    time.sleep(SLEEP_SHARE * _PACE.get(id(engine), 0.0) * nbytes)
    with _WAITING:
        rc = int(engine.get_batch_transfer_status([batch]))
    pace = (time.perf_counter() - start) / max(nbytes, 1)
    _PACE[id(engine)] = min(pace, _PACE.get(id(engine), pace))
    return rc


#: Held by the one read whose end is waited for (Mooncake's wait polls a core). On a host short of cores, the
#: reads of several copies waited for at once (a receiver takes up to RECEIVER_SLOTS: two repairers' windows)
#: polled the cores the engine's io thread moves the bytes on: on the 2-core dev box, reads of 14.6 MB that take
#: 40-100 ms took 12-14 s with 8 waiting (a node joining, two senders). A read that ends while another is waited
#: for returns at once when its turn comes: the reads stay in flight together, only the polling is one at a time.
_WAITING = threading.Lock()
#: The fewest seconds a byte of a receiving engine's reads took, submit to done (by `id(engine)`): the least,
#: not the last, so neither a first read (its connection's handshake) nor reads queued behind each other on
#: the engine's one io thread make the next ones sleep past their end.
_PACE: dict[int, float] = {}
