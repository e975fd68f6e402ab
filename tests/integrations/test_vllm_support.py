"""What the vLLM connector's tests share: the skip, and an engine harness around vLLM's REAL v1 Scheduler.

Skips only when vLLM cannot be imported (the reason printed, with scripts/install_engines.sh's
note from VENV/engine-skip-vllm.txt when it could not install it).

The harness (`Engine`) builds a real `VllmConfig` on CPU from a tiny config.json it writes
(`DeviceConfig("cpu")`, `skip_tokenizer_init=True`, `cache_config.num_gpu_blocks` set), a
`KVCacheConfig` for the tiny fixture geometry's caches, and vLLM's real `Scheduler`, which
creates the scheduler-side connector through vLLM's connector factory from
`kv_connector_module_path`. It stands in for the model runner only: each step it hands the
worker-side connector (made by the same factory) the step's metadata, calls `start_load_kv`,
"runs the model" by writing each computed row's bytes (`model_row`: a function of the tokens up
to the row's last position, as a real model's rows are) into CPU page tensors, calls
`wait_for_save` and `get_transfer_results`, and feeds vLLM's `update_from_output` the sampled
tokens, the finished transfers and the load errors, as vLLM's GPU model runner does.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.conftest import STORE_BLOCK_TOKENS, engine_skip_reason

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
except ImportError as exc:
    _reason = engine_skip_reason("vllm", exc)
    print(f"SKIP tests/integrations/test_vllm_*.py: {_reason}", file=sys.stderr)
    pytest.skip(_reason, allow_module_level=True)

import kvstore
from kvstore.geometry import TINY as GEO
from kvstore.geometry import ModelGeometry

#: vLLM's tokens per page in these tests.
PAGE = 16
#: Pages in vLLM's pool.
NUM_PAGES = 96
#: Bytes of padding after each page's rows (vLLM aligns page strides): the connector must skip them.
PAD = 8
GLOBAL = [(s.layer, s.component, s.row_bytes) for s in GEO.block_layout(STORE_BLOCK_TOKENS)]

__all__ = ["GEO", "GLOBAL", "PAGE", "STORE_BLOCK_TOKENS", "Engine", "cache_name", "expected_block", "extra",
           "model_row", "prompt", "stored", "window_row"]


def sections(geo: ModelGeometry) -> list[tuple[int, str, int]]:
    """(layer, component, row bytes) of every section of a store block of `geo` (GLOBAL for the model's rows)."""
    return [(s.layer, s.component, s.row_bytes) for s in geo.block_layout(STORE_BLOCK_TOKENS)]


def split_at(geo: ModelGeometry, component: str) -> int:
    """Where vLLM splits a row of `component` in its pages: its data bytes when its pages are block-split (every
    slot's data, then every slot's scales: vLLM's fp8_ds_mla V4 record and its indexer kernels), else 0."""
    fmt = {"compressed_kv": geo.records.kv, "indexer": geo.records.indexer, "window": geo.records.window}[component]
    # vLLM's indexer_k_store writes a page's values, then its scales, for every indexer dtype.
    return geo.row_split(component)[0] if fmt.block_split or component == "indexer" else 0


def put_row(page: torch.Tensor, slot: int, rows_per_page: int, row: bytes, data: int) -> None:
    """Write `row` into slot `slot` of one page (uint8, its bytes), as vLLM's insert kernels lay it out."""
    value = torch.frombuffer(bytearray(row), dtype=torch.uint8)
    if not data:
        page[slot * len(row): (slot + 1) * len(row)] = value
        return
    scales = len(row) - data
    page[slot * data: (slot + 1) * data] = value[:data]
    base = rows_per_page * data
    page[base + slot * scales: base + (slot + 1) * scales] = value[data:]


def get_row(page: torch.Tensor, slot: int, rows_per_page: int, row_bytes: int, data: int) -> bytes:
    """The row in slot `slot` of one page (the inverse of `put_row`)."""
    if not data:
        return bytes(page[slot * row_bytes: (slot + 1) * row_bytes].tolist())
    scales, base = row_bytes - data, rows_per_page * data
    return bytes(page[slot * data: (slot + 1) * data].tolist() + page[base + slot * scales:
                                                                         base + (slot + 1) * scales].tolist())


def cache_name(layer: int, component: str) -> str:
    """The registered cache name of a source layer's rows (the names the connector maps, docs/ENGINES.md)."""
    return f"model.layers.{layer}.self_attn." + ("indexer.k_cache" if component == "indexer" else "kv_cache")


def model_row(tokens: Sequence[int], layer: int, component: str, row: int, row_bytes: int) -> bytes:
    """The bytes the stand-in model writes for row `row`: a function of the tokens up to its last position."""
    ratio = GEO.compress_ratios[layer]
    seed = hashlib.sha256(repr((list(tokens[: (row + 1) * ratio]), layer, component)).encode()).digest()
    return (seed * (row_bytes // len(seed) + 1))[:row_bytes]


def window_row(tokens: Sequence[int], layer: int, position: int, geo: ModelGeometry = GEO) -> bytes:
    """The stand-in model's window (SWA) row of `layer` at `position`: a function of the tokens up to it."""
    seed = hashlib.sha256(repr((list(tokens[: position + 1]), layer, "window")).encode()).digest()
    return (seed * (geo.window_row_bytes // len(seed) + 1))[: geo.window_row_bytes]


def prompt(n: int, seed: int = 0) -> list[int]:
    """n token ids below the tiny vocabulary (128)."""
    return [(i * 7 + seed * 13 + 1) % 127 + 1 for i in range(n)]


def write_model(path: Path) -> Path:
    """The tiny config.json vLLM's ModelConfig reads (no weights: the scheduler never loads a model)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": GEO.num_layers, "vocab_size": 128, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32"}))
    return path


class Engine:
    """vLLM's real Scheduler with the kvstore connector on both sides, stepping on CPU.

    Args:
        model_dir: where the tiny config.json goes.
        extra: kv_connector_extra_config (worker_extra: the worker side's, default the same).
        hybrid: a second KV cache group of sliding-window caches (every layer's window), so vLLM's
            hybrid allocator runs and the connector must be SupportsHMA.
        failure_policy: vLLM's `kv_load_failure_policy` ("recompute" or vLLM's default "fail").
        hooks: run the stand-in model layer by layer and call the per-layer hooks as vLLM's attention
            layers do (`wait_for_layer_load` before a layer, `save_kv_layer` after it, with the layer's
            name `model.layers.<i>.self_attn.attn`); off: the whole forward at once, no per-layer calls.
        scribble: with `hooks`, overwrite a layer's caches right after its `save_kv_layer` and put them
            back after `wait_for_save`: a save that did not copy the layer out at once stores garbage.
        cache_dtype: vLLM's `--kv-cache-dtype`; `geo`: the geometry whose records vLLM's caches then hold (the
            tiny model's own rows, or it in an engine layout, kvstore.layout), laid out as vLLM's kernels do.
    """

    def __init__(self, model_dir: Path, extra: dict[str, Any], *, worker_extra: dict[str, Any] | None = None,
                 hybrid: bool = False, role: str = "kv_both", failure_policy: str = "recompute",
                 cache_dtype: str = "auto", hooks: bool = False, scribble: bool = False,
                 geo: ModelGeometry = GEO) -> None:
        self.geo, self.sections = geo, sections(geo)
        model = ModelConfig(model=str(write_model(model_dir)), tokenizer=str(model_dir), skip_tokenizer_init=True,
                            max_model_len=2048, dtype="float32")
        cache = CacheConfig(block_size=PAGE, enable_prefix_caching=True, cache_dtype=cache_dtype)
        cache.num_gpu_blocks = NUM_PAGES
        transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_role=role,
                                    kv_connector_module_path="integrations.vllm_connector",
                                    kv_connector_extra_config=extra, kv_load_failure_policy=failure_policy)
        self.config = VllmConfig(model_config=model, cache_config=cache, device_config=DeviceConfig(device="cpu"),
                                 scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8,
                                                                  max_model_len=2048, is_encoder_decoder=False),
                                 kv_transfer_config=transfer)
        groups = [KVCacheGroupSpec([cache_name(layer, comp) for layer, comp, _ in self.sections],
                                   FullAttentionSpec(block_size=PAGE, num_kv_heads=1, head_size=72, dtype=torch.uint8))]
        if hybrid:
            window = [f"model.layers.{i}.self_attn.swa_cache" for i in range(GEO.num_layers)]
            groups.append(KVCacheGroupSpec(window, SlidingWindowSpec(block_size=PAGE, num_kv_heads=1, head_size=132,
                                                                     dtype=torch.uint8, sliding_window=GEO.window)))
        self.kv_cache_config = KVCacheConfig(num_blocks=NUM_PAGES, kv_cache_tensors=[], kv_cache_groups=groups)
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=self.kv_cache_config,
                                   structured_output_manager=StructuredOutputManager(self.config), block_size=PAGE)
        worker_config = self.config
        if worker_extra is not None:
            worker_config = self.config.__class__(**{**{f: getattr(self.config, f) for f in (
                "model_config", "cache_config", "device_config", "scheduler_config")},
                "kv_transfer_config": KVTransferConfig(kv_connector="KVStoreConnector", kv_role=role,
                                                       kv_connector_module_path="integrations.vllm_connector",
                                                       kv_connector_extra_config=worker_extra)})
        self.worker = KVConnectorFactory.create_connector(worker_config, KVConnectorRole.WORKER, self.kv_cache_config)
        # As vLLM lays a group out: one physical block per page index holding every layer's page of the
        # group side by side (block stride = the sum of their pages), each layer's cache a strided view.
        widths = {cache_name(layer, comp): PAGE // GEO.compress_ratios[layer] * rb + PAD
                  for layer, comp, rb in self.sections}
        if hybrid:
            widths.update({f"model.layers.{i}.self_attn.swa_cache": PAGE * geo.window_row_bytes + PAD
                           for i in range(GEO.num_layers)})
        physical = torch.zeros(NUM_PAGES, sum(widths.values()), dtype=torch.uint8)
        self.caches, offset = {}, 0
        for name, width in widths.items():
            self.caches[name] = physical[:, offset: offset + width]
            offset += width
        self.hybrid, self.hooks, self.scribble = hybrid, hooks, scribble
        #: With `hooks`: called with each layer after its `wait_for_layer_load`, before its rows are written.
        self.before_layer: Any = None
        self.worker.register_kv_caches(self.caches)
        self.tokens: dict[str, list[int]] = {}
        self.pages: dict[str, list[list[int]]] = {}
        #: Per step: {req_id: (first position computed, positions computed)}.
        self.computed: list[dict[str, tuple[int, int]]] = []
        self.finished: list[str] = []
        #: Finish reason of each finished request (vLLM's FinishReason name).
        self.reasons: dict[str, str] = {}

    @property
    def connector(self) -> Any:
        """The scheduler-side connector vLLM's scheduler made."""
        return self.scheduler.connector

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1, cache_salt: str | None = None) -> Request:
        """Queue a request (greedy, `max_tokens` output tokens)."""
        request = Request(req_id, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0), None,
                          cache_salt=cache_salt)
        self.tokens[req_id] = list(tokens)
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        """One engine step: schedule, load, run the stand-in model, save, report back. Returns the SchedulerOutput."""
        so = self.scheduler.schedule()
        self.worker.bind_connector_metadata(so.kv_connector_metadata)
        self.worker.start_load_kv(None)
        ran: dict[str, tuple[int, int]] = {}
        for new in so.scheduled_new_reqs:
            self.pages[new.req_id] = [list(g) for g in new.block_ids]
            ran[new.req_id] = (new.num_computed_tokens, so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.pages[req_id] = [list(g) for g in ids or ()]
            elif ids is not None:
                for group, more in zip(self.pages[req_id], ids, strict=False):
                    group.extend(more)
            ran[req_id] = (cached.num_computed_tokens[i], so.num_scheduled_tokens[req_id])
        scribbled: dict[str, torch.Tensor] = {}
        for layers in ([[layer] for layer in range(GEO.num_layers)] if self.hooks else [None]):
            name = None if layers is None else f"model.layers.{layers[0]}.self_attn.attn"
            if name is not None:
                self.worker.wait_for_layer_load(name)
                if self.before_layer is not None:
                    self.before_layer(layers[0])
            for req_id, (start, count) in ran.items():
                self._forward(req_id, start, start + count, layers)
            if name is not None and layers is not None:
                mine = [n for n in self.caches if f".layers.{layers[0]}." in n]
                self.worker.save_kv_layer(name, self.caches[mine[0]] if mine else torch.empty(0), None)
                for n in mine if self.scribble else ():
                    scribbled[n] = self.caches[n].clone()
                    self.caches[n].fill_(0xEE)
        self.worker.wait_for_save()
        for n, saved in scribbled.items():
            self.caches[n].copy_(saved)
        results = self.worker.get_transfer_results(so.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        req_ids = list(ran)
        sampled = []
        for req_id in req_ids:
            start, count = ran[req_id]
            done = start + count >= self.scheduler.requests[req_id].num_tokens
            sampled.append([sum(self.tokens[req_id]) % 120 + 1] if done else [])
        output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled,
                                   kv_connector_output=KVConnectorOutput(
                                       finished_sending=results.finished_sending or None,
                                       finished_recving=results.finished_recving or None,
                                       failed_recving=results.failed_recving, invalid_block_ids=errors,
                                       kv_connector_worker_meta=self.worker.build_connector_worker_meta()))
        outputs = self.scheduler.update_from_output(so, output)
        for req_id in req_ids:  # the tokens vLLM kept (it drops a step's sample when it recomputes)
            if req_id in self.scheduler.requests:
                self.tokens[req_id] = list(self.scheduler.requests[req_id].all_token_ids)
        for engine_outputs in outputs.values():
            for o in engine_outputs.outputs:
                if o.finished:
                    self.finished.append(o.request_id)
                    self.reasons[o.request_id] = str(o.finish_reason)
        self.computed.append(ran)
        return so

    def _forward(self, req_id: str, start: int, end: int, layers: list[int] | None = None) -> None:
        """Write the rows of positions [start, end) of `layers` (all: None)."""
        tokens = self.tokens[req_id]
        if self.hybrid:  # every layer's window row of each computed position, in the window group's pages
            data = split_at(self.geo, "window")
            for layer in range(GEO.num_layers) if layers is None else layers:
                cache = self.caches[f"model.layers.{layer}.self_attn.swa_cache"]
                for pos in range(start, end):
                    page = self.pages[req_id][1][pos // PAGE]
                    if page:  # 0 is vLLM's null block: a page out of the window, not allocated
                        put_row(cache[page], pos % PAGE, PAGE, window_row(tokens, layer, pos, self.geo), data)
        for layer, comp, rb in self.sections:
            if layers is not None and layer not in layers:
                continue
            r = GEO.compress_ratios[layer]
            rows_per_page, data = PAGE // r, split_at(self.geo, comp)
            cache = self.caches[cache_name(layer, comp)]
            for j in range(start // r, end // r):
                if (j + 1) * r - 1 < start:
                    continue
                page = self.pages[req_id][0][j // rows_per_page]
                put_row(cache[page], j % rows_per_page, rows_per_page, model_row(tokens, layer, comp, j, rb), data)

    def run(self, steps: int = 20) -> None:
        """Step until every request finished (or `steps` steps); held ones stay held."""
        for _ in range(steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()

    def drain(self, deadline_s: float = 30.0) -> None:
        """Step until vLLM has freed every finished request (their saves reported done)."""
        end = time.monotonic() + deadline_s
        while self.scheduler.requests and time.monotonic() < end:
            self.step()
            time.sleep(0.01)

    def page_row(self, req_id: str, layer: int, component: str, row: int) -> bytes:
        """The bytes of a request's row as its pages hold them now."""
        rb = dict(((lay, c), b) for lay, c, b in self.sections)[(layer, component)]
        rows_per_page = PAGE // GEO.compress_ratios[layer]
        page = self.caches[cache_name(layer, component)][self.pages[req_id][0][row // rows_per_page]]
        return get_row(page, row % rows_per_page, rows_per_page, rb, split_at(self.geo, component))

    def close(self) -> None:
        """Shut both connectors down (puts in flight finish)."""
        self.worker.shutdown()
        self.connector.shutdown()


def extra(store: Any, *, tenant_fidelity: bool = False, **more: object) -> dict[str, object]:
    """kv_connector_extra_config for the store child `store` (the tiny geometry), plus `more`. The engine's
    own fidelity is 1 window unless `more` names one, or `tenant_fidelity` leaves it to the tenant's
    stored policy (replay_fidelity; docs/ENGINES.md)."""
    own = {} if tenant_fidelity or "replay_fidelity" in more else {"replay_windows": 1}
    return {"target": store.target, "geometry": GEO.name, "timeout_s": 10.0, **own, **more}


def store_prompt(store: Any, model_dir: Path, tokens: list[int], **add: Any) -> None:
    """Run one vLLM engine with the connector until the prompt `tokens` ran and was stored."""
    first = Engine(model_dir, extra(store))
    first.add("r1", tokens, **add)
    first.run()
    first.close()


def assert_rows_loaded(engine: Engine, req_id: str, tokens: Sequence[int], loaded_tokens: int = 80) -> None:
    """The request's pages hold the model's rows of `tokens` for its first `loaded_tokens` tokens."""
    for layer, comp, rb in engine.sections:
        for row in range(loaded_tokens // GEO.compress_ratios[layer]):
            assert engine.page_row(req_id, layer, comp, row) == model_row(tokens, layer, comp, row, rb)


def stored(target: str, tokens: list[int], geo: ModelGeometry = GEO) -> int:
    """Leading tokens of `tokens` the store holds under `geo`'s layout (a Lookup)."""
    with kvstore.Client(target, geometry=geo.name) as c:
        return int(c.lookup(tokens).found_tokens)


def expected_block(tokens: Sequence[int], index: int, geo: ModelGeometry = GEO) -> bytes:
    """The store block `index` of a prompt as the stand-in model's rows make it (the block layout's order)."""
    out = bytearray()
    b = STORE_BLOCK_TOKENS
    for layer, comp, rb in sections(geo):
        r = GEO.compress_ratios[layer]
        for j in range(index * b // r, (index + 1) * b // r):
            out += model_row(tokens, layer, comp, j, rb)
    return bytes(out)
