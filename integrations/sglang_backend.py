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
DeepSeek-V4.1 runs with SGLang's own page size (256: drop `--page-size`) and
`SGLANG_DSV4_KV_LAYOUT=v41` (or `v41_new`); each 256-token page is then 4 kvstore blocks
joined from its side pools (sglang_register, sglang_v4_io; docs/ENGINES.md).

Extra config (`HiCacheStorageConfig.extra_config`), each checked at start (ConfigError):
- `target` (required): the kvstore server, host:port.
- `token`: the tenant's API token (default: $KVSTORE_TOKEN; none on a server without auth).
- `namespace`, `geometry`: the tenant and geometry (default: the token's tenant, the server's default).
- `timeout_s`: deadline of each call (default 30).
- `ledger_pages`: pages whose tokens are remembered for Put (integrations.sglang_keys; default 262,144).
- `swa_ttl_s`: lifetime asked for SWA snapshots (default and most: the server's `swa.ttl_s`).
- `interface_v1`: 1 makes SGLang call batch_get_v1/batch_set_v1 (zero-copy into the host pool).
- `keep_s`: a retention hint: keep every prefix stored through batch_set_v1 this many seconds past
  now, beyond the tenant's retention (a pin, docs/RETENTION.md R22-R27; default: none). A call's
  `extra_info.extra_info["kvstore_keep_until_s"]` (a Unix time) or `["kvstore_keep_s"]` overrides it.
- `share_model_rows`: with SGLang's default `v4` rows, store a page as the model's rows where every row
  re-encodes to SGLang's bytes bit for bit (shared with V4.1 engines; integrations.sglang_share), else
  as SGLang's records (default true).
- `transcode_device`: where that transcoding runs, "cpu" (default) or "cuda".

Keys: while attached, SGLang's page key is kvstore's chain hash of the page's last block in
hex (sglang_keys), so a prompt stored by any kvstore client (the vLLM connector,
`kvstore.Client.put`) is found here, and the other way round. A caller computes them from
token ids as `[h.hex() for h in kvstore.Client(target).hashes(token_ids)][n - 1::n]`, one per
full page of n blocks (n = 1 on 64-token pages, 4 on V4's 256-token pages).

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
window rows (sglang_swa); a DeepSeek-V4 page is its side pools' pages (sglang_v4). A pool
of another size or another name is refused at registration with ConfigError rather than
served wrongly.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterator, Sequence
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
from integrations.sglang_pools import Chain, PoolsV2
from integrations.sglang_register import PoolRegistry
from integrations.sglang_share import V4Sharing
from integrations.sglang_v4_io import V4Pages
from kvstore.client import Client
from kvstore.errors import ConfigError, FailedPrecondition, KVStoreError
from kvstore.geometry import resolve
from kvstore.v1 import kvstore_pb2 as pb

logger = logging.getLogger(__name__)


class KVStoreHiCacheStorage(PoolRegistry, PoolsV2, HiCacheStorage):
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
        self.settings = s
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
        self.keep_s: float | None = s["keep_s"]
        self.ledger = sglang_keys.KeyLedger(self.client.root, self.client.block_tokens, capacity=s["ledger_pages"],
                                            run_blocks=sglang_keys.run_blocks_of(self.client))
        sglang_keys.install(self.ledger)
        self.page_size = self.client.block_tokens
        #: kvstore blocks per SGLang page: 1, or page_tokens / block_tokens on a DeepSeek-V4 stack.
        self.blocks_per_page = 1
        #: The DeepSeek-V4 side pools' page I/O, once SGLang's V4 anchor is registered (sglang_v4_io).
        self.v4: V4Pages | None = None
        self._v4_pools: dict[str, Any] = {}
        #: SGLang v4 pages kept as the model's rows where exact (`share_model_rows`; integrations.sglang_share).
        self.sharing: V4Sharing | None = None
        self.metrics = storage_config.enable_storage_metrics
        self._pages_gb = self.client.block_bytes / 1e9
        self._window: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                                "backup_bandwidth": []}
        #: Counters since start (`counters()`): pages found, read and written, snapshots, unknown keys, failures.
        self.stats = {"exists_calls": 0, "pages_found": 0, "pages_read": 0, "pages_written": 0, "write_failures": 0,
                      "unknown_keys": 0, "snapshots_read": 0, "snapshots_written": 0, "pins": 0}

    # -- keys ------------------------------------------------------------------

    def _chain(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None) -> Chain | None:
        """The chain from the sequence start through `keys`: its page keys, its block hashes, and
        where `keys` begin in it (pages).

        kvstore's Lookup counts a chain from its root (R15), so the pages before `keys`
        come along: SGLang's `prefix_keys` when it passes them, else the ledger's parents.
        None when a key is not a kvstore hash or a known page's chain cannot be traced to its start
        (or, on multi-block pages, a page's blocks are not in the ledger).
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
        pages = prefix + hashes
        blocks = pages if self.blocks_per_page == 1 else self.ledger.blocks_of([p.hex() for p in pages])
        if blocks is None:
            return None
        return Chain(pages=pages, blocks=blocks, offset=len(prefix))

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
        try:
            found = self.client.lookup_hashes(chain.blocks).found_blocks if self.sharing is None \
                else self.sharing.lookup(chain.pages, chain.blocks)[0]
        except KVStoreError as exc:
            logger.warning("kvstore lookup failed (counted as a miss): %s", exc)
            return 0
        hit = max(0, min(len(keys), found // self.blocks_per_page - chain.offset))
        self.stats["pages_found"] += hit
        return hit

    def exists(self, key: str) -> bool:
        """Whether the page `key` and every page before it are stored."""
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read the pages of `keys` into the KV host pool at `host_indices` (page i at host_indices[i x page])."""
        start = time.perf_counter()
        if self.v4 is not None:   # the anchor holds no rows: the side pools' pages, noted for batch_get_v2
            self.v4.forget_reads()
            results = self.v4.read(keys, host_indices)
        else:
            results = self._read_pages(self._pool(PoolName.KV.value), keys, host_indices, extra_info)
        self._measure("prefetch", sum(results), start)
        return results

    def _measure(self, kind: str, pages: int, start: float) -> None:
        """One call's pages and GB/s for SGLang's storage metrics (--enable-storage-metrics)."""
        if self.metrics and pages:
            self._window[f"{kind}_pgs"].append(pages)
            self._window[f"{kind}_bandwidth"].append(pages * self._pages_gb / max(time.perf_counter() - start, 1e-9))

    def _read_pages(self, pool: Any, keys: Sequence[str], host_indices: torch.Tensor,
                    extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        results = [False] * len(keys)
        try:
            hashes = [bytes.fromhex(k) for k in keys]
        except ValueError:
            return results
        dummy = pool.get_dummy_flat_data_page()
        try:
            for index, status, data in self._stream(keys, hashes, extra_info):
                if status != pb.BLOCK_STATUS_FOUND or len(data) != self.client.block_bytes:
                    continue
                page = sglang_swa.read_only(data).view(dummy.dtype)  # copied into the pool by SGLang
                pool.set_from_flat_data_page(int(host_indices[index * self.page_size]), page)
                results[index] = True
        except KVStoreError as exc:
            logger.warning("kvstore get failed after %d pages: %s", sum(results), exc)
        self.stats["pages_read"] += sum(results)
        return results

    def _stream(self, keys: Sequence[str], hashes: list[bytes],
                extra_info: HiCacheStorageExtraInfo | None) -> Iterator[tuple[int, int, bytes]]:
        """(index in `keys`, status, data) of each page's block: by its hash on one server; in a fleet or through its
        gateway, as the part of the chain from the sequence start that `keys` are (a run is found by its first hash,
        F29, F60), none when that chain cannot be traced (a miss: SGLang recomputes)."""
        if not self.ledger.run_blocks:
            return self.client.stream(hashes)
        chain = self._chain(keys, extra_info)
        if chain is None:
            return iter(())
        return sglang_keys.stream_part(self.client, chain.blocks, chain.offset, len(chain.blocks))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the KV host pool's pages at `host_indices` under `keys` (a chain, in order)."""
        start = time.perf_counter()
        until, granted = self._keep_until(extra_info), list[Any]()
        if self.v4 is not None:   # the side pools' pages (or what batch_set_v2 already stored of them)
            results = self.v4.write(keys, host_indices, keep_until_s=until, granted=granted)
        else:
            pool = self._pool(PoolName.KV.value)
            pages = [pool.get_data_page(int(host_indices[i * self.page_size]), flat=True) for i in range(len(keys))]
            results = self._write_pages(keys, pages, keep_until_s=until, granted=granted)
        self._measure("backup", sum(results), start)
        if until and granted:   # pinned in the last page's own Put (R22): no Lookup
            self._count_pin(granted[-1])
        elif until and any(results):   # the last page not put (or its twin call asked no pin): by a Lookup
            self._keep(keys, extra_info, until)
        return results

    def _keep_until(self, extra_info: HiCacheStorageExtraInfo | None) -> float:
        """The retention hint of a write: the call's (extra_info) or the backend's `keep_s`; 0 for none."""
        hint = (extra_info.extra_info if extra_info is not None else None) or {}
        until, keep_s = hint.get("kvstore_keep_until_s"), hint.get("kvstore_keep_s", self.keep_s)
        if isinstance(until, int | float) and not isinstance(until, bool) and until > 0:
            return float(until)
        if isinstance(keep_s, int | float) and not isinstance(keep_s, bool) and keep_s > 0:
            return time.time() + float(keep_s)
        return 0.0

    def _keep(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None, until_s: float) -> None:
        """Pin the stored prefix through `keys` until `until_s` (a Lookup asking keep_until_s); a refusal
        or an outage is logged and counted, never a failed write."""
        chain = self._chain(keys, extra_info)
        if chain is None:
            return
        try:
            got = self.client.pin_hashes(chain.blocks, until_s)
            if self.sharing is not None and got.found_blocks < len(chain.blocks):
                # Not (all) the model's rows: the chain went to SGLang's own layout (integrations.sglang_share).
                engine = self.sharing.engine_chain(chain.pages)
                if engine is not None:
                    got = self.sharing.engine.pin_hashes(engine, until_s)
        except KVStoreError as exc:
            logger.warning("kvstore pin failed: %s", exc)
            return
        self._count_pin(got)

    def _count_pin(self, got: Any) -> None:
        """Count a pin's grant (a Put's or a Lookup's `kept_until_s`), or log why none was granted."""
        if got.kept_until_s:
            self.stats["pins"] += 1
        elif got.keep_note:
            logger.info("kvstore pin not granted: %s", got.keep_note)

    def _write_pages(self, keys: Sequence[str], pages: Sequence[torch.Tensor], *, keep_until_s: float = 0.0,
                     granted: list[Any] | None = None) -> list[bool]:
        """Put pages as runs of one chain: each run is one Put of its tokens (from the ledger) and blocks
        (a page is `blocks_per_page` blocks, flat or [n, block_bytes]). With `keep_until_s`, the run that
        ends at the last key pins it in its own Put (R22), its `PutResult` appended to `granted`."""
        n, size = self.blocks_per_page, self.client.block_bytes
        results = [False] * len(keys)
        i = 0
        while i < len(keys):
            first = self.ledger.page(keys[i])
            if first is None or len(first.tokens) != n * self.client.block_tokens:
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
            flat = [p.contiguous().view(torch.uint8).reshape(n, size) for p in pages[i:j]]
            blocks = [page[k].numpy().data for page in flat for k in range(n)]  # views, no copy
            try:
                keep = keep_until_s if j == len(keys) else 0.0
                if self.ledger.run_blocks:   # a fleet places runs by their index: the prompt from its start
                    put = self._put_in_fleet(keys[i], first, run_tokens, blocks, keep)
                else:
                    put = self.client.put(run_tokens, blocks, parent=first.parent, extra_keys=first.extra_keys,
                                          keep_until_s=keep)
                if keep and granted is not None:
                    granted.append(put)
                for k, h in enumerate(put.block_hashes[n - 1::n]):
                    results[i + k] = h.hex() == keys[i + k]
            except KVStoreError as exc:
                self.stats["write_failures"] += 1
                logger.warning("kvstore put of %d pages failed: %s", j - i, exc)
            i = j
        self.stats["pages_written"] += sum(results)
        return results

    def _put_in_fleet(self, key: str, first: sglang_keys.LedgerPage, run_tokens: list[int], blocks: list[Any],
                      keep_until_s: float) -> Any:
        """A fleet's Put of pages from `key` on: the tokens from the sequence start, the blocks from the page's
        index (the fleet client hashes the prefix and places each run itself: kvstore.client.fleet).

        Raises:
            FailedPrecondition: the chain before `key` is not in the ledger (nothing stored).
        """
        above = array("I") if first.parent == self.client.root else \
            self.ledger.tokens_to(first.parent.hex())
        if above is None or first.first_block < 0:
            raise FailedPrecondition(f"page {key[:16]}'s chain is not in the ledger back to its start: a fleet "
                                     "places runs by their index in the prompt")
        return self.client.put([*above, *run_tokens], blocks, first_block=first.first_block,
                               extra_keys=first.extra_keys, keep_until_s=keep_until_s)

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        """One page's bytes into `target_location` (a tensor of the page's size), or None when missing
        (always on a DeepSeek-V4 stack, whose pages SGLang moves through batch_get_v1/v2 only)."""
        ok = _is_hash(key) and self.v4 is None
        got = None
        if ok and self.ledger.run_blocks:
            got = next((bytes(d) for _, st, d in self._stream([key], [bytes.fromhex(key)], None)
                        if st == pb.BLOCK_STATUS_FOUND), None)
        elif ok:
            got = self.client.get_hashes([bytes.fromhex(key)]).blocks[0]
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
        return self._write_pages([key], [value])[0] if value is not None and self.v4 is None else False

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """Store pages in chain order; True when every one was stored."""
        if values is None or self.v4 is not None:
            return False
        return all(self._write_pages(keys, list(values)))

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
