"""Where a found prefix lives: the nodes that hold its blocks on their own hosts (issue 26 item 2).

A Lookup asked with `hosts=True` answers, beside the found tokens, one `PrefixHost` per node
holding blocks of the found prefix: the node, its machine (name and kernel boot id), the block
ranges it holds, and whether a same-host reader (`kvstore.client.colocated.ColocatedReader`)
can open its store. A single server names itself, holding the whole found prefix; a fleet
(a fleet client, or a gateway) names every live replica of each found run (its placement:
F30 acknowledges a Put only once every copy is durable, re-replication restores lost ones).
The resume planner turns the answer into the path and time a worker on each host would take
(`replay/hosts.py`, docs/PLANNER.md "Where a prefix lives").
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvstore.v1 import kvstore_pb2 as pb

#: Where the kernel publishes this boot's id (one per running kernel: shared by its containers).
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def host_id() -> str:
    """This host's identity: the kernel's boot id ('' where it cannot be read). Two processes
    with one boot id run on one machine, so a worker compares a node's with its own."""
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""


def host_name() -> str:
    """This machine's name (what a fleet node registers as its `host`)."""
    return socket.gethostname()


@dataclass(frozen=True, kw_only=True)
class PrefixHost:
    """One node holding blocks of a found prefix on its own host.

    Attributes:
        node_id: the store's id (its data dir's, docs/FLEET.md F1).
        host: the machine's name.
        host_id: the machine's kernel boot id ('' when unknown): a worker on that host has the same.
        address: the node's gRPC address ('' from a single server: the client's own target).
        block_ranges: the found prefix's blocks it holds, as [first, end) ranges of block indices.
        colocated: a same-host reader can open its store (an LMDB file on its host).
        data_dir: the store's data dir, for that reader ('' when not colocated).
    """

    node_id: str
    host: str
    host_id: str = ""
    address: str = ""
    block_ranges: tuple[tuple[int, int], ...] = ()
    colocated: bool = False
    data_dir: str = ""

    @property
    def blocks(self) -> int:
        """How many blocks of the found prefix it holds."""
        return sum(end - first for first, end in self.block_ranges)

    def blocks_below(self, end_block: int) -> int:
        """How many of the blocks [0, end_block) it holds (what a plan fetching them reads here)."""
        return sum(max(0, min(end, end_block) - first) for first, end in self.block_ranges if first < end_block)

    def to_pb(self) -> pb.PrefixHost:
        """The wire message."""
        return pb.PrefixHost(node_id=self.node_id, host=self.host, host_id=self.host_id, address=self.address,
                             block_ranges=[b for r in self.block_ranges for b in r], colocated=self.colocated,
                             data_dir=self.data_dir)

    @classmethod
    def from_pb(cls, msg: pb.PrefixHost) -> PrefixHost:
        """From the wire message (an odd last range bound is dropped: a malformed answer holds less)."""
        flat = list(msg.block_ranges)
        ranges = tuple((flat[i], flat[i + 1]) for i in range(0, len(flat) - 1, 2) if flat[i] < flat[i + 1])
        return cls(node_id=msg.node_id, host=msg.host, host_id=msg.host_id, address=msg.address,
                   block_ranges=ranges, colocated=msg.colocated, data_dir=msg.data_dir)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"node_id": self.node_id, "host": self.host, "host_id": self.host_id, "address": self.address,
                "blocks": self.blocks, "block_ranges": [list(r) for r in self.block_ranges],
                "colocated": self.colocated, "data_dir": self.data_dir}


class _NodeRecord(Protocol):
    """What a fleet node registers of its host (`kvstore.fleet.membership.NodeRecord`)."""

    @property
    def address(self) -> str: ...

    @property
    def host(self) -> str: ...

    @property
    def host_id(self) -> str: ...

    @property
    def data_dir(self) -> str: ...


class _Run(Protocol):
    """A run's placement (`kvstore.fleet.placement.RunPlacement`)."""

    @property
    def first_block(self) -> int: ...

    @property
    def end_block(self) -> int: ...

    @property
    def replicas(self) -> tuple[str, ...]: ...


def fleet_hosts(runs: Iterable[_Run], found_blocks: int, nodes: Mapping[str, _NodeRecord]) -> tuple[PrefixHost, ...]:
    """The nodes holding a fleet's found prefix of `found_blocks` blocks: each live replica of each run it
    reaches into, with the run's found part (`runs`: the chain's placement, replicas best first).

    A replica gone from `nodes` (it left the membership) is left out; a node registered before hosts were
    (no boot id, no data dir) is named with what it registered, not colocated.
    """
    ranges: dict[str, list[tuple[int, int]]] = {}
    for run in runs:
        end = min(run.end_block, found_blocks)
        if end <= run.first_block:
            break
        for node in run.replicas:
            if node in nodes:
                ranges.setdefault(node, []).append((run.first_block, end))
    out = []
    for node, held in ranges.items():
        record = nodes[node]
        out.append(PrefixHost(node_id=node, host=record.host, host_id=record.host_id, address=record.address,
                              block_ranges=tuple(_merged(held)), colocated=bool(record.data_dir),
                              data_dir=record.data_dir))
    return tuple(sorted(out, key=lambda h: (-h.blocks, h.node_id)))


def _merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent or overlapping ranges joined, in order."""
    out: list[tuple[int, int]] = []
    for first, end in sorted(ranges):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((first, end))
    return out


def hosts_of(reply: pb.LookupResponse) -> tuple[PrefixHost, ...]:
    """The hosts a Lookup's reply names."""
    return tuple(PrefixHost.from_pb(h) for h in reply.hosts)
