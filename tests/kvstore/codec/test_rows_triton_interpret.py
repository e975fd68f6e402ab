"""The row codec's bf16 FP4 encode kernels under Triton's CPU interpreter give the torch path's bytes.

kvstore/codec/rows_triton.py's bf16 kernels (`_encode_bf16_lanes_kernel`, the default, and
`_encode_bf16_pairs_kernel`: two channels per int32 word, issue 25 item 5) and the general `_encode_kernel`,
run on CPU tensors through `TRITON_INTERPRET=1` in a child process (the interpreter must be on before triton
is imported), against rows.py's torch code: every rule's edge rows of test_codec_gpu.py's `hard_inputs` and
the codec bench's data sets, compressed KV at four widths and indexer keys (lanes) at three, and the
non-finite flag. E4M3 casts on the bits (`HW_FP8 = False`: the interpreter's float8 cast does not round to
nearest even); test_codec_gpu.py runs the kernels on CUDA both ways. Skipped where triton is not installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.kvstore.codec.triton_interpret import run_in_interpreter

if TYPE_CHECKING:
    from torch import Tensor


def taken(result: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """A kernel's (rows, flag), which it must not decline here."""
    assert result is not None
    return result


def run_checks() -> None:
    """The child's side: both kernels against the torch path."""
    import torch

    from kvstore.bench.codec import data_sets
    from kvstore.codec import rows
    from kvstore.codec import rows_triton as kernels
    from tests.kvstore.codec.test_codec_gpu import hard_inputs

    kernels.HW_FP8 = False
    kernels.LANES_PTX = False
    for d in (512, 128, 48, 16):
        x = hard_inputs(d, torch.float32, 61)
        x = x[torch.isfinite(x).all(dim=1)]
        sets = [x] + ([v[:128] for v in data_sets(128, d).values()] if d == 512 else [])
        for values in sets:
            bf16 = values.to(torch.bfloat16)
            want = rows.compressed_kv_rows(bf16)
            for pairs in ("lanes", "pairs", "general"):
                kernels.BF16_KERNEL = pairs
                got, flag = taken(kernels.compressed_kv_rows(bf16))
                assert torch.equal(got, want), (d, pairs)
                assert float(flag) == 0.0
        bad = x[:8].to(torch.bfloat16)
        bad[3, 5] = float("nan")
        kernels.BF16_KERNEL = "lanes"
        kernels.LANES_PTX = False
        assert not torch.isfinite(taken(kernels.compressed_kv_rows(bad))[1]).all()
    # Indexer-key rows by the lanes kernel alone: the general kernel's float compares of bf16 subnormals (the
    # subnormal edge row, scale 2^-126) differ under the interpreter, not on the GPU, where test_codec_gpu.py
    # checks both.
    kernels.BF16_KERNEL = "lanes"
    for d in (128, 64, 96):
        x = hard_inputs(d, torch.float32, 61)
        bf16 = x[torch.isfinite(x).all(dim=1)].to(torch.bfloat16)
        got, flag = taken(kernels.indexer_key_rows(bf16))
        assert torch.equal(got, rows.indexer_key_rows(bf16)), (d, "lanes, indexer key")
        assert float(flag) == 0.0
    print("interpreter checks passed")


def test_the_bf16_encode_kernels_under_the_interpreter_give_the_torch_paths_bytes() -> None:
    run_in_interpreter("tests.kvstore.codec.test_rows_triton_interpret")
