"""kvstore: KV-cache storage and transfer for long-context LLM serving; this package is the core.

The core is importable without a server and without torch (docs/ARCHITECTURE.md
has the map). It imports nothing of `tiers`, `gateway`, `replay` or
`integrations`, except where tests/kvstore/test_wire.py allows it by name (the
same-host reader's on-disk format); `cli.py` and `bench/` are the composition
root and import every layer, lazily. Its modules, one idea each:

- `geometry`: the model's cache geometry from its config.json (which layers write
  global KV, row and block sizes, the fingerprint in every key; docs/FORMAT.md).
- `prefix`: chained SHA-256 block hashes and storage keys (docs/PREFIX_HASHING.md).
- `swa_snapshot`: an SWA snapshot's size, key, resume rules and record (torch-free).
- `transfer`: transfer descriptors, their groups and results; `transfer_ring`: the
  request ring's layout and futex, shared by client and server; `region`: a
  client's sealed memfd (docs/TRANSFER.md).
- `errors`: one error hierarchy, `retryable` and a hint, and the one table to gRPC status.
- `config`: one settings object from TOML and the environment; `config_sections` its
  frozen sections; `config_ranges` the range of every number.
- `clock`: injected wall and monotonic time; `host`: the CPUs the process may use
  (every default sized to cores reads it); `protowire`: varints and length
  prefixes for the few messages written by hand; `api_tokens`: the tenants'
  token file (docs/SECURITY.md); `side_files`: the data dir's JSON side files,
  read bounded; `counted`: counted nouns in what kvstore prints.
- `codec/`: the model's own bytes (rows, blocks, snapshots; docs/CODEC.md), torch.
- `client/`: the worker-side clients over one connection (its docstring lists them).
- `fleet/`: membership in etcd and placement over many nodes.
- `commands/`: the operator commands, one module each; `cli`: the `kvstore`
  command; `bench/`: `kvstore bench NAME` (docs/BENCHMARKS.md).

`kvstore.Client` is imported lazily so that `import kvstore.geometry` (or the
codec) does not pull in gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.version import __version__

if TYPE_CHECKING:
    from kvstore.client import Client

__all__ = ["Client", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from kvstore.client import Client

        return Client
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
