"""Everything that reads bytes or wire values, fuzzed: the block codec, the FP8/FP4
decoders, sealed SWA records, snapshot keys and prefix hashing. Bad input raises
a kvstore.errors class (or, for a sealed record, reads as None), never another
exception; input of the right shape always decodes. Bounded for CI."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstore.codec import block_codec, rows
from kvstore.codec.snapshot import decode_snapshot, split_snapshot
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.geometry import TINY, V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes, encode_extra_keys, root_hash, token_bytes
from kvstore.swa_snapshot import HEADER_BYTES, checksum, seal, snapshot_bytes, snapshot_key, snapshot_keys, unseal

FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BLOCK_TOKENS = 16
BLOCK_BYTES = V4_1_FLASH.block_bytes(BLOCK_TOKENS)
#: Snapshots of the tiny fixture geometry (5 layers, window 8) stay cheap to build.
SNAPSHOT_T = 9
SNAPSHOT_BYTES = snapshot_bytes(TINY, SNAPSHOT_T)

#: Seeds of bytes too long for hypothesis to draw one by one (a block is 14 KiB).
seeds = st.integers(0, 2**32)
ints = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 16, 64, 2**32 - 1, 2**32, 2**64]))


def refused_or_done(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(...)`, or None when it refuses with a kvstore error; anything else fails the test."""
    try:
        return fn(*args, **kwargs)
    except KVStoreError:
        return None


@st.composite
def buffers(draw: st.DrawFn, size: int) -> Any:
    """Something a caller might hand a decoder: bytes of `size` or near it, in every buffer
    type and tensor layout, or not a buffer at all."""
    rng = random.Random(draw(seeds))
    n = draw(st.one_of(st.just(size), st.integers(0, size + 8)))
    raw = rng.randbytes(n)
    kind = draw(st.sampled_from(["bytes", "bytearray", "memoryview", "strided", "tensor", "tensor2d",
                                 "tensor_int8", "tensor_strided", "numpy", "str", "int", "none", "list"]))
    if kind == "bytes":
        return raw
    if kind == "bytearray":
        return bytearray(raw)
    if kind == "memoryview":
        return memoryview(raw)
    if kind == "strided":
        return memoryview(raw + raw)[::2]
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    if kind == "tensor":
        return t
    if kind == "tensor2d":
        return t.view(1, -1)
    if kind == "tensor_int8":
        return t.view(torch.int8)
    if kind == "tensor_strided":
        return torch.cat((t, t))[::2]
    if kind == "numpy":
        return np.frombuffer(raw, dtype=np.uint8)
    if kind == "str":
        return raw.decode("latin-1")
    if kind == "int":
        return n
    if kind == "list":
        return list(raw)
    return None


# -- the block codec -----------------------------------------------------------

@FUZZ
@given(data=buffers(BLOCK_BYTES), block_tokens=st.one_of(st.just(BLOCK_TOKENS), ints))
@example(data=bytes(BLOCK_BYTES), block_tokens=0)
@example(data=bytes(BLOCK_BYTES), block_tokens=-BLOCK_TOKENS)
def test_block_decoding_refuses_bad_input_with_a_kvstore_error(data: Any, block_tokens: int) -> None:
    refused_or_done(block_codec.split_block, V4_1_FLASH, data, block_tokens)
    refused_or_done(block_codec.decode_block, V4_1_FLASH, data, block_tokens)


@FUZZ
@given(seed=seeds)
def test_any_block_of_the_right_size_decodes(seed: int) -> None:
    data = random.Random(seed).randbytes(BLOCK_BYTES)  # any bits: NaN scales decode to NaN, they do not raise
    decoded = block_codec.decode_block(V4_1_FLASH, data, BLOCK_TOKENS)
    assert sorted(decoded) == [g.layer for g in V4_1_FLASH.global_layers]


@FUZZ
@given(data=buffers(64), expected=st.integers(-4, 80))
@example(data=b"", expected=0)
def test_as_uint8_refuses_bad_buffers_with_a_kvstore_error(data: Any, expected: int) -> None:
    out = refused_or_done(block_codec.as_uint8, data, expected_bytes=expected, what="fuzz")
    assert out is None or (out.dtype == torch.uint8 and out.numel() == expected)


# -- SWA snapshots and the FP4/FP8 dequantizers --------------------------------

@FUZZ
@given(data=buffers(SNAPSHOT_BYTES), position=st.one_of(st.just(SNAPSHOT_T), ints))
def test_snapshot_splitting_refuses_bad_input_with_a_kvstore_error(data: Any, position: int) -> None:
    out = refused_or_done(split_snapshot, data, position, TINY)
    assert out is None or out[0].shape == (TINY.num_layers, min(position, TINY.window), TINY.window_row_bytes)
    decoded = refused_or_done(decode_snapshot, data, position, TINY)
    assert decoded is None or decoded[0].shape == (TINY.num_layers, min(position, TINY.window), TINY.head_dim)


@FUZZ
@given(seed=seeds, position=st.integers(1, 3 * TINY.window))
def test_any_snapshot_of_the_right_size_splits_and_decodes(seed: int, position: int) -> None:
    data = random.Random(seed).randbytes(snapshot_bytes(TINY, position))
    rows, tail = split_snapshot(data, position, TINY)
    assert rows.shape == (TINY.num_layers, min(position, TINY.window), TINY.window_row_bytes)
    assert (tail is None) == (position % 2 == 0)
    values, _ = decode_snapshot(data, position, TINY)
    assert values.shape == (TINY.num_layers, min(position, TINY.window), TINY.head_dim)


_DTYPES = [torch.uint8, torch.int8, torch.float32, torch.float16, torch.float8_e4m3fn, torch.int64]
shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    raw = torch.randint(0, 256, draw(shapes), dtype=torch.uint8)
    dtype = draw(st.sampled_from(_DTYPES))
    return raw.view(dtype) if dtype.itemsize == 1 else raw.to(dtype)


@FUZZ
@given(rows_in=tensors(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_row_decoders_take_any_tensor_or_refuse_it_with_a_kvstore_error(rows_in: torch.Tensor,
                                                                         dtype: torch.dtype) -> None:
    refused_or_done(rows.decode_compressed_kv_rows, rows_in, dtype)
    refused_or_done(rows.decode_indexer_key_rows, rows_in, dtype)
    refused_or_done(rows.decode_swa_rows, rows_in, dtype)


# -- sealed SWA records ----------------------------------------------------------

@FUZZ
@given(record=st.binary(max_size=HEADER_BYTES + 40), seed=seeds, position=st.integers(1, 40))
@example(record=b"abc", seed=0, position=1)
def test_a_damaged_record_reads_as_none(record: bytes, seed: int, position: int) -> None:
    for candidate in (record, seal(TINY.fingerprint, position, record, checksum(record)),
                      seal(TINY.fingerprint, position, random.Random(seed).randbytes(snapshot_bytes(TINY, position)),
                           seed)):
        opened = unseal(candidate, TINY)
        assert opened is None or (len(opened.data) == snapshot_bytes(TINY, opened.position)
                                  and checksum(opened.data) == opened.checksum)


@FUZZ
@given(seed=seeds, position=st.integers(1, 20), flip=st.integers(0, 10**6))
def test_a_sealed_record_opens_and_any_flipped_bit_is_caught(seed: int, position: int, flip: int) -> None:
    data = random.Random(seed).randbytes(snapshot_bytes(TINY, position))
    record = seal(TINY.fingerprint, position, data, checksum(data))
    opened = unseal(record, TINY)
    assert opened is not None and (opened.data, opened.checksum, opened.position) == (data, checksum(data), position)
    # Any bit, header included: the header is checked as the data is (a flipped T of the same size too).
    bit = flip % (8 * HEADER_BYTES) if flip % 2 else flip % (8 * len(record))
    damaged = bytearray(record)
    damaged[bit // 8] ^= 1 << (bit % 8)
    assert unseal(bytes(damaged), TINY) is None


# -- prefix hashing and snapshot keys: what a client hands them -------------------

extra_keys = st.lists(st.one_of(st.text(max_size=8), st.binary(max_size=8), ints, st.none(),
                                st.just("\ud800"), st.binary(min_size=1100, max_size=1100)), max_size=4)
tokens = st.one_of(st.lists(ints, max_size=40), st.lists(st.integers(0, 2**32 - 1), max_size=40),
                   st.lists(st.floats(), max_size=3), st.text(max_size=3))
hashes = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40))


@FUZZ
@given(tokens=tokens, block_tokens=ints, parent=hashes, keys=extra_keys)
@example(tokens=list(range(32)), block_tokens=0, parent=bytes(32), keys=[])
@example(tokens=list(range(32)), block_tokens=2**32, parent=bytes(32), keys=[])
@example(tokens=[0], block_tokens=16, parent=bytes(32), keys=["\ud800"])
def test_chain_hashing_refuses_bad_input_with_a_kvstore_error(tokens: Any, block_tokens: int, parent: bytes,
                                                               keys: list[Any]) -> None:
    out = refused_or_done(chain_hashes, tokens, block_tokens=block_tokens, parent=parent, extra_keys=keys)
    assert out is None or all(len(h) == 32 for h in out)
    refused_or_done(token_bytes, tokens)
    refused_or_done(encode_extra_keys, keys)


@pytest.mark.parametrize("key", [5, None, 1.5, ["a"]])
def test_an_extra_key_is_text_or_bytes(key: Any) -> None:
    # bytes(5) is five zero bytes: an int would have been hashed as one (bytes(10**9): a gigabyte).
    with pytest.raises(InvalidArgument, match="extra_keys\\[1\\] is a"):
        encode_extra_keys(["ok", key])


@FUZZ
@given(fingerprint=st.binary(max_size=10), block_tokens=ints, namespace=st.text(max_size=8), block_hash=hashes)
@example(fingerprint=bytes(8), block_tokens=2**32, namespace="", block_hash=bytes(32))
@example(fingerprint=bytes(8), block_tokens=-1, namespace="", block_hash=bytes(32))
def test_roots_and_storage_keys_refuse_bad_input_with_a_kvstore_error(fingerprint: bytes, block_tokens: int,
                                                                       namespace: str, block_hash: bytes) -> None:
    refused_or_done(root_hash, fingerprint, block_tokens)
    scope = refused_or_done(BlockScope, fingerprint, namespace)
    if scope is not None:
        refused_or_done(scope.key, block_hash)


@FUZZ
@given(anchor=hashes, partial=tokens, position=ints, keys=extra_keys,
       positions=st.lists(ints, max_size=3), block_tokens=ints)
@example(anchor=bytes(32), partial=[], position=2**64, keys=[], positions=[], block_tokens=16)
def test_snapshot_keys_refuse_bad_input_with_a_kvstore_error(anchor: bytes, partial: Any, position: int,
                                                              keys: list[Any], positions: list[int],
                                                              block_tokens: int) -> None:
    refused_or_done(snapshot_key, anchor, partial, position, keys)
    refused_or_done(snapshot_keys, list(range(40)), positions, block_tokens=block_tokens, root=anchor,
                    extra_keys=keys)
