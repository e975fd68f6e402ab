"""Resuming a conversation: the planner, its cost model, the resumer, and the reference worker.

The planner side is torch-free and imports only the core (`kvstore`, its client
included), so it runs beside the storage client; `model/` and `worker/` use
torch. Nothing here imports `tiers`, and only `worker.service` imports `gateway`:
the server's error-to-status wrapper and its undecodable-request interceptor, so
the worker's service answers as the store's does. Its modules:

- `plan` (the `Plan` record and its actions), `cost` (fetch bytes at a measured
  GB/s against tokens at the worker's rate, and the tenant's fidelity),
  `planner` (one leased Lookup, the cheapest usable option, each decision
  explained), `plan_command` (`kvstore plan`), `resume` (the `Resumer`: plan, run,
  fall back to a full prefill) (docs/PLANNER.md).
- `model/`: the torch reference model of the V4.1 cache structure (docs/MODEL.md).
- `worker/`: the `kvstore.v1.Worker` service that runs plans with it (`kvstore
  worker`; docs/WORKER.md).
- `fidelity` (bounded against exact replay, behind `kvstore bench replay`;
  docs/REPLAY.md) and `corpus` (the tiny model's text).
"""
