"""Codec benchmark: error of the FP4/FP8 cache formats and their speed against a tensor copy.

Error is measured on realistic cache vectors (RMS-normalised, per-channel gains,
RoPE on the last 64 channels, largest element about 10) and on adversarial
ones (outlier channels, tiny values, all-equal groups). Speed is GB/s of the
unquantized bf16 tensor (read by quantize, written by dequantize) against a
plain copy of a tensor of the same size, in the same run on the same device.
The report notes which implementation ran (`codec_paths`: Triton kernels or the
torch.compile fallback on CUDA).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvstore.bench.report import Figure, Progress, Report
from kvstore.codec import fp4, fp8

#: Channels RoPE rotates in each vector (DeepSeek's decoupled RoPE width).
ROPE_CHANNELS = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench codec`."""
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run (default: cuda when available)")
    parser.add_argument("--speed-mib", type=int, default=0,
                        help="MiB of bf16 input per speed measurement (default: 16 on cpu, 1024 on cuda)")
    parser.add_argument("--error-vectors", type=int, default=16384,
                        help="vectors of 512 channels per error data set")
    parser.add_argument("--repeat", type=int, default=0, help="timed runs per figure (default: 5 cpu, 20 cuda)")


def realistic(vectors: int, channels: int, gen: torch.Generator) -> torch.Tensor:
    """Cache-like vectors: RMS-normalised, per-channel gains, RoPE, largest element ~10."""
    x = torch.randn(vectors, channels, generator=gen)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    x = x * torch.exp(0.5 * torch.randn(channels, generator=gen))
    rope = min(ROPE_CHANNELS, channels)
    positions = torch.randint(0, 1 << 20, (vectors, 1), generator=gen).float()
    angles = positions * 10000.0 ** (-torch.arange(0, rope, 2).float() / rope)
    a, b = x[:, -rope::2].clone(), x[:, -rope + 1::2].clone()
    x[:, -rope::2] = a * angles.cos() - b * angles.sin()
    x[:, -rope + 1::2] = a * angles.sin() + b * angles.cos()
    return x * (10.0 / x.abs().amax(-1).mean())


def data_sets(vectors: int, channels: int) -> dict[str, torch.Tensor]:
    """Realistic vectors and the adversarial variants of them."""
    gen = torch.Generator().manual_seed(0)
    base = realistic(vectors, channels, gen)
    outliers = base.clone()
    outliers[:, 7] *= 50.0  # one hot channel, as attention sinks make
    equal = base.unflatten(-1, (-1, 16))[..., :1].expand(-1, -1, 16).flatten(-2).contiguous()
    return {"realistic": base, "outlier channel x50": outliers, "tiny (x1e-3)": base * 1e-3,
            "all-equal groups": equal}


def errors(x: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    """Relative L2 error, mean and worst cosine similarity per vector, max abs error."""
    cos = torch.nn.functional.cosine_similarity(out, x, dim=-1)
    return {"rel_err": round(((out - x).norm() / x.norm()).item(), 5),
            "cos_mean": round(cos.mean().item(), 6), "cos_min": round(cos.min().item(), 6),
            "max_abs_err": round((out - x).abs().max().item(), 5)}


def fp8_unscaled(x: torch.Tensor) -> torch.Tensor:
    """The alternative SWA scheme we rejected: a plain cast, saturating at 448."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def measure_errors(vectors: int, device: str) -> dict[str, dict[str, float]]:
    """Error of each format on each data set (computed on `device`)."""
    table: dict[str, dict[str, float]] = {}
    for name, x in data_sets(vectors, 512).items():
        x = x.to(device)
        table[f"fp4 main_kv e4m3/16 | {name}"] = errors(x, fp4.dequantize(*fp4.quantize(x)))
        key = x[:, :128].contiguous()
        table[f"fp4 indexer f32/vec | {name}"] = errors(key, fp4.dequantize(*fp4.quantize_per_vector(key)))
        table[f"fp8 swa pow2/token | {name}"] = errors(x, fp8.dequantize(*fp8.quantize(x)))
        table[f"fp8 swa unscaled | {name}"] = errors(x, fp8_unscaled(x))
    return {k: {m: (v.item() if isinstance(v, torch.Tensor) else v) for m, v in e.items()} for k, e in table.items()}


def seconds(fn: Callable[[], object], device: str, repeat: int) -> float:
    """Median wall time of `fn` after a warm-up (which also compiles on CUDA)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_speed(report: Report, device: str, mib: int, repeat: int, progress: Progress) -> None:
    """GB/s of bf16 input for quantize/dequantize beside a copy of the same bytes."""
    vectors = mib * (1 << 20) // (512 * 2)
    x = torch.randn(vectors, 512, device=device).bfloat16()
    gb = x.numel() * 2 / 1e9
    keys = x.view(-1, 128)  # the indexer's vectors: same bytes, one float32 scale per 128
    values, scales = fp4.quantize(x)
    key_values, key_scales = fp4.quantize_per_vector(keys)
    codes, pow2 = fp8.quantize(x)
    cases: dict[str, Callable[[], object]] = {
        "fp4 quantize (main_kv)": lambda: fp4.quantize(x),
        "fp4 dequantize to bf16 (main_kv)": lambda: fp4.dequantize(values, scales, dtype=torch.bfloat16),
        "fp4 quantize (indexer)": lambda: fp4.quantize_per_vector(keys),
        "fp4 dequantize to bf16 (indexer)": lambda: fp4.dequantize(key_values, key_scales, dtype=torch.bfloat16),
        "fp8 quantize (swa)": lambda: fp8.quantize(x),
        "fp8 dequantize to bf16 (swa)": lambda: fp8.dequantize(codes, pow2, dtype=torch.bfloat16),
    }
    with progress.bar("codec speed", total=len(cases) + 1, unit="case") as bar:
        copy_gbps = gb / seconds(lambda: x.clone(), device, repeat)
        bar.update(1)
        for name, fn in cases.items():
            report.add(Figure.against(name, gb / seconds(fn, device, repeat), "GB/s", "tensor copy", copy_gbps))
            bar.update(1)


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Measure codec error and speed; see the module docstring."""
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    report = Report(bench="codec")
    report.notes["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report.notes["errors"] = measure_errors(args.error_vectors, device)
    mib = args.speed_mib or (1024 if device == "cuda" else 16)
    repeat = args.repeat or (20 if device == "cuda" else 5)
    measure_speed(report, device, mib, repeat, progress)
    report.notes["speed_input_mib"] = mib
    # Which implementation the timed calls ran: "triton" (fused kernels), else the fallback's
    # "compiled"/"eager" (on CPU every step is eager torch).
    report.notes["codec_paths"] = {k.name: k.mode if device == "cuda" else "eager" for k in (
        fp4._quantize_groups, fp4._dequantize_groups, fp4._quantize_vectors, fp4._dequantize_vectors,
        fp8._quantize_tokens, fp8._dequantize_tokens)}
    return report
