"""The worker-side clients of a kvstore server, one module each, over one shared connection.

- `connection`: the channel and the call plumbing (deadlines, gRPC status to
  `kvstore.errors`, streaming calls) and what the server said at connect time.
- `store`: `Client`, lookup, put and get of global-KV blocks (its `swa` and
  `transfer()` hand its connection to the two clients below).
- `swa`: `SwaClient`, SWA snapshots in the server's pool.
- `transfer`: `TransferSession`, batched transfers through registered regions: the
  session, its regions and paths; `transfer_batches`: its batches (`read`, `write`,
  `fetch`, `wait_all`), `SessionBatches`, the session's base class.
- `blocks`: the KVStore block calls `store` and `transfer` both make.
- `puts`, `resume_report`: a Put on the wire and the ReportResume call, for `store`.
- `arguments`: the checks of what callers hand the clients.

Imports point one way: store -> swa, transfer -> blocks -> connection -> arguments.
"""

from kvstore.client.connection import Connection, TlsOptions
from kvstore.client.store import Client, GetResult, LookupResult, PutResult, as_buffer
from kvstore.client.swa import SwaClient, SwaPutResult
from kvstore.client.transfer import PATHS, TransferSession
from kvstore.client.transfer_path import Transfer, TransferPath
from kvstore.errors import KVStoreError

__all__ = [
    "PATHS",
    "Client",
    "Connection",
    "GetResult",
    "KVStoreError",
    "LookupResult",
    "PutResult",
    "SwaClient",
    "SwaPutResult",
    "TlsOptions",
    "Transfer",
    "TransferPath",
    "TransferSession",
    "as_buffer",
]
