"""The gRPC front of kvstore: servicers, request validation, the server process.

Imports `tiers` and the core, never `replay`, `integrations` or torch
(tests/kvstore/test_wire.py). Servicers translate messages and call the tiers;
rules live in the modules they call. Its modules:

- `server`: the process (KVStore, SwaPool, Transfer, Admin, health and reflection
  on one port; TLS; clean SIGTERM). Interceptors, outermost first: `metrics` (via
  `call_outcome`), `auth`, `undecodable`, `quotas`.
- `kvstore_servicer` (the KVStore service), `validate` (everything that arrives
  over the wire), `status` (errors to gRPC status, in one place), `replies` (Get
  and Fetch replies serialized off the event loop), `grpc_log` (grpc.aio's error
  for a reply the client stopped waiting for, as one DEBUG line).
- `swa_servicer` and `swa_reports` (the SWA pool's service and the direct path's
  reports, each counted once; docs/SWA_POOL.md).
- Transfers (docs/TRANSFER.md): `transfer_servicer` over `transfer_session_table`
  (who may name which session and region), `transfer_sessions` (one session's
  batches and bounds), `transfer_regions` (a sealed memfd mapped safely),
  `transfer_engine` (batch reads and writes), `transfer_fetch` (the striped
  Fetch), `transfer_ring`, `transfer_ring_native`, `transfer_ring_context` (the
  request ring), `transfer_bulk`, `transfer_bulk_lanes`, `transfer_bulk_map` (the
  Mooncake bulk transport).
- Operators (docs/SECURITY.md, POLICIES.md, METRICS.md, OPERATIONS.md): `auth`
  and `tenants` (a token becomes a `Caller`; the tenants file, reloaded live),
  `admin_servicer` with `policies`, `audit` and `quotas`, `tenant_export` and
  `export_format` (a tenant's cache as a file), `hit_stats` and `resume_counters`
  (`kvstore stats`), `metrics`, `metrics_collector`, `metrics_tenants` (the
  Prometheus endpoint) and `request_log` (one JSON line per failed call).
"""
