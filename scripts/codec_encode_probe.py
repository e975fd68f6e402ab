"""FP4 encode probe (issue 25 item 5): the rows_triton encode kernels against a same-size copy on CUDA.

Each figure is the copy's time over the encode's, in the same run: "kernel" calls rows_triton directly,
"api" the public rows.py call (allocation, kernel, the flag's check). Variants: `BF16_KERNEL` general, pairs and
lanes (the default), and program sizes (channels per program / warps).
Usage: python3 scripts/codec_encode_probe.py [MIB] (default 1024). docs/BENCHMARKS.md's codec encode budget quotes it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from kvstore.codec import rows
from kvstore.codec import rows_triton as kernels

#: (channels per program, warps) tried for each kernel.
TILINGS = ((4096, 4), (4096, 2), (2048, 2), (4096, 8), (8192, 4), (2048, 4))


def milliseconds(fn: Callable[[], object], repeat: int = 20, inner: int = 5) -> float:
    """Median time of one call over `repeat` samples of `inner` calls, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return sorted(times)[len(times) // 2]


def probe(
    name: str, api: Callable[..., object], kernel: Callable[..., object], width: int, dtype: torch.dtype, mib: int
) -> str:
    """One line of ratios for a row type and input dtype."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(mib * (1 << 20) // (width * 2), width, device="cuda", generator=gen) * 3).to(dtype)
    copy = milliseconds(x.clone)
    line = [f"{name} {str(dtype)[6:]} copy {copy:.3f} ms"]
    default = kernels.BF16_KERNEL
    for variant in ("general", "pairs", "lanes") if dtype == torch.bfloat16 else ("general",):
        kernels.BF16_KERNEL = variant
        for block, warps in TILINGS:
            kernels.BLOCK_ELEMENTS, kernels.NUM_WARPS = block, warps
            ratio = copy / milliseconds(functools.partial(kernel, x))
            line.append(f"{variant} {block}/{warps} kernel {ratio:.2f}x")
        kernels.BLOCK_ELEMENTS, kernels.NUM_WARPS = 4096, 4
        line.append(f"{variant} api {copy / milliseconds(functools.partial(api, x)):.2f}x")
    kernels.BF16_KERNEL = default
    return " | ".join(line)


def main() -> None:
    """Print each row type's line for each input dtype."""
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    for name, api, kernel, width in (
        ("compressed KV", rows.compressed_kv_rows, kernels.compressed_kv_rows, 512),
        ("indexer key", rows.indexer_key_rows, kernels.indexer_key_rows, 128),
    ):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            print(probe(name, api, kernel, width, dtype, mib), flush=True)


if __name__ == "__main__":
    main()
