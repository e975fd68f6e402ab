"""SGLang's DeepSeek-V4 HiCache pools registered with the kvstore backend: what it serves, what it refuses.

SGLang 0.5.23 builds a V4 HiCache stack (`build_deepseek_v4_hicache_stack`) as a
`HostPoolGroup` anchored on a row-less `LogicalHostPool` (256-token pages), with the
model's rows in `DeepSeekV4PagedHostPool` side pools: deepseek_v4_c2 (source layers 2,
8, 14: 128 compressed-KV slots of 288 B per page), deepseek_v4_c1 (layer 20: 256 slots),
their _indexer pools (pages of 64 slots x 68 B) and the "swa" window pool (40 layers x
256 V41 rows of 528 B). These tests build SGLang's real pool classes on the CPU, as that
builder does, and register them as its cache controller does (the anchor, then every
entry, then `on_host_pools_registered`). The pages' data: test_sglang_v4_pages.py.

Importing them loads SGLang's model-config and quantization trees, which need packages
the lean engine install leaves out (torchvision, compressed_tensors, gguf, sentencepiece);
`_import_with_stand_ins` stands in empty modules for the SGLang modules that import those
(none of them is used by a host pool), only when the plain import fails, and takes the
stand-ins out of `sys.modules` again afterwards.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import pytest
import torch
from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

from tests.children import Child
from tests.integrations import test_sglang_support as support
from tests.integrations.test_sglang_support import ConfigError, PoolName, StorageBackendFactory, config

# The shared fixtures: pytest finds them by name in this module.
python_tree_core = support.python_tree_core
server = support.server


@pytest.fixture(autouse=True)
def v41_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang keeps V4.1 rows (SGLANG_DSV4_KV_LAYOUT=v41, SM100): these pools are V4.1's. Its default, v4, keeps
    584-B rows, served under their own layout (test_sglang_v4_layout.py)."""
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")

#: SGLang modules that import packages the lean install lacks; none is used by a host pool.
_UNUSED_HEAVY = (
    "sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr", "sglang.srt.configs.internvl",
    "sglang.srt.layers.quantization.gguf", "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors",
    "sglang.srt.layers.quantization.compressed_tensors.utils",
    *(f"sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_{s}" for s in (
        "w4a4_mxint4_moe", "w4a8_fp8_moe", "w8a8_fp8", "w8a8_fp8_moe", "w8a8_int8", "w8a8_int8_moe", "w8a16_fp8",
        "wNa16", "wNa16_moe")),
)


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def attr(a: str) -> Any:
        if a.startswith("__"):
            raise AttributeError(a)
        return type(a, (), {"model_type": f"unused-{a}"})

    module.__getattr__ = attr  # type: ignore[method-assign]
    return module


def _import_with_stand_ins(*names: str) -> list[types.ModuleType]:
    """SGLang's modules `names`, importing them with stand-ins for `_UNUSED_HEAVY` when the plain import fails."""
    try:
        return [importlib.import_module(n) for n in names]
    except ImportError:
        pass
    added = [n for n in _UNUSED_HEAVY if n not in sys.modules]
    for n in added:
        sys.modules[n] = _stand_in(n)
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        for n in added:
            sys.modules.pop(n, None)


host, v4_pool = _import_with_stand_ins("sglang.srt.mem_cache.memory_pool_host",
                                       "sglang.srt.mem_cache.deepseek_v4_memory_pool")
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402

V4_PAGE = 256   # SGLang's page size for DeepSeek-V4 (arg_groups/model_overrides/deepseek_v4.py)
KV_ROW, INDEX_ROW, INDEX_PAGE = 288, 68, 64   # V41_FP4 compressed KV row, FP4 indexer row, its slots per page
SWA_ITEM = V4_PAGE * 528                      # a V41 SWA page per layer: 256 x (512 B E4M3 + 16 B UE8M0)


def side_pool(name: str, layers: int, item_bytes: int, pages: int = 2, page_size: int = V4_PAGE) -> Any:
    """A real V4 host pool of `pages` host pages, as build_deepseek_v4_hicache_stack makes it (CPU buffers)."""
    device = [torch.zeros(2, item_bytes, dtype=torch.uint8) for _ in range(layers)]
    return host.DeepSeekV4PagedHostPool(pool_name=str(name), device_buffers=device, item_bytes=item_bytes,
                                        num_host_pages=pages, slot_page_size=page_size, pin_memory=False,
                                        page_aligned_only=True)


def v41_side_pools(pages: int = 2) -> dict[PoolName, Any]:
    """DeepSeek-V4.1-Flash's side pools: ratio 2 (layers 2, 8, 14) and ratio 1 (layer 20)."""
    return {
        PoolName.DEEPSEEK_V4_C2: side_pool(PoolName.DEEPSEEK_V4_C2, 3, V4_PAGE // 2 * KV_ROW, pages),
        PoolName.DEEPSEEK_V4_C2_INDEXER: side_pool(PoolName.DEEPSEEK_V4_C2_INDEXER, 3, V4_PAGE // 2 * INDEX_ROW, pages),
        PoolName.DEEPSEEK_V4_C1: side_pool(PoolName.DEEPSEEK_V4_C1, 1, V4_PAGE * KV_ROW, pages),
        PoolName.DEEPSEEK_V4_C1_INDEXER: side_pool(PoolName.DEEPSEEK_V4_C1_INDEXER, 1, V4_PAGE * INDEX_ROW, pages),
    }


def v41_group(pages: int = 2, *, swa: bool = False, extra: dict[PoolName, Any] | None = None,
              leave_out: PoolName | None = None) -> Any:
    """SGLang's V4.1 host pool group: the logical anchor, the side pools (and the SWA window pool)."""
    anchor = host.LogicalHostPool(pages * V4_PAGE, V4_PAGE)
    pools = {**v41_side_pools(pages), **({PoolName.SWA: side_pool(PoolName.SWA, 40, SWA_ITEM, pages)} if swa else {}),
             **(extra or {})}
    entries = [PoolEntry(name=PoolName.KV, host_pool=anchor, device_pool=None, layer_mapper=lambda i: i,
                         is_primary_index_anchor=True)]
    entries += [PoolEntry(name=n, host_pool=p, device_pool=None, layer_mapper=lambda i: i)
                for n, p in pools.items() if n != leave_out]
    return HostPoolGroup(entries)


def attach(target: str, group: Any, extra: dict[str, Any] | None = None) -> Any:
    """The backend as SGLang's hybrid cache controller attaches it: made by the factory with the anchor,
    the anchor registered, then every entry of the group, then the end of registration."""
    anchor = group.anchor_entry.host_pool
    backend = StorageBackendFactory.create_backend("dynamic", config(target, extra), anchor)
    try:
        backend.register_mem_pool_host(anchor)
        for entry in group.entries:
            backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
        backend.on_host_pools_registered()
    except BaseException:
        backend.close()
        raise
    return backend


def test_the_real_v4_pools_have_the_page_sizes_the_backend_checks() -> None:
    pools = v41_side_pools()
    assert all(p.page_size == V4_PAGE for p in pools.values())
    c2 = pools[PoolName.DEEPSEEK_V4_C2].get_dummy_flat_data_page()
    assert c2.numel() == 3 * 128 * KV_ROW                  # 3 layers x 128 slots of 288 B per 256 tokens
    index = pools[PoolName.DEEPSEEK_V4_C2_INDEXER].get_dummy_flat_data_page()
    assert index.numel() == 3 * 2 * INDEX_PAGE * INDEX_ROW  # two 64-slot indexer pages per layer
    assert host.LogicalHostPool(V4_PAGE, V4_PAGE).get_dummy_flat_data_page().numel() == 0   # no rows at all
    assert KVLayout.V41.page_bytes(V4_PAGE) == SWA_ITEM == KVLayout.V41_NEW.page_bytes(V4_PAGE)


def test_a_v41_stack_is_served_with_256_token_pages_of_four_blocks(server: Child) -> None:
    backend = attach(server.target, v41_group(swa=True))
    try:
        assert backend.page_size == V4_PAGE and backend.blocks_per_page == 4
        assert backend.v4 is not None and not backend.v4.layout.interleaved
        assert set(backend.v4.pools) == {str(n) for n in v41_side_pools()}
    finally:
        backend.close()
    group = v41_group()   # registering the group itself registers its entries
    made = StorageBackendFactory.create_backend("dynamic", config(server.target), group)
    try:
        made.register_mem_pool_host(group)
        made.on_host_pools_registered()
        assert made.blocks_per_page == 4 and len(made.v4.pools) == 4
    finally:
        made.close()


@pytest.mark.parametrize("name, item, message", [
    (PoolName.DEEPSEEK_V4_C4, 64 * 584, "ratio-4 compressed KV belongs to DeepSeek-V4"),
    (PoolName.DEEPSEEK_V4_C128, 2 * 584, "ratio-128"),
    (PoolName.DEEPSEEK_V4_C4_STATE, 1024, "compressor state pools"),
    (PoolName.DEEPSEEK_V4_C2_INDEXER_SCALE, 512, "only on AMD"),
    (PoolName.DEEPSEEK_V4_C4_ROPE, 512, "rope half"),
    (PoolName.DRAFT, 512, "draft"),
])
def test_v4_pools_kvstore_does_not_keep_are_refused_saying_why(server: Child, name: PoolName, item: int,
                                                                 message: str) -> None:
    with pytest.raises(ConfigError, match=message) as exc:
        attach(server.target, v41_group(extra={name: side_pool(name, 1, item)}))
    assert str(name) in str(exc.value) and "not served" in str(exc.value)


def test_v4_rows_of_another_layout_are_refused_naming_the_setting(server: Child) -> None:
    # SGLang's V4 layout (fp8 nope + bf16 rope, 584 B rows) with SGLANG_DSV4_KV_LAYOUT=v41 set: not V4.1's rows.
    v4_rows = side_pool(PoolName.DEEPSEEK_V4_C2, 3, KVLayout.V4.page_bytes(128))
    with pytest.raises(ConfigError, match="SGLANG_DSV4_KV_LAYOUT=v4 ") as exc:
        attach(server.target, v41_group(extra={PoolName.DEEPSEEK_V4_C2: v4_rows}))
    assert "'deepseek_v4_c2'" in str(exc.value)
    v4_swa = side_pool(PoolName.SWA, 40, KVLayout.V4.page_bytes(V4_PAGE))
    with pytest.raises(ConfigError, match="SWA host pool has 40 layers x 149760 B"):
        attach(server.target, v41_group(extra={PoolName.SWA: v4_swa}))


def test_a_v4_swa_pool_with_draft_layers_is_refused(server: Child) -> None:
    with pytest.raises(ConfigError, match="1 of them MTP/DSpark draft layers"):
        attach(server.target, v41_group(extra={PoolName.SWA: side_pool(PoolName.SWA, 41, SWA_ITEM)}))


def test_a_v4_stack_missing_a_side_pool_is_refused_when_registration_ends(server: Child) -> None:
    with pytest.raises(ConfigError, match=r"registered no \['deepseek_v4_c1'\] host pool"):
        attach(server.target, v41_group(leave_out=PoolName.DEEPSEEK_V4_C1))


def test_a_v4_stack_needs_interface_v1(server: Child) -> None:
    with pytest.raises(ConfigError, match='"interface_v1": 1'):
        attach(server.target, v41_group(), {"interface_v1": None})


@pytest.mark.parametrize("name", [PoolName.DEEPSEEK_V4_C2, PoolName.DEEPSEEK_V4_C1_INDEXER])
def test_a_v4_side_pool_without_its_anchor_is_refused(server: Child, name: PoolName) -> None:
    backend = StorageBackendFactory.create_backend("dynamic", config(server.target), None)
    try:
        with pytest.raises(ConfigError, match="came before its anchor"):
            backend.register_mem_host_pool_v2(v41_side_pools()[name], name)
        assert str(name) not in getattr(backend, "registered_pools", {})
    finally:
        backend.close()


def test_a_v4_page_that_cannot_hold_whole_indexer_pages_is_refused(server: Child) -> None:
    anchor = host.LogicalHostPool(4 * 64, 64)   # 64-token pages: 32 ratio-2 slots, half an indexer page
    backend = StorageBackendFactory.create_backend("dynamic", config(server.target), anchor)
    try:
        with pytest.raises(ConfigError, match="at least 128 tokens"):
            backend.register_mem_pool_host(anchor)
        assert backend.v4 is None
    finally:
        backend.close()
