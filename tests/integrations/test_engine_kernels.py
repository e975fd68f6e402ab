"""The engines' write kernels vendored for the GPU run (tests/integrations/engine_kernels.py), checked on the CPU.

The GPU machine has no engine; the GPU test (test_engine_writes_gpu.py) runs the copies. Here: each copy
is the installed engine's text, character for character (the lean installs of SGLang 0.5.23 and vLLM
0.33.0); and the torch port of vLLM's 584-B insert writes the byte layout vLLM documents and
HOPPER_LAYOUTS.md section 2 reads in its source (data at slot x 576, scales at block x 576 + slot x 8,
per-64 UE8M0 scale ceil(log2(max(amax, 1e-4) / 448)), byte 7 zero, E4M3 NoPE, BF16 RoPE at the group's
first position), value for value against an independent numpy transcription.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from tests.integrations import engine_kernels as ek

SOURCES = {
    "sglang": ("kernels/ops/attention/dsv4/fp4_rope_fake_quant.py",
               ("rope_tail_fake_quant_fp4_row", "_rope_tail_fake_quant_fp4_kernel")),
    "vllm": ("models/deepseek_v41/common/ops/fused_compress_quant_cache.py", ("_rope_quant_insert_kernel",)),
}


def _function(text: str, name: str) -> str:
    """The `@triton.jit` function `name` of a module's text, decorator to the next blank-blank line."""
    i = text.index(f"def {name}(")
    j = text.rfind("@triton.jit", 0, i)
    k = text.find("\n\n\n", i)
    return text[j:k if k > 0 else len(text)].rstrip()


@pytest.mark.parametrize("engine", sorted(SOURCES))
def test_the_vendored_kernels_are_the_installed_engines_text(engine: str) -> None:
    spec = importlib.util.find_spec(engine)
    if spec is None or spec.origin is None:
        pytest.skip(f"{engine} is not installed (scripts/install_engines.sh)")
    path, names = SOURCES[engine]
    theirs = (Path(spec.origin).parent / path).read_text()
    ours = Path(ek.__file__).read_text()
    for name in names:
        assert _function(ours, name) == _function(theirs, name), name


def _numpy_insert(latent: np.ndarray, pos: int, cos_sin: np.ndarray, ratio: int) -> tuple[np.ndarray, np.ndarray]:
    """One token's 576 data bytes and 8 scale bytes, from the kernel's stated arithmetic (float32 numpy)."""
    x = latent.astype(np.float32)
    data = np.zeros(576, dtype=np.uint8)
    scales = np.zeros(8, dtype=np.uint8)
    for w in range(8):
        tile = x[w * 64:(w + 1) * 64]
        amax = max(np.float32(np.abs(tile).max()), np.float32(1e-4))
        e = math.ceil(math.log2(float(np.float32(amax * np.float32(1.0 / 448.0)))))
        q = np.clip(tile * np.float32(2.0 ** -e), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        if w < 7:
            data[w * 64:(w + 1) * 64] = q
            scales[w] = min(max(e + 127, 0), 255)
    base = pos // ratio * ratio
    c, s = cos_sin[base, :32].astype(np.float64), cos_sin[base, 32:].astype(np.float64)
    even, odd = x[448::2].astype(np.float64), x[449::2].astype(np.float64)
    rope = np.stack((even * c - odd * s, odd * c + even * s), axis=-1).reshape(64)
    data[448:] = rope.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint8)
    return data, scales


def test_the_vllm_insert_port_writes_the_documented_rows() -> None:
    g = torch.Generator().manual_seed(3)
    t, block, ratio = 40, 32, 2
    latent = (torch.randn(t, 512, generator=g) * torch.rand(1, 512, generator=g) * 3).to(torch.bfloat16)
    latent[5, :64] = 0                                              # a tile under the 1e-4 floor
    positions = torch.arange(100, 100 + t)
    angles = torch.arange(256, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(32) / 32))[None]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    slots = torch.randperm(4 * block, generator=g)[:t]
    slots[7] = -1                                                   # padding: never written
    cache = torch.full((4, block, 584), 0xEE, dtype=torch.uint8)
    ek.vllm_insert_584(latent, positions, cos_sin, cache, slots, ratio)
    pages = cache.view(4, -1)
    written = 0
    touched = torch.zeros_like(pages, dtype=torch.bool)
    for i in range(t):
        slot = int(slots[i])
        if slot < 0 or (int(positions[i]) + 1) % ratio:
            continue
        page, off = divmod(slot, block)
        data, scales = _numpy_insert(latent[i].float().numpy(), int(positions[i]), cos_sin.numpy(), ratio)
        got = pages[page, off * 576:(off + 1) * 576].numpy()
        assert np.array_equal(got[:448], data[:448]), i
        # RoPE: bf16 of the rotation; the port fuses a*c - b*s as Triton does, the transcription does not:
        # at most one bf16 step apart.
        diff = np.abs(got[448:].view(np.int16).astype(np.int32) - data[448:].view(np.int16).astype(np.int32))
        assert diff.max() <= 1, i
        assert np.array_equal(pages[page, block * 576 + off * 8:block * 576 + off * 8 + 8].numpy(), scales), i
        touched[page, off * 576:(off + 1) * 576] = True
        touched[page, block * 576 + off * 8:block * 576 + off * 8 + 8] = True
        written += 1
    assert written == sum(1 for i in range(t) if slots[i] >= 0 and (positions[i] + 1) % ratio == 0) > 10
    assert (pages[~touched] == 0xEE).all()                           # nothing else touched
