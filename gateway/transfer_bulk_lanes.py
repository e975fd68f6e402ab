"""Who the bulk transport's server engines write to (docs/TRANSFER.md "Bulk transport"):
client engine names ("host:port", checked to be on the calling host) and a session's lanes.

A session's lanes are its client engines, each tied to one of the server's engines when
named (`OpenBulk`, once per engine). Mooncake 0.3.13's TCP transport moves all of one
engine's bytes on one io thread, so a session on a host with many cores fetches through
several engine pairs at once; each write goes through the lane with the fewest writes
running.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidArgument

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
    """A session's lanes (on the event loop: no lock)."""

    def __init__(self) -> None:
        self.lanes: list[Lane] = []

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
