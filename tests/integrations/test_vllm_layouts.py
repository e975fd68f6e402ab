"""vLLM's own records served byte for byte: `--kv-cache-dtype fp8_ds_mla` (its DeepSeek-V4.1 default) and the rest.

vLLM's REAL v1 Scheduler on CPU (harness: test_vllm_support.py) and a real `kvstore serve`. The stand-in
model writes each row where vLLM 0.33.0's kernels put it: fp8_ds_mla's 584-B V4 record off SM100 and its
FP8 indexer row block-split (`_rope_quant_insert_kernel`: data at slot x 576, scales at page_slots x 576 +
slot x 8; `indexer_k_store`: values, then 4-B scales), the 528-B MXFP8 record on SM100 interleaved. The
connector derives the layout from vLLM's settings (integrations/vllm_records.py) and keys its blocks by it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import kvstore
from integrations import vllm_records
from kvstore import layout
from kvstore.errors import ConfigError
from tests.children import Child
from tests.integrations.test_vllm_support import (
    GEO,
    PAGE,
    STORE_BLOCK_TOKENS,
    Engine,
    assert_rows_loaded,
    expected_block,
    extra,
    get_row,
    prompt,
    split_at,
    stored,
    window_row,
)

SM90 = GEO.with_records(layout.VLLM_FP8_DS_MLA_SM90)
SM100 = GEO.with_records(layout.VLLM_FP8_DS_MLA_SM100)


@pytest.fixture(scope="module")
def store(start_store: Callable[[], Child]) -> Child:
    return start_store()


def _store(store: Child, path: Path, tokens: list[int], geo: object, **kw: object) -> Engine:
    first = Engine(path, extra(store), cache_dtype=str(kw.pop("cache_dtype", "fp8_ds_mla")), geo=geo, **kw)
    first.add("r1", tokens, max_tokens=1)
    first.run()
    first.drain()
    first.close()
    return first


def test_fp8_ds_mla_rows_are_stored_byte_for_byte_under_their_layout_and_loaded_back(
        store: Child, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tokens = prompt(100, seed=31)
    with caplog.at_level("INFO", logger="integrations.common"):
        first = _store(store, tmp_path / "a", tokens, SM90)
    assert first.connector.client.geometry == SM90.name == first.worker.client.geometry
    assert "vllm-fp8_ds_mla-sm90" in caplog.text and SM90.fingerprint.hex() in caplog.text   # said in the log
    assert stored(store.target, tokens, SM90) == 96 and stored(store.target, tokens, GEO) == 0
    with kvstore.Client(store.target, geometry=SM90.name) as c:
        got = c.get(tokens[:96]).blocks
    assert [bytes(b or b"") for b in got] == [expected_block(tokens, i, SM90) for i in range(96 // STORE_BLOCK_TOKENS)]
    # A second fp8_ds_mla engine loads them into its block-split pages, byte for byte.
    engine = Engine(tmp_path / "b", extra(store), cache_dtype="fp8_ds_mla", geo=SM90)
    turn2 = [*tokens, 5, 6, 7]
    engine.add("r2", turn2)
    engine.step()
    assert engine.worker.worker.loads.blocks_loaded == 5   # the hit, 96, less the replay span, on vLLM's page: 80
    assert_rows_loaded(engine, "r2", turn2)
    engine.close()
    # An engine keeping the model's own rows finds nothing of them.
    native = Engine(tmp_path / "c", extra(store))
    native.add("r3", turn2)
    native.step()
    assert native.computed[0]["r3"] == (0, len(turn2)) and native.worker.worker.loads.blocks_loaded == 0
    native.close()


def test_fp8_ds_mla_window_rows_make_snapshots_of_their_layout(store: Child, tmp_path: Path) -> None:
    tokens = prompt(100, seed=32)
    first = _store(store, tmp_path / "a", tokens, SM90, hybrid=True)
    assert first.worker.worker.saves.snapshots_saved == 1
    with kvstore.Client(store.target, geometry=SM90.name) as c:
        rows = [window_row(tokens, layer, p, SM90)
                for layer in range(GEO.num_layers) for p in range(96 - GEO.window, 96)]
        assert c.swa.get(tokens[:96], 96) == b"".join(rows)          # 168-B rows, un-split from the pages
    engine = Engine(tmp_path / "b", extra(store), cache_dtype="fp8_ds_mla", geo=SM90, hybrid=True)
    turn2 = [*tokens, 3]
    engine.add("r2", turn2)
    engine.step()
    assert engine.worker.worker.loads.snapshots_loaded == 1   # a fetch + snapshot resume at 96
    engine.step()
    assert_rows_loaded(engine, "r2", turn2, 96)
    for layer in range(GEO.num_layers):
        cache = engine.caches[f"model.layers.{layer}.self_attn.swa_cache"]
        for pos in range(96 - GEO.window, 96):
            page = cache[engine.pages["r2"][1][pos // PAGE]]
            assert get_row(page, pos % PAGE, PAGE, SM90.window_row_bytes, split_at(SM90, "window")) == \
                window_row(turn2, layer, pos, SM90)
    engine.close()


def test_on_sm100_fp8_ds_mla_is_a_layout_of_its_own(store: Child, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_records, "sm100_family", lambda: True)   # what vLLM's platform says on a B200
    tokens = prompt(100, seed=33)
    first = _store(store, tmp_path / "a", tokens, SM100)
    assert first.worker.client.geometry == SM100.name
    assert stored(store.target, tokens, SM100) == 96 and stored(store.target, tokens, SM90) == 0
    with kvstore.Client(store.target, geometry=SM100.name) as c:
        assert bytes(c.get(tokens[:16]).blocks[0] or b"") == expected_block(tokens, 0, SM100)


def test_what_is_not_served_is_a_config_error_naming_the_setting(store: Child, tmp_path: Path) -> None:
    engine = Engine(tmp_path / "m", extra(store))
    config = engine.config
    engine.close()
    config.cache_config.cache_dtype = "fp8_ds_mla"
    config.attention_config.indexer_kv_dtype = "mxfp4"
    with pytest.raises(ConfigError, match="indexer_kv_dtype=mxfp4 with --kv-cache-dtype fp8_ds_mla"):
        vllm_records.records_of(config, sm100=True)
    config.cache_config.cache_dtype = "nvfp4_ds_mla"
    assert vllm_records.records_of(config, sm100=True) is layout.MODEL_NATIVE
    config.attention_config.indexer_kv_dtype = "auto"     # vLLM's default: the FP8 indexer
    assert vllm_records.records_of(config, sm100=True) is layout.VLLM_NVFP4_DS_MLA_FP8_INDEXER
    config.cache_config.cache_dtype = "auto"
    config.model_config.hf_config.model_type = "deepseek_v41"
    with pytest.raises(ConfigError, match="set it explicitly"):
        vllm_records.records_of(config)
    with pytest.raises(ConfigError, match="holds sglang-v4 rows"):   # a geometry of another engine's layout
        Engine(tmp_path / "n", extra(store, geometry=GEO.with_records(layout.SGLANG_V4).name),
               cache_dtype="fp8_ds_mla", geo=SM90)
