"""Layout signatures (kvstore.layout): every block and snapshot key is scoped by the byte layout of its rows.

No engine needed: a real `kvstore serve` child and `kvstore.Client`, naming the served geometry of
each layout (`<model>+<layout>`), as the adapters do once they derived their layout from the engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator

import pytest

import kvstore
from kvstore import geometry, layout
from kvstore.geometry import TINY, V4_1_FLASH
from kvstore.prefix import root_hash
from kvstore.swa_snapshot import snapshot_bytes, snapshot_key
from tests.children import Child
from tests.integrations.conftest import STORE_BLOCK_TOKENS


@pytest.fixture(scope="module")
def store(start_store: object) -> Iterator[Child]:
    yield start_store()  # type: ignore[operator]


def _blocks(g: geometry.ModelGeometry, tokens: list[int], tag: bytes) -> list[bytes]:
    size = g.block_bytes(STORE_BLOCK_TOKENS)
    out = []
    for i in range(len(tokens) // STORE_BLOCK_TOKENS):
        seed = hashlib.sha256(tag + bytes([i])).digest()
        out.append((seed * (size // 32 + 1))[:size])
    return out


def test_engine_layouts_have_the_sizes_of_the_engines_records() -> None:
    # ../shared/HOPPER_LAYOUTS.md section 4, checked against the engines' sources (docs/BLOCK_SIZE.md).
    sizes = {name: (g.compressed_kv_row_bytes, g.indexer_row_bytes, g.window_row_bytes, g.bytes_per_token)
             for name, g in geometry.REGISTRY.items() if name.startswith(V4_1_FLASH.name)}
    assert sizes == {
        "deepseek-v4.1-flash": (288, 68, 528, 890),
        "deepseek-v4.1-flash+sglang-v4": (584, 68, 584, 1630),
        "deepseek-v4.1-flash+vllm-fp8_ds_mla-sm90": (584, 132, 584, 1790),
        "deepseek-v4.1-flash+vllm-fp8_ds_mla-sm100": (528, 132, 528, 1650),
        "deepseek-v4.1-flash+vllm-nvfp4_ds_mla-fp8-indexer": (288, 132, 528, 1050),
    }
    assert V4_1_FLASH.with_records(layout.SGLANG_V4).row_split("compressed_kv") == (576, 8)  # 448 E4M3 + 128 BF16


def test_each_layout_has_its_own_fingerprint_and_root_and_the_model_rows_keep_theirs() -> None:
    assert V4_1_FLASH.fingerprint.hex() == "f303fd5c6387cfaa"  # docs/PREFIX_HASHING.md: stored blocks stay hits
    assert V4_1_FLASH.with_records(layout.MODEL_NATIVE) is V4_1_FLASH
    prints = {g.fingerprint for g in geometry.REGISTRY.values()}
    assert len(prints) == len(geometry.REGISTRY)
    roots = {root_hash(g.fingerprint, 64) for g in geometry.REGISTRY.values()}
    assert len(roots) == len(geometry.REGISTRY)
    # Same sizes, other engine or arch: still apart (a vLLM 584 row is not an SGLang one).
    a = V4_1_FLASH.with_records(layout.SGLANG_V4)
    b = V4_1_FLASH.with_records(layout.VLLM_FP8_DS_MLA_SM90)
    assert a.compressed_kv_row_bytes == b.compressed_kv_row_bytes and a.fingerprint != b.fingerprint
    # The record layout itself is hashed, not only the name it gives the geometry.
    assert dataclasses.replace(V4_1_FLASH, records=layout.SGLANG_V4).fingerprint != V4_1_FLASH.fingerprint
    assert dataclasses.replace(a, records=layout.VLLM_FP8_DS_MLA_SM90).fingerprint != a.fingerprint


def test_one_prompt_stored_through_two_layouts_is_found_only_in_its_own(store: Child) -> None:
    tokens = list(range(1, 4 * STORE_BLOCK_TOKENS + 1))
    v4 = TINY.with_records(layout.SGLANG_V4)
    with kvstore.Client(store.target, geometry=TINY.name) as native, \
            kvstore.Client(store.target, geometry=v4.name) as engine:
        assert engine.block_bytes == v4.block_bytes(STORE_BLOCK_TOKENS) != native.block_bytes
        assert engine.fingerprint == v4.fingerprint
        native_blocks, engine_blocks = _blocks(TINY, tokens, b"model"), _blocks(v4, tokens, b"v4")
        native.put(tokens[: 2 * STORE_BLOCK_TOKENS], native_blocks[:2])
        assert native.lookup(tokens).found_tokens == 2 * STORE_BLOCK_TOKENS
        assert engine.lookup(tokens).found_tokens == 0             # the model's rows are no hit for v4
        engine.put(tokens, engine_blocks)
        assert engine.lookup(tokens).found_tokens == 4 * STORE_BLOCK_TOKENS
        assert native.lookup(tokens).found_tokens == 2 * STORE_BLOCK_TOKENS   # nor v4's for the model
        assert [bytes(b or b"") for b in engine.get(tokens).blocks] == engine_blocks
        assert [bytes(b or b"") for b in native.get(tokens[: 2 * STORE_BLOCK_TOKENS]).blocks] == native_blocks[:2]
        by_layout = {g.name: g.blocks_stored for g in native.stats().stored_by_geometry}
    assert by_layout[TINY.name] == 2 and by_layout[v4.name] == 4   # `kvstore stats` shows each apart


def test_a_snapshot_is_found_only_under_its_own_layout(store: Child) -> None:
    tokens = list(range(7, 7 + 2 * STORE_BLOCK_TOKENS))
    v4 = TINY.with_records(layout.VLLM_FP8_DS_MLA_SM90)
    position = len(tokens)
    with kvstore.Client(store.target, geometry=TINY.name) as native, \
            kvstore.Client(store.target, geometry=v4.name) as engine:
        anchor = engine.hashes(tokens)[-1]
        assert anchor != native.hashes(tokens)[-1]            # the layout is in the chain's root
        key = snapshot_key(anchor, [], position)
        engine.swa.put_many([(key, position, bytes(snapshot_bytes(v4, position)))])
        assert engine.swa.get_many([key])[0] is not None
        assert native.swa.get_many([key])[0] is None          # same key bytes, other layout: not found
        with pytest.raises(kvstore.errors.InvalidArgument):   # the model's size is not v4's
            native.swa.put_many([(key, position, bytes(snapshot_bytes(v4, position)))])
