"""The server's start-up heap, moved out of the cyclic collector's sight once (`kvstore serve` does, at start).

Under load every full (generation 2) collection walks every object the process holds, and most of them
are what start-up made: modules, classes, protobuf descriptors, grpc's and the tiers' tables, none of which
ever becomes garbage. Traced in `kvstore serve` under `kvstore bench load` (16 clients, dev box): a full
collection paused the event loop 18 ms, with every call in flight waiting through it (each client's Lookup
p50 is ~17 ms there, a few ms on a 16-core host): the size of the tail issue 25 item 4 asks to cut
(docs/BENCHMARKS.md, `bench load`). `gc.freeze()` puts those objects in the permanent generation, so a full
collection walks only what was allocated since; the young generations are untouched (gen-0 pauses are
~0.15 ms), and nothing is leaked: what start-up left as garbage is collected first.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect start-up's garbage, then freeze what is left; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
