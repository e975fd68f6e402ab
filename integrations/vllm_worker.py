"""The worker side of the vLLM connector: store blocks <-> vLLM's paged caches.

vLLM-free. It is handed the registered cache tensors, the page size of each tensor's KV cache
group, and the scheduler side's `LoadSpec`/`SaveSpec`s, and answers vLLM's worker hooks from two
halves that share the map of the caches: the loads (`integrations.vllm_loads`: fetch, then the
pages layer by layer on one loader thread) and the saves (`integrations.vllm_saves`: rows copied
out in the step that computes them, put on one save thread). Where each block section and window
row lies: `integrations.vllm_caches`; the layer-by-layer pieces: `integrations.vllm_layers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from integrations.common import StoreSettings
from integrations.vllm_caches import CacheMap
from integrations.vllm_loads import Loader
from integrations.vllm_saves import Saver
from kvstore.client import Client
from kvstore.geometry import ModelGeometry


class WorkerSide:
    """The worker-side connector: its loads and its saves, and what concerns both (the caches' map,
    a request's end, closing).

    Args:
        client: the store's client (closed by `close`).
        settings: the adapter's settings (load path).
        geometry: the store's geometry; `block_tokens` its block size.
        reader: a `ColocatedReader` for the direct paths, or None.
        layerwise: fill loads layer by layer while the forward runs (it must call
            `loads.wait_layer` for every layer) and copy saves out per layer (`saves.save_layer`);
            off: all at once.

    Attributes:
        loads: `start_load_kv`, `wait_for_layer_load`, the load errors (and the load counters).
        saves: `save_kv_layer`, `wait_for_save` (and the save counters).
    """

    def __init__(self, client: Client, settings: StoreSettings, geometry: ModelGeometry, *,
                 reader: Any = None, layerwise: bool = False) -> None:
        self.client, self.geometry, self.reader = client, geometry, reader
        self.loads = Loader(client, settings, geometry, reader=reader, layerwise=layerwise)
        self.saves = Saver(client, geometry)

    def register(self, caches: Mapping[str, torch.Tensor], groups: Mapping[str, tuple[int, int]]) -> None:
        """`register_kv_caches`: find where each block section and window row lies, for both halves.

        Raises:
            ConfigError: a section without a cache, two caches for one, or pages that do not hold
                whole rows (`integrations.vllm_caches`).
        """
        self.loads.caches = self.saves.caches = CacheMap.of(self.geometry, self.client.block_tokens, caches, groups)

    def finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str] | None, set[str] | None]:
        """`get_finished`: requests whose saves are all done (of those vLLM ended), and loads done."""
        self.loads.finish()
        done = self.saves.finished(finished_req_ids)
        recved = self.loads.take_recved()
        return done or None, recved or None

    def close(self) -> None:
        """Wait for the loads and puts in flight, then close the client."""
        self.loads.close()
        self.saves.close()
        self.client.close()
