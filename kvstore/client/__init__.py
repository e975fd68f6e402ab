"""The worker-side clients of a kvstore server, one module each, over one shared connection.

Calls and their plumbing:

- `connection`: the channel and the call plumbing (deadlines, gRPC status to
  `kvstore.errors`, streaming calls) and what the server said at connect time.
- `store`: `Client`, lookup, put and get of global-KV blocks (its `swa` and
  `transfer()` hand its connection to the two clients below).
- `blocks`: the KVStore block calls `store` and `transfer` both make.
- `puts`, `resume_report`: a Put on the wire and the ReportResume call, for `store`.
- `arguments`: the checks of what callers hand the clients.
- `chain_memo`: the chains a connection hashed, so a conversation's next turn hashes only its
  new tokens; `lookup_anchors`: the chains the server found, so its Lookup sends only the new
  hashes (docs/PREFIX_HASHING.md, "The next turn").
- `admin`: the Admin service (policies, audit log, purge, export, import);
  `worker`: the Worker service (run a resume plan on an engine).

The SWA pool (docs/SWA_POOL.md):

- `swa`: `SwaClient`, snapshots through the gateway, or one of the direct paths:
- `swa_direct`, `swa_put`, `swa_resp`, `swa_report`: the Redis direct path (the
  tenant's ACL user, sealed records, GET replies read into buffers of their own,
  the report to the gateway's counters);
- `swa_shm`: the embedded pool's same-host shared-memory path.

Batched transfers (docs/TRANSFER.md):

- `transfer`: `TransferSession`, its regions and paths; `transfer_batches`: its
  batches (`read`, `write`, `fetch`, `wait_all`), `SessionBatches`, the session's base class;
- `transfer_path`: the seams (`Transfer`, `TransferPath`, `SessionView`, through
  which the paths see their session without importing `transfer`);
- `transfer_shm`, `transfer_stream`, `transfer_bulk`: the shared-memory, striped
  gRPC and bulk (Mooncake) paths; `transfer_ring`, `transfer_ring_request`: the
  request ring and its request bytes.

A fleet of nodes (docs/FLEET.md, "Data path"): `Client("etcd://...")` is a `FleetClient`:

- `fleet`: `FleetClient`, routing each call; `fleet_address`: the `etcd://` address;
  `fleet_view`: the live nodes (the membership view on a thread); `fleet_nodes`: one
  connection per node and the read order of replicas; `fleet_chain`: a chain's hashes
  run by run; `fleet_put`, `fleet_lookup`, `fleet_get`: the replicated Put, the Lookup
  across runs, the Get with failover; `fleet_refresh`: the refreshes of the other copies;
  `fleet_swa`: the SWA pool the nodes share (F44-F45); `fleet_transfer`: a transfer
  session's fetch, run by run (F49); restore's direct paths run by run from this host's
  node are `restore`'s (F48).
- `retry`: `Retry`, the one retry policy (capped, jittered backoff over retryable errors).

Direct restore on the store's host (docs/DIRECT_RESTORE.md):

- `colocated`, `colocated_read`, `colocated_memory`: the same-host reader of the
  store's LMDB file (the one client code allowed `kvstore.native.records` and `kvstore.native.blockcopy`:
  the on-disk format);
- `gpu_gather`, `gpu_rounds`, `gpu_pinned`, `gpu_layout`, `gpu_kernels`: its GPU
  gather (registered chunks under a pinned budget, a read's columns, Triton kernels);
- `restore`: one call over direct-gpu, direct-cpu, shm and gRPC.

Imports point one way: store -> swa, transfer -> blocks -> connection -> arguments
(tests/kvstore/test_wire.py finds any circle).
"""

from kvstore.client.connection import Connection, TlsOptions
from kvstore.client.fleet import FleetClient  # registers the etcd:// scheme with Client
from kvstore.client.retry import ExponentialBackoff, Retry
from kvstore.client.store import Client, GetResult, LookupResult, PutResult, as_buffer
from kvstore.client.swa import SwaClient, SwaPutResult
from kvstore.client.transfer import PATHS, TransferSession
from kvstore.client.transfer_path import Transfer, TransferPath
from kvstore.errors import KVStoreError

__all__ = [
    "PATHS",
    "Client",
    "Connection",
    "ExponentialBackoff",
    "FleetClient",
    "GetResult",
    "KVStoreError",
    "LookupResult",
    "PutResult",
    "Retry",
    "SwaClient",
    "SwaPutResult",
    "TlsOptions",
    "Transfer",
    "TransferPath",
    "TransferSession",
    "as_buffer",
]
