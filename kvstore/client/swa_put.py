"""A direct put's records streamed to one Redis, each sealed in place and renamed to its key.

The record header holds the snapshot's xxh3 and comes first, so a record is sent
under a placeholder header to a temporary key of its own, then sealed and renamed,
all pipelined on one connection (docs/SWA_POOL.md "Direct path"):

    SET <key>~<call token>.<i> <PLACEHOLDER_HEADER + snapshot> PX px
    SETRANGE <that key> 0 <header>
    RENAME <that key> <key>        (RENAME keeps the PX)

The checksum is the one pass over the snapshot a raw SET does not make. Two ways
to pay it (`put_records(overlap=...)`):

- **overlapped** (hosts with `OVERLAP_MIN_CPUS` or more CPUs): a worker thread
  checksums the batch's snapshots (kvstore.native.swa_digest: without the GIL) while this
  thread sends them; a record's SETRANGE and RENAME go out as soon as its
  checksum is there (after a later record's SET when it is not yet), so on a
  host with a spare core the checksum costs the put nothing;
- **streamed** (fewer CPUs): each 1 MiB piece is checksummed on this thread just
  after it is sent, while it is still partly in cache. On two cores, where Redis
  and the loopback work already fill the second core, a worker thread only
  competed with them (docs/SWA_POOL.md has the figures).

Either way every reply is read (the connection stays in step) and a record any of
whose commands was refused is removed from where it got to.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from kvstore.native import swa_digest
from kvstore.swa_snapshot import HEADER_BYTES, PLACEHOLDER_HEADER, seal

#: A streamed put's piece: sent, then checksummed while it is still in cache (a core's L2 holds
#: 1-2 MiB on today's servers).
STREAM_CHUNK_BYTES = 1 << 20
#: Overlap the checksum with the send (a worker thread) from this many usable CPUs: below it,
#: the worker has no idle core to run on (measured on a 2-core host: docs/SWA_POOL.md).
OVERLAP_MIN_CPUS = 4
#: Command slots of a record, in the order its replies are read into.
SET, SETRANGE, RENAME = 0, 1, 2


def pack(*args: bytes) -> bytes:
    """One command in RESP (small arguments)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%b\r\n" % (len(a), a) for a in args)


def _reply(conn: Any) -> Any:
    """The next reply on `conn`, an error reply returned (as a ResponseError), not raised."""
    try:
        return conn.read_response()
    except ResponseError as exc:
        return exc


class Checksums:
    """The checksums of one batch's snapshots, filled in order by the worker thread."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = list(views)
        self.values: list[int | None] = [None] * len(self.views)
        self.error: BaseException | None = None
        self.cancelled = False
        self._done = [threading.Event() for _ in self.views]

    def ready(self, i: int) -> bool:
        """Whether snapshot i's checksum (or the worker's failure) is in."""
        return self._done[i].is_set()

    def wait(self, i: int) -> int:
        """Snapshot i's checksum, once the worker has it (its failure raised)."""
        self._done[i].wait()
        if self.error is not None:
            raise self.error
        value = self.values[i]
        assert value is not None
        return value

    def run(self) -> None:
        """Checksum each snapshot in order (the worker's side; the GIL is let go over each)."""
        try:
            for i, view in enumerate(self.views):
                if self.cancelled:
                    break
                self.values[i] = swa_digest.digest(view)
                self._done[i].set()
        except BaseException as exc:  # handed to the sender, which raises it
            self.error = exc
        finally:
            self.views = []  # the caller's buffers are not held past the batch
            for done in self._done:
                done.set()


class _Worker:
    """One daemon thread per process that checksums batches in turn (made on first use)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Checksums] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, views: Sequence[memoryview]) -> Checksums:
        job = Checksums(views)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="kvstore-swa-checksum", daemon=True)
                self._thread.start()
        self._jobs.put(job)
        return job

    def _serve(self) -> None:
        while True:
            self._jobs.get().run()


_WORKER = _Worker()


def put_records(conn: Any, *, fingerprint: bytes, px: int, token: bytes, targets: Sequence[bytes],
                records: Sequence[tuple[int, Any]], overlap: bool) -> ResponseError | None:
    """Send each (T, snapshot) sealed to its target key (see the module docstring), read every reply,
    remove each refused record; the first refusal, or None. A failure to write or read (the connection
    is then out of step) is raised for the caller to disconnect."""
    ttl = b"%d" % px
    tail = b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl)
    temps = [target + b"~%b.%d" % (token, i) for i, target in enumerate(targets)]
    views = [memoryview(data).cast("B") for _, data in records]
    order: list[tuple[int, int]] = []  # (record, slot) of each command sent, in order: how replies are read

    def seal_cmds(i: int, checksum: int) -> bytes:
        order.extend(((i, SETRANGE), (i, RENAME)))
        header = seal(fingerprint, records[i][0], b"", checksum)
        return pack(b"SETRANGE", temps[i], b"0", header) + pack(b"RENAME", temps[i], targets[i])

    def head(i: int) -> bytes:
        order.append((i, SET))
        return b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (
            len(temps[i]), temps[i], HEADER_BYTES + len(views[i]), PLACEHOLDER_HEADER)

    pending = b""
    if overlap:
        sums = _WORKER.submit(views)
        sealed = 0  # records before this one have their SETRANGE and RENAME sent
        try:
            for i, view in enumerate(views):
                pending += head(i)
                for start in range(0, len(view), STREAM_CHUNK_BYTES):
                    piece = view[start:start + STREAM_CHUNK_BYTES]
                    conn.send_packed_command([pending, piece] if pending else [piece], False)
                    pending = b""
                pending = tail
                while sealed <= i and sums.ready(sealed):  # in record order, as soon as each is known
                    pending += seal_cmds(sealed, sums.wait(sealed))
                    sealed += 1
            for i in range(sealed, len(views)):
                pending += seal_cmds(i, sums.wait(i))
        finally:
            sums.cancelled = True
    else:
        for i, view in enumerate(views):
            pending += head(i)
            digest = swa_digest.hasher()
            for start in range(0, len(view), STREAM_CHUNK_BYTES):
                piece = view[start:start + STREAM_CHUNK_BYTES]
                conn.send_packed_command([pending, piece] if pending else [piece], False)
                digest.update(piece)  # after the send, whose copy left the piece partly in cache
                pending = b""
            pending = tail + seal_cmds(i, digest.intdigest())
    conn.send_packed_command([pending], False)
    return _settle(conn, order, temps, targets)


def _settle(conn: Any, order: Sequence[tuple[int, int]], temps: Sequence[bytes],
            targets: Sequence[bytes]) -> ResponseError | None:
    """Read the reply of each command in `order` (every one, so the connection stays in step) and
    remove each record a command of which was refused from where it got to (the target when its
    RENAME went through, else the temporary key) with an empty value that expires at once; the first
    refusal, or None."""
    replies: list[list[Any]] = [[None, None, None] for _ in temps]
    for i, slot in order:
        replies[i][slot] = _reply(conn)
    refused, cleanup = None, []
    for temp, target, got in zip(temps, targets, replies, strict=True):
        # "no such key": the temporary key expired (a PX shorter than the send) or was evicted: stored, then gone.
        errors = [r for r in got if isinstance(r, ResponseError) and str(r) != "no such key"]
        if errors:
            refused = refused or errors[0]
            renamed = not isinstance(got[RENAME], ResponseError)
            cleanup.append(pack(b"SET", target if renamed else temp, b"", b"PX", b"1"))
    if cleanup:
        conn.send_packed_command([b"".join(cleanup)], False)
        for _ in cleanup:
            _reply(conn)
    return refused
