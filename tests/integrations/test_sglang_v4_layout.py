"""SGLang's default DeepSeek-V4 layout (SGLANG_DSV4_KV_LAYOUT=v4, every GPU but SM100) served byte for byte.

SGLang 0.5.23's V4 rows are 584 B (448 E4M3 NoPE + 64 BF16 RoPE, 7 UE8M0 scales and a pad byte;
`KVLayout.V4`), block-split in pages padded to 576 B, for compressed KV and the SWA window alike;
its ratio-1/2 indexer keeps FP4 index pages. These tests build SGLang's real V4 host pools at those
sizes, lay rows into them with SGLang's own `KVLayout.V4.row_addressing`, and check that the backend
stores them as blocks of the `sglang-v4` layout (kvstore.layout), found only under it, and reads them
back byte for byte, with the window as a snapshot of 584-B rows.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

from integrations import sglang_v4_pools
from kvstore import layout
from tests.children import Child
from tests.integrations import test_sglang_support as support
from tests.integrations.test_sglang_support import GEO, PoolName, kvstore, sg_utils
from tests.integrations.test_sglang_v4 import INDEX_PAGE, INDEX_ROW, V4_PAGE, attach, side_pool, v41_group
from tests.integrations.test_sglang_v4_pages import SIDE, N, page_bytes, side_transfers, slots, swa_transfer, tokens_of

python_tree_core = support.python_tree_core
server = support.server

ENGINE = GEO.with_records(layout.SGLANG_V4)
ROW = 584
SOURCES = {2: (2, 8, 14), 1: (20,)}   # ratio -> V4.1-Flash's source layers of that ratio (SGLang's pool order)
KV_POOL = {2: PoolName.DEEPSEEK_V4_C2, 1: PoolName.DEEPSEEK_V4_C1}
INDEX_POOL = {2: PoolName.DEEPSEEK_V4_C2_INDEXER, 1: PoolName.DEEPSEEK_V4_C1_INDEXER}


def v4_group(pages: int) -> Any:
    """SGLang's host pool group with V4's compressed-KV and SWA pools (KVLayout.V4.page_bytes sizes)."""
    return v41_group(pages=pages, swa=True, extra={
        PoolName.DEEPSEEK_V4_C2: side_pool(PoolName.DEEPSEEK_V4_C2, 3, KVLayout.V4.page_bytes(128), pages),
        PoolName.DEEPSEEK_V4_C1: side_pool(PoolName.DEEPSEEK_V4_C1, 1, KVLayout.V4.page_bytes(256), pages),
        PoolName.SWA: side_pool(PoolName.SWA, 40, KVLayout.V4.page_bytes(V4_PAGE), pages)})


def v4_page(rows: torch.Tensor) -> torch.Tensor:
    """`[layers, slots, 584]` rows as SGLang's V4 page per layer (its own row_addressing; padding zero)."""
    layers, n, _ = rows.shape
    stride, base, scale_stride = KVLayout.V4.row_addressing(n)
    page = torch.zeros(layers, KVLayout.V4.page_bytes(n), dtype=torch.uint8)
    for i in range(n):
        page[:, i * stride: i * stride + 576] = rows[:, i, :576]
        page[:, base + i * scale_stride: base + i * scale_stride + 8] = rows[:, i, 576:]
    return page


def index_page(rows: torch.Tensor) -> torch.Tensor:
    """`[layers, slots, 68]` FP4 indexer rows as SGLang's index pages: per 64 slots, [64 x 64 B][64 x 4 B]."""
    layers, n, _ = rows.shape
    g = rows.view(layers, n // INDEX_PAGE, INDEX_PAGE, INDEX_ROW)
    return torch.cat([g[..., :64].reshape(layers, n // INDEX_PAGE, -1),
                      g[..., 64:].reshape(layers, n // INDEX_PAGE, -1)], dim=-1).reshape(layers, -1)


def fill(group: Any, first_page: int, pages: int, seed: int) -> list[bytes]:
    """Random V4 rows laid into the side pools at host pages [first_page, +pages); the kvstore blocks they are
    (per source layer, the block's compressed-KV rows then its indexer rows, each 584 / 68 B)."""
    g = torch.Generator().manual_seed(seed)
    blocks: list[bytes] = []
    for p in range(pages):
        rows = {}
        for ratio, layers in SOURCES.items():
            kv = torch.randint(0, 256, (len(layers), V4_PAGE // ratio, ROW), generator=g, dtype=torch.uint8)
            ix = torch.randint(0, 256, (len(layers), V4_PAGE // ratio, INDEX_ROW), generator=g, dtype=torch.uint8)
            group.get_pool(KV_POOL[ratio]).set_from_flat_data_page((first_page + p) * V4_PAGE, v4_page(kv).flatten())
            group.get_pool(INDEX_POOL[ratio]).set_from_flat_data_page((first_page + p) * V4_PAGE,
                                                                      index_page(ix).flatten())
            rows.update({layer: (kv[i], ix[i], 64 // ratio) for i, layer in enumerate(layers)})
        for b in range(N):
            blocks.append(b"".join(bytes(part[b * per:(b + 1) * per].flatten().numpy())
                                   for layer in (2, 8, 14, 20) for kv, ix, per in [rows[layer]] for part in (kv, ix)))
    return blocks


def test_sglangs_default_is_the_v4_layout_off_sm100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_DSV4_KV_LAYOUT", raising=False)
    assert sglang_v4_pools.records() is layout.SGLANG_V4           # SGLANG_DSV4_KV_LAYOUT defaults to v4
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "auto")
    assert sglang_v4_pools.records() is layout.SGLANG_V4           # auto keeps V4 off SM100/SM103 (this host)
    for mode in ("v41", "v41_new"):
        monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", mode)
        assert sglang_v4_pools.records() is layout.MODEL_NATIVE


def test_an_attention_backend_that_fixes_the_layout_is_followed_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from sglang.srt import runtime_context

    from kvstore.errors import ConfigError

    def published(backend: str) -> None:   # what a started SGLang server publishes as its "exec" config
        monkeypatch.setattr(runtime_context, "get_exec", lambda: SimpleNamespace(
            kernel=SimpleNamespace(dsv4_attn_backend=backend)))

    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v4")
    published("flashmla_mega")
    assert sglang_v4_pools.records() is layout.MODEL_NATIVE       # SGLang forces v41 for flashmla_mega
    published("trtllm")
    with pytest.raises(ConfigError, match="dsv4_attn_backend trtllm keeps uniform FP8 pools"):
        sglang_v4_pools.records()
    published("flashmla")
    assert sglang_v4_pools.records() is layout.SGLANG_V4


@pytest.mark.parametrize("share", [False, True], ids=["share-off", "share-on"])
def test_v4_pages_are_stored_under_their_layout_and_read_back_byte_for_byte(
        server: Child, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, share: bool) -> None:
    # Random rows are no image of an FP4 row: with sharing on (the default) they stay SGLang's records too
    # (integrations.sglang_share), the backend's keys being the model chain's.
    monkeypatch.delenv("SGLANG_DSV4_KV_LAYOUT", raising=False)     # SGLang's default
    group = v4_group(pages=4)
    with caplog.at_level(logging.INFO, logger="integrations.common"):
        backend = attach(server.target, group, {"share_model_rows": share})
    try:
        engine_client = backend.sharing.engine if share else backend.client
        assert engine_client.geometry == ENGINE.name and engine_client.block_bytes == 4 * 26_080
        assert backend.client.geometry == (GEO.name if share else ENGINE.name)
        assert "sglang-v4 rows (SGLANG_DSV4_KV_LAYOUT=v4" in caplog.text     # the layout, said at attach
        tokens = tokens_of(41, 2)
        blocks = fill(group, 0, 2, seed=41)
        saved = [page_bytes(group, p) for p in range(2)]
        keys = sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:2]
        with kvstore.Client(server.target, geometry=ENGINE.name) as engine, kvstore.Client(server.target) as native:
            assert keys == [h.hex() for h in (native if share else engine).hashes(tokens)][N - 1::N]
            assert backend.batch_set_v2(side_transfers(keys, slots(0, 2))) == {str(n): [True] * 2 for n in SIDE}
            assert backend.batch_set_v1(keys, slots(0, 2)) == [True, True]
            assert engine.get(tokens[:2 * V4_PAGE]).blocks == blocks            # the engine's rows, byte for byte
            assert native.lookup(tokens).found_blocks == 0                      # never the model's rows
            assert backend.counters().get("blocks_engine", 2 * N) == 2 * N
            # Read back into host pages 2 and 3, as SGLang's prefetch does.
            assert backend.batch_exists_v2(keys, side_transfers(keys, slots(2, 2))).kv_hit_pages == 2
            assert backend.batch_get_v1(keys, slots(2, 2)) == [True, True]
            assert [page_bytes(group, 2 + p) for p in range(2)] == saved
            # The window: the page ending the prefix, 584-B rows, as kvstore's snapshot at T = 512.
            swa = group.get_pool(PoolName.SWA)
            window = torch.randint(0, 256, (40, V4_PAGE, ROW), generator=torch.Generator().manual_seed(42),
                                   dtype=torch.uint8)
            swa.set_from_flat_data_page(V4_PAGE, v4_page(window).flatten())
            assert backend.batch_set_v2([swa_transfer(keys[1:], 1)]) == {PoolName.SWA.value: [True]}
            snap = engine.swa.get(tokens[:2 * V4_PAGE])
            assert snap is not None and bytes(snap) == bytes(window[:, V4_PAGE - 128:].contiguous().numpy())
            assert native.swa.get(tokens[:2 * V4_PAGE]) is None
            assert backend.batch_get_v2([swa_transfer(keys[1:], 3)]) == {PoolName.SWA.value: [True]}
            older = window.clone()
            older[:, :V4_PAGE - 128] = 0                                       # below the window: zero
            assert torch.equal(swa.get_data_page(3 * V4_PAGE).view(40, -1), v4_page(older))
    finally:
        backend.close()
    # An SGLang keeping the model's rows (v41, SM100) finds none of them.
    monkeypatch.setenv("SGLANG_DSV4_KV_LAYOUT", "v41")
    other = attach(server.target, v41_group(pages=2))
    try:
        assert other.client.geometry == GEO.name
        assert other.batch_exists(sg_utils.get_hash_str(tokens, None, page_size=V4_PAGE)[:2]) == 0
    finally:
        other.close()
