"""kvstore as a vLLM v1 KV connector (vLLM 0.33.0): `KVConnectorBase_V1` + `SupportsHMA`.

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "integrations.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"target": "127.0.0.1:50051"}}'

Extra config (`integrations.common.parse_settings`; a mistake is a `kvstore.errors.ConfigError`
naming it): `target` (required), `token` (default `$KVSTORE_TOKEN`), `namespace`, `geometry`,
`timeout_s`, `path` ("auto", "shm", "grpc", "direct-cpu", "direct-gpu"), `data_dir` (the store's
data dir on this host: enables the direct paths), `lease_ms`, `replay_windows` (1, 2, ... or
"exact") or `replay_fidelity` (any fidelity setting, e.g. "kl:1e-3"): this engine's own; neither: the
tenant's stored policy `replay_fidelity`, read at attach and every `fidelity_refresh_s` (default 60),
`load_async` (default: true with several KV cache groups), `layerwise` (default false:
fill loads layer by layer while the forward runs and copy saves out per layer; needs a model whose
attention calls vLLM's per-layer hooks, and makes vLLM use piecewise CUDA graphs).

Scheduler side (`integrations.vllm_scheduler`): one leased planner Lookup per request; only usable
tokens are reported. Worker side (`integrations.vllm_worker`): loads (`integrations.vllm_loads`)
fill vLLM's paged caches before the forward; new full blocks are copied out after it and put on a
background thread (`integrations.vllm_saves`); requests with saves are held until their puts are
done. With `layerwise`, `start_load_kv` returns at once and `wait_for_layer_load` waits for one
layer (`integrations.vllm_layers`); `save_kv_layer` copies each layer's rows out as the forward
writes them. docs/ENGINES.md has the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from integrations.common import COMMON_KEYS, connect_layout, parse_settings
from integrations.vllm_caches import has_windows
from integrations.vllm_records import records_of
from integrations.vllm_scheduler import ConnectorMeta, SchedulerSide
from integrations.vllm_worker import WorkerSide
from kvstore import geometry as geometries
from kvstore.errors import ConfigError
from replay.cost import CostModel
from replay.fidelity_budget import DEFAULT_BUDGET
from replay.planner import Planner, stored_fidelity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
#: Settings this connector reads beyond the common ones.
KNOWN = COMMON_KEYS | {"load_async", "layerwise"}


class KVStoreMetadata(KVConnectorMetadata, ConnectorMeta):
    """One step's loads and saves, scheduler -> worker."""


@dataclass
class KVStoreWorkerMeta(KVConnectorWorkerMetadata):
    """One step's pins granted to the worker's Puts (req id -> (time granted, 0: none; why less)),
    worker -> scheduler (`SchedulerSide.granted`); the workers' are merged, the earliest time kept."""

    kept: dict[str, tuple[float, str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another worker's grants: a request pinned by two workers holds until the earlier time."""
        assert isinstance(other, KVStoreWorkerMeta)
        kept = dict(self.kept)
        for req_id, got in other.kept.items():
            kept[req_id] = min(kept.get(req_id, got), got)
        return KVStoreWorkerMeta(kept=kept)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """kvstore behind vLLM's KV connector interface (both roles; see the module docstring).

    Raises (at construction):
        ConfigError: bad extra config, or vLLM's pages not a multiple of the store's rows.
        KVStoreError: the store cannot be reached (Unavailable, Unauthenticated, ...).
    """

    #: vLLM's hit metrics: kvstore's blocks live on NVMe (LMDB).
    _cache_hit_source = CacheHitSource.DISK

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """With `layerwise` the per-layer hooks wait and copy: they must run, so not inside a full CUDA graph."""
        return extra_config.get("layerwise", False) is True

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache. Saves copy the rows out in the step that computes them, so a
        preemption loses nothing in flight, and a dropped save is only a future miss."""
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = parse_settings(extra, known=KNOWN)
        load_async = extra.get("load_async", len(kv_cache_config.kv_cache_groups) > 1)
        if not isinstance(load_async, bool):
            raise ConfigError(f"kv_connector_extra_config 'load_async' must be true or false, got {load_async!r}")
        layerwise = extra.get("layerwise", False)
        if not isinstance(layerwise, bool):
            raise ConfigError(f"kv_connector_extra_config 'layerwise' must be true or false, got {layerwise!r}")
        if not load_async and len(kv_cache_config.kv_cache_groups) > 1:
            raise ConfigError("kv_connector_extra_config 'load_async' = false with several KV cache groups: vLLM "
                              "cannot take block-level load errors there; leave it unset (asynchronous)")
        # The layout of vLLM's records (kvstore.layout), from its own settings: the blocks' keys are scoped by it.
        self.records = records_of(vllm_config)
        self.engine_block = vllm_config.cache_config.block_size
        self.client = connect_layout(self.settings, self.records, f"vLLM ({role.name.lower()})")
        self.geometry = geometries.resolve(self.client.geometry)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            cost = CostModel(replay_windows=self.settings.replay_windows)
            names = [n for group in kv_cache_config.kv_cache_groups for n in group.layer_names]
            snapshots = has_windows(self.geometry.num_layers, names)
            # Without a window cache for every layer a snapshot cannot be loaded: no probes, so a
            # plan is a replay or a full prefill, never a resume that needs the window.
            # The fidelity: the engine's own setting, else the tenant's stored policy (read now and again
            # every fidelity_refresh_s; the default budget from a server that keeps no policies).
            own = self.settings.fidelity
            planner = Planner(self.client, cost=cost, lease_ms=self.settings.lease_ms,
                              snapshot_probes=4 if snapshots else 0, reprobe=snapshots,
                              fidelity=own or DEFAULT_BUDGET,
                              fidelity_source=None if own else partial(stored_fidelity, self.client),
                              fidelity_refresh_s=self.settings.fidelity_refresh_s)
            log.info("kvstore: replay fidelity %s", planner.span_choice.reason if planner.span_choice else "-")
            config = self._kv_transfer_config
            self.scheduler = SchedulerSide(planner, block_tokens=self.client.block_tokens,
                                           engine_block=self.engine_block, load=config.is_kv_consumer,
                                           save=config.is_kv_producer, asynchronous=load_async,
                                           snapshots=snapshots)
        else:
            reader = None
            if self.settings.data_dir is not None:
                from kvstore.client.colocated import ColocatedReader
                reader = ColocatedReader(self.settings.data_dir)
            self.worker = WorkerSide(self.client, self.settings, self.geometry, reader=reader, layerwise=layerwise)

    # -- worker side --------------------------------------------------------------

    def _worker(self) -> WorkerSide:
        if self.worker is None:
            raise ConfigError("a worker-side method was called on the scheduler-side kvstore connector")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map every store block section onto one of vLLM's caches (ConfigError when one is missing)."""
        groups = {name: (g, group.kv_cache_spec.block_size)
                  for g, group in enumerate(self._kv_cache_config.kv_cache_groups) for name in group.layer_names}
        self._worker().register(kv_caches, groups)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads: filled layer by layer on the loader thread; without `layerwise`,
        every layer is in the pages when this returns."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata)
        self._worker().loads.start(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's loads filled every layer up to `layer_name`'s (nothing left to wait
        for without `layerwise`)."""
        self._worker().loads.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """With `layerwise`: copy the rows this layer just wrote of the step's saves out of the pages
        (the registered caches of the layer: its compressed KV, indexer and window rows). Otherwise
        nothing: `wait_for_save` copies every layer out at once."""
        worker = self._worker()
        if not worker.loads.layerwise or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata)
        worker.saves.save_layer(meta.saves, layer_name)

    def wait_for_save(self) -> None:
        """End of the forward: the step's loads are collected (what failed is reported to vLLM); the
        completed blocks are taken from the per-layer copies or copied out now, and their puts queued."""
        worker = self._worker()
        worker.loads.finish()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata)
        worker.saves.save_step(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Ended requests whose puts are done (their pages may go), and finished asynchronous loads."""
        return self._worker().finished(finished_req_ids)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The pins this worker's Puts were granted since the last step (a hinted request's, R22)."""
        kept = self._worker().saves.take_granted()
        return KVStoreWorkerMeta(kept=kept) if kept else None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished` plus the asynchronous loads that failed (vLLM recomputes those requests)."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=self._worker().loads.take_failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose synchronous load failed: vLLM recomputes from the first of them."""
        return self._worker().loads.take_errors()

    def shutdown(self) -> None:
        """Wait for puts in flight; close the store's client and the planner."""
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.planner.close()
            self.client.close()

    # -- scheduler side -------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        if self.scheduler is None:
            raise ConfigError("a scheduler-side method was called on the worker-side kvstore connector")
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Usable stored tokens beyond vLLM's local hit (one leased Lookup per request)."""
        return self._scheduler().matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Queue the load of the reported tokens into the pages just allocated."""
        self._scheduler().allocated(request, blocks.get_block_ids(), num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Requests whose asynchronous load failed get no second load: vLLM recomputes them. Requests
        whose puts are done get the pin their retention hint asked (`kv_transfer_params`)."""
        self._scheduler().load_failed(connector_output.failed_recving)
        self._scheduler().sent(connector_output.finished_sending)
        worker_meta = connector_output.kv_connector_worker_meta
        if isinstance(worker_meta, KVStoreWorkerMeta):
            self._scheduler().granted(worker_meta.kept)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and the saves of the blocks it completes."""
        meta = self._scheduler().build(scheduler_output)
        return KVStoreMetadata(loads=meta.loads, saves=meta.saves)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """True (hold the pages) while the request's saves are in flight."""
        return self._scheduler().finished(request), None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` for hybrid layouts (every KV cache group's pages held alike)."""
        return self._scheduler().finished(request), None
