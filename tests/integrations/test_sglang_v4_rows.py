"""integrations.sglang_v4: SGLang's DeepSeek-V4.1 side-pool pages <-> kvstore blocks, byte for byte.

Against SGLang's real classes on the CPU: `DeepSeekV4PagedHostPool` (the host pages the
backend would read and write), `DeepSeekV4IndexerPool.get_index_k_fp4` (SGLang's own CPU
read of an indexer row from a page) and `KVLayout.row_addressing` (where SGLang's kernels
find a compressed-KV row's data and scales). The blocks are kvstore's own, made from
model rows by `kvstore.codec.block_codec.encode_blocks`.
"""

from __future__ import annotations

import pytest
import torch
from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

from integrations.sglang_v4 import POOLS, V4PageLayout, blocks_to_pages, pages_to_blocks
from kvstore.codec.block_codec import encode_blocks, split_blocks
from kvstore.errors import ConfigError
from tests.integrations.test_sglang_support import GEO, PoolName
from tests.integrations.test_sglang_v4 import V4_PAGE, host, v4_pool

BLOCKS = V4_PAGE // 64


def _blocks(seed: int) -> torch.Tensor:
    """Four kvstore blocks (one 256-token page) of the model's rows, from random values."""
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for s in GEO.kv_source_layers:
        rows = BLOCKS * GEO.block_rows(s, 64)
        layers[s] = (torch.randn(rows, GEO.head_dim, generator=g), torch.randn(rows, GEO.index_head_dim, generator=g))
    return encode_blocks(GEO, layers, 64)


def _pools(layout: V4PageLayout) -> dict[str, object]:
    """SGLang's real side pools for the layout (2 host pages each)."""
    out = {}
    for ratio, (kv, index) in POOLS.items():
        n = len(layout.sources(ratio))
        for name, item in ((kv, layout.kv_item_bytes(ratio)), (index, layout.index_item_bytes(ratio))):
            device = [torch.zeros(2, item, dtype=torch.uint8) for _ in range(n)]
            out[name] = host.DeepSeekV4PagedHostPool(pool_name=name, device_buffers=device, item_bytes=item,
                                                     num_host_pages=2, slot_page_size=V4_PAGE, pin_memory=False,
                                                     page_aligned_only=True)
    return out


@pytest.mark.parametrize("interleaved", [False, True])
def test_blocks_go_through_sglangs_host_pools_and_come_back_byte_identical(interleaved: bool) -> None:
    layout = V4PageLayout(GEO, interleaved=interleaved)
    blocks = _blocks(1)
    pools = _pools(layout)
    assert {str(n) for n in (PoolName.DEEPSEEK_V4_C1, PoolName.DEEPSEEK_V4_C2, PoolName.DEEPSEEK_V4_C1_INDEXER,
                             PoolName.DEEPSEEK_V4_C2_INDEXER)} == set(pools)
    for name, page in blocks_to_pages(layout, blocks).items():
        pools[name].set_from_flat_data_page(V4_PAGE, page.flatten())      # host page 1, as SGLang's get would
    read = {name: pool.get_data_page(V4_PAGE, flat=True) for name, pool in pools.items()}
    assert torch.equal(pages_to_blocks(layout, read), blocks)
    assert all(p.get_data_page(0).count_nonzero() == 0 for p in pools.values())   # page 0 untouched


@pytest.mark.parametrize("interleaved", [False, True])
def test_compressed_kv_rows_sit_where_sglangs_kv_layout_addresses_them(interleaved: bool) -> None:
    layout = V4PageLayout(GEO, interleaved=interleaved)
    kv_layout = KVLayout.V41_FP4_NEW if interleaved else KVLayout.V41_FP4
    blocks = _blocks(2)
    pages = blocks_to_pages(layout, blocks)
    rows = split_blocks(GEO, blocks, 64)
    assert layout.kv_item_bytes(2) == kv_layout.page_bytes(128) and layout.kv_item_bytes(1) == kv_layout.page_bytes(256)
    for ratio, (kv_name, _) in POOLS.items():
        slots = layout.slots(ratio)
        stride, scale_base, scale_stride = kv_layout.row_addressing(slots)
        for i, layer in enumerate(layout.sources(ratio)):
            page = pages[kv_name][i]
            for slot in (0, 1, slots // 2 + 3, slots - 1):
                data = page[slot * stride:slot * stride + kv_layout.data_bytes]
                scales = page[scale_base + slot * scale_stride:scale_base + slot * scale_stride + kv_layout.scale_bytes]
                per_block = slots // BLOCKS
                expected = rows[layer][0][slot // per_block, slot % per_block]
                assert torch.equal(torch.cat([data, scales]), expected), (layer, slot)


def test_indexer_rows_read_back_through_sglangs_own_indexer_pool() -> None:
    layout = V4PageLayout(GEO)
    blocks = _blocks(3)
    pages = blocks_to_pages(layout, blocks)
    rows = split_blocks(GEO, blocks, 64)
    for ratio, (_, index_name) in POOLS.items():
        sources, slots = layout.sources(ratio), layout.slots(ratio)
        pool = v4_pool.DeepSeekV4IndexerPool(2 * slots, 64, torch.bfloat16, GEO.index_head_dim, len(sources), "cpu",
                                             False, use_fp4_indexer=True, global_page_size=V4_PAGE)
        for i, layer in enumerate(sources):
            buffer = pool.index_k_with_scale_buffer[i]
            buffer[:slots // 64].copy_(pages[index_name][i].view(slots // 64, -1))   # the device pages of one page
            payload, scales = pool.get_index_k_fp4(i, torch.arange(slots))
            got = torch.cat([payload.view(torch.uint8), scales.view(torch.uint8).reshape(slots, 4)], dim=1)
            expected = rows[layer][1].reshape(slots, -1)
            assert torch.equal(got, expected), layer


def test_pages_that_cannot_hold_whole_indexer_pages_or_blocks_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least 128 tokens"):
        V4PageLayout(GEO, page_tokens=64)
    with pytest.raises(ConfigError, match="not a whole number"):
        V4PageLayout(GEO, page_tokens=160)
    layout = V4PageLayout(GEO, page_tokens=128)
    assert layout.blocks_per_page == 2 and layout.index_item_bytes(2) == 64 * 68
    with pytest.raises(ConfigError, match="2 blocks"):
        blocks_to_pages(layout, _blocks(4))
    with pytest.raises(ConfigError, match="no 'deepseek_v4_c1' pool data"):
        pages_to_blocks(V4PageLayout(GEO), {k: v for k, v in blocks_to_pages(V4PageLayout(GEO), _blocks(5)).items()
                                            if k != "deepseek_v4_c1"})
