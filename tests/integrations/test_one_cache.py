"""One cache, three clients: what the vLLM connector stores, the SGLang HiCache backend (one-block pages,
and DeepSeek-V4 pages of several blocks) and the kvstore client read back byte-identical, and what SGLang
stores is a hit the vLLM connector loads.

Needs both engines in one venv (scripts/install_engines.sh); skips, with the reason, when either
cannot be imported. vLLM runs its real Scheduler (test_vllm_support.py); SGLang's backend is made by
its real dynamic factory (test_sglang_support.py); one `kvstore serve` child serves all three.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kvstore
from integrations.sglang_v4 import POOLS, V4PageLayout, pages_to_blocks
from integrations.vllm_scheduler import SaveSpec
from tests.children import Child
from tests.integrations import test_sglang_support as sg  # skips (with the reason) without SGLang
from tests.integrations.test_vllm_support import (
    GEO,
    GLOBAL,
    STORE_BLOCK_TOKENS,
    Engine,
    assert_rows_loaded,
    model_row,
    prompt,
)

B = STORE_BLOCK_TOKENS
#: SGLang's DeepSeek-V4 page in the V4 test: 8 blocks of the tiny geometry (its ratio-2 rows fill whole
#: 64-slot indexer pages, as SGLang's 256-token pages do for V4.1-Flash).
V4_PAGE = 8 * B


@pytest.fixture
def store(start_store: Callable[[], Child], monkeypatch: pytest.MonkeyPatch) -> Child:
    # SGLang's Python radix-tree core hashes pages through kvstore's keys (its backend refuses the Rust one).
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")   # the V4 pools here hold the model's rows
    return start_store()


def stored_through_vllm(store: Child, tmp_path: Path, prompt_tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """Run one request through vLLM with the connector, until its blocks are saved: its tokens (prompt and
    output) and its whole blocks as vLLM's own pages hold them (read while vLLM still holds them)."""
    engine = Engine(tmp_path / "vllm", {"target": store.target, "geometry": GEO.name, "replay_windows": 1})
    engine.add("r1", prompt_tokens, max_tokens=3)
    engine.run()
    tokens = engine.tokens["r1"]
    n = len(tokens) // B
    pages = engine.worker.worker.saves.gather(SaveSpec(req_id="r1", tokens=tokens[: n * B], first_block=0,
                                                       block_ids=tuple(engine.pages["r1"])))
    blocks = [bytes(pages[i].numpy()) for i in range(n)]
    engine.drain()
    engine.close()
    return tokens, blocks


def sglang_backend(target: str, pages: int) -> tuple[object, object]:
    pool = sg.PagePool(pages, GEO.block_bytes(B), page_size=B)
    backend = sg.StorageBackendFactory.create_backend("dynamic", sg.config(target, {"geometry": GEO.name}), pool)
    backend.register_mem_pool_host(pool)   # what SGLang's cache controller does next
    return backend, pool


def test_a_prompt_stored_through_vllm_reads_back_byte_identical_through_sglang_and_the_client(
        store: Child, tmp_path: Path) -> None:
    tokens, vllm_blocks = stored_through_vllm(store, tmp_path, prompt(100, seed=11))
    n = len(vllm_blocks)

    with kvstore.Client(store.target, geometry=GEO.name) as client:
        assert client.get(tokens[: n * B]).blocks == vllm_blocks
        hashes = client.hashes(tokens)

    backend, pool = sglang_backend(store.target, n + 2)
    try:
        keys = sg.sg_utils.get_storage_hash_str(tokens, None, page_size=B)[:n]   # SGLang's own page keys
        assert keys == [h.hex() for h in hashes]
        assert backend.batch_exists(keys) == n
        assert backend.batch_get_v1(keys, torch.arange(B, (n + 1) * B)) == [True] * n
        assert [pool.page_bytes(1 + i) for i in range(n)] == vllm_blocks
    finally:
        backend.close()


def test_a_prompt_stored_through_sglang_is_loaded_by_the_vllm_connector(store: Child, tmp_path: Path) -> None:
    tokens = prompt(100, seed=12)
    n = len(tokens) // B
    blocks = [b"".join(model_row(tokens, layer, comp, j, rb)
                       for layer, comp, rb in GLOBAL
                       for j in range(i * B // GEO.compress_ratios[layer], (i + 1) * B // GEO.compress_ratios[layer]))
              for i in range(n)]
    backend, pool = sglang_backend(store.target, n + 1)
    try:
        for i, block in enumerate(blocks):
            pool.buf[i * B:(i + 1) * B] = torch.frombuffer(bytearray(block), dtype=torch.uint8).reshape(B, -1)
        keys = sg.sg_utils.get_hash_str(tokens, None, page_size=B)[:n]   # what a write-back is keyed with
        assert backend.batch_set_v1(keys, torch.arange(0, n * B)) == [True] * n
    finally:
        backend.close()
    engine = Engine(tmp_path / "vllm", {"target": store.target, "geometry": GEO.name, "replay_windows": 1})
    engine.add("r2", [*tokens, 1, 2, 3], max_tokens=2)
    so = engine.step()
    # 96 stored by SGLang: a bounded replay loads [0, 88) rounded down to vLLM's 16-token page.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 80
    assert_rows_loaded(engine, "r2", tokens)
    engine.close()


def sglang_v4_backend(target: str, pages: int) -> tuple[object, dict[str, object]]:
    """The backend on SGLang's real DeepSeek-V4 host pools for the tiny geometry, attached as SGLang does."""
    from tests.integrations import test_sglang_v4 as v4  # SGLang's V4 pool classes (imported there)

    layout = V4PageLayout(GEO, page_tokens=V4_PAGE, block_tokens=B)
    pools: dict[str, object] = {}
    for ratio, (kv, index) in POOLS.items():
        if layout.sources(ratio):
            n = len(layout.sources(ratio))
            pools[kv] = v4.side_pool(kv, n, layout.kv_item_bytes(ratio), pages, V4_PAGE)
            pools[index] = v4.side_pool(index, n, layout.index_item_bytes(ratio), pages, V4_PAGE)
    anchor = v4.host.LogicalHostPool(pages * V4_PAGE, V4_PAGE)
    entries = [v4.PoolEntry(name=sg.PoolName.KV, host_pool=anchor, device_pool=None, layer_mapper=lambda i: i,
                         is_primary_index_anchor=True)]
    entries += [v4.PoolEntry(name=sg.PoolName(n), host_pool=p, device_pool=None, layer_mapper=lambda i: i)
                for n, p in pools.items()]
    return v4.attach(target, v4.HostPoolGroup(entries), {"geometry": GEO.name}), pools


def test_a_prompt_stored_through_vllm_reads_back_byte_identical_through_sglang_v4_pages(
        store: Child, tmp_path: Path) -> None:
    tokens, vllm_blocks = stored_through_vllm(store, tmp_path, prompt(2 * V4_PAGE + 20, seed=13))

    backend, pools = sglang_v4_backend(store.target, 3)
    try:
        keys = sg.sg_utils.get_storage_hash_str(tokens, None, page_size=V4_PAGE)[:2]   # SGLang's V4 page keys
        assert backend.batch_exists(keys) == 2
        assert backend.batch_get_v1(keys, torch.arange(V4_PAGE, 3 * V4_PAGE)) == [True, True]
        layout = V4PageLayout(GEO, page_tokens=V4_PAGE, block_tokens=B)
        for p in range(2):
            side = {name: pool.get_data_page((1 + p) * V4_PAGE) for name, pool in pools.items()}  # type: ignore[attr-defined]
            got = pages_to_blocks(layout, side)
            assert [bytes(b.numpy()) for b in got] == vllm_blocks[p * 8:(p + 1) * 8]
    finally:
        backend.close()
