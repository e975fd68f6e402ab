"""The capability of a store that routes whole requests over a fleet's nodes (a gateway's: `gateway.fleet_store`).

A node's store answers by storage key (`tiers.store.BlockStore`). A gateway's cannot:
a storage key hides the tenant (a hash of its name), and a run is placed by its first
hash, which a request from inside a run does not carry. So the KVStore servicer gives
a `RoutedStore` the request's own fields (docs/FLEET.md F36-F38): the caller's token,
namespace and geometry (`Route`), the hashes, and where the request starts in its run.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gateway.block_feed import Feed
from gateway.validate import RunPart

if TYPE_CHECKING:  # the client package loads every client (redis too): not on a node's import path
    from kvstore.client.fleet_pins import FleetPin
    from kvstore.prefix_hosts import PrefixHost
    from kvstore.v1 import kvstore_pb2 as pb


@dataclass(frozen=True, kw_only=True)
class Route:
    """Whose request a routed call carries to the nodes: the caller's own token and fields.

    The nodes check `token` against the fleet's tenants themselves, so a request through a
    gateway has exactly the rights its token has on a node (F38).
    """

    token: str | None
    namespace: str
    geometry: str


@dataclass(frozen=True, kw_only=True)
class StoredTail:
    """What a Put stream's last request stored on every replica of its last run (F69b): that request's caller
    (`route`), where it ended (`end_block`, the index after its last block), that block's fleet hash and the key
    of the run it lies in. The next request of the same stream from `end_block` needs no check of that run."""

    route: Route
    end_block: int
    last_hash: bytes
    run_key: bytes

    def stored_before(self, route: Route, first_block: int, parent_hash: bytes, parent_run_key: bytes) -> bool:
        """Whether a request from `first_block` extends exactly this tail: same caller, from its end, its parent
        the tail's last block and the run before it placed by the tail's run key."""
        return (self.route == route and self.end_block == first_block and self.last_hash == parent_hash
                and self.run_key == parent_run_key)


@runtime_checkable
class RoutedStore(Protocol):
    """A store that serves Lookup, Release, Put and Get by routing them to a fleet's nodes."""

    #: The fleet's blocks per run (told to clients in GetInfo).
    run_blocks: int

    def route_lookup(self, route: Route, hashes: Sequence[bytes], lease_ms: int) -> tuple[int, str | None]:
        """(found blocks, composite lease id or None) of a chain of fleet hashes from block 0."""
        ...

    def route_release(self, route: Route, lease_id: str) -> bool:
        """Release a composite lease on every node it names."""
        ...

    def route_swa(self, route: Route, request: pb.LookupRequest, found_tokens: int) -> pb.LookupResponse:
        """A Lookup's SWA candidates, answered by the fleet's shared pool within `found_tokens` (F52)."""
        ...

    def route_stats(self, route: Route, request: pb.StatsRequest) -> pb.StatsResponse:
        """The fleet's Stats: every live node's answer to the caller's request, merged (F53)."""
        ...

    def route_put(self, route: Route, parts: Sequence[RunPart],
                  keep_until_s: float = 0.0) -> tuple[int, int, FleetPin | None]:
        """Put each run part on all its replicas; (written, existing) blocks once every copy is durable, and
        the pin the copies granted each part's last block when `keep_until_s` asked one."""
        ...

    def route_pin(self, route: Route, hashes: Sequence[bytes], found_blocks: int, until_s: float) -> FleetPin:
        """Pin a found prefix of fleet hashes on every live copy of each of its runs (R28)."""
        ...

    def route_hosts(self, hashes: Sequence[bytes], found_blocks: int, tenant: str = "") -> tuple[PrefixHost, ...]:
        """The nodes holding a found prefix of fleet hashes, with the block ranges each holds, placed at
        `tenant`'s replication."""
        ...

    def route_parent_run(self, route: Route, first_block: int, parent_hash: bytes, parent_run_key: bytes,
                         after: StoredTail | None = None) -> None:
        """Refuse a Put from the first block of a run r > 0 unless run r - 1, placed by `parent_run_key`, is
        complete on some live replica (R6 across runs, F69); nothing for other Puts, nor for one that extends
        `after`, what the request before it in the same stream stored (F69b)."""
        ...

    def route_get_feeds(self, route: Route, hashes: Sequence[bytes], first_block: int,
                        run_key: bytes) -> Generator[Feed[tuple[int, int, bytes]], None, None]:
        """(index, status, data) per block of `hashes`, blocks from `first_block` of a prompt: one bounded feed per
        run, in order, each filled on the store's threads as its node answers (F69a)."""
        ...
