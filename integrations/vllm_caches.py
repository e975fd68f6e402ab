"""Where a store block's rows lie among vLLM's registered caches (the worker side's mapping).

vLLM-free. The mapping assumed (docs/ENGINES.md "vLLM: the cache layout"): a registered cache
whose name has `layers.<i>.` with `i` a kv source layer of the store's geometry holds that
layer's compressed-KV rows, or its indexer rows when the name contains "indexer"; it is
`[num_pages, page_bytes]`-shaped in bytes (any dtype, viewed as uint8; trailing padding allowed)
with `page_tokens // ratio` rows per page, each row the geometry's record layout's `[data][scales]`
bytes (kvstore.layout: the model's own rows, docs/CODEC.md, or vLLM's fp8_ds_mla records), the rows
one after the other, or block-split (every row's data, then every row's scales) where the layout's
row format says so (`page_map`). A cache with `window` or `swa` in its name holds that layer's
window rows, one per token. Other caches (non-source layers) are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from integrations.common import PageMap
from integrations.vllm_layers import layer_of
from kvstore.errors import ConfigError
from kvstore.geometry import ModelGeometry, Section


def page_map(geometry: ModelGeometry, component: str, page_tokens: int, ratio: int) -> PageMap:
    """Where rows of `component` ("compressed_kv", "indexer", "window") lie in vLLM's pages of `page_tokens`
    tokens: interleaved or block-split as the geometry's record layout keeps them (kvstore.layout)."""
    records = geometry.records
    fmt = {"compressed_kv": records.kv, "indexer": records.indexer, "window": records.window}[component]
    data, scales = geometry.row_split(component)
    # vLLM's indexer pages are block-split whatever the layout (indexer_k_store: a page's values, then its
    # scales, for the FP8 and the MXFP4 key alike), the model's rows included.
    split = fmt.block_split or component == "indexer"
    return PageMap(page_tokens=page_tokens, ratio=ratio, row_bytes=data + scales, data_bytes=data if split else 0)


@dataclass(frozen=True)
class CacheTarget:
    """One block section's destination: a registered cache, its page map, its group."""

    section: Section
    name: str
    cache: torch.Tensor
    pages: PageMap
    group: int


#: layer -> (its window cache, the cache's page map, its KV cache group).
Windows = Mapping[int, tuple[torch.Tensor, PageMap, int]]


@dataclass(frozen=True)
class CacheMap:
    """Where everything the worker side copies lies among vLLM's registered caches (`of`); empty
    until `register_kv_caches`.

    Attributes:
        targets: each store block section's destination (`map_caches`).
        windows: each layer's window cache (`map_windows`); None: no snapshots.
    """

    targets: tuple[CacheTarget, ...] = ()
    windows: Windows | None = None

    @classmethod
    def of(cls, geometry: ModelGeometry, block_tokens: int, caches: Mapping[str, torch.Tensor],
           groups: Mapping[str, tuple[int, int]]) -> CacheMap:
        """The map of vLLM's `caches` (`groups`: layer name -> (group index, tokens per page)).

        Raises:
            ConfigError: as `map_caches`.
        """
        return cls(targets=tuple(map_caches(geometry, block_tokens, caches, groups)),
                   windows=map_windows(geometry, caches, groups))

    @property
    def device(self) -> torch.device:
        """The caches' device (the CPU before registration)."""
        return self.targets[0].cache.device if self.targets else torch.device("cpu")


def map_caches(geometry: ModelGeometry, block_tokens: int, caches: Mapping[str, torch.Tensor],
               groups: Mapping[str, tuple[int, int]]) -> list[CacheTarget]:
    """The destination of every section of a store block among vLLM's registered caches.

    Args:
        groups: layer name -> (KV cache group index, tokens per page of that group).

    Raises:
        ConfigError: a section without a cache, or two caches for one section.
    """
    found: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for name, cache in caches.items():
        layer = layer_of(name)
        if layer is None or layer not in geometry.kv_source_layers:
            continue
        component = "indexer" if "indexer" in name else "compressed_kv"
        if "window" in name or "swa" in name:
            continue
        key = (layer, component)
        if key in found:
            raise ConfigError(f"two vLLM caches hold layer {key[0]}'s {component} rows: {found[key][0]!r} and "
                              f"{name!r} (docs/ENGINES.md: the cache layout)")
        found[key] = (name, cache)
    targets: list[CacheTarget] = []
    missing = []
    for s in geometry.block_layout(block_tokens):
        hit = found.get((s.layer, s.component))
        if hit is None:
            missing.append(f"layer {s.layer} {s.component}")
            continue
        name, cache = hit
        if name not in groups:
            raise ConfigError(f"vLLM cache {name!r} is in no KV cache group of the kv_cache_config")
        group, page_tokens = groups[name]
        ratio = geometry.compress_ratios[s.layer]
        if page_tokens % ratio:
            raise ConfigError(f"vLLM pages of {page_tokens} tokens do not hold whole rows of layer {s.layer} "
                              f"(one per {ratio} tokens)")
        pages = page_map(geometry, s.component, page_tokens, ratio)
        pages.view(cache)  # checks the page holds its rows
        targets.append(CacheTarget(section=s, name=name, cache=cache, pages=pages, group=group))
    if missing:
        raise ConfigError(f"no vLLM cache for {', '.join(missing)} of geometry {geometry.name!r} among "
                          f"{sorted(caches)} (names need 'layers.<i>.', indexer caches 'indexer')")
    return targets


def has_windows(num_layers: int, names: Iterable[str]) -> bool:
    """Whether `names` (vLLM's cache layer names) hold a window cache for every layer (see `map_windows`)."""
    layers = set()
    for name in names:
        layer = layer_of(name)
        if layer is not None and ("window" in name or "swa" in name):
            layers.add(layer)
    return layers == set(range(num_layers))


def map_windows(geometry: ModelGeometry, caches: Mapping[str, torch.Tensor],
                groups: Mapping[str, tuple[int, int]]) -> dict[int, tuple[torch.Tensor, PageMap, int]] | None:
    """Every layer's window (SWA) cache: name with `layers.<i>.` and `window` or `swa`, one row of
    `window_row_bytes` per token in position order. None unless every layer has one (no snapshots then)."""
    found: dict[int, tuple[torch.Tensor, PageMap, int]] = {}
    for name, cache in caches.items():
        layer = layer_of(name)
        if layer is None or not ("window" in name or "swa" in name) or name not in groups:
            continue
        group, page_tokens = groups[name]
        pages = page_map(geometry, "window", page_tokens, 1)
        pages.view(cache)
        found[layer] = (cache, pages, group)
    return found if sorted(found) == list(range(geometry.num_layers)) else None
