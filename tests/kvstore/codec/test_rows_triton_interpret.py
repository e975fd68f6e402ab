"""The row codec's bf16 compressed-KV encode kernels under Triton's CPU interpreter give the torch path's bytes.

kvstore/codec/rows_triton.py's `_encode_bf16_pairs_kernel` (two channels per int32 word: issue 25 item 5)
and the general `_encode_kernel` it stands in for, run on CPU tensors through `TRITON_INTERPRET=1` in a
child process (the interpreter must be on before triton is imported), against rows.py's torch code: every
rule's edge rows of test_codec_gpu.py's `hard_inputs` and the codec bench's data sets, at four widths, and
the non-finite flag. E4M3 casts on the bits (`HW_FP8 = False`: the interpreter's float8 cast does not round
to nearest even); test_codec_gpu.py runs the kernels on CUDA both ways. Skipped where triton is not installed.
"""

from __future__ import annotations

from tests.kvstore.codec.triton_interpret import run_in_interpreter


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
                got, flag = kernels.compressed_kv_rows(bf16)
                assert torch.equal(got, want), (d, pairs)
                assert float(flag) == 0.0
        bad = x[:8].to(torch.bfloat16)
        bad[3, 5] = float("nan")
        kernels.BF16_KERNEL = "lanes"
        kernels.LANES_PTX = False
        assert not torch.isfinite(kernels.compressed_kv_rows(bad)[1]).all()
    print("interpreter checks passed")


def test_the_bf16_encode_kernels_under_the_interpreter_give_the_torch_paths_bytes() -> None:
    run_in_interpreter("tests.kvstore.codec.test_rows_triton_interpret")
