"""The kvstore vLLM connector driven by vLLM's REAL v1 Scheduler on CPU, against a real `kvstore serve`.

Harness: test_vllm_support.py (skips, with the reason, only when vLLM cannot be imported).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kvstore
from integrations.common import PageMap, parse_settings
from kvstore.errors import ConfigError, KVStoreError
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
    store_prompt,
    stored,
)

B = STORE_BLOCK_TOKENS


@pytest.fixture(scope="module")
def store(start_store: Callable[[], Child]) -> Child:
    return start_store()


def test_a_prompt_is_saved_block_by_block_in_the_models_bytes_and_held_until_saved(
        store: Child, tmp_path: Path) -> None:
    engine = Engine(tmp_path / "model", extra(store))
    tokens = prompt(100, seed=1)
    engine.add("r1", tokens, max_tokens=3)
    first = engine.step()
    # A miss: vLLM computes the whole prompt.
    assert first.num_scheduled_tokens["r1"] == 100
    assert engine.connector.scheduler.plan_of("r1").found_tokens == 0
    engine.run()
    assert engine.finished == ["r1"]
    # Finished, but its pages are held (vLLM keeps the request) until the worker says its puts are done.
    assert "r1" in engine.scheduler.requests
    engine.drain()
    assert "r1" not in engine.scheduler.requests
    # 100 prompt + 2 fed-back output tokens = 102 computed -> 6 full store blocks.
    assert stored(store.target, engine.tokens["r1"]) == 6 * B
    with kvstore.Client(store.target, geometry=GEO.name) as c:
        got = c.get(engine.tokens["r1"][: 6 * B])
    for i, block in enumerate(got.blocks):
        assert block == expected_block(engine.tokens["r1"], i), f"block {i}"
    assert engine.worker.worker.saves.blocks_saved == 6 and engine.worker.worker.saves.save_errors == 0
    engine.close()


def test_a_hit_loads_only_the_usable_tokens_byte_identical_and_vllm_computes_the_rest(
        store: Child, tmp_path: Path) -> None:
    tokens = prompt(100, seed=2)
    store_prompt(store, tmp_path / "a", tokens)
    assert stored(store.target, tokens) == 96
    # A new engine (an empty local prefix cache): the same prefix and a new turn.
    engine = Engine(tmp_path / "b", extra(store))
    turn2 = tokens + prompt(50, seed=3)
    engine.add("r2", turn2, max_tokens=3)
    so = engine.step()
    plan = engine.connector.scheduler.plan_of("r2")
    assert plan.found_tokens == 96 and plan.action.value == "bounded-replay"
    # Usable = the hit minus one window (8) = 88, rounded down to vLLM's 16-token page = 80.
    assert plan.replay_start == 96 - GEO.window
    assert so.scheduled_new_reqs[0].num_computed_tokens == 80
    assert so.num_scheduled_tokens["r2"] == 150 - 80
    assert_rows_loaded(engine, "r2", turn2)
    assert engine.worker.worker.loads.blocks_loaded == 5
    engine.run()
    engine.close()
    # Blocks 6.. (the new turn) were stored after the ones found, chained to them.
    assert stored(store.target, engine.tokens["r2"]) == len(engine.tokens["r2"]) // B * B


@pytest.mark.parametrize("path", ["grpc", "shm", "direct-cpu"])
def test_each_load_path_fills_the_same_bytes(store: Child, tmp_path: Path, path: str) -> None:
    tokens = prompt(100, seed=20)
    store_prompt(store, tmp_path / "a", tokens)
    direct = {"data_dir": str(store.data_dir)} if path.startswith("direct") else {}
    engine = Engine(tmp_path / "b", extra(store, path=path, **direct))
    turn2 = [*tokens, 4, 4]
    engine.add("r2", turn2, max_tokens=2)
    engine.step()
    assert engine.worker.worker.loads.load_paths == {path: 1}
    assert_rows_loaded(engine, "r2", turn2)
    engine.close()


def test_a_preempted_request_loads_its_hit_again_into_its_new_pages(store: Child, tmp_path: Path) -> None:
    tokens = prompt(100, seed=21)
    store_prompt(store, tmp_path / "a", tokens)
    engine = Engine(tmp_path / "b", extra(store))
    turn2 = [*tokens, 6, 6]
    engine.add("r2", turn2, max_tokens=4)
    engine.step()
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)   # vLLM preempts r2
    for cache in engine.caches.values():
        cache.zero_()   # its freed pages may hold anything now
    so = engine.step()
    for _ in range(20):  # vLLM may take the resumed request a step later (seen under two pytest workers)
        if so.scheduled_cached_reqs.req_ids or so.scheduled_new_reqs:
            break
        so = engine.step()
    assert so.scheduled_cached_reqs.req_ids == ["r2"] and "r2" in so.scheduled_cached_reqs.resumed_req_ids
    assert so.scheduled_cached_reqs.num_computed_tokens == [80]
    assert len(so.kv_connector_metadata.loads) == 1 and so.kv_connector_metadata.loads[0].lease_id is None
    assert_rows_loaded(engine, "r2", turn2)
    engine.run(60)  # as the layerwise and snapshot tests: a loaded two-worker CI run needed more than 20 steps
    assert engine.finished == ["r2"]
    engine.close()


def test_requests_batched_in_one_step_each_get_their_own_rows(store: Child, tmp_path: Path) -> None:
    prompts = {f"p{i}": prompt(70 + 20 * i, seed=30 + i) for i in range(3)}
    first = Engine(tmp_path / "a", extra(store))
    for req_id, tokens in prompts.items():
        first.add(req_id, tokens)
    first.run()
    first.close()
    engine = Engine(tmp_path / "b", extra(store))
    turns = {f"q{i}": [*tokens, 5] for i, tokens in enumerate(prompts.values())}
    for req_id, tokens in turns.items():
        engine.add(req_id, tokens, max_tokens=2)
    so = engine.step()
    assert len(so.kv_connector_metadata.loads) == 3
    for new in so.scheduled_new_reqs:
        tokens = turns[new.req_id]
        # found = len // 16 blocks; usable = found - window (8), rounded down to 16
        assert new.num_computed_tokens == (len(tokens) // B * B - GEO.window) // PAGE * PAGE
        for layer, comp, rb in GLOBAL:
            for row in range(new.num_computed_tokens // GEO.compress_ratios[layer]):
                assert engine.page_row(new.req_id, layer, comp, row) == model_row(tokens, layer, comp, row, rb)
    engine.run()
    assert sorted(engine.finished) == sorted(turns)
    engine.close()


def test_a_store_outage_costs_the_cache_not_the_requests(start_store: Callable[[], Child], tmp_path: Path) -> None:
    down = start_store()
    engine = Engine(tmp_path / "m", extra(down, timeout_s=2.0))
    down.kill9()
    engine.add("r", prompt(70, seed=23), max_tokens=2)
    so = engine.step()     # the lookup fails: a miss, vLLM computes everything
    assert so.num_scheduled_tokens == {"r": 70} and so.scheduled_new_reqs[0].num_computed_tokens == 0
    engine.run()
    engine.drain()         # the failed puts still end: the request's pages are freed
    assert engine.finished == ["r"] and not engine.scheduler.requests
    assert engine.worker.worker.saves.save_errors >= 1 and engine.worker.worker.saves.blocks_saved == 0
    engine.close()


def test_a_salted_request_is_a_chain_of_its_own_found_only_under_its_salt(store: Child, tmp_path: Path) -> None:
    tokens = prompt(100, seed=24)
    store_prompt(store, tmp_path / "a", tokens, cache_salt="user-7")
    with kvstore.Client(store.target, geometry=GEO.name) as c:
        assert c.lookup(tokens).found_tokens == 0                                   # not an unsalted prompt's
        assert c.lookup(tokens, extra_keys=["vllm-salt:user-7"]).found_tokens == 96
    engine = Engine(tmp_path / "b", extra(store))
    engine.add("same", [*tokens, 1], cache_salt="user-7", max_tokens=2)
    engine.add("other", [*tokens, 1], cache_salt="user-8", max_tokens=2)
    engine.add("plain", [*tokens, 1], max_tokens=2)
    so = engine.step()
    computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
    assert computed == {"same": 80, "other": 0, "plain": 0}
    assert_rows_loaded(engine, "same", tokens)
    engine.close()


def test_exact_fidelity_replays_layers_times_window(store: Child, tmp_path: Path) -> None:
    tokens = prompt(100, seed=4)
    store_prompt(store, tmp_path / "a", tokens)
    engine = Engine(tmp_path / "b", extra(store, replay_windows="exact"))
    engine.add("r2", [*tokens, 5, 6, 7])
    so = engine.step()
    # 96 found, exact replay span 5 layers x 8 = 40: usable 56, rounded down to 48.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 48
    engine.close()


def test_a_hit_not_above_the_window_or_a_miss_loads_nothing(store: Child, tmp_path: Path) -> None:
    engine = Engine(tmp_path / "m", extra(store))
    engine.add("miss", prompt(40, seed=5))
    so = engine.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so.kv_connector_metadata.loads == []
    engine.close()


def test_vllm_asking_again_makes_no_second_lookup(store: Child, tmp_path: Path) -> None:
    engine = Engine(tmp_path / "m", extra(store))
    request = engine.add("r", prompt(70, seed=6))
    connector = engine.connector
    assert connector.get_num_new_matched_tokens(request, 0) == connector.get_num_new_matched_tokens(request, 0)
    engine.step()
    assert connector.scheduler.lookups == 1
    engine.close()


def test_blocks_that_fail_to_load_are_reported_and_vllm_recomputes_them(
        store: Child, start_store: Callable[[], Child], tmp_path: Path) -> None:
    tokens = prompt(100, seed=7)
    store_prompt(store, tmp_path / "a", tokens)
    # The worker reads from a store that lost the blocks (an empty one): every load fails.
    empty = start_store()
    engine = Engine(tmp_path / "b", extra(store), worker_extra=extra(empty))
    engine.add("r2", [*tokens, 9, 9])
    so = engine.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 80
    # vLLM's scheduler took the reported pages back: the request restarts at 0 and recomputes them.
    request = engine.scheduler.requests["r2"]
    assert request.num_computed_tokens == 0
    so = engine.step()
    assert so.num_scheduled_tokens["r2"] == 102
    engine.run()
    assert engine.finished == ["r2"]
    engine.close()


def test_with_vllms_default_failure_policy_a_failed_load_fails_the_request(
        store: Child, start_store: Callable[[], Child], tmp_path: Path) -> None:
    tokens = prompt(100, seed=7)
    store_prompt(store, tmp_path / "a", tokens)
    engine = Engine(tmp_path / "b", extra(store), worker_extra=extra(start_store()), failure_policy="fail")
    engine.add("r2", [*tokens, 9, 9])
    engine.step()
    assert engine.finished == ["r2"] and "ERROR" in engine.reasons["r2"].upper()
    engine.close()


@pytest.mark.parametrize(("bad", "says"), [
    ({}, "target"),
    ({"target": "nohostport"}, "target"),
    ({"target": "127.0.0.1:1", "path": "rdma"}, "path"),
    ({"target": "127.0.0.1:1", "tarrget": "x"}, "unknown"),
    ({"target": "127.0.0.1:1", "timeout_s": "soon"}, "timeout_s"),
    ({"target": "127.0.0.1:1", "replay_windows": 0}, "replay_windows"),
    ({"target": "127.0.0.1:1", "path": "direct-cpu"}, "data_dir"),
])
def test_bad_settings_are_config_errors_naming_them(bad: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_settings(bad)


def test_pages_are_written_in_place_and_a_cache_whose_pages_are_not_contiguous_is_refused() -> None:
    pages = PageMap(page_tokens=16, ratio=2, row_bytes=72)
    physical = torch.zeros(8, 2 * (8 * 72 + 8), dtype=torch.uint8)
    cache = physical[:, 8 * 72 + 8:]                 # the second layer's pages: a strided view
    pages.view(cache)[3, 2] = 7
    assert physical[3, 8 * 72 + 8 + 2 * 72: 8 * 72 + 8 + 3 * 72].eq(7).all() and int(physical.sum()) == 7 * 72
    transposed = torch.zeros(8, 72, 8, dtype=torch.uint8).transpose(1, 2)   # rows not contiguous bytes
    with pytest.raises(ConfigError, match="contiguous"):
        pages.view(transposed)


def test_a_bad_setting_stops_vllm_at_connector_creation(store: Child, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="load_async"):
        Engine(tmp_path / "m", extra(store, load_async="yes"))
    with pytest.raises(ConfigError, match="several KV cache groups"):
        Engine(tmp_path / "h", extra(store, load_async=False), hybrid=True)
    # --kv-cache-dtype fp8_ds_mla is served under its own layout now (test_vllm_layouts.py).


def test_an_unreachable_store_is_a_typed_error_at_start(tmp_path: Path) -> None:
    with pytest.raises(KVStoreError):
        Engine(tmp_path / "m", {"target": "127.0.0.1:1", "geometry": GEO.name, "timeout_s": 2.0})


def test_the_connector_is_what_vllm_loads_from_the_module_path(store: Child, tmp_path: Path) -> None:
    from integrations.vllm_connector import KVStoreConnector  # here: imports vLLM (the skip comes first)

    engine = Engine(tmp_path / "m", extra(store))
    assert isinstance(engine.connector, KVStoreConnector) and isinstance(engine.worker, KVStoreConnector)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
    assert supports_hma(engine.connector)
    assert engine.connector.requires_kv_delivery is False   # best effort: a preemption needs no recompute
    request = engine.add("r", prompt(70, seed=22))
    assert engine.connector.get_external_cache_hit_sources(request, 16) == {"disk": 16}
    engine.close()
