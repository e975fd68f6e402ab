"""The SGLang v4 Triton kernels under Triton's CPU interpreter give the torch path's bytes (no GPU needed).

kvstore/codec/sglang_v4_triton.py runs on CUDA in production (test_sglang_v4_triton_gpu.py checks it there);
this runs the same kernel code, op for op, on CPU tensors through `TRITON_INTERPRET=1`, and compares
everything with the torch path bit for bit (sglang_v4_cases: adversarial, realistic and random rows, whole
blocks, both row widths, both `alternatives`). The interpreter must be on before triton is imported, so the
checks run in a child process. What the interpreter cannot stand for: the GPU's own float8 cast (its
interpreter cast does not round to nearest even), so the E4M3 casts run on the bits here (`HW_FP8 = False`);
the GPU test runs both. Skipped where triton is not installed. Larger programs than on the GPU (the
interpreter's cost is per operation, not per element), then the GPU's sizes on a partly masked tail.

    PYTHONPATH=/tmp/triton_site .venv/bin/python -m pytest -q tests/kvstore/codec/test_sglang_v4_triton_interpret.py
"""

from __future__ import annotations

from tests.kvstore.codec.triton_interpret import run_in_interpreter


def run_checks() -> None:
    """The child's side: every check of sglang_v4_cases on CPU tensors under the interpreter."""
    import torch

    from kvstore.codec import sglang_v4
    from kvstore.codec import sglang_v4_triton as kernels
    from tests.kvstore.codec import sglang_v4_cases as cases

    kernels.HW_FP8 = False
    kernels.LOAD_ROWS, kernels.SAVE_ROWS = 512, 256
    cases.check_all("cpu", small=True)
    kernels.LOAD_ROWS, kernels.SAVE_ROWS = 4, 4                     # the GPU's programs, the last one partly masked
    native = cases.adversarial_native(boosts=(0x7F,))[247:260]
    out = torch.empty(13, 584, dtype=torch.uint8)
    assert torch.equal(kernels.encode_rows(native, sglang_v4.RowShape(), out), sglang_v4.encode_rows(native))
    rows = cases.adversarial_v4()[:13]
    got = kernels.recover_rows(rows, sglang_v4.RowShape(), False)
    want = sglang_v4.recover_rows(rows)
    assert got is not None and torch.equal(got[0], want.native) and torch.equal(got[1], want.exact)
    print("interpreter checks passed")


def test_the_kernels_under_the_interpreter_give_the_torch_paths_bytes() -> None:
    run_in_interpreter("tests.kvstore.codec.test_sglang_v4_triton_interpret")
