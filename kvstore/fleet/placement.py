"""Where each run of a chain's blocks lives: rendezvous (highest-random-weight) hashing over node ids.

A chain of blocks is cut into runs of `run_blocks` contiguous blocks (256 blocks
of 64 tokens = 16,384 tokens; a 1M-token prompt's 15,625 blocks are 62 runs).
One placement per run, not per block, so a long prompt touches at most one node
set per run, however large the fleet (F9). Run r is keyed by the hash of its
first block, which in a chained prefix hash (kvstore.prefix) is the hash of the
whole prefix up to there: two chains that share a run's first block share that
run's placement, and every block of the run lies on the same nodes.

Each node scores a run with a 64-bit BLAKE2b of (run key, node id); the run's
replicas are the `k` highest scores, best first (ties, never seen in practice,
go to the smaller id). So the placement depends only on the run and the set of
live ids: every client and node computes the same lists without talking (F10);
adding an (N+1)th node moves only the runs it now wins, about 1/(N+1) of the
copies (F11), and removing a node moves only the copies it held (F12). The
replicas of a run are distinct nodes, as many as the replication asks where
the fleet has that many (F13).

Everything here is a pure function of its arguments.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

from kvstore.errors import InvalidArgument, Unavailable

#: The placement hash's version, mixed into every score: a new scoring rule gets a new tag.
SCORE_TAG = b"kvstore.fleet.placement.v1\0"


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What every node and client of a fleet must agree on to place alike (recorded in etcd, F8)."""

    #: Blocks per run (fleet.run_blocks).
    run_blocks: int
    #: Tokens per block (store.block_tokens): the chain's hashes depend on it.
    block_tokens: int

    def __post_init__(self) -> None:
        if self.run_blocks < 1 or self.block_tokens < 1:
            raise InvalidArgument(f"a layout needs run_blocks and block_tokens >= 1, got {self}")

    @property
    def run_tokens(self) -> int:
        """Tokens per run."""
        return self.run_blocks * self.block_tokens

    def to_json(self) -> bytes:
        """As recorded in etcd."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Layout | None:
        """The recorded layout, or None when it does not parse."""
        try:
            raw = json.loads(data)
            return cls(run_blocks=int(raw["run_blocks"]), block_tokens=int(raw["block_tokens"]))
        except (ValueError, KeyError, TypeError, InvalidArgument):
            return None


@dataclass(frozen=True, kw_only=True)
class RunPlacement:
    """One run of a chain and the nodes that hold it."""

    #: The run's index in the chain (0 = the chain's first run_blocks blocks).
    run: int
    #: Index of its first block in the chain.
    first_block: int
    #: Index one past its last block (the last run may be short).
    end_block: int
    #: Node ids holding it, best first (the first is where a write goes first and a read prefers).
    replicas: tuple[str, ...]


def run_count(n_blocks: int, run_blocks: int) -> int:
    """Runs a chain of `n_blocks` is cut into (the last one may be short)."""
    if n_blocks < 0 or run_blocks < 1:
        raise InvalidArgument(f"run_count needs n_blocks >= 0 and run_blocks >= 1, got {n_blocks}, {run_blocks}")
    return -(-n_blocks // run_blocks)


def score(run_key: bytes, node_id: str) -> int:
    """The rendezvous weight of `node_id` for the run keyed `run_key`: a 64-bit BLAKE2b of both.

    Lengths are part of the input, so no (key, id) pair reads as another.
    """
    node = node_id.encode()
    digest = hashlib.blake2b(SCORE_TAG + len(run_key).to_bytes(4, "little") + run_key + node, digest_size=8)
    return int.from_bytes(digest.digest(), "big")


def scores(run_key: bytes, node_ids: Iterable[str]) -> dict[str, int]:
    """`score(run_key, n)` of every node id: the key's part hashed once and copied per node (0.47-0.67 us a node
    against `score`'s 1.1-1.2 us on the dev box), for a ranking of every node, as a re-replication pass makes per
    run (F86)."""
    base = hashlib.blake2b(SCORE_TAG + len(run_key).to_bytes(4, "little") + run_key, digest_size=8)
    out = {}
    for n in node_ids:
        h = base.copy()
        h.update(n.encode())
        out[n] = int.from_bytes(h.digest(), "big")
    return out


def replicas(run_key: bytes, node_ids: Iterable[str], k: int) -> tuple[str, ...]:
    """The `k` nodes holding the run keyed `run_key`, best first (fewer when there are fewer nodes).

    Raises:
        InvalidArgument: k < 1.
        Unavailable: no node is live.
    """
    if k < 1:
        raise InvalidArgument(f"a replication factor is at least 1, got {k}")
    ids = set(node_ids)
    if not ids:
        raise Unavailable("no storage node is live in the fleet", hint="start a node, or wait for etcd's view")
    # Highest score first; the smaller id first among equal scores, so the order is total.
    weight = scores(run_key, ids)
    best = heapq.nsmallest(k, ids, key=lambda n: (-weight[n], n))
    return tuple(best)


def run_key(chain: Sequence[bytes], run: int, run_blocks: int) -> bytes:
    """The key run `run` is placed by: the chained hash of its first block (the prefix up to it)."""
    first = run * run_blocks
    if not 0 <= first < len(chain):
        raise InvalidArgument(f"run {run} starts at block {first}, outside a chain of {len(chain)} blocks")
    return chain[first]


def place_chain(chain: Sequence[bytes], node_ids: Iterable[str], *, run_blocks: int,
                replication: int) -> tuple[RunPlacement, ...]:
    """The placement of every run of a chain of block hashes (kvstore.prefix.chain_hashes), in order.

    Raises:
        InvalidArgument: run_blocks or replication below 1.
        Unavailable: no node is live.
    """
    run_count(len(chain), run_blocks)  # checks run_blocks before the slice below
    # The runs' keys are their first hashes (`run_key`): a chain placed before is placed from the memo.
    return _placed(tuple(chain[::run_blocks]), len(chain), frozenset(node_ids), run_blocks, replication)


@functools.lru_cache(maxsize=256)
def _placed(keys: tuple[bytes, ...], n_blocks: int, ids: frozenset[str], run_blocks: int,
            replication: int) -> tuple[RunPlacement, ...]:
    """`place_chain` by the runs' keys, remembered for the last 256 (chains, node set): a prompt sent again
    (its Lookup, then its Get) is placed without building its runs again (docs/FLEET.md F65)."""
    return tuple(RunPlacement(run=run, first_block=run * run_blocks, end_block=min((run + 1) * run_blocks, n_blocks),
                              replicas=ranked(key, ids, replication)) for run, key in enumerate(keys))


@functools.lru_cache(maxsize=1 << 16)
def ranked(run_key: bytes, node_ids: frozenset[str], k: int) -> tuple[str, ...]:
    """`replicas`, remembered for the last 65,536 (run, node set, k): a prompt sent again is placed without
    hashing its runs again (a 1M-token prompt's 62 runs over a few nodes cost ~0.5 ms to score).

    Raises:
        InvalidArgument, Unavailable: as `replicas` (not remembered).
    """
    return replicas(run_key, node_ids, k)


def nodes_touched(placement: Iterable[RunPlacement]) -> frozenset[str]:
    """Every node holding a copy of some run of a placed chain."""
    return frozenset(n for p in placement for n in p.replicas)


class PlacedRecord(Protocol):
    """What placement reads of a node's record (`kvstore.fleet.membership.NodeRecord`, which imports this module)."""

    @property
    def node_id(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def draining(self) -> bool: ...


def placeable(nodes: Mapping[str, PlacedRecord]) -> list[str]:
    """The ids to place runs over: of the records that share an address, the latest started only (F42); a
    draining node's never (F21: a read asks it after the replicas, `NodePool.read_order`'s next ranked).

    A node killed and started again on a wiped data dir at the same address is a new id while the old id's
    record waits out its lease; both records name the one process that answers there, so placing over both
    could put a run's two copies on one process and acknowledge one copy as two.
    """
    latest = _latest_at_each_address(r for r in nodes.values() if not r.draining)  # F21: draining ones never
    return [r.node_id for r in latest.values()]


def superseded(nodes: Mapping[str, PlacedRecord]) -> set[str]:
    """The ids whose address a later-started record also names (F42): the same process answers for both, so a
    re-replication pass counts only the latest as a holder or a replica (two ids there are one copy, not two)."""
    latest = _latest_at_each_address(nodes.values())
    return {n for n, r in nodes.items() if latest[r.address].node_id != n}


def _latest_at_each_address(records: Iterable[PlacedRecord]) -> dict[str, PlacedRecord]:
    latest: dict[str, PlacedRecord] = {}
    for record in records:
        seen = latest.get(record.address)
        if seen is None or (record.started_at, record.node_id) > (seen.started_at, seen.node_id):
            latest[record.address] = record
    return latest
