"""ModelConfig: the tiny fixture, config.json reading, the JSON round trip, refusals."""

from __future__ import annotations

import json

import pytest

from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY, TINY_CONFIG, V4_1_FLASH
from replay.model.config import TINY_MODEL, ModelConfig, from_config, reduced_v41


def test_tiny_model_is_the_v41_fixture() -> None:
    """docs/FORMAT.md's tiny fixture: vocab 128, dim 128, 4 heads, index layers (1, 3, 4), 2 x 64 indexer, top-k 64."""
    c = TINY_MODEL
    assert c.geometry == TINY and (c.vocab_size, c.dim, c.n_heads) == (128, 128, 4)
    assert c.index_layers == (1, 3, 4) and (c.index_heads, c.index_topk) == (2, 64)
    assert [c.index_layer_of(layer) for layer in range(5)] == [None, 1, 1, 3, 4]


def test_index_layers_default_to_the_kv_sources() -> None:
    """Without index layers every layer reads its source's top-k (V4.1: 2, 8, 14, 20)."""
    c = reduced_v41()
    assert c.index_layers == (2, 8, 14, 20) and c.geometry == V4_1_FLASH and c.dim == 512
    assert c.index_layer_of(39) == 20 and c.index_layer_of(5) == 2 and c.index_layer_of(1) is None


def test_from_config_reads_config_json_fields() -> None:
    """Geometry fields via kvstore.geometry.from_config, the rest by their config.json names."""
    raw = {**TINY_CONFIG, "name": TINY.name, "vocab_size": 64, "hidden_size": 96, "num_attention_heads": 2,
           "index_layer_ids": [1, 3], "index_n_heads": 4, "index_topk": 16, "intermediate_size": 128,
           "rope_theta": 5e4, "compress_rope_theta": 1e6, "rms_norm_eps": 1e-5}
    c = from_config(raw, seed=3)
    assert (c.vocab_size, c.dim, c.n_heads, c.index_layers, c.index_heads, c.index_topk) == (64, 96, 2, (1, 3), 4, 16)
    assert (c.mlp_hidden, c.rope_theta, c.compress_rope_theta, c.norm_eps, c.seed) == (128, 5e4, 1e6, 1e-5, 3)
    assert from_config({**TINY_CONFIG, "name": TINY.name}).index_layers == (1, 3)
    assert from_config(TINY_CONFIG, name="unnamed").geometry.name == "unnamed"


def test_json_round_trip() -> None:
    """to_dict is JSON-ready and from_dict takes it back equal."""
    for c in (TINY_MODEL, reduced_v41(dim=256, tail_prefill=True)):
        assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_refusals_name_the_field() -> None:
    """An index layer on a window-only layer, a layer with no index layer for its source, a bad width."""
    with pytest.raises(InvalidArgument, match="index layers"):
        ModelConfig(geometry=TINY, index_layers=(0, 1, 3))
    with pytest.raises(InvalidArgument, match="no index layer"):
        ModelConfig(geometry=TINY, index_layers=(1,))
    with pytest.raises(InvalidArgument, match="dim"):
        ModelConfig(geometry=TINY, dim=0)
    with pytest.raises(InvalidArgument, match="unknown"):
        ModelConfig.from_dict({**TINY_MODEL.to_dict(), "bogus": 1})
