"""The fleet client's (the router's) counters, in prometheus-client's process registry (docs/METRICS.md, "Fleet").

A worker that routes through `kvstore.Client("etcd://...")` counts here, in
prometheus_client's default `REGISTRY`, shared by every FleetClient of the
process: failovers (a run's read moved on to another replica after a failure
or a miss), retry rounds (every replica asked once, then a backoff), Puts that
raised PutNotReplicated, and failed calls per node. The client starts no HTTP
server: a worker exposes them with its own endpoint, e.g.
`prometheus_client.start_http_server(9465)`, or its framework's (vLLM's
/metrics serves the default registry).

Labels are bounded: `op` by the code (get, lookup, put), `node` by the fleet's
node ids (a node wiped and started again is a new id).
"""

from __future__ import annotations

from prometheus_client import Counter

FAILOVERS = Counter("kvstore_fleet_client_failovers", "Reads of a run that moved on to another replica after a "
                    "node failed the call or lacked a block, by operation.", ["op"])
RETRIES = Counter("kvstore_fleet_client_retries", "Retry rounds (every replica asked, then a backoff), by "
                  "operation.", ["op"])
NOT_REPLICATED = Counter("kvstore_fleet_client_put_not_replicated", "Fleet Puts that raised PutNotReplicated "
                         "(a copy failed after the retry policy's rounds).")
NODE_ERRORS = Counter("kvstore_fleet_client_node_errors", "Calls to a node that failed (unreachable, timed out, "
                      "refused), by node id.", ["node"])


def failover(op: str) -> None:
    """Count a read of a run moving on to the next replica."""
    FAILOVERS.labels(op).inc()


def retry_round(op: str) -> None:
    """Count a retry round."""
    RETRIES.labels(op).inc()


def not_replicated() -> None:
    """Count a Put that raised PutNotReplicated."""
    NOT_REPLICATED.inc()


def node_error(node_id: str) -> None:
    """Count a failed call to `node_id`."""
    NODE_ERRORS.labels(node_id).inc()
