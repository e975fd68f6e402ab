"""What an SWA snapshot is: its size, its key, the resume lengths it serves, and the record a pool stores.

A snapshot at prompt length T is the model's resume state (docs/SWA_POOL.md,
docs/FORMAT.md "State needed to resume"):

- the window rows of positions [max(0, T - window), T) for every layer, in layer
  order, each layer's rows in position order (`window_row_bytes` each: 528 B
  for V4.1-Flash, 512 E4M3 + 16 UE8M0);
- when T is odd, the raw compressor tail of each ratio-2 source layer, in layer
  order: the last token's float32 kv[head_dim] then float32 score[head_dim],
  little-endian.

T and the geometry are not in the bytes: they are in the key (its position) and
in the record's header, so the server checks a snapshot's size from T.

Its key names that position exactly, so a snapshot may be taken at a block
boundary or inside a block:

    key = SHA-256("kvstore.swa.v1" | anchor | u32 partial count | u32 token ids |
                  extra keys (kvstore.prefix canonical bytes) | u64 position)

where `anchor` is the chain hash of the last full block before the position (or
the chain root when the position is inside the first block) and the partial
tokens are those after that block, up to the position. The anchor covers the
geometry fingerprint, the block size, every earlier token and the extra keys, so
two snapshots share a key only when they describe the same prefix. All integers
are unsigned little-endian, as in kvstore.prefix; never Python's `hash()`.

This module is torch-free: the server sizes and checks snapshots without the
codec (kvstore.codec.snapshot builds and splits them).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry
from kvstore.prefix import FINGERPRINT_BYTES, HASH_BYTES, ExtraKey, chain_hashes, encode_extra_keys, token_bytes

#: Record header: magic, format version, geometry fingerprint, position T, xxh3-64 of the data,
#: then xxh3-64 of those fields (so a damaged T is caught like damaged data).
_FIELDS = struct.Struct("<4sB8sQQ")
_HEADER = struct.Struct(f"<{_FIELDS.size}sQ")
_MAGIC = b"SWA2"
_VERSION = 2
HEADER_BYTES = _HEADER.size
#: Bytes of one float32 of the raw tail.
TAIL_ITEM_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class SnapshotShape:
    """The sizes a geometry gives its snapshots.

    Attributes:
        layers: layers that keep window rows (every layer).
        window: sliding-window tokens.
        row_bytes: bytes of one window row.
        ratio2_layers: source layers with compress ratio 2 (a raw tail each at odd T).
        tail_channels: float32 channels of the kv and of the score of one tail (head_dim).
    """

    layers: int
    window: int
    row_bytes: int
    ratio2_layers: tuple[int, ...]
    tail_channels: int

    @property
    def tail_bytes(self) -> int:
        """Bytes of the raw tail at an odd T: ratio-2 layers x (kv + score) x channels x 4."""
        return len(self.ratio2_layers) * 2 * self.tail_channels * TAIL_ITEM_BYTES

    def window_positions(self, position: int) -> int:
        """Window rows per layer in a snapshot at `position`: min(T, window)."""
        return min(position, self.window)


def snapshot_shape(geometry: ModelGeometry) -> SnapshotShape:
    """The snapshot sizes of `geometry` (the one place they are read from it)."""
    return SnapshotShape(layers=geometry.num_layers, window=geometry.window, row_bytes=geometry.window_row_bytes,
                         ratio2_layers=tuple(geometry.ratio2_source_layers), tail_channels=geometry.head_dim)


def check_position(position: object) -> int:
    """`position` as a snapshot length T (an integer in [1, 2**64)).

    Raises:
        InvalidArgument: not an integer, or outside that range (a snapshot holds at least one position).
    """
    if not isinstance(position, int) or isinstance(position, bool):
        raise InvalidArgument(f"snapshot position must be an integer, got {type(position).__name__}")
    if not 1 <= position < 2**64:
        raise InvalidArgument(f"snapshot position must be in [1, 2**64): a snapshot holds at least one "
                              f"position; got {position}")
    return position


def snapshot_bytes(geometry: ModelGeometry, position: int) -> int:
    """Bytes of the snapshot at prompt length T = `position`: the one place its size is computed.

    layers x min(T, window) x window_row_bytes, plus the raw tail (ratio-2 source
    layers x 2 x head_dim x 4) when T is odd: 2,703,360 B for an even T >= 128 on
    V4.1-Flash, 2,715,648 B for an odd one.

    Raises:
        InvalidArgument: `position` is not a valid T (check_position).
    """
    t = check_position(position)
    shape = snapshot_shape(geometry)
    return shape.layers * shape.window_positions(t) * shape.row_bytes + (shape.tail_bytes if t % 2 else 0)


# -- resume rules ----------------------------------------------------------------

def serves(geometry: ModelGeometry, position: int, resume: int) -> bool:
    """Whether the snapshot at T = `position` can resume a request at length `resume` (R), by itself.

    The rules (fastllm's, docs/FORMAT.md): R = T always; an even T also serves
    T - 1 (the window holds one position to spare), and any shorter length when
    T < window (the window holds every position); an odd T serves only T (its
    raw tail completes the pair (T-1, T) and nothing else). R = 0 is no resume.
    The global rows below R must be loadable too: `resume_length` adds that.
    """
    if not 1 <= resume <= position:
        return False
    if resume == position:
        return True
    if position % 2:
        return False
    return position < geometry.window or resume == position - 1


def resume_length(geometry: ModelGeometry, position: int, loadable_tokens: int) -> int | None:
    """The longest R <= `loadable_tokens` the snapshot at T = `position` serves, or None.

    `loadable_tokens` is the most the worker can resume at: the found global KV
    (a resume at R needs the compressed and indexer rows of every position below
    R, which only found blocks give), cut by what the request allows.
    """
    if loadable_tokens >= position:
        return position if position >= 1 else None
    if position % 2 or loadable_tokens < 1:
        return None
    if position < geometry.window:
        return loadable_tokens
    return position - 1 if loadable_tokens == position - 1 else None


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The 64-bit checksum a snapshot travels and rests with (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_stream() -> xxhash.xxh3_64:
    """A streaming `checksum`: `update()` it with a snapshot's pieces in order, and its
    `intdigest()` is `checksum()` of the whole (xxh3-64, seed 0), so a writer can hash each piece
    while it is still in cache, just before sending it."""
    return xxhash.xxh3_64()


def snapshot_key(anchor: bytes, partial_tokens: Sequence[int], position: int,
                 extra_keys: Sequence[ExtraKey] = ()) -> bytes:
    """The 32-byte key of the snapshot at `position`.

    Args:
        anchor: chain hash of the last full block before `position`, or the chain root.
        partial_tokens: the tokens after that block, up to `position` (fewer than a block).
        position: tokens before the snapshot point, counted from the prompt start.
        extra_keys: the keys the prefix was hashed with.

    Raises:
        InvalidArgument: the anchor is not a 32-byte hash, the position is not a u64, or a
            token id or extra key is bad.
    """
    if len(anchor) != HASH_BYTES:
        raise InvalidArgument(f"anchor hash must be {HASH_BYTES} bytes, got {len(anchor)}")
    if not 0 <= position < 2**64:
        raise InvalidArgument(f"snapshot position must be in [0, 2**64), got {position}")
    body = (b"kvstore.swa.v1\0" + anchor + struct.pack("<I", len(partial_tokens)) + token_bytes(partial_tokens)
            + encode_extra_keys(extra_keys) + struct.pack("<Q", position))
    return hashlib.sha256(body).digest()


def snapshot_keys(tokens: Sequence[int], positions: Sequence[int], *, block_tokens: int, root: bytes,
                  extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
    """Keys of the snapshots of `tokens` at each of `positions` (the chain is hashed once).

    Raises:
        InvalidArgument: a position is outside [0, len(tokens)].
    """
    for p in positions:
        if not 0 <= p <= len(tokens):
            raise InvalidArgument(f"snapshot position {p} is outside the {len(tokens)} tokens given")
    last = max(positions, default=0)
    chain = chain_hashes(tokens[:last], block_tokens=block_tokens, parent=root, extra_keys=extra_keys)
    keys = []
    for p in positions:
        full = p // block_tokens
        anchor = chain[full - 1] if full else root
        keys.append(snapshot_key(anchor, tokens[full * block_tokens:p], p, extra_keys))
    return keys


@dataclass(frozen=True, kw_only=True)
class Unsealed:
    """A record's data, checked against its header."""

    data: bytes
    checksum: int
    position: int


#: A header no record is opened with (no magic, and its fields' checksum does not match them): what a
#: streamed record carries until its real header is written over it (kvstore.client.swa_direct).
PLACEHOLDER_HEADER = bytes(HEADER_BYTES)


def seal(fingerprint: bytes, position: int, data: bytes, data_checksum: int) -> bytes:
    """The record a pool stores: a header naming the geometry, T and the checksum, then the data."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise InvalidArgument(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
    fields = _FIELDS.pack(_MAGIC, _VERSION, fingerprint, check_position(position), data_checksum)
    return _HEADER.pack(fields, xxhash.xxh3_64_intdigest(fields)) + data


def unseal(record: bytes, geometry: ModelGeometry) -> Unsealed | None:
    """The data, checksum and T of a record of `geometry`, or None when it fails any check.

    A record of another geometry or format, whose size is not the size of a
    snapshot at its T, or whose data no longer matches its checksum is never
    returned: the caller counts it as corrupt and misses.
    """
    if len(record) < HEADER_BYTES:
        return None
    fields, fields_sum = _HEADER.unpack_from(record)
    if xxhash.xxh3_64_intdigest(fields) != fields_sum:
        return None
    magic, version, stored_fp, position, stored_sum = _FIELDS.unpack(fields)
    if magic != _MAGIC or version != _VERSION or stored_fp != geometry.fingerprint or position < 1:
        return None
    if len(record) != HEADER_BYTES + snapshot_bytes(geometry, position):
        return None
    data = record[HEADER_BYTES:]
    if checksum(data) != stored_sum:
        return None
    return Unsealed(data=data, checksum=stored_sum, position=position)
