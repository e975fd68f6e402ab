"""SGLang's DeepSeek-V4.1 HiCache side-pool pages <-> kvstore blocks: the row mapping.

The backend (sglang_v4_io) joins a V4 page's side-pool pages into kvstore blocks with
it, byte for byte (the same bytes the vLLM connector and `kvstore.Client` store for
the same rows), and splits them back.

SGLang 0.5.23 (`build_deepseek_v4_hicache_stack`) mirrors, per page of `page_tokens`
tokens and per source layer of each compression ratio (`DeepSeekV4PagedHostPool`, one
`item_bytes` page per layer, layers in source order):

- `deepseek_v4_c2` / `deepseek_v4_c1` (compressed KV, `page_tokens / ratio` slots,
  `KVLayout.V41_FP4`): block-split `[slots x 256 B E2M1 data][slots x 32 B E4M3 scales]`,
  padded to 256 B; or interleaved (`V41_FP4_NEW`, SGLANG_DSV4_KV_LAYOUT=v41_new): slots
  rows of `[data][scales]`, 288 B, padded to 288 B: kvstore's row.
- `deepseek_v4_c2_indexer` / `deepseek_v4_c1_indexer` (FP4 indexer keys,
  `DeepSeekV4IndexerPool`): index pages of `index_page_slots` slots (64; 128 with
  DeepGEMM's paged sparse MQA logits), each `[slots x 64 B E2M1][slots x 4 B UE8M0]`.

A kvstore block (kvstore.codec.block_codec) holds, per source layer, the block's
compressed-KV rows then its indexer rows, each row `[data][scales]`.

With SGLang's default `SGLANG_DSV4_KV_LAYOUT=v4` (every GPU but SM100/SM103) the compressed-KV
pages are `KVLayout.V4` instead: block-split `[slots x 576 B][slots x 8 B]` (448 E4M3 NoPE + 64
BF16 RoPE, 7 UE8M0 scales and a pad byte), padded to 576 B, and the indexer pages are the same
FP4 index pages. The geometry then is the model's in the `sglang-v4` record layout
(kvstore.layout): its 584-B rows are stored as they are, under keys of their own; the mapping is
the same, with the row's data and scale widths taken from the layout (`ModelGeometry.row_split`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvstore.codec.block_codec import join_blocks, split_blocks
from kvstore.errors import ConfigError
from kvstore.geometry import ModelGeometry

#: SGLang's pool names (`PoolName` values) per compression ratio: (compressed KV, indexer keys).
POOLS = {2: ("deepseek_v4_c2", "deepseek_v4_c2_indexer"), 1: ("deepseek_v4_c1", "deepseek_v4_c1_indexer")}


@dataclass(frozen=True)
class V4PageLayout:
    """How SGLang arranges one V4.1 page of `page_tokens` tokens in its side pools.

    Args:
        geometry: the model's cache geometry (row widths, source layers and their ratios).
        page_tokens: SGLang's page size (256 on GPU).
        block_tokens: kvstore's block size (64).
        interleaved: compressed-KV pages in `V41_FP4_NEW` (rows `[data][scales]`) rather than block-split.
        index_page_slots: slots per indexer page (`DSV41_INDEX_PAGE_SIZE`).
    """

    geometry: ModelGeometry
    page_tokens: int = 256
    block_tokens: int = 64
    interleaved: bool = False
    index_page_slots: int = 64

    def __post_init__(self) -> None:
        if self.page_tokens % self.block_tokens:
            raise ConfigError(f"SGLang's V4 page ({self.page_tokens} tokens) is not a whole number of "
                              f"{self.block_tokens}-token kvstore blocks")
        for ratio in POOLS:
            if self.sources(ratio) and self.slots(ratio) % self.index_page_slots:
                raise ConfigError(f"a {self.page_tokens}-token page holds {self.slots(ratio)} ratio-{ratio} slots, "
                                  f"not whole {self.index_page_slots}-slot indexer pages (SGLang needs pages of "
                                  f"at least {self.index_page_slots * ratio} tokens)")

    def sources(self, ratio: int) -> tuple[int, ...]:
        """The source layers of one ratio, in SGLang's pool order (the geometry's)."""
        return tuple(s for s in self.geometry.kv_source_layers if self.geometry.compress_ratios[s] == ratio)

    def slots(self, ratio: int) -> int:
        """Compressed rows (slots) of one ratio in a page."""
        return self.page_tokens // ratio

    def kv_item_bytes(self, ratio: int) -> int:
        """A compressed-KV pool's page per layer (SGLang's `KVLayout.page_bytes`: padded to the data
        row, 256 B for V41_FP4 and 576 B for V4, or to the whole row when interleaved)."""
        data, scales = self.geometry.row_split("compressed_kv")
        align = data + scales if self.interleaved else data
        return -(-self.slots(ratio) * (data + scales) // align) * align

    def index_item_bytes(self, ratio: int) -> int:
        """An indexer pool's page per layer: whole indexer pages."""
        return self.slots(ratio) * self.geometry.indexer_row_bytes

    @property
    def blocks_per_page(self) -> int:
        """kvstore blocks in one SGLang page."""
        return self.page_tokens // self.block_tokens


def _kv_rows(layout: V4PageLayout, page: torch.Tensor, slots: int) -> torch.Tensor:
    """`[layers, slots, row]` rows (a copy when block-split) from compressed-KV pages `[layers, item]`."""
    row = layout.geometry.compressed_kv_row_bytes
    data = layout.geometry.row_split("compressed_kv")[0]
    if layout.interleaved:
        return page[:, :slots * row].reshape(-1, slots, row)
    return torch.cat([page[:, :slots * data].reshape(-1, slots, data),
                      page[:, slots * data:slots * row].reshape(-1, slots, row - data)], dim=-1)


def _index_rows(layout: V4PageLayout, page: torch.Tensor, slots: int) -> torch.Tensor:
    """`[layers, slots, row]` indexer rows from indexer pages `[layers, item]` (index pages of data then scales)."""
    row = layout.geometry.indexer_row_bytes
    data = layout.geometry.row_split("indexer")[0]
    per = layout.index_page_slots
    pages = page[:, :slots * row].reshape(-1, slots // per, per * row)
    rows = torch.cat([pages[..., :per * data].reshape(-1, slots // per, per, data),
                      pages[..., per * data:].reshape(-1, slots // per, per, row - data)], dim=-1)
    return rows.reshape(-1, slots, row)


def _check(name: str, page: torch.Tensor | None, layers: int, item: int) -> torch.Tensor:
    if page is None:
        raise ConfigError(f"the V4 page has no {name!r} pool data")
    if page.dtype != torch.uint8 or page.numel() != layers * item:
        raise ConfigError(f"{name!r} page: expected {layers} x {item} uint8 bytes, got {page.dtype} x {page.numel()}")
    return page.reshape(layers, item)


def pages_to_blocks(layout: V4PageLayout, pages: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The kvstore blocks of one SGLang V4.1 page.

    Args:
        layout: the page arrangement.
        pages: pool name (POOLS) -> that pool's page, uint8 `[layers, item_bytes]` or flat
            (`DeepSeekV4PagedHostPool.get_data_page(i, flat=True)`).

    Returns:
        uint8 `[blocks_per_page, block_bytes]`, the page's blocks in position order.

    Raises:
        ConfigError: a pool missing, or a page of the wrong size.
    """
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for ratio, (kv_name, index_name) in POOLS.items():
        sources = layout.sources(ratio)
        if not sources:
            continue
        slots = layout.slots(ratio)
        kv = _kv_rows(layout, _check(kv_name, pages.get(kv_name), len(sources), layout.kv_item_bytes(ratio)), slots)
        index = _index_rows(layout, _check(index_name, pages.get(index_name), len(sources),
                                           layout.index_item_bytes(ratio)), slots)
        for i, layer in enumerate(sources):
            rows[layer] = (kv[i], index[i])
    return join_blocks(layout.geometry, rows, layout.block_tokens)


def blocks_to_pages(layout: V4PageLayout, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """One SGLang V4.1 page per pool from its kvstore blocks (the inverse of `pages_to_blocks`).

    Args:
        layout: the page arrangement.
        blocks: uint8 `[blocks_per_page, block_bytes]` in position order.

    Returns:
        Pool name -> uint8 `[layers, item_bytes]` (padding zero), for
        `DeepSeekV4PagedHostPool.set_from_flat_data_page(i, page.flatten())`.
    """
    if blocks.dim() != 2 or blocks.shape[0] != layout.blocks_per_page:
        raise ConfigError(f"a {layout.page_tokens}-token page is {layout.blocks_per_page} blocks, "
                          f"got {tuple(blocks.shape)}")
    split = split_blocks(layout.geometry, blocks, layout.block_tokens)
    g = layout.geometry
    out: dict[str, torch.Tensor] = {}
    for ratio, (kv_name, index_name) in POOLS.items():
        sources = layout.sources(ratio)
        if not sources:
            continue
        slots = layout.slots(ratio)
        kv = torch.stack([split[s][0].reshape(slots, -1) for s in sources])        # [layers, slots, 288 or 584]
        index = torch.stack([split[s][1].reshape(slots, -1) for s in sources])     # [layers, slots, 68]
        kv_page = torch.zeros(len(sources), layout.kv_item_bytes(ratio), dtype=torch.uint8)
        data = g.row_split("compressed_kv")[0]
        if layout.interleaved:
            kv_page[:, :slots * g.compressed_kv_row_bytes] = kv.reshape(len(sources), -1)
        else:
            kv_page[:, :slots * data] = kv[..., :data].reshape(len(sources), -1)
            kv_page[:, slots * data:slots * g.compressed_kv_row_bytes] = kv[..., data:].reshape(len(sources), -1)
        per, idata = layout.index_page_slots, g.row_split("indexer")[0]
        grouped = index.reshape(len(sources), slots // per, per, -1)
        index_page = torch.cat([grouped[..., :idata].reshape(len(sources), slots // per, -1),
                                grouped[..., idata:].reshape(len(sources), slots // per, -1)], dim=-1)
        out[kv_name] = kv_page
        out[index_name] = index_page.reshape(len(sources), -1).contiguous()
    return out
