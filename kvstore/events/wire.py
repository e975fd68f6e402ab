"""The events' wire format: vLLM's `KVEventBatch` of `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.

The structs mirror `vllm.distributed.kv_events` (vLLM 0.33) field for field, so vLLM's own
decoder (`msgspec.msgpack.Decoder(KVEventBatch)`) reads what kvstore sends, and any consumer
of vLLM's events (Dynamo's ZMQ relay, llm-d's KV-cache indexer) indexes kvstore as one more
medium. vLLM encodes an event as a msgpack map tagged by `type` (the class name) and a batch as
the array `[ts, events, data_parallel_rank]`; a decoder ignores a map key it does not know, so
kvstore's own facts travel as three more keys of each event (`kvstore_node`, `kvstore_tenant`,
`kvstore_geometry`) that vLLM's classes skip and kvstore's (these) read.

Why these values (docs/EVENTS.md, "Format"): `block_hashes` are kvstore's chain hashes
(docs/PREFIX_HASHING.md, 32 bytes each), `parent_block_hash` the stored parent's (None for
a chain's first block: its parent is the chain's root, no block), `token_ids` empty (kvstore
keeps no tokens, and a prompt's tokens are the tenant's data), `block_size` the store's
tokens per block, `medium` "kvstore".
"""

from __future__ import annotations

import msgspec

#: The `medium` of every kvstore event: a consumer tells kvstore's blocks from an engine's GPU/CPU ones.
MEDIUM = "kvstore"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (a msgpack map tagged `type`, as vLLM's)."""


class BlockStored(KVCacheEvent, kw_only=True):
    """Blocks of one chain stored, parent first: each block's parent is the one before it.

    The fields up to `lora_name` are vLLM's required ones (always written); the rest are
    kvstore's, read by kvstore's decoder and skipped by vLLM's.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    # No defaults: omit_defaults would leave them out, and vLLM's decoder requires them.
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    #: The node holding the blocks (its store id, docs/FLEET.md F1).
    kvstore_node: str = ""
    #: The tenant (namespace) the blocks belong to: a batch never names another's.
    kvstore_tenant: str = ""
    #: The geometry fingerprint the blocks were hashed under (16 hex digits).
    kvstore_geometry: str = ""


class BlockRemoved(KVCacheEvent, kw_only=True):
    """Blocks removed (evicted, purged or found corrupt), children before their parents."""

    block_hashes: list[bytes]
    medium: str | None  # no default: vLLM's decoder requires it
    kvstore_node: str = ""
    kvstore_tenant: str = ""
    kvstore_geometry: str = ""


class AllBlocksCleared(KVCacheEvent, kw_only=True):
    """Whatever a consumer knew of this node's blocks is void: a new event log starts (docs/EVENTS.md E5)."""

    kvstore_node: str = ""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One commit's events of one tenant (or one AllBlocksCleared), as vLLM's `KVEventBatch`."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode(batch: KVEventBatch) -> bytes:
    """The batch's msgpack bytes (what the PUB socket's third frame holds)."""
    return _ENCODER.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes, with kvstore's fields (vLLM's decoder drops them).

    Raises:
        msgspec.DecodeError: the bytes are not a batch.
    """
    return _DECODER.decode(payload)
