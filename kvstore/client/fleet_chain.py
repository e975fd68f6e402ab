"""A chain's hashes in a fleet: each run of `run_blocks` blocks is a chain of its own, bridged to the one before.

A node keeps R6 (docs/RETENTION.md): it stores a block only when its parent is
stored there, and a Lookup counts block i only at depth i + 1. A fleet places
run r on other nodes than run r - 1, so the node of run r never holds run r's
parent. So in a fleet every run is stored as its own chain from the root, and
the prefix before it is bound in by one more extra key, the *bridge*:

    run 0:      block hashes as on one server (kvstore.prefix, from the root)
    run r > 0:  from the root, with extra keys = the caller's + [BRIDGE_TAG | hash of block r*run_blocks - 1]

The last hash of run r - 1 names the whole prefix before run r (it is chained
the same way), so two prompts share run r's blocks exactly when they share
every token up to its end and their extra keys, as on one server. Every node
keeps its own R6 within a run unchanged; across runs the client keeps it
(docs/FLEET.md, "Data path"). A run's first hash is its placement key
(`kvstore.fleet.placement.run_key`), and on the node it is the run's depth-1
block: a node can find the run of any block it holds by walking to depth 1.

The bridge takes one extra key of 53 bytes from the caller's budget
(kvstore.prefix: 128 keys, 8 KiB in all), so a fleet client takes 127 keys and
8,139 bytes.

A snapshot's key is anchored on this chain too (`fleet_snapshot_keys`, F45): here, so that the SWA
client through a gateway (kvstore.client.swa) and the fleet's (kvstore.client.fleet_swa, built on
it) share one derivation without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.client import arguments
from kvstore.errors import InvalidArgument
from kvstore.prefix import ExtraKey, chain_hashes
from kvstore.swa_snapshot import snapshot_key

#: Marks the bridge key; a new bridging rule gets a new tag.
BRIDGE_TAG = b"kvstore.fleet.run.v1\0"


def run_extra_keys(extra_keys: Sequence[ExtraKey], previous: bytes | None) -> list[ExtraKey]:
    """The extra keys a run is hashed (and Put) with: the caller's, plus the bridge to `previous`.

    Args:
        extra_keys: the caller's keys.
        previous: the hash of the block before the run (None for run 0).
    """
    keys = list(extra_keys)
    if previous is not None:
        keys.append(BRIDGE_TAG + previous)
    return keys


def fleet_hashes(tokens: Sequence[int], *, root: bytes, block_tokens: int, run_blocks: int,
                 extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
    """The fleet hash of every full block of `tokens`, from the prompt start (run by run, bridged).

    Raises:
        InvalidArgument: a bad token id or extra key (kvstore.prefix names the limits).
    """
    run_tokens = run_blocks * block_tokens
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_tokens + 1, run_tokens):
        keys = run_extra_keys(extra_keys, hashes[-1] if hashes else None)
        hashes += chain_hashes(tokens[start:start + run_tokens], block_tokens=block_tokens, parent=root,
                               extra_keys=keys)
    return hashes


def fleet_snapshot_keys(tokens: Sequence[int], positions: Sequence[int], *, root: bytes, block_tokens: int,
                        run_blocks: int, extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
    """Snapshot keys of `tokens` at each position, each anchored on the fleet hash of the last full block before
    it (F29's chain; the root inside the first block), with the caller's extra keys (F45).

    Raises:
        InvalidArgument: a position outside [0, len(tokens)], a bad token id or extra key.
    """
    tokens = arguments.token_ids(tokens)
    positions = [arguments.integer(p, f"positions[{i}]") for i, p in enumerate(positions)]
    extra_keys = arguments.extra_keys(extra_keys)
    for p in positions:
        if p > len(tokens):
            raise InvalidArgument(f"snapshot position {p} is outside the {len(tokens)} tokens given")
    b = block_tokens
    chain = fleet_hashes(tokens[:max(positions, default=0)], root=root, block_tokens=b, run_blocks=run_blocks,
                         extra_keys=extra_keys)
    return [snapshot_key(chain[p // b - 1] if p >= b else root, tokens[p // b * b:p], p, extra_keys)
            for p in positions]
