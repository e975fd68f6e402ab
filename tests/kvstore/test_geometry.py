"""Geometry from the model's config.json: V4.1-Flash and the tiny fixture reproduce docs/FORMAT.md's numbers."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import subprocess
import sys

import pytest

from kvstore import geometry
from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY, TINY_CONFIG, V4_1_FLASH, V4_1_FLASH_CONFIG, from_config

#: The fingerprint of the earlier codec's geometry (NVFP4-like rows, float32 indexer scale).
OLD_FINGERPRINT = "2d76cb51b8017512"


def test_v4_1_flash_numbers() -> None:
    g = V4_1_FLASH
    assert (g.num_layers, g.window, g.head_dim, g.rope_head_dim, g.index_head_dim) == (40, 128, 512, 64, 128)
    assert g.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert g.kv_source_layers == (2, 8, 14, 20) and g.ratio2_source_layers == (2, 8, 14)
    assert (g.compressed_kv_row_bytes, g.indexer_row_bytes, g.window_row_bytes) == (288, 68, 528)
    assert g.bytes_per_token == 890 and g.entries_per_token == 2.5 and g.token_alignment == 2
    assert g.block_bytes(64) == 56_960 and g.block_bytes(1_000_000) == 890_000_000
    assert [(x.layer, x.tokens_per_entry, x.entry_bytes) for x in g.global_layers] == [
        (2, 2, 356), (8, 2, 356), (14, 2, 356), (20, 1, 356)]


def test_tiny_fixture_numbers() -> None:
    t = TINY
    assert t.kv_source_layers == (1, 3) and t.ratio2_source_layers == (1,) and t.window == 8
    assert (t.compressed_kv_row_bytes, t.indexer_row_bytes, t.window_row_bytes) == (72, 34, 132)
    assert t.bytes_per_token == (72 + 34) / 2 + (72 + 34) == 159
    assert t.block_bytes(64) == 32 * 106 + 64 * 106
    assert geometry.resolve("v41-tiny-fixture") is TINY and geometry.resolve("") is V4_1_FLASH


def test_release_config_nested_under_text_config_reads_the_same() -> None:
    nested = {"architectures": ["DeepseekV41ForCausalLM"], "text_config": copy.deepcopy(V4_1_FLASH_CONFIG)}
    assert from_config(nested, name=V4_1_FLASH.name) == V4_1_FLASH
    named = {**V4_1_FLASH_CONFIG, "_name_or_path": "deepseek-v4.1-flash"}
    assert from_config(named) == V4_1_FLASH
    assert from_config(V4_1_FLASH.to_config(), name=V4_1_FLASH.name) == V4_1_FLASH


def test_row_sizes_follow_the_widths() -> None:
    g = from_config({**TINY_CONFIG, "head_dim": 256, "index_head_dim": 96}, name="w")
    assert (g.compressed_kv_row_bytes, g.indexer_row_bytes, g.window_row_bytes) == (128 + 16, 48 + 3, 256 + 8)
    assert g.block_bytes(2) == (144 + 51) * 1 + (144 + 51) * 2


def _without(field: str) -> dict[str, object]:
    config = copy.deepcopy(V4_1_FLASH_CONFIG)
    del config[field]
    return config


@pytest.mark.parametrize("field", sorted(V4_1_FLASH_CONFIG))
def test_a_missing_field_is_named(field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"lacks the field {field}"):
        from_config(_without(field), name="x")


@pytest.mark.parametrize(("change", "message"), [
    ({"head_dim": "512"}, "head_dim must be an integer"),
    ({"head_dim": 512.0}, "head_dim must be an integer"),
    ({"sliding_window": True}, "sliding_window must be an integer"),
    ({"compress_ratios": "0,0,2"}, "compress_ratios must be a list of integers"),
    ({"kv_source_layer_ids": [2, 8, 14, 20.0]}, "kv_source_layer_ids must be a list of integers"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be positive"),
    ({"num_hidden_layers": 41}, "compress_ratios has 40 entries; num_hidden_layers is 41"),
    ({"compress_ratios": [0, 0] + [2] * 18 + [1] * 19}, "compress_ratios has 39 entries"),
    ({"compress_ratios": [0, -1] + [2] * 18 + [1] * 20}, "compress_ratios must be non-negative"),
    ({"kv_source_layer_ids": [1, 8, 14, 20]}, "kv_source_layer_ids names layer 1, whose compress ratio is 0"),
    ({"kv_source_layer_ids": [8, 2, 14, 20]}, "kv_source_layer_ids must be distinct, ascending"),
    ({"kv_source_layer_ids": [2, 8, 14, 40]}, "kv_source_layer_ids must be distinct, ascending layers below 40"),
    ({"kv_source_layer_ids": []}, "kv_source_layer_ids is empty"),
    ({"kv_source_layer_ids": [2, 8, 14]}, "compress_ratios gives layer 20 ratio 1, but the source layer it reads"),
    ({"sliding_window": 0}, "sliding_window must be positive"),
    ({"head_dim": 496}, "head_dim must be a positive multiple of 32"),
    ({"index_head_dim": 112}, "index_head_dim must be a positive multiple of 32"),
    ({"qk_rope_head_dim": 520}, "qk_rope_head_dim must be between 0 and head_dim"),
])
def test_a_bad_field_is_named(change: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        from_config({**copy.deepcopy(V4_1_FLASH_CONFIG), **change}, name="x")


def test_a_bad_config_or_name_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="config must be a dict"):
        from_config([1, 2], name="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="text_config must be a dict"):
        from_config({"text_config": "x"}, name="x")
    with pytest.raises(InvalidArgument, match="config has no name"):
        from_config(V4_1_FLASH_CONFIG)
    with pytest.raises(InvalidArgument, match="name must be a non-empty string"):
        from_config(V4_1_FLASH_CONFIG, name="")
    with pytest.raises(InvalidArgument, match="head_dim must be a positive multiple of 32"):
        dataclasses.replace(V4_1_FLASH, head_dim=100)  # direct construction is checked too


def test_source_of_names_the_layer_whose_rows_a_layer_reads() -> None:
    assert [V4_1_FLASH.source_of(x) for x in (0, 1, 2, 7, 8, 19, 20, 39)] == [None, None, 2, 2, 8, 14, 20, 20]
    assert [TINY.source_of(x) for x in range(5)] == [None, 1, 1, 3, 3]
    with pytest.raises(InvalidArgument, match="no layer 40"):
        V4_1_FLASH.source_of(40)


def test_block_bytes_follow_tokens() -> None:
    assert V4_1_FLASH.block_bytes(64) == 64 * 890
    for bad in (63, 0, -2, 64.0, True):
        with pytest.raises(InvalidArgument, match="multiple of 2"):
            V4_1_FLASH.block_bytes(bad)  # type: ignore[arg-type]
    assert V4_1_FLASH.block_rows(2, 64) == 32 and V4_1_FLASH.block_rows(20, 64) == 64
    with pytest.raises(InvalidArgument, match="layer 3 is not a kv source layer"):
        V4_1_FLASH.block_rows(3, 64)


def test_layout_is_each_source_kv_rows_then_its_indexer_rows() -> None:
    sections = V4_1_FLASH.block_layout(64)
    assert [(s.layer, s.component, s.offset, s.rows, s.row_bytes) for s in sections] == [
        (2, "compressed_kv", 0, 32, 288), (2, "indexer", 9216, 32, 68),
        (8, "compressed_kv", 11392, 32, 288), (8, "indexer", 20608, 32, 68),
        (14, "compressed_kv", 22784, 32, 288), (14, "indexer", 32000, 32, 68),
        (20, "compressed_kv", 34176, 64, 288), (20, "indexer", 52608, 64, 68),
    ]
    for geo, tokens in ((V4_1_FLASH, 64), (V4_1_FLASH, 2), (TINY, 16)):
        layout = geo.block_layout(tokens)
        assert layout[0].offset == 0
        for a, b in itertools.pairwise(layout):
            assert b.offset == a.offset + a.size_bytes
        assert layout[-1].offset + layout[-1].size_bytes == geo.block_bytes(tokens)


def test_fingerprint_changes_with_every_field_and_the_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    assert V4_1_FLASH.fingerprint.hex() != OLD_FINGERPRINT  # blocks of the earlier codec never match
    assert dataclasses.replace(V4_1_FLASH).fingerprint == V4_1_FLASH.fingerprint
    longer = {"num_layers": 41, "compress_ratios": (*V4_1_FLASH.compress_ratios, 1)}
    changes: list[dict[str, object]] = [
        longer, {**longer, "kv_source_layers": (2, 8, 14, 20, 40)}, {"window": 256}, {"head_dim": 256},
        {"rope_head_dim": 32}, {"index_head_dim": 64}, {"name": "other"},
        {"compress_ratios": (0, 0, 0, 0, 0, 0, 0, 0) + (2,) * 12 + (1,) * 20, "kv_source_layers": (8, 14, 20)},
    ]
    seen = {V4_1_FLASH.fingerprint}
    for change in changes:
        seen.add(dataclasses.replace(V4_1_FLASH, **change).fingerprint)  # type: ignore[arg-type]
    assert len(seen) == len(changes) + 1
    assert TINY.fingerprint not in seen
    monkeypatch.setitem(geometry.ROW_FORMATS, "indexer", "e2m1, one float32 scale per row")
    assert from_config(V4_1_FLASH_CONFIG, name=V4_1_FLASH.name).fingerprint != V4_1_FLASH.fingerprint


def test_fingerprint_is_stable_across_processes() -> None:
    code = "from kvstore.geometry import V4_1_FLASH, TINY; print(V4_1_FLASH.fingerprint.hex(), TINY.fingerprint.hex())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [V4_1_FLASH.fingerprint.hex(), TINY.fingerprint.hex()]


def test_resolve_names_the_known_profiles() -> None:
    assert list(geometry.REGISTRY)[:2] == [V4_1_FLASH.name, TINY.name]  # then each in every engine layout
    with pytest.raises(InvalidArgument, match="unknown geometry 'nope'"):
        geometry.resolve("nope")
