"""The codec on CUDA (fused Triton kernels, or torch.compile without Triton) is bit-identical to the CPU codec."""

from __future__ import annotations

import pytest
import torch

from kvstore.codec import block_codec, fp4, fp8
from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def make_hard(rows: int = 2048, channels: int = 512) -> torch.Tensor:
    """Wide magnitudes, exact ties, zeros, all-equal groups and overflow, on the CPU."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, channels, generator=gen) * torch.logspace(-6, 3.6, rows).unsqueeze(1)
    x[0] = 0
    x[1] = 1.7
    x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # ties at scale 1
    x[3, 0] = 6 * 1.0625  # scale tie
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_quantize_matches_cpu(dtype: torch.dtype) -> None:
    x = make_hard().to(dtype)
    for quantize in (fp4.quantize, fp4.quantize_per_vector):
        cpu_values, cpu_scales = quantize(x)
        gpu_values, gpu_scales = quantize(x.cuda())
        assert gpu_values.is_cuda
        assert same_bits(gpu_values, cpu_values) and same_bits(gpu_scales, cpu_scales)
        assert torch.equal(fp4.dequantize(gpu_values, gpu_scales).cpu(), fp4.dequantize(cpu_values, cpu_scales))


def test_fp4_stats_match_cpu() -> None:
    x = make_hard()
    assert fp4.quantize_with_stats(x.cuda())[2] == fp4.quantize_with_stats(x)[2]


def test_fp8_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(1)
    window = torch.randn(40, 128, 512, generator=gen) * torch.logspace(-8, 5, 128).view(1, -1, 1)
    window[0, 0] = 0
    cpu = fp8.encode_snapshot(V4_1_FLASH, window)
    gpu = fp8.encode_snapshot(V4_1_FLASH, window.cuda())
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(fp8.decode_snapshot(V4_1_FLASH, gpu).cpu(), fp8.decode_snapshot(V4_1_FLASH, cpu))


def test_block_codec_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(2)
    block = {g.layer: {c.name: torch.randn(64 // g.tokens_per_entry, c.channels, generator=gen).bfloat16()
                       for c in g.components} for g in V4_1_FLASH.global_layers}
    cpu = block_codec.encode_block(V4_1_FLASH, 64, block)
    on_gpu = {k: {n: t.cuda() for n, t in v.items()} for k, v in block.items()}
    gpu = block_codec.encode_block(V4_1_FLASH, 64, on_gpu)
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    decoded = block_codec.decode_block(V4_1_FLASH, 64, gpu)
    expected = block_codec.decode_block(V4_1_FLASH, 64, cpu)
    assert all(torch.equal(decoded[k][n].cpu(), expected[k][n]) for k in expected for n in expected[k])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_raises_on_gpu(bad: float) -> None:
    x = torch.ones(4, 512, device="cuda")
    x[3, 100] = bad
    for quantize in (fp4.quantize, fp4.quantize_per_vector, fp8.quantize):
        with pytest.raises(InvalidArgument, match="NaN or Inf"):
            quantize(x)


# --- Fused Triton kernels (kvstore/fp4_triton.py, kvstore/fp8_triton.py), called directly so that a
# kernel which fails to build cannot hide behind the fallback.


@pytest.fixture(scope="module")
def fp4_triton():  # type: ignore[no-untyped-def]
    return pytest.importorskip("kvstore.codec.fp4_triton")


@pytest.fixture(scope="module")
def fp8_triton():  # type: ignore[no-untyped-def]
    return pytest.importorskip("kvstore.codec.fp8_triton")


def make_adversarial(dtype: torch.dtype, channels: int = 512) -> torch.Tensor:
    """make_hard plus rows at each rule's edges, representable in dtype (f16 tops out at 65504)."""
    x = make_hard(rows=1031, channels=channels)  # 1031 rows: the last program is partly masked
    edges = torch.zeros(12, channels)
    edges[0] = -0.0  # all -0: scale 0, code 8
    edges[1, ::2] = 2688.0  # the largest storable magnitude, exactly
    edges[1, 1::2] = -2688.0
    edges[2] = 2688.0 * (1 + 2.0**-10)  # just beyond it: clipped to +-2688
    edges[3, :] = 3000.0  # overflow
    edges[4] = torch.linspace(-1e-3, 1e-3, channels)  # tiny: below the 2^-6 scale floor
    edges[5] = torch.linspace(-3e-39, 3e-39, channels)  # float32 subnormals
    edges[6, ::32] = 2.0**-8  # groups whose largest element sits on the round-to-zero threshold (2^-6 / 4) ...
    edges[6, 16::32] = 2.0**-8 * (1 + 2.0**-7)  # ... and just above it
    edges[7] = 6 * torch.tensor([1.0625, 1.1875, 416.0, 432.0, 2.0**-6, 448.0, 7 / 512, 1.0]).repeat(channels // 8)
    edges[8] = -edges[7]
    edges[9] = 1e30 if dtype != torch.float16 else 6e4  # huge (per-vector and FP8 scales follow it)
    edges[10, -1] = 3.0e38 if dtype != torch.float16 else 6.5e4
    edges[11] = torch.arange(channels) * (2.0**-9)  # FP8 subnormal steps and ties after scaling
    x = torch.cat((edges, x))
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", [512, 128, 48])
def test_triton_fp4_quantize_is_bit_identical_to_cpu(fp4_triton, dtype: torch.dtype, channels: int) -> None:
    x = make_adversarial(dtype, channels)
    values, scales, flag = fp4_triton.quantize_groups(x.cuda())
    cpu_values, cpu_scales = fp4.quantize(x)
    assert same_bits(values, cpu_values) and same_bits(scales, cpu_scales)
    assert flag.item() == 0
    values, scales, flag = fp4_triton.quantize_vectors(x.cuda())
    cpu_values, cpu_scales = fp4.quantize_per_vector(x)
    assert same_bits(values, cpu_values) and same_bits(scales, cpu_scales)
    assert flag.item() == 0


def random_fp4(rows: int, channels: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Any packed codes, any non-NaN E4M3 scale bytes (subnormal and negative too), float32 scales."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (rows, channels // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (rows, channels // 16), generator=gen, dtype=torch.uint8)
    scales |= torch.randint(0, 2, scales.shape, generator=gen, dtype=torch.uint8) << 7
    vector_scales = torch.randn(rows, 1, generator=gen) * torch.logspace(-30, 30, rows).unsqueeze(1)
    vector_scales[0] = 0
    return values, scales.view(torch.float8_e4m3fn), vector_scales


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_triton_fp4_dequantize_is_bit_identical_to_cpu(fp4_triton, dtype: torch.dtype) -> None:
    values, scales, vector_scales = random_fp4(1031, 512, seed=3)
    out = fp4_triton.dequantize_groups(values.cuda(), scales.cuda(), dtype)
    assert out.dtype == dtype and same_bits(out, fp4.dequantize(values, scales, dtype=dtype))
    out = fp4_triton.dequantize_vectors(values.cuda(), vector_scales.cuda(), dtype)
    assert out.dtype == dtype and same_bits(out, fp4.dequantize(values, vector_scales, dtype=dtype))
    values, scales = fp4.quantize(make_adversarial(torch.float32))
    assert same_bits(fp4_triton.dequantize_groups(values.cuda(), scales.cuda(), dtype),
                     fp4.dequantize(values, scales, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", [512, 16, 7])
def test_triton_fp8_is_bit_identical_to_cpu(fp8_triton, dtype: torch.dtype, channels: int) -> None:
    x = make_adversarial(dtype, 512)[:, :channels].contiguous()
    codes, scales, flag = fp8_triton.quantize_tokens(x.cuda())
    cpu_codes, cpu_scales = fp8.quantize(x)
    assert same_bits(codes, cpu_codes) and same_bits(scales, cpu_scales) and flag.item() == 0
    gen = torch.Generator().manual_seed(4)
    any_codes = torch.randint(0, 0x7F, x.shape, generator=gen, dtype=torch.uint8)
    any_codes |= torch.randint(0, 2, x.shape, generator=gen, dtype=torch.uint8) << 7
    any_codes = any_codes.view(torch.float8_e4m3fn)
    any_scales = torch.randn(x.shape[0], 1, generator=gen) * 1e3
    for c, s in ((cpu_codes, cpu_scales), (any_codes, any_scales)):
        out = fp8_triton.dequantize_tokens(c.cuda(), s.cuda(), dtype)
        assert out.dtype == dtype and same_bits(out, fp8.dequantize(c, s, dtype=dtype))


def test_cuda_calls_take_the_triton_path(fp4_triton, fp8_triton) -> None:
    x = make_adversarial(torch.bfloat16).cuda()
    fp4.dequantize(*fp4.quantize(x), dtype=torch.bfloat16)
    fp4.dequantize(*fp4.quantize_per_vector(x))
    fp8.dequantize(*fp8.quantize(x), dtype=torch.bfloat16)
    kernels = (fp4._quantize_groups, fp4._quantize_vectors, fp4._dequantize_groups, fp4._dequantize_vectors,
               fp8._quantize_tokens, fp8._dequantize_tokens)
    assert {k.name: k.mode for k in kernels} == {k.name: "triton" for k in kernels}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_triton_flags_non_finite_anywhere(fp4_triton, bad: float) -> None:
    for where in ((0, 0), (1030, 511), (517, 300)):  # first, last (in a partly masked program), middle
        x = torch.ones(1031, 512, device="cuda", dtype=torch.bfloat16)
        x[where] = bad
        for quantize in (fp4.quantize, fp4.quantize_per_vector, fp8.quantize):
            with pytest.raises(InvalidArgument, match="NaN or Inf"):
                quantize(x)
    assert fp4._quantize_groups.mode == "triton"


def test_triton_handles_more_than_2_31_elements(fp4_triton, fp8_triton) -> None:
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs 40 GiB of GPU memory")
    pattern = make_adversarial(torch.bfloat16)
    copies = 2**31 // pattern.numel() + 1  # past int32 element offsets
    x = pattern.cuda().repeat(copies, 1)
    values, scales, _ = fp4_triton.quantize_groups(x)
    cpu_values, cpu_scales = fp4.quantize(pattern)
    assert torch.equal(values.view(copies, -1), cpu_values.cuda().view(1, -1).expand(copies, -1))
    assert same_bits(scales[-len(pattern):], cpu_scales)
    out = fp4_triton.dequantize_groups(values, scales, torch.bfloat16)
    del values, scales
    expected = fp4.dequantize(cpu_values, cpu_scales, dtype=torch.bfloat16).cuda()
    assert torch.equal(out.view(copies, -1), expected.view(1, -1).expand(copies, -1))
    del out, expected
    codes, pow2, _ = fp8_triton.quantize_tokens(x)
    cpu_codes, cpu_pow2 = fp8.quantize(pattern)
    assert torch.equal(codes.view(torch.uint8).view(copies, -1),
                       cpu_codes.view(torch.uint8).cuda().view(1, -1).expand(copies, -1))
    assert same_bits(pow2[-len(pattern):], cpu_pow2)


def test_torch_compile_fallback_stays_bit_identical() -> None:
    x = make_hard().bfloat16()
    values, scales, _ = fp4._quantize_groups_torch(x.cuda())
    cpu_values, cpu_scales = fp4.quantize(x)
    assert same_bits(values, cpu_values) and same_bits(scales.to(torch.float8_e4m3fn), cpu_scales)
    out = fp4._dequantize_groups_torch(values, scales.to(torch.float8_e4m3fn), torch.bfloat16)
    assert same_bits(out, fp4.dequantize(cpu_values, cpu_scales, dtype=torch.bfloat16))
