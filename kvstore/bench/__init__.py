"""Benchmarks, one module per capability, run by `kvstore bench NAME`.

Each module defines `add_arguments(parser)` and `run(args, progress) -> Report`.
Modules are imported only when chosen, so one benchmark's heavy imports (torch,
redis) do not slow another.
"""

from __future__ import annotations

#: Benchmark name -> module path. A module is imported only when it runs.
BENCHES: dict[str, str] = {
    "store": "kvstore.bench.store",
    "lookup": "kvstore.bench.lookup",
    "codec": "kvstore.bench.codec",
    "transfer": "kvstore.bench.transfer",
    "swa": "kvstore.bench.swa",
    "load": "kvstore.bench.load",
    "replay": "kvstore.bench.replay",
    "fleet": "kvstore.bench.fleet",
    "fleet-swa": "kvstore.bench.fleet_swa",
    "fleet-gateway": "kvstore.bench.fleet_gateway",
    "trace": "kvstore.bench.trace",
    "trace-record": "kvstore.bench.trace_record",
    "transcode": "kvstore.bench.transcode",
}
