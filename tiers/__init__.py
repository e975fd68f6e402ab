"""Storage: the NVMe block tier on LMDB and the SWA DRAM pool's backends.

Imports the core (`kvstore`) only, never `gateway` or `replay`, and never torch
(tests/kvstore/test_wire.py). Its modules, one idea each:

The NVMe tier (rules R1-R21 in docs/RETENTION.md):

- `store`: the seam the gateway sees a store through (`BlockStore`, with the
  `MappedReads` and `ManagedStore` capabilities; docs/ARCHITECTURE.md).
- `lmdb_tier`: `LmdbBlockTier`, global-KV blocks in LMDB with the 72-hour
  retention guarantee, and its one bounded executor for blocking LMDB work;
  `lmdb_map` (the read txns of its map it lends the same-host transfer paths).
- `retention` (what may go, and when; the guarded retention clock), `eviction`
  (making room, least recently used first), `leases` (Lookup leases that pin a prefix).
- `puts` (a Put's write transaction), `block_txn` (records, LRU index and usage
  changed together), `reads` (verified and staged reads), `refresh` (group commit
  of retention refreshes), `chains` (how much of a chain is stored, R15, with its memo).
- `records` (the on-disk record layouts), `usage` (the usage totals, recounted
  and repaired at open), `tally` and `accounting` (counters, the write rate, stats).
- `damage` (blocks on damaged pages met while serving, R16), `purge` (R20, and
  corrupt blocks with their descendants, R10), `namespaces` (per-tenant usage,
  token-hours, retention and quota, R17-R19), `export` (a namespace's records out
  and back in, R21).
- `blockcopy`: the transfer path's verify-and-copy loop, native in `_blockcopy.c`;
  `ring`: the request ring's native server (`_ring.c`); `allocator` (glibc told to keep
  the memory a Put frees for the next one; `kvstore serve` does at start).

The data dir (docs/OPERATIONS.md): `datadir` (its OS lock, identity and the checks
before LMDB maps it), `lmdb_pages` (LMDB's file read page by page, never mapped),
`integrity` with `integrity_walk`, `integrity_plan`, `integrity_repair` and
`integrity_report` (`kvstore check` and `--repair`).

The SWA pool (docs/SWA_POOL.md): `swa_pool` (the ABC, its backends by name, the
cap), `swa_memory` (the embedded pool) over `swa_shm` (per-tenant shared-memory
arenas), `swa_shm_server` and `swa_shm_session` (the shared-memory control
server and what each request does, through a Protocol so the server never
imports the pool), `swa_redis` (Redis and Redis Cluster), `swa_acl` (the direct
path's per-tenant Redis users), `swa_cache` (records sealed with geometry and
checksum; a miss is never an error), `swa_digest` (checksums and arena copies).
"""
