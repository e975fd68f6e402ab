"""Prefix addressing: published test vectors, chaining, stability across processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore.errors import InvalidArgument
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes, namespace_id, root_hash

# The vectors published in docs/PREFIX_HASHING.md. If these change, every stored
# block becomes unreachable: treat a failure here as a wire-format break.
FINGERPRINT = "2d76cb51b8017512"
ROOT_64 = "82cde81d537d0fd5b51d4a146b2fa897bde5a96487f1643ee8a5fe22097f9aeb"
CHAIN_0_127 = [
    "d3f61eb18edc8578b4624b112a82736b82458097d7812fb482d55b814fd2a9a4",
    "a96b5f6a85a7af28d5e4961fb12c7634d7025b97499a49f6957a15956f0dcb43",
]
CHAIN_0_127_EXTRA = [
    "bf04e9c3e0d3f40313db6b5b744d49458d5d1e176a2b491438bf1cdbb18dad06",
    "5b012117dcf72202a62fd938a8228cb81d48093f6913e3b38d44faf74df23aa2",
]
NAMESPACE_DEFAULT = "a72e661c53e9f74e"


def test_published_vectors() -> None:
    assert V4_1_FLASH.fingerprint.hex() == FINGERPRINT
    root = root_hash(V4_1_FLASH.fingerprint, 64)
    assert root.hex() == ROOT_64
    assert [h.hex() for h in chain_hashes(list(range(128)), block_tokens=64, parent=root)] == CHAIN_0_127
    extra = chain_hashes(list(range(128)), block_tokens=64, parent=root, extra_keys=["lora:sql-adapter", b"\0\1"])
    assert [h.hex() for h in extra] == CHAIN_0_127_EXTRA
    assert namespace_id("default").hex() == NAMESPACE_DEFAULT


def test_vectors_follow_the_published_formula() -> None:
    """docs/PREFIX_HASHING.md's formula, transcribed with hashlib alone."""
    import hashlib
    import struct

    root = bytes.fromhex(ROOT_64)
    keys = [b"lora:sql-adapter", b"\0\1"]
    encoded = struct.pack("<I", len(keys)) + b"".join(struct.pack("<I", len(k)) + k for k in keys)
    tail = struct.pack("<I", len(keys)) + hashlib.sha256(encoded).digest()  # the keys hashed once per chain
    parent, out = root, []
    for start in (0, 64):
        tokens = struct.pack("<64I", *range(start, start + 64))
        parent = hashlib.sha256(parent + struct.pack("<I", 64) + tokens + tail).digest()
        out.append(parent.hex())
    assert out == CHAIN_0_127_EXTRA


def test_extra_keys_are_hashed_once_per_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 KiB of keys on 50 blocks: the keys' bytes go through SHA-256 once; each block's input stays small."""
    import hashlib

    from kvstore import prefix

    inputs: list[int] = []
    real = hashlib.sha256

    def counting_sha256(data: bytes = b"") -> object:
        inputs.append(len(data))
        return real(data)

    monkeypatch.setattr(prefix.hashlib, "sha256", counting_sha256)
    hashes = chain_hashes(list(range(64 * 50)), block_tokens=64, parent=bytes(32), extra_keys=["k" * 1024] * 8)
    block_input = 32 + 4 + 4 * 64 + 4 + 32  # parent, block_tokens, token ids, key count, keys' digest
    assert len(hashes) == 50
    assert sorted(inputs)[:-1] == [block_input] * 50 and sum(inputs) < 50 * block_input + 9000


def test_same_keys_in_another_process() -> None:
    code = ("from kvstore.geometry import V4_1_FLASH as g; from kvstore.prefix import *;"
            "print(chain_hashes(list(range(128)), block_tokens=64, parent=root_hash(g.fingerprint, 64))[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=None).stdout.strip()
    assert out == CHAIN_0_127[1]


def test_each_hash_covers_its_whole_prefix() -> None:
    root = root_hash(V4_1_FLASH.fingerprint, 16)
    a = chain_hashes(list(range(48)), block_tokens=16, parent=root)
    b = chain_hashes([999, *range(1, 48)], block_tokens=16, parent=root)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))  # one early token changes all


def test_partial_block_has_no_hash_and_chain_resumes() -> None:
    root = root_hash(V4_1_FLASH.fingerprint, 16)
    whole = chain_hashes(list(range(40)), block_tokens=16, parent=root)
    assert len(whole) == 2
    tail = chain_hashes(list(range(16, 40)), block_tokens=16, parent=whole[0])
    assert tail == whole[1:]


def test_layouts_never_share_a_root() -> None:
    assert root_hash(V4_1_FLASH.fingerprint, 64) != root_hash(V4_1_FLASH.fingerprint, 128)
    assert root_hash(V4_1_FLASH.fingerprint, 64) != root_hash(b"\0" * 8, 64)


def test_tenants_never_share_a_key() -> None:
    h = b"\1" * 32
    a, b = BlockScope(V4_1_FLASH.fingerprint, "alice"), BlockScope(V4_1_FLASH.fingerprint, "bob")
    assert a.key(h) != b.key(h) and a.key(h)[:8] == V4_1_FLASH.fingerprint


def test_bad_tokens_and_hashes_are_rejected() -> None:
    root = root_hash(V4_1_FLASH.fingerprint, 16)
    with pytest.raises(InvalidArgument, match="token ids"):
        chain_hashes([-1] * 16, block_tokens=16, parent=root)
    with pytest.raises(InvalidArgument, match="token ids"):
        chain_hashes([2**32] * 16, block_tokens=16, parent=root)
    with pytest.raises(InvalidArgument, match="32 bytes"):
        chain_hashes([1] * 16, block_tokens=16, parent=b"short")
    with pytest.raises(InvalidArgument, match="32 bytes"):
        BlockScope(V4_1_FLASH.fingerprint, "t").key(b"short")
