"""Which SGLang host pools the kvstore backend takes, checked when SGLang registers them.

SGLang registers the anchor pool (`register_mem_pool_host`), then every pool of its host
pool group (`register_mem_host_pool_v2`), then says it is done (`on_host_pools_registered`).
The backend serves:

- a KV pool whose page is one kvstore block (`--page-size` = block size, page bytes =
  `block_bytes`), with an optional SWA pool of layer-major window rows (sglang_swa);
- SGLang's DeepSeek-V4 stack: a row-less `LogicalHostPool` anchor of 256-token pages, the
  side pools whose pages join into kvstore blocks and the SWA window pool
  (sglang_v4_pools says which, and refuses the rest).

Any other pool stops the attach with a ConfigError naming it, rather than be served wrongly.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName

from integrations import sglang_keys, sglang_swa, sglang_v4_pools
from integrations.common import StoreSettings, connect_layout
from integrations.sglang_keys import KeyLedger
from integrations.sglang_share import V4Sharing
from integrations.sglang_v4_io import V4Pages
from kvstore.client import Client
from kvstore.errors import ConfigError
from kvstore.geometry import ModelGeometry, resolve
from kvstore.layout import SGLANG_V4

log = logging.getLogger(__name__)


class PoolRegistry:
    """The backend's host pool registration (the attributes below are the backend's)."""

    client: Client
    ledger: KeyLedger
    geometry: ModelGeometry
    storage_config: HiCacheStorageConfig
    page_size: int
    blocks_per_page: int
    v4: V4Pages | None
    stats: dict[str, int]
    settings: dict[str, Any]
    _pages_gb: float
    _v4_pools: dict[str, Any]
    sharing: V4Sharing | None

    def _write_pages(self, keys: Any, pages: Any) -> list[bool]:
        raise NotImplementedError

    def _check_kv_pool(self, pool: Any) -> None:
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

    def _attach_v4(self, anchor: Any) -> None:
        """SGLang's DeepSeek-V4 stack: pages of `anchor.page_size` tokens, rows in side pools (sglang_v4_pools)."""
        if self.v4 is not None:
            return
        if not (self.storage_config.extra_config or {}).get("interface_v1"):
            raise ConfigError("SGLang's DeepSeek-V4 HiCache needs the kvstore backend's page interface: add "
                              "\"interface_v1\": 1 to --hicache-storage-backend-extra-config")
        self._use_records(sglang_v4_pools.records())
        page_tokens = int(anchor.page_size)
        layout = sglang_v4_pools.layout(self.geometry, page_tokens, self.client.block_tokens)
        self.page_size, self.blocks_per_page = page_tokens, layout.blocks_per_page
        self.v4 = V4Pages(self.client, self.ledger, layout, self._v4_pools, self._write_pages, self.stats,
                          sharing=self.sharing)

    def _use_records(self, records: Any) -> None:
        """Work under the geometry of SGLang's record layout (kvstore.layout), said in the log: on SGLang's
        default `v4` rows a client, a chain root and a ledger of that layout's own (registration comes
        before any request, so no key was handed out under the other root)."""
        s = self.settings
        settings = StoreSettings(target=s["target"], token=s["token"], namespace=s["namespace"],
                                 geometry=self.client.geometry, timeout_s=float(s["timeout_s"]))
        client = connect_layout(settings, records, "SGLang's DeepSeek-V4 HiCache")
        if client.geometry == self.client.geometry:
            client.close()
            return
        if records == SGLANG_V4 and s["share_model_rows"]:
            # Keys, ledger and blocks stay the model's (shared where exact); SGLang's records, the pools'
            # row sizes and the SWA window are the engine layout's (integrations.sglang_share).
            model = resolve(self.client.geometry)
            self.geometry = resolve(client.geometry)
            self.sharing = V4Sharing(self.client, client, model, self.ledger, self.stats,
                                     device=s["transcode_device"])
            log.info("kvstore: SGLang v4 pages are shared as the model's rows (%s) where every row re-encodes "
                     "exactly, else kept as %s records (share_model_rows; transcoding on %s)", model.name,
                     client.geometry, s["transcode_device"])
            return
        self.client.close()
        self.client, self.geometry = client, resolve(client.geometry)
        self.ledger = KeyLedger(client.root, client.block_tokens, capacity=s["ledger_pages"],
                                run_blocks=sglang_keys.run_blocks_of(client))
        sglang_keys.install(self.ledger)
        self._pages_gb = client.block_bytes / 1e9

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The anchor host pool: a KV pool whose pages are kvstore blocks, or SGLang's DeepSeek-V4 anchor
        (with a HostPoolGroup, its entries are registered too). ConfigError otherwise."""
        if sglang_v4_pools.is_v4_anchor(mem_pool_host):
            anchor = getattr(getattr(mem_pool_host, "anchor_entry", None), "host_pool", mem_pool_host)
            self._attach_v4(anchor)
            super().register_mem_pool_host(anchor)  # type: ignore[misc]
            for entry in getattr(mem_pool_host, "entries", []):
                self.register_mem_host_pool_v2(entry.host_pool, entry.name)
            return
        self._check_kv_pool(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)  # type: ignore[misc]

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """An extra host pool: KV (blocks), SWA (snapshots) or a served DeepSeek-V4 side pool; any other is
        refused with ConfigError."""
        name = str(host_pool_name)
        if name == PoolName.KV.value and sglang_v4_pools.is_v4_anchor(host_pool):
            self._attach_v4(host_pool)
        elif self.v4 is not None:
            self._check_v4_pool(host_pool, name)
        elif name.startswith("deepseek_v4_"):
            raise ConfigError(f"SGLang's DeepSeek-V4 pool {name!r} came before its anchor (a LogicalHostPool "
                              "registered as the KV pool): the kvstore backend joins V4 pages only under it")
        elif name == PoolName.KV.value:
            self._check_kv_pool(host_pool)
        elif name == PoolName.SWA.value:
            if int(host_pool.page_size) != self.page_size:
                raise ConfigError(f"SGLang's SWA host pool has {host_pool.page_size}-token pages; the kvstore "
                                  f"backend needs the KV page size, {self.page_size}")
            page = host_pool.get_dummy_flat_data_page()
            sglang_swa.check_swa_page(self.geometry, int(host_pool.page_size), page.numel() * page.element_size())
        else:
            raise ConfigError(f"SGLang host pool {name!r} has no kvstore counterpart; the kvstore backend "
                              f"stores {PoolName.KV.value!r} (blocks) and {PoolName.SWA.value!r} (snapshots)")
        super().register_mem_host_pool_v2(host_pool, name)  # type: ignore[misc]

    def _check_v4_pool(self, host_pool: Any, name: str) -> None:
        assert self.v4 is not None
        why = sglang_v4_pools.refusal(name)
        if why is not None or (name not in sglang_v4_pools.SERVED and name != PoolName.SWA.value):
            raise ConfigError(f"SGLang's DeepSeek-V4 host pool {name!r} is not served by the kvstore backend: "
                              f"{why or 'no kvstore counterpart'} (docs/ENGINES.md, SGLang: not supported yet)")
        if name == PoolName.SWA.value:
            sglang_v4_pools.check_swa_pool(self.geometry, self.page_size, host_pool,
                                           interleaved=self.v4.layout.interleaved)
        else:
            sglang_v4_pools.check_side_pool(self.v4.layout, host_pool, name)
            self._v4_pools[name] = host_pool

    def on_host_pools_registered(self) -> None:
        """SGLang's registration is over: a DeepSeek-V4 stack must have every side pool a block joins."""
        if self.v4 is not None:
            sglang_v4_pools.check_complete(self.v4.layout, self._v4_pools)

    def _pool(self, name: str) -> Any:
        pools = getattr(self, "registered_pools", {})
        if name in pools:
            return pools[name]
        if name == PoolName.KV.value and hasattr(self, "mem_pool_host"):
            return self.mem_pool_host
        raise ConfigError(f"no SGLang host pool {name!r} was registered with the kvstore backend")

