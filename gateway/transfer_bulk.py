"""The bulk transport: blocks written by Mooncake's transfer engine straight into a client's memory.

A client whose regions this server cannot map (another host) fetches over gRPC
(`Transfer.Fetch`, its bytes in the reply) or, when both ends agree, over the bulk
transport (docs/TRANSFER.md "Bulk transport"):

1. `OpenBulk`: the client names its engine ("host:port"); the server answers yes,
   or no and why (`transfer.bulk` is off, Mooncake cannot run here).
2. `BulkFetch`: the server looks the blocks up, verifies each against its checksum
   and copies it into a staging slot (the native verify-copy loop, as Fetch), then
   its engine writes the found blocks to the client's addresses in one batch
   (`batch_transfer_sync_write`: RDMA where the hardware has it, TCP otherwise);
   the reply carries statuses only. No ack: the slot is free once the write returns.

Staging is bounded: `bulk_staging_bytes` cut into slots of `bulk_max_blocks` blocks;
a call waits for a free slot. The pool is allocated and registered at the first
accepted OpenBulk, so a server that never serves one pays nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.transfer_fetch import CORRUPT_REASON
from kvstore.config import TransferSettings
from kvstore.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvstore.transfer import DONE, FAILED, MISSING, SKIPPED, BatchResults
from tiers import blockcopy
from tiers.lmdb_tier import LmdbBlockTier

#: `blockcopy` result code -> transfer status code.
_CODES = bytes.maketrans(bytes([blockcopy.NOT_REACHED, blockcopy.FOUND, blockcopy.MISSING, blockcopy.CORRUPT]),
                         bytes([SKIPPED, DONE, MISSING, FAILED]))
#: A client engine's name: "host:port" (a host name, IPv4, or [IPv6]).
_SEGMENT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]{1,253}):([0-9]{1,5})$")


def engine_missing() -> str:
    """Why Mooncake's transfer engine cannot run in this process ("" when it can)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError, or its native library (libibverbs) failing to load
        return (f"mooncake-transfer-engine cannot run on the server ({type(exc).__name__}: {exc}); "
                "fix: apt-get install -y libibverbs1 && pip install mooncake-transfer-engine-non-cuda")
    return ""


def checked_segment(segment: str) -> str:
    """A client engine's name, checked to be "host:port".

    Raises:
        InvalidArgument: naming the value and the form.
    """
    match = _SEGMENT.match(segment)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise InvalidArgument(f"segment {segment[:64]!r} is not host:port (its engine's handshake port)")
    return segment


def peer_host(peer: str) -> str:
    """The host of a grpc peer ("ipv4:1.2.3.4:5678" -> "1.2.3.4", "ipv6:[::1]:5678" -> "::1"; else "")."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return rest.rpartition(":")[0].strip("[]")


def same_host(host: str, caller: str) -> bool:
    """Whether address `host` is the address `caller` (an IPv4-mapped IPv6 address is its IPv4
    address; any two loopback addresses are this host)."""
    try:
        a, b = ipaddress.ip_address(host), ipaddress.ip_address(caller)
    except ValueError:
        return False  # a name: only addresses are compared, never resolved
    a = getattr(a, "ipv4_mapped", None) or a
    b = getattr(b, "ipv4_mapped", None) or b
    return a == b or (a.is_loopback and b.is_loopback)


@dataclass(frozen=True, kw_only=True)
class BulkFetched:
    """A BulkFetch's results: statuses and failures per block (the bytes went by the engine)."""

    results: BatchResults
    found: int


class _Staging:
    """The registered staging pool and its free slots (each `slot_bytes`)."""

    def __init__(self, engine: Any, slots: int, slot_bytes: int) -> None:
        self.buffer = np.empty(slots * slot_bytes, dtype=np.uint8)  # pages committed as slots are used
        self.address = int(self.buffer.ctypes.data)
        self.slot_bytes = slot_bytes
        if engine.register_memory(self.address, self.buffer.nbytes):
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
        #: Session id -> the client engine's name, for sessions whose OpenBulk was accepted.
        self.segments: dict[str, str] = {}
        #: BulkFetch calls answered since start.
        self.fetches = 0
        self._engine: Any = None
        self._staging: _Staging | None = None
        self._start_lock = threading.Lock()
        # The engine's writes block for the time of a transfer: on threads of their own, one per
        # slot (what bounds them), so they never hold up asyncio.to_thread's other users.
        self._writers = ThreadPoolExecutor(self.slots, thread_name_prefix="kvstore-bulk-write")
        self._refused = "" if settings.bulk == "mooncake" else "transfer.bulk is off on this server"
        #: What OpenSession's first event offers: the transport named by `transfer.bulk`, if any.
        self.offered = [] if settings.bulk == "off" else [settings.bulk]

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
        if int(segment.rpartition(":")[2]) == self._engine.get_rpc_port():
            # Never its own engine: a write there could land in another call's staging slot.
            return f"segment {segment} names this server's own transfer engine"
        self.segments[session_id] = segment
        return ""

    def _start(self) -> None:
        """Import and start the engine and register the staging pool, once (P2P handshake: no
        metadata server)."""
        with self._start_lock:
            if self._engine is not None or self._refused:
                return
            self._refused = engine_missing()
            if self._refused:
                return
            from mooncake.engine import TransferEngine

            try:
                engine = TransferEngine()
                failed = engine.initialize(self.settings.bulk_host, "P2PHANDSHAKE", "tcp", "")
            except Exception as exc:  # the native engine's own errors: bulk stays off, gRPC serves
                failed, engine = f"{type(exc).__name__}: {exc}", None
            if failed:
                self._refused = f"the server's transfer engine did not start on {self.settings.bulk_host} ({failed})"
                return
            try:
                self._staging = _Staging(engine, self.slots, self.slot_bytes)
            except Unavailable as exc:
                self._refused = exc.message
                return
            self._engine = engine

    def close(self) -> None:
        """Stop the write threads (after the server stopped taking calls)."""
        self._writers.shutdown(wait=True)

    def forget(self, session_id: str) -> None:
        """The session ended: its engine is no longer written to."""
        self.segments.pop(session_id, None)

    def segment(self, session_id: str) -> str:
        """The session's client engine.

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

    async def fetch(self, tier: LmdbBlockTier, keys: list[bytes], segment: str, offsets: np.ndarray, address: int,
                    block_bytes: int, prefix_only: bool) -> BulkFetched:
        """Stage the blocks in a slot, write the found ones into the client's memory, restart their
        retention clocks durably (a failed refresh fails the call, as it fails a Get).

        Raises:
            Unavailable: the engine's write failed (the client falls back to gRPC).
        """
        staging = self._staging
        assert staging is not None and self._engine is not None  # a session has a segment only once started
        n = len(keys)
        async with staging.ready:
            slot = staging.free.pop()
            try:
                codes, due = await tier.call(_stage, tier, keys, staging.view(slot), block_bytes, prefix_only)
                touched = tier.touch_soon(due) if due else None
                found = np.flatnonzero(np.frombuffer(codes, dtype=np.uint8) == blockcopy.FOUND)
                if len(found):
                    base = staging.address + slot * staging.slot_bytes
                    local = (found * block_bytes + base).tolist()
                    remote = (offsets[found] + np.uint64(address)).tolist()
                    rc = await asyncio.get_running_loop().run_in_executor(
                        self._writers, self._engine.batch_transfer_sync_write, segment, local, remote,
                        [block_bytes] * len(local))
                    if rc:
                        raise Unavailable(f"bulk: writing {len(local)} blocks into {segment} failed "
                                          f"(Mooncake returned {rc})", hint="fetch over gRPC (Transfer.Fetch)")
            finally:
                staging.free.append(slot)
        if touched is not None:
            await asyncio.wrap_future(touched)
        results = BatchResults(n)
        results.statuses[:] = codes.translate(_CODES)
        for i in np.flatnonzero(np.frombuffer(codes, dtype=np.uint8) == blockcopy.CORRUPT).tolist():
            results.fail(i, "DATA_LOSS", CORRUPT_REASON)
        results.bytes_moved = len(found) * block_bytes
        self.fetches += 1  # on the event loop: no lock
        return BulkFetched(results=results, found=len(found))


def _stage(tier: LmdbBlockTier, keys: list[bytes], slot: memoryview, block_bytes: int, prefix_only: bool
           ) -> tuple[bytes, list[bytes]]:
    """Look `keys` up in one read txn and verify-copy them into the slot (on the tier's pool).

    Returns:
        A `blockcopy` code per key, and the keys of found blocks due a retention refresh.
    """
    dests: list[memoryview | None] = [slot[i * block_bytes:(i + 1) * block_bytes] for i in range(len(keys))]
    due: list[bytes] = []
    staged = tier.stage_reads(keys)
    try:
        codes = staged.copy(dests, prefix_only, touch_due=due)
    finally:
        staged.close()
        dests.clear()
    return codes, due
