"""The worker-side client of the SWA pool, reached as `Client.swa` on the client's connection.

Snapshot keys are computed here (kvstore.swa_snapshot), so a worker names a
snapshot by its tokens and position T (the prompt length it was taken at; its
size depends on T, `snapshot_bytes(T)`). Batches are split to fit the server's
message limit; a miss (never stored, expired, evicted, corrupt, backend down)
comes back as None, never as an error.

Two paths (`path`, docs/SWA_POOL.md "Direct path"): through the gateway
(gRPC), or direct: in Redis with the ACL user the gateway hands out
(kvstore.client.swa_direct), or, with the embedded pool and a client on the
server's host, in the server's shared memory with the ticket the gateway hands
out (kvstore.client.swa_shm). "auto" (the default) goes direct when the server
offers it and falls back to the gateway when Redis cannot be reached or the
user was deleted (after re-opening once), trying direct again after
`RETRY_DIRECT_S`; "direct" raises instead of falling back; "gateway" never goes
direct. `last_path` says which path the last call took ("shm", "direct" for
Redis, "gateway"). Direct gets and puts in Redis are reported to the gateway
(SwaPool.ReportDirect, kvstore.client.swa_report: at most a second late, never
holding up a call; `flush_report()` sends at once) so its hit counters see
them, and, when the gateway records its access trace, each call with its keys;
the shared-memory server counts and traces its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore import geometry as geometries
from kvstore.client import arguments
from kvstore.client.connection import ENVELOPE_BYTES, Connection
from kvstore.client.fleet_chain import fleet_snapshot_keys
from kvstore.client.swa_direct import DirectPath
from kvstore.client.swa_report import MAX_CALL_KEYS, DirectReport
from kvstore.client.swa_shm import ShmPath
from kvstore.errors import InvalidArgument, KVStoreError, PermissionDenied, Unavailable
from kvstore.prefix import ExtraKey
from kvstore.swa_snapshot import check_position, checksum, snapshot_bytes, snapshot_keys, snapshot_shape
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

Buffer = bytes | bytearray | memoryview
#: The paths a SwaClient may take: "auto" (direct when offered, else the gateway), "direct", "gateway".
PATHS = ("auto", "direct", "gateway")
#: Seconds the "auto" path stays on the gateway after the direct path failed (or was not offered).
RETRY_DIRECT_S = 5.0
#: Longest TTL the wire carries (uint32 milliseconds); the server cuts any TTL to its own anyway.
_MAX_TTL_MS = 2**32 - 1


def _ttl_ms(ttl_s: Any) -> int:
    """Milliseconds of a requested TTL (0: the server's TTL), at least 1 for any positive TTL."""
    if ttl_s is None:
        return 0
    return min(max(math.ceil(arguments.seconds(ttl_s, "ttl_s") * 1000), 1), _MAX_TTL_MS)


def _kind(direct: DirectPath | ShmPath) -> str:
    """The `last_path` name of a direct path: "shm" or "direct" (Redis)."""
    return "shm" if isinstance(direct, ShmPath) else "direct"


@dataclass(frozen=True, kw_only=True)
class SwaPutResult:
    """What a put stored: `failed` snapshots were lost to an unreachable backend."""

    stored: int
    failed: int
    ttl_ms: int


class SwaClient:
    """SWA snapshots of one tenant and geometry, over a client's connection.

    Args:
        connection: the connection (its channel, tenant, geometry and chain root).
        path: "auto", "direct" or "gateway" (module doc).
        verify: on the shared-memory path, have the server copy and checksum each put snapshot as it
            is copied, so it is sealed when the put returns (kvstore.client.swa_shm.ShmPath; its gets
            check every copy against the server's checksum either way).
        clock: monotonic seconds (injected in tests).
        wall_clock: Unix seconds, the time of each direct call reported for the gateway's trace (injected in tests).

    Raises:
        InvalidArgument: an unknown path.
    """

    def __init__(self, connection: Connection, *, path: str = "auto", verify: bool = False,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self.connection = connection
        self._stub = pb_grpc.SwaPoolStub(connection.channel)
        self._geometry = geometries.resolve(connection.geometry)
        self._max_batch: int | None = None
        if path not in PATHS:
            raise InvalidArgument(f"path must be one of {', '.join(PATHS)}, got {path!r}")
        self.path = path
        self.verify = verify
        self.clock = clock
        #: "shm", "direct" (Redis) or "gateway": the path the last put or get took (None before the first).
        self.last_path: str | None = None
        #: Why the direct path is not in use, when it is not ('' while it is).
        self.direct_reason = ""
        self._direct: DirectPath | ShmPath | None = None
        self._retry_direct_at = 0.0
        self._report = DirectReport(connection, self._stub, clock, wall_clock)

    def snapshot_bytes(self, position: int) -> int:
        """Bytes of a snapshot at prompt length T = `position` in the client's geometry
        (kvstore.swa_snapshot.snapshot_bytes: 2,703,360 for an even T >= 128 on V4.1-Flash)."""
        return snapshot_bytes(self._geometry, arguments.integer(position, "position"))

    @property
    def _batch(self) -> int:
        """Most snapshots per call the server takes (asked once)."""
        if self._max_batch is None:
            self._max_batch = self.stats().max_batch_snapshots or 2**31
        return self._max_batch

    def _batches(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """[lo, hi) runs of items whose bytes fit a message, at most `_batch` items each (at least one)."""
        room = max(self.connection.max_message_bytes - ENVELOPE_BYTES, 1)
        runs: list[tuple[int, int]] = []
        lo = used = 0
        for i, size in enumerate(sizes):
            if i > lo and (used + size > room or i - lo >= self._batch):
                runs.append((lo, i))
                lo, used = i, 0
            used += size
        if lo < len(sizes):
            runs.append((lo, len(sizes)))
        return runs

    def keys(self, tokens: Sequence[int], positions: Sequence[int], *,
             extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        """Snapshot keys of `tokens` at each position (tokens before the snapshot point); through a gateway
        (GetInfo's run_blocks), anchored on the fleet's hashes as a fleet client's are (docs/FLEET.md F45, F52)."""
        c = self.connection
        positions = [arguments.integer(p, f"positions[{i}]") for i, p in enumerate(positions)]
        if c.run_blocks:
            return fleet_snapshot_keys(tokens, positions, root=c.root, block_tokens=c.block_tokens,
                                       run_blocks=c.run_blocks, extra_keys=extra_keys)
        return snapshot_keys(tokens, positions, block_tokens=c.block_tokens, root=c.root,
                             extra_keys=arguments.extra_keys(extra_keys))

    def key(self, tokens: Sequence[int], position: int | None = None, *,
            extra_keys: Sequence[ExtraKey] = ()) -> bytes:
        """The key of one snapshot; `position` defaults to the end of `tokens`."""
        if position is None:
            position = len(tokens)
        return self.keys(tokens, [position], extra_keys=extra_keys)[0]

    def put_many(self, items: Sequence[tuple[bytes, int, Buffer | torch.Tensor]], *,
                 ttl_s: float | None = None) -> SwaPutResult:
        """Store (key, position, snapshot) triples; each lives `ttl_s` (default and most: the server's TTL).

        `position` is T, the prompt length the snapshot was taken at (the position
        its key was computed for); the server checks the snapshot has T's size. A
        snapshot is bytes (or another buffer, a uint8 numpy array), or a uint8
        tensor (`kvstore.codec.snapshot.join_snapshot` builds one).

        Raises:
            InvalidArgument: a snapshot of the wrong size or type, a bad key or
                position, or a ttl_s that is not a finite number of seconds above 0
                (nothing stored).
        """
        ttl = _ttl_ms(ttl_s)
        if isinstance(items, str | bytes | bytearray | memoryview):
            raise InvalidArgument(f"items must be a sequence of (key, position, snapshot) triples, "
                                  f"got {type(items).__name__}")
        triples = []
        for i, item in enumerate(items):
            if not isinstance(item, tuple | list) or len(item) != 3:
                raise InvalidArgument(f"items[{i}] must be a (key, position, snapshot) triple, "
                                      f"got {type(item).__name__}")
            key = arguments.one_hash(item[0], f"items[{i}] key")
            position = check_position(arguments.integer(item[1], f"items[{i}] position"))
            # Its size: the server checks it against T.
            triples.append((key, position, arguments.buffer(item[2], f"items[{i}] snapshot")))
        return self._via(lambda d: self._put_direct(d, triples, ttl), lambda: self._put_gateway(triples, ttl),
                         write=True)

    def _put_gateway(self, triples: list[tuple[bytes, int, bytes]], ttl: int) -> SwaPutResult:
        stored = failed = ttl_ms = 0
        for lo, hi in self._batches([len(data) for _, _, data in triples]):
            request = pb.SwaPutRequest(geometry=self.connection.geometry, namespace=self.connection.namespace,
                                       ttl_ms=ttl)
            for key, position, data in triples[lo:hi]:
                # Filled in place: a snapshot built apart is copied again into its request.
                snap = request.snapshots.add()
                snap.key, snap.position, snap.data, snap.checksum = key, position, data, checksum(data)
            reply = self.connection.call(self._stub.Put, request)
            stored, failed, ttl_ms = stored + reply.stored, failed + reply.failed, reply.ttl_ms
        return SwaPutResult(stored=stored, failed=failed, ttl_ms=ttl_ms)

    def _put_direct(self, direct: DirectPath | ShmPath, triples: list[tuple[bytes, int, bytes]],
                    ttl: int) -> SwaPutResult:
        if isinstance(direct, ShmPath):
            put_bytes = sum(direct.put_many(triples[lo:lo + direct.max_batch], ttl)
                            for lo in range(0, len(triples), direct.max_batch))
        else:
            put_bytes = direct.put_many(triples, ttl)
        if not isinstance(direct, ShmPath):  # the server counts and traces shared-memory puts itself
            keys = [key for key, _, _ in triples[:MAX_CALL_KEYS]] if direct.trace_calls else None
            self._report.put(len(triples), put_bytes, keys)
        return SwaPutResult(stored=len(triples), failed=0, ttl_ms=min(ttl, direct.ttl_ms) if ttl else direct.ttl_ms)

    def put(self, tokens: Sequence[int], data: Buffer | torch.Tensor, *, position: int | None = None,
            extra_keys: Sequence[ExtraKey] = (), ttl_s: float | None = None) -> SwaPutResult:
        """Store the snapshot of `tokens` at T = `position` (default: their end, len(tokens))."""
        t = len(tokens) if position is None else position
        return self.put_many([(self.key(tokens, t, extra_keys=extra_keys), t, data)], ttl_s=ttl_s)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """Snapshots by key, in order; None where missing (checksums verified on both ends).

        Through the gateway a snapshot is bytes; on the direct path a read-only memoryview
        over the record Redis returned (no copy; valid for as long as it is held).
        """
        keys = arguments.hashes(keys, "keys")
        return self._via(lambda d: self._get_direct(d, keys), lambda: self._get_gateway(keys), write=False)

    def _get_direct(self, direct: DirectPath | ShmPath, keys: list[bytes]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = []
        if isinstance(direct, ShmPath):  # the server counts shared-memory gets itself
            for lo in range(0, len(keys), direct.max_batch):
                out.extend(direct.get_many(keys[lo:lo + direct.max_batch]).data)
            return out
        for lo in range(0, len(keys), self._batch):
            batch = keys[lo:lo + self._batch]
            got = direct.get_many(batch)
            self._report.got(len(got.data), sum(d is not None for d in got.data), got.corrupt,
                             batch if direct.trace_calls else None)
            out.extend(got.data)
        return out

    def _get_gateway(self, keys: list[bytes]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = []
        for lo, hi in self._batches([self._largest] * len(keys)):
            reply = self.connection.call(self._stub.Get, pb.SwaGetRequest(
                geometry=self.connection.geometry, namespace=self.connection.namespace, keys=keys[lo:hi]))
            for r in reply.results:
                data = r.data if r.status == pb.SWA_STATUS_FOUND else None  # each read of the field copies it
                out.append(data if data is not None and checksum(data) == r.checksum else None)
        return out

    @property
    def _largest(self) -> int:
        """Bytes of the largest snapshot: a full window and a tail (an odd T >= window)."""
        window = snapshot_shape(self._geometry).window
        return snapshot_bytes(self._geometry, window | 1)

    def get(self, tokens: Sequence[int], position: int | None = None, *,
            extra_keys: Sequence[ExtraKey] = ()) -> bytes | memoryview | None:
        """The snapshot of `tokens` at `position` (default: their end), or None (`get_many`: its type)."""
        return self.get_many([self.key(tokens, position, extra_keys=extra_keys)])[0]

    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Drop snapshots by key; how many existed."""
        keys = arguments.hashes(keys, "keys")
        if not keys:
            raise InvalidArgument("keys is empty")
        deleted = 0
        for start in range(0, len(keys), self._batch):
            reply = self.connection.call(self._stub.Delete, pb.SwaDeleteRequest(
                geometry=self.connection.geometry, namespace=self.connection.namespace,
                keys=keys[start:start + self._batch]))
            deleted += reply.deleted
        return deleted

    def stats(self) -> pb.SwaStatsResponse:
        """The pool's counters, hit rate inputs and usage against its cap (direct gets reported first)."""
        self.flush_report()
        return self.connection.call(self._stub.Stats, pb.SwaStatsRequest())

    # -- the direct path ---------------------------------------------------

    def _via(self, direct_op: Callable[[Any], Any], gateway_op: Callable[[], Any], *, write: bool) -> Any:
        """Run `direct_op` on the direct path when it is in use (re-opening it once on a failure),
        else, or when it fails again, `gateway_op` ("direct": raise instead)."""
        direct = self._direct_path()
        if direct is not None and write and not direct.writable:
            direct = None  # a read-only user (a byte quota): writes go through the gateway's ledger
        if direct is not None:
            try:
                result = direct_op(direct)
                self.last_path = _kind(direct)
                return result
            except (Unavailable, PermissionDenied) as first:
                reopened = self._reopen()
                try:
                    if reopened is None:
                        raise first
                    result = direct_op(reopened)
                    self.last_path = _kind(reopened)
                    return result
                except (Unavailable, PermissionDenied) as exc:
                    self._drop_direct(f"{exc.message}")
                    if self.path == "direct":
                        raise
        elif self.path == "direct":
            raise Unavailable(f"the SWA direct path is not available: {self.direct_reason}",
                              hint='use path="auto" to fall back to the gateway')
        self.last_path = "gateway"
        return gateway_op()

    def _direct_path(self) -> DirectPath | ShmPath | None:
        """The direct path to use now (opened or renewed when due), or None for the gateway."""
        if self.path == "gateway":
            return None
        direct = self._direct
        if direct is not None and not direct.due:
            return direct
        if direct is None and self.clock() < self._retry_direct_at:
            return None
        return self._reopen()

    def _reopen(self) -> DirectPath | ShmPath | None:
        """Ask the gateway for a (newer) user; None when it offers none or cannot be asked."""
        try:
            reply = self.connection.call(self._stub.OpenDirect, pb.SwaOpenDirectRequest(
                geometry=self.connection.geometry))
        except KVStoreError as exc:
            self._drop_direct(f"OpenDirect failed: {exc.message}")
            return None
        if not reply.offered or self.connection.namespace not in ("", reply.tenant):
            self._drop_direct(reply.reason or f"the direct user is the token's tenant {reply.tenant!r}'s, "
                              f"not namespace {self.connection.namespace!r}'s")
            return None
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if reply.shm_socket:
            try:
                self._direct = ShmPath(reply, geometry=self._geometry, timeout_s=self.connection.timeout_s,
                                       verify=self.verify, clock=self.clock)
            except KVStoreError as exc:  # another host, another network namespace, a refused ticket
                self._drop_direct(f"the shared-memory path is not usable from here: {exc.message}")
                return None
            self.direct_reason = ""
            return self._direct
        self._direct = DirectPath(reply, fingerprint=self.connection.fingerprint, geometry=self._geometry,
                                  timeout_s=self.connection.timeout_s, clock=self.clock)
        self.direct_reason = ""
        return self._direct

    def _drop_direct(self, reason: str) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        self.direct_reason = reason
        self._retry_direct_at = self.clock() + RETRY_DIRECT_S

    def flush_report(self) -> None:
        """Send the direct path's pending gets and puts to the gateway's counters now, and wait.

        A report the gateway cannot take now is kept for the next one; one it refuses for good is dropped
        and counted (`reports_dropped`). Neither is raised: counting is not worth failing a get for.
        """
        self._report.flush()

    @property
    def reports_dropped(self) -> int:
        """Direct-path reports the gateway refused for good (a non-retryable error, logged): dropped, not
        sent again, so the reports after them still arrive (kvstore.client.swa_report)."""
        return self._report.dropped

    def close(self) -> None:
        """Report what is pending and close the direct path's Redis connections."""
        self.flush_report()
        if self._direct is not None:
            self._direct.close()
            self._direct = None
