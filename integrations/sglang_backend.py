"""kvstore as SGLang's HiCache storage backend (the L3 tier under SGLang's host memory).

Run SGLang with it (SGLang 0.5.23 refuses a custom registered name; its "dynamic"
backend loads this class from the extra config):

    SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python python -m sglang.launch_server ... \\
        --page-size 64 --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "integrations.sglang_backend", "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1, "target": "127.0.0.1:50051"}'

with `SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python` in its environment (the default Rust
tree core hashes pages natively, past kvstore's keys; the backend refuses to start without it).

Extra config (`HiCacheStorageConfig.extra_config`), each checked at start (ConfigError):
- `target` (required): the kvstore server, host:port.
- `token`: the tenant's API token (default: $KVSTORE_TOKEN; none on a server without auth).
- `namespace`, `geometry`: the tenant and geometry (default: the token's tenant, the server's default).
- `timeout_s`: deadline of each call (default 30).
- `ledger_pages`: pages whose tokens are remembered for Put (integrations.sglang_keys; default 262,144).
- `swa_ttl_s`: lifetime asked for SWA snapshots (default and most: the server's `swa.ttl_s`).
- `interface_v1`: 1 makes SGLang call batch_get_v1/batch_set_v1 (zero-copy into the host pool).

Keys: while attached, SGLang's page keys are kvstore chain hashes in hex (sglang_keys), so
a prompt stored by any kvstore client (the vLLM connector, `kvstore.Client.put`) is found
here, and the other way round. A caller computes them from token ids as
`[h.hex() for h in kvstore.Client(target).hashes(token_ids)]`, one per full 64-token page.

Outside SGLang (the one-cache test): build it as SGLang does, through the factory, with any
object that has the host pool's page interface (`page_size` = 64, `get_dummy_flat_data_page()`,
`get_data_page(i, flat=True)`, `set_from_flat_data_page(i, page)`; tests/integrations/
test_sglang_support.py has `PagePool`), with SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python set:

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name="m", extra_config={"backend_name": "kvstore", "interface_v1": 1,
                               "module_path": "integrations.sglang_backend",
                               "class_name": "KVStoreHiCacheStorage", "target": target})
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    keys = [h.hex() for h in kvstore.Client(target).hashes(token_ids)]
    backend.batch_exists(keys)                                          # leading pages stored
    backend.batch_get_v1(keys, torch.arange(len(keys) * 64))            # page i -> pool token slot 64 i

Data: a page of the KV host pool (`get_data_page(i, flat=True)`) is one kvstore block
byte for byte, so the pool's page must be `Client.block_bytes` long (56,960 B for
V4.1-Flash: the model's rows, docs/BLOCK_SIZE.md); an SWA pool page is layer-major
window rows (sglang_swa). A pool of another size or another name is refused at
registration with ConfigError rather than served wrongly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)

from integrations import sglang_config, sglang_keys, sglang_swa
from integrations.sglang_pools import PoolsV2
from kvstore.client import Client
from kvstore.errors import ConfigError, KVStoreError
from kvstore.geometry import resolve
from kvstore.v1 import kvstore_pb2 as pb

logger = logging.getLogger(__name__)


class KVStoreHiCacheStorage(PoolsV2, HiCacheStorage):
    """SGLang HiCache storage in a kvstore server: KV pages as kvstore blocks, SWA pages as snapshots.

    Args:
        storage_config: SGLang's storage config; its `extra_config` holds the settings above.
        kwargs: what the dynamic factory passes along (unused).

    Raises:
        ConfigError: a missing or bad setting.
        Unavailable, Unauthenticated, ...: the server could not be reached or refused the token.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        s = sglang_config.settings(storage_config.extra_config)
        sglang_config.check_tree_core()
        sglang_config.check_topology(storage_config)
        self.storage_config = storage_config
        self.client = Client(s["target"], namespace=s["namespace"], geometry=s["geometry"],
                             timeout_s=float(s["timeout_s"]), token=s["token"])
        try:
            self.geometry = resolve(self.client.geometry)
        except KVStoreError:
            self.client.close()
            raise
        self.swa_ttl_s: float | None = s["swa_ttl_s"]
        self.ledger = sglang_keys.KeyLedger(self.client.root, self.client.block_tokens, capacity=s["ledger_pages"])
        sglang_keys.install(self.ledger)
        self.page_size = self.client.block_tokens
        self.metrics = storage_config.enable_storage_metrics
        self._pages_gb = self.client.block_bytes / 1e9
        self._window: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                                "backup_bandwidth": []}
        #: Counters since start (`counters()`): pages found, read and written, snapshots, unknown keys, failures.
        self.stats = {"exists_calls": 0, "pages_found": 0, "pages_read": 0, "pages_written": 0, "write_failures": 0,
                      "unknown_keys": 0, "snapshots_read": 0, "snapshots_written": 0}

    # -- pools -----------------------------------------------------------------

    def _check_kv_pool(self, pool: Any, name: str | None = None) -> None:
        sglang_config.check_not_deepseek_v4(pool, name, self.client.block_tokens)
        page_size = int(getattr(pool, "page_size", 0))
        if page_size != self.client.block_tokens:
            raise ConfigError(f"SGLang's page size is {page_size} tokens; kvstore blocks are "
                              f"{self.client.block_tokens}: start SGLang with --page-size {self.client.block_tokens}")
        if not callable(getattr(pool, "get_dummy_flat_data_page", None)):
            raise ConfigError(f"SGLang's KV host pool ({type(pool).__name__}) has no page data interface "
                              "(get_dummy_flat_data_page): the kvstore backend stores whole KV host pages")
        page = pool.get_dummy_flat_data_page()
        nbytes = page.numel() * page.element_size()
        if nbytes != self.client.block_bytes:
            raise ConfigError(f"SGLang's KV host page is {nbytes} B; a kvstore block of {self.client.geometry} is "
                              f"{self.client.block_bytes} B (its rows, docs/BLOCK_SIZE.md): this model's pages "
                              "cannot be stored as kvstore blocks")

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor (KV) host pool: its pages must be kvstore blocks (ConfigError otherwise)."""
        self._check_kv_pool(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """An extra host pool: KV (blocks) or SWA (snapshots); any other is refused with ConfigError."""
        name = str(host_pool_name)
        sglang_config.check_not_deepseek_v4(host_pool, name, self.client.block_tokens)
        if name == PoolName.KV.value:
            self._check_kv_pool(host_pool, name)
        elif name == PoolName.SWA.value:
            if int(host_pool.page_size) != self.page_size:
                raise ConfigError(f"SGLang's SWA host pool has {host_pool.page_size}-token pages; the kvstore "
                                  f"backend needs the KV page size, {self.page_size}")
            page = host_pool.get_dummy_flat_data_page()
            sglang_swa.check_swa_page(self.geometry, int(host_pool.page_size), page.numel() * page.element_size())
        else:
            raise ConfigError(f"SGLang host pool {name!r} has no kvstore counterpart; the kvstore backend "
                              f"stores {PoolName.KV.value!r} (blocks) and {PoolName.SWA.value!r} (snapshots)")
        super().register_mem_host_pool_v2(host_pool, name)

    def _pool(self, name: str) -> Any:
        pools = getattr(self, "registered_pools", {})
        if name in pools:
            return pools[name]
        if name == PoolName.KV.value and hasattr(self, "mem_pool_host"):
            return self.mem_pool_host
        raise ConfigError(f"no SGLang host pool {name!r} was registered with the kvstore backend")

    # -- keys ------------------------------------------------------------------

    def _chain(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None) -> tuple[list[bytes], int] | None:
        """The chain hashes from the sequence start through `keys`, and where `keys` begin in it.

        kvstore's Lookup counts a chain from its root (R15), so the pages before `keys`
        come along: SGLang's `prefix_keys` when it passes them, else the ledger's parents.
        None when a key is not a kvstore hash or a known page's chain cannot be traced to its start.
        """
        try:
            hashes = [bytes.fromhex(k) for k in keys]
            prefix_keys = extra_info.prefix_keys if extra_info is not None else None
            if prefix_keys is not None:
                prefix = [bytes.fromhex(k) for k in prefix_keys]
            else:
                # Keys the ledger never hashed (another client's) are taken to start at the root:
                # the server counts them only if they really are a chain from there (R15).
                entry = self.ledger.page(keys[0]) if keys else None
                found = [] if entry is None or entry.parent == self.client.root else \
                    self.ledger.chain_to_root(entry.parent.hex())
                if found is None:
                    return None
                prefix = found
        except ValueError:
            return None
        if any(len(h) != 32 for h in hashes) or any(len(h) != 32 for h in prefix):
            return None
        return prefix + hashes, len(prefix)

    def _extra_keys(self, key: str) -> tuple[str, ...]:
        """The kvstore extra keys of the chain `key` is in (a salted request's seed key), from the ledger."""
        entry = self.ledger.page(key)
        return entry.extra_keys if entry is not None else ()

    # -- KV pages --------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of `keys` the store holds (their chain from the start included)."""
        self.stats["exists_calls"] += 1
        if not keys:
            return 0
        chain = self._chain(keys, extra_info)
        if chain is None:
            self.stats["unknown_keys"] += 1
            return 0
        hashes, offset = chain
        try:
            found = self.client.lookup_hashes(hashes).found_blocks
        except KVStoreError as exc:
            logger.warning("kvstore lookup failed (counted as a miss): %s", exc)
            return 0
        hit = max(0, min(len(keys), found - offset))
        self.stats["pages_found"] += hit
        return hit

    def exists(self, key: str) -> bool:
        """Whether the page `key` and every page before it are stored."""
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read the pages of `keys` into the KV host pool at `host_indices` (page i at host_indices[i x page])."""
        start = time.perf_counter()
        results = self._read_pages(self._pool(PoolName.KV.value), keys, host_indices)
        self._measure("prefetch", sum(results), start)
        return results

    def _measure(self, kind: str, pages: int, start: float) -> None:
        """One call's pages and GB/s for SGLang's storage metrics (--enable-storage-metrics)."""
        if self.metrics and pages:
            self._window[f"{kind}_pgs"].append(pages)
            self._window[f"{kind}_bandwidth"].append(pages * self._pages_gb / max(time.perf_counter() - start, 1e-9))

    def _read_pages(self, pool: Any, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        results = [False] * len(keys)
        try:
            hashes = [bytes.fromhex(k) for k in keys]
        except ValueError:
            return results
        dummy = pool.get_dummy_flat_data_page()
        try:
            for index, status, data in self.client.stream(hashes):
                if status != pb.BLOCK_STATUS_FOUND or len(data) != self.client.block_bytes:
                    continue
                page = sglang_swa.read_only(data).view(dummy.dtype)  # copied into the pool by SGLang
                pool.set_from_flat_data_page(int(host_indices[index * self.page_size]), page)
                results[index] = True
        except KVStoreError as exc:
            logger.warning("kvstore get failed after %d pages: %s", sum(results), exc)
        self.stats["pages_read"] += sum(results)
        return results

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the KV host pool's pages at `host_indices` under `keys` (a chain, in order)."""
        start = time.perf_counter()
        pool = self._pool(PoolName.KV.value)
        pages = [pool.get_data_page(int(host_indices[i * self.page_size]), flat=True) for i in range(len(keys))]
        results = self._write_pages(keys, pages)
        self._measure("backup", sum(results), start)
        return results

    def _write_pages(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Put pages as runs of one chain: each run is one Put of its tokens (from the ledger) and blocks."""
        results = [False] * len(keys)
        i = 0
        while i < len(keys):
            first = self.ledger.page(keys[i])
            if first is None:
                self.stats["unknown_keys"] += 1
                logger.warning("kvstore backend: page %s was not hashed in this process (or was forgotten); "
                               "not stored", keys[i][:16])
                i += 1
                continue
            run_tokens = list(first.tokens)
            j = i + 1
            while j < len(keys):
                entry = self.ledger.page(keys[j])
                if entry is None or entry.parent.hex() != keys[j - 1] or entry.extra_keys != first.extra_keys:
                    break
                run_tokens.extend(entry.tokens)
                j += 1
            blocks = [p.contiguous().view(torch.uint8).numpy().data for p in pages[i:j]]  # views, no copy
            try:
                put = self.client.put(run_tokens, blocks, parent=first.parent, extra_keys=first.extra_keys)
                for k, h in enumerate(put.block_hashes):
                    results[i + k] = h.hex() == keys[i + k]
            except KVStoreError as exc:
                self.stats["write_failures"] += 1
                logger.warning("kvstore put of %d pages failed: %s", j - i, exc)
            i = j
        self.stats["pages_written"] += sum(results)
        return results

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        """One page's bytes into `target_location` (a tensor of the page's size), or None when missing."""
        got = self.client.get_hashes([bytes.fromhex(key)]).blocks[0] if _is_hash(key) else None
        if got is None:
            return None
        data = torch.frombuffer(bytearray(got), dtype=torch.uint8)
        if target_location is None:
            return data
        if target_location.numel() * target_location.element_size() != len(got):
            raise ConfigError(f"target_location holds {target_location.numel() * target_location.element_size()} B; "
                              f"a kvstore block is {len(got)} B")
        target_location.view(-1).view(torch.uint8).copy_(data)
        return target_location  # type: ignore[no-any-return]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        """`get` of each key (SGLang's older interface)."""
        return [self.get(k, t) for k, t in zip(keys, target_locations or [None] * len(keys), strict=True)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        """Store one page (`value`: its tensor) under `key`; its parent page must be stored already."""
        return self._write_pages([key], [value])[0] if value is not None else False

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """Store pages in chain order; True when every one was stored."""
        return all(self._write_pages(keys, list(values or []))) if values is not None else False

    # -- the rest of SGLang's interface ------------------------------------------

    def clear(self) -> None:
        """Nothing: the store is shared by every engine and client of the tenant, and keeps its own
        retention (72 h); `kvstore purge` empties a tenant."""
        logger.info("kvstore backend: clear() leaves the shared store as it is (use `kvstore purge`)")

    def get_stats(self) -> SimpleNamespace:
        """SGLang's storage metrics since the last call (the fields of its StorageMetrics: pages and GB/s
        per prefetch and per backup call), as SGLang's own backends hand them over."""
        window = {k: list(v) for k, v in self._window.items()}
        for v in self._window.values():
            v.clear()
        return SimpleNamespace(**window)

    def counters(self) -> dict[str, int]:
        """Counters since start: pages found, read and written, snapshots, unknown keys, failures."""
        return dict(self.stats)

    def close(self) -> None:
        """Give SGLang back its own page hash and close the connection."""
        if sglang_keys.installed_ledger() is self.ledger:
            sglang_keys.uninstall()
        self.client.close()


def _is_hash(key: str) -> bool:
    return len(key) == 64 and all(c in "0123456789abcdef" for c in key)
