"""The SWA direct path's reports already counted (`SwaPool.ReportDirect`), so that one sent
again is counted once.

A client whose report failed (its deadline passed, the connection dropped) cannot tell
whether the gateway counted it, so it sends the same report, under the same id, again
(kvstore/client/swa_report.py). The gateway remembers each tenant's report ids for `KEEP_S`
(a client sends again within seconds: at its next report or its `stats()`), at most
`MOST_PER_TENANT` of them, the oldest forgotten first: what one tenant sends cannot push
out another's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

#: A report id's length: random bytes the client draws per report (proto/kvstore/v1/swa.proto).
REPORT_ID_BYTES = 16
#: How long an id is remembered: a report sent again later than this (the gateway was out of
#: reach that long) is counted again.
KEEP_S = 300.0
#: Most ids remembered per tenant (16 bytes and a float each: a few MB at most).
MOST_PER_TENANT = 65536


class SeenReports:
    """Report ids seen per tenant, each for `keep_s` (the servicer's event loop alone uses it).

    Args:
        clock: monotonic seconds (injected in tests).
        keep_s: how long an id is remembered.
        most: most ids remembered per tenant.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, keep_s: float = KEEP_S,
                 most: int = MOST_PER_TENANT) -> None:
        self._clock = clock
        self._keep_s = keep_s
        self._most = most
        self._seen: dict[str, OrderedDict[bytes, float]] = {}

    def first(self, tenant: str, report_id: bytes) -> bool:
        """Whether `report_id` is new for `tenant` (it is remembered from now on); False for one
        seen within `keep_s`."""
        now = self._clock()
        ids = self._seen.setdefault(tenant, OrderedDict())
        while ids and next(iter(ids.values())) < now - self._keep_s:
            ids.popitem(last=False)
        if report_id in ids:
            return False
        ids[report_id] = now
        while len(ids) > self._most:
            ids.popitem(last=False)
        return True

    def remembered(self, tenant: str) -> int:
        """How many of `tenant`'s ids are remembered now (expired ones go at its next report)."""
        return len(self._seen.get(tenant, ()))
