"""Which of SGLang's DeepSeek-V4 HiCache host pools the kvstore backend serves, each checked at registration.

SGLang 0.5.23 serves DeepSeek-V4/V4.1 (`build_deepseek_v4_hicache_stack`) with a row-less
anchor (`LogicalHostPool`, 256-token pages) and the model's rows in side pools. For
V4.1-Flash (compression ratios 0, 1 and 2) the backend serves:

- `deepseek_v4_c2`, `deepseek_v4_c2_indexer`, `deepseek_v4_c1`, `deepseek_v4_c1_indexer`:
  joined, page by page, into `page_tokens / block_tokens` kvstore blocks (sglang_v4);
- `swa`: the window rows of the page that ends a prefix, as a kvstore SWA snapshot
  (sglang_swa.v4_page_to_window).

and refuses, with a ConfigError saying why, every other V4 pool (`V4_REFUSED`).

The in-page arrangement is not in the host pools (a block-split and an interleaved page
have the same size), so it comes from SGLang's own settings, as its pools were built:
`SGLANG_DSV4_KV_LAYOUT=v41_new` interleaves, `v41` (or `auto` on SM100) splits, and the
indexer's slots per page are `DSV41_INDEX_PAGE_SIZE` (64; 128 with DeepGEMM's paged logits).

The record layout comes from the same settings (`records`, as SGLang's `select_dsv4_kv_layout`
picks it): `v41` / `v41_new` keep the model's rows; SGLang's default `v4` (and `auto` off SM100)
keeps 584-B V4 rows, stored as they are under the `sglang-v4` layout (kvstore.layout).
"""

from __future__ import annotations

import sys
from typing import Any

from integrations.sglang_swa import v4_swa_item_bytes
from integrations.sglang_v4 import POOLS, V4PageLayout
from kvstore import layout as layouts
from kvstore.errors import ConfigError
from kvstore.geometry import ModelGeometry
from kvstore.layout import RecordLayout

#: The V4 side pools whose pages are kvstore blocks.
SERVED = frozenset(name for pair in POOLS.values() for name in pair)
#: The SWA window pool's name (SGLang's PoolName.SWA).
SWA = "swa"

#: V4 pools the backend does not serve, by name (or name suffix), and why.
V4_REFUSED = {
    "_indexer_scale": "SGLang splits the FP4 indexer into payload and scale pools only on AMD (aiter's "
                      "row-group layout), whose bytes differ from kvstore's indexer rows",
    "_state": "compressor state pools belong to the ratio-4/128 layers of DeepSeek-V4 (not V4.1): state "
              "kvstore does not keep",
    "_rope": "the bf16 rope half of SGLang's unified fp8 KV is not a V4.1 row",
    "deepseek_v4_c4": "ratio-4 compressed KV belongs to DeepSeek-V4 (not V4.1), which kvstore's geometry has not",
    "deepseek_v4_c128": "ratio-128 compressed KV belongs to DeepSeek-V4 (not V4.1), which kvstore's geometry has not",
    "draft": "MTP/DSpark draft pools: engines start the draft's state empty after a restore (docs/ENGINES.md)",
}

#: What SGLang's V4 stack is served with: its layout's rows, each pool at its size.
V41_HINT = ("kvstore serves SGLang's DeepSeek-V4 pools with SGLANG_DSV4_KV_LAYOUT=v4 (SGLang's default: 584-B rows) "
            "or v41 / v41_new on SM100/SM103 (the model's rows), with the compressed caches of that layout "
            "(SGLANG_DSV4_COMPRESSED_KV_LAYOUT auto; fp4 with v41)")


def _sm100() -> bool:
    """SGLang's test for the V4.1 layouts (`select_dsv4_kv_layout`): a CUDA GPU of capability major 10."""
    import torch

    return bool(torch.cuda.is_available() and torch.version.cuda is not None
                and torch.cuda.get_device_capability()[0] == 10)


def records() -> RecordLayout:
    """The record layout of SGLang's DeepSeek-V4 pools, read from its settings as `select_dsv4_kv_layout` does.

    Raises:
        ConfigError: a layout kvstore does not serve (TRT-LLM's uniform FP8 pools, an fp8 compressed cache
            beside V4.1 rows is refused later by the pool sizes), naming the setting.
    """
    from sglang.srt.environ import envs

    mode = envs.SGLANG_DSV4_KV_LAYOUT.get().lower()
    try:
        from sglang.srt.runtime_context import get_exec
        backend = str(get_exec().kernel.dsv4_attn_backend)
    except Exception:  # no server context (SGLang not started, as in a test): no backend forces a layout
        backend = ""
    if backend == "trtllm":
        raise ConfigError("SGLang's dsv4_attn_backend trtllm keeps uniform FP8 pools (512 E4M3, an external scale), "
                          f"which kvstore does not serve: {V41_HINT}")
    if backend == "flashmla_mega" and mode != "v41_new":
        mode = "v41"
    if mode == "v4" or (mode == "auto" and not _sm100()):
        return layouts.SGLANG_V4
    return layouts.MODEL_NATIVE


def is_v4_anchor(pool: Any) -> bool:
    """Whether `pool` is SGLang's DeepSeek-V4 anchor: a row-less `LogicalHostPool`, bare or a group's anchor."""
    anchor = getattr(getattr(pool, "anchor_entry", None), "host_pool", pool)
    return type(anchor).__name__ == "LogicalHostPool"


def refusal(name: str) -> str | None:
    """Why the V4 pool `name` is not served, or None when it is (or is no V4 pool)."""
    if name in SERVED or name == SWA or name == "kv":
        return None
    for part, why in V4_REFUSED.items():
        if name.endswith(part) or name.startswith(part):
            return why
    return "no kvstore counterpart" if name.startswith("deepseek_v4_") else None


def layout(geometry: ModelGeometry, page_tokens: int, block_tokens: int) -> V4PageLayout:
    """The page arrangement SGLang's V4 pools were built with (module doc), for `page_tokens`-token pages.

    Raises:
        ConfigError: a page that is not whole kvstore blocks or whole indexer pages.
    """
    from sglang.srt.environ import envs

    interleaved = envs.SGLANG_DSV4_KV_LAYOUT.get().lower() == "v41_new"
    pool_module = sys.modules.get("sglang.srt.mem_cache.deepseek_v4_memory_pool")
    index_slots = int(getattr(pool_module, "DSV41_INDEX_PAGE_SIZE", 64))
    return V4PageLayout(geometry, page_tokens=page_tokens, block_tokens=block_tokens, interleaved=interleaved,
                        index_page_slots=index_slots)


def check_side_pool(page: V4PageLayout, pool: Any, name: str) -> None:
    """Refuse a served side pool whose pages are not this layout's (its layers, page size and item bytes).

    Raises:
        ConfigError: naming the pool, what it holds and what kvstore's rows need.
    """
    ratio = next(r for r, pair in POOLS.items() if name in pair)
    layers = len(page.sources(ratio))
    item = page.kv_item_bytes(ratio) if name == POOLS[ratio][0] else page.index_item_bytes(ratio)
    got = tuple(int(getattr(pool, a, -1)) for a in ("page_size", "layer_num", "item_bytes"))
    if got != (page.page_tokens, layers, item):
        raise ConfigError(f"SGLang's {name!r} host pool has {got[0]}-token pages of {got[1]} layers x {got[2]} B; "
                          f"kvstore's {page.geometry.name} rows need {page.page_tokens}-token pages of {layers} "
                          f"layers x {item} B. {V41_HINT}")


def check_swa_pool(geometry: ModelGeometry, page_tokens: int, pool: Any, *, interleaved: bool = False) -> None:
    """Refuse a V4 SWA pool that is not the model's window rows: every target layer, V41 rows, no draft layers.

    Raises:
        ConfigError: naming what the pool holds and what kvstore's SWA snapshots need.
    """
    layers = int(getattr(pool, "layer_num", -1))
    item = int(getattr(pool, "item_bytes", -1))
    want = v4_swa_item_bytes(geometry, page_tokens, interleaved)
    if int(getattr(pool, "page_size", 0)) != page_tokens:
        raise ConfigError(f"SGLang's V4 SWA host pool has {pool.page_size}-token pages; the kvstore backend "
                          f"needs the KV page size, {page_tokens}")
    if layers > geometry.num_layers:
        raise ConfigError(f"SGLang's V4 SWA host pool holds {layers} layers, {layers - geometry.num_layers} of them "
                          f"MTP/DSpark draft layers; kvstore's SWA snapshots hold the model's {geometry.num_layers}: "
                          "run without speculative decoding to use the kvstore backend's SWA window")
    if layers != geometry.num_layers or item != want:
        raise ConfigError(f"SGLang's V4 SWA host pool has {layers} layers x {item} B per page; kvstore's "
                          f"{geometry.name} window rows need {geometry.num_layers} layers x {page_tokens} x "
                          f"{geometry.window_row_bytes} B, {want} B with page padding. {V41_HINT}")
    if geometry.window > page_tokens:
        raise ConfigError(f"the SWA window ({geometry.window} tokens) is longer than SGLang's {page_tokens}-token "
                          "page: the page ending a prefix does not hold its whole window")


def check_complete(page: V4PageLayout, registered: dict[str, Any]) -> None:
    """Refuse a V4 stack without every side pool the geometry's blocks need (a page could not be joined).

    Raises:
        ConfigError: naming the missing pools.
    """
    need = sorted(n for r, pair in POOLS.items() if page.sources(r) for n in pair)
    missing = [n for n in need if n not in registered]
    if missing:
        raise ConfigError(f"SGLang's DeepSeek-V4 HiCache registered no {missing} host pool(s); a kvstore block of "
                          f"{page.geometry.name} joins {need}. {V41_HINT}")
