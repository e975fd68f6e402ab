"""What each node's re-replication has left to do, as it publishes it in etcd (docs/FLEET.md F18).

Each node writes one record, `/kvstore/<cluster>/repair/<node_id>`, under its
registration's lease (so it leaves with the node; a drained node's, whose lease is
revoked, stays until the drain is cancelled): the membership it last planned
over, the bytes and runs it still has to copy to bring its runs back to their
replication factor, and what it has copied. `kvstore fleet status` sums them:
under-replicated bytes fleet-wide go to 0 once every node's pass over the current
membership is done.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from kvstore.fleet.endpoints import KEY_ROOT


def repair_prefix(cluster: str) -> bytes:
    """The prefix of the nodes' re-replication records: `/kvstore/<cluster>/repair/`."""
    return f"{KEY_ROOT}/{cluster}/repair/".encode()


def repair_key(cluster: str, node_id: str) -> bytes:
    """The key of one node's re-replication record."""
    return repair_prefix(cluster) + node_id.encode()


def drain_prefix(cluster: str) -> bytes:
    """The prefix of the drain requests: `/kvstore/<cluster>/drain/`."""
    return f"{KEY_ROOT}/{cluster}/drain/".encode()


def drain_key(cluster: str, node_id: str) -> bytes:
    """The key `kvstore fleet drain NODE` writes: `/kvstore/<cluster>/drain/<node_id>` (deleted by --cancel)."""
    return drain_prefix(cluster) + node_id.encode()


def drained_node(key: bytes) -> str:
    """The node id a drain request's key names (`drain_key`'s last part)."""
    return key.decode(errors="replace").rsplit("/", 1)[-1]


@dataclass(kw_only=True)
class RepairProgress:
    """One node's re-replication: what its last pass planned and what is left."""

    node_id: str
    #: The live node ids the current (or last) pass planned over, sorted.
    planned_nodes: list[str] = field(default_factory=list)
    #: Whether a pass is under way.
    running: bool = False
    #: Passes finished since the node started.
    passes: int = 0
    #: Bytes of copies still to make: for each run this node is to copy, its bytes times the replicas lacking it.
    under_replicated_bytes: int = 0
    #: Runs with a replica still lacking some of their blocks.
    under_replicated_runs: int = 0
    #: Bytes and blocks copied to other nodes since the node started (newly stored there).
    copied_bytes: int = 0
    copied_blocks: int = 0
    #: Bytes of block data sent in copies since the node started (above copied_bytes: a block the target
    #: stored meanwhile, through a Put or another holder's copy).
    sent_bytes: int = 0
    #: Of copied_bytes, those read by the targets over the bulk transport (the rest went over gRPC).
    bulk_bytes: int = 0
    #: Blocks found damaged (checksum) on this node while copying: dropped here, never sent (F17).
    damaged_blocks: int = 0
    #: Pins sent with copied blocks (docs/RETENTION.md R31) that the targets granted until the time held here,
    #: and those they granted shorter or not at all (their limits for the tenant), since the node started.
    pins_copied: int = 0
    pins_short: int = 0
    #: Runs a copy failed for in the last pass (a target unreachable, a refusal): retried on the next pass.
    failed_runs: int = 0
    #: Whether the node is draining (`kvstore fleet drain`, F21): a member, serving, placed on by no one, until the
    #: other nodes hold every run it holds at its replication.
    draining: bool = False
    #: A draining node's last pass: the bytes (and runs) of its in-window blocks that the run's replicas among the
    #: other nodes did not hold yet, as they answered (RunDigests, HeldBlocks): what the drain has left.
    drain_left_bytes: int = 0
    drain_left_runs: int = 0
    #: Whether a draining node's pass found every run it holds at its replication on the other nodes, so it left the
    #: membership (revoked its lease): it may be stopped.
    drained: bool = False
    #: Runs (and their bytes) this node held while no longer among their replicas, dropped once every replica
    #: confirmed holding them with this copy's last uses (docs/FLEET.md F79), since the node started.
    stale_dropped_runs: int = 0
    stale_dropped_bytes: int = 0
    #: The runs the current (or last) pass plans, of those the node holds: fewer after a membership change (the runs
    #: it moved, F18f, F86) and in a periodic pass over a big node (its sweep's part, F87).
    pass_runs: int = 0
    held_runs: int = 0
    #: Unix time of the last update.
    updated_at: float = 0.0

    def to_json(self) -> bytes:
        """As written in etcd."""
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RepairProgress | None:
        """A stored record, None when it does not parse."""
        try:
            raw = json.loads(data)
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except (ValueError, TypeError, KeyError):
            return None
