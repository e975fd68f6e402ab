"""The SGLang HiCache backend (integrations/sglang_backend.py) through SGLang's real factory, storage
API and page hash, against a real `kvstore serve` child: keys, KV pages as blocks, the ledger, threads.

Skips only when SGLang cannot be imported (test_sglang_support.py says why).
"""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.children import Child
from tests.integrations import test_sglang_support as support
from tests.integrations.test_sglang_support import (
    BLOCK,
    PAGE,
    ConfigError,
    HiCacheStorageExtraInfo,
    PagePool,
    RadixLike,
    StorageBackendFactory,
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



def test_the_dynamic_factory_loads_the_backend_and_a_custom_name_is_refused(server: Child) -> None:
    pool = PagePool(2, BLOCK)
    made = StorageBackendFactory.create_backend("dynamic", config(server.target), pool)
    try:
        assert type(made).__name__ == "KVStoreHiCacheStorage"
    finally:
        made.close()
    with pytest.raises(ValueError, match="Unknown storage backend 'kvstore'"):
        StorageBackendFactory.create_backend("kvstore", config(server.target), pool)


def test_sglang_page_keys_are_kvstore_chain_hashes(backend: Any, client: kvstore.Client) -> None:
    tokens = prompt(1, 3)
    # What SGLang's cache controller calls for a prefetch's pages (get_storage_hash_str -> get_hash_str).
    keys = sg_utils.get_storage_hash_str(tokens, None, page_size=PAGE)
    assert keys[:3] == [h.hex() for h in client.hashes(tokens)]
    assert len(keys) == 4  # SGLang hashes the trailing partial page too; it is never a block
    assert sglang_keys.page_keys(client.root, PAGE, tokens) == keys[:3]
    # A chain continued from a page key (SGLang's prior_hash) is the same chain.
    assert sg_utils.get_hash_str(tokens[PAGE:3 * PAGE], keys[0], page_size=PAGE) == keys[1:3]


def test_the_radix_trees_node_hashes_are_the_same_keys(backend: Any, client: kvstore.Client) -> None:
    # What the Python tree core keys a write-back with: each node's pages chained from its parent's last hash.
    tokens = prompt(12, 3, extra=0)
    root = SimpleNamespace(key=[], hash_value=[], parent=None)
    first = SimpleNamespace(key=tokens[:PAGE], parent=root, hash_value=None)
    first.hash_value = sg_utils.compute_node_hash_values(first, PAGE)
    second = SimpleNamespace(key=tokens[PAGE:], parent=first, hash_value=None)
    second.hash_value = sg_utils.compute_node_hash_values(second, PAGE)
    assert first.hash_value + second.hash_value == [h.hex() for h in client.hashes(tokens)]


def test_the_default_rust_tree_core_is_refused(server: Child, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND")
    with pytest.raises(ConfigError, match="SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python"):
        StorageBackendFactory.create_backend("dynamic", config(server.target), None)


def test_a_salted_requests_pages_are_a_chain_of_their_own_with_the_seed_as_extra_key(
        backend: Any, client: kvstore.Client) -> None:
    b, pool = backend
    tokens = prompt(15, 2, extra=0)
    plain = sg_utils.get_storage_hash_str(tokens, None, page_size=PAGE)
    salted = sg_utils.get_storage_hash_str(RadixLike(tokens, cache_salt="user-7"), None, page_size=PAGE)
    seed = sg_utils.storage_namespace_seed(None, "user-7")
    assert salted != plain
    assert salted == [h.hex() for h in client.hashes(tokens, extra_keys=[f"sglang-ns:{seed}"])]
    assert b.batch_set_v1(salted, fill(pool, 0, 2, seed=15)) == [True, True]
    assert client.lookup(tokens, extra_keys=[f"sglang-ns:{seed}"]).found_blocks == 2
    assert client.lookup(tokens).found_blocks == 0 and b.batch_exists(plain) == 0
    assert b.batch_exists(salted[1:]) == 1


def test_pages_set_through_sglang_are_kvstore_blocks_byte_for_byte(backend: Any, client: kvstore.Client) -> None:
    b, pool = backend
    tokens = prompt(2, 3)
    keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:3]
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, fill(pool, 0, 3, seed=2)) == [True, True, True]
    got = client.get(tokens)
    assert got.found_prefix_blocks == 3
    assert [bytes(x or b"") for x in got.blocks] == [pool.page_bytes(i) for i in range(3)]
    assert b.batch_exists(keys) == 3
    assert b.exists(keys[2])


def test_batch_exists_is_the_longest_stored_prefix(backend: Any) -> None:
    b, pool = backend
    tokens = prompt(3, 4)
    keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:4]
    assert b.batch_set_v1(keys[:2], fill(pool, 0, 2, seed=3)) == [True, True]
    assert b.batch_exists(keys) == 2
    # A later batch of the same prompt: SGLang passes the pages before it as prefix_keys...
    assert b.batch_exists(keys[1:], HiCacheStorageExtraInfo(prefix_keys=keys[:1])) == 1
    # ...or not: the ledger knows the chain back to its start.
    assert b.batch_exists(keys[1:]) == 1
    assert b.batch_exists(keys[2:]) == 0
    assert b.batch_exists(["not-a-kvstore-key"]) == 0


def test_a_prompt_stored_by_the_kvstore_client_is_read_back_through_sglang(backend: Any,
                                                                           client: kvstore.Client) -> None:
    b, pool = backend
    tokens = prompt(4, 3)
    blocks = [bytes(random.Random(i).randbytes(BLOCK)) for i in range(3)]
    client.put(tokens, blocks)
    keys = [h.hex() for h in client.hashes(tokens)]       # no SGLang hashing: another client's prompt
    assert b.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=[])) == 3
    assert b.batch_exists(keys) == 3          # keys this process never hashed: taken from the chain root
    assert b.batch_exists(keys[1:]) == 0      # ...so a mid-chain batch of them is no chain at all
    assert b.batch_get_v1(keys, torch.arange(5 * PAGE, 8 * PAGE)) == [True, True, True]
    assert [pool.page_bytes(5 + i) for i in range(3)] == blocks
    target = torch.zeros(BLOCK, dtype=torch.uint8)
    assert b.get(keys[1], target) is target and bytes(target.numpy()) == blocks[1]


def test_sglangs_older_page_interface_stores_and_reads_the_same_blocks(backend: Any, client: kvstore.Client) -> None:
    # Without interface_v1 SGLang calls batch_set(keys, pages) and batch_get(keys, dummy pages).
    b, pool = backend
    tokens = prompt(14, 2)
    keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:2]
    fill(pool, 0, 2, seed=14)
    assert b.batch_set(keys, [pool.get_data_page(0), pool.get_data_page(PAGE)])
    assert [bytes(x or b"") for x in client.get(tokens).blocks] == [pool.page_bytes(0), pool.page_bytes(1)]
    got = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert [bytes(g.numpy()) for g in got] == [pool.page_bytes(0), pool.page_bytes(1)]


def test_missing_pages_read_as_failures_and_leave_the_pool_alone(backend: Any) -> None:
    b, pool = backend
    tokens = prompt(5, 2)
    keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:2]
    pool.buf.fill_(7)
    assert b.batch_get_v1(keys, torch.arange(0, 2 * PAGE)) == [False, False]
    assert bool((pool.buf == 7).all())
    assert b.get(keys[0], torch.zeros(BLOCK, dtype=torch.uint8)) is None


def test_a_page_sglang_did_not_hash_here_is_not_stored(backend: Any) -> None:
    b, pool = backend
    foreign = "ab" * 32   # a well-formed key the ledger never produced: no tokens to Put it with
    assert b.batch_set_v1([foreign], fill(pool, 0, 1, seed=6)) == [False]
    assert b.counters()["unknown_keys"] == 1


def test_a_page_stored_under_another_hash_than_its_key_is_reported_failed(backend: Any) -> None:
    b, pool = backend
    tokens = prompt(13, 1, extra=0)
    key = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[0]
    entry = b.ledger.page(key)
    b.ledger._remember(key, entry._replace(tokens=entry.tokens[::-1]))   # its tokens no longer hash to the key
    assert b.batch_set_v1([key], fill(pool, 0, 1, seed=13)) == [False]
    assert b.batch_exists([key]) == 0


def test_the_ledger_forgets_the_oldest_pages_beyond_ledger_pages(server: Child) -> None:
    pool = PagePool(4, BLOCK)
    b = StorageBackendFactory.create_backend("dynamic", config(server.target, {"ledger_pages": 2}), pool)
    try:
        b.register_mem_pool_host(pool)
        keys = sg_utils.get_hash_str(prompt(16, 4, extra=0), None, page_size=PAGE)
        assert len(b.ledger) == 2 and b.ledger.page(keys[0]) is None and b.ledger.page(keys[3]) is not None
        assert b.batch_set_v1(keys[:1], fill(pool, 0, 1, seed=16)) == [False]   # its tokens are gone
        assert b.counters()["unknown_keys"] == 1
    finally:
        b.close()


def test_storage_threads_read_and_write_at_once(backend: Any, server: Child) -> None:
    # SGLang's prefetch and backup threads call the backend concurrently.
    b, pool = backend
    prompts = [prompt(100 + i, 2, extra=0) for i in range(6)]
    keys = [sg_utils.get_hash_str(t, None, page_size=PAGE) for t in prompts]
    fill(pool, 0, 2, seed=17)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            assert b.batch_set_v1(keys[i], torch.arange(0, 2 * PAGE)) == [True, True]
            assert b.batch_exists(keys[i]) == 2
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with kvstore.Client(server.target) as c:
        for t in prompts:
            got = c.get(t)
            assert [bytes(x or b"") for x in got.blocks] == [pool.page_bytes(0), pool.page_bytes(1)]


def test_a_page_whose_parent_is_not_stored_fails_and_nothing_is_written(backend: Any) -> None:
    b, pool = backend
    tokens = prompt(7, 2)
    keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:2]
    assert b.batch_set_v1(keys[1:], fill(pool, 1, 1, seed=7)) == [False]   # kvstore: FailedPrecondition
    assert b.counters()["write_failures"] == 1
    assert b.batch_exists(keys) == 0


def test_bfloat16_host_pages_travel_as_their_bytes_and_are_measured(server: Child) -> None:
    pool = PagePool(4, BLOCK, dtype=torch.bfloat16)
    cfg = config(server.target)
    cfg.enable_storage_metrics = True
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    try:
        b.register_mem_pool_host(pool)
        tokens = prompt(8, 2)
        keys = sg_utils.get_hash_str(tokens, None, page_size=PAGE)[:2]
        assert b.batch_set_v1(keys, fill(pool, 0, 2, seed=8)) == [True, True]
        saved = pool.buf[:2 * PAGE].clone()
        assert b.batch_get_v1(keys, torch.arange(2 * PAGE, 4 * PAGE)) == [True, True]
        assert torch.equal(pool.buf[2 * PAGE:4 * PAGE].view(torch.uint8), saved.view(torch.uint8))
        metrics = b.get_stats()   # SGLang's StorageMetrics fields, since the last call
        assert metrics.prefetch_pgs == [2] and metrics.backup_pgs == [2]
        assert metrics.prefetch_bandwidth[0] > 0 and metrics.backup_bandwidth[0] > 0
        assert b.get_stats().prefetch_pgs == []
    finally:
        b.close()
