"""What the codec's entry points take and give back: torch tensors, numpy arrays and byte buffers.

Every public function of `kvstore.codec.rows`, `block_codec` and `snapshot`
takes the caller's data in the kinds `Client.put` takes
(`kvstore.client.arguments.BUFFER_KINDS`), read by these rules (docs/CODEC.md,
"What the entry points take"):

1. A torch tensor is used as it is, on its device.
2. A numpy array becomes a CPU tensor over the same memory (`torch.from_numpy`,
   no copy). One with a negative stride (`a[::-1]`) is copied first: torch
   cannot view it. Its dtype must be one torch has (numpy has no bfloat16).
3. A buffer (bytes, bytearray, memoryview: C-contiguous, one-byte items) becomes a
   1-D uint8 tensor over its bytes (`torch.frombuffer`, no copy). Only arguments
   that are bytes take one: blocks, snapshots, and the rows that `join_blocks`
   and `join_snapshot` lay out (a flat buffer of whole rows).
4. What comes back is numpy when the caller's data was numpy (views of it stay
   views, read-only where the input was), and torch otherwise: a buffer gives
   tensors. Results that are bytes (`join_snapshot`) are bytes either way.

Anything else raises InvalidArgument naming what the argument accepts, never a
bare TypeError. The low-level pieces in `fp4` and `fp8` take torch tensors only
and say so.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvstore.errors import InvalidArgument

#: A numpy array of any shape and dtype.
NDArray = npt.NDArray[Any]
#: The byte buffers rule 3 reads.
Buffer = bytes | bytearray | memoryview

#: What an argument that is an array accepts, said in refusals.
ARRAY_KINDS = "a torch tensor or a numpy array"
#: What an argument that is bytes accepts, said in refusals.
BYTE_KINDS = "a torch tensor, a numpy array, bytes, bytearray or memoryview"


def is_numpy(data: object) -> bool:
    """Whether `data` is a numpy array (its results come back as numpy: rule 4)."""
    return isinstance(data, np.ndarray)


def is_buffer(data: object) -> bool:
    """Whether `data` is a byte buffer of rule 3 (bytes, bytearray, memoryview)."""
    return isinstance(data, bytes | bytearray | memoryview)


def dtype_name(t: torch.Tensor) -> str:
    """The dtype as numpy and torch both spell it ("uint8", "float32")."""
    return str(t.dtype).removeprefix("torch.")


def as_tensor(data: object, *, what: str, wants: str, buffers: bool = False, views: bool = False) -> torch.Tensor:
    """`data` as a torch tensor sharing its memory (rules 1-3).

    Args:
        data: a torch tensor, a numpy array, or (with `buffers`) a byte buffer.
        what: how messages name the argument.
        wants: what it must be, for the refusal ("uint8 [n * 32, 288]").
        buffers: whether a byte buffer is accepted (as a 1-D uint8 tensor).
        views: the caller returns views of `data`, so a numpy array with a
            negative stride is refused rather than copied (views of a copy would
            not show the caller's changes).

    Returns:
        `data` itself for a tensor; a CPU tensor over the same memory otherwise.
        It keeps `data` alive, but not whatever lent `data` (an LMDB
        transaction); it must not be written to when `data` is read-only.

    Raises:
        InvalidArgument: another type, a numpy dtype torch lacks, or a buffer
            that is not contiguous or has items wider than a byte.
    """
    if isinstance(data, torch.Tensor):
        return data
    if isinstance(data, np.ndarray):
        if views and any(stride < 0 for stride in data.strides):
            raise InvalidArgument(f"{what}: a numpy array with a negative stride cannot be viewed without a copy; "
                                  "pass np.ascontiguousarray(it)")
        return _from_numpy(data, what)
    if buffers and is_buffer(data):
        return _from_buffer(data, what)  # type: ignore[arg-type]
    kinds = BYTE_KINDS if buffers else ARRAY_KINDS
    raise InvalidArgument(f"{what}: expected {wants}, as {kinds}; got {type(data).__name__}")


def _from_numpy(array: NDArray, what: str) -> torch.Tensor:
    if any(stride < 0 for stride in array.strides):
        array = np.ascontiguousarray(array)  # torch views no negative stride: the one copy rule 2 allows
    try:
        with warnings.catch_warnings():
            # A read-only array makes torch warn that writing would be undefined; the
            # contract (as_tensor's Returns) forbids writing instead.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(array)
    except (TypeError, ValueError) as e:  # a dtype torch lacks (bfloat16 from ml_dtypes, object), byte order
        raise InvalidArgument(f"{what}: numpy array of dtype {array.dtype} has no torch equivalent ({e}); "
                              "pass uint8 bytes or float32/float16 values, or a torch tensor") from None


def _from_buffer(data: Buffer, what: str) -> torch.Tensor:
    view = memoryview(data)
    if not view.c_contiguous:
        raise InvalidArgument(f"{what}: expected a contiguous buffer")
    if view.itemsize != 1:
        raise InvalidArgument(f"{what}: buffer has {view.itemsize}-byte items (format {view.format!r}); "
                              "a buffer is read as uint8 bytes: pass the array itself")
    if not view.nbytes:  # torch.frombuffer refuses an empty buffer; there is nothing to share
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # bytes are read-only: as _from_numpy
        return torch.frombuffer(view.cast("B"), dtype=torch.uint8)


def to_numpy(t: torch.Tensor, *, read_only: bool = False) -> NDArray:
    """A CPU tensor as a numpy array over the same memory (rule 4), read-only when asked.

    A tensor made from a read-only array gives a writable one; `read_only` keeps
    the caller's promise visible on what comes back.
    """
    try:
        out = t.numpy()
    except TypeError:  # a dtype numpy lacks: bfloat16
        raise InvalidArgument(f"numpy has no {dtype_name(t)}: ask for float32 or float16, or pass torch tensors "
                              "to get torch tensors back") from None
    if read_only:
        out.flags.writeable = False
    return out


def is_read_only(data: object) -> bool:
    """Whether `data` is a numpy array that may not be written to."""
    return isinstance(data, np.ndarray) and not data.flags.writeable


def require_tensor(x: object, what: str) -> None:
    """Raise InvalidArgument unless `x` is a torch tensor (the fp4/fp8 pieces take nothing else)."""
    if not isinstance(x, torch.Tensor):
        raise InvalidArgument(f"{what}: expected a torch tensor, got {type(x).__name__} (the row functions of "
                              "kvstore.codec.rows take numpy arrays; torch.from_numpy converts one)")


def pairs_to_numpy(pairs: dict[int, tuple[torch.Tensor, torch.Tensor]], *,
                   read_only: bool = False) -> dict[int, tuple[NDArray, NDArray]]:
    """Per-layer tensor pairs as numpy arrays over the same memory."""
    return {layer: (to_numpy(a, read_only=read_only), to_numpy(b, read_only=read_only))
            for layer, (a, b) in pairs.items()}
