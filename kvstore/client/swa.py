"""The worker-side client of the SWA pool, reached as `Client.swa` on the client's connection.

Snapshot keys are computed here (kvstore.swa_snapshot), so a worker names a
snapshot by its tokens and position T (the prompt length it was taken at; its
size depends on T, `snapshot_bytes(T)`). Batches are split to fit the server's
message limit; a miss (never stored, expired, evicted, corrupt, backend down)
comes back as None, never as an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore import geometry as geometries
from kvstore.client import arguments
from kvstore.client.connection import ENVELOPE_BYTES, Connection
from kvstore.errors import InvalidArgument
from kvstore.prefix import ExtraKey
from kvstore.swa_snapshot import check_position, checksum, snapshot_bytes, snapshot_keys, snapshot_shape
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

Buffer = bytes | bytearray | memoryview
#: Longest TTL the wire carries (uint32 milliseconds); the server cuts any TTL to its own anyway.
_MAX_TTL_MS = 2**32 - 1


def _ttl_ms(ttl_s: Any) -> int:
    """Milliseconds of a requested TTL (0: the server's TTL), at least 1 for any positive TTL."""
    if ttl_s is None:
        return 0
    return min(max(math.ceil(arguments.seconds(ttl_s, "ttl_s") * 1000), 1), _MAX_TTL_MS)


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
    """

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._stub = pb_grpc.SwaPoolStub(connection.channel)
        self._geometry = geometries.resolve(connection.geometry)
        self._max_batch: int | None = None

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
        """Snapshot keys of `tokens` at each position (tokens before the snapshot point)."""
        c = self.connection
        positions = [arguments.integer(p, f"positions[{i}]") for i, p in enumerate(positions)]
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
        stored = failed = ttl_ms = 0
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

    def put(self, tokens: Sequence[int], data: Buffer | torch.Tensor, *, position: int | None = None,
            extra_keys: Sequence[ExtraKey] = (), ttl_s: float | None = None) -> SwaPutResult:
        """Store the snapshot of `tokens` at T = `position` (default: their end, len(tokens))."""
        t = len(tokens) if position is None else position
        return self.put_many([(self.key(tokens, t, extra_keys=extra_keys), t, data)], ttl_s=ttl_s)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Snapshots by key, in order; None where missing (checksums verified on both ends)."""
        keys = arguments.hashes(keys, "keys")
        out: list[bytes | None] = []
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
            extra_keys: Sequence[ExtraKey] = ()) -> bytes | None:
        """The snapshot of `tokens` at `position` (default: their end), or None."""
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
        """The pool's counters, hit rate inputs and usage against its cap."""
        return self.connection.call(self._stub.Stats, pb.SwaStatsRequest())
