"""The SGLang backend's SWA pool (trailing pages as one kvstore snapshot), its configuration errors
and the pools it refuses, through SGLang's real factory against a real `kvstore serve` child.

Skips only when SGLang cannot be imported (test_sglang_support.py says why).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from integrations import sglang_swa
from tests.children import Child
from tests.integrations import test_sglang_support as support
from tests.integrations.test_sglang_support import (
    BLOCK,
    GEO,
    PAGE,
    SWA_PAGE,
    ConfigError,
    HiCacheStorageExtraInfo,
    KVStoreHiCacheStorage,
    PagePool,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    StorageBackendFactory,
    Unavailable,
    config,
    fill,
    kvstore,
    prompt,
    sg_utils,
    sglang_keys,
)

# The shared fixtures: pytest finds them by name in this module.
python_tree_core = support.python_tree_core
server = support.server
backend = support.backend
client = support.client


# -- SWA: trailing pages as one snapshot -------------------------------------------------------

@pytest.fixture
def swa_backend(backend: Any) -> tuple[KVStoreHiCacheStorage, PagePool, PagePool]:
    b, kv = backend
    swa = PagePool(4, SWA_PAGE)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    return b, kv, swa


def swa_transfer(keys: list[str], first_page: int) -> PoolTransfer:
    return PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.TRAILING_PAGES,
                        host_indices=torch.arange(first_page * PAGE, (first_page + len(keys)) * PAGE))


def test_swa_trailing_pages_are_the_snapshot_at_the_page_boundary(swa_backend: Any, client: kvstore.Client) -> None:
    b, kv, swa = swa_backend
    tokens = prompt(9, 3)
    keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:3]
    assert b.batch_set_v1(keys, fill(kv, 0, 3, seed=9)) == [True] * 3
    # Without a snapshot the KV pages are found, but no prefix is restorable with its window.
    probe = [swa_transfer(keys[1:3], 0)]
    none = b.batch_exists_v2(keys, probe)
    assert none.kv_hit_pages == 0 and none.extra_pool_hit_pages.get(PoolName.KV) == 3
    fill(swa, 0, 2, seed=10)
    assert b.batch_set_v2([swa_transfer(keys[1:3], 0)]) == {PoolName.SWA.value: [True, True]}
    # The snapshot kvstore holds is the window rows of every layer, pages joined per layer.
    snap = client.swa.get(tokens[:3 * PAGE])
    assert snap is not None and len(snap) == client.swa.snapshot_bytes(3 * PAGE)
    rows = torch.frombuffer(bytearray(snap), dtype=torch.uint8).view(GEO.num_layers, 2 * PAGE, -1)
    assert bytes(rows[:, PAGE:].contiguous().numpy()) == swa.page_bytes(1)
    hit = b.batch_exists_v2(keys, probe)
    assert hit.kv_hit_pages == 3 and hit.restorable_prefix_pages == [3]
    assert hit.extra_pool_hit_pages[PoolName.SWA] == 3
    saved = [swa.page_bytes(0), swa.page_bytes(1)]
    swa.buf.zero_()
    assert b.batch_get_v2([swa_transfer(keys[1:3], 2)]) == {PoolName.SWA.value: [True, True]}
    assert [swa.page_bytes(2), swa.page_bytes(3)] == saved
    # Another process (no ledger) reads it too, placed by SGLang's prefix_keys: the pages before the window.
    other = StorageBackendFactory.create_backend("dynamic", config(client.target), kv)
    try:
        other.register_mem_host_pool_v2(kv, PoolName.KV)
        other.register_mem_host_pool_v2(swa, PoolName.SWA)
        swa.buf.zero_()
        after = HiCacheStorageExtraInfo(prefix_keys=keys[:1])
        assert other.batch_get_v2([swa_transfer(keys[1:3], 0)], after) == {PoolName.SWA.value: [True, True]}
        assert [swa.page_bytes(0), swa.page_bytes(1)] == saved
        assert other.batch_get_v2([swa_transfer(keys[1:3], 0)]) == {PoolName.SWA.value: [False, False]}  # no guess
        # ...and never writes a window at a guessed length (T = 128 here: the pages before it unknown).
        assert other.batch_set_v2([swa_transfer(keys[1:3], 0)]) == {PoolName.SWA.value: [False, False]}
        assert client.swa.get_many([sglang_swa.key_at(bytes.fromhex(keys[2]), 2 * PAGE)]) == [None]
    finally:
        other.close()


def test_swa_pages_that_do_not_fill_the_window_are_refused(swa_backend: Any) -> None:
    b, kv, _ = swa_backend
    tokens = prompt(11, 3)
    keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:3]
    assert b.batch_set_v1(keys, fill(kv, 0, 3, seed=11)) == [True] * 3
    # One trailing page at T = 192: the window there is two pages; a half snapshot is never stored.
    assert b.batch_set_v2([swa_transfer(keys[2:3], 0)]) == {PoolName.SWA.value: [False]}
    assert b.batch_get_v2([swa_transfer(keys[1:3], 0)]) == {PoolName.SWA.value: [False, False]}


# -- configuration errors ---------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    ({"target": None}, "'target' must be the kvstore server"),
    ({"target": "127.0.0.1:1", "colour": "blue"}, "unknown kvstore HiCache settings"),
    ({"timeout_s": 0}, "'timeout_s' must be a number"),
    ({"ledger_pages": 1.5}, "'ledger_pages' must be an integer"),
    ({"namespace": 3}, "'namespace' must be a string"),
])
def test_bad_settings_are_config_errors(server: Child, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StorageBackendFactory.create_backend("dynamic", config(server.target, extra), None)


@pytest.mark.parametrize("field, value, message", [
    ("is_mla_model", False, "tp_size=2 with per-head KV"),
    ("pp_size", 2, "pp_size=2"),
    ("attn_cp_size", 2, "attn_cp_size=2"),
])
def test_ranks_holding_a_shard_of_each_page_are_refused(server: Child, field: str, value: object,
                                                        message: str) -> None:
    cfg = config(server.target)
    cfg.tp_size, cfg.tp_rank = 2, 0
    setattr(cfg, field, value)
    with pytest.raises(ConfigError, match=message):
        StorageBackendFactory.create_backend("dynamic", cfg, None)
    cfg = config(server.target)
    cfg.tp_size = 2   # MLA: every TP rank holds the whole page; accepted
    StorageBackendFactory.create_backend("dynamic", cfg, None).close()


def test_an_unreachable_server_is_unavailable_at_start() -> None:
    with pytest.raises(Unavailable):
        StorageBackendFactory.create_backend("dynamic", config("127.0.0.1:1", {"timeout_s": 5}), None)


def test_pools_that_are_not_kvstore_blocks_are_refused(server: Child) -> None:
    b = StorageBackendFactory.create_backend("dynamic", config(server.target), None)
    try:
        with pytest.raises(ConfigError, match="--page-size 64"):
            b.register_mem_pool_host(PagePool(2, 32 * 890, page_size=32))
        with pytest.raises(ConfigError, match="56960 B"):
            b.register_mem_pool_host(PagePool(2, 64 * 512))
        with pytest.raises(ConfigError, match="32-token pages"):
            b.register_mem_host_pool_v2(PagePool(2, SWA_PAGE // 2, page_size=32), PoolName.SWA)
        with pytest.raises(ConfigError, match="SWA host page"):
            b.register_mem_host_pool_v2(PagePool(2, 64 * 528), PoolName.SWA)
        with pytest.raises(ConfigError, match="no page data interface"):   # no HostKVCache page methods
            b.register_mem_pool_host(SimpleNamespace(page_size=PAGE, kv_buffer=None, layer_num=0))
        with pytest.raises(ConfigError, match="no kvstore counterpart"):
            b.register_mem_host_pool_v2(PagePool(2, BLOCK), PoolName.MAMBA)
    finally:
        b.close()


def test_close_gives_sglang_back_its_own_page_hash(server: Child) -> None:
    b = StorageBackendFactory.create_backend("dynamic", config(server.target), None)
    assert sglang_keys.installed_ledger() is b.ledger
    b.close()
    assert sglang_keys.installed_ledger() is None
    assert sg_utils.get_hash_str.__module__ == "sglang.srt.mem_cache.utils"
