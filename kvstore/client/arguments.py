"""Checks on what a caller hands the clients, before anything goes on the wire.

Each check raises `InvalidArgument` naming the argument, what was given and what
is accepted, so a bad call never surfaces as a bare ValueError or TypeError from
protobuf or the hashing code. Accepted values are returned in the form the wire
needs (protobuf bytes fields take `bytes` only, repeated uint32 fields an array).
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.prefix import HASH_BYTES, MAX_TOKEN_ID

#: What a block or a snapshot may be, said in every refusal.
BUFFER_KINDS = "bytes, bytearray, memoryview, a 1-D uint8 numpy array or a uint8 torch tensor"


def integer(value: Any, name: str, *, least: int = 0, most: int | None = None) -> int:
    """`value` as an int in [least, most] (numpy integers accepted; bools and floats refused)."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if number < least or (most is not None and number > most):
        upper = "" if most is None else f", at most {most}"
        raise InvalidArgument(f"{name} = {number} is out of range: at least {least}{upper}")
    return number


def flag(value: Any, name: str) -> bool:
    """A bool argument (an int or a string is a mistake worth naming, not a truth value)."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be True or False, got {value!r}")
    return value


def keep_time(value: object, *, required: bool = False) -> float:
    """A pin's time: a finite Unix time in seconds (0: none, unless `required`).

    Raises:
        InvalidArgument: anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0 \
            or (required and value <= 0):
        raise InvalidArgument(f"keep_until_s must be a Unix time in seconds{'' if required else ' (0: none)'}, "
                              f"got {value!r}")
    return float(value)


def seconds(value: Any, name: str) -> float:
    """`value` as a finite number of seconds above zero."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{name} = {value!r} must be a finite number of seconds above 0")
    return float(value)


def token_ids(tokens: Any, name: str = "tokens") -> array[int]:
    """Token ids as a uint32 array (what the hashing and the wire both take)."""
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        raise InvalidArgument(f"{name} must be a sequence of integer token ids, got {type(tokens).__name__}")
    try:
        return array("I", tokens)
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"{name} must be integer token ids in [0, {MAX_TOKEN_ID}]: {exc}") from None


def text(value: Any, name: str) -> str:
    """`value` when it is a str."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a str, got {type(value).__name__}")
    return value


class NotExact(Exception):
    """`exact_hashes` found every item a hash, but not every one `bytes`: convert them with `hashes` (never
    raised to a caller of the clients)."""


def hash_list(values: Any, name: str) -> list[Any]:
    """`values` as a list, its items not checked yet (`exact_hashes` checks them; `hashes` does both)."""
    if isinstance(values, str | bytes | bytearray | memoryview):
        raise InvalidArgument(f"{name} must be a sequence of {HASH_BYTES}-byte hashes, got one {type(values).__name__}")
    return list(values)


def exact_hashes(values: list[Any], name: str) -> None:
    """Check that every item of `values` is a `bytes` hash: two C-speed passes, ~0.35 ms over a 2^20-token
    prompt's 16,384, which a Lookup runs while its first calls fly (docs/FLEET.md F83).

    Raises:
        InvalidArgument: an item is not a hash (the first named, as `hashes` names it).
        NotExact: every item is a hash, but some is a bytearray or a memoryview.
    """
    # Counted, not collected into sets: countOf's identity test needs no hashing (0.44 -> 0.35 ms for 16,384).
    if operator.countOf(map(type, values), bytes) == len(values) \
            and operator.countOf(map(len, values), HASH_BYTES) == len(values):
        return
    for i, value in enumerate(values):  # only to name what is wrong
        one_hash(value, f"{name}[{i}]")
    raise NotExact(name)


class ChainCheck:
    """A check of a chain's hashes (`exact_hashes`), run once: by the first call that takes it, while that call
    flies (docs/FLEET.md F83), or before any error the chain's items caused is raised, so that a bad hash is named
    rather than what it broke. None: nothing to check."""

    def __init__(self, check: Callable[[], object] | None = None) -> None:
        self._check = check

    def take(self) -> Callable[[], object] | None:
        """The check, if not run yet (whoever takes it runs it)."""
        check, self._check = self._check, None
        return check

    def settle(self) -> None:
        """Run the check if no one has (raising what it raises)."""
        check = self.take()
        if check is not None:
            check()


def hashes(values: Any, name: str) -> list[bytes]:
    """A list of 32-byte hashes (or snapshot keys) as bytes."""
    out = hash_list(values, name)
    try:
        exact_hashes(out, name)
    except NotExact:
        return [bytes(value) for value in out]
    return out


def one_hash(value: Any, name: str) -> bytes:
    """A 32-byte hash (or snapshot key) as bytes."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidArgument(f"{name} is a {type(value).__name__}; a hash is {HASH_BYTES} bytes")
    if len(value) != HASH_BYTES:
        raise InvalidArgument(f"{name} is {len(value)} bytes; a hash is {HASH_BYTES} bytes")
    return bytes(value)


def extra_keys(keys: Any) -> list[str | bytes]:
    """Extra keys: each a str or bytes-like (an int would hash as that many zero bytes)."""
    if isinstance(keys, str | bytes | bytearray | memoryview):
        raise InvalidArgument(f"extra_keys must be a sequence of keys, got one {type(keys).__name__}")
    out: list[str | bytes] = []
    for i, key in enumerate(keys):
        if isinstance(key, str | bytes):
            out.append(key)
        elif isinstance(key, bytearray | memoryview):
            out.append(bytes(key))
        else:
            raise InvalidArgument(f"extra_keys[{i}] is a {type(key).__name__}; an extra key is str or bytes")
    return out


def is_tensor(obj: Any) -> bool:
    """Whether `obj` is a torch tensor (checked without importing torch)."""
    return hasattr(obj, "dim") and hasattr(obj, "dtype")


def buffer(data: Any, name: str, size: int | None = None) -> bytes:
    """The bytes of one block or snapshot, `size` long when given.

    Accepts BUFFER_KINDS; tensors may live on any device (copied to host).
    """
    if isinstance(data, bytes):
        raw = data
    elif is_tensor(data):
        if str(data.dtype) != "torch.uint8":
            raise InvalidArgument(f"{name} must be uint8 (packed codes), got a {data.dtype} tensor")
        raw = bytes(data.contiguous().cpu().numpy().tobytes())
    else:
        try:
            view = memoryview(data)
        except TypeError:
            raise InvalidArgument(f"{name} is a {type(data).__name__}; accepted: {BUFFER_KINDS}") from None
        if view.itemsize != 1:
            raise InvalidArgument(f"{name} has {view.itemsize}-byte items (format {view.format!r}); "
                                  "blocks and snapshots are uint8 bytes")
        raw = view.tobytes()
    if size is not None and len(raw) != size:
        raise InvalidArgument(f"{name} is {len(raw)} bytes; it must be {size} bytes")
    return raw


def buffers(blocks: Any, name: str, size: int) -> list[bytes]:
    """Blocks as bytes, each `size` long: a sequence of buffers, or a uint8 [n, size] tensor or array."""
    if isinstance(blocks, str | bytes | bytearray | memoryview):
        raise InvalidArgument(f"{name} must be a sequence of blocks (or a uint8 [n, {size}] array), "
                              f"got one {type(blocks).__name__}")
    ndim = getattr(blocks, "ndim", None)
    if ndim is not None and ndim != 2:
        raise InvalidArgument(f"{name} as one array must be uint8 [n, {size}], got shape {tuple(blocks.shape)}")
    if is_tensor(blocks):
        if str(blocks.dtype) != "torch.uint8":
            raise InvalidArgument(f"{name} must be uint8 (packed codes), got a {blocks.dtype} tensor")
        blocks = blocks.contiguous().cpu().numpy()  # one copy to the host, not one per row
    try:
        items: Sequence[Any] = list(blocks)
    except TypeError:
        raise InvalidArgument(f"{name} must be a sequence of blocks, got {type(blocks).__name__}") from None
    return [buffer(block, f"{name}[{i}]", size) for i, block in enumerate(items)]
