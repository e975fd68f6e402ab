"""SGLang's DeepSeek-V4 HiCache pools against the kvstore backend: refused at start, with what to use instead.

SGLang 0.5.23 builds a V4 HiCache stack (`build_deepseek_v4_hicache_stack`) as a
`HostPoolGroup` anchored on a row-less `LogicalHostPool` (256-token pages), with the
model's rows in `DeepSeekV4PagedHostPool` side pools: deepseek_v4_c2 (source layers 2,
8, 14: 128 compressed-KV slots of 288 B per page), deepseek_v4_c1 (layer 20: 256 slots),
and their _indexer pools (pages of 64 slots x 68 B). The backend does not map those pools
into kvstore blocks yet, so it must refuse them by name, not send the user to a page size
V4 cannot run with. These tests build SGLang's real pool classes on the CPU.

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

from tests.children import Child
from tests.integrations import test_sglang_support as support
from tests.integrations.test_sglang_support import ConfigError, PoolName, StorageBackendFactory, config

# The shared fixtures: pytest finds them by name in this module.
python_tree_core = support.python_tree_core
server = support.server

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


def _side_pool(name: PoolName, layers: int, item_bytes: int) -> Any:
    """A real V4 side pool of 2 host pages, as build_deepseek_v4_hicache_stack makes it (CPU buffers)."""
    device = [torch.zeros(2, item_bytes, dtype=torch.uint8) for _ in range(layers)]
    return host.DeepSeekV4PagedHostPool(pool_name=str(name), device_buffers=device, item_bytes=item_bytes,
                                        num_host_pages=2, slot_page_size=V4_PAGE, pin_memory=False,
                                        page_aligned_only=True)


def _v41_side_pools() -> dict[PoolName, Any]:
    """DeepSeek-V4.1-Flash's side pools: ratio 2 (layers 2, 8, 14) and ratio 1 (layer 20)."""
    return {
        PoolName.DEEPSEEK_V4_C2: _side_pool(PoolName.DEEPSEEK_V4_C2, 3, V4_PAGE // 2 * KV_ROW),
        PoolName.DEEPSEEK_V4_C2_INDEXER: _side_pool(PoolName.DEEPSEEK_V4_C2_INDEXER, 3, V4_PAGE // 2 * INDEX_ROW),
        PoolName.DEEPSEEK_V4_C1: _side_pool(PoolName.DEEPSEEK_V4_C1, 1, V4_PAGE * KV_ROW),
        PoolName.DEEPSEEK_V4_C1_INDEXER: _side_pool(PoolName.DEEPSEEK_V4_C1_INDEXER, 1, V4_PAGE * INDEX_ROW),
    }


def _v41_group() -> Any:
    anchor = host.LogicalHostPool(2 * V4_PAGE, V4_PAGE)
    entries = [PoolEntry(name=PoolName.KV, host_pool=anchor, device_pool=None, layer_mapper=lambda i: i,
                         is_primary_index_anchor=True)]
    entries += [PoolEntry(name=n, host_pool=p, device_pool=None, layer_mapper=lambda i: i)
                for n, p in _v41_side_pools().items()]
    return HostPoolGroup(entries)


def _assert_v4_refusal(exc: pytest.ExceptionInfo[ConfigError]) -> None:
    text = str(exc.value)
    assert "DeepSeek-V4 HiCache is not supported" in text
    assert "256 tokens" in text and "deepseek_v4_c1" in text and "deepseek_v4_c2" in text
    assert "integrations.vllm_connector" in text           # what to use instead
    assert "--page-size" not in text                       # never a page size V4 cannot run with


def test_the_real_v4_side_pools_have_the_page_sizes_the_refusal_names() -> None:
    pools = _v41_side_pools()
    assert all(p.page_size == V4_PAGE for p in pools.values())
    c2 = pools[PoolName.DEEPSEEK_V4_C2].get_dummy_flat_data_page()
    assert c2.numel() == 3 * 128 * KV_ROW                  # 3 layers x 128 slots of 288 B per 256 tokens
    index = pools[PoolName.DEEPSEEK_V4_C2_INDEXER].get_dummy_flat_data_page()
    assert index.numel() == 3 * 2 * INDEX_PAGE * INDEX_ROW  # two 64-slot indexer pages per layer
    assert host.LogicalHostPool(V4_PAGE, V4_PAGE).get_dummy_flat_data_page().numel() == 0   # no rows at all


def test_a_v4_host_pool_group_is_refused_when_registered(server: Child) -> None:
    group = _v41_group()
    backend = StorageBackendFactory.create_backend("dynamic", config(server.target), group)
    try:
        with pytest.raises(ConfigError) as exc:
            backend.register_mem_pool_host(group)   # what SGLang's cache controller does after the factory
        _assert_v4_refusal(exc)
        with pytest.raises(ConfigError) as exc:
            backend.register_mem_pool_host(host.LogicalHostPool(2 * V4_PAGE, V4_PAGE))   # the bare anchor
        _assert_v4_refusal(exc)
        assert backend.counters()["pages_written"] == 0
    finally:
        backend.close()


@pytest.mark.parametrize("name", [PoolName.DEEPSEEK_V4_C2, PoolName.DEEPSEEK_V4_C2_INDEXER,
                                  PoolName.DEEPSEEK_V4_C1, PoolName.DEEPSEEK_V4_C1_INDEXER])
def test_each_v4_side_pool_is_refused_by_name(server: Child, name: PoolName) -> None:
    backend = StorageBackendFactory.create_backend("dynamic", config(server.target), None)
    try:
        with pytest.raises(ConfigError) as exc:
            backend.register_mem_host_pool_v2(_v41_side_pools()[name], name)
        _assert_v4_refusal(exc)
        assert str(name) not in getattr(backend, "registered_pools", {})
    finally:
        backend.close()
