"""The fleet's core: many storage nodes, their membership in etcd, and where each run of blocks lives.

Importable by the client and the server alike (no torch, no gateway): `endpoints`
(the etcd endpoints a setting names), `etcd` (one aetcd client failing over
between them, its errors as `kvstore.errors`), `membership` (a node's
registration under a lease, and the live view of every node), `placement`
(rendezvous hashing of runs of blocks over the live nodes' ids). The rules are
numbered in docs/FLEET.md (F1...).
"""
