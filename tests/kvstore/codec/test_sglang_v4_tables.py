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

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

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


#: The float ops whose NaN results CUDA canonicalizes (arithmetic; not copies, views, max or clamp).
_ARITHMETIC = {torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.mul, torch.mul, torch.Tensor.__truediv__,
               torch.Tensor.div, torch.div, torch.true_divide, torch.Tensor.__rtruediv__, torch.Tensor.__add__,
               torch.Tensor.__radd__, torch.Tensor.add, torch.add, torch.Tensor.__sub__, torch.Tensor.sub, torch.sub}
_DIVISION = {torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide}


class CudaFloat(TorchFunctionMode):
    """Torch's float ops on the CPU with CUDA's bits where they differ: float32 arithmetic gives the canonical
    NaN 0x7FFFFFFF (the CPU keeps an operand's, sign included), a float32 -> bf16 cast of a NaN gives 0x7FFF
    (the CPU 0xFFFF), and a tensor divided by a Python scalar is a multiply by the float32 reciprocal. The
    save's tables built on an H200 recovered other rows than on the CPU; built under this mode, on the CPU,
    they do the same (the first test below), so any float op left on a transcode's path shows here."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _DIVISION and not kwargs and len(args) == 2 and isinstance(args[1], (int, float)) \
                and args[0].is_floating_point():
            out = args[0] * float(torch.tensor(1.0) / torch.tensor(float(args[1])))
        else:
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and func in _ARITHMETIC:
            out = torch.where(out.isnan(), torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32), out)
        if isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.float32:
            out = torch.where(out.isnan(), torch.tensor(0x7FFF, dtype=torch.int16).view(torch.bfloat16), out)
        return out


def test_tables_built_with_cudas_float_bits_recover_other_rows() -> None:
    """The H200 failure, on the CPU: the save's tables built by CUDA's float ops recover other rows (the
    exactness the same, the rows found not), so they must be built on the CPU only (next tests)."""
    rows = torch.cat((engine_rows(400, 11), junk(512, 584, 13)))
    want = reference.recover_rows(rows)
    with CudaFloat():
        cuda_built = codec._build_recover_tables()
    got = codec._recover(rows, cuda_built, None, codec.RowShape(), False)
    assert torch.equal(got[1], want.exact) and not torch.equal(got[0], want.native)


def near_thresholds() -> torch.Tensor:
    """float32 amax values within 40 ulps of 448 x 2^k for every k a tile can have, and of the 1e-4 floor."""
    centres = torch.tensor([448.0 * 2.0**k for k in range(-22, 100)] + [codec.AMAX_FLOOR], dtype=torch.float32)
    bits = centres.view(torch.int32)[:, None] + torch.arange(-40, 41, dtype=torch.int32)
    return bits.flatten().view(torch.float32)


def test_the_tile_exponent_is_the_ieee_quotients_on_the_bits_not_the_devices_division() -> None:
    amax = torch.cat((near_thresholds(), torch.tensor([0.0, float("inf"), float("nan")]),
                      torch.rand(100_000, generator=torch.Generator().manual_seed(9)) * 1000))
    ieee = codec._ue8m0_ceil(torch.maximum(amax, torch.tensor(codec.AMAX_FLOOR)) / codec.E4M3_MAX)
    assert torch.equal(codec._tile_exponent(amax), ieee)
    with CudaFloat():
        assert torch.equal(codec._tile_exponent(amax), ieee)


def test_the_transcode_gives_the_cpus_bytes_under_cudas_float_ops() -> None:
    """With the tables built (once, on the CPU) the store, the load and the save under CUDA's float bits give
    the CPU's bytes, NaN latents and amax near the exponent thresholds included: no float op on their path
    decides a bit."""
    g = torch.Generator().manual_seed(10)
    x = realistic(512, 512, g)
    tiles = x[:, :448].view(512, 7, 64)
    tiles[:, :, 0] = near_thresholds()[: 512 * 7].view(512, 7) * torch.where(torch.rand(512, 7, generator=g) < 0.5,
                                                                             -1, 1)
    x[::5, ::37] = float("nan")
    x[1::5, ::41] = -float("nan")
    store = reference.store_rows(x)
    rows = torch.cat((engine_rows(400, 11), junk(512, 584, 13)))
    want = reference.recover_rows(rows, alternatives=True)
    blocks = junk(4, MODEL.block_bytes(64), 14)
    v4 = reference.native_blocks_to_v4(MODEL, blocks, 64)
    codec._recover_tables(CPU), codec._encode_tables(CPU), codec._byte_tables(CPU)
    with CudaFloat():
        assert not torch.equal(reference.store_rows(x), store)      # the mode bites the float store's NaNs
        assert torch.equal(codec.store_rows(x), store)
        got = codec.recover_rows(rows, alternatives=True)
        assert torch.equal(got.native, want.native) and torch.equal(got.exact, want.exact)
        assert torch.equal(got.ambiguous, want.ambiguous)
        assert torch.equal(codec.native_blocks_to_v4(MODEL, blocks, 64, fused=False), v4)
        assert torch.equal(codec._fused_blocks(blocks, codec._byte_tables(CPU), MODEL, 64), v4)
        back = codec.v4_blocks_to_native(MODEL, v4, 64, fused=False)
        fused = codec._fused_recover_blocks(v4, codec._recover_tables(CPU), codec._byte_tables(CPU), MODEL, 64)
        assert torch.equal(fused[0], back.native) and torch.equal(fused[1], back.exact)
    assert torch.equal(back.native, reference.v4_blocks_to_native(MODEL, v4, 64).native)


def test_every_devices_tables_are_the_cpu_build_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables are built once, on the CPU, and copied to each device (the device only gathers): a device
    gets the CPU's bytes whatever its float ops do (building them on an H200 gave other save results)."""
    builds: list[str] = []
    def counted(name: str) -> Any:
        real = getattr(codec, name)

        def build(*args: Any) -> Any:
            builds.append(name)
            return real(*args)
        return build

    for name in ("_build_recover_tables", "_build_encode_tables"):
        monkeypatch.setattr(codec, name, counted(name))
    caches: tuple[dict[torch.device, Any], ...] = (codec._RECOVER, codec._ENCODE, codec._BYTES)
    saved = [dict(cache) for cache in caches]
    for cache in caches:
        cache.clear()
    meta = torch.device("meta")
    try:
        recover, encode, byte = codec._recover_tables(meta), codec._encode_tables(meta), codec._byte_tables(meta)
        cpu = codec._recover_tables(CPU), codec._encode_tables(CPU), codec._byte_tables(CPU)
        assert sorted(builds) == ["_build_encode_tables", "_build_recover_tables"]     # once each, for both
        for dev, host in zip((recover, encode, byte), cpu, strict=True):
            for a, b in zip(vars(dev).values(), vars(host).values(), strict=True):
                assert a.device == meta and b.device == CPU and (a.dtype, a.shape) == (b.dtype, b.shape)
    finally:
        for cache, old in zip(caches, saved, strict=True):
            cache.clear()
            cache.update(old)
