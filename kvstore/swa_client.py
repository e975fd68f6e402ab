"""The worker-side client of the SWA pool, reached as `Client.swa` on the client's channel.

Snapshot keys are computed here (kvstore.swa_snapshot), so a worker names a
snapshot by its tokens and position. Batches are split to fit the server's
message limit; a miss (never stored, expired, evicted, corrupt, backend down)
comes back as None, never as an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore import arguments
from kvstore import geometry as geometries
from kvstore.errors import InvalidArgument
from kvstore.prefix import ExtraKey
from kvstore.swa_snapshot import checksum, snapshot_bytes, snapshot_keys
from kvstore.v1 import swa_pb2 as pb
from kvstore.v1 import swa_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

    from kvstore.client import Client

Buffer = bytes | bytearray | memoryview
#: Room left in a message for everything that is not snapshot bytes.
_ENVELOPE_BYTES = 1 << 20
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
    """SWA snapshots of one tenant and geometry, over a `Client`'s channel.

    Args:
        client: the connected client (its channel, tenant, geometry and chain root).
    """

    def __init__(self, client: Client) -> None:
        self._client = client
        self._stub = pb_grpc.SwaPoolStub(client._channel)
        #: Bytes of one snapshot of the client's geometry.
        self.snapshot_bytes: int = snapshot_bytes(geometries.resolve(client.geometry))
        self._batch_size: int | None = None

    @property
    def _batch(self) -> int:
        """Snapshots per call: what fits a message, and no more than the server takes (asked once)."""
        if self._batch_size is None:
            by_bytes = max((self._client.max_message_bytes - _ENVELOPE_BYTES) // self.snapshot_bytes, 1)
            self._batch_size = min(by_bytes, self.stats().max_batch_snapshots or by_bytes)
        return self._batch_size

    def keys(self, tokens: Sequence[int], positions: Sequence[int], *,
             extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        """Snapshot keys of `tokens` at each position (tokens before the snapshot point)."""
        c = self._client
        positions = [arguments.integer(p, f"positions[{i}]") for i, p in enumerate(positions)]
        return snapshot_keys(tokens, positions, block_tokens=c.block_tokens, root=c.root,
                             extra_keys=arguments.extra_keys(extra_keys))

    def key(self, tokens: Sequence[int], position: int | None = None, *,
            extra_keys: Sequence[ExtraKey] = ()) -> bytes:
        """The key of one snapshot; `position` defaults to the end of `tokens`."""
        if position is None:
            position = len(tokens)
        return self.keys(tokens, [position], extra_keys=extra_keys)[0]

    def put_many(self, items: Sequence[tuple[bytes, Buffer | torch.Tensor]], *,
                 ttl_s: float | None = None) -> SwaPutResult:
        """Store (key, snapshot) pairs; each lives `ttl_s` (default and most: the server's TTL).

        A snapshot is bytes (or another buffer, a uint8 numpy array), or the uint8
        tensor `kvstore.codec.fp8.encode_snapshot` returns.

        Raises:
            InvalidArgument: a snapshot of the wrong size or type, a bad key, or a
                ttl_s that is not a finite number of seconds above 0 (nothing stored).
        """
        stored = failed = ttl_ms = 0
        ttl = _ttl_ms(ttl_s)
        if isinstance(items, str | bytes | bytearray | memoryview):
            raise InvalidArgument(f"items must be a sequence of (key, snapshot) pairs, got {type(items).__name__}")
        pairs = []
        for i, item in enumerate(items):
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise InvalidArgument(f"items[{i}] must be a (key, snapshot) pair, got {type(item).__name__}")
            key = arguments.one_hash(item[0], f"items[{i}] key")
            pairs.append((key, arguments.buffer(item[1], f"items[{i}] snapshot")))  # its size: the server checks
        for start in range(0, len(pairs), self._batch):
            request = pb.SwaPutRequest(geometry=self._client.geometry, namespace=self._client.namespace, ttl_ms=ttl)
            for key, buffer in pairs[start:start + self._batch]:
                # Filled in place: a snapshot built apart is copied again into its request.
                snap = request.snapshots.add()
                snap.key, snap.data, snap.checksum = key, buffer, checksum(buffer)
            reply = self._client._call(self._stub.Put, request)
            stored, failed, ttl_ms = stored + reply.stored, failed + reply.failed, reply.ttl_ms
        return SwaPutResult(stored=stored, failed=failed, ttl_ms=ttl_ms)

    def put(self, tokens: Sequence[int], data: Buffer | torch.Tensor, *, position: int | None = None,
            extra_keys: Sequence[ExtraKey] = (), ttl_s: float | None = None) -> SwaPutResult:
        """Store the snapshot of `tokens` at `position` (default: their end)."""
        return self.put_many([(self.key(tokens, position, extra_keys=extra_keys), data)], ttl_s=ttl_s)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Snapshots by key, in order; None where missing (checksums verified on both ends)."""
        keys = arguments.hashes(keys, "keys")
        out: list[bytes | None] = []
        for start in range(0, len(keys), self._batch):
            reply = self._client._call(self._stub.Get, pb.SwaGetRequest(
                geometry=self._client.geometry, namespace=self._client.namespace,
                keys=keys[start:start + self._batch]))
            for r in reply.results:
                data = r.data if r.status == pb.SWA_STATUS_FOUND else None  # each read of the field copies it
                out.append(data if data is not None and checksum(data) == r.checksum else None)
        return out

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
            reply = self._client._call(self._stub.Delete, pb.SwaDeleteRequest(
                geometry=self._client.geometry, namespace=self._client.namespace,
                keys=keys[start:start + self._batch]))
            deleted += reply.deleted
        return deleted

    def stats(self) -> pb.SwaStatsResponse:
        """The pool's counters, hit rate inputs and usage against its cap."""
        return self._client._call(self._stub.Stats, pb.SwaStatsRequest())
