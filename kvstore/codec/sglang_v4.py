"""SGLang's `v4` compressed-KV rows <-> the model's rows, where that is exact (issue 27 item 3).

SGLang 0.5.23 with its default `SGLANG_DSV4_KV_LAYOUT=v4` writes a compressed-KV row in two steps
(`deepseek_v4_backend._low_ratio_write_group`, off the fused SM100 kernels):

1. `_rope_fq4(latent, compressed_kv=True)`: RoPE on the last 64 channels, then the FP4 fake-quantization
   of all 512 channels with one E4M3 scale per 16 (`rope_tail_fake_quant_fp4`, or on the CPU its
   torch twin `fake_quant_compressed_kv`). The output, bf16, is q x s for E2M1 codes q and E4M3
   scales s: exactly the values of the model's own 288-B row (docs/CODEC.md) of that latent.
2. `fused_store_cache(type="flashmla", layout=V4)` (`kernels/jit/csrc/deepseek_v4/store.cuh`,
   `fused_store_flashmla_cache`): per 64 NoPE channels (one warp) `scale = ue8m0(max(1e-4f, amax) / 448)`
   (the power of two at or above, on the bits: `fp8_utils.cuh` `cast_to_ue8m0`), E4M3 of x x 2^-e,
   clipped to +-448, round to nearest even (`pack_fp8`, `__nv_fp8x2_e4m3` satfinite); the 64 RoPE
   channels copied as bf16 at byte 448; the 7 scale bytes after the 576 data bytes, the 8th (pad)
   never written (zero).

So the 584-B row is a pure function of the model's row: `encode_rows` is that function (`store_rows`
being a bit-exact torch port of step 2, on CPU and CUDA tensors alike). The other way is not a
function in general (HOPPER_LAYOUTS.md section 3: distinct FP4 rows can store the same bytes, and
a row that is not the image of an FP4 row, such as vLLM's FP8 of the raw latent, has no preimage):
`recover_rows` finds a preimage candidate per 16-channel group and calls a row exact only when
`encode_rows` of what it found gives back the engine's 584 bytes bit for bit. Only such rows may be
stored as the model's rows (`v4_blocks_to_native`); any other row stays in SGLang's layout.

Choice of the preimage (where several exist): per group, the E4M3 scale nearest amax/6 of the
engine's decoded values, with the E2M1 codes nearest the values under it; where that does not
re-encode to the group's bytes, its lower then its upper neighbour (the 584-B row moves a group's amax
by at most 1/16 of itself, so the scale SGLang used is one of the three). Where two of them re-encode
(a collision: the 584 bytes do not say which FP4 row they came from), the first in that order is kept
and the row is counted `ambiguous` when asked (`alternatives`).

On CUDA tensors the public functions first run the Triton kernels of kvstore/codec/sglang_v4_triton.py
(through `fp4.CudaKernel`: imported on the first CUDA call, the same bytes, one pass per direction); the
torch code below runs on other devices, for an input a kernel declines, when triton cannot be imported,
after a kernel has raised once (logged), and where the caller asks for it (`fused=False`: the eager
gathers; `fused=True`: the compiled kernels). `kernel_modes()` says which path the last CUDA calls took.

Client side (the SGLang backend); the server never imports it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kvstore.codec.block_codec import block_grid, join_blocks, split_blocks
from kvstore.codec.fp4 import E2M1_VALUES, CudaKernel, e2m1_codes, pack_nibbles
from kvstore.errors import InvalidArgument
from kvstore.geometry import ModelGeometry
from kvstore.layout import SGLANG_V4

logger = logging.getLogger(__name__)

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


def _tile_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The store kernel's scale exponent of tiles of float32 `amax` (>= 0 or NaN): `cast_to_ue8m0(fmaxf(1e-4f,
    amax) / 448)` with IEEE division, on the bits (int32, as `_ue8m0_ceil` of the quotient).

    Integer-exact on every device: CUDA divides a tensor by a scalar as a multiply by its reciprocal (not
    the correctly rounded quotient), which moves the ceiling where amax is near 448 x 2^k. For m = max(1e-4,
    amax) the quotient rounds to at most 2^k exactly when m <= 448 x 2^k x (1 + 2^-24), and the only float32
    in that range's last step is 448 x 2^k = 1.75 x 2^(k+8) itself; so the exponent is m's biased exponent
    less 8, plus one where m's mantissa is above 1.75's (0x600000). Inf and NaN keep the quotient's
    (255, 256), as `_ue8m0_ceil(inf or NaN / 448)` gives.
    """
    m = torch.maximum(amax, torch.tensor(AMAX_FLOOR, dtype=torch.float32, device=amax.device))
    bits = m.contiguous().view(torch.int32)
    biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    finite = biased - 8 + (mantissa > 0x600000).to(torch.int32)
    return torch.where(biased == 0xFF, 0xFF + (mantissa != 0).to(torch.int32), finite)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """2^(biased - 127) as float32 (`__uint_as_float(exp << 23)`), for biased exponents 1..254."""
    return (biased.to(torch.int32) << 23).view(torch.float32)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """`pack_fp8`: clip to +-448, then E4M3 round to nearest even; the bytes."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


#: The CPU's bf16 of every float32 NaN (0xFFFF: torch's vectorized cast, what the float reference gives), as
#: int16 bits; CUDA's `__float2bfloat16` gives 0x7FFF.
_BF16_NAN = torch.tensor(-1, dtype=torch.int16)


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
    exponent = _tile_exponent(amax)                                       # fmaxf(1e-4f, amax) / 448, IEEE
    inverse = _pow2(254 - exponent)                                       # inv_scale_ue8m0: exact 2^-e
    # NaNs as the CPU gives them on every device: CUDA's multiply returns a canonical (positive) NaN where
    # the CPU's keeps the operand's sign (E4M3 0xFF vs 0x7F), and its bf16 cast 0x7FFF where the CPU's 0xFFFF.
    nope = _e4m3(torch.where(tiles.isnan(), tiles, tiles * inverse)).flatten(-2)
    rope_x = x[..., shape.nope:]
    rope = torch.where(rope_x.isnan(), _BF16_NAN.to(x.device), rope_x.to(torch.bfloat16).view(torch.int16))
    rope = rope.contiguous().view(torch.uint8)
    pad = shape.v4_bytes - shape.nope - 2 * shape.rope - shape.tiles
    scales = exponent.flatten(-2).to(torch.uint8)
    zeros = torch.zeros(*x.shape[:-1], pad, dtype=torch.uint8, device=x.device)
    return torch.cat((nope, rope, scales, zeros), dim=-1)


# -- the load transcode: model rows -> V4 rows, by tables -------------------------------------------------
#
# A model row's values are code x E4M3 scale, so everything `store_rows` computes from them is a function of
# bytes: a NoPE group's largest value of its largest code magnitude (the low three bits of a nibble; E2M1
# magnitudes are ordered as their codes) and its scale byte; a tile's exponent, being a monotone function of
# its amax (IEEE max, division by 448, the ceiling to a power of two), the largest of its groups' exponents;
# an output byte pair, of the group's scale byte, the tile's exponent and the input byte. `store_rows`'s math
# is run once on every such combination (`_EncodeTables`), and encoding is then integer gathers only: the
# same ops, so the same bytes, on every device, with no float rounding left to a device or a compiler. The
# tile exponents a model row can have are few (105..130, and 256 for a NaN scale): they are indexed densely.


@dataclass(frozen=True)
class _EncodeTables:
    """`store_rows`'s results on every input combination, on one device.

    Attributes:
        group_key: uint8 [8 * 256]: (largest code magnitude m, scale byte s) -> the dense index of the group's
            tile exponent (`ue8m0(max(1e-4, value(m) x |s|) / 448)`), ordered as the exponents.
        key_exponent: uint8 [keys]: dense index -> the scale byte written (the exponent's low byte).
        nope_pairs: int16 [keys * 256 * 256]: (key, s, input byte) -> the two E4M3 bytes of its two codes.
        rope_pairs: int32 [256 * 256]: (s, input byte) -> the two BF16 values of its two codes.
    """

    group_key: torch.Tensor
    key_exponent: torch.Tensor
    nope_pairs: torch.Tensor
    rope_pairs: torch.Tensor


_ENCODE: dict[torch.device, _EncodeTables] = {}


def _scale_floats() -> torch.Tensor:
    """float32 value of each of the 256 E4M3 scale bytes (NaN for 0x7F and 0xFF)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _build_encode_tables() -> _EncodeTables:
    s = _scale_floats()
    # Group exponents, exactly as `store_rows` takes a tile's: |code value x scale| (exact), the floor, / 448.
    amax = (_CODE_VALUES[:8, None] * s[None, :]).abs()                              # [m, s]
    exponent = _tile_exponent(amax).flatten()
    exponents = torch.unique(exponent)                                              # sorted: keys keep the order
    if exponents.numel() > 255:
        raise AssertionError("more tile exponents than a uint8 key holds")
    group_key = torch.searchsorted(exponents, exponent).to(torch.uint8)
    # Output byte pairs: `store_rows`'s `_e4m3(values * inverse)` with inverse = 2^-(exponent - 127).
    inverse = _pow2(254 - exponents)                                                # [keys]
    byte = torch.arange(256)
    lo, hi = _CODE_VALUES[byte & 15], _CODE_VALUES[byte >> 4]                       # [256] each
    values = torch.stack((lo, hi), dim=-1)[None, :, :] * s[:, None, None]           # [s, byte, 2]
    pairs = _e4m3(values[None] * inverse[:, None, None, None])                      # [keys, s, byte, 2]
    rope = values.to(torch.bfloat16).contiguous().view(torch.int32)                 # [s, byte, 1]
    return _EncodeTables(group_key=group_key, key_exponent=exponents.to(torch.uint8),
                         nope_pairs=pairs.contiguous().view(torch.int16).flatten(),
                         rope_pairs=rope.flatten())


def _encode_tables(device: torch.device) -> _EncodeTables:
    if device not in _ENCODE:
        cpu = _ENCODE.get(torch.device("cpu")) or _build_encode_tables()
        _ENCODE[torch.device("cpu")] = cpu
        _ENCODE[device] = _EncodeTables(*(t.to(device) for t in (cpu.group_key, cpu.key_exponent, cpu.nope_pairs,
                                                                cpu.rope_pairs)))
    return _ENCODE[device]


def _as_int16(x: torch.Tensor) -> torch.Tensor | None:
    """An int16 view of uint8 rows `x` (a view of an output), or None where its offsets or widths are odd."""
    if x.shape[-1] % 2 or x.storage_offset() % 2 or any(st % 2 for st in x.stride()[:-1]) or x.stride(-1) != 1:
        return None
    return x.view(torch.int16)


def _encode_into(native: torch.Tensor, out: torch.Tensor, shape: RowShape) -> None:
    """Write the V4 rows of model rows `native` [..., native_bytes] into `out` [..., v4_bytes] (views allowed):
    a handful of integer ops and three gathers over the whole batch (module notes above)."""
    t = _encode_tables(native.device)
    lead = native.shape[:-1]
    half_nope, half = shape.nope // 2, shape.width // 2
    groups = shape.nope // GROUP
    codes = native[..., :half_nope].unflatten(-1, (groups, GROUP // 2))                 # [..., g, 8] bytes
    scales = native[..., half:half + shape.width // GROUP]
    nope_scales = scales[..., :groups]
    # The tile exponent key: the largest of its groups', each from its largest code magnitude and scale.
    magnitude = torch.maximum(codes & 7, (codes >> 4) & 7).amax(dim=-1)                 # [..., g]
    group = t.group_key.index_select(0, ((magnitude.to(torch.int32) << 8) | nope_scales).flatten())
    key = group.view(*lead, shape.tiles, TILE // GROUP).amax(dim=-1)                    # [..., tiles]
    base = ((key.repeat_interleave(TILE // GROUP, dim=-1).to(torch.int32) << 8) | nope_scales) << 8
    nope = t.nope_pairs.index_select(0, (base.unsqueeze(-1) + codes).flatten())         # int16: 2 E4M3 bytes
    rope_codes = native[..., half_nope:half].unflatten(-1, (shape.rope // GROUP, GROUP // 2))
    rope_index = (scales[..., groups:].to(torch.int32) << 8).unsqueeze(-1) + rope_codes
    rope = t.rope_pairs.index_select(0, rope_index.flatten())                           # int32: 2 BF16 values
    start = shape.nope + 2 * shape.rope
    wide = _as_int16(out[..., :start])
    if wide is not None:
        wide[..., :half_nope].copy_(nope.view(*lead, half_nope))
        wide[..., half_nope:].copy_(rope.view(torch.int16).view(*lead, shape.rope))
    else:
        out[..., :shape.nope].copy_(nope.view(torch.uint8).view(*lead, shape.nope))
        out[..., shape.nope:start].copy_(rope.view(torch.uint8).view(*lead, 2 * shape.rope))
    out[..., start:start + shape.tiles].copy_(t.key_exponent.index_select(0, key.flatten().to(torch.int32))
                                              .view(*lead, shape.tiles))
    out[..., start + shape.tiles:].zero_()


def _encode_torch(native: torch.Tensor, shape: RowShape) -> torch.Tensor:
    """`encode_rows` by the torch gathers (any device), into new memory."""
    out = torch.empty(*native.shape[:-1], shape.v4_bytes, dtype=torch.uint8, device=native.device)
    if native.numel():
        _encode_into(native, out, shape)
    return out


# -- the same, fused: one compiled kernel over whole blocks (CUDA) ----------------------------------------
#
# Eager, the gathers above each go through memory (int32 indices, int16 results, then a copy into the
# block): about 12x the bytes a block moves. Over whole blocks the same integer math, one output byte per
# element (`_ByteTables`), compiles (torch.compile, inductor) into kernels that read the model-rows blocks
# once and write the v4 blocks once. Integer ops and table loads only: the compiler has no rounding to
# choose, so its bytes are the eager path's (checked by tests/kvstore/codec/test_sglang_v4_tables.py on
# the CPU and tests/kvstore/codec/test_sglang_v4_gpu.py on CUDA).


@dataclass(frozen=True)
class _ByteTables:
    """Per-output-byte tables: `nope` uint8 [keys * 256 * 16] ((key, s, code) -> E4M3 byte), `rope` uint8
    [256 * 16 * 2] ((s, code, half) -> a BF16 byte), with `_EncodeTables`' group_key and key_exponent."""

    group_key: torch.Tensor
    key_exponent: torch.Tensor
    nope: torch.Tensor
    rope: torch.Tensor


_BYTES: dict[torch.device, _ByteTables] = {}


def _byte_tables(device: torch.device) -> _ByteTables:
    if device not in _BYTES:
        t = _encode_tables(torch.device("cpu"))
        keys = t.key_exponent.numel()
        pairs = t.nope_pairs.view(torch.uint8).view(keys, 256, 256, 2)          # [key, s, byte, lo/hi]
        nope = pairs[:, :, :16, 0]                                               # byte b < 16: low nibble b
        rope = t.rope_pairs.view(torch.uint8).view(256, 256, 4)[:, :16, :2]      # its low code's two bytes
        cpu = _ByteTables(t.group_key, t.key_exponent, nope.contiguous().flatten(), rope.contiguous().flatten())
        _BYTES[device] = _ByteTables(*(x.to(device) for x in (cpu.group_key, cpu.key_exponent, cpu.nope,
                                                                cpu.rope)))
    return _BYTES[device]


def _fused_rows(kv: torch.Tensor, t: _ByteTables, shape: RowShape) -> torch.Tensor:
    """V4 rows uint8 [m, v4_bytes] of model rows [m, native_bytes]: `_encode_into`'s math, one byte per element."""
    m = kv.shape[0]
    half, groups, per = shape.width // 2, shape.nope // GROUP, GROUP
    rope_groups = shape.rope // GROUP
    packed = kv[:, :half]
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(m, shape.width)     # one code per channel
    nope_codes = codes[:, :shape.nope].reshape(m, groups, per)
    scales = kv[:, half:half + groups].to(torch.int32)
    magnitude = (nope_codes & 7).amax(dim=-1).to(torch.int32)
    key = t.group_key[(magnitude << 8) | scales].reshape(m, shape.tiles, TILE // per).amax(dim=-1)
    base = ((key.to(torch.int32).repeat_interleave(TILE // per, dim=-1) << 8) | scales) << 4
    nope = t.nope[(base.unsqueeze(-1) + nope_codes.to(torch.int32)).reshape(m, shape.nope)]
    rope_scales = kv[:, half + groups:half + groups + rope_groups].to(torch.int32)
    rope_codes = codes[:, shape.nope:].reshape(m, rope_groups, per).to(torch.int32)
    rope_index = ((rope_scales << 5).unsqueeze(-1) + (rope_codes << 1)).unsqueeze(-1) \
        + torch.arange(2, dtype=torch.int32, device=kv.device)
    rope = t.rope[rope_index.reshape(m, 2 * shape.rope)]
    exponents = t.key_exponent[key.to(torch.int32)]
    pad = torch.zeros(m, shape.v4_bytes - shape.nope - 2 * shape.rope - shape.tiles, dtype=torch.uint8,
                      device=kv.device)
    return torch.cat((nope, rope, exponents, pad), dim=-1)


def _fused_blocks(blocks: torch.Tensor, t: _ByteTables, model: ModelGeometry, block_tokens: int) -> torch.Tensor:
    """`native_blocks_to_v4` as one function of whole blocks (what torch.compile fuses)."""
    n, shape = blocks.shape[0], RowShape.of(model)
    parts = []
    for s in model.block_layout(block_tokens):
        section = blocks[:, s.offset:s.offset + s.size_bytes]
        if s.component == "compressed_kv":
            parts.append(_fused_rows(section.reshape(n * s.rows, s.row_bytes), t, shape).reshape(n, -1))
        else:
            parts.append(section)
    return torch.cat(parts, dim=-1)


_COMPILED: dict[tuple[str, int, str], object] = {}


def compile_enabled() -> bool:
    """Whether CUDA transcodes compile their whole-block kernels: only with `KVSTORE_V4_COMPILE=1`.

    Off by default: on an H200 the first compiled calls took minutes (inductor, per geometry and kind),
    a stall a serving engine's first save or load must not take, against an eager path of the same bytes
    (docs/ENGINES.md). Read on every call that has no compiled function yet, so the variable is honoured
    whenever it is set before the first transcode of a geometry.
    """
    return os.environ.get("KVSTORE_V4_COMPILE", "0") == "1"


def _compiled(model: ModelGeometry, block_tokens: int, kind: str = "load"):  # type: ignore[no-untyped-def]
    """The compiled `_fused_blocks` ("load") or `_fused_recover_blocks` ("save") of a geometry, or None where
    compiling is off (`compile_enabled`), torch.compile is not there, or it failed once."""
    key = (model.fingerprint.hex(), block_tokens, kind)
    if key not in _COMPILED:
        from functools import partial
        fn = _fused_blocks if kind == "load" else _fused_recover_blocks
        if not compile_enabled():
            return None                   # not cached: setting the variable later still turns it on
        try:
            _COMPILED[key] = torch.compile(partial(fn, model=model, block_tokens=block_tokens), dynamic=True)
        except Exception:  # no inductor here: the eager path
            _COMPILED[key] = None
    return _COMPILED[key]


def encode_rows(native: torch.Tensor, shape: RowShape = RowShape(), *, out: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """SGLang's V4 rows of the model's compressed-KV rows: the store of the FP4 row's values.

    Those values (code x E4M3 scale, at most 6 significant bits) are what SGLang's FP4 fake-quant
    hands its store, exactly, in bf16; so for a latent whose model row is `native`, this is the row
    SGLang writes (`store_rows` of the row's values, bit for bit, for every input byte: by tables of
    `store_rows`'s own results, module notes). Loads use it to give a V4 engine the model's rows in its
    own bytes.

    Args:
        native: uint8 `[..., native_bytes]` model rows (288 B for 512 channels), any device, views allowed.
        out: where to write, uint8 `[..., v4_bytes]` of native's leading shape on its device (a view of
            a larger tensor, such as a block's section, is fine); new memory if None.

    Returns:
        uint8 `[..., v4_bytes]` (584 B), on native's device: `out` when given.
    """
    _rows(native, shape.native_bytes, "encode_rows")
    if out is None:
        out = torch.empty(*native.shape[:-1], shape.v4_bytes, dtype=torch.uint8, device=native.device)
    elif out.dtype != torch.uint8 or out.shape != (*native.shape[:-1], shape.v4_bytes) \
            or out.device != native.device:
        raise InvalidArgument(f"encode_rows out: expected uint8 {(*native.shape[:-1], shape.v4_bytes)} on "
                              f"{native.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if native.numel() and not (native.is_cuda and _TRITON_ROWS(native, shape, out) is not None):
        _encode_into(native, out, shape)
    return out


def _declined(*args: object) -> None:
    """The Triton kernels' fallback: nothing, so the caller goes on to the torch path."""
    return None


#: The Triton kernels (kvstore/codec/sglang_v4_triton.py) on CUDA tensors; each returns None where it declines.
_TRITON_ROWS = CudaKernel("sglang_v4_triton", "encode_rows", _declined)
_TRITON_BLOCKS = CudaKernel("sglang_v4_triton", "native_blocks_to_v4", _declined)
_TRITON_RECOVER = CudaKernel("sglang_v4_triton", "recover_rows", _declined)
_TRITON_SAVE = CudaKernel("sglang_v4_triton", "v4_blocks_to_native", _declined)


def kernel_modes() -> dict[str, str]:
    """The path each Triton-backed step took on its last CUDA call ("triton", "eager", with why triton
    failed where it did, or "not run")."""
    return {k.name.rsplit(".", 1)[1]: k.mode for k in (_TRITON_ROWS, _TRITON_BLOCKS, _TRITON_RECOVER, _TRITON_SAVE)}


# -- the save transcode: V4 rows -> model rows, by tables ---------------------------------------------------
#
# The search (`recover_rows`' doc) looks at one 16-channel group at a time, and everything it computes is a
# function of bytes: a NoPE group's values are its E4M3 bytes under its tile's exponent byte (clamped to
# 1..254), a RoPE group's its BF16 bits; its amax is the value of its largest magnitude byte (E4M3 and BF16
# magnitudes are ordered as their bits, NaN above all, as torch's amax propagates it); the scale tried
# first is a function of that (`near`); and under a tried scale byte (one of 1..127 or 0xFF: `_slot`) each
# element's nearest code and whether it re-encodes to its byte are a function of (exponent, scale, byte) or
# (scale, bits) (`nope` / `rope`). The float search is run once over every such combination and the
# recovery is gathers and integer logic over whole batches: no per-group Python, no data-dependent
# indexing (all three scales are tried everywhere and the preference rule applied with masks), so no host
# round trip, and the same bytes on every device (tests/kvstore/codec/test_sglang_v4_tables.py).

#: Scale-byte slots of the tried scales: bytes 0..127 as themselves, 0xFF (a NaN amax's nearest) as 128.
_SLOTS = 129


@dataclass(frozen=True)
class _RecoverTables:
    """The float search's results on every input combination, on one device.

    Attributes:
        nope_near: uint8 [255 * 128]: (tile exponent byte, largest magnitude byte) -> the nearest scale byte.
        rope_near: uint8 [32768]: largest BF16 magnitude bits -> the nearest scale byte.
        nope: uint8 [255 * _SLOTS * 256]: (exponent, scale slot, E4M3 byte) -> nearest code | 16 if it does not
            re-encode to that byte.
        rope: uint8 [_SLOTS * 65536]: (scale slot, BF16 bits) -> the same.
        decoded: float32 [_SLOTS * 16]: (scale slot, code) -> code value x scale (the search's `decoded`).
    """

    nope_near: torch.Tensor
    rope_near: torch.Tensor
    nope: torch.Tensor
    rope: torch.Tensor
    decoded: torch.Tensor


_RECOVER: dict[torch.device, _RecoverTables] = {}


def _nearest(amax: torch.Tensor) -> torch.Tensor:
    """The search's first scale byte for groups of largest magnitude `amax`: E4M3 of amax/6 in [2^-9, 448]."""
    return (amax / 6.0).clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _slot_scales() -> torch.Tensor:
    """float32 scale of each slot (`_SLOTS`)."""
    return torch.cat((torch.arange(128), torch.tensor([255]))).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _outcome(values: torch.Tensor, scale: torch.Tensor, target: torch.Tensor, inverse: torch.Tensor | None,
             ) -> torch.Tensor:
    """Per element, the search's `_try`: nearest code of `values` under `scale`, | 16 where its re-encoding
    (E4M3 under `inverse`, or BF16 with None) is not `target`."""
    codes = e2m1_codes(values, scale)
    decoded = torch.take(_CODE_VALUES.to(values.device), codes.long()) * scale
    again = decoded.to(torch.bfloat16).view(torch.int16) if inverse is None else _e4m3(decoded * inverse)
    return codes | ((again != target).to(torch.uint8) << 4)


def _build_recover_tables() -> _RecoverTables:
    """The tables, computed on the CPU by the float search's own ops (those of the reference it replaced).

    Only ever on the CPU (`_recover_tables` copies them to other devices): the same float ops on CUDA give
    other bits (a tensor divided by a scalar is a multiply by its reciprocal there, so amax / 6 moves the
    nearest scale; NaNs come out without their sign), which made the save recover other rows on an H200.
    """
    device = torch.device("cpu")
    exps = torch.arange(1, 255, dtype=torch.int32, device=device)                       # clamped exponent bytes
    tile = _pow2(exps)                                                                  # [254]
    e4m3 = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).view(torch.float8_e4m3fn).float()
    nope_near = torch.zeros(255, 128, dtype=torch.uint8, device=device)
    nope_near[1:] = _nearest((e4m3[None, :128] * tile[:, None]).abs())
    bits = torch.arange(32768, dtype=torch.int32, device=device).to(torch.int16)
    rope_near = _nearest(bits.view(torch.bfloat16).float().abs())
    scales = _slot_scales().to(device)
    target = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    values = (e4m3[None, None, :] * tile[:, None, None]).expand(-1, _SLOTS, -1).contiguous()   # [exp, slot, b]
    nope = torch.zeros(255, _SLOTS, 256, dtype=torch.uint8, device=device)
    nope[1:] = _outcome(values, scales[None, :, None], target, (1.0 / tile)[:, None, None])
    del values
    all_bits = torch.arange(65536, dtype=torch.int32, device=device).to(torch.int16)
    rope = _outcome(all_bits.view(torch.bfloat16).float().expand(_SLOTS, 65536).contiguous(), scales[:, None],
                    all_bits, None)
    decoded = _CODE_VALUES.to(device)[None, :] * scales[:, None]
    return _RecoverTables(nope_near=nope_near.flatten(), rope_near=rope_near, nope=nope.flatten(),
                          rope=rope.flatten(), decoded=decoded.flatten())


def _recover_tables(device: torch.device) -> _RecoverTables:
    """The save's tables on `device`: built once on the CPU, then copied (the device only gathers)."""
    if device not in _RECOVER:
        cpu = _RECOVER.get(torch.device("cpu")) or _build_recover_tables()
        _RECOVER[torch.device("cpu")] = cpu
        _RECOVER[device] = _RecoverTables(*(x.to(device) for x in (cpu.nope_near, cpu.rope_near, cpu.nope,
                                                                    cpu.rope, cpu.decoded)))
    return _RECOVER[device]


def _slot(scale: torch.Tensor) -> torch.Tensor:
    """int32 slot of scale bytes (int32 in 0..127 or 255)."""
    return torch.where(scale > 127, 128, scale)


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


def _search(base: torch.Tensor, target: torch.Tensor, near: torch.Tensor, table: torch.Tensor, stride: int,
            decoded: torch.Tensor, alternatives: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [g, 16], scale bytes [g] and how many preimages of distinct values were seen [g], for groups of
    one kind: `near` the scale tried first (int32 [g]), then its neighbours (clamped to 1..126), where it
    does not re-encode (or, with `alternatives`, everywhere, to count collisions). `table[base + slot *
    stride + target]` is an element's outcome (`_outcome`) under a scale slot; `decoded` the values table."""
    def attempt(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        index = (base + _slot(scale) * stride).unsqueeze(-1) + target
        got = table.index_select(0, index.flatten()).view(target.shape)
        codes = got & 15
        values = decoded.index_select(0, ((_slot(scale) << 4).unsqueeze(-1) + codes).flatten()).view(target.shape)
        return codes, (got < 16).all(dim=-1), values

    codes, ok, values = attempt(near)
    scale = near
    count = ok.to(torch.int32)
    tried_here = torch.ones_like(ok) if alternatives else ~ok          # the groups the neighbours are tried on
    for offset in _NEIGHBOURS[1:]:
        tried = (near + offset).clamp(_SCALE_MIN, _SCALE_MAX)
        c, k, v = attempt(tried)
        k = k & tried_here
        distinct = (v != values).any(dim=-1) | ~ok
        count = count + (k & distinct & (tried != scale)).to(torch.int32)
        better = k & ~ok                           # taken only where nothing re-encoded yet
        codes = torch.where(better.unsqueeze(-1), c, codes)
        values = torch.where(better.unsqueeze(-1), v, values)
        scale = torch.where(better, tried, scale)
        ok = ok | better
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
    found = _TRITON_RECOVER(v4, shape, alternatives) if v4.is_cuda and v4.numel() else None
    if found is not None:
        return Recovered(native=found[0], exact=found[1], ambiguous=found[2])
    return _recover_torch(v4, shape, alternatives)


def _recover_torch(v4: torch.Tensor, shape: RowShape, alternatives: bool) -> Recovered:
    """`recover_rows` by the torch gathers (any device)."""
    lead = v4.shape[:-1]
    native, exact, ambiguous = _recover(v4.reshape(-1, shape.v4_bytes), _recover_tables(v4.device), None, shape,
                                        alternatives)
    return Recovered(native=native.reshape(*lead, shape.native_bytes), exact=exact.reshape(lead),
                     ambiguous=ambiguous.reshape(lead))


def _recover(flat: torch.Tensor, t: _RecoverTables, encode: _ByteTables | None, shape: RowShape,
             alternatives: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`recover_rows` of rows [n, v4_bytes]: (native [n, native_bytes], exact [n], ambiguous [n]); the final
    re-encoding by `encode_rows`, or with `encode` by `_fused_rows` (the same bytes; the compiled path's)."""
    n, groups, rope_groups = flat.shape[0], shape.nope // GROUP, shape.rope // GROUP
    start = shape.nope + 2 * shape.rope
    nope_bytes = flat[:, :shape.nope].reshape(n, groups, GROUP)                            # [n, g, 16]
    exps = flat[:, start:start + shape.tiles].to(torch.int32).clamp(1, 254)                # [n, tiles]
    exps = exps.repeat_interleave(TILE // GROUP, dim=-1)                                   # per group
    largest = (nope_bytes & 0x7F).amax(dim=-1).to(torch.int32)
    near = t.nope_near[(exps << 7) | largest].to(torch.int32)
    nope_codes, nope_scale, nope_count = _search(exps * (_SLOTS * 256), nope_bytes, near, t.nope, 256, t.decoded,
                                                 alternatives)
    rope = flat[:, shape.nope:start].reshape(n, rope_groups, GROUP, 2).to(torch.int32)
    rope_target = rope[..., 0] | (rope[..., 1] << 8)                                       # BF16 bits, unsigned
    largest = (rope_target & 0x7FFF).amax(dim=-1)
    near = t.rope_near[largest].to(torch.int32)
    rope_codes, rope_scale, rope_count = _search(torch.zeros_like(near), rope_target, near, t.rope, 65536,
                                                 t.decoded, alternatives)
    codes = torch.cat((nope_codes.reshape(n, -1), rope_codes.reshape(n, -1)), dim=-1)
    scale = torch.cat((nope_scale, rope_scale), dim=-1)
    count = torch.cat((nope_count, rope_count), dim=-1)
    native = torch.cat((pack_nibbles(codes), scale.to(torch.uint8)), dim=-1)
    again = _encode_torch(native, shape) if encode is None else _fused_rows(native, encode, shape)
    exact = (again == flat).all(dim=-1)
    ambiguous = exact & (count > 1).any(dim=-1)
    return native, exact, ambiguous


def _fused_recover_blocks(blocks: torch.Tensor, t: _RecoverTables, encode: _ByteTables, model: ModelGeometry,
                          block_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`v4_blocks_to_native` as one function of whole blocks (what torch.compile fuses): the model-rows
    blocks, exact [n], and int64 [3] (rows, exact rows, ambiguous rows)."""
    n, shape = blocks.shape[0], RowShape.of(model)
    engine = engine_geometry(model)
    parts, exact = [], torch.ones(n, dtype=torch.bool, device=blocks.device)
    counts = torch.zeros(3, dtype=torch.int64, device=blocks.device)
    for s in engine.block_layout(block_tokens):
        section = blocks[:, s.offset:s.offset + s.size_bytes]
        if s.component == "compressed_kv":
            native, ok, ambiguous = _recover(section.reshape(n * s.rows, s.row_bytes), t, encode, shape, False)
            parts.append(native.reshape(n, -1))
            exact = exact & ok.reshape(n, s.rows).all(dim=-1)
            counts = counts + torch.stack((torch.ones_like(ok).sum(), ok.sum(), ambiguous.sum()))
        else:
            parts.append(section)
    return torch.cat(parts, dim=-1), exact, counts


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


def v4_blocks_to_native(geometry: ModelGeometry, blocks: torch.Tensor, block_tokens: int, *,
                        fused: bool | None = None) -> BlockTranscode:
    """Blocks of SGLang's `v4` layout as blocks of the model's rows, with which of them are exact.

    The indexer rows are the model's in both layouts (SGLang keeps its FP4 indexer) and are copied;
    every compressed-KV row goes through `recover_rows`.

    Args:
        geometry: the model's geometry (or its `+sglang-v4` one).
        blocks: uint8 `[n, v4 block_bytes]`, any device.
        block_tokens: tokens per block.
        fused: None: on CUDA the Triton kernel (one launch), else the compiled kernels where
            `compile_enabled()`, else the eager gathers; True: the compiled kernels; False: the eager gathers.
    """
    model = _model(geometry)
    engine, shape = engine_geometry(model), RowShape.of(model)
    blocks = block_grid(engine, blocks, block_tokens)         # the checks, on every path
    n = blocks.shape[0]
    if fused is None and blocks.is_cuda and n:
        found = _TRITON_SAVE(blocks, model, block_tokens)     # no per-layer views, as the load
        if found is not None:
            native, exact, counts = found
            rows, exact_rows, ambiguous_rows = counts.tolist()                  # the call's one host sync
            return BlockTranscode(native=native, exact=exact, rows=rows, exact_rows=exact_rows,
                                  ambiguous_rows=ambiguous_rows)
    if fused is None:
        fused = blocks.is_cuda and _compiled(model, block_tokens, "save") is not None
    if fused and n:
        fn = _compiled(model, block_tokens, "save")
        if fn is not None:
            try:
                native, exact, counts = fn(blocks, _recover_tables(blocks.device), _byte_tables(blocks.device))
                rows, exact_rows, ambiguous_rows = counts.tolist()              # the call's one host sync
                return BlockTranscode(native=native, exact=exact, rows=rows, exact_rows=exact_rows,
                                      ambiguous_rows=ambiguous_rows)
            except Exception as exc:  # inductor missing or failing: the eager path, same bytes
                logger.warning("kvstore: compiled v4 save transcode unavailable (%s); using the eager gathers", exc)
                _COMPILED[(model.fingerprint.hex(), block_tokens, "save")] = None
    split = split_blocks(engine, blocks, block_tokens)
    exact = torch.ones(n, dtype=torch.bool, device=blocks.device)
    layers, counts = {}, []
    for layer, (kv, index) in split.items():
        found = _recover_torch(kv, shape, False)
        exact &= found.exact.all(dim=-1)
        counts.append(torch.stack((found.exact.sum(), found.ambiguous.sum())))
        layers[layer] = (found.native, index)
    rows = sum(kv.shape[0] * kv.shape[1] for kv, _ in split.values())
    native = join_blocks(model, layers, block_tokens)
    exact_rows, ambiguous_rows = torch.stack(counts).sum(dim=0).tolist() if counts else (0, 0)   # one host sync
    return BlockTranscode(native=native, exact=exact, rows=rows, exact_rows=exact_rows,
                          ambiguous_rows=ambiguous_rows)


def native_blocks_to_v4(geometry: ModelGeometry, blocks: torch.Tensor, block_tokens: int, *,
                        fused: bool | None = None) -> torch.Tensor:
    """Blocks of the model's rows as SGLang's `v4` blocks (`encode_rows` per compressed-KV row).

    Args:
        geometry: the model's geometry (or its `+sglang-v4` one).
        blocks: uint8 `[n, block_bytes]` of the model's rows, any device.
        block_tokens: tokens per block.
        fused: True: the compiled whole-block kernels (`_fused_blocks`, module notes); False: the eager
            gathers; None: on CUDA the Triton kernel (one launch), else the compiled kernels where
            `compile_enabled()` and torch.compile works (a failure is logged once and the eager gathers are
            used from then on), else the eager gathers.

    Returns:
        uint8 `[n, v4 block_bytes]`: for a block `v4_blocks_to_native` called exact, the engine's own bytes
        (the same on either path, every device).
    """
    model = _model(geometry)
    shape, engine = RowShape.of(model), engine_geometry(model)
    grid = block_grid(model, blocks, block_tokens)            # the checks, on every path
    if fused is None and grid.is_cuda and grid.shape[0]:
        out = _TRITON_BLOCKS(grid, model, block_tokens)        # no per-layer views: 0.4 ms of a 1M-token load
        if out is not None:
            return out  # type: ignore[no-any-return]
    split = split_blocks(model, grid, block_tokens)
    if fused is None:
        fused = grid.is_cuda and _compiled(model, block_tokens) is not None
    if fused and grid.shape[0]:
        fn = _compiled(model, block_tokens)
        if fn is not None:
            try:
                return fn(grid, _byte_tables(grid.device))  # type: ignore[no-any-return,operator]
            except Exception as exc:  # inductor missing or failing: the eager path, same bytes
                logger.warning("kvstore: compiled v4 transcode unavailable (%s); using the eager gathers", exc)
                _COMPILED[(model.fingerprint.hex(), block_tokens, "load")] = None
    out = torch.empty(grid.shape[0], engine.block_bytes(block_tokens), dtype=torch.uint8, device=grid.device)
    for layer, (kv_out, index_out) in split_blocks(engine, out, block_tokens).items():   # views of out
        kv, index = split[layer]
        if kv.numel():
            _encode_into(kv, kv_out, shape)
        index_out.copy_(index)
    return out


__all__ = ["AMAX_FLOOR", "GROUP", "TILE", "BlockTranscode", "Recovered", "RowShape", "compile_enabled",
           "encode_rows", "engine_geometry", "kernel_modes", "native_blocks_to_v4", "recover_rows", "store_rows",
           "v4_blocks_to_native"]
