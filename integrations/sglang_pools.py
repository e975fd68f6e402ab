"""SGLang's per-pool storage interface (v2) for the kvstore backend: KV pages and the SWA window.

SGLang's hybrid models hand a backend several host pools at once (`PoolTransfer`s):
the KV pages (ALL_PAGES: every page of the prefix) and pools that matter only at the
prefix's end, such as the sliding window (TRAILING_PAGES). `PoolsV2` answers them for
`KVStoreHiCacheStorage`: KV pages are kvstore blocks, the SWA pool's trailing pages one
kvstore snapshot (sglang_swa). Any other pool is refused when it is registered.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

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
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.geometry import ModelGeometry

logger = logging.getLogger(__name__)


class PoolsV2:
    """batch_exists_v2 / batch_get_v2 / batch_set_v2 over the backend's client, ledger and pools
    (the attributes and helpers below are the backend's)."""

    client: Client
    ledger: KeyLedger
    geometry: ModelGeometry
    page_size: int
    swa_ttl_s: float | None
    stats: dict[str, int]

    def _chain(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None) -> tuple[list[bytes], int] | None:
        raise NotImplementedError

    def _extra_keys(self, key: str) -> tuple[str, ...]:
        raise NotImplementedError

    def _pool(self, name: str) -> Any:
        raise NotImplementedError

    def _read_pages(self, pool: Any, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        raise NotImplementedError

    def _write_pages(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        raise NotImplementedError

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix: KV pages stored, and for an SWA pool (trailing pages) the longest page
        boundary with a live snapshot. One Lookup answers both."""
        chain = self._chain(keys, extra_info) if keys else None
        if chain is None:
            return PoolTransferResult.empty()
        hashes, offset = chain
        wants_swa = any(str(t.name) == PoolName.SWA.value for t in pool_transfers or [])
        swa_keys: list[bytes] = []
        positions: list[int] = []
        if wants_swa:
            for p in range(1, len(keys) + 1):
                t = (offset + p) * self.page_size
                anchor = hashes[offset + p - 1]
                swa_keys.append(sglang_swa.key_at(anchor, t, self._extra_keys(anchor.hex())))
                positions.append(t)
        try:
            reply = self.client.lookup_hashes(hashes, swa_keys=swa_keys, swa_positions=positions)
        except KVStoreError as exc:
            logger.warning("kvstore lookup failed (counted as a miss): %s", exc)
            return PoolTransferResult.empty()
        kv_pages = max(0, min(len(keys), reply.found_blocks - offset))
        hits: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            name = str(transfer.name)
            if name == PoolName.SWA.value and transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                at = reply.swa_position
                page = at // self.page_size - offset if at is not None and at % self.page_size == 0 else 0
                pool_ok = {page} if 1 <= page <= kv_pages else set()
            else:
                pool_ok = set()  # a pool kvstore does not keep is never restorable from it
            if pool_ok:
                hits[name] = max(pool_ok)
            restorable &= pool_ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each transfer's pages: KV pages as blocks, the SWA pool's trailing pages from one snapshot."""
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            name = str(t.name)
            if name == PoolName.SWA.value:
                out[name] = self._swa_io(t, keys, extra_info, write=False)
            elif name == PoolName.KV.value and t.host_indices is not None:
                out[name] = self._read_pages(self._pool(name), keys, t.host_indices)
            else:
                out[name] = [False] * len(keys)
        return out

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Write each transfer's pages: KV pages as blocks, the SWA pool's trailing pages as one snapshot."""
        out: dict[str, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or [])
            name = str(t.name)
            if name == PoolName.SWA.value:
                out[name] = self._swa_io(t, keys, extra_info, write=True)
            elif name == PoolName.KV.value and t.host_indices is not None:
                pool = self._pool(name)
                pages = [pool.get_data_page(int(t.host_indices[i * self.page_size]), flat=True)
                         for i in range(len(keys))]
                out[name] = self._write_pages(keys, pages)
            else:
                out[name] = [False] * len(keys)
        return out

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
        chain_hashes = chain[0]
        done = sglang_swa.move(self.client, self.geometry, self._pool(PoolName.SWA.value), chain_hashes,
                               transfer.host_indices, len(keys), self.page_size, write=write, ttl_s=self.swa_ttl_s,
                               extra_keys=self._extra_keys(keys[-1]))
        self.stats["snapshots_written" if write else "snapshots_read"] += int(done)
        return [done] * len(keys)

