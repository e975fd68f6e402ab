"""FP4 (OCP MX E2M1) pieces of the model's rows, and the lazy CUDA-kernel wrapper.

`kvstore.codec.rows` builds the compressed-KV and indexer-key rows from these:

- `e2m1_codes`: x/scale to the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} clamped at
  +-6, round to nearest, ties to the even code; bit 3 is the sign bit of x.
- `pack_nibbles`: element 2i in the low nibble of byte i, 2i+1 in the high one.
- `e2m1_values`: the float32 value of each packed code.
- `check_input` / `check_finite`: the InvalidArgument checks every encoder runs.
- `CudaKernel`: runs a Triton kernel of a `kvstore.codec` module on CUDA tensors,
  imported on first use, and the torch code everywhere else.

These pieces take torch tensors only (anything else is refused with
InvalidArgument saying so); the row functions built on them take numpy arrays too.

Rounding compares |x| with thresholds m*scale that are exact in float32 instead
of dividing: the result is that of the exact quotient, on every device and
under any compiler (a fused GPU kernel may approximate division, never an exact
product).
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from kvstore.codec.arrays import dtype_name, require_tensor
from kvstore.errors import InvalidArgument

logger = logging.getLogger(__name__)

#: Largest E2M1 magnitude.
E2M1_MAX = 6.0

#: E2M1 value of each 4-bit code (bit 3 is the sign).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Midpoint between magnitude codes k and k+1, and whether a tie there goes up:
# ties go to the even code (mantissa bit 0), i.e. up exactly when k+1 is even.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


class CudaKernel:
    """A codec step that runs a fused Triton kernel on CUDA tensors and `fallback` otherwise.

    The kernel is `name` in `kvstore.codec.<module>`, imported on the first CUDA call
    so that CPU-only machines never import triton. It returns what `fallback` returns,
    bit for bit (tests/kvstore/codec/test_codec_gpu.py), or None for an input it does not
    handle. `fallback` runs on other devices, for declined inputs, when triton
    cannot be imported, and after the kernel has raised once (logged): its results
    are the same, only slower. `mode` names the path of the last CUDA call.
    """

    def __init__(self, module: str, name: str, fallback: Callable[..., Any]) -> None:
        self._module = module
        self._attr = name
        self.name = f"{module}.{name}"
        self._fallback = fallback
        self._kernel: Callable[..., Any] | None = None
        self._failed = ""
        self.mode = "not run"

    def __call__(self, *args: Any) -> Any:
        if not args[0].is_cuda:
            return self._fallback(*args)
        if not self._failed:
            try:
                if self._kernel is None:
                    self._kernel = getattr(importlib.import_module(f"kvstore.codec.{self._module}"), self._attr)
                out = self._kernel(*args)
            except torch.cuda.OutOfMemoryError:
                raise  # the fallback needs more memory, not less
            except Exception as e:  # no triton, or one that cannot build the kernel: the fallback still works
                self._failed = f" (triton failed: {type(e).__name__})"
                logger.warning("Triton kernel %s failed, using the slower path: %s", self.name, e)
                out = None
            if out is not None:
                self.mode = "triton"
                return out
        out = self._fallback(*args)
        self.mode = getattr(self._fallback, "mode", "eager") + self._failed
        return out


def check_input(x: torch.Tensor, *, what: str, multiple: int) -> None:
    """Raise InvalidArgument unless `x` is a finite-typed float tensor whose last dim is a multiple.

    Args:
        x: the tensor to check.
        what: how the caller names it in messages.
        multiple: the last dimension must be a positive multiple of this.
    """
    require_tensor(x, what)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidArgument(f"{what}: expected dtype float32, bfloat16 or float16, got {dtype_name(x)}")
    if x.dim() == 0 or x.shape[-1] == 0 or x.shape[-1] % multiple:
        raise InvalidArgument(
            f"{what}: expected last dimension a positive multiple of {multiple}, got shape {tuple(x.shape)}"
        )


def check_finite(amax: torch.Tensor, *, what: str) -> None:
    """Raise InvalidArgument if a vector maximum is NaN or infinite (so its input was)."""
    finite = math.isfinite(amax.item()) if amax.numel() == 1 else bool(torch.isfinite(amax).all())
    if not finite:
        raise InvalidArgument(f"{what}: input contains NaN or Inf; the cache cannot store it")


def e2m1_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes of x/scale clamped to +-6, round to nearest, ties to the even code.

    Decided by comparing |x| with the midpoints times scale, exact in float32
    for a scale of at most 4 significant bits (E4M3 or a power of two): the
    result is that of the exact quotient, on every device. The sign bit of x is
    kept, so a negative value (or -0.0) that rounds to 0 is code 8.

    Args:
        x: float32 tensor.
        scale: float32 tensor broadcasting against x, > 0.

    Returns:
        uint8 tensor of x's shape, one code per element.
    """
    require_tensor(x, "e2m1_codes x")
    require_tensor(scale, "e2m1_codes scale")
    ax = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in zip(_MIDPOINTS, _TIE_UP, strict=True):
        threshold = midpoint * scale
        mag = mag + (ax >= threshold if tie_up else ax > threshold).to(torch.uint8)
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte: element 2i in the low nibble, 2i+1 in the high nibble."""
    require_tensor(codes, "pack_nibbles")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


#: float32 values of the two codes of each byte: row b is (low nibble, high nibble).
_E2M1_PAIRS = torch.tensor([(E2M1_VALUES[b & 15], E2M1_VALUES[b >> 4]) for b in range(256)],
                           dtype=torch.float32)


def e2m1_values(values: torch.Tensor) -> torch.Tensor:
    """float32 value of each packed code, `[..., 2 * n]` from uint8 `[..., n]`, -0.0 for code 8.

    One lookup per byte in a 256 x 2 table: on the CPU 8x faster than building
    the floats from the bits, and exact either way.
    """
    require_tensor(values, "e2m1_values")
    table = _E2M1_PAIRS if values.device == _E2M1_PAIRS.device else _E2M1_PAIRS.to(values.device)
    return torch.nn.functional.embedding(values.long(), table).flatten(-2)
