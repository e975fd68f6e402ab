"""The codec on CUDA (fused by torch.compile) is bit-identical to the CPU codec."""

from __future__ import annotations

import pytest
import torch

from kvstore import block_codec, fp4, fp8
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
