"""The engines' own Triton write kernels for their V4 rows, vendored verbatim, and a torch port of vLLM's.

The GPU machine has no engine installed (no network there), so the kernels the engines run on an H200 to
write their Hopper rows are copied here, unchanged, from the pinned wheels (../shared/HOPPER_LAYOUTS.md):

- SGLang 0.5.23 `sglang/kernels/ops/attention/dsv4/fp4_rope_fake_quant.py`: `rope_tail_fake_quant_fp4_row`
  and `_rope_tail_fake_quant_fp4_kernel`, step 1 of its compressed-KV write (RoPE on the tail, FP4
  fake-quant, one E4M3 scale per 16); `rope_tail_fake_quant_fp4` below is its launcher, trimmed to the
  compressed-KV call `_rope_fq4(latent, freqs, 64, compressed_kv=True)` makes. Step 2, the V4 store, is CUDA
  JIT (tvm-ffi + nvcc) and is kvstore's bit-exact port `kvstore.codec.sglang_v4.store_rows`.
- vLLM 0.33.0 `vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py`: `_rope_quant_insert_kernel`,
  the `fp8_ds_mla` 584-B insert of a compressed-KV latent (`rope_quant_insert` with a 584-wide uint8 cache);
  `rope_quant_insert_584` below is its launcher.

tests/integrations/test_engine_kernels.py checks that the kernel text here is the installed engines' text
(CPU, where the lean installs are there). Both engines are Apache-2.0 licensed.

`vllm_insert_584` is a torch port of vLLM's kernel, on CPU and CUDA tensors alike: the CPU oracle for its
rows (tested in CI against the documented byte layout; on the GPU, byte for byte against the kernel).
"""

# ruff: noqa: N803 -- the vendored kernels keep the engines' own argument names, verbatim
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

#: `sglang.kernels.ops.quantization.fp4_fake_quant.FP4_AMAX_FLOOR` (0.5.23).
FP4_AMAX_FLOOR = 6 * 2.0**-126
#: vLLM's `_ON_GFX950` on CUDA.
_ON_GFX950 = False


@triton.jit
def rope_tail_fake_quant_fp4_row(
    x_row_ptr,
    f_row_ptr,
    D: tl.constexpr,
    RD: tl.constexpr,
    BLK: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    INVERSE: tl.constexpr,
    COMPRESSED_KV: tl.constexpr,
):
    """One row of rope_tail_fake_quant_fp4 as an fp32 [D] vector: x_row_ptr points
    at the row, f_row_ptr at the token's [RD // 2, 2] real view of the complex freqs."""
    offs = tl.arange(0, D)
    v = tl.load(x_row_ptr + offs).to(tl.float32)

    # ---- rope_tail: adjacent pairs of the last RD features as one complex number
    head_len = D - RD
    in_tail = offs >= head_len
    pos = offs - head_len
    j = pos // 2
    is_im = (pos % 2) == 1
    re = tl.load(x_row_ptr + head_len + 2 * j, mask=in_tail, other=0.0).to(tl.float32)
    im = tl.load(x_row_ptr + head_len + 2 * j + 1, mask=in_tail, other=0.0).to(
        tl.float32
    )
    # freqs is a real/imag-interleaved view: stride 2 between complex pairs.
    fr = tl.load(f_row_ptr + 2 * j, mask=in_tail, other=1.0)
    fi = tl.load(f_row_ptr + 2 * j + 1, mask=in_tail, other=0.0)
    if INVERSE:
        fi = -fi
    rot = tl.where(is_im, re * fi + im * fr, re * fr - im * fi)
    # rope_tail casts the rotated tail back to x.dtype before the cat; the head
    # never leaves it. Reproduce that rounding or the quant sees different input.
    rot = rot.to(tl.bfloat16).to(tl.float32)
    v = tl.where(in_tail, rot, v)

    # ---- FP4 round-trip, with a separate scale format for compressed KV.
    vb = tl.reshape(v, (D // BLK, BLK))
    amax = tl.max(tl.abs(vb), axis=1)
    if COMPRESSED_KV:
        scale = tl.minimum(tl.maximum(amax * (1.0 / 6.0), 2.0**-9), 448.0)
        scale = scale.to(tl.float8e4nv).to(tl.float32)
        s = tl.div_rn(vb, scale[:, None])
    else:
        amax = tl.maximum(amax, AMAX_FLOOR) * (1.0 / 6.0)
        # ceil_pow2 on the IEEE bits, exact at powers of two
        bits = amax.to(tl.int32, bitcast=True)
        expo = ((bits >> 23) & 0xFF) - 127
        expo = expo + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = ((expo + 127) << 23).to(tl.float32, bitcast=True)
        s = vb / scale[:, None]
    s = tl.minimum(tl.maximum(s, -6.0), 6.0)
    mag = tl.abs(s)
    step = tl.where(mag < 2.0, 0.5, tl.where(mag < 4.0, 1.0, 2.0))
    # torch.round is round-half-to-even; torch.sign(0) is 0
    sgn = tl.where(s > 0, 1.0, tl.where(s < 0, -1.0, 0.0))
    q = libdevice.rint(mag / step) * step * sgn
    return tl.reshape(q * scale[:, None], (D,))


@triton.jit
def _rope_tail_fake_quant_fp4_kernel(
    x_ptr,
    f_ptr,
    pos_ptr,
    out_ptr,
    x_stride_r,
    out_stride_r,
    f_stride_t,
    rows_per_token,
    num_pos,
    D: tl.constexpr,
    RD: tl.constexpr,
    BLK: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    INVERSE: tl.constexpr,
    COMPRESSED_KV: tl.constexpr,
    HAS_POS: tl.constexpr,
):
    r = tl.program_id(0)
    t = r // rows_per_token
    if HAS_POS:
        # freqs is the whole table: row t reads its position's entry (the freqs[positions] gather folded in)
        t = tl.load(pos_ptr + t).to(tl.int64)
        # the caller owns positions < num_pos; an out-of-range row reads entry 0 instead of past the table
        t = tl.where((t >= 0) & (t < num_pos), t, 0)
    out = rope_tail_fake_quant_fp4_row(
        x_ptr + r * x_stride_r,
        f_ptr + t * f_stride_t,
        D=D,
        RD=RD,
        BLK=BLK,
        AMAX_FLOOR=AMAX_FLOOR,
        INVERSE=INVERSE,
        COMPRESSED_KV=COMPRESSED_KV,
    )
    tl.store(
        out_ptr + r * out_stride_r + tl.arange(0, D), out.to(out_ptr.dtype.element_ty)
    )


@triton.jit
def _rope_quant_insert_kernel(
    latent,
    positions,
    cos_sin,
    cache,
    cache_slots,
    COS_STRIDE: tl.constexpr,
    CACHE_STRIDE: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    COMPRESS_RATIO: tl.constexpr,
    SANITIZE_CACHE_NANS: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(cache_slots + t)
    if slot < 0:
        return
    position = tl.load(positions + t)
    if (position + 1) % COMPRESS_RATIO != 0:
        return
    d = tl.arange(0, 512)
    normed = tl.load(latent + t.to(tl.int64) * 512 + d).to(tl.float32)
    page = cache + (slot // CACHE_BLOCK).to(tl.int64) * CACHE_STRIDE
    values = page + (slot % CACHE_BLOCK) * 576
    scales = page + CACHE_BLOCK * 576 + (slot % CACHE_BLOCK) * 8

    quant = tl.reshape(normed, (8, 64))
    amax = tl.maximum(tl.max(tl.abs(quant), 1), 1e-4)
    exponent = tl.ceil(tl.log2(amax * (1.0 / 448.0)))
    scaled = quant * tl.reshape(tl.exp2(-exponent), (8, 1))
    fp8 = tl.clamp(scaled, -448.0, 448.0).to(tl.float8e4nv)
    packed = tl.reshape(fp8.to(tl.uint8, bitcast=True), (512,))
    tl.store(values + d, packed, d < 448)
    s = tl.arange(0, 8)
    max_encoded: tl.constexpr = 254.0 if SANITIZE_CACHE_NANS else 255.0
    encoded = tl.minimum(tl.maximum(exponent + 127.0, 0.0), max_encoded)
    tl.store(scales + s, encoded.to(tl.uint8), s < 7)
    tl.store(scales + 7, tl.full((), 0, tl.uint8))

    even, odd = tl.split(tl.reshape(normed, (256, 2)))
    pair = tl.arange(0, 256) - 224
    cs = cos_sin + (position // COMPRESS_RATIO * COMPRESS_RATIO) * COS_STRIDE
    c = tl.load(cs + tl.maximum(pair, 0), pair >= 0, other=1.0).to(tl.float32)
    s = tl.load(cs + 32 + tl.maximum(pair, 0), pair >= 0, other=0.0).to(tl.float32)
    rotated = tl.interleave(even * c - odd * s, odd * c + even * s)
    if SANITIZE_CACHE_NANS:
        rotated = tl.where(rotated == rotated, rotated, 0.0)
    rope_dst = (values + 448).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_dst + d - 448, rotated.to(tl.bfloat16), d >= 448)



def rope_tail_fake_quant_fp4(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int = 64) -> torch.Tensor:
    """SGLang's `rope_tail_fake_quant_fp4(x, freqs, rope_dim, compressed_kv=True)` (CUDA): x bf16 [T, 512],
    freqs complex [T, rope_dim // 2]; the latent its V4 store receives (bf16 q x s)."""
    x = x.contiguous()
    d = x.shape[-1]
    out = torch.empty_like(x)
    f_real = torch.view_as_real(freqs.contiguous()).contiguous()
    _rope_tail_fake_quant_fp4_kernel[(x.shape[0],)](
        x, f_real, f_real, out, x.stride(0), d, f_real.stride(0), 1, f_real.shape[0],
        D=d, RD=rope_dim, BLK=16, AMAX_FLOOR=FP4_AMAX_FLOOR, INVERSE=False, COMPRESSED_KV=True, HAS_POS=False,
        num_warps=4)
    return out


def rope_quant_insert_584(latent: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          kv_cache: torch.Tensor, slot_mapping: torch.Tensor, compress_ratio: int) -> None:
    """vLLM's `rope_quant_insert` for a 584-wide uint8 paged cache `[blocks, block_slots, 584]` (CUDA)."""
    assert kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == 584 and latent.is_contiguous()
    _rope_quant_insert_kernel[(slot_mapping.numel(),)](
        latent, positions, cos_sin_cache, kv_cache, slot_mapping, COS_STRIDE=cos_sin_cache.stride(0),
        CACHE_STRIDE=kv_cache.stride(0), CACHE_BLOCK=kv_cache.shape[1], COMPRESS_RATIO=compress_ratio,
        SANITIZE_CACHE_NANS=_ON_GFX950, num_warps=4)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a x b + c rounded once (what Triton's default fp contraction makes of `a * b + c`): the product is
    exact in float64, the sum rounded to float64 then float32 (a double rounding only on a float64 tie)."""
    return (a.double() * b.double() + c.double()).float()


def vllm_insert_584(latent: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, compress_ratio: int, *,
                    contract: bool = True) -> None:
    """`_rope_quant_insert_kernel` in torch, on any device.

    Per token t with slot >= 0 at a group end ((position + 1) % ratio == 0), from its bf16 latent as float32:
    per 64 channels (8 tiles, the last the RoPE channels) amax = max(max |x|, 1e-4), exponent =
    ceil(log2(amax * fl(1/448))), E4M3 of x x 2^-exponent clamped to +-448, the first 448 kept; scale bytes
    clamp(exponent + 127, 0, 255) for tiles 0-6 and a zero; RoPE (GPT-J pairs of channels 448..511) at
    position `pos // ratio * ratio` of `cos_sin_cache` ([positions, 64]: 32 cos then 32 sin), stored as bf16.
    Data at byte `slot % block * 576` of page `slot // block`, the 8 scale bytes at `block * 576 + slot % block
    * 8`. `contract`: the rotation's a*c - b*s as one fused multiply-add, as Triton compiles it by default.
    For bf16 latents amax x fl(1/448) is a power of two exactly or far from one, so torch's log2 and the GPU's
    approximate one agree on the ceiling.
    """
    t = slot_mapping.numel()
    slots = slot_mapping.long()
    pos = positions[:t].long()
    keep = (slots >= 0) & ((pos + 1) % compress_ratio == 0)
    x = latent[:t].float()
    tiles = x.view(t, 8, 64)
    amax = torch.maximum(tiles.abs().amax(dim=-1), torch.tensor(1e-4, dtype=torch.float32, device=x.device))
    exponent = torch.ceil(torch.log2(amax * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=x.device)))
    scaled = tiles * torch.exp2(-exponent).unsqueeze(-1)
    fp8 = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).view(t, 512)[:, :448]
    encoded = (exponent + 127.0).clamp(0.0, 255.0).to(torch.uint8)[:, :7]
    even, odd = x[:, 448::2], x[:, 449::2]
    cs = cos_sin_cache[pos // compress_ratio * compress_ratio].float()
    c, s = cs[:, :32], cs[:, 32:64]
    if contract:
        re = _fma(even, c, -(odd * s))
        im = _fma(odd, c, even * s)
    else:
        re, im = even * c - odd * s, odd * c + even * s
    rope = torch.stack((re, im), dim=-1).reshape(t, 64).to(torch.bfloat16).view(torch.uint8)
    block = kv_cache.shape[1]
    pages = kv_cache.view(kv_cache.shape[0], -1)
    rows = keep.nonzero().flatten()
    page, off = slots[rows] // block, slots[rows] % block
    data = torch.cat((fp8[rows], rope[rows]), dim=-1)                                    # [k, 576]
    scales = torch.cat((encoded[rows], torch.zeros(len(rows), 1, dtype=torch.uint8, device=x.device)), dim=-1)
    cols = torch.arange(576, device=x.device)
    pages[page.unsqueeze(-1), (off * 576).unsqueeze(-1) + cols] = data
    cols = torch.arange(8, device=x.device)
    pages[page.unsqueeze(-1), (block * 576 + off * 8).unsqueeze(-1) + cols] = scales
