"""The SGLang v4 Triton kernels on CUDA give the torch path's bytes (issue 27 item 4; skipped without a GPU).

kvstore/codec/sglang_v4_triton.py called directly (a kernel that fails to build must not hide behind the
torch fallback) with its E4M3 casts both ways (the GPU's cvt where it has one, and on the bits), on the
adversarial, realistic and random rows of sglang_v4_cases, compared with torch.equal against the torch path
on the CPU: the load (rows and whole blocks), the save (native rows of every row, exactness, collisions,
block counts); then 1M tokens of blocks against the eager gathers on the same device, and the routing
(`kernel_modes`). The same checks run on the CPU under Triton's interpreter in
test_sglang_v4_triton_interpret.py. Speed: `kvstore bench transcode --device cuda` (timing is no test's).

    .venv/bin/pytest -q -m gpu tests/kvstore/codec/test_sglang_v4_triton_gpu.py
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kvstore.bench.transcode import blocks
from kvstore.codec import sglang_v4
from tests.kvstore.codec import sglang_v4_cases as cases

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = [pytest.mark.gpu, needs_cuda]


@pytest.fixture(params=[None, False], ids=["fp8-auto", "fp8-on-bits"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """sglang_v4_triton with its E4M3 casts as chosen for the GPU (the H200's cvt) and on the bits."""
    module = pytest.importorskip("kvstore.codec.sglang_v4_triton")
    monkeypatch.setattr(module, "HW_FP8", request.param)
    return module


def test_the_load_of_rows_and_blocks_is_the_torch_paths_bytes(kernels: ModuleType) -> None:
    cases.check_load_rows("cuda", realistic_rows=4096, junk_rows=4096)
    cases.check_load_blocks("cuda", blocks=24)


def test_the_save_of_rows_and_blocks_is_the_torch_paths_rows_and_verdicts(kernels: ModuleType) -> None:
    cases.check_save_rows("cuda", engine=2048, junk_rows=2048)
    cases.check_save_blocks("cuda", blocks=24)


def test_1m_tokens_of_blocks_transcode_as_the_eager_gathers_do(kernels: ModuleType) -> None:
    native, v4 = blocks(1 << 20, "cuda")                     # v4: the eager gathers' bytes, on the device
    got = kernels.native_blocks_to_v4(native, cases.MODEL, 64)
    assert got is not None and torch.equal(got, v4)
    found = kernels.v4_blocks_to_native(v4, cases.MODEL, 64)
    assert found is not None
    slow = sglang_v4.v4_blocks_to_native(cases.MODEL, v4, 64, fused=False)
    assert torch.equal(found[0], slow.native) and torch.equal(found[1], slow.exact)
    assert found[2].tolist() == [slow.rows, slow.exact_rows, slow.ambiguous_rows]
    assert bool(slow.exact.all())


def test_cuda_calls_take_the_kernels_and_declined_ones_the_torch_path() -> None:
    native, v4 = blocks(8 * 64, "cuda")
    assert torch.equal(sglang_v4.native_blocks_to_v4(cases.MODEL, native, 64), v4)
    found = sglang_v4.v4_blocks_to_native(cases.MODEL, v4, 64)
    assert bool(found.exact.all()) and found.rows == found.exact_rows == 8 * 160
    rows = native[:, :288].contiguous()
    assert torch.equal(sglang_v4.encode_rows(rows), v4[:, :584])
    back = sglang_v4.recover_rows(v4[:, :584].contiguous(), alternatives=True)
    assert bool(back.exact.all())
    assert set(sglang_v4.kernel_modes().values()) == {"triton"}, sglang_v4.kernel_modes()
    odd = torch.zeros(8, 1 + 584, dtype=torch.uint8, device="cuda")
    assert torch.equal(sglang_v4.encode_rows(rows, out=odd[:, 1:]), v4[:, :584])    # declined: the torch path
    assert sglang_v4.kernel_modes()["encode_rows"] == "eager"
