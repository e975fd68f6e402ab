"""Model cache geometry, read from the model's own config.json.

A geometry is a frozen value built by `from_config` from the fields of the
model's release config (`num_hidden_layers`, `compress_ratios`,
`kv_source_layer_ids`, `sliding_window`, `head_dim`, `qk_rope_head_dim`,
`index_head_dim`). Everything that sizes bytes is derived from it:

- a compressed-KV row (FP4 E2M1 + one E4M3 scale per 16 channels) of a
  `head_dim`-wide latent is `head_dim/2 + head_dim/16` bytes (288 for 512);
- an indexer-key row (FP4 E2M1 + one UE8M0 scale per 32 channels) is
  `index_head_dim/2 + index_head_dim/32` bytes (68 for 128);
- a window (SWA) row (E4M3 + one UE8M0 scale per 32 channels) is
  `head_dim + head_dim/32` bytes (528 for 512);
- a source layer with compress ratio r writes one compressed-KV row and one
  indexer row per r tokens; the other layers read their source's rows.

A block of global KV holds, for each source layer in order, its compressed-KV
rows then its indexer rows, in position order (`block_layout`). The geometry's
fingerprint goes into every storage key, so blocks of two geometries or of two
row formats never mix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from kvstore import layout as layouts
from kvstore.errors import InvalidArgument
from kvstore.layout import MODEL_NATIVE, RecordLayout

#: The row formats this code writes. Part of the fingerprint: a change of format
#: must give new keys, so that rows of the earlier codec are never read as these.
ROW_FORMATS: dict[str, str] = {
    "compressed_kv": "e2m1 packed low-nibble-first, e4m3fn scale per 16 channels (v4.1)",
    "indexer": "e2m1 packed low-nibble-first, ue8m0 scale per 32 channels (v4.1)",
    "window": "e4m3fn, ue8m0 scale per 32 channels (v4.1)",
}

#: The config.json fields a geometry is read from, and the attribute each becomes.
CONFIG_FIELDS: dict[str, str] = {
    "num_hidden_layers": "num_layers",
    "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layers",
    "sliding_window": "window",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "index_head_dim": "index_head_dim",
}


@dataclass(frozen=True, kw_only=True)
class GlobalKVLayer:
    """A source layer: it writes compressed-KV and indexer rows, one of each per
    `tokens_per_entry` tokens (its compress ratio)."""

    layer: int
    tokens_per_entry: int
    kv_row_bytes: int
    index_row_bytes: int

    @property
    def entry_bytes(self) -> int:
        """Bytes of one compressed-KV row plus one indexer row."""
        return self.kv_row_bytes + self.index_row_bytes


@dataclass(frozen=True, kw_only=True)
class Section:
    """One contiguous run of rows inside a block: the compressed-KV or the indexer
    rows of one source layer, in position order."""

    layer: int
    component: str  # "compressed_kv" or "indexer"
    offset: int
    rows: int
    row_bytes: int

    @property
    def size_bytes(self) -> int:
        """Bytes of the section: rows x row_bytes."""
        return self.rows * self.row_bytes


@dataclass(frozen=True, kw_only=True)
class ModelGeometry:
    """The cache geometry of one model profile (build it with `from_config`).

    Attributes:
        name: profile name, as clients name it on the wire.
        num_layers: transformer layers in total (`num_hidden_layers`).
        compress_ratios: per layer, tokens per compressed row; 0 for a layer
            that keeps only its window (`compress_ratios`).
        kv_source_layers: the layers that compute compressed KV and indexer keys,
            ascending (`kv_source_layer_ids`); every other layer with a nonzero
            ratio reads the nearest source below it.
        window: sliding-window tokens every layer keeps (`sliding_window`).
        head_dim: channels of the KV latent (`head_dim`), RoPE channels included.
        rope_head_dim: RoPE channels at the end of the latent (`qk_rope_head_dim`).
        index_head_dim: channels of an indexer key (`index_head_dim`).
        records: the byte layout of its rows (kvstore.layout): the model's own by default, or an
            engine's record kept byte for byte (`with_records`); part of the fingerprint.
    """

    name: str
    num_layers: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    window: int
    head_dim: int
    rope_head_dim: int
    index_head_dim: int
    records: RecordLayout = MODEL_NATIVE

    def __post_init__(self) -> None:
        _check_geometry(self)

    # -- rows ------------------------------------------------------------------

    def row_split(self, kind: str) -> tuple[int, int]:
        """(data bytes, scale bytes) of one row of `kind` ("compressed_kv", "indexer", "window") in `records`."""
        if kind == "indexer":
            return layouts.row_sizes(self.records.indexer.encoding, self.index_head_dim)
        fmt = self.records.kv if kind == "compressed_kv" else self.records.window
        return layouts.row_sizes(fmt.encoding, self.head_dim, self.rope_head_dim)

    @property
    def compressed_kv_row_bytes(self) -> int:
        """Bytes of one compressed-KV row: head_dim/2 of E2M1 pairs + head_dim/16 E4M3 scales (model's rows)."""
        return sum(self.row_split("compressed_kv"))

    @property
    def indexer_row_bytes(self) -> int:
        """Bytes of one indexer-key row: index_head_dim/2 + index_head_dim/32 UE8M0 scales (model's rows)."""
        return sum(self.row_split("indexer"))

    @property
    def window_row_bytes(self) -> int:
        """Bytes of one window (SWA) row: head_dim E4M3 + head_dim/32 UE8M0 scales (model's rows)."""
        return sum(self.row_split("window"))

    @cached_property
    def ratio2_source_layers(self) -> tuple[int, ...]:
        """Source layers that pool token pairs (ratio 2): those with a raw tail at odd lengths."""
        return tuple(layer for layer in self.kv_source_layers if self.compress_ratios[layer] == 2)

    def source_of(self, layer: int) -> int | None:
        """The source layer whose compressed KV `layer` reads (itself for a source),
        or None for a window-only layer."""
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument(f"geometry {self.name!r}: no layer {layer} (it has {self.num_layers})")
        if self.compress_ratios[layer] == 0:
            return None
        below = [s for s in self.kv_source_layers if s <= layer]
        return below[-1] if below else None

    @cached_property
    def global_layers(self) -> tuple[GlobalKVLayer, ...]:
        """The source layers, in block order, with their ratios and row sizes."""
        return tuple(GlobalKVLayer(layer=s, tokens_per_entry=self.compress_ratios[s],
                                   kv_row_bytes=self.compressed_kv_row_bytes,
                                   index_row_bytes=self.indexer_row_bytes)
                     for s in self.kv_source_layers)

    # -- blocks ------------------------------------------------------------------

    @cached_property
    def token_alignment(self) -> int:
        """Smallest token count that holds a whole number of rows in every source layer."""
        return math.lcm(*(g.tokens_per_entry for g in self.global_layers))

    @cached_property
    def bytes_per_token(self) -> float:
        """Global KV bytes per token (890 for V4.1-Flash)."""
        return self.block_bytes(self.token_alignment) / self.token_alignment

    @cached_property
    def entries_per_token(self) -> float:
        """Compressed-KV rows written per token across source layers (2.5 for V4.1-Flash)."""
        return sum(1 / g.tokens_per_entry for g in self.global_layers)

    def block_rows(self, layer: int, block_tokens: int) -> int:
        """Rows of source layer `layer` in a block of `block_tokens` tokens (each kind)."""
        self.check_block_tokens(block_tokens)
        if layer not in self.kv_source_layers:
            raise InvalidArgument(f"geometry {self.name!r}: layer {layer} is not a kv source layer "
                                  f"(sources: {list(self.kv_source_layers)})")
        return block_tokens // self.compress_ratios[layer]

    def block_bytes(self, block_tokens: int) -> int:
        """Bytes of one block of `block_tokens` tokens.

        Raises:
            InvalidArgument: the token count does not hold whole rows.
        """
        self.check_block_tokens(block_tokens)
        return sum(g.entry_bytes * (block_tokens // g.tokens_per_entry) for g in self.global_layers)

    def check_block_tokens(self, block_tokens: object) -> None:
        """Raise InvalidArgument unless `block_tokens` is a positive multiple of the alignment."""
        if (not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens <= 0
                or block_tokens % self.token_alignment):
            raise InvalidArgument(
                f"block of {block_tokens!r} tokens does not hold whole rows of geometry "
                f"{self.name!r} (needs a positive multiple of {self.token_alignment})"
            )

    def block_layout(self, block_tokens: int) -> tuple[Section, ...]:
        """The byte layout of one block: for each source layer in order, its
        compressed-KV rows then its indexer rows, each in position order.

        For V4.1-Flash and 64 tokens: layers 2, 8, 14 hold 32 + 32 rows, layer 20
        64 + 64, 56,960 bytes in all. Rows of one kind are contiguous, so an
        engine copies them into its paged cache with one copy per run.
        """
        self.check_block_tokens(block_tokens)
        sections: list[Section] = []
        offset = 0
        for g in self.global_layers:
            rows = block_tokens // g.tokens_per_entry
            for component, row_bytes in (("compressed_kv", g.kv_row_bytes), ("indexer", g.index_row_bytes)):
                sections.append(Section(layer=g.layer, component=component, offset=offset, rows=rows,
                                        row_bytes=row_bytes))
                offset += rows * row_bytes
        return tuple(sections)

    # -- identity ---------------------------------------------------------------

    def to_config(self) -> dict[str, object]:
        """The config.json fields this geometry was read from (`from_config` takes them back)."""
        return {field: (list(v) if isinstance(v := getattr(self, attr), tuple) else v)
                for field, attr in CONFIG_FIELDS.items()}

    def to_dict(self) -> dict[str, object]:
        """A canonical, JSON-ready description (the input of the fingerprint): the
        name, the config fields and the row formats (the record layout: kvstore.layout)."""
        return {"name": self.name, "config": self.to_config(), "formats": dict(ROW_FORMATS)}

    @cached_property
    def fingerprint(self) -> bytes:
        """8 bytes identifying the geometry, its row formats and its record layout (`kvstore.layout.fingerprint`)."""
        return layouts.fingerprint(self.to_dict(), self.records)

    def with_records(self, records: RecordLayout) -> ModelGeometry:
        """This model's geometry with its rows in `records`, named `<name>+<records.name>` (itself when native)."""
        if records.native:
            return self
        return dataclasses.replace(self, name=layouts.geometry_name(self.name, records), records=records)


def _check_geometry(g: ModelGeometry) -> None:
    """Raise InvalidArgument naming the config field that makes `g` impossible."""
    def bad(field: str, why: str) -> InvalidArgument:
        return InvalidArgument(f"geometry {g.name!r}: {field} {why}")

    if not isinstance(g.name, str) or not g.name:
        raise InvalidArgument(f"geometry name must be a non-empty string, got {g.name!r}")
    for field, attr in CONFIG_FIELDS.items():
        value = getattr(g, attr)
        is_list = attr in ("compress_ratios", "kv_source_layers")
        items = value if is_list and isinstance(value, tuple) else (value,)
        if (is_list and not isinstance(value, tuple)) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in items):
            raise bad(field, f"must be {'a list of integers' if is_list else 'an integer'}, got {value!r}")
    if g.num_layers <= 0:
        raise bad("num_hidden_layers", f"must be positive, got {g.num_layers}")
    if len(g.compress_ratios) != g.num_layers:
        raise bad("compress_ratios", f"has {len(g.compress_ratios)} entries; num_hidden_layers is {g.num_layers}")
    if any(r < 0 for r in g.compress_ratios):
        raise bad("compress_ratios", f"must be non-negative, got {list(g.compress_ratios)}")
    sources = list(g.kv_source_layers)
    if not sources:
        raise bad("kv_source_layer_ids", "is empty: no layer writes global KV")
    if sources != sorted(set(sources)) or not all(0 <= s < g.num_layers for s in sources):
        raise bad("kv_source_layer_ids", f"must be distinct, ascending layers below {g.num_layers}, got {sources}")
    for s in sources:
        if g.compress_ratios[s] == 0:
            raise bad("kv_source_layer_ids", f"names layer {s}, whose compress ratio is 0 (window only)")
    for layer, ratio in enumerate(g.compress_ratios):
        below = [s for s in sources if s <= layer]
        if ratio and (not below or g.compress_ratios[below[-1]] != ratio):
            raise bad("compress_ratios", f"gives layer {layer} ratio {ratio}, but the source layer it reads "
                                         f"({below[-1] if below else 'none'}) has another ratio")
    if g.window <= 0:
        raise bad("sliding_window", f"must be positive, got {g.window}")
    if g.head_dim <= 0 or g.head_dim % 32:
        raise bad("head_dim", f"must be a positive multiple of 32 (one scale per 32 channels), got {g.head_dim}")
    if not 0 <= g.rope_head_dim <= g.head_dim:
        raise bad("qk_rope_head_dim", f"must be between 0 and head_dim ({g.head_dim}), got {g.rope_head_dim}")
    if g.index_head_dim <= 0 or g.index_head_dim % 32:
        raise bad("index_head_dim", f"must be a positive multiple of 32 (one scale per 32 channels), "
                                    f"got {g.index_head_dim}")


def from_config(config: Mapping[str, object], *, name: str | None = None) -> ModelGeometry:
    """The geometry of a model, from its config.json as a dict.

    Args:
        config: the parsed config.json. Fields are read from `config["text_config"]`
            when there is one (multimodal releases nest them), else from the top.
        name: the profile name; by default the config's `name` or `_name_or_path`.

    Raises:
        InvalidArgument: naming the field that is missing, of the wrong type, or
            inconsistent (list lengths, a source layer with ratio 0, a width that
            is not a multiple of 32, ...).
    """
    if not isinstance(config, Mapping):
        raise InvalidArgument(f"config must be a dict (the model's config.json), got {type(config).__name__}")
    fields: Mapping[str, object] = config
    if "text_config" in config:
        nested = config["text_config"]
        if not isinstance(nested, Mapping):
            raise InvalidArgument(f"config field text_config must be a dict, got {type(nested).__name__}")
        fields = {**config, **nested}
    if name is None:
        found = fields.get("name", fields.get("_name_or_path"))
        if not isinstance(found, str) or not found:
            raise InvalidArgument("config has no name (neither name nor _name_or_path): pass name=")
        name = found
    values: dict[str, object] = {}
    for field, attr in CONFIG_FIELDS.items():
        if field not in fields:
            raise InvalidArgument(f"config for {name!r} lacks the field {field}")
        value = fields[field]
        if attr in ("compress_ratios", "kv_source_layers"):
            if not isinstance(value, list | tuple):
                raise InvalidArgument(f"geometry {name!r}: {field} must be a list of integers, "
                                      f"got {type(value).__name__}")
            value = tuple(value)
        values[attr] = value
    return ModelGeometry(name=name, **values)  # type: ignore[arg-type]  # checked in __post_init__


#: DeepSeek-V4.1-Flash: the fields of the release config.json that shape its cache.
V4_1_FLASH_CONFIG: dict[str, object] = {
    "num_hidden_layers": 40,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "sliding_window": 128,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
}

#: The tiny configuration public tests use (fastllm's CPU fixture, docs/FORMAT.md):
#: 5 layers, sources 1 (ratio 2) and 3 (ratio 1), 128-wide latent, window 8.
TINY_CONFIG: dict[str, object] = {
    "num_hidden_layers": 5,
    "compress_ratios": [0, 2, 2, 1, 1],
    "kv_source_layer_ids": [1, 3],
    "sliding_window": 8,
    "head_dim": 128,
    "qk_rope_head_dim": 32,
    "index_head_dim": 64,
}

#: The default profile: 288 + 68 B per source row, 2.5 rows and 890 B per token.
V4_1_FLASH: ModelGeometry = from_config(V4_1_FLASH_CONFIG, name="deepseek-v4.1-flash")

#: The tiny fixture: 72 + 34 B per source row, 159 B per token.
TINY: ModelGeometry = from_config(TINY_CONFIG, name="v41-tiny-fixture")

#: Profiles a server knows by name, default first: the model geometries, then each in every engine
#: layout (kvstore.layout.ENGINE_LAYOUTS), whose blocks and snapshots are kept apart by their fingerprints.
REGISTRY: dict[str, ModelGeometry] = {V4_1_FLASH.name: V4_1_FLASH, TINY.name: TINY}
REGISTRY.update({g.name: g for model in (V4_1_FLASH, TINY)
                 for g in (model.with_records(r) for r in layouts.ENGINE_LAYOUTS)})


def resolve(name: str) -> ModelGeometry:
    """The registered geometry called `name` ('' means the default).

    Raises:
        InvalidArgument: no profile has that name.
    """
    if not name:
        return V4_1_FLASH
    try:
        return REGISTRY[name]
    except KeyError:
        raise InvalidArgument(f"unknown geometry {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


__all__ = [
    "CONFIG_FIELDS", "REGISTRY", "ROW_FORMATS", "TINY", "V4_1_FLASH", "GlobalKVLayer", "ModelGeometry",
    "Section", "from_config", "resolve",
]
