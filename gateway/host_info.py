"""This node as a Lookup's hosts answer names it (issue 26 item 2, docs/PLANNER.md "Where a prefix lives").

A node holding a found prefix says who it is (its store's id), which machine it runs on (name
and kernel boot id, so a worker can tell it runs beside it) and whether a same-host reader can
open its store: an LMDB tier's file on this host can be (`ColocatedReader(data_dir)`, given
the OS rights to it, docs/SECURITY.md); any other store cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError
from kvstore.prefix_hosts import PrefixHost, host_id, host_name
from tiers.store import MappedStore


@dataclass(frozen=True, kw_only=True)
class NodeHost:
    """What this node says of itself in a hosts answer."""

    node_id: str
    host: str
    host_id: str
    colocated: bool
    data_dir: str

    @classmethod
    def of(cls, tier: Any) -> NodeHost:
        """This process's node for `tier`: a store read out of LMDB's map (an LMDB tier's file, in its data dir)
        is colocated-readable; another store is not."""
        if isinstance(tier, MappedStore):
            from tiers.datadir import node_id  # the identity file the tier wrote when it opened

            data_dir = tier.settings.data_dir.resolve()
            try:
                node = node_id(data_dir)
            except ConfigError:
                node = ""
            return cls(node_id=node, host=host_name(), host_id=host_id(), colocated=True, data_dir=str(data_dir))
        return cls(node_id="", host=host_name(), host_id=host_id(), colocated=False, data_dir="")

    def held(self, found_blocks: int) -> PrefixHost:
        """This node holding the found prefix's first `found_blocks` blocks (a node holds a prefix whole: R6)."""
        return PrefixHost(node_id=self.node_id, host=self.host, host_id=self.host_id,
                          block_ranges=((0, found_blocks),), colocated=self.colocated, data_dir=self.data_dir)
