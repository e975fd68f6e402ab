"""How soon the event loop gets the GIL back from the server's other threads (`kvstore serve` sets it, at start).

A small Lookup reads LMDB's index on the event loop (gateway/kvstore_servicer.py, INLINE_LOOKUP_BLOCKS), and
py-lmdb drops the GIL around each read. When an LMDB thread (a Put's plan, a group commit's inserts) takes it
meanwhile, the loop waits until that thread blocks or the interpreter forces a switch, after
`sys.getswitchinterval()` (5 ms by default): one such wait is longer than the whole Lookup. Traced in
`kvstore serve` under `kvstore bench load` (16 clients, dev box): the slowest 2% of the inline index reads took
2-9 ms of wall for 0.2 ms of CPU; with the interval at 0.5 ms, in four alternating pairs, the Lookup handler's p99
and the clients' Lookup p99/p50 were lower in three (medians 6.1 -> 4.0 ms, 3.44 -> 2.54; docs/BENCHMARKS.md,
`bench load`, issue 25 item 4). The loop holds the GIL ~97% of the time
it is held at all (py-spy --gil), so the shorter interval costs the LMDB threads little: they run short stretches
of Python between their blocking calls.
"""

from __future__ import annotations

import sys

#: Seconds a thread waiting for the GIL waits before it asks the holder to let go (CPython's default: 0.005).
SERVER_SWITCH_INTERVAL_S = 0.0005


def shorten_gil_switch_interval(interval_s: float = SERVER_SWITCH_INTERVAL_S) -> float:
    """Set the interpreter's GIL switch interval to `interval_s` for this process; returns the one before."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    return before
