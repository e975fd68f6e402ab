"""This host's nodes of a fleet, and a fleet session's region mapped into one of them (F62).

A fleet client's shared-memory path goes to the nodes on the worker's host: a node is on this host
when its record's kernel boot id is this process's (`kvstore.prefix_hosts.host_id`; two processes
with one boot id run on one machine), or, for a record without one, when its host name is this
machine's (the rule the read order already uses, F33). A `ColocatedReader` names its node outright
(F48), and `restore` takes that one when given. The node itself then proves it maps the region: it
reads a nonce from the memfd, as for a single node's session (docs/TRANSFER.md), so a node whose
record says "this host" but cannot open this process's memory (another pid namespace) is passed by.

A fleet session's region is this process's memfd, with an id of the fleet session's; a node's
transfer session knows it by the id that node handed out. `mapped_alias` is that second name: a
`Region` object over the same mapping whose `region_id` is the node's and `shared` is set, so the
node's own session (`TransferSession`, its request ring and batches) serves it unchanged. The alias
never closes the mapping (it holds no descriptor); the fleet session closes the region itself.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Protocol

from kvstore.client.transfer import TransferSession
from kvstore.client.transfer_ring import open_ring
from kvstore.prefix_hosts import host_id, host_name
from kvstore.region import Region


class _Record(Protocol):
    """What a node registers of its host (`kvstore.fleet.membership.NodeRecord`)."""

    @property
    def host(self) -> str: ...

    @property
    def host_id(self) -> str: ...


def on_this_host(record: _Record) -> bool:
    """Whether a node's record names this machine: its boot id where it has one, else its host name."""
    if record.host_id and host_id():
        return record.host_id == host_id()
    return bool(record.host) and record.host == host_name()


def local_nodes(nodes: Mapping[str, _Record], only: Iterable[str] | None = None) -> tuple[str, ...]:
    """The live nodes on this host (`on_this_host`), sorted; with `only`, those of them named there.

    `only` names this host's nodes outright (a `ColocatedReader`'s node, F48): they are taken when live,
    whatever their records say.
    """
    if only is not None:
        return tuple(sorted(n for n in set(only) if n in nodes))
    return tuple(sorted(n for n, r in nodes.items() if on_this_host(r)))


def map_region(session: TransferSession, region: Region) -> tuple[Region | None, str]:
    """Register `region` (fresh: its first bytes are overwritten by the nonce) with a node's shm session.

    Returns the alias the node's session knows it by, or None and why the node did not map it.

    Raises:
        KVStoreError: the node refused the call (Unavailable when it does not answer).
    """
    reply = session.ask_to_map(region)
    if not reply.shared:
        return None, reply.reason or "the node did not map the region"
    alias = copy.copy(region)
    # The alias shares the mapping and nothing else: no descriptor to close, no CUDA pinning to undo.
    alias._fd = None
    alias._pinned = None
    alias.region_id, alias.shared = reply.region_id, True
    session.regions[alias.region_id] = alias
    if session.ring is None and session._want_ring:  # as the node's own register() does at its first shared region
        session._want_ring = False
        session.ring, session.ring_reason = open_ring(session)
    return alias, ""


__all__ = ["local_nodes", "map_region", "on_this_host"]
