"""What every request ring of a server shares (`RingContext`): the tier, sessions, limits,
counters and the reader slots the rings take turns at.

Its own module so that the Python ring server (`gateway.transfer_ring`) and the native one
(`gateway.transfer_ring_native`) both take it from here, and neither from the other.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.hit_stats import HitStats
    from gateway.transfer_session_table import SessionTable
    from gateway.validate import Layout
    from tiers.ring import Mapping
    from tiers.store import MappedStore


@dataclass(kw_only=True)
class RingContext:
    """What every ring of a server shares: the tier, sessions, limits and counters."""

    tier: MappedStore
    table: SessionTable
    layouts: dict[str, Layout]
    limit: int
    hits: HitStats | None = None
    #: The quota interceptor's request rate (`gateway.quotas.RequestRate`), or None: not charged.
    rate: Any = None
    #: Bounds the rings reading at once (each holds an LMDB reader slot while it copies).
    slots: threading.BoundedSemaphore | None = None
    #: Rings waiting for one of `slots` (`take_slot`): a hot ring then gives its kept slot back.
    waiting: int = 0
    waiting_lock: threading.Lock = field(default_factory=threading.Lock)

    #: The tier's mapping of data.mdb for the native server (`transfer_ring_native.tier_mapping`).
    mapping: Mapping | None = None
    mapping_tried: bool = False
    #: Whether rings are served natively where `kvstore.native._ring` is built (False: the Python server only).
    native: bool = True

    def take_slot(self) -> None:
        """One of `slots`, waiting for it when none is free (counted in `waiting` meanwhile)."""
        if self.slots is None or self.slots.acquire(blocking=False):
            return
        with self.waiting_lock:
            self.waiting += 1
        try:
            self.slots.acquire()
        finally:
            with self.waiting_lock:
                self.waiting -= 1
