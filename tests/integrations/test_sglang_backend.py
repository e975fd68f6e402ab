"""The SGLang HiCache backend (integrations/sglang_backend.py) through SGLang's real factory and
storage API, against a real `kvstore serve` child.

Skips only when SGLang cannot be imported (scripts/install_engines.sh writes why into
VENV/engine-skip-sglang.txt when it could not install it; the reason is in the skip).

The host pools are small page stores with the page interface of SGLang's HostKVCache
(`page_size`, `get_data_page`, `get_dummy_flat_data_page`, `set_from_flat_data_page`),
the only part of a host pool a storage backend touches: SGLang's own pool classes
import its whole model-config tree (transformers, torchvision) on import.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.children import Child


def _sglang_missing() -> str | None:
    try:
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    except ImportError as exc:
        reason = f"sglang is not importable here ({exc})"
        note = Path(sys.prefix) / "engine-skip-sglang.txt"
        if note.exists():
            reason += f"; scripts/install_engines.sh: {note.read_text().strip()}"
        return reason
    return None


_MISSING = _sglang_missing()
if _MISSING:
    print(f"SKIP tests/integrations/test_sglang_backend.py: {_MISSING}", file=sys.stderr)
    pytest.skip(_MISSING, allow_module_level=True)

from sglang.srt.mem_cache import utils as sg_utils  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

import kvstore  # noqa: E402
from integrations import sglang_keys  # noqa: E402
from integrations.sglang_backend import KVStoreHiCacheStorage  # noqa: E402
from kvstore.errors import ConfigError, Unavailable  # noqa: E402
from kvstore.geometry import V4_1_FLASH as GEO  # noqa: E402

PAGE = 64
BLOCK = GEO.block_bytes(PAGE)                                # 56,960
SWA_PAGE = GEO.num_layers * PAGE * GEO.window_row_bytes      # 40 x 64 x 528


class PagePool:
    """A host pool of `pages` pages of `page_bytes` (SGLang's HostKVCache page interface)."""

    def __init__(self, pages: int, page_bytes: int, page_size: int = PAGE, dtype: torch.dtype = torch.uint8) -> None:
        self.page_size = page_size
        self.item = torch.empty((), dtype=dtype).element_size()
        self.dtype = dtype
        self.buf = torch.zeros(pages * page_size, page_bytes // page_size // self.item, dtype=dtype)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.buf.shape[1] * self.page_size, dtype=self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.buf[index:index + self.page_size].flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.buf[index:index + self.page_size] = data_page.reshape(self.page_size, -1)

    def page_bytes(self, page: int) -> bytes:
        return bytes(self.buf[page * self.page_size:(page + 1) * self.page_size].contiguous().view(torch.uint8)
                     .flatten().numpy())


@pytest.fixture(autouse=True)
def python_tree_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's Python radix-tree core: its page hashes go through kvstore's keys (the backend refuses the Rust one)."""
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    root = tmp_path_factory.mktemp("sglang")
    child = Child("serve", ["serve", "--port", "0", "--data-dir", str(root / "data")], root / "logs")
    try:
        yield child
    finally:
        child.kill_if_alive()


def config(target: str, extra: dict[str, Any] | None = None) -> HiCacheStorageConfig:
    """SGLang's storage config as `--hicache-storage-backend-extra-config` makes it (a None value drops the key)."""
    settings = {"backend_name": "kvstore", "module_path": "integrations.sglang_backend",
                "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "target": target, **(extra or {})}
    settings = {k: v for k, v in settings.items() if v is not None}
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="v41-flash", extra_config=settings)


@pytest.fixture
def backend(server: Child) -> Iterator[tuple[KVStoreHiCacheStorage, PagePool]]:
    pool = PagePool(16, BLOCK)
    made = StorageBackendFactory.create_backend("dynamic", config(server.target), pool)
    made.register_mem_pool_host(pool)   # what SGLang's cache controller does next
    assert isinstance(made, KVStoreHiCacheStorage)
    try:
        yield made, pool
    finally:
        made.close()


@pytest.fixture
def client(server: Child) -> Iterator[kvstore.Client]:
    with kvstore.Client(server.target) as c:
        yield c


class RadixLike(list):  # type: ignore[type-arg]
    """Token ids with the namespace fields of SGLang's RadixKey (extra_key, cache_salt)."""

    def __init__(self, tokens: list[int], *, extra_key: str | None = None, cache_salt: str | None = None) -> None:
        super().__init__(tokens)
        self.extra_key, self.cache_salt = extra_key, cache_salt


def prompt(seed: int, pages: int, extra: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(pages * PAGE + extra)]


def fill(pool: PagePool, first_page: int, pages: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = pool.buf[first_page * PAGE:(first_page + pages) * PAGE].view(torch.uint8)
    rows.copy_(torch.randint(0, 256, rows.shape, generator=g, dtype=torch.uint8))
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE)


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
        with pytest.raises(ConfigError, match="SWA host page"):
            b.register_mem_host_pool_v2(PagePool(2, 64 * 528), PoolName.SWA)
        with pytest.raises(ConfigError, match="holds no page data"):   # DeepSeek-V4's LogicalHostPool anchor
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
