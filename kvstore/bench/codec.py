"""Codec benchmark: error of the model's three row formats and their speed against a tensor copy.

Error is measured on realistic cache vectors (RMS-normalised, per-channel gains,
RoPE on the last 64 channels, largest element about 10) and on adversarial
ones (outlier channels, tiny values, all-equal groups), each row type at its
V4.1 width: compressed KV 512 channels, indexer key 128, window KV 512.

Speed: each encode (bf16 `[n, d]` -> rows) and each decode (rows -> bf16) is
timed beside a plain device copy of a tensor of the same bytes, in the same run
on the same device. The bytes compared are the larger side of each step, which
for bf16 is always the unquantized tensor: encode reads it (2d bytes per row
against d/2 + d/16, d/2 + d/32 or d + d/32 written), decode writes it. A figure
is those bytes per second, its baseline the copy's bytes per second (a copy of
N bytes reads N and writes N), and its ratio the copy's time over the step's.
Targets on a GPU (issue 10): each encode >= 0.6x, each decode >= 1x.
`codec_paths` says which implementation ran (Triton kernels or the torch code).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from kvstore.bench.report import Figure, Progress, Report
from kvstore.codec import rows

#: Channels RoPE rotates in each vector (DeepSeek's decoupled RoPE width).
ROPE_CHANNELS = 64

#: name -> (encode, decode, V4.1 width) of each row type.
ROW_TYPES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[..., torch.Tensor], int]] = {
    "compressed KV": (rows.compressed_kv_rows, rows.decode_compressed_kv_rows, 512),
    "indexer key": (rows.indexer_key_rows, rows.decode_indexer_key_rows, 128),
    "window KV": (rows.swa_rows, rows.decode_swa_rows, 512),
}

#: Speed targets on a GPU, as ratios against the same-size copy (issue 10).
ENCODE_TARGET = 0.6
DECODE_TARGET = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench codec`."""
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run (default: cuda when available)")
    parser.add_argument("--speed-mib", type=int, default=0,
                        help="MiB of bf16 input per speed measurement (default: 16 on cpu, 1024 on cuda)")
    parser.add_argument("--error-vectors", type=int, default=16384,
                        help="vectors per error data set")
    parser.add_argument("--repeat", type=int, default=0, help="timed samples per figure (default: 5 cpu, 20 cuda)")


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


def measure_errors(vectors: int, device: str) -> dict[str, dict[str, float]]:
    """Error of each row type on each data set (computed on `device`)."""
    table: dict[str, dict[str, float]] = {}
    for kind, (encode, decode, width) in ROW_TYPES.items():
        for name, x in data_sets(vectors, width).items():
            x = x.to(device)
            table[f"{kind} | {name}"] = errors(x, decode(encode(x)))
    return table


def seconds(fn: Callable[[], object], device: str, repeat: int, inner: int) -> float:
    """Median time of one call of `fn`, over `repeat` samples of `inner` calls, after a warm-up."""
    fn()  # compiles the kernel on first use
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
    else:
        times = []
        for _ in range(repeat):
            start_s = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - start_s) / inner)
    return sorted(times)[len(times) // 2]


def measure_speed(report: Report, device: str, mib: int, repeat: int, progress: Progress) -> dict[str, object]:
    """Each row type's encode and decode against a copy of the same bytes; returns the notes."""
    inner = 5 if device == "cuda" else 1
    notes: dict[str, object] = {}
    with progress.bar("codec speed", total=3 * len(ROW_TYPES), unit="case") as bar:
        for kind, (encode, decode, width) in ROW_TYPES.items():
            vectors = max(1, mib * (1 << 20) // (width * 2))
            gen = torch.Generator(device=device).manual_seed(1)
            x = (torch.randn(vectors, width, device=device, generator=gen) * 3).bfloat16()
            encoded = encode(x)
            compared = max(x.nbytes, encoded.nbytes)  # bf16: the unquantized side, both ways
            copy_s = seconds(x.clone, device, repeat, inner)
            bar.update(1)
            encode_s = seconds(functools.partial(encode, x), device, repeat, inner)
            bar.update(1)
            decode_s = seconds(functools.partial(decode, encoded, torch.bfloat16), device, repeat, inner)
            bar.update(1)
            copy_gbps = compared / copy_s / 1e9
            baseline = f"copy of {compared / 2**20:,.0f} MiB"
            report.add(Figure.against(f"{kind} encode (bf16 -> rows)", compared / encode_s / 1e9, "GB/s",
                                      baseline, copy_gbps))
            report.add(Figure.against(f"{kind} decode (rows -> bf16)", compared / decode_s / 1e9, "GB/s",
                                      baseline, copy_gbps))
            notes[kind] = {"rows": vectors, "bf16_bytes": x.nbytes, "row_bytes": encoded.nbytes,
                           "compared_bytes": compared, "copy_us": round(copy_s * 1e6, 2),
                           "encode_us": round(encode_s * 1e6, 2), "decode_us": round(decode_s * 1e6, 2)}
            del x, encoded
    return notes


def codec_paths() -> dict[str, str]:
    """Which implementation each row function's last CUDA call ran ("triton", else the torch code's mode)."""
    kernels = [getattr(rows, n, None) for n in ("_compressed_kv", "_indexer_key", "_swa", "_decode_compressed_kv",
                                                "_decode_indexer_key", "_decode_swa")]
    return {k.name: k.mode for k in kernels if k is not None}


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
    report.notes["speed"] = measure_speed(report, device, mib, repeat, progress)
    report.notes["speed_input_mib"] = mib
    report.notes["compared_bytes"] = ("the larger side of each step: the bf16 tensor (encode's input, "
                                      "decode's output); baseline = device copy of that many bytes")
    if device == "cuda":
        report.notes["targets"] = {f.name: (f.ratio or 0) >= (ENCODE_TARGET if "encode" in f.name else DECODE_TARGET)
                                   for f in report.figures}
    report.notes["codec_paths"] = codec_paths() if device == "cuda" else "torch (cpu)"
    return report
