"""kvstore.codec.sglang_v4 on CUDA: the same bytes as on the CPU (issue 27 items 3-4; skipped without a GPU).

The CPU path is checked against SGLang's own fake-quant and a transcription of its store kernel in
tests/integrations/test_sglang_v4_share.py, and against the float implementation it replaced
(tests/kvstore/codec/sglang_v4_reference.py) in test_sglang_v4_tables.py; here every step is run on CUDA
tensors, on both paths (the compiled whole-block kernels a CUDA transcode takes, and the eager gathers),
and compared bit for bit with that reference on the CPU: the store, model rows -> v4 rows (the load), v4
rows -> model rows with the exactness mask and collision counts (the save), whole blocks of a 1M-token
restore's size included. The compiled kernels run only with KVSTORE_V4_COMPILE=1 (off by default: minutes of
compiling on the first call). The transcode's speed
against the restore it sits in is `kvstore bench transcode --device cuda` (timing is no test's).

    .venv/bin/pytest -q -m gpu tests/kvstore/codec/test_sglang_v4_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from kvstore.bench.codec import realistic
from kvstore.bench.transcode import blocks
from kvstore.codec import sglang_v4
from kvstore.codec.rows import compressed_kv_rows
from kvstore.geometry import resolve
from tests.kvstore.codec import sglang_v4_reference as reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = [pytest.mark.gpu, needs_cuda]

MODEL = resolve("deepseek-v4.1-flash")


def rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(model rows [n, 288], v4 rows [n, 584]) of realistic latents, on the CPU; plus raw-latent rows mixed in."""
    x = realistic(n, 512, torch.Generator().manual_seed(seed))
    native = compressed_kv_rows(x)
    v4 = sglang_v4.encode_rows(native)
    v4[::7] = sglang_v4.store_rows(x[::7].to(torch.bfloat16))    # every 7th row: no FP4 image (vLLM-like)
    return native, v4


def junk(n: int, width: int, seed: int) -> torch.Tensor:
    """Random bytes: every code and scale byte, NaN scales included."""
    return torch.randint(0, 256, (n, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_every_path_on_cuda_gives_the_float_references_bytes() -> None:
    native = torch.cat((junk(2048, 288, 10), rows(2048, 11)[0]))
    want = reference.encode_rows(native)
    assert torch.equal(sglang_v4.encode_rows(native.cuda()).cpu(), want)
    t = sglang_v4._byte_tables(torch.device("cuda"))
    assert torch.equal(sglang_v4._fused_rows(native.cuda(), t, sglang_v4.RowShape()).cpu(), want)
    v4 = torch.cat((rows(2048, 12)[1], junk(512, 584, 13), want))
    for alternatives in (False, True):
        ref = reference.recover_rows(v4, alternatives=alternatives)
        got = sglang_v4.recover_rows(v4.cuda(), alternatives=alternatives)
        assert torch.equal(got.exact.cpu(), ref.exact) and torch.equal(got.ambiguous.cpu(), ref.ambiguous)
        assert torch.equal(got.native.cpu(), ref.native)


@pytest.mark.parametrize("fused", [True, False], ids=["compiled", "eager"])
def test_blocks_on_cuda_are_the_float_references_blocks(fused: bool) -> None:
    if fused and not sglang_v4.compile_enabled():
        pytest.skip("compiling is off (the default): KVSTORE_V4_COMPILE=1 runs the compiled kernels")
    blocks_in = junk(24, MODEL.block_bytes(64), 14)
    want = reference.native_blocks_to_v4(MODEL, blocks_in, 64)
    assert torch.equal(sglang_v4.native_blocks_to_v4(MODEL, blocks_in.cuda(), 64, fused=fused).cpu(), want)
    _, v4 = blocks(24 * 64, "cpu")
    v4 = torch.cat((v4, want))
    ref = reference.v4_blocks_to_native(MODEL, v4, 64)
    got = sglang_v4.v4_blocks_to_native(MODEL, v4.cuda(), 64, fused=fused)
    assert torch.equal(got.native.cpu(), ref.native) and torch.equal(got.exact.cpu(), ref.exact)
    assert (got.rows, got.exact_rows, got.ambiguous_rows) == (ref.rows, ref.exact_rows, ref.ambiguous_rows)
    if fused:     # the compiled kernels were what ran (a compile failure falls back, and says so here)
        assert sglang_v4._compiled(MODEL, 64, "load") is not None
        assert sglang_v4._compiled(MODEL, 64, "save") is not None


def test_the_store_and_the_load_transcode_are_the_cpus_bytes_on_cuda() -> None:
    x = realistic(4096, 512, torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[0] = 0
    x[1, :64] = 1e-6
    assert torch.equal(sglang_v4.store_rows(x.cuda()).cpu(), sglang_v4.store_rows(x))
    native, _ = rows(4096, 2)
    assert torch.equal(sglang_v4.encode_rows(native.cuda()).cpu(), sglang_v4.encode_rows(native))


def test_the_save_transcode_finds_the_same_rows_and_exactness_on_cuda() -> None:
    native, v4 = rows(4096, 3)
    cpu = sglang_v4.recover_rows(v4, alternatives=True)
    gpu = sglang_v4.recover_rows(v4.cuda(), alternatives=True)
    assert torch.equal(gpu.exact.cpu(), cpu.exact) and torch.equal(gpu.ambiguous.cpu(), cpu.ambiguous)
    assert torch.equal(gpu.native.cpu()[cpu.exact], cpu.native[cpu.exact])
    assert cpu.exact.sum() == 4096 - len(range(0, 4096, 7))      # exactly the FP4 images
    assert torch.equal(cpu.native[cpu.exact], native[cpu.exact])


def test_blocks_of_a_1m_token_restore_transcode_on_cuda_as_on_the_cpu() -> None:
    native, v4 = blocks(1 << 20, "cuda")                        # 16,384 blocks: 0.93 GB model rows, 1.7 GB v4
    assert native.is_cuda
    eager = sglang_v4.native_blocks_to_v4(MODEL, native, 64, fused=False)
    assert torch.equal(sglang_v4.native_blocks_to_v4(MODEL, native, 64), eager)     # compiled = eager, all of it
    assert torch.equal(eager, v4)
    back = sglang_v4.v4_blocks_to_native(MODEL, v4, 64)
    # The rule is that the recovered rows store the engine's bytes again; a rare collision (distinct FP4 rows
    # that store the same bytes) recovers another row than the one written: one block of 16,384 on the H200.
    assert bool(back.exact.all()) and torch.equal(sglang_v4.native_blocks_to_v4(MODEL, back.native, 64), v4)
    slow = sglang_v4.v4_blocks_to_native(MODEL, v4[:2048], 64, fused=False)
    assert torch.equal(slow.native, back.native[:2048]) and bool(slow.exact.all())
    other = (back.native != native).flatten(1).any(1).nonzero().flatten().cpu()
    assert len(other) * 1000 <= len(native), len(other)
    some = torch.cat([torch.arange(64), other[:8]])               # the CPU reference on a part of it, collisions too
    assert torch.equal(reference.native_blocks_to_v4(MODEL, native[some].cpu(), 64), v4[some].cpu())
    assert torch.equal(reference.v4_blocks_to_native(MODEL, v4[some].cpu(), 64).native, back.native[some].cpu())
