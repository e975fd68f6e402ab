"""Who the bulk transport's server engines write to (docs/TRANSFER.md "Bulk transport"):
client engine names ("host:port", checked to be on the calling host), a session's lanes,
and its engine writes still running.

A session's lanes are its client engines, each tied to one of the server's engines when
named (`OpenBulk`, once per engine). Mooncake 0.3.13's TCP transport moves all of one
engine's bytes on one io thread, so a session on a host with many cores fetches through
several engine pairs at once; each write goes through the lane with the fewest writes
running.

A write is not stopped by its call's end: a BulkFetch the client cancels, or whose deadline
passes, leaves its engine write going (Mooncake cannot cancel one). So each write of a
session is counted until it returns (`Lanes.submit`), and `Lanes.drain` waits for them:
a client falling back to gRPC asks first (`Transfer.BulkDrain`), so that no late write
lands in memory it has filled since.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidArgument

#: Longest a BulkDrain waits for a session's engine writes (a write of one BulkFetch takes
#: milliseconds; one still running after this is stuck, and the client is told so).
DRAIN_MOST_S = 30.0
#: A BulkDrain answers this long before its caller's deadline, so the count reaches it.
DRAIN_MARGIN_S = 0.2
#: A client engine's name: "host:port" (a host name, IPv4, or [IPv6]).
_SEGMENT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9._-]{1,253}):([0-9]{1,5})$")


def checked_segment(segment: str) -> str:
    """A client engine's name, checked to be "host:port".

    Raises:
        InvalidArgument: naming the value and the form.
    """
    match = _SEGMENT.match(segment)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise InvalidArgument(f"segment {segment[:64]!r} is not host:port (its engine's handshake port)")
    return segment


def peer_host(peer: str) -> str:
    """The host of a grpc peer ("ipv4:1.2.3.4:5678" -> "1.2.3.4", "ipv6:[::1]:5678" -> "::1"; else "")."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    return rest.rpartition(":")[0].strip("[]")


def same_host(host: str, caller: str) -> bool:
    """Whether address `host` is the address `caller` (an IPv4-mapped IPv6 address is its IPv4
    address; any two loopback addresses are this host)."""
    try:
        a, b = ipaddress.ip_address(host), ipaddress.ip_address(caller)
    except ValueError:
        return False  # a name: only addresses are compared, never resolved
    a = getattr(a, "ipv4_mapped", None) or a
    b = getattr(b, "ipv4_mapped", None) or b
    return a == b or (a.is_loopback and b.is_loopback)


@dataclass
class Lane:
    """One client engine of a session, the server engine that writes to it, and its writes running."""

    segment: str
    engine: Any
    index: int  # the server engine's index
    writing: int = 0
    uses: int = 0


class Lanes:
    """A session's lanes (on the event loop: no lock) and its engine writes running."""

    def __init__(self) -> None:
        self.lanes: list[Lane] = []
        #: The session's engine writes not yet returned, whether or not their call still waits.
        self.running: set[Future[int]] = set()

    def submit(self, pool: Executor, write: Callable[..., int], *args: Any) -> asyncio.Future[int]:
        """Run an engine write on `pool`, counted in `running` until it returns; its result, awaitable
        on the event loop (cancelling that await does not stop the write)."""
        done = pool.submit(write, *args)
        self.running.add(done)
        done.add_done_callback(self.running.discard)  # on the write's thread: one atomic set operation
        return asyncio.wrap_future(done)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the writes running now to return; how many still run."""
        running = list(self.running)
        if running:
            await asyncio.wait([asyncio.wrap_future(w) for w in running], timeout=max(timeout_s, 0.0))
        return sum(not w.done() for w in running)

    @contextmanager
    def pick(self) -> Iterator[Lane]:
        """The lane with the fewest writes running (of those, the least used: idle lanes take
        turns), counted as writing until the block ends."""
        lane = min(self.lanes, key=lambda one: (one.writing, one.uses))
        lane.writing += 1
        lane.uses += 1
        try:
            yield lane
        finally:
            lane.writing -= 1
