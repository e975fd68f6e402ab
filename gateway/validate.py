"""Checks on what arrives over the wire, before anything is stored.

Each check raises InvalidArgument with a message that names the field and what
was expected, so a caller can fix the request; nothing here touches storage.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.auth import current_caller
from kvstore import geometry as geometries
from kvstore.api_tokens import ADMIN
from kvstore.counted import counted
from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.geometry import ModelGeometry
from kvstore.prefix import HASH_BYTES, BlockScope, chain_hashes, root_hash
from tiers.chains import PackedHashes

#: Matched in full (`fullmatch`): `$` alone would also take a name ending in a newline.
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A geometry as this server serves it: with the block size and chain root."""

    geometry: ModelGeometry
    block_tokens: int
    block_bytes: int
    root: bytes

    @classmethod
    def of(cls, geometry: ModelGeometry, block_tokens: int) -> Layout:
        """The layout of `geometry` in blocks of `block_tokens`."""
        return cls(geometry=geometry, block_tokens=block_tokens,
                   block_bytes=geometry.block_bytes(block_tokens),
                   root=root_hash(geometry.fingerprint, block_tokens))


def namespace(name: str) -> str:
    """The tenant whose blocks a request touches: '' means the caller's own (gateway.auth).

    Raises:
        InvalidArgument: a malformed name.
        PermissionDenied: another tenant's name, from a caller without "admin"
            (refused whether or not that tenant exists).
    """
    caller = current_caller()
    if not name or name == caller.tenant:
        return caller.tenant
    if not _NAMESPACE.fullmatch(name):
        raise InvalidArgument(f"namespace {name!r} is not 1-128 of [A-Za-z0-9._-] starting alphanumeric")
    if ADMIN not in caller.rights:
        raise PermissionDenied(f"namespace {name!r} is not this token's tenant ({caller.tenant!r})",
                               hint="leave namespace empty: a call works on its token's tenant")
    return name


def scope(layouts: dict[str, Layout], geometry: str, tenant: str) -> tuple[Layout, BlockScope]:
    """The layout and the storage scope of a request (`tenant`: the request's namespace field, see `namespace`)."""
    layout = layouts.get(geometry or geometries.V4_1_FLASH.name)
    if layout is None:
        raise InvalidArgument(f"unknown geometry {geometry!r}; this server serves: {', '.join(layouts)}")
    return layout, BlockScope(layout.geometry.fingerprint, namespace(tenant))


def hashes(values: Sequence[bytes], *, limit: int, field: str = "block_hashes") -> list[bytes]:
    """A non-empty batch of 32-byte hashes, at most `limit` long."""
    if not values:
        raise InvalidArgument(f"{field} is empty: send at least one block hash")
    if len(values) > limit:
        raise InvalidArgument(f"{field} has {len(values)} entries; at most {limit} per call")
    out = list(values)
    if set(map(len, out)) == {HASH_BYTES}:  # the common case, without a Python loop
        return out
    for i, h in enumerate(out):
        if len(h) != HASH_BYTES:
            raise InvalidArgument(f"{field}[{i}] is {len(h)} bytes; a block hash is {HASH_BYTES} bytes")
    return out


def lookup_hashes(block_hashes: Sequence[bytes], packed: bytes, *, limit: int) -> Sequence[bytes]:
    """A Lookup's hashes: `block_hashes`, or `packed` (32 bytes each) as `PackedHashes`, never both.

    Packed hashes stay packed: the tier reads them as they came (tiers/chains.py), rather than
    have them cut into one object per hash (1 ms for 15,625) and joined again.

    Raises:
        InvalidArgument: both named, neither, a packed length not a multiple of 32 bytes, or more
            than `limit` hashes.
    """
    if not packed:
        return hashes(block_hashes, limit=limit)
    if block_hashes:
        raise InvalidArgument("name block_hashes or block_hashes_packed, not both")
    return PackedHashes(_packed(packed, limit=limit, already=0))


def _packed(packed: bytes, *, limit: int, already: int) -> bytes:
    """`packed`, checked: a multiple of 32 bytes, at most `limit` hashes with the `already` before them."""
    count, extra = divmod(len(packed), HASH_BYTES)
    if extra:
        raise InvalidArgument(f"block_hashes_packed is {len(packed)} bytes; it holds {HASH_BYTES}-byte hashes, "
                              f"so its length is a multiple of {HASH_BYTES}")
    if already + count > limit:
        if already:
            raise InvalidArgument(f"the anchor's {already} hashes and block_hashes_packed's {count} pass the "
                                  f"{limit} a Lookup may hold")
        raise InvalidArgument(f"block_hashes_packed has {count} hashes; at most {limit} per call")
    return packed


def anchor(anchor_hash: bytes, anchor_blocks: int, block_hashes: Sequence[bytes]) -> None:
    """A Lookup's anchor (a next turn, gateway.lookup_anchors): a 32-byte hash standing for at least one block.

    Raises:
        InvalidArgument: a hash of another size, no block count, or the repeated block_hashes beside it.
    """
    if len(anchor_hash) != HASH_BYTES:
        raise InvalidArgument(f"anchor_hash is {len(anchor_hash)} bytes; a block hash is {HASH_BYTES} bytes")
    if anchor_blocks < 1:
        raise InvalidArgument("anchor_blocks must be at least 1: the length of the chain anchor_hash ends")
    if block_hashes:
        raise InvalidArgument("an anchor goes with block_hashes_packed (the hashes after it), not block_hashes")


def anchored_hashes(head: PackedHashes, after: bytes, *, limit: int) -> Sequence[bytes]:
    """A next turn's hashes: the anchor's remembered chain `head`, then the packed `after` (one copy
    of the two, no object per hash).

    Raises:
        InvalidArgument: `after` not a multiple of 32 bytes, or more than `limit` hashes in all.
    """
    after = _packed(after, limit=limit, already=len(head))
    return PackedHashes(head.packed + after) if after else head


def anchored_after(after: bytes, anchor_blocks: int, *, limit: int) -> PackedHashes:
    """A next turn's hashes after its anchor (A5), packed as they came.

    Raises:
        InvalidArgument: `after` not a multiple of 32 bytes, or more than `limit` hashes with the anchor's.
    """
    return PackedHashes(_packed(after, limit=limit, already=anchor_blocks))


@dataclass(frozen=True, kw_only=True)
class PutPlan:
    """A validated Put: where the chain starts, its hashes, and its blocks."""

    parent: bytes
    is_root: bool
    hashes: list[bytes]


def put_plan(layout: Layout, *, parent_hash: bytes, token_ids: Sequence[int], extra_keys: Sequence[bytes],
             blocks: Sequence[bytes | memoryview], limit: int) -> PutPlan:
    """Check a Put's shape and hash its tokens into the chain it extends."""
    _check_put(layout, parent_hash=parent_hash, token_ids=token_ids, blocks=blocks, limit=limit)
    parent = parent_hash or layout.root
    chain = chain_hashes(token_ids, block_tokens=layout.block_tokens, parent=parent, extra_keys=extra_keys)
    return PutPlan(parent=parent, is_root=parent == layout.root, hashes=chain)


def _check_put(layout: Layout, *, parent_hash: bytes, token_ids: Sequence[int],
               blocks: Sequence[bytes | memoryview], limit: int) -> None:
    if not blocks:
        raise InvalidArgument("blocks is empty: a Put stores at least one block")
    if len(blocks) > limit:
        raise InvalidArgument(f"a Put holds at most {limit} blocks; got {len(blocks)}")
    full = len(token_ids) // layout.block_tokens
    if full != len(blocks):
        raise InvalidArgument(
            f"{counted(len(token_ids), 'token id')} make {counted(full, 'full block')} of {layout.block_tokens}, "
            f"but {counted(len(blocks), 'block')} {'was' if len(blocks) == 1 else 'were'} sent"
        )
    for i, block in enumerate(blocks):
        if len(block) != layout.block_bytes:
            raise InvalidArgument(
                f"block {i} is {len(block)} bytes; {layout.geometry.name} blocks of "
                f"{layout.block_tokens} tokens are {layout.block_bytes} bytes"
            )
    if parent_hash and len(parent_hash) != HASH_BYTES:
        raise InvalidArgument(f"parent_hash is {len(parent_hash)} bytes; a block hash is {HASH_BYTES} bytes")


@dataclass(frozen=True, kw_only=True)
class RunPart:
    """The part of a gateway's Put that lies in one run: what each of the run's replicas is sent."""

    #: The run's first fleet hash: where it is placed.
    run_key: bytes
    #: The node-level parent: b"" at the run's first block, else the block before (within the run).
    parent: bytes
    #: The caller's extra keys plus the run's bridge (kvstore/client/fleet_chain.py).
    extra_keys: list[bytes]
    token_ids: list[int]
    blocks: list[bytes]
    hashes: list[bytes]


def fleet_put_plan(layout: Layout, *, run_blocks: int, parent_hash: bytes, token_ids: Sequence[int],
                   extra_keys: Sequence[bytes], blocks: Sequence[bytes], limit: int, first_block: int,
                   run_key: bytes, run_bridge: bytes) -> list[RunPart]:
    """Check a Put sent to a fleet's gateway and cut it at run boundaries, each run hashed as the fleet
    does (a chain of its own, bridged: docs/FLEET.md F29, F36).

    Args:
        run_blocks: the fleet's blocks per run.
        parent_hash: the fleet hash of block `first_block - 1` (empty at block 0).
        first_block: the index in the prompt of blocks[0].
        run_key, run_bridge: the first hash of blocks[0]'s run and the hash before that run, when
            blocks[0] does not start it (the bridge empty in the first run).
    """
    # Here, not at the top: kvstore.client's package loads the SWA client (redis), which a node never needs.
    from kvstore.client.fleet_chain import BRIDGE_TAG

    _check_put(layout, parent_hash=parent_hash, token_ids=token_ids, blocks=blocks, limit=limit)
    if bool(first_block) != bool(parent_hash):
        raise InvalidArgument(f"first_block is {first_block} but parent_hash is "
                              f"{'set' if parent_hash else 'empty'}: through a gateway parent_hash is the fleet "
                              "hash of block first_block - 1, empty only at block 0")
    past_first = first_block >= run_blocks
    bad_run = len(run_key) != HASH_BYTES or len(run_bridge) != (HASH_BYTES if past_first else 0)
    if first_block % run_blocks and bad_run:
        raise InvalidArgument(f"a Put from block {first_block}, inside a run of {run_blocks} blocks, needs "
                                  "run_key (the run's first fleet hash) and, past the first run, run_bridge (the "
                                  "hash of the block before the run), 32 bytes each")
    parts: list[RunPart] = []
    previous, pos, done = parent_hash, first_block, 0
    keys = list(extra_keys)
    while done < len(blocks):
        n = min(run_blocks - pos % run_blocks, len(blocks) - done)
        at_start = pos % run_blocks == 0
        bridge = (previous or None) if at_start else (run_bridge or None)
        run_keys = keys + ([BRIDGE_TAG + bridge] if bridge else [])
        tokens = list(token_ids[done * layout.block_tokens:(done + n) * layout.block_tokens])
        hashes = chain_hashes(tokens, block_tokens=layout.block_tokens,
                              parent=layout.root if at_start else previous, extra_keys=run_keys)
        parts.append(RunPart(run_key=hashes[0] if at_start else run_key, parent=b"" if at_start else previous,
                             extra_keys=run_keys, token_ids=tokens, blocks=list(blocks[done:done + n]),
                             hashes=hashes))
        previous, pos, done = hashes[-1], pos + n, done + n
    return parts
