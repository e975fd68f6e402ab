"""What an SWA snapshot is: its key, its expected size, and the checksummed record a pool stores.

A snapshot is the FP8 SWA KV of every SWA layer for the last n_win tokens before
a position of a token sequence. Its key names that position exactly, so a
snapshot may be taken at a block boundary or inside a block:

    key = SHA-256("kvstore.swa.v1" | anchor | u32 partial count | u32 token ids |
                  extra keys (kvstore.prefix canonical bytes) | u64 position)

where `anchor` is the chain hash of the last full block before the position (or
the chain root when the position is inside the first block) and the partial
tokens are those after that block, up to the position. The anchor covers the
geometry fingerprint, the block size, every earlier token and the extra keys, so
two snapshots share a key only when they describe the same prefix. All integers
are unsigned little-endian, as in kvstore.prefix; never Python's `hash()`.

This module is torch-free: the server sizes and checks snapshots without the codec.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import xxhash

from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry
from kvstore.prefix import FINGERPRINT_BYTES, HASH_BYTES, ExtraKey, chain_hashes, encode_extra_keys, token_bytes

#: Bytes of one per-token, per-layer scale in the codec's snapshot layout
#: (kvstore.codec.fp8.SCALE_BYTES; a test pins the two together).
SCALE_BYTES = 4
#: Record header: magic, format version, geometry fingerprint, xxh3-64 of the data.
_HEADER = struct.Struct("<4sB8sQ")
_MAGIC = b"SWA1"
_VERSION = 1
HEADER_BYTES = _HEADER.size


def snapshot_bytes(geometry: ModelGeometry) -> int:
    """Bytes of one encoded snapshot of `geometry`: the one place the expected size is computed.

    The layout is kvstore.codec.fp8's: FP8 codes [layers, window, channels] then one
    float32 scale per token per layer (a test checks this equals
    `kvstore.codec.fp8.snapshot_bytes`; that module needs torch, the server must not).
    """
    return geometry.swa_snapshot_bytes + geometry.swa_layers * geometry.swa_window_tokens * SCALE_BYTES


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The 64-bit checksum a snapshot travels and rests with (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(data)


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


def seal(fingerprint: bytes, data: bytes, data_checksum: int) -> bytes:
    """The record a pool stores: a header naming the geometry and the checksum, then the data."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise InvalidArgument(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
    return _HEADER.pack(_MAGIC, _VERSION, fingerprint, data_checksum) + data


def unseal(record: bytes, *, fingerprint: bytes, size_bytes: int) -> tuple[bytes, int] | None:
    """The data and checksum of a record, or None when it fails any check.

    A record of another geometry, another size, or whose data no longer matches
    its checksum is never returned: the caller counts it as corrupt and misses.
    """
    if size_bytes < 0 or len(record) != HEADER_BYTES + size_bytes:
        return None
    magic, version, stored_fp, stored_sum = _HEADER.unpack_from(record)
    if magic != _MAGIC or version != _VERSION or stored_fp != fingerprint:
        return None
    data = record[HEADER_BYTES:]
    if checksum(data) != stored_sum:
        return None
    return data, stored_sum
