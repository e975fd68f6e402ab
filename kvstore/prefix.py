"""Prefix addressing: token blocks hashed as a chain, the same on every machine.

A block's hash covers its parent's hash, its token ids and the request's extra
keys (multimodal input hashes, an adapter id, a salt), as canonical bytes fed to
SHA-256. The chain starts from a root that covers the geometry fingerprint and
the block size, so two layouts never share a hash: the fingerprint is the geometry's in its
record layout (kvstore.layout: the model's own rows keep theirs, an engine's records get
their own), so this root is the one seed through which a layout enters every chain. Tenants are kept apart one
level down, in the storage key (`storage_key`). Never Python's `hash()`: it is
salted per process.

Canonical bytes of a block (all integers unsigned little-endian):
    parent (32 B) | u32 token count | u32 token id ... | u32 extra-key count |
    SHA-256 of the extra keys' canonical bytes (32 B; only when the count is not 0)
where the extra keys' canonical bytes are `u32 count | (u32 length | bytes) ...`
(UTF-8 for text). Each extra key is so hashed once per chain, not once per block:
a chain's blocks mix in the 32-byte digest. Their count and size are still bounded
(`MAX_EXTRA_KEYS`, `MAX_EXTRA_KEY_BYTES`, `MAX_EXTRA_KEYS_BYTES`): they travel in
every Put; a longer key (a whole document) is to be hashed by the caller first.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence

from kvstore.errors import InvalidArgument

try:  # built at install from kvstore/native/_chainhash.c where OpenSSL's headers are; else the Python loop
    from kvstore.native._chainhash import chain as _native_chain
except ImportError:  # pragma: no cover - a build without it
    _native_chain = None

HASH_BYTES = 32
FINGERPRINT_BYTES = 8
NAMESPACE_ID_BYTES = 8
KEY_BYTES = FINGERPRINT_BYTES + NAMESPACE_ID_BYTES + HASH_BYTES
MAX_TOKEN_ID = 2**32 - 1
#: Most extra keys one chain is hashed with (multimodal input hashes, adapter, salt).
MAX_EXTRA_KEYS = 128
#: Most bytes of one extra key (UTF-8 for text): an image hash, an adapter name.
MAX_EXTRA_KEY_BYTES = 1024
#: Most bytes of all of a chain's extra keys together (they travel with every Put).
MAX_EXTRA_KEYS_BYTES = 8192

ExtraKey = str | bytes


def _check_block_tokens(block_tokens: int) -> None:
    # Hashed as a u32; 0 would make every block empty.
    if not 1 <= block_tokens <= MAX_TOKEN_ID:
        raise InvalidArgument(f"block_tokens must be in [1, {MAX_TOKEN_ID}], got {block_tokens}")


def root_hash(fingerprint: bytes, block_tokens: int) -> bytes:
    """The parent hash of a chain's first block, for one layout and block size."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise InvalidArgument(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    _check_block_tokens(block_tokens)
    return hashlib.sha256(b"kvstore.prefix.v1/root\0" + fingerprint + struct.pack("<I", block_tokens)).digest()


def encode_extra_keys(extra_keys: Sequence[ExtraKey]) -> bytes:
    """Canonical bytes of the extra keys, appended to every block's input.

    Raises:
        InvalidArgument: more than `MAX_EXTRA_KEYS` keys, a key longer than
            `MAX_EXTRA_KEY_BYTES`, or more than `MAX_EXTRA_KEYS_BYTES` in all.
    """
    if len(extra_keys) > MAX_EXTRA_KEYS:
        raise InvalidArgument(f"extra_keys has {len(extra_keys)} keys; at most {MAX_EXTRA_KEYS} "
                              "(kvstore.prefix.MAX_EXTRA_KEYS)")
    parts = [struct.pack("<I", len(extra_keys))]
    total = 0
    for i, key in enumerate(extra_keys):
        raw = _key_bytes(i, key)
        if len(raw) > MAX_EXTRA_KEY_BYTES:
            raise InvalidArgument(f"extra_keys[{i}] is {len(raw)} bytes; an extra key is at most "
                                  f"{MAX_EXTRA_KEY_BYTES} bytes (kvstore.prefix.MAX_EXTRA_KEY_BYTES)",
                                  hint="hash a long key (a document, an image) and send its digest")
        total += len(raw)
        if total > MAX_EXTRA_KEYS_BYTES:
            raise InvalidArgument(f"extra_keys hold more than {MAX_EXTRA_KEYS_BYTES} bytes in all "
                                  f"({total} by key {i}); at most {MAX_EXTRA_KEYS_BYTES} "
                                  "(kvstore.prefix.MAX_EXTRA_KEYS_BYTES)",
                                  hint="hash long keys and send their digests")
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def extra_keys_tail(extra_keys: Sequence[ExtraKey]) -> bytes:
    """What every block of a chain appends for its extra keys: their count, then (if any)
    the SHA-256 of their canonical bytes, computed once here for the whole chain."""
    if not extra_keys:
        return struct.pack("<I", 0)
    encoded = encode_extra_keys(extra_keys)
    return encoded[:4] + hashlib.sha256(encoded).digest()


def _key_bytes(index: int, key: object) -> bytes:
    if isinstance(key, str):
        try:
            return key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"extra_keys[{index}] is not valid text: {exc.reason}") from None
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    raise InvalidArgument(f"extra_keys[{index}] is a {type(key).__name__}; an extra key is str or bytes")


def token_bytes(tokens: Sequence[int] | Iterable[int]) -> bytes:
    """Token ids as little-endian uint32.

    A uint32 `array.array`, or a 1-D integer numpy array or CPU tensor, is converted
    without a Python loop (a million ids: ~0.2 ms rather than ~15 ms for a list);
    the bytes are the same either way.

    Raises:
        InvalidArgument: a token id is negative or does not fit 32 bits.
    """
    fast = _buffer_token_bytes(tokens)
    if fast is not None:
        return fast
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidArgument(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
    if arr.itemsize != 4:  # pragma: no cover - no such platform in use
        raise InvalidArgument("this platform has no 4-byte unsigned int array")
    if sys.byteorder == "big":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def token_buffer(tokens: Sequence[int] | Iterable[int]) -> bytes | memoryview:
    """`token_bytes(tokens)`, or a view of `tokens`' own memory where it already holds exactly those
    bytes (a C-contiguous little-endian uint32 numpy array or `array("I")`): no copy.

    A view is valid while `tokens` is unchanged; callers that keep the bytes copy them.
    """
    if isinstance(tokens, array) and tokens.typecode == "I" and tokens.itemsize == 4 and sys.byteorder == "little":
        return memoryview(tokens).cast("B")
    dtype, flags = getattr(tokens, "dtype", None), getattr(tokens, "flags", None)
    if (getattr(dtype, "str", "") == "<u4" and getattr(tokens, "ndim", None) == 1 and not hasattr(tokens, "detach")
            and getattr(flags, "c_contiguous", False)):  # a numpy array (a tensor goes through token_bytes)
        return memoryview(tokens).cast("B")  # type: ignore[arg-type]
    return token_bytes(tokens)


def _buffer_token_bytes(tokens: object) -> bytes | None:
    """`token_bytes` of an array-backed sequence in one C pass, or None for anything else."""
    if isinstance(tokens, array):
        if tokens.typecode != "I" or tokens.itemsize != 4 or sys.byteorder != "little":
            return None  # other widths and signs go through the checked conversion
        return tokens.tobytes()
    dtype = getattr(tokens, "dtype", None)
    if dtype is None or getattr(tokens, "ndim", None) != 1:
        return None
    if hasattr(tokens, "detach"):  # a torch tensor: its numpy view when it is on the CPU
        if getattr(tokens.device, "type", "") != "cpu" or not hasattr(tokens, "numpy"):  # type: ignore[attr-defined]
            return None
        try:
            tokens = tokens.detach().numpy()  # type: ignore[attr-defined]
        except (RuntimeError, TypeError):  # a dtype numpy cannot hold: the checked path says what
            return None
        dtype = tokens.dtype  # type: ignore[attr-defined]
    if getattr(dtype, "kind", "") not in ("i", "u") or not hasattr(tokens, "astype"):
        return None  # floats, bools and objects: the checked path refuses or converts them as before
    if len(tokens) and (dtype.kind == "i" or dtype.itemsize > 4):  # type: ignore[arg-type]
        low, high = int(tokens.min()), int(tokens.max())  # type: ignore[attr-defined]
        if low < 0 or high > MAX_TOKEN_ID:
            raise InvalidArgument(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: got {low if low < 0 else high}")
    return tokens.astype("<u4", copy=False).tobytes()  # type: ignore[attr-defined,no-any-return]


def chain_hashes(
    tokens: Sequence[int],
    *,
    block_tokens: int,
    parent: bytes,
    extra_keys: Sequence[ExtraKey] = (),
) -> list[bytes]:
    """Hashes of every full block of `tokens`, chained from `parent`.

    A trailing partial block has no hash: only full blocks are addressable.

    Args:
        tokens: the token ids, from the block after `parent`.
        block_tokens: tokens per block.
        parent: the hash before the first block (`root_hash` at a prompt start).
        extra_keys: keys mixed into every block (image hashes, adapter, salt).

    Returns:
        One 32-byte hash per full block, in order.

    Raises:
        InvalidArgument: a bad parent, block size, token id or extra key
            (`encode_extra_keys` names the limits).
    """
    if len(parent) != HASH_BYTES:
        raise InvalidArgument(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    _check_block_tokens(block_tokens)
    return chain_hashes_of_bytes(token_bytes(tokens), block_tokens=block_tokens, parent=parent,
                                 tail=extra_keys_tail(extra_keys))


def chain_hashes_of_bytes(raw: bytes | memoryview, *, block_tokens: int, parent: bytes, tail: bytes) -> list[bytes]:
    """`chain_hashes` of tokens already in `token_bytes` form, with the chain's `extra_keys_tail`.

    For callers that keep the bytes (the client's chain memo, kvstore.client.chain_memo);
    the arguments are not checked again here.
    """
    head = struct.pack("<I", block_tokens)
    step = 4 * block_tokens
    if _native_chain is not None:  # the same bytes hashed in C: ~0.7 us a block against Python's ~3 (cold)
        return _native_chain(raw, step, parent, head, tail)  # type: ignore[no-any-return]
    hashes: list[bytes] = []
    sha256 = hashlib.sha256
    for start in range(0, len(raw) - step + 1, step):
        parent = sha256(parent + head + raw[start : start + step] + tail).digest()
        hashes.append(parent)
    return hashes


def namespace_id(namespace: str) -> bytes:
    """8 bytes naming a tenant inside storage keys."""
    return hashlib.sha256(b"kvstore.namespace.v1\0" + namespace.encode()).digest()[:NAMESPACE_ID_BYTES]



class BlockScope:
    """Where a request's blocks live: one layout (geometry fingerprint) and one tenant.

    Two scopes never produce the same storage key, whatever the hashes.
    """

    __slots__ = ("fingerprint", "namespace", "prefix")

    def __init__(self, fingerprint: bytes, namespace: str) -> None:
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise InvalidArgument(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.prefix = fingerprint + namespace_id(namespace)

    def key(self, block_hash: bytes) -> bytes:
        """The storage key of `block_hash` in this scope."""
        if len(block_hash) != HASH_BYTES:
            raise InvalidArgument(f"block hash must be {HASH_BYTES} bytes, got {len(block_hash)}")
        return self.prefix + block_hash
