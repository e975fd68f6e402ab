"""The kvstore vLLM connector with vLLM's hybrid layout: window (SWA) caches beside the global ones.

vLLM's REAL v1 Scheduler on CPU (harness: test_vllm_support.py), a real `kvstore serve`: loads are
asynchronous (`SupportsHMA`, several KV cache groups), snapshots are put from the window pages and
loaded back into them for a fetch + snapshot resume.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import kvstore
from replay.planner import Planner
from tests.children import Child
from tests.integrations.test_vllm_support import GEO, GLOBAL, PAGE, Engine, extra, model_row, prompt, stored, window_row


@pytest.fixture(scope="module")
def store(start_store: Callable[[], Child]) -> Child:
    return start_store()


def test_hybrid_groups_load_asynchronously_through_supports_hma(store: Child, tmp_path: Path) -> None:
    tokens = prompt(100, seed=8)
    first = Engine(tmp_path / "a", extra(store), hybrid=True)
    first.add("r1", tokens)
    first.run()
    assert first.finished == ["r1"]
    first.close()
    assert stored(store.target, tokens) == 96
    engine = Engine(tmp_path / "b", extra(store), hybrid=True)
    turn2 = [*tokens, 3, 4, 5]
    engine.add("r2", turn2)
    so = engine.step()   # the load runs (asynchronously for vLLM); the request waits for it
    assert so.num_scheduled_tokens == {} and len(so.kv_connector_metadata.loads) == 1
    # The first engine's window caches gave a snapshot at the prompt's last boundary, 96: an exact resume there.
    assert engine.worker.worker.loads.blocks_loaded == 6 and engine.worker.worker.loads.snapshots_loaded == 1
    so = engine.step()   # loaded: vLLM computes from 96 on
    assert so.num_scheduled_tokens == {"r2": 103 - 96}
    for layer, comp, rb in GLOBAL:
        for row in range(96 // GEO.compress_ratios[layer]):
            assert engine.page_row("r2", layer, comp, row) == model_row(turn2, layer, comp, row, rb)
    engine.run()
    assert engine.finished == ["r2"]
    engine.close()


def test_with_window_caches_snapshots_are_put_at_the_prompts_and_the_outputs_block_boundaries(
        store: Child, tmp_path: Path) -> None:
    engine = Engine(tmp_path / "m", extra(store), hybrid=True)
    engine.add("r1", prompt(100, seed=9), max_tokens=20)
    engine.run(60)
    engine.drain()
    engine.close()
    tokens = engine.tokens["r1"]   # 100 prompt + 20 output tokens; 119 computed
    assert engine.worker.worker.saves.snapshots_saved == 2
    with kvstore.Client(store.target, geometry=GEO.name) as c:
        for t in (96, 112):   # the boundaries at or below the prompt's end and the output's end
            rows = [window_row(tokens, layer, p) for layer in range(GEO.num_layers) for p in range(t - GEO.window, t)]
            assert c.swa.get(tokens[:t], t) == b"".join(rows), t
        # The planner finds the output's snapshot for the next turn: a fetch+snapshot resume at 112.
        with Planner(c, snapshot_probes=4) as planner:
            plan = planner.plan([*tokens, 7, 7], report=False)
        assert plan.action.value == "fetch+snapshot" and plan.snapshot_position == 112


def test_a_stored_snapshot_is_a_fetch_and_snapshot_resume_loading_blocks_and_window(
        store: Child, tmp_path: Path) -> None:
    first = Engine(tmp_path / "a", extra(store), hybrid=True)
    first.add("r1", prompt(100, seed=10), max_tokens=20)
    first.run(60)
    first.drain()
    first.close()
    tokens = first.tokens["r1"]        # snapshots at 96 and 112, blocks up to 112
    engine = Engine(tmp_path / "b", extra(store), hybrid=True)
    turn2 = [*tokens, 7, 7]
    engine.add("r2", turn2, max_tokens=2)
    engine.step()
    plan = engine.connector.scheduler.plan_of("r2")
    assert plan.action.value == "fetch+snapshot" and plan.resume_tokens == 112
    assert engine.worker.worker.loads.snapshots_loaded == 1
    so = engine.step()   # loaded: vLLM computes from R = 112, with the window state of the snapshot
    assert so.num_scheduled_tokens == {"r2": len(turn2) - 112}
    rb = GEO.window_row_bytes
    for layer in range(GEO.num_layers):
        cache = engine.caches[f"model.layers.{layer}.self_attn.swa_cache"][:, : PAGE * rb].view(-1, PAGE, rb)
        for pos in range(112 - GEO.window, 112):
            page = engine.pages["r2"][1][pos // PAGE]
            assert bytes(cache[page, pos % PAGE].tolist()) == window_row(turn2, layer, pos), (layer, pos)
    for layer, comp, rb in GLOBAL:
        for row in range(112 // GEO.compress_ratios[layer]):
            assert engine.page_row("r2", layer, comp, row) == model_row(turn2, layer, comp, row, rb)
    engine.close()


def test_a_snapshot_gone_before_the_load_fails_the_async_load_and_vllm_recomputes(
        store: Child, tmp_path: Path) -> None:
    tokens = prompt(100, seed=13)
    first = Engine(tmp_path / "a", extra(store), hybrid=True)
    first.add("r1", tokens)
    first.run()
    first.close()
    engine = Engine(tmp_path / "b", extra(store), hybrid=True)
    load = engine.worker.start_load_kv

    def expire_then_load(context: object) -> None:   # the snapshot's TTL ends between the plan and the load
        with kvstore.Client(store.target, geometry=GEO.name) as c:
            assert c.swa.delete_many([c.swa.key(tokens[:96], 96)]) == 1
        engine.worker.start_load_kv = load
        load(context)

    engine.worker.start_load_kv = expire_then_load
    engine.add("r2", [*tokens, 3])
    engine.step()
    assert engine.worker.worker.loads.snapshots_loaded == 0
    so = engine.step()   # vLLM got the failed load (failed_recving) and recomputes the whole prompt
    assert so.num_scheduled_tokens == {"r2": 101}
    engine.run()
    assert engine.finished == ["r2"]
    engine.close()
