"""The batches of a transfer session: `read`, `write`, `fetch` and `wait_all`.

`SessionBatches` is `kvstore.client.transfer.TransferSession`'s base: the session
module opens the session, registers its regions and negotiates its paths; this
one checks each batch's arguments and sends it down the path its regions take
(`fetch`'s lean request-ring path, `_ring_fast`, first). A base class rather than
an object the session holds, so `session.fetch` costs no extra call.

Every method raises a `kvstore.errors` class, never a bare ValueError or
TypeError: `InvalidArgument` for a bad argument (nothing sent).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvstore.client import arguments
from kvstore.client.blocks import encode_extra_keys
from kvstore.client.connection import Connection
from kvstore.client.transfer_bulk import BulkPath
from kvstore.client.transfer_path import Transfer, TransferPath, timeout
from kvstore.client.transfer_ring import NATIVE_ASK, RingClient, RingUnusable
from kvstore.client.transfer_shm import state_of
from kvstore.client.transfer_stream import StreamPath
from kvstore.errors import InvalidArgument, NotFound
from kvstore.prefix import HASH_BYTES, ExtraKey
from kvstore.region import Region
from kvstore.transfer import Descriptor, DescriptorGroup, Op, TransferState, group
from kvstore.v1 import transfer_pb2 as pb

_WHOLE, _BYTES = {HASH_BYTES}, {bytes}


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


def fetch_arguments(blocks: int, block_bytes: int, region: Region, offset_bytes: Any, batch_descriptors: Any,
                    prefix_only: Any) -> tuple[int, int]:
    """A fetch's `offset_bytes` and `batch_descriptors`, checked, and `prefix_only` checked to be a bool.

    Raises:
        InvalidArgument: a bad offset, batch size or flag, or `blocks` blocks that do not fit in `region`.
    """
    offset_bytes = arguments.integer(offset_bytes, "offset_bytes")
    batch_descriptors = arguments.integer(batch_descriptors, "batch_descriptors", least=1)
    if not isinstance(prefix_only, bool):
        raise InvalidArgument(f"prefix_only must be a bool, got {type(prefix_only).__name__}")
    if offset_bytes + blocks * block_bytes > region.size_bytes:
        raise InvalidArgument(f"{blocks} blocks of {block_bytes} bytes from offset {offset_bytes} do not fit "
                              f"in region {region.name} of {region.size_bytes} bytes")
    return offset_bytes, batch_descriptors


class SessionBatches:
    """A session's batches (the base of `TransferSession`, which sets every attribute below)."""

    connection: Connection
    regions: dict[int, Region]
    ring: RingClient | None
    bulk: BulkPath | None
    max_descriptors: int
    keep_finished: int
    max_session_descriptors: int
    _paths: dict[str, TransferPath]

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
        size = self.connection.block_bytes
        offset_bytes, batch_descriptors = fetch_arguments(len(hashes), size, region, offset_bytes, batch_descriptors,
                                                          prefix_only)
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
        try:  # natively where built: the list's items checked as they are written into the ring
            state = ring.fetch_list(hashes, region.region_id, offset_bytes, size, prefix_only)
        except RingUnusable:
            return None
        if state is not None or NATIVE_ASK:
            return state
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
