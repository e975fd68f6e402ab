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
FINGERPRINT = "f303fd5c6387cfaa"
ROOT_64 = "aeb7540a3f94a79108002b2b4402455086d58d9b970818053bf64d92e6cee2dd"
CHAIN_0_127 = [
    "ca29109fe22dc872cdc29e64112aeb9a088b60c3482de20786379546843aadde",
    "8fbec87c4e55bd8e7521cd4644b84e820a0c5ead1b61f66d7f099ccc42b6dfad",
]
CHAIN_0_127_EXTRA = [
    "6efb458f4601d5cf077bea70371c4c5477f01473f6f71fd206f77cc25467e47c",
    "26ad33eb8af12627e49c507c66b5fda6d0e587d2b6126d0f39fecea51aad64fe",
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
    monkeypatch.setattr(prefix, "_native_chain", None)  # the Python loop's inputs (the native one's: below)
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


def test_native_chain_hashes_are_the_python_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvstore.native._chainhash hashes exactly the bytes the Python loop does: fuzzed block sizes, lengths (a
    partial last block), parents, extra-key tails and buffer kinds, against the loop, and the vectors above."""
    import os
    import random

    from kvstore import prefix

    native = prefix._native_chain
    if native is None:
        pytest.skip("kvstore.native._chainhash was not built")
    rng = random.Random(25)
    cases = []
    for trial in range(200):
        block_tokens = rng.choice([1, 3, 16, 64, 256])
        raw = os.urandom(rng.randrange(0, 40) * 4 * block_tokens + rng.randrange(0, 4 * block_tokens))
        tail = prefix.extra_keys_tail(["k" * rng.randrange(0, 300)] if trial % 2 else [])
        cases.append((memoryview(raw) if trial % 3 else raw, block_tokens, os.urandom(32), tail))
    got = [prefix.chain_hashes_of_bytes(r, block_tokens=b, parent=p, tail=t) for r, b, p, t in cases]
    vectors = chain_hashes(list(range(128)), block_tokens=64, parent=root_hash(V4_1_FLASH.fingerprint, 64))
    monkeypatch.setattr(prefix, "_native_chain", None)
    assert got == [prefix.chain_hashes_of_bytes(r, block_tokens=b, parent=p, tail=t) for r, b, p, t in cases]
    assert [h.hex() for h in vectors] == CHAIN_0_127
    assert any(got) and not all(got)  # chains of blocks and prompts shorter than a block, both
