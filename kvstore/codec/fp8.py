"""FP8 and UE8M0 pieces of the model's rows (power-of-two scales).

`kvstore.codec.rows` builds the indexer and window rows from these:

- `ceil_power_of_two`: 2^ceil(log2 v) of a positive float32, exact (on the bits).
- `ue8m0_bytes`: the UE8M0 byte of a power-of-two scale (its biased exponent).
- `ue8m0_values`: the float32 value of UE8M0 bytes, 2^(byte-127).

They take torch tensors only (anything else is refused with InvalidArgument
saying so); the row functions built on them take numpy arrays too.
"""

from __future__ import annotations

import torch

from kvstore.codec.arrays import require_tensor

_EXPONENT_MASK = 0x7F800000
_MANTISSA_MASK = 0x007FFFFF


def ceil_power_of_two(v: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 v) for positive normal float32 v, exact: taken on the bits.

    The exponent of v, plus one when any mantissa bit is set, so a power of two
    maps to itself. No logarithm, so no rounding and the same on every device.
    """
    require_tensor(v, "ceil_power_of_two")
    bits = v.view(torch.int32)
    up = ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    return ((bits & _EXPONENT_MASK) + (up << 23)).view(torch.float32)


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte of each normal power-of-two float32 scale: its biased exponent, as uint8."""
    require_tensor(scale, "ue8m0_bytes")
    return (scale.view(torch.int32) >> 23).to(torch.uint8)


def ue8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 value of each UE8M0 byte: 2^(byte-127); byte 0 is 2^-127, 0xFF is NaN."""
    require_tensor(codes, "ue8m0_values")
    b = codes.to(torch.int32)
    value = (b << 23).view(torch.float32)
    value = torch.where(b == 0, 2.0**-127, value)
    return torch.where(b == 0xFF, float("nan"), value)
