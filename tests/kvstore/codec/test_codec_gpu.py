"""The row codec on CUDA (kvstore/codec/rows_triton.py) is bit-identical to the CPU path (rows.py).

The kernels are called directly where a kernel that fails to build must not hide
behind the torch fallback, and through rows.py to check the routing. CUDA tests
skip without a device; the last two tests run on CPU.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from kvstore.codec import rows
from kvstore.errors import InvalidArgument

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
gpu = [pytest.mark.gpu, needs_cuda]

#: name -> (CPU encoder, kernel name, CPU decoder, decode kernel name, group channels, widths tested)
FORMATS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str, Callable[..., torch.Tensor], str, int,
                         tuple[int, ...]]] = {
    "compressed_kv": (rows.compressed_kv_rows, "compressed_kv_rows", rows.decode_compressed_kv_rows,
                      "decode_compressed_kv_rows", 16, (512, 128, 48, 16)),
    "indexer_key": (rows.indexer_key_rows, "indexer_key_rows", rows.decode_indexer_key_rows,
                    "decode_indexer_key_rows", 32, (128, 64, 96)),
    "swa": (rows.swa_rows, "swa_rows", rows.decode_swa_rows, "decode_swa_rows", 32, (512, 128, 96, 32)),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# bf16 FP4 rows by each kernel: lanes (the default) with and without its inline PTX, general, pairs. The lanes
# kernel's scales once went through Triton's float8e4nv converts, whose float32 values were wrong in 46% of the
# groups on the H200 (Triton 3.6); it now calls the GPU's cvt itself (rows_triton.e4m3_code_cvt).
@pytest.fixture(params=[(None, "lanes", None), (False, "lanes", False), (None, "lanes", False), (None, "general", None),
                        (None, "pairs", None)],
                ids=["fp8-auto", "fp8-on-bits", "fp8-auto-bf16-lanes-no-ptx", "fp8-auto-bf16-general",
                     "fp8-auto-bf16-pairs"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """rows_triton, with its E4M3 conversions as chosen for the GPU (the H200's own instructions)
    and done on the bits (what GPUs before compute capability 8.9 run); bf16 rows by the lanes kernel (with
    and without inline PTX), the general and the pairs kernel."""
    module = pytest.importorskip("kvstore.codec.rows_triton")
    monkeypatch.setattr(module, "HW_FP8", request.param[0])
    monkeypatch.setattr(module, "BF16_KERNEL", request.param[1])
    monkeypatch.setattr(module, "LANES_PTX", request.param[2])
    return module


def tiled(values: list[float], d: int) -> torch.Tensor:
    """`values` repeated to fill one row of d channels."""
    t = torch.tensor(values, dtype=torch.float32)
    return t.repeat(d // len(t) + 1)[:d]


def hard_inputs(d: int, dtype: torch.dtype, random_rows: int = 1031) -> torch.Tensor:
    """Rows at every rule's edges, then random rows of magnitudes from 1e-6 to 4e3, float32 `[n, d]` cast to dtype.

    Edges: zeros, -0.0, values below each amax floor, float32 subnormals, E2M1 and
    E4M3 ties at scale 1 (amax 6 for the FP4 rows, 256 for window rows) and their
    float32 neighbours, E4M3 scale ties (amax = 6x a midpoint, subnormal ones
    too), the 2688 saturation edge, huge values. 1031 random rows leave the last
    program partly masked.
    """
    kv_ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    e4m3_ties = [256.0, 1.0625, 2.0**-10, 3 * 2.0**-10, 7.5 * 2.0**-9, 440.0, -440.0, 432.0 / 4, -(2.0**-10),
                 13 * 2.0**-11, 0.0, -0.0, 1.1875, 24.0 + 2.0, 3.0, 0.5 + 2.0**-5]
    scale_ties = [6 * 1.0625, 6 * 1.5 * 2.0**-9, 6 * 432.0, 6 * 7.5 * 2.0**-9, 2688.0, 6 * 2.0**-9,
                  6 * 2.0**-9 * 0.99, 6 * 2.5 * 2.0**-9, 6 * 15.5 * 2.0**-9, 6 * 0.96875, 2688.0 * (1 + 2.0**-10),
                  3000.0, 6 * 2.0**-6 * 1.0625, 1e-4 * 448, 6 * 2.0**-126 * 3, 1.0]
    edges = [
        torch.zeros(d),
        torch.full((d,), -0.0),
        torch.linspace(-1e-3, 1e-3, d),  # below the compressed-KV floor
        torch.linspace(-3e-5, 3e-5, d),  # below the window floor
        torch.linspace(-3e-39, 3e-39, d),  # float32 subnormals, below the indexer floor
        tiled(kv_ties, d),
        tiled(e4m3_ties, d),
        -tiled(e4m3_ties, d),
        torch.repeat_interleave(tiled(scale_ties, d // 16 + 1), 16)[:d] * tiled([1.0, -0.5, 0.3, -1.0], d),
        tiled([2688.0, -2688.0], d),
        tiled([1e30, -3e-30], d),
        tiled([3.0e38, -1.0], d),
    ]
    x = torch.stack(edges)
    ties = torch.cat((x[5:9], x[5:9]))
    x = torch.cat((x, torch.nextafter(ties, torch.full_like(ties, float("inf"))),
                   torch.nextafter(ties, torch.full_like(ties, -float("inf")))))
    gen = torch.Generator().manual_seed(d)
    noise = torch.randn(random_rows, d, generator=gen) * torch.logspace(-6, 3.6, random_rows).unsqueeze(1)
    noise[::7, 5] = -0.0
    x = torch.cat((x, noise))
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


def same_bits(gpu_out: torch.Tensor, cpu_out: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads too)."""
    gpu_out = gpu_out.cpu()
    return (gpu_out.dtype == cpu_out.dtype and gpu_out.shape == cpu_out.shape
            and torch.equal(gpu_out.contiguous().view(torch.uint8), cpu_out.contiguous().view(torch.uint8)))


def same_values(gpu_out: torch.Tensor, cpu_out: torch.Tensor) -> bool:
    """Bit-identical where not NaN, and NaN in the same places."""
    gpu_out = gpu_out.cpu()
    nan = cpu_out.isnan()
    return (gpu_out.dtype == cpu_out.dtype and torch.equal(gpu_out.isnan(), nan)
            and same_bits(gpu_out.masked_fill(nan, 0), cpu_out.masked_fill(nan, 0)))


def _cases() -> list[tuple[str, int]]:
    return [(name, d) for name, spec in FORMATS.items() for d in spec[5]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "d"), _cases())
@pytest.mark.gpu
@needs_cuda
def test_kernel_encode_is_bit_identical_to_cpu(kernels: ModuleType, name: str, d: int, dtype: torch.dtype) -> None:
    encode, kernel, *_ = FORMATS[name]
    x = hard_inputs(d, dtype)
    out, flag = getattr(kernels, kernel)(x.cuda())
    expected = encode(x)
    assert out.is_cuda and same_bits(out, expected)
    assert bool(torch.isfinite(flag).all())


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.gpu
@needs_cuda
def test_any_leading_shape_and_layout(kernels: ModuleType, name: str) -> None:
    encode, _, decode, _, _, widths = FORMATS[name]
    d = widths[0]
    flat = hard_inputs(d, torch.bfloat16, random_rows=100)
    for shape in ((d,), (7, d), (3, 5, d), (2, 3, 4, d), (1, 1, d)):
        x = flat[:math.prod(shape[:-1])].reshape(shape)
        out = encode(x.cuda())
        assert out.shape == (*shape[:-1], out.shape[-1]) and same_bits(out, encode(x))
        assert same_bits(decode(out, torch.bfloat16), decode(encode(x), torch.bfloat16))
    wide = torch.zeros(flat.shape[0], 2 * d, dtype=torch.bfloat16)
    wide[:, ::2] = flat
    strided = wide[:, ::2]  # not contiguous
    assert not strided.is_contiguous()
    assert same_bits(encode(strided.cuda()), encode(strided))
    gpu_rows = encode(flat.cuda())
    assert same_bits(decode(gpu_rows[:, None].expand(-1, 2, -1), torch.float32),
                     decode(encode(flat)[:, None].expand(-1, 2, -1), torch.float32))


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.gpu
@needs_cuda
def test_cuda_calls_take_the_triton_path(kernels: ModuleType, name: str) -> None:
    encode, kernel, decode, decode_kernel, _, widths = FORMATS[name]
    x = hard_inputs(widths[0], torch.bfloat16, random_rows=10).cuda()
    assert same_bits(decode(encode(x)), decode(encode(x.cpu())))
    routed = [k for k in vars(rows).values() if getattr(k, "name", None) in (
        f"rows_triton.{kernel}", f"rows_triton.{decode_kernel}")]
    assert len(routed) == 2 and all(k.mode == "triton" for k in routed), [(k.name, k.mode) for k in routed]


@pytest.mark.parametrize("out_dtype", [*DTYPES, torch.float64])
@pytest.mark.parametrize(("name", "d"), _cases())
@pytest.mark.gpu
@needs_cuda
def test_kernel_decode_is_bit_identical_to_cpu(kernels: ModuleType, name: str, d: int,
                                                out_dtype: torch.dtype) -> None:
    encode, _, decode, decode_kernel, _, _ = FORMATS[name]
    encoded = encode(hard_inputs(d, torch.float32))
    out = getattr(kernels, decode_kernel)(encoded.cuda(), out_dtype)
    assert out.dtype == out_dtype and same_bits(out, decode(encoded, out_dtype))
    # Any bytes at all: every code, every scale byte (E4M3 NaN and subnormal scales, UE8M0 0 and 255).
    gen = torch.Generator().manual_seed(d)
    any_rows = torch.randint(0, 256, (2053, encoded.shape[-1]), generator=gen, dtype=torch.uint8)
    any_rows[:256, -1] = torch.arange(256, dtype=torch.uint8)
    out = getattr(kernels, decode_kernel)(any_rows.cuda(), out_dtype)
    assert same_values(out, decode(any_rows, out_dtype))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.gpu
@needs_cuda
def test_non_finite_raises_anywhere(kernels: ModuleType, bad: float) -> None:
    for name, (encode, kernel, *_rest, widths) in FORMATS.items():
        d = widths[0]
        for where in ((0, 0), (1030, d - 1), (517, d // 3)):  # first, last (a partly masked program), middle
            x = torch.ones(1031, d, device="cuda", dtype=torch.bfloat16)
            x[where] = bad
            _, flag = getattr(kernels, kernel)(x)
            assert not bool(torch.isfinite(flag).all()), (name, where)
            with pytest.raises(InvalidArgument, match="NaN or Inf"):
                encode(x)


@pytest.mark.gpu
@needs_cuda
def test_more_than_2_31_elements(kernels: ModuleType) -> None:
    if torch.cuda.get_device_properties(0).total_memory < 60 * 2**30:
        pytest.skip("needs 60 GiB of GPU memory")
    for name in ("compressed_kv", "swa"):
        encode, kernel, decode, decode_kernel, _, widths = FORMATS[name]
        pattern = hard_inputs(widths[0], torch.bfloat16, random_rows=100)
        copies = 2**31 // pattern.numel() + 1  # past int32 element offsets
        x = pattern.cuda().repeat(copies, 1)
        out, _ = getattr(kernels, kernel)(x)
        del x
        expected = encode(pattern).cuda()
        assert torch.equal(out.view(copies, -1), expected.view(1, -1).expand(copies, -1)), name
        decoded = getattr(kernels, decode_kernel)(out, torch.bfloat16)
        del out
        expected_values = decode(encode(pattern), torch.bfloat16).cuda()
        assert torch.equal(decoded.view(copies, -1), expected_values.view(1, -1).expand(copies, -1)), name
        del decoded


# --- CPU -------------------------------------------------------------------------------------------


def test_cpu_use_never_imports_the_kernels() -> None:
    code = ("import sys, torch; from kvstore.codec import rows; x = torch.randn(4, 512); "
            "rows.decode_swa_rows(rows.swa_rows(x)); rows.decode_compressed_kv_rows(rows.compressed_kv_rows(x)); "
            "rows.decode_indexer_key_rows(rows.indexer_key_rows(x[:, :128])); "
            "assert 'kvstore.codec.rows_triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bench_codec_runs_on_cpu() -> None:
    from kvstore.bench import codec
    from kvstore.bench.report import Progress

    args = argparse.Namespace(device="cpu", speed_mib=1, error_vectors=64, repeat=1)
    report = codec.run(args, Progress(enabled=False))
    assert [f.name for f in report.figures] == [f"{kind} {step}" for kind in codec.ROW_TYPES for step in (
        "encode (bf16 -> rows)", "decode (rows -> bf16)")]
    assert all(f.ratio and f.ratio > 0 and f.baseline and "copy" in f.baseline for f in report.figures)
    errors = report.notes["errors"]
    assert isinstance(errors, dict)
    assert errors["compressed KV | realistic"]["cos_min"] > 0.9
