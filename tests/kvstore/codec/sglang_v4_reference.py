"""The SGLang v4 transcode as it was before the table-driven rewrite (commit 8ab8433): the bit-for-bit reference.

kvstore/codec/sglang_v4.py now encodes and recovers rows with integer lookup tables (a few gathers over whole
batches, the same ops on every device); this is the float implementation it replaced, kept verbatim (its
public functions only) so that tests/kvstore/codec/test_sglang_v4_tables.py can check the new one against it
byte for byte on the CPU, and tests/kvstore/codec/test_sglang_v4_gpu.py on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.codec.block_codec import join_blocks, split_blocks
from kvstore.codec.fp4 import E2M1_VALUES, e2m1_codes, pack_nibbles
from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry
from kvstore.layout import SGLANG_V4

#: NoPE channels per UE8M0 scale of a V4 row (one warp of the store kernel: 32 threads x 2).
TILE = 64
#: Channels per E4M3 scale of the model's compressed-KV row.
GROUP = 16
#: The store kernel's amax floor (`fmaxf(1e-4f, abs_max)`), as float32.
AMAX_FLOOR = 1e-4
#: E4M3's largest finite magnitude (`kFP8E4M3Max` on CUDA).
E4M3_MAX = 448.0
#: Bytes of the scale field of a V4 row: one per tile, padded with zeros to 8.
_SCALE_ALIGN = 8
#: Scale byte offsets tried around the nearest one, in order of preference on a tie.
_NEIGHBOURS = (0, -1, 1)
#: Positive finite E4M3 scale bytes (2^-9 .. 448).
_SCALE_MIN, _SCALE_MAX = 0x01, 0x7E


@dataclass(frozen=True)
class RowShape:
    """Widths of one compressed-KV row: `width` channels, the last `rope` of them RoPE.

    SGLang's kernel is written for 512 = 448 + 64; the tiny test geometry (128 = 64 + 64) keeps the
    same rules. NoPE must be whole 64-channel tiles and every width whole 16-channel groups.
    """

    width: int = 512
    rope: int = 64

    def __post_init__(self) -> None:
        if self.nope <= 0 or self.nope % TILE or self.rope % GROUP:
            raise InvalidArgument(f"a V4 row needs NoPE channels in whole {TILE}-channel tiles and RoPE in whole "
                                  f"{GROUP}-channel groups, got width {self.width}, rope {self.rope}")

    @property
    def nope(self) -> int:
        """NoPE channels (E4M3 in the V4 row)."""
        return self.width - self.rope

    @property
    def tiles(self) -> int:
        """UE8M0 scales of a V4 row (one per 64 NoPE channels)."""
        return self.nope // TILE

    @property
    def v4_bytes(self) -> int:
        """Bytes of SGLang's V4 row: E4M3 NoPE, BF16 RoPE, the scales padded to 8 (584 for 512)."""
        return self.nope + 2 * self.rope + -(-self.tiles // _SCALE_ALIGN) * _SCALE_ALIGN

    @property
    def native_bytes(self) -> int:
        """Bytes of the model's compressed-KV row (288 for 512)."""
        return self.width // 2 + self.width // GROUP

    @classmethod
    def of(cls, geometry: ModelGeometry) -> RowShape:
        """The compressed-KV row of `geometry`'s model."""
        return cls(width=geometry.head_dim, rope=geometry.rope_head_dim)


#: float32 value of each 4-bit E2M1 code, and of each byte's two codes (low nibble first) as one int64 of
#: two float32s: `torch.take` on these is a plain gather, about 2x faster on the CPU than an embedding.
_CODE_VALUES = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_PAIR_VALUES = torch.tensor([(E2M1_VALUES[b & 15], E2M1_VALUES[b >> 4]) for b in range(256)],
                            dtype=torch.float32).view(torch.int64).reshape(256)
_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device not in _TABLES:
        _TABLES[device] = (_CODE_VALUES.to(device), _PAIR_VALUES.to(device))
    return _TABLES[device]


def _native_values(native: torch.Tensor, shape: RowShape) -> torch.Tensor:
    """float32 `[..., width]` values of model rows: code x E4M3 scale (docs/CODEC.md rule 5), exact."""
    pairs = torch.take(_tables(native.device)[1], native[..., :shape.width // 2].long()).view(torch.float32)
    scales = native[..., shape.width // 2:].contiguous().view(torch.float8_e4m3fn).float()
    return (pairs.unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)).flatten(-2)


def _rows(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.dim() == 0 or x.shape[-1] != width:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise InvalidArgument(f"{what}: expected a uint8 tensor [..., {width}], got {got}")
    return x


def _ue8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """`cast_to_ue8m0`: the biased exponent of positive float32 x, plus one when any mantissa bit is set."""
    bits = x.contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """2^(biased - 127) as float32 (`__uint_as_float(exp << 23)`), for biased exponents 1..254."""
    return (biased.to(torch.int32) << 23).view(torch.float32)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """`pack_fp8`: clip to +-448, then E4M3 round to nearest even; the bytes."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def store_rows(values: torch.Tensor, shape: RowShape = RowShape()) -> torch.Tensor:
    """SGLang's V4 FlashMLA store (`fused_store_flashmla_cache`) of `[..., width]` values, bit for bit.

    Args:
        values: the latent as SGLang hands it to the store (bf16; float32 is rounded to bf16 for the RoPE
            channels as the kernel's `cast<bf16x2_t>` does, and used as it is for the NoPE channels).
        shape: the row's widths.

    Returns:
        uint8 `[..., v4_bytes]` rows `[NoPE E4M3][RoPE BF16][UE8M0 per 64 NoPE][zero pad]`, on values' device.
    """
    if not isinstance(values, torch.Tensor) or values.dtype not in (torch.bfloat16, torch.float32) \
            or values.dim() == 0 or values.shape[-1] != shape.width:
        got = f"{values.dtype} {tuple(values.shape)}" if isinstance(values, torch.Tensor) else type(values).__name__
        raise InvalidArgument(f"store_rows: expected bf16 or float32 values [..., {shape.width}], got {got}")
    x = values.float()
    tiles = x[..., :shape.nope].unflatten(-1, (shape.tiles, TILE))
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    floor = torch.tensor(AMAX_FLOOR, dtype=torch.float32, device=x.device)
    exponent = _ue8m0_ceil(torch.maximum(amax, floor) / E4M3_MAX)         # fmaxf(1e-4f, amax) / 448, IEEE
    inverse = _pow2(254 - exponent)                                       # inv_scale_ue8m0: exact 2^-e
    nope = _e4m3(tiles * inverse).flatten(-2)
    rope = x[..., shape.nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    pad = shape.v4_bytes - shape.nope - 2 * shape.rope - shape.tiles
    scales = exponent.flatten(-2).to(torch.uint8)
    zeros = torch.zeros(*x.shape[:-1], pad, dtype=torch.uint8, device=x.device)
    return torch.cat((nope, rope, scales, zeros), dim=-1)


def encode_rows(native: torch.Tensor, shape: RowShape = RowShape()) -> torch.Tensor:
    """SGLang's V4 rows of the model's compressed-KV rows: the store of the FP4 row's values.

    Those values (code x E4M3 scale, at most 6 significant bits) are what SGLang's FP4 fake-quant
    hands its store, exactly, in bf16; so for a latent whose model row is `native`, this is the row
    SGLang writes. Loads use it to give a V4 engine the model's rows in its own bytes.

    Args:
        native: uint8 `[..., native_bytes]` model rows (288 B for 512 channels).

    Returns:
        uint8 `[..., v4_bytes]` (584 B), on native's device.
    """
    _rows(native, shape.native_bytes, "encode_rows")
    return store_rows(_native_values(native, shape), shape)


def _v4_values(v4: torch.Tensor, shape: RowShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A V4 row's parts: NoPE bytes [..., nope], NoPE values, RoPE bf16 bits as int16, and the tile scales
    (float32, one per NoPE channel); the values decoded exactly (E4M3 x 2^e, bf16)."""
    nope_bytes = v4[..., :shape.nope]
    rope_bits = v4[..., shape.nope:shape.nope + 2 * shape.rope].contiguous().view(torch.int16)
    start = shape.nope + 2 * shape.rope
    exps = v4[..., start:start + shape.tiles].to(torch.int32).clamp(1, 254)   # 0 / 255: never SGLang's; caught below
    tile_scale = _pow2(exps).repeat_interleave(TILE, dim=-1)
    nope = nope_bytes.contiguous().view(torch.float8_e4m3fn).float() * tile_scale
    return nope_bytes, nope, rope_bits, tile_scale


@dataclass(frozen=True)
class Recovered:
    """What `recover_rows` found.

    Attributes:
        native: uint8 `[..., native_bytes]`: the model rows found (meaningful where `exact`).
        exact: bool `[...]`: rows whose re-encoding (`encode_rows`) is the engine's row bit for bit.
        ambiguous: bool `[...]`: exact rows with a group where another tried scale also re-encodes
            exactly (a collision: HOPPER_LAYOUTS.md section 3); counted, the preference rule picks one.
    """

    native: torch.Tensor
    exact: torch.Tensor
    ambiguous: torch.Tensor


def _try(values: torch.Tensor, scale_bytes: torch.Tensor, target: torch.Tensor, inverse: torch.Tensor | None,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tried scale per group: groups `values` [g, 16] (the engine's decoded values), scale bytes [g],
    `target` the groups' E4M3 bytes under the tile scales 1/`inverse` (NoPE) or, with `inverse` None, their
    bf16 bits (RoPE). Returns the nearest codes [g, 16], whether they re-encode to `target`, their values."""
    scale = scale_bytes.to(torch.uint8).view(torch.float8_e4m3fn).float().unsqueeze(-1)
    codes = e2m1_codes(values, scale)
    decoded = torch.take(_tables(values.device)[0], codes.long()) * scale
    again = decoded.to(torch.bfloat16).view(torch.int16) if inverse is None else _e4m3(decoded * inverse)
    return codes, (again == target).all(dim=-1), decoded


def _search(values: torch.Tensor, target: torch.Tensor, inverse: torch.Tensor | None,
            alternatives: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [g, 16], scale bytes [g] and how many preimages of distinct values were seen [g], for groups of
    one kind (NoPE or RoPE: `_try`): the scale nearest amax/6 first, its neighbours where it does not
    re-encode (or, with `alternatives`, everywhere, to count collisions)."""
    amax = values.abs().amax(dim=-1)
    nearest = (amax / 6.0).clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    codes, ok, decoded = _try(values, nearest, target, inverse)
    scale = nearest.clone()
    count = ok.to(torch.int32)
    others = torch.arange(values.shape[0], device=values.device) if alternatives else (~ok).nonzero().squeeze(-1)
    for offset in _NEIGHBOURS[1:]:
        if others.numel() == 0:
            break
        tried = (nearest[others] + offset).clamp(_SCALE_MIN, _SCALE_MAX)
        c, k, d = _try(values[others], tried, target[others], None if inverse is None else inverse[others])
        distinct = (d != decoded[others]).any(dim=-1) | ~ok[others]
        count.index_add_(0, others, (k & distinct & (tried != scale[others])).to(torch.int32))
        better = k & ~ok[others]                   # taken only where nothing re-encoded yet
        idx = others[better]
        codes[idx], scale[idx], decoded[idx] = c[better], tried[better], d[better]
        ok[idx] = True
    return codes, scale, count


def recover_rows(v4: torch.Tensor, shape: RowShape = RowShape(), *, alternatives: bool = False) -> Recovered:
    """The model rows SGLang's V4 rows were written from, and which rows that is exact for.

    Per 16-channel group the E4M3 scale nearest amax/6 of the engine's values is tried first; only
    groups where it does not re-encode (or is not what the model's fake-quant gives) try its two
    neighbours (module doc: the preference rule).

    Args:
        v4: uint8 `[..., v4_bytes]` SGLang V4 compressed-KV rows (584 B), any device.
        shape: the row's widths.
        alternatives: also try the neighbours of groups that passed, to count collisions (`ambiguous`);
            off on the save path (it triples the work).

    Returns:
        `Recovered`: rows where `exact` holds re-encode to `v4` bit for bit; the others are not the
        image of any row the search found (a raw-latent FP8 row, a damaged row) and must stay SGLang's.
    """
    _rows(v4, shape.v4_bytes, "recover_rows")
    lead = v4.shape[:-1]
    flat = v4.reshape(-1, shape.v4_bytes)
    nope_bytes, nope, rope_bits, tile_scale = _v4_values(flat, shape)
    n = flat.shape[0]
    inverse = (1.0 / tile_scale).reshape(-1, GROUP)                 # exact: powers of two
    nope_codes, nope_scale, nope_count = _search(nope.reshape(-1, GROUP), nope_bytes.reshape(-1, GROUP), inverse,
                                                 alternatives)
    rope_codes, rope_scale, rope_count = _search(rope_bits.view(torch.bfloat16).float().reshape(-1, GROUP),
                                                 rope_bits.reshape(-1, GROUP), None, alternatives)
    codes = torch.cat((nope_codes.reshape(n, -1), rope_codes.reshape(n, -1)), dim=-1)
    scale = torch.cat((nope_scale.reshape(n, -1), rope_scale.reshape(n, -1)), dim=-1)
    count = torch.cat((nope_count.reshape(n, -1), rope_count.reshape(n, -1)), dim=-1)
    native = torch.cat((pack_nibbles(codes), scale.to(torch.uint8)), dim=-1)
    exact = (encode_rows(native, shape) == flat).all(dim=-1)
    ambiguous = exact & (count > 1).any(dim=-1)
    return Recovered(native=native.reshape(*lead, shape.native_bytes), exact=exact.reshape(lead),
                     ambiguous=ambiguous.reshape(lead))


@dataclass(frozen=True)
class BlockTranscode:
    """`v4_blocks_to_native`'s answer for n blocks.

    Attributes:
        native: uint8 `[n, native block_bytes]`: the blocks in the model's rows (use only where `exact`).
        exact: bool `[n]`: blocks every compressed-KV row of which re-encodes to the engine's bytes.
        rows: compressed-KV rows looked at; exact_rows: of those, exact; ambiguous_rows: exact rows with
            a collision (another tried preimage also exact).
    """

    native: torch.Tensor
    exact: torch.Tensor
    rows: int
    exact_rows: int
    ambiguous_rows: int


def engine_geometry(geometry: ModelGeometry) -> ModelGeometry:
    """The `sglang-v4` geometry of `geometry`'s model (the one its V4 blocks are stored under)."""
    return geometry.with_records(SGLANG_V4)


def _model(geometry: ModelGeometry) -> ModelGeometry:
    if geometry.records.native:
        return geometry
    if geometry.records != SGLANG_V4:
        raise InvalidArgument(f"geometry {geometry.name!r} holds {geometry.records.name} rows; only SGLang's v4 "
                              "rows transcode to the model's")
    name = geometry.name.rsplit("+", 1)[0]
    from dataclasses import replace

    from kvstore.layout import MODEL_NATIVE
    return replace(geometry, name=name, records=MODEL_NATIVE)


def v4_blocks_to_native(geometry: ModelGeometry, blocks: torch.Tensor, block_tokens: int) -> BlockTranscode:
    """Blocks of SGLang's `v4` layout as blocks of the model's rows, with which of them are exact.

    The indexer rows are the model's in both layouts (SGLang keeps its FP4 indexer) and are copied;
    every compressed-KV row goes through `recover_rows`.

    Args:
        geometry: the model's geometry (or its `+sglang-v4` one).
        blocks: uint8 `[n, v4 block_bytes]`, any device.
        block_tokens: tokens per block.
    """
    model = _model(geometry)
    engine, shape = engine_geometry(model), RowShape.of(model)
    split = split_blocks(engine, blocks, block_tokens)
    n = blocks.shape[0]
    exact = torch.ones(n, dtype=torch.bool, device=blocks.device)
    layers, rows, exact_rows, ambiguous_rows = {}, 0, 0, 0
    for layer, (kv, index) in split.items():
        found = recover_rows(kv, shape)
        exact &= found.exact.all(dim=-1)
        rows += found.exact.numel()
        exact_rows += int(found.exact.sum())
        ambiguous_rows += int(found.ambiguous.sum())
        layers[layer] = (found.native, index)
    native = join_blocks(model, layers, block_tokens)
    return BlockTranscode(native=native, exact=exact, rows=rows, exact_rows=exact_rows, ambiguous_rows=ambiguous_rows)


def native_blocks_to_v4(geometry: ModelGeometry, blocks: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Blocks of the model's rows as SGLang's `v4` blocks (`encode_rows` per compressed-KV row).

    Args:
        geometry: the model's geometry (or its `+sglang-v4` one).
        blocks: uint8 `[n, block_bytes]` of the model's rows, any device.
        block_tokens: tokens per block.

    Returns:
        uint8 `[n, v4 block_bytes]`: for a block `v4_blocks_to_native` called exact, the engine's own bytes.
    """
    model = _model(geometry)
    shape = RowShape.of(model)
    split = split_blocks(model, blocks, block_tokens)
    layers = {layer: (encode_rows(kv, shape), index) for layer, (kv, index) in split.items()}
    return join_blocks(engine_geometry(model), layers, block_tokens)


