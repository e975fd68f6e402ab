"""FP4 (OCP MX E2M1) quantization of cache vectors, with their scales.

Two scalings, one per `ScaleFormat` of the geometry:

- `quantize`: one FP8 E4M3 scale per 16 consecutive channels (NVFP4 without its
  second-level per-tensor scale). Used for the main KV: 512 channels -> 256 B of
  codes + 32 B of scales = 288 B.
- `quantize_per_vector`: one float32 scale per vector. Used for the indexer key:
  128 dims -> 64 B of codes + 4 B = 68 B.

Rules (docs/CODEC.md states them with the measured errors):

1. Codes are E2M1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; the
   magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Element 2i goes in the low nibble
   of byte i and element 2i+1 in the high nibble (torch.float4_e2m1fn_x2 packing).
2. Scale (E4M3): amax/6 of the group rounded to the nearest E4M3 value, ties
   to even, kept within [2^-6, 448]: the smallest normal value and the largest
   finite one. Rounding to nearest, rather than up, lets the group's largest
   element clip by at most half an E4M3 step (< 6.25%) and gives every other
   element a finer grid: 8% less relative error on realistic cache vectors
   (docs/CODEC.md). A group whose every element rounds to 0 (all zeros, or
   amax <= 2^-6/4 under the floor) stores scale 0. The floor makes quantization
   idempotent: every other group holds a code of magnitude 6, so
   quantize(dequantize(q)) == q; a subnormal scale would serve only groups with
   amax < 0.09, where FP4 has lost them anyway.
3. Code: x/s rounded to nearest on the E2M1 grid, ties to even, computed on the
   exact quotient; |x| > 6*s saturates to +-6*s and is counted.
4. Scale (float32 per vector): the smallest float32 of 21 significant bits that
   is >= amax/6 (at least 2^-126), so nothing saturates and every decision
   threshold m*s and every decoded value c*s is exact in float32. At 21 bits the
   rounding direction costs nothing measurable.

Rounding is done by comparing |x| with thresholds m*s that are exact in float32
instead of dividing: the result is then the same on every device and under any
compiler (a fused GPU kernel may approximate division, never an exact product).

On CUDA the work runs in the fused Triton kernels of kvstore/fp4_triton.py (one
pass each way), imported on first use; without Triton, through torch.compile.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import InvalidArgument

logger = logging.getLogger(__name__)

#: Channels sharing one E4M3 scale.
GROUP_CHANNELS = 16
#: Largest E2M1 magnitude.
E2M1_MAX = 6.0
#: Largest finite E4M3 magnitude.
E4M3_MAX = 448.0
#: Largest magnitude a per-16 E4M3-scaled code can hold (448 * 6).
FP4_E4M3_MAX = E4M3_MAX * E2M1_MAX

#: E2M1 value of each 4-bit code (bit 3 is the sign).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Midpoint between magnitude codes k and k+1, and whether a tie there goes up:
# ties go to the even code (mantissa bit 0), i.e. up exactly when k+1 is even.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)

_E4M3_MIN_NORMAL = 2.0**-6
_E4M3_ULP_BITS = 1 << 20  # one E4M3 mantissa step, in float32 bit units
_F32_SCALE_ULP_BITS = 1 << 3  # float32 scales keep 21 significant bits
_F32_MIN_NORMAL = 2.0**-126


@dataclass(frozen=True, kw_only=True)
class QuantStats:
    """What one quantization clipped.

    Attributes:
        elements: values quantized.
        saturated: values with |x| > 6*scale, stored as +-6*scale. Expected:
            a group whose amax/6 rounds down to its scale clips its largest
            element by less than half an E4M3 step.
        overflowed: values beyond the format's range (|x| > 2688), which clip
            by more than that.
    """

    elements: int
    saturated: int
    overflowed: int


class FusedKernel:
    """A pure-tensor function run through torch.compile on CUDA, eagerly elsewhere.

    Eager torch runs one kernel per operator, far from memory bandwidth; the
    compiled graph is one or two fused kernels. Every function wrapped here uses
    only exact float32 products, comparisons and bit operations, so the compiled
    and eager results are bit-identical. If compilation fails (no Triton, say),
    the eager function is used and `mode` says why.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._compiled: Callable[..., Any] | None = None
        self.mode = "eager"
        self.name = fn.__name__
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        if not args[0].is_cuda or self.mode.startswith("eager (compile failed"):
            return self._fn(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self._fn, dynamic=True, fullgraph=True)
        try:
            out = self._compiled(*args)
        except Exception as e:  # inductor lacking a compiler or backend; eager still works
            self.mode = f"eager (compile failed: {type(e).__name__})"
            logger.warning("torch.compile of %s failed, using eager torch: %s", self._fn.__name__, e)
            return self._fn(*args)
        self.mode = "compiled"
        return out


class CudaKernel:
    """A codec step that runs a fused Triton kernel on CUDA tensors and `fallback` otherwise.

    The kernel is `name` in `kvstore.<module>`, imported on the first CUDA call so
    that CPU-only machines never import triton. It returns what `fallback` returns,
    bit for bit (tests/kvstore/test_codec_gpu.py), or None for an input it does not
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
    if not isinstance(x, torch.Tensor):
        raise InvalidArgument(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidArgument(f"{what}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
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
    ax = x.abs()
    nonzero = ax > _MIDPOINTS[0] * scale
    mag = nonzero.to(torch.uint8)
    for midpoint, tie_up in zip(_MIDPOINTS[1:], _TIE_UP[1:], strict=True):
        threshold = midpoint * scale
        mag = mag + (ax >= threshold if tie_up else ax > threshold).to(torch.uint8)
    # With scale 0 every threshold is 0 and `>=` would fire; such a group is all zeros.
    mag = torch.where(nonzero, mag, 0)
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte: element 2i in the low nibble, 2i+1 in the high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _e4m3_nearest(amax: torch.Tensor) -> torch.Tensor:
    """The normal E4M3 value nearest to amax/6 (ties to even), within [2^-6, 448], as float32."""
    v = torch.clamp(amax / E2M1_MAX, min=_E4M3_MIN_NORMAL, max=E4M3_MAX)
    bits = v.view(torch.int32)
    # Round to nearest even at 3 mantissa bits in the float32 bits, then truncate.
    half = (_E4M3_ULP_BITS >> 1) - 1 + ((bits >> 20) & 1)
    s = ((bits + half) & -_E4M3_ULP_BITS).view(torch.float32)
    # amax/6 is itself rounded (and may be approximate in a fused kernel): move
    # one step where amax lies beyond 6x a midpoint. 6x an E4M3 midpoint has at
    # most 7 significant bits, so every comparison below is exact.
    for step in (1, -1):
        sb = s.view(torch.int32)
        other = (sb + step * _E4M3_ULP_BITS).view(torch.float32)
        boundary = E2M1_MAX * (s + other) * 0.5
        other_even = ((sb + step * _E4M3_ULP_BITS) >> 20) & 1 == 0
        beyond = amax > boundary if step == 1 else amax < boundary
        tie = (amax == boundary) & other_even
        in_range = (s < E4M3_MAX) if step == 1 else (s > _E4M3_MIN_NORMAL)
        s = torch.where((beyond | tie) & in_range, other, s)
    return s


def _f32_round_up(amax: torch.Tensor) -> torch.Tensor:
    """Smallest float32 s of 21 significant bits with 6*s >= amax (0 for amax 0)."""
    v = torch.clamp(amax / E2M1_MAX, min=_F32_MIN_NORMAL)
    s = ((v.view(torch.int32) + (_F32_SCALE_ULP_BITS - 1)) & -_F32_SCALE_ULP_BITS).view(torch.float32)
    bits = s.view(torch.int32)
    nxt = (bits + _F32_SCALE_ULP_BITS).view(torch.float32)
    s = torch.where(E2M1_MAX * s < amax, nxt, s)
    prv = (s.view(torch.int32) - _F32_SCALE_ULP_BITS).view(torch.float32)
    s = torch.where((prv >= _F32_MIN_NORMAL) & (E2M1_MAX * prv >= amax), prv, s)
    return torch.where(amax > 0, s, 0.0)


@FusedKernel
def _quantize_groups_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = x.float().unflatten(-1, (-1, GROUP_CHANNELS))
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = _e4m3_nearest(amax)
    codes = e2m1_codes(g, scale).flatten(-2)
    # A group that rounds to all zeros stores scale 0, as its decoded zeros would.
    stored = torch.where(amax > _MIDPOINTS[0] * scale, scale, 0.0)
    # amax is returned (16x smaller than x) rather than counts: a whole-tensor
    # reduction here would split the fused kernel and re-read x.
    return pack_nibbles(codes), stored.squeeze(-1), amax.squeeze(-1)


# Each returns (values, scales, t), t an amax or a flag that is non-finite where x was.
_quantize_groups = CudaKernel("fp4_triton", "quantize_groups", _quantize_groups_torch)


def _clip_counts(x: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """(saturated, overflowed) counts of a quantization; a second pass over x."""
    ax = x.float().abs().unflatten(-1, (-1, GROUP_CHANNELS))
    amax = ax.amax(dim=-1, keepdim=True)
    limit = E2M1_MAX * _e4m3_nearest(amax)
    saturated, overflowed = torch.stack(((ax > limit).sum(), (ax > FP4_E4M3_MAX).sum())).tolist()
    return saturated, overflowed


@FusedKernel
def _quantize_vectors_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v = x.float()
    amax = v.abs().amax(dim=-1, keepdim=True)
    scale = _f32_round_up(amax)
    stored = torch.where(amax > _MIDPOINTS[0] * scale, scale, 0.0)
    return pack_nibbles(e2m1_codes(v, scale)), stored, amax


_quantize_vectors = CudaKernel("fp4_triton", "quantize_vectors", _quantize_vectors_torch)


def quantize_with_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, QuantStats]:
    """Like `quantize`, and also count the values clipped (a second pass over x).

    Raises:
        InvalidArgument: as `quantize`.
    """
    values, scales = quantize(x)
    saturated, overflowed = _clip_counts(x, scales)
    return values, scales, QuantStats(elements=x.numel(), saturated=saturated, overflowed=overflowed)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to FP4 with one E4M3 scale per 16 consecutive elements of the last dim.

    Args:
        x: float32, bfloat16 or float16 tensor `[..., C]`, C a multiple of 16,
            on any device.

    Returns:
        `(values, scales)` on x's device: `values` uint8 `[..., C/2]`, element 2i
        in the low nibble and 2i+1 in the high nibble; `scales` float8_e4m3fn
        `[..., C/16]`: amax/6 of each group rounded to the nearest E4M3 value
        within [2^-6, 448], or 0 where the whole group rounds to zero.

    Raises:
        InvalidArgument: wrong type, dtype or last dimension; NaN or Inf in x.
    """
    check_input(x, what="fp4.quantize", multiple=GROUP_CHANNELS)
    values, scales, amax = _quantize_groups(x)
    check_finite(amax, what="fp4.quantize")
    return values, scales.to(torch.float8_e4m3fn)


def quantize_per_vector(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to FP4 with one float32 scale per vector (the last dim).

    Args:
        x: float32, bfloat16 or float16 tensor `[..., C]`, C even.

    Returns:
        `(values, scales)`: `values` uint8 `[..., C/2]` packed as in `quantize`;
        `scales` float32 `[..., 1]`, the smallest float32 of 21 significant bits
        >= amax/6 (0 for an all-zero vector). Nothing saturates.

    Raises:
        InvalidArgument: wrong type, dtype or last dimension; NaN or Inf in x.
    """
    check_input(x, what="fp4.quantize_per_vector", multiple=2)
    values, scales, amax = _quantize_vectors(x)
    check_finite(amax, what="fp4.quantize_per_vector")
    return values, scales


def e2m1_values(values: torch.Tensor) -> torch.Tensor:
    """float32 value of each packed code, `[..., 2 * n]`, built from its bits (no table gather)."""
    codes = torch.stack((values & 0xF, values >> 4), dim=-1).flatten(-2).to(torch.int32)
    mag = codes & 7
    # Codes 2-7 are normal: exponent mag>>1 (bias 1), mantissa mag&1; build the float32 bits.
    normal = ((((mag >> 1) + 126) << 23) | ((mag & 1) << 22)).view(torch.float32)
    value = torch.where(mag < 2, mag.float() * 0.5, normal)
    # The sign goes in as a bit: compiled, `-value` becomes 0 - value and would lose -0.0 (code 8).
    return (value.view(torch.int32) | ((codes & 8) << 28)).view(torch.float32)


@FusedKernel
def _dequantize_groups_torch(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    decoded = e2m1_values(values).unflatten(-1, (-1, GROUP_CHANNELS))
    return (decoded * scales.float().unsqueeze(-1)).flatten(-2).to(dtype)


@FusedKernel
def _dequantize_vectors_torch(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (e2m1_values(values) * scales).to(dtype)


_dequantize_groups = CudaKernel("fp4_triton", "dequantize_groups", _dequantize_groups_torch)
_dequantize_vectors = CudaKernel("fp4_triton", "dequantize_vectors", _dequantize_vectors_torch)


def dequantize(values: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode FP4 codes with either kind of scale back to floats.

    Args:
        values: uint8 `[..., C/2]` packed codes, as `quantize` returns.
        scales: float8_e4m3fn `[..., C/16]` (per 16 elements) or float32
            `[..., 1]` (per vector), on the same device.
        dtype: output dtype. float32 is exact; bfloat16 is exact for E4M3
            scales and rounds float32 per-vector scales to 8 bits.

    Returns:
        `[..., C]` tensor of `dtype` on values' device.

    Raises:
        InvalidArgument: dtypes or shapes that do not fit together.
    """
    if values.dtype != torch.uint8:
        raise InvalidArgument(f"fp4.dequantize: expected values of dtype uint8, got {values.dtype}")
    lead, half = tuple(values.shape[:-1]), values.shape[-1] if values.dim() else 0
    if scales.dtype == torch.float8_e4m3fn:
        expected = (*lead, half * 2 // GROUP_CHANNELS)
        if half * 2 % GROUP_CHANNELS or tuple(scales.shape) != expected:
            raise InvalidArgument(f"fp4.dequantize: values {tuple(values.shape)} need float8_e4m3fn "
                                  f"scales of shape {expected}, got {tuple(scales.shape)}")
        return _dequantize_groups(values, scales, dtype)
    if scales.dtype == torch.float32:
        if tuple(scales.shape) != (*lead, 1):
            raise InvalidArgument(f"fp4.dequantize: values {tuple(values.shape)} need float32 "
                                  f"scales of shape {(*lead, 1)}, got {tuple(scales.shape)}")
        return _dequantize_vectors(values, scales, dtype)
    raise InvalidArgument(f"fp4.dequantize: expected scales of dtype float8_e4m3fn or float32, "
                          f"got {scales.dtype}")
