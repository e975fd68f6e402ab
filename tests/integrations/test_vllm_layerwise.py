"""Layer-wise loads and saves of the kvstore vLLM connector (`layerwise`), vLLM's REAL v1 Scheduler on CPU.

Harness: test_vllm_support.py. With `hooks` the stand-in model runs layer by layer and calls
`wait_for_layer_load` / `save_kv_layer` as vLLM's attention layers do; `scribble` overwrites a
layer's caches right after its `save_kv_layer` (put back after `wait_for_save`), so only rows copied
out per layer can be stored right.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import kvstore
from tests.children import Child
from tests.integrations.test_vllm_support import (
    GEO,
    GLOBAL,
    PAGE,
    STORE_BLOCK_TOKENS,
    Engine,
    assert_rows_loaded,
    expected_block,
    extra,
    model_row,
    prompt,
    window_row,
)

B = STORE_BLOCK_TOKENS
#: The tiny geometry's source layers, in order (layer 1 at ratio 2, layer 3 at ratio 1).
FIRST, LATER = sorted(GEO.kv_source_layers)


@pytest.fixture(scope="module")
def store(start_store: Callable[[], Child]) -> Child:
    return start_store()


def _stored_prompt(store: Child, tmp_path: Path, seed: int, n: int = 100) -> list[int]:
    first = Engine(tmp_path / f"seed{seed}", extra(store))
    tokens = prompt(n, seed=seed)
    first.add("r1", tokens)
    first.run()
    first.close()
    return tokens


def _rows_equal(engine: Engine, req_id: str, tokens: list[int], layer: int, upto: int) -> bool:
    return all(engine.page_row(req_id, lay, comp, row) == model_row(tokens, lay, comp, row, rb)
               for lay, comp, rb in GLOBAL if lay == layer for row in range(upto // GEO.compress_ratios[lay]))


def _rows_zero(engine: Engine, req_id: str, layer: int, upto: int) -> bool:
    return all(engine.page_row(req_id, lay, comp, row) == bytes(rb)
               for lay, comp, rb in GLOBAL if lay == layer for row in range(upto // GEO.compress_ratios[lay]))


def test_a_layer_is_filled_and_released_to_the_forward_before_the_later_layers_are_done(
        store: Child, tmp_path: Path) -> None:
    tokens = _stored_prompt(store, tmp_path, seed=40)
    engine = Engine(tmp_path / "b", extra(store, layerwise=True), hooks=True)
    release = threading.Event()

    def loader_hook(layer: int) -> None:   # the loader thread holds after the first source layer
        if layer == FIRST:
            release.wait(10)   # an all-at-once load blocks start_load_kv here, then fills the rest

    seen: dict[int, tuple[bool, bool]] = {}

    def before_layer(layer: int) -> None:   # the forward, after wait_for_layer_load(layer)
        if layer in (FIRST, LATER):
            seen[layer] = (_rows_equal(engine, "r2", turn2, layer, 80), _rows_zero(engine, "r2", LATER, 80))
        if layer == FIRST:
            release.set()

    engine.worker.worker.loads.layer_filled = loader_hook
    engine.before_layer = before_layer
    turn2 = [*tokens, 4, 4]
    engine.add("r2", turn2, max_tokens=2)
    so = engine.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 80
    # At the first source layer: its rows are in, the later layer's pages are still empty.
    assert seen[FIRST] == (True, True)
    # At the later layer: its rows are in too, byte-identical to the stored blocks.
    assert seen[LATER] == (True, False)
    assert_rows_loaded(engine, "r2", turn2)
    assert engine.worker.worker.loads.blocks_loaded == 5 and engine.worker.worker.loads.layerwise
    engine.run()
    assert engine.finished == ["r2"]
    engine.close()


def test_layerwise_blocks_that_fail_to_load_are_reported_and_vllm_recomputes_them(
        store: Child, start_store: Callable[[], Child], tmp_path: Path) -> None:
    tokens = _stored_prompt(store, tmp_path, seed=41)
    empty = start_store()   # the worker reads from a store that lost the blocks
    engine = Engine(tmp_path / "b", extra(store, layerwise=True), worker_extra=extra(empty, layerwise=True),
                    hooks=True)
    engine.add("r2", [*tokens, 9, 9])
    so = engine.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 80
    # get_block_ids_with_load_errors named the pages: vLLM took them back and restarts at 0.
    assert engine.scheduler.requests["r2"].num_computed_tokens == 0
    so = engine.step()
    assert so.num_scheduled_tokens["r2"] == 102
    engine.run()
    assert engine.finished == ["r2"]
    engine.close()


def test_when_vllm_calls_no_per_layer_hooks_layerwise_loads_are_recomputed_and_the_next_load_whole(
        store: Child, tmp_path: Path) -> None:
    tokens, other = _stored_prompt(store, tmp_path, seed=42), _stored_prompt(store, tmp_path, seed=43)
    # Layer-wise configured, but the model's attention never waits per layer (vLLM 0.33's DeepSeek-V4.1).
    engine = Engine(tmp_path / "b", extra(store, layerwise=True), hooks=False)
    engine.add("r2", [*tokens, 9])
    engine.step()
    assert engine.scheduler.requests["r2"].num_computed_tokens == 0   # reported: vLLM recomputes
    assert engine.worker.worker.loads.layerwise is False
    engine.run()
    engine.add("r3", [*other, 9], max_tokens=2)
    so = engine.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 80 and engine.scheduler.requests["r3"].num_computed_tokens
    assert_rows_loaded(engine, "r3", [*other, 9])
    engine.close()


def test_per_layer_hooks_without_layerwise_change_nothing(store: Child, tmp_path: Path) -> None:
    tokens = _stored_prompt(store, tmp_path, seed=44)
    engine = Engine(tmp_path / "b", extra(store), hooks=True)
    filled: list[int] = []
    engine.worker.worker.loads.layer_filled = filled.append
    engine.before_layer = lambda layer: filled.append(-1 - layer)
    engine.add("r2", [*tokens, 4], max_tokens=2)
    engine.step()
    # Every layer was filled before the forward's first layer began (start_load_kv returned filled).
    assert filled[: len(GEO.kv_source_layers)] == sorted(GEO.kv_source_layers)
    assert engine.worker.worker.saves.parts_captured == 0
    engine.close()


def test_a_layerwise_save_stores_the_bytes_of_the_all_at_once_save(store: Child, tmp_path: Path) -> None:
    tokens = prompt(100, seed=45)
    runs = {}
    for salt, layerwise in (("whole", False), ("layers", True)):
        engine = Engine(tmp_path / salt, extra(store, layerwise=layerwise), hooks=layerwise, scribble=layerwise)
        engine.add("r1", tokens, max_tokens=20, cache_salt=salt)
        engine.run(60)
        engine.drain()
        engine.close()
        runs[salt] = engine
    whole, layers = runs["whole"], runs["layers"]
    assert whole.tokens["r1"] == layers.tokens["r1"]
    out = whole.tokens["r1"]   # 119 computed: 7 full blocks, saved over several steps
    with kvstore.Client(store.target, geometry=GEO.name) as c:
        a = c.get(out[: 7 * B], extra_keys=["vllm-salt:whole"]).blocks
        b = c.get(out[: 7 * B], extra_keys=["vllm-salt:layers"]).blocks
    assert len(a) == len(b) == 7 and a == b
    assert all(block == expected_block(out, i) for i, block in enumerate(b))
    # Every part came from the per-layer copies (the scribbled caches were never read at the step's end).
    assert layers.worker.worker.saves.parts_captured > 0 and layers.worker.worker.saves.parts_gathered == 0
    assert whole.worker.worker.saves.parts_captured == 0 and whole.worker.worker.saves.parts_gathered > 0


def test_layerwise_with_window_caches_saves_the_same_snapshots_and_loads_them(store: Child, tmp_path: Path) -> None:
    engine = Engine(tmp_path / "a", extra(store, layerwise=True), hybrid=True, hooks=True, scribble=True)
    engine.add("r1", prompt(100, seed=46), max_tokens=20)
    engine.run(60)
    engine.drain()
    engine.close()
    tokens = engine.tokens["r1"]
    assert engine.worker.worker.saves.snapshots_saved == 2 and engine.worker.worker.saves.parts_gathered == 0
    with kvstore.Client(store.target, geometry=GEO.name) as c:
        for t in (96, 112):
            rows = [window_row(tokens, layer, p) for layer in range(GEO.num_layers) for p in range(t - GEO.window, t)]
            assert c.swa.get(tokens[:t], t) == b"".join(rows), t
    # A fetch + snapshot resume, layer by layer: the blocks and every layer's window rows.
    resumed = Engine(tmp_path / "b", extra(store, layerwise=True), hybrid=True, hooks=True)
    turn2 = [*tokens, 7, 7]
    resumed.add("r2", turn2, max_tokens=2)
    resumed.step()
    assert resumed.worker.worker.loads.snapshots_loaded == 1
    so = resumed.step()
    assert so.num_scheduled_tokens == {"r2": len(turn2) - 112}
    rb = GEO.window_row_bytes
    for layer in range(GEO.num_layers):
        cache = resumed.caches[f"model.layers.{layer}.self_attn.swa_cache"][:, : PAGE * rb].view(-1, PAGE, rb)
        for pos in range(112 - GEO.window, 112):
            page = resumed.pages["r2"][1][pos // PAGE]
            assert bytes(cache[page, pos % PAGE].tolist()) == window_row(turn2, layer, pos), (layer, pos)
    for layer, comp, rb in GLOBAL:
        for row in range(112 // GEO.compress_ratios[layer]):
            assert resumed.page_row("r2", layer, comp, row) == model_row(turn2, layer, comp, row, rb)
    resumed.close()


def test_layerwise_must_be_a_boolean_and_asks_vllm_for_piecewise_graphs(store: Child, tmp_path: Path) -> None:
    from integrations.vllm_connector import KVStoreConnector
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="layerwise"):
        Engine(tmp_path / "m", extra(store, layerwise="yes"))
    assert KVStoreConnector.requires_piecewise_for_cudagraph({"layerwise": True}) is True
    assert KVStoreConnector.requires_piecewise_for_cudagraph({}) is False
