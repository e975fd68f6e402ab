"""Model cache geometry: which layers write global KV, how compressed, in which format.

A geometry is a frozen value. Everything that sizes bytes (block sizes, the byte
layout of a block, the SWA snapshot size) is derived from it, and its fingerprint
goes into every storage key so blocks of two layouts never mix.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property

from kvstore.errors import InvalidArgument


class ScaleFormat(str, enum.Enum):
    """How the FP4 values of one vector are scaled."""

    #: One FP8 E4M3 scale per 16 consecutive channels (NVFP4 without its
    #: second-level per-tensor scale).
    E4M3_PER_16 = "e4m3_per_16"
    #: One float32 scale for the whole vector (the indexer key).
    F32_PER_VECTOR = "f32_per_vector"


@dataclass(frozen=True, kw_only=True)
class KVComponent:
    """One vector stored per global-KV entry (main KV or indexer key), in FP4."""

    name: str
    channels: int
    scale_format: ScaleFormat

    def __post_init__(self) -> None:
        if self.channels <= 0 or self.channels % 16:
            raise InvalidArgument(f"component {self.name!r}: channels must be a positive multiple of 16")

    @property
    def value_bytes(self) -> int:
        """Bytes of packed E2M1 codes for one entry (two codes per byte)."""
        return self.channels // 2

    @property
    def scale_bytes(self) -> int:
        """Bytes of scales for one entry."""
        if self.scale_format is ScaleFormat.E4M3_PER_16:
            return self.channels // 16
        return 4

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry of this component: values plus scales."""
        return self.value_bytes + self.scale_bytes


@dataclass(frozen=True, kw_only=True)
class GlobalKVLayer:
    """A layer that writes its own global KV (a CSA2 layer in Full mode)."""

    layer: int
    tokens_per_entry: int
    components: tuple[KVComponent, ...]

    @property
    def entry_bytes(self) -> int:
        """Bytes of one entry across all components."""
        return sum(c.entry_bytes for c in self.components)


@dataclass(frozen=True, kw_only=True)
class Section:
    """One contiguous run of bytes inside a block: values or scales of one component."""

    layer: int
    component: str
    part: str  # "values" or "scales"
    offset: int
    size_bytes: int
    entries: int


@dataclass(frozen=True, kw_only=True)
class ModelGeometry:
    """The cache geometry of one model profile.

    Attributes:
        name: profile name, as clients name it on the wire.
        num_layers: transformer layers in total.
        global_layers: the layers that write global KV, ascending.
        swa_window_tokens: sliding-window length n_win.
        swa_layers: number of layers that keep SWA state.
        swa_channels: FP8 channels of SWA KV per token per layer (an assumption
            in the default profile: the sources do not give it).
    """

    name: str
    num_layers: int
    global_layers: tuple[GlobalKVLayer, ...]
    swa_window_tokens: int = 128
    swa_layers: int = 40
    swa_channels: int = 512

    def __post_init__(self) -> None:
        layers = [g.layer for g in self.global_layers]
        if layers != sorted(set(layers)) or any(not 0 <= x < self.num_layers for x in layers):
            raise InvalidArgument(f"geometry {self.name!r}: global layers must be distinct, ascending, in range")

    @cached_property
    def token_alignment(self) -> int:
        """Smallest token count that holds a whole number of entries in every layer."""
        return math.lcm(*(g.tokens_per_entry for g in self.global_layers))

    @cached_property
    def bytes_per_token(self) -> float:
        """Global KV bytes per token (890 for V4.1-Flash)."""
        return self.block_bytes(self.token_alignment) / self.token_alignment

    @cached_property
    def entries_per_token(self) -> float:
        """Global KV entries written per token across layers (2.5 for V4.1-Flash)."""
        return sum(1 / g.tokens_per_entry for g in self.global_layers)

    def block_bytes(self, block_tokens: int) -> int:
        """Bytes of one block of `block_tokens` tokens.

        Raises:
            InvalidArgument: the token count does not hold whole entries.
        """
        self.check_block_tokens(block_tokens)
        return sum(g.entry_bytes * (block_tokens // g.tokens_per_entry) for g in self.global_layers)

    def check_block_tokens(self, block_tokens: int) -> None:
        """Raise InvalidArgument unless `block_tokens` is a positive multiple of the alignment."""
        if block_tokens <= 0 or block_tokens % self.token_alignment:
            raise InvalidArgument(
                f"block of {block_tokens} tokens does not hold whole entries of geometry "
                f"{self.name!r} (needs a positive multiple of {self.token_alignment})"
            )

    def block_layout(self, block_tokens: int) -> tuple[Section, ...]:
        """The byte layout of one block: for each global layer in order, for each
        component, its values then its scales, entries in token order.

        Structure-of-arrays keeps each tensor contiguous, so a GPU dequantizer
        reads one section as one tensor with no gather.
        """
        self.check_block_tokens(block_tokens)
        sections: list[Section] = []
        offset = 0
        for g in self.global_layers:
            entries = block_tokens // g.tokens_per_entry
            for c in g.components:
                for part, per_entry in (("values", c.value_bytes), ("scales", c.scale_bytes)):
                    size = per_entry * entries
                    sections.append(
                        Section(layer=g.layer, component=c.name, part=part, offset=offset,
                                size_bytes=size, entries=entries)
                    )
                    offset += size
        return tuple(sections)

    @property
    def swa_snapshot_bytes(self) -> int:
        """Bytes of one SWA snapshot: FP8 KV of the window in every SWA layer."""
        return self.swa_layers * self.swa_window_tokens * self.swa_channels

    def to_dict(self) -> dict[str, object]:
        """A canonical, JSON-ready description (the input of the fingerprint)."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))

    @cached_property
    def fingerprint(self) -> bytes:
        """8 bytes identifying the layout: a SHA-256 of the canonical description."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(b"kvstore.geometry.v1\0" + canon).digest()[:8]


def _v4_1_flash() -> ModelGeometry:
    main = KVComponent(name="main_kv", channels=512, scale_format=ScaleFormat.E4M3_PER_16)
    index = KVComponent(name="indexer_key", channels=128, scale_format=ScaleFormat.F32_PER_VECTOR)
    comps = (main, index)
    # The sources say three encoder Full layers and the first decoder layer; they
    # do not say which encoder layers. Layers 0-1 are SWA-only, so we assume the
    # Full layers open each third of the remaining encoder: 2, 8, 14.
    encoder = tuple(GlobalKVLayer(layer=i, tokens_per_entry=2, components=comps) for i in (2, 8, 14))
    decoder = (GlobalKVLayer(layer=20, tokens_per_entry=1, components=comps),)
    return ModelGeometry(name="deepseek-v4.1-flash", num_layers=40, global_layers=encoder + decoder)


#: The default profile: 356 B per entry, 2.5 entries and 890 B per token.
V4_1_FLASH: ModelGeometry = _v4_1_flash()

#: Profiles a server knows by name, default first.
REGISTRY: dict[str, ModelGeometry] = {V4_1_FLASH.name: V4_1_FLASH}


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
