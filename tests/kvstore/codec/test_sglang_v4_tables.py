"""The table-driven SGLang v4 transcode (kvstore/codec/sglang_v4.py) against the float one it replaced, bit for bit.

`sglang_v4_reference` is the implementation before the rewrite (its store math checked against SGLang's
own fake-quant and a transcription of `store.cuh` in tests/integrations/test_sglang_v4_share.py). Here,
on the CPU, every path of the new one gives its bytes: the eager gathers (`encode_rows`, whole blocks
written in place), the one-byte-per-element formulation torch.compile fuses on CUDA (`_fused_blocks`,
`_fused_recover_blocks`, run eagerly here), the recovery's native rows, exactness and collision counts,
on realistic rows, raw-latent rows, damaged rows, collisions and random bytes (every scale byte, NaN
ones included). The CUDA side, compiled, is tests/kvstore/codec/test_sglang_v4_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.bench.codec import realistic
from kvstore.bench.transcode import blocks as transcode_blocks
from kvstore.codec import sglang_v4 as codec
from kvstore.codec.block_codec import split_blocks
from kvstore.codec.rows import compressed_kv_rows
from kvstore.geometry import resolve
from tests.kvstore.codec import sglang_v4_reference as reference

MODEL = resolve("deepseek-v4.1-flash")
TINY = codec.RowShape(width=128, rope=64)
CPU = torch.device("cpu")


def junk(n: int, width: int, seed: int) -> torch.Tensor:
    """Random bytes [n, width]: every code and scale byte (NaN scales 0x7F / 0xFF, negative scales) occurs."""
    return torch.randint(0, 256, (n, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def engine_rows(n: int, seed: int) -> torch.Tensor:
    """V4 rows [n, 584] of every kind the save sees: SGLang's rows of realistic latents, raw-latent FP8 rows
    (vLLM-like: no FP4 step), rows with one byte flipped, random bytes, sparse rows (collisions), and the
    known collision pair (scales 1.625 and 1.75 with one code 6: HOPPER_LAYOUTS.md section 3)."""
    g = torch.Generator().manual_seed(seed)
    x = realistic(n, 512, g)
    rows = reference.encode_rows(compressed_kv_rows(x))
    rows[1::7] = reference.store_rows(x[1::7].to(torch.bfloat16))
    flip = torch.arange(2, n, 11)
    rows[flip, torch.randint(0, 584, (len(flip),), generator=g)] ^= 1
    rows[3::13] = junk(len(range(3, n, 13)), 584, seed)
    sparse = x[: n // 4] * (torch.rand(n // 4, 512, generator=g) < 0.1)
    pair = torch.zeros(2, 512)
    pair[0, 0], pair[1, 0] = 9.75, 10.5
    extra = reference.encode_rows(compressed_kv_rows(torch.cat((sparse, pair))))
    return torch.cat((rows, extra))


@pytest.mark.parametrize("shape", [codec.RowShape(), TINY], ids=["512", "128"])
def test_the_load_encoding_is_the_float_store_of_every_byte(shape: codec.RowShape) -> None:
    native = torch.cat((junk(3000, shape.native_bytes, 1),
                        compressed_kv_rows(realistic(500, shape.width, torch.Generator().manual_seed(2)))))
    ref = reference.encode_rows(native, reference.RowShape(shape.width, shape.rope))
    assert torch.equal(codec.encode_rows(native, shape), ref)
    # The formulation compiled on CUDA, run eagerly: the same bytes.
    assert torch.equal(codec._fused_rows(native, codec._byte_tables(CPU), shape), ref)


def test_rows_are_written_in_place_into_views_even_at_odd_offsets() -> None:
    native = junk(64, 288, 3)
    ref = reference.encode_rows(native)
    big = torch.full((64, 1 + 584 + 3), 0xAA, dtype=torch.uint8)
    out = codec.encode_rows(native, out=big[:, 1:585])          # odd offset: the byte-wise copies
    assert out.data_ptr() == big[:, 1:].data_ptr() and torch.equal(big[:, 1:585], ref)
    assert (big[:, 0] == 0xAA).all() and (big[:, 585:] == 0xAA).all()
    even = torch.zeros(64, 2 + 584, dtype=torch.uint8)
    codec.encode_rows(native, out=even[:, 2:])
    assert torch.equal(even[:, 2:], ref)
    with pytest.raises(codec.InvalidArgument, match="encode_rows out"):
        codec.encode_rows(native, out=torch.empty(63, 584, dtype=torch.uint8))


def test_blocks_encode_as_before_on_both_paths() -> None:
    blocks = junk(12, MODEL.block_bytes(64), 4)
    ref = reference.native_blocks_to_v4(MODEL, blocks, 64)
    assert torch.equal(codec.native_blocks_to_v4(MODEL, blocks, 64, fused=False), ref)
    assert torch.equal(codec._fused_blocks(blocks, codec._byte_tables(CPU), MODEL, 64), ref)
    assert codec.native_blocks_to_v4(MODEL, blocks[:0], 64).shape == (0, ref.shape[1])


@pytest.mark.parametrize("alternatives", [False, True])
def test_the_recovery_finds_the_same_rows_exactness_and_collisions(alternatives: bool) -> None:
    rows = engine_rows(800, 5)
    ref = reference.recover_rows(rows, alternatives=alternatives)
    got = codec.recover_rows(rows, alternatives=alternatives)
    assert torch.equal(got.exact, ref.exact) and torch.equal(got.ambiguous, ref.ambiguous)
    assert torch.equal(got.native, ref.native)            # every row, inexact ones too
    # The inputs reach every branch: exact, inexact, and (asked) collisions.
    assert 0 < int(ref.exact.sum()) < len(rows)
    assert bool(ref.ambiguous.any()) == alternatives and bool(ref.ambiguous[-2:].all()) == alternatives
    tiny = junk(400, TINY.v4_bytes, 6)
    tiny[:200] = reference.encode_rows(junk(200, TINY.native_bytes, 7), reference.RowShape(128, 64))
    ref = reference.recover_rows(tiny, reference.RowShape(128, 64), alternatives=alternatives)
    got = codec.recover_rows(tiny, TINY, alternatives=alternatives)
    assert torch.equal(got.exact, ref.exact) and torch.equal(got.native, ref.native)
    assert torch.equal(got.ambiguous, ref.ambiguous)


def test_blocks_recover_as_before_with_their_counts_on_both_paths() -> None:
    engine = codec.engine_geometry(MODEL)
    blocks = reference.native_blocks_to_v4(MODEL, junk(6, MODEL.block_bytes(64), 8), 64)
    blocks = torch.cat((blocks, transcode_blocks(6 * 64, "cpu")[1]))          # SGLang's rows of realistic latents
    kv = split_blocks(engine, blocks, 64)[MODEL.kv_source_layers[0]][0]
    kv[7, 3, 10] ^= 1                                        # one row of block 7 damaged
    ref = reference.v4_blocks_to_native(MODEL, blocks, 64)
    got = codec.v4_blocks_to_native(MODEL, blocks, 64, fused=False)
    assert torch.equal(got.native, ref.native) and torch.equal(got.exact, ref.exact)
    assert (got.rows, got.exact_rows, got.ambiguous_rows) == (ref.rows, ref.exact_rows, ref.ambiguous_rows)
    assert got.exact[6] and not got.exact[7] and got.exact[8:].all() and ref.exact_rows < ref.rows
    native, exact, counts = codec._fused_recover_blocks(blocks, codec._recover_tables(CPU), codec._byte_tables(CPU),
                                                        MODEL, 64)
    assert torch.equal(native, ref.native) and torch.equal(exact, ref.exact)
    assert counts.tolist() == [ref.rows, ref.exact_rows, ref.ambiguous_rows]
