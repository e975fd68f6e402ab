"""The reference model's configuration: the cache geometry plus the widths that do not shape the cache.

`ModelConfig.geometry` (kvstore.geometry.ModelGeometry) fixes everything the store
sees: layers, compress ratios, kv sources, window, head_dim, RoPE channels and the
indexer key width. The rest (hidden size, heads, MLP width, vocabulary, RoPE
thetas, top-k) only changes the compute. `from_config` reads both from a model's
config.json; `TINY_MODEL` is the tiny fixture of docs/FORMAT.md and `reduced_v41` keeps
V4.1-Flash's layer pattern at a reduced hidden width, for the speed figures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.geometry import TINY, V4_1_FLASH, ModelGeometry
from kvstore.geometry import from_config as geometry_from_config


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of one reference model.

    Attributes:
        geometry: the cache geometry (layers, ratios, kv sources, window, head_dim,
            RoPE channels, indexer key width).
        vocab_size: tokens in the vocabulary.
        dim: hidden size.
        n_heads: query heads; attention is latent MQA (K = V = the head_dim latent).
        index_layers: layers that run their own indexer query. A layer with a
            nonzero ratio that is not one reuses the top-k of the nearest index
            layer below it with the same kv source. Empty means the kv sources.
        index_heads: indexer query heads.
        index_topk: compressed rows each query attends to (the indexer's top-k).
        mlp_hidden: hidden width of the dense SwiGLU MLP (stands in for the MoE).
        rope_theta: RoPE base of the window KV and the window queries.
        compress_rope_theta: RoPE base of compressed rows, indexer keys and their queries.
        norm_eps: RMSNorm epsilon.
        seed: seeds the weights (the same seed gives the same bits).
        tail_prefill: decoder-side tail prefill by default (extend's switch).
    """

    geometry: ModelGeometry
    vocab_size: int = 128
    dim: int = 128
    n_heads: int = 4
    index_layers: tuple[int, ...] = ()
    index_heads: int = 2
    index_topk: int = 64
    mlp_hidden: int = 256
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    norm_eps: float = 1e-6
    seed: int = 0
    tail_prefill: bool = False

    def __post_init__(self) -> None:
        if not self.index_layers:
            object.__setattr__(self, "index_layers", tuple(self.geometry.kv_source_layers))
        object.__setattr__(self, "index_layers", tuple(int(i) for i in self.index_layers))
        _check(self)

    @property
    def num_layers(self) -> int:
        """Transformer layers (the geometry's)."""
        return self.geometry.num_layers

    @property
    def head_dim(self) -> int:
        """Channels of the KV latent and of each query head."""
        return self.geometry.head_dim

    @property
    def last_source(self) -> int:
        """The last kv source layer: decoder-side tail prefill cuts the layers above it."""
        return self.geometry.kv_source_layers[-1]

    def index_layer_of(self, layer: int) -> int | None:
        """The index layer whose top-k `layer` uses (itself for an index layer), None for window-only layers."""
        source = self.geometry.source_of(layer)
        if source is None:
            return None
        below = [i for i in self.index_layers if i <= layer and self.geometry.source_of(i) == source]
        return below[-1]  # _check guarantees one exists

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description; `from_dict` takes it back."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "geometry":
                value = {"name": value.name, **value.to_config()}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """The config `to_dict` described.

        Raises:
            InvalidArgument: a field is missing, unknown or of the wrong kind.
        """
        if not isinstance(data, Mapping) or "geometry" not in data:
            raise InvalidArgument("model config: expected a dict with a 'geometry' entry (ModelConfig.to_dict)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidArgument(f"model config: unknown fields {unknown}")
        geo = data["geometry"]
        if not isinstance(geo, Mapping):
            raise InvalidArgument("model config: 'geometry' must be a dict (name + config.json fields)")
        fields = {k: v for k, v in data.items() if k != "geometry"}
        if "index_layers" in fields:
            fields["index_layers"] = tuple(fields["index_layers"])
        try:
            return cls(geometry=geometry_from_config(dict(geo)), **fields)
        except TypeError as exc:
            raise InvalidArgument(f"model config: {exc}") from None


def _check(c: ModelConfig) -> None:
    """Raise InvalidArgument naming the field that makes `c` impossible."""
    g = c.geometry
    if not isinstance(g, ModelGeometry):
        raise InvalidArgument(f"model config: geometry must be a ModelGeometry, got {type(g).__name__}")
    for name in ("vocab_size", "dim", "n_heads", "index_heads", "index_topk", "mlp_hidden"):
        value = getattr(c, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidArgument(f"model config: {name} must be a positive integer, got {value!r}")
    if g.rope_head_dim % 2 or g.rope_head_dim > g.index_head_dim:
        raise InvalidArgument(f"model config: qk_rope_head_dim {g.rope_head_dim} must be even and at most "
                              f"index_head_dim {g.index_head_dim} (indexer keys carry RoPE on as many channels)")
    if any(not 0 <= i < g.num_layers or g.compress_ratios[i] == 0 for i in c.index_layers):
        raise InvalidArgument(f"model config: index layers {list(c.index_layers)} must be layers with a nonzero "
                              f"compress ratio")
    for layer in range(g.num_layers):
        source = g.source_of(layer)
        if source is not None and not any(i <= layer and g.source_of(i) == source for i in c.index_layers):
            raise InvalidArgument(f"model config: layer {layer} reads kv source {source} but no index layer at "
                                  f"or below it reads that source (index layers {list(c.index_layers)})")
    if c.rope_theta <= 0 or c.compress_rope_theta <= 0 or c.norm_eps <= 0:
        raise InvalidArgument("model config: rope thetas and norm_eps must be positive")


#: config.json field -> ModelConfig attribute, for the fields beside the geometry.
CONFIG_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_attention_heads": "n_heads",
    "index_layer_ids": "index_layers",
    "index_n_heads": "index_heads",
    "index_topk": "index_topk",
    "intermediate_size": "mlp_hidden",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "rms_norm_eps": "norm_eps",
}


def from_config(config: Mapping[str, object], **overrides: Any) -> ModelConfig:
    """A model config from a config.json dict (geometry via kvstore.geometry.from_config).

    Args:
        config: the parsed config.json (fields under `text_config` win, as for the geometry).
        **overrides: ModelConfig fields that replace what the config says (e.g. seed, dim);
            `name` names the geometry when the config has neither name nor _name_or_path.

    Raises:
        InvalidArgument: a missing or inconsistent geometry field, or a bad value.
    """
    name = overrides.pop("name", None)
    geometry = overrides.pop("geometry", None) or geometry_from_config(config, name=name)
    fields: Mapping[str, object] = config
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        fields = {**config, **nested}
    values: dict[str, Any] = {}
    for key, attr in CONFIG_FIELDS.items():
        if key in fields:
            value = fields[key]
            values[attr] = tuple(value) if isinstance(value, list | tuple) else value  # type: ignore[arg-type]
    values.update(overrides)
    try:
        return ModelConfig(geometry=geometry, **values)
    except TypeError as exc:
        raise InvalidArgument(f"model config: {exc}") from None


#: docs/FORMAT.md's tiny fixture: vocab 128, dim 128, 5 layers, ratios (0,2,2,1,1), kv sources (1,3),
#: index layers (1,3,4), head_dim 128 with 32 RoPE, window 8, 4 heads, indexer 2 heads x 64, top-k 64.
TINY_MODEL: ModelConfig = ModelConfig(geometry=TINY, vocab_size=128, dim=128, n_heads=4, index_layers=(1, 3, 4),
                                      index_heads=2, index_topk=64, mlp_hidden=256)


def reduced_v41(dim: int = 512, n_heads: int = 4, **kw: Any) -> ModelConfig:
    """V4.1-Flash's layer pattern and cache geometry at a reduced hidden width.

    40 layers, window 128, head_dim 512 (64 RoPE), indexer keys 128 wide, kv sources
    2/8/14/20 (ratios 2, 2, 2, 1): the cache is byte for byte V4.1-Flash's; only the
    hidden size, heads and MLP are small. For the speed figures.

    Args:
        dim: hidden size.
        n_heads: query heads.
        **kw: other ModelConfig fields (index_topk defaults to 512, V4.1's; mlp_hidden to 2 x dim).
    """
    kw.setdefault("index_topk", 512)
    kw.setdefault("index_heads", 4)
    kw.setdefault("mlp_hidden", 2 * dim)
    kw.setdefault("vocab_size", 1024)
    return ModelConfig(geometry=V4_1_FLASH, dim=dim, n_heads=n_heads, **kw)


#: The V4.1-shaped model trained for a fidelity table (issue 30 item 3, docs/REPLAY.md): V4.1-Flash's 40
#: layers, layer pattern, kv sources and 128-token window (its cache geometry exactly), at hidden width 256
#: with 2 query heads, a 512-wide MLP and the byte vocabulary of the training corpus (replay/corpus.py:
#: ASCII, 128 ids). The width is what fits two trainings of a few minutes on one H200; the window and
#: depth, which decide how far a bounded replay's error reaches, are V4.1's.
REDUCED_V41_D256: ModelConfig = reduced_v41(dim=256, n_heads=2, mlp_hidden=512, vocab_size=128)

#: Reference-model configurations by name: what `scripts/train_tiny.py --config` trains and
#: `kvstore bench replay --model` measures; a fidelity table is written as replay/fidelity/<name>.json.
NAMED_CONFIGS: dict[str, ModelConfig] = {"tiny": TINY_MODEL, "reduced_v41-d256": REDUCED_V41_D256}


def named_config(name: str) -> ModelConfig:
    """The configuration `NAMED_CONFIGS` calls `name`.

    Raises:
        InvalidArgument: no configuration has that name (the message lists them).
    """
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise InvalidArgument(f"unknown model config {name!r}; known: {', '.join(NAMED_CONFIGS)}") from None


__all__ = ["CONFIG_FIELDS", "NAMED_CONFIGS", "REDUCED_V41_D256", "TINY_MODEL", "ModelConfig", "from_config",
           "named_config", "reduced_v41"]
