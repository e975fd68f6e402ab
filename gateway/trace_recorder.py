"""The server's own access trace (`[trace]`, docs/CAPACITY.md "Recording"): one record per call, off the request path.

The services call `CallTrace`'s methods at the end of each call they trace (Lookup, Get,
Put, ReportResume, the SWA pool's Put and Get). With tracing off (`CallTrace`, the
default) each is an empty method. A `TraceRecorder` instead appends the call's facts to a
bounded queue and returns: building the line, hex-encoding the hashes and compressing
are done by its writer task on a thread, and the file is written through aiofiles, so no
call waits on the disk. A record may come from any thread (the SWA pool's shared-memory
sessions are served by their own threads, tiers.swa_shm_server): the queue and its
counters are kept under a lock, and a record from another thread wakes the writer through
`loop.call_soon_threadsafe` (an asyncio.Event may only be set on its loop). When the queue
is full (`queue_records`, `queue_bytes`: the writer fell behind, the disk is stalled) or a
write fails, records are dropped and
counted (`TraceStats.dropped_records`, the kvstore_trace_dropped_records series), never
a call.

Files (the format is kvstore/trace/recorded.py's) hold one zstd frame per batch the writer
takes from the queue; a new file starts when the current one would pass `file_bytes`, and
the oldest files of the folder go so that all of them stay within `max_bytes` (a batch
that cannot fit even then is dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os
import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.clock import Clock
from kvstore.config_sections import TraceSettings
from kvstore.prefix import HASH_BYTES, BlockScope
from kvstore.trace import recorded

log = logging.getLogger("kvstore.trace")

#: What a queued record is guessed to cost besides its hashes (the dict, the names).
RECORD_OVERHEAD_BYTES = 200
#: File names tried in turn when the next one is taken.
OPEN_TRIES = 100
#: Seconds `close` waits for the writer to drain before it drops what is left.
CLOSE_WAIT_S = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceStats:
    """The recorder's counters since the server started."""

    written_records: int = 0
    dropped_records: int = 0
    written_bytes: int = 0
    files_written: int = 0
    files_removed: int = 0
    queued_records: int = 0
    bytes_on_disk: int = 0


class CallTrace:
    """What the services tell the trace; this base records nothing (`[trace] enabled = false`)."""

    enabled = False

    def lookup(self, scope: BlockScope, hashes: Sequence[bytes], found: int, *, lease_ms: int = 0,
               swa_asked: int = 0, swa: tuple[int, int, int] | None = None) -> None:
        """A Lookup: the prompt's hashes, the blocks found, the lease asked, the SWA snapshot that serves it
        (index, T, R)."""

    def get(self, scope: BlockScope, hashes: Sequence[bytes], found: int) -> None:
        """A Get: the blocks asked and found (what a plan used)."""

    def put(self, scope: BlockScope, hashes: Sequence[bytes], *, written: int, existing: int,
            evicted_blocks: int, evicted_bytes: int) -> None:
        """A Put batch: its hashes, what was new and what was evicted for it."""

    def resume(self, scope: BlockScope, *, prompt_tokens: int, found_tokens: int, usable_tokens: int,
               action: str) -> None:
        """A planner's report of its plan (ReportResume)."""

    def swa_put(self, scope: BlockScope, keys: Sequence[bytes], *, stored: int, via: str = "grpc",
                t: float | None = None, snapshots: int | None = None) -> None:
        """An SWA pool Put of the snapshots `keys` (32 bytes each), `stored` of them taken; `via` "grpc" (SwaPool.Put),
        "shm" (a shared-memory session's COMMIT: called on that session's thread) or "redis-direct" (a client's
        put in Redis, reported by SwaPool.ReportDirect: at the client's time `t`, of `snapshots` snapshots, more
        than `keys` where the client cut them)."""

    def swa_get(self, scope: BlockScope, keys: Sequence[bytes], *, found: int, via: str = "grpc",
                t: float | None = None, snapshots: int | None = None) -> None:
        """An SWA pool Get of the snapshots `keys`, `found` of them served whole; `via`, `t` and `snapshots` as
        for `swa_put`."""

    def count_dropped(self, records: int) -> None:
        """Count `records` lost before they reached the recorder (a client's direct calls it could not keep)."""

    @property
    def stats(self) -> TraceStats:
        """Its counters (all 0 here)."""
        return TraceStats()


#: The services' trace while none is configured.
NO_TRACE = CallTrace()


class TraceRecorder(CallTrace):
    """Records calls into rotating zstd files in `folder` (see the module docstring).

    Args:
        settings: the `[trace]` section.
        folder: where the files go (`settings.path(data_dir)`).
        block_tokens: the store's tokens per block (written in each file's header).
        node: the store's id (in each header: whose trace it is).
        clock: the records' time (`now`).
        geometries: served geometries' names by fingerprint (a record names its geometry).
    """

    enabled = True

    def __init__(self, settings: TraceSettings, *, folder: Path, block_tokens: int, node: str, clock: Clock,
                 geometries: dict[bytes, str] | None = None) -> None:
        self.settings = settings
        self.geometries = geometries or {}
        self.folder = folder
        self.block_tokens = block_tokens
        self.node = node
        self.clock = clock
        #: Awaited before each write: lets a test stall the disk under the recorder (None: nothing).
        self.before_write: Callable[[], Awaitable[None]] | None = None
        self._queue: deque[tuple[dict[str, Any], bytes | None]] = deque()
        self._queued_bytes = 0
        # The queue, its bytes and the drop counter change on the loop (the services, the writer) and on
        # the shared-memory sessions' threads: check-then-append and take-then-clear must not interleave.
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._file: Any = None
        self._file_bytes = 0
        self._closed_files: deque[tuple[Path, int]] = deque()  # oldest first, with their sizes
        self._sequence = 0
        self._written = self._dropped = self._bytes = self._files = self._removed = 0
        self._compress: Callable[[bytes], bytes] | None = None
        self._path = folder
        self._written_here = False  # whether the open file holds a batch (a file holds at least one)

    async def start(self) -> None:
        """Make the folder, take stock of the files already there (they count toward `max_bytes`), start writing.

        Raises:
            OSError: the folder cannot be made or read.
        """
        import zstandard

        # A checksum per frame: a damaged file is an error when read, not wrong records.
        self._compress = zstandard.ZstdCompressor(level=self.settings.level, write_checksum=True).compress
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._closed_files.extend(await asyncio.to_thread(self._existing))
        self._task = asyncio.create_task(self._run(), name="kvstore-trace-writer")

    def _existing(self) -> list[tuple[Path, int]]:
        self.folder.mkdir(parents=True, exist_ok=True)
        files = recorded.trace_files(self.folder)
        for p in files:
            seq = p.name.split("-")[1] if p.name.count("-") >= 2 else ""
            if seq.isdigit():
                self._sequence = max(self._sequence, int(seq))
        return [(p, p.stat().st_size) for p in files]

    # -- the services' side: append and return ----------------------------------------------------

    def _full(self, cost: int) -> bool:
        s = self.settings
        return (len(self._queue) >= s.queue_records or self._queued_bytes + cost > s.queue_bytes
                or self._closing.is_set())

    def _add(self, record: dict[str, Any], hashes: Sequence[bytes] | None = None) -> None:
        """Queue `record` (any thread), or drop and count it when the queue is full or closing."""
        s = self.settings
        cost = RECORD_OVERHEAD_BYTES + s.hash_bytes * (len(hashes) if hashes is not None else 0)
        # Cut outside the lock (a long prompt's copy must not hold up another thread's record); a first look
        # without it spares the copy when the writer is plainly behind.
        packed = None if hashes is None or self._full(cost) else cut(hashes, s.hash_bytes)
        with self._lock:
            if (hashes is not None and packed is None) or self._full(cost):
                self._dropped += 1  # the writer is behind: the record goes, the call does not wait
                return
            wake = not self._queue  # the writer is woken once per batch, not per record
            self._queue.append((record, packed))
            self._queued_bytes += cost
        if not wake:
            return
        if self._loop is None or threading.get_ident() == self._loop_thread:
            self._wake.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server is gone, and the record too
                self._loop.call_soon_threadsafe(self._wake.set)

    def _take(self) -> list[tuple[dict[str, Any], bytes | None]]:
        """What is queued, leaving the queue empty (a record another thread adds meanwhile waits for the next)."""
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
        return batch

    def _drop(self, n: int) -> None:
        with self._lock:
            self._dropped += n

    def _head(self, op: str, scope: BlockScope) -> dict[str, Any]:
        fp = scope.fingerprint
        return {"t": self.clock.now(), "op": op, "tenant": scope.namespace,
                "geometry": self.geometries.get(fp) or fp.hex()}

    def lookup(self, scope: BlockScope, hashes: Sequence[bytes], found: int, *, lease_ms: int = 0,
               swa_asked: int = 0, swa: tuple[int, int, int] | None = None) -> None:
        """A Lookup: the prompt's hashes, the blocks found, the lease asked, the SWA snapshot that serves it
        (index, T, R)."""
        record = self._head("lookup", scope)
        record["found"] = found
        record["lease_ms"] = lease_ms
        if swa_asked:
            record["swa"] = {"asked": swa_asked, "found": swa is not None, "position": swa[1] if swa else 0,
                             "resume_tokens": swa[2] if swa else 0}
        self._add(record, hashes)

    def get(self, scope: BlockScope, hashes: Sequence[bytes], found: int) -> None:
        """A Get: the blocks asked and found (what a plan used)."""
        record = self._head("get", scope)
        record.update(blocks=len(hashes), found=found,
                      last=hashes[-1][:self.settings.hash_bytes].hex() if hashes else "")
        self._add(record)

    def put(self, scope: BlockScope, hashes: Sequence[bytes], *, written: int, existing: int,
            evicted_blocks: int, evicted_bytes: int) -> None:
        """A Put batch: its hashes, what was new and what was evicted for it."""
        record = self._head("put", scope)
        record.update(written=written, existing=existing, evicted_blocks=evicted_blocks, evicted_bytes=evicted_bytes)
        self._add(record, hashes)

    def resume(self, scope: BlockScope, *, prompt_tokens: int, found_tokens: int, usable_tokens: int,
               action: str) -> None:
        """A planner's report of its plan (ReportResume)."""
        record = self._head("resume", scope)
        record.update(prompt_tokens=prompt_tokens, found_tokens=found_tokens, usable_tokens=usable_tokens,
                      action=action)
        self._add(record)

    def swa_put(self, scope: BlockScope, keys: Sequence[bytes], *, stored: int, via: str = "grpc",
                t: float | None = None, snapshots: int | None = None) -> None:
        """An SWA pool Put of the snapshots `keys` (32 bytes each), `stored` of them taken; `via` "grpc" (SwaPool.Put),
        "shm" (a shared-memory session's COMMIT: called on that session's thread) or "redis-direct" (a client's
        put in Redis, reported by SwaPool.ReportDirect: at the client's time `t`, of `snapshots` snapshots, more
        than `keys` where the client cut them)."""
        record = self._swa_head("swa_put", scope, keys, via, t, snapshots)
        record.update(snapshots=len(keys) if snapshots is None else snapshots, stored=stored)
        self._add(record, keys)

    def swa_get(self, scope: BlockScope, keys: Sequence[bytes], *, found: int, via: str = "grpc",
                t: float | None = None, snapshots: int | None = None) -> None:
        """An SWA pool Get of the snapshots `keys`, `found` of them served whole; `via`, `t` and `snapshots` as
        for `swa_put`."""
        record = self._swa_head("swa_get", scope, keys, via, t, snapshots)
        record.update(asked=len(keys) if snapshots is None else snapshots, found=found)
        self._add(record, keys)

    def _swa_head(self, op: str, scope: BlockScope, keys: Sequence[bytes], via: str, t: float | None,
                  snapshots: int | None) -> dict[str, Any]:
        record = self._head(op, scope)
        if t is not None:
            record["t"] = t  # the client's clock: a direct call is reported after it was made
        record["via"] = via
        if snapshots is not None and snapshots > len(keys):
            record["keys_cut"] = snapshots - len(keys)  # the client sent the first keys only (`hashes` has those)
        return record

    def count_dropped(self, records: int) -> None:
        """Count `records` lost before they reached the recorder (a client's direct calls it could not keep)."""
        self._drop(records)

    @property
    def stats(self) -> TraceStats:
        """Its counters since start."""
        return TraceStats(written_records=self._written, dropped_records=self._dropped, written_bytes=self._bytes,
                          files_written=self._files, files_removed=self._removed, queued_records=len(self._queue),
                          bytes_on_disk=sum(n for _, n in self._closed_files) + self._file_bytes)

    # -- the writer --------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if not self._queue:
                if self._closing.is_set():
                    return
                self._wake.clear()
                continue
            if self.settings.flush_s and not self._closing.is_set():
                with contextlib.suppress(TimeoutError):  # gather a frame's worth (one per record compresses poorly)
                    await asyncio.wait_for(self._closing.wait(), self.settings.flush_s)
            if not self._closing.is_set():
                self._wake.clear()  # before the take: a record queued after it wakes the writer again
            batch = self._take()
            try:
                await self._write(batch)
            except Exception as exc:  # a full or failing disk: the batch goes, the writer goes on
                self._drop(len(batch))
                log.warning("trace: %d records dropped: %s", len(batch), exc,
                            exc_info=not isinstance(exc, OSError | _NoRoom))
                await self._close_file(cut=True)

    def _encode(self, batch: list[tuple[dict[str, Any], bytes | None]]) -> bytes:
        """One zstd frame of the batch's JSON lines (on a thread: O(hashes))."""
        lines = []
        for record, hashes in batch:
            line = json.dumps(record, separators=(",", ":"))
            if hashes is not None:  # hex needs no escaping: json.dumps would scan it, a long prompt's 100s of kB
                line = f'{line[:-1]},"hashes":"{hashes.hex()}"}}'
            lines.append(line.encode())
        lines.append(b"")
        assert self._compress is not None
        return self._compress(b"\n".join(lines))

    async def _write(self, batch: list[tuple[dict[str, Any], bytes | None]]) -> None:
        data = await asyncio.to_thread(self._encode, batch)
        if self.before_write is not None:
            await self.before_write()
        await self._room_for(len(data))
        await self._file.write(data)
        await self._file.flush()
        self._file_bytes += len(data)
        self._written_here = True
        self._bytes += len(data)
        self._written += len(batch)

    async def _room_for(self, size: int) -> None:
        """A file to write `size` bytes to, within `file_bytes` (rotating) and `max_bytes` (the oldest go).

        Raises:
            _NoRoom: the bytes do not fit under `max_bytes` even alone.
            OSError: a file cannot be opened or removed.
        """
        s = self.settings
        if self._file is not None and self._file_bytes + size > s.file_bytes and self._written_here:
            await self._close_file()
        if self._file is None:
            await self._open_file()
        while self._closed_files and self.stats.bytes_on_disk + size > s.max_bytes:
            path, _ = self._closed_files.popleft()
            with contextlib.suppress(FileNotFoundError):  # someone took it already: it no longer counts either way
                await aiofiles.os.remove(path)
            self._removed += 1
        if self.stats.bytes_on_disk + size > s.max_bytes:
            raise _NoRoom(f"a batch of {size:,} bytes does not fit under trace.max_bytes = {s.max_bytes:,}")

    async def _open_file(self) -> None:
        started = datetime.datetime.fromtimestamp(self.clock.now(), datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        head = recorded.header(block_tokens=self.block_tokens, hash_bytes=self.settings.hash_bytes, node=self.node,
                               started_s=self.clock.now())
        assert self._compress is not None
        data = self._compress(json.dumps(head).encode() + b"\n")
        for _ in range(OPEN_TRIES):
            self._sequence += 1
            path = self.folder / recorded.file_name(started, self._sequence)
            try:  # "x": never append to, nor truncate, a file someone else wrote
                self._file = await aiofiles.open(path, "xb")
                break
            except FileExistsError:
                continue  # a name taken since start (another writer in the folder): the next number
        else:
            raise OSError(f"no free trace file name in {self.folder} after {OPEN_TRIES} tries")
        self._path = path
        self._files += 1
        await self._file.write(data)
        self._file_bytes = len(data)
        self._written_here = False

    async def _close_file(self, *, cut: bool = False) -> None:
        """Close the open file; `cut`: after a failed write, first cut it back to its last whole frame, so
        that a write cut short leaves no damaged frame for readers to refuse."""
        if self._file is None:
            return
        f, self._file = self._file, None
        self._closed_files.append((self._path, self._file_bytes))
        good, self._file_bytes = self._file_bytes, 0
        try:
            await f.close()  # the file is closed even when flushing what a failed write left fails
        except OSError as exc:
            log.warning("trace: closing %s: %s", self._path, exc)
        if cut:
            try:
                await asyncio.to_thread(os.truncate, self._path, good)
            except OSError as exc:
                log.warning("trace: cutting %s back to its last whole frame: %s", self._path, exc)

    async def close(self) -> None:
        """Write what is queued (waiting at most CLOSE_WAIT_S for a stalled disk: then it is dropped), close."""
        self._closing.set()
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), CLOSE_WAIT_S)
            except TimeoutError:
                self._task.cancel()
                self._drop(len(self._take()))
                log.warning("trace: the writer did not finish within %g s: queued records dropped", CLOSE_WAIT_S)
        await self._close_file()


def cut(hashes: Sequence[bytes], width: int) -> bytes:
    """The first `width` bytes of each 32-byte hash, end to end.

    In C (a join, then numpy's strided copy: tens of microseconds for a million-token prompt), so the
    call that records pays little and the queue holds a quarter of the hashes' bytes at 8; a Python
    loop per hash would also hold the GIL against the event loop.
    """
    packed = getattr(hashes, "packed", None)  # tiers.chains.PackedHashes: already one bytes object
    if not isinstance(packed, bytes):
        packed = b"".join(hashes)
    if width >= HASH_BYTES or not packed:
        return packed
    return np.frombuffer(packed, dtype=_lead(width))["lead"].tobytes()


@functools.cache
def _lead(width: int) -> np.dtype[Any]:
    """A hash as one record of its first `width` bytes with a stride of 32: one copy per hash, not per byte."""
    return np.dtype({"names": ["lead"], "formats": [f"V{width}"], "itemsize": HASH_BYTES})


class _NoRoom(Exception):
    """A batch bigger than the folder's whole cap."""


def open_recorder(settings: TraceSettings, *, data_dir: Path, block_tokens: int, node: str, clock: Clock,
                  geometries: dict[bytes, str]) -> TraceRecorder | None:
    """The recorder `[trace]` asks for (not started), or None while it is off."""
    if not settings.enabled:
        return None
    return TraceRecorder(settings, folder=settings.path(data_dir), block_tokens=block_tokens, node=node, clock=clock,
                         geometries=geometries)


def trace_counters(trace: CallTrace) -> Any:
    """The recorder's counters as the Stats answer carries them (`kvstore.v1.TraceCounters`)."""
    from kvstore.v1 import kvstore_pb2 as pb

    s = trace.stats
    return pb.TraceCounters(enabled=trace.enabled, written_records=s.written_records,
                            dropped_records=s.dropped_records, written_bytes=s.written_bytes,
                            files_written=s.files_written, files_removed=s.files_removed,
                            queued_records=s.queued_records, bytes_on_disk=s.bytes_on_disk)


def trace_line(settings: TraceSettings, recorder: CallTrace) -> str:
    """What `kvstore serve` says of its trace at start."""
    if not isinstance(recorder, TraceRecorder):
        return "off ([trace] enabled = false)"
    return (f"recording to {recorder.folder} (files of {settings.file_bytes / 2**20:g} MiB, "
            f"{settings.max_bytes / 2**30:g} GiB in all, hashes cut to {settings.hash_bytes} bytes)")


class TraceCollector(Collector):
    """The kvstore_trace_* series: all 0 while the trace is off (docs/METRICS.md, "Trace")."""

    def __init__(self, trace: CallTrace) -> None:
        self.trace = trace

    def describe(self) -> list[Metric]:
        """Nothing: the values are read at each scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.trace.stats
        yield CounterMetricFamily("kvstore_trace_written_records", "Trace records written to the trace files.",
                                  value=s.written_records)
        yield CounterMetricFamily("kvstore_trace_dropped_records", "Trace records dropped because the writer fell "
                                  "behind (a full queue) or a write failed; the calls were answered.",
                                  value=s.dropped_records)
        yield CounterMetricFamily("kvstore_trace_written_bytes", "Compressed bytes written to the trace files.",
                                  value=s.written_bytes)
        yield CounterMetricFamily("kvstore_trace_written_files", "Trace files opened (a rotation at "
                                  "trace.file_bytes opens the next).", value=s.files_written)
        yield CounterMetricFamily("kvstore_trace_removed_files", "Trace files removed to stay under "
                                  "trace.max_bytes.", value=s.files_removed)
        yield GaugeMetricFamily("kvstore_trace_queued_records", "Trace records waiting for the writer.",
                                value=s.queued_records)
        yield GaugeMetricFamily("kvstore_trace_disk_bytes", "Bytes of the trace folder's files.",
                                value=s.bytes_on_disk)
