"""SGLang's per-pool storage interface (v2) for the kvstore backend: KV pages, V4 side pools, the SWA window.

SGLang's hybrid models hand a backend several host pools at once (`PoolTransfer`s):
the KV pages (ALL_PAGES: every page of the prefix), pools derived from them (DeepSeek-V4's
compressed-KV and indexer side pools, ALL_PAGES at the KV pages' host indices) and pools
that matter only at the prefix's end, such as the sliding window (TRAILING_PAGES).
`PoolsV2` answers them for `KVStoreHiCacheStorage`: KV pages are kvstore blocks, a V4
page's side-pool pages are its blocks (sglang_v4_io), the SWA pool's trailing pages one
kvstore snapshot (sglang_swa). Any other pool is refused when it is registered.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from integrations import sglang_swa
from integrations.sglang_keys import KeyLedger
from integrations.sglang_share import V4Sharing
from integrations.sglang_v4_io import V4Pages
from integrations.sglang_v4_pools import SERVED as V4_SIDE_POOLS
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.geometry import ModelGeometry

logger = logging.getLogger(__name__)


class Chain(NamedTuple):
    """A chain from the sequence start through a call's keys."""

    pages: list[bytes]    # page keys (each page's last block hash), prefix pages first
    blocks: list[bytes]   # the block chain hashes of those pages, in order (= pages on one-block pages)
    offset: int           # pages before the call's keys


class PoolsV2:
    """batch_exists_v2 / batch_get_v2 / batch_set_v2 over the backend's client, ledger and pools
    (the attributes and helpers below are the backend's)."""

    client: Client
    ledger: KeyLedger
    geometry: ModelGeometry
    page_size: int
    blocks_per_page: int
    v4: V4Pages | None
    swa_ttl_s: float | None
    stats: dict[str, int]
    sharing: V4Sharing | None

    def _chain(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None) -> Chain | None:
        raise NotImplementedError

    def _extra_keys(self, key: str) -> tuple[str, ...]:
        raise NotImplementedError

    def _pool(self, name: str) -> Any:
        raise NotImplementedError

    def _read_pages(self, pool: Any, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        raise NotImplementedError

    def _write_pages(self, keys: Sequence[str], pages: Sequence[torch.Tensor], *, keep_until_s: float = 0.0,
                     granted: list[Any] | None = None) -> list[bool]:
        raise NotImplementedError

    def _keep_until(self, extra_info: HiCacheStorageExtraInfo | None) -> float:
        raise NotImplementedError

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix: KV pages stored, and for an SWA pool (trailing pages) the longest page
        boundary with a live snapshot. One Lookup answers both."""
        chain = self._chain(keys, extra_info) if keys else None
        if chain is None:
            return PoolTransferResult.empty()
        offset = chain.offset
        wants_swa = any(str(t.name) == PoolName.SWA.value for t in pool_transfers or [])
        swa_keys: list[bytes] = []
        positions: list[int] = []
        if wants_swa:
            for p in range(1, len(keys) + 1):
                t = (offset + p) * self.page_size
                anchor = chain.pages[offset + p - 1]
                swa_keys.append(sglang_swa.key_at(self._swa_anchor(anchor), t, self._extra_keys(anchor.hex())))
                positions.append(t)
        try:
            if self.sharing is None:
                reply = self.client.lookup_hashes(chain.blocks, swa_keys=swa_keys, swa_positions=positions)
                found, swa_at = reply.found_blocks, reply.swa_position
            else:   # the model's rows or SGLang's v4 records; the window is always the latter's
                found, swa_at = self.sharing.lookup(chain.pages, chain.blocks, swa_keys=swa_keys,
                                                    swa_positions=positions)
        except KVStoreError as exc:
            logger.warning("kvstore lookup failed (counted as a miss): %s", exc)
            return PoolTransferResult.empty()
        # A page stored in part (fewer than its blocks) is not found: whole pages only.
        kv_pages = max(0, min(len(keys), found // self.blocks_per_page - offset))
        hits: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            name = str(transfer.name)
            if name == PoolName.SWA.value and transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                at = swa_at
                page = at // self.page_size - offset if at is not None and at % self.page_size == 0 else 0
                pool_ok = {page} if 1 <= page <= kv_pages else set()
            elif self.v4 is not None and name in V4_SIDE_POOLS:
                pool_ok = set(range(1, kv_pages + 1))   # a V4 page's side-pool rows are its blocks
            else:
                pool_ok = set()  # a pool kvstore does not keep is never restorable from it
            if pool_ok:
                hits[name] = max(pool_ok)
            restorable &= pool_ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def _swa_anchor(self, page: bytes) -> bytes:
        """The chain hash a snapshot ending at page `page` is keyed by: the page's own, or with v4 sharing
        the engine layout's chain hash of its last block (so any client of that layout finds the window)."""
        if self.sharing is None:
            return page
        blocks = self.sharing.engine_blocks(page.hex())
        return blocks[-1] if blocks else page

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each transfer's pages: KV pages as blocks, the SWA pool's trailing pages from one snapshot."""
        return self._v2_io(transfers, extra_info, write=False)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Write each transfer's pages: KV pages as blocks, the SWA pool's trailing pages as one snapshot."""
        return self._v2_io(transfers, extra_info, write=True)

    def _v2_io(self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None, *,
               write: bool) -> dict[str, list[bool]]:
        """Each transfer's pages, pool by pool; a pool kvstore does not keep moves nothing (all False)."""
        out: dict[str, list[bool]] = {}
        moved: dict[tuple[Any, ...], list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            name = str(t.name)
            if name == PoolName.SWA.value:
                out[name] = self._swa_io(t, keys, extra_info, write=write)
            elif self.v4 is not None and (name in V4_SIDE_POOLS or name == PoolName.KV.value):
                # Every side pool at once: the first pool's move serves the others (_v4_io).
                out[name] = self._v4_io(t, keys, moved, write=write,
                                        keep_until_s=self._keep_until(extra_info) if write else 0.0)
            elif name == PoolName.KV.value and t.host_indices is not None:
                out[name] = self._kv_io(keys, t.host_indices, write=write)
            else:
                out[name] = [False] * len(keys)
        return out

    def _kv_io(self, keys: list[str], host_indices: torch.Tensor, *, write: bool) -> list[bool]:
        """KV host pages (one kvstore block each) <-> their blocks."""
        pool = self._pool(PoolName.KV.value)
        if not write:
            return self._read_pages(pool, keys, host_indices)
        pages = [pool.get_data_page(int(host_indices[i * self.page_size]), flat=True) for i in range(len(keys))]
        return self._write_pages(keys, pages)

    def _v4_io(self, transfer: PoolTransfer, keys: list[str], moved: dict[tuple[Any, ...], list[bool]], *,
               write: bool, keep_until_s: float = 0.0) -> list[bool]:
        """A V4 side pool's pages: one move serves every side pool of the call at the same keys and slots
        (`moved`), as a V4 page is all of them (sglang_v4_io)."""
        assert self.v4 is not None
        if transfer.host_indices is None:
            return [False] * len(keys)
        at = (tuple(keys), tuple(int(transfer.host_indices[i * self.page_size]) for i in range(len(keys))))
        if at not in moved:
            # A write with a retention hint pins in the Put of its last page (R22); batch_set_v1, the twin
            # call after it, takes that grant from the note (sglang_v4_io) and asks no Lookup.
            moved[at] = self.v4.write(keys, transfer.host_indices, keep_until_s=keep_until_s) if write \
                else self.v4.read(keys, transfer.host_indices)
        return list(moved[at])

    def _swa_io(self, transfer: PoolTransfer, keys: list[str], extra_info: HiCacheStorageExtraInfo | None, *,
                write: bool) -> list[bool]:
        """The trailing SWA pages of one prefix <-> the snapshot at its end (sglang_swa.move).

        The prefix's length comes from SGLang's `prefix_keys` (they and `keys` are one chain
        from the sequence start), else from the ledger's parents of the last key.
        """
        known = keys and ((extra_info is not None and extra_info.prefix_keys is not None)
                          or self.ledger.page(keys[0]) is not None)
        chain = self._chain(keys, extra_info) if known else None   # never guessed: T is in the key
        if chain is None or transfer.host_indices is None:
            return [False] * len(keys)
        pool = self._pool(PoolName.SWA.value)
        if self.v4 is not None:
            swa_client = self.client if self.sharing is None else self.sharing.engine
            pages = [*chain.pages[:-1], self._swa_anchor(chain.pages[-1])]
            done = sglang_swa.move_v4(swa_client, self.geometry, pool, pages, transfer.host_indices, len(keys),
                                      self.page_size, interleaved=self.v4.layout.interleaved, write=write,
                                      ttl_s=self.swa_ttl_s, extra_keys=self._extra_keys(keys[-1]))
        else:
            done = sglang_swa.move(self.client, self.geometry, pool, chain.pages, transfer.host_indices, len(keys),
                                   self.page_size, write=write, ttl_s=self.swa_ttl_s,
                                   extra_keys=self._extra_keys(keys[-1]))
        self.stats["snapshots_written" if write else "snapshots_read"] += int(done)
        return [done] * len(keys)
