"""Rows for checking kvstore/codec/sglang_v4_triton.py against the torch path, and the checks themselves.

Shared by test_sglang_v4_triton_gpu.py (the kernels compiled for CUDA) and test_sglang_v4_triton_interpret.py
(the same kernels under Triton's CPU interpreter, in a child process). Every check builds its rows on the
CPU, runs the torch path there (the reference: the bytes every device must give) and the Triton function on
`device`, and asserts torch.equal on everything the torch path returns.

Adversarial rows, each aimed at one rule:
- load (model rows): every scale byte (NaN 0x7F / 0xFF, negative, zero, subnormal, 448) with all 16 codes in
  one group, so every (code, scale) pair meets every E4M3 rounding tie its tile allows; tile-mates at other
  scales that lift the tile's exponent (subnormal E4M3 outputs and their ties) or hold a NaN; all-zero rows,
  -0 codes, the largest values.
- save (V4 rows): SGLang's rows of realistic latents, raw-latent rows (no preimage), rows with one byte
  flipped, random bytes, sparse rows and the known collision pair (sglang_v4_tables' `engine_rows`), the
  images of the load's adversarial rows, exponent bytes 0 and 255 (clamped), a non-zero pad byte, NaN and
  the largest E4M3 data bytes, NaN, Inf and -0 bf16 RoPE bits, all-zero and all-0xFF rows.
"""

from __future__ import annotations

import torch

from kvstore.bench.codec import realistic
from kvstore.bench.transcode import blocks as transcode_blocks
from kvstore.codec import sglang_v4
from kvstore.codec.rows import compressed_kv_rows
from kvstore.geometry import resolve
from tests.kvstore.codec.test_sglang_v4_tables import engine_rows, junk

MODEL = resolve("deepseek-v4.1-flash")
TINY = sglang_v4.RowShape(width=128, rope=64)
WIDE = sglang_v4.RowShape()


def adversarial_native(shape: sglang_v4.RowShape = WIDE, boosts: tuple[int | None, ...] = (
        None, 0x7E, 0x7F)) -> torch.Tensor:
    """Model rows [256 * len(boosts) + 4, native_bytes]: per scale byte s, a row whose every group holds the
    16 codes 0..15 under s, except (boost b) the last group of each tile, at scale b with all codes 7 / 15;
    then an all-zero row, a row of -0 codes, the largest values (codes 7 and 15 at 448 and -448)."""
    half, groups = shape.width // 2, shape.width // sglang_v4.GROUP
    every_code = torch.arange(16, dtype=torch.uint8)
    packed = (every_code[0::2] | (every_code[1::2] << 4)).repeat(groups)              # [half]
    rows = []
    for boost in boosts:
        for s in range(256):
            row = torch.empty(shape.native_bytes, dtype=torch.uint8)
            row[:half] = packed
            row[half:] = s
            if boost is not None:
                for tile in range(shape.tiles):
                    last = tile * 4 + 3
                    row[last * 8:(last + 1) * 8] = 0xF7
                    row[half + last] = boost
            rows.append(row)
    zero = torch.zeros(shape.native_bytes, dtype=torch.uint8)
    minus_zero = zero.clone()
    minus_zero[:half] = 0x88
    minus_zero[half:] = 0x38                                                       # scale 1.0
    largest = zero.clone()
    largest[:half] = 0xF7
    largest[half::2], largest[half + 1::2] = 0x7E, 0xFE
    nan_one = largest.clone()
    nan_one[half + 5] = 0xFF                                                       # one NaN group, in tile 1
    return torch.cat((torch.stack(rows), torch.stack((zero, minus_zero, largest, nan_one))))


def adversarial_v4(shape: sglang_v4.RowShape = WIDE) -> torch.Tensor:
    """V4 rows of the edge cases in the module doc, built from SGLang rows of realistic latents."""
    g = torch.Generator().manual_seed(21)
    base = sglang_v4.encode_rows(compressed_kv_rows(realistic(16, shape.width, g)), shape)
    start = shape.nope + 2 * shape.rope
    rows = [base]
    for exponent in (0, 255, 1, 254):
        r = base.clone()
        r[:, start] = exponent
        rows.append(r)
    r = base.clone()
    r[:, shape.v4_bytes - 1] = 1                                                   # the pad byte
    rows.append(r)
    for data in (0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80):
        r = base.clone()
        r[:, ::29][:, : shape.nope // 29] = data
        rows.append(r)
    for bits in (0x7FC0, 0xFFFF, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x7F7F):
        r = base.clone()
        r[:, shape.nope:start].view(torch.int16)[:, ::7] = torch.tensor(bits, dtype=torch.int32).to(torch.int16)
        rows.append(r)
    rows.append(torch.zeros(2, shape.v4_bytes, dtype=torch.uint8))
    rows.append(torch.full((2, shape.v4_bytes), 0xFF, dtype=torch.uint8))
    zeros = torch.zeros(2, shape.v4_bytes, dtype=torch.uint8)
    zeros[:, start:start + shape.tiles] = 105                                      # the exponent of amax 0
    rows.append(zeros)
    return torch.cat(rows)


def check_load_rows(device: str, realistic_rows: int = 256, junk_rows: int = 256,
                    boosts: tuple[int | None, ...] = (None, 0x7E, 0x7F)) -> None:
    """`encode_rows` of adversarial, realistic and random model rows, both widths."""
    from kvstore.codec import sglang_v4_triton as kernels

    for shape in (WIDE, TINY):
        gen = torch.Generator().manual_seed(3)
        native = torch.cat((adversarial_native(shape, boosts),
                            compressed_kv_rows(realistic(realistic_rows, shape.width, gen)),
                            junk(junk_rows, shape.native_bytes, 4)))
        want = sglang_v4.encode_rows(native, shape)
        on = native.to(device)
        out = torch.full((native.shape[0], shape.v4_bytes), 0xAA, dtype=torch.uint8, device=device)
        got = kernels.encode_rows(on, shape, out)
        assert got is out and torch.equal(out.cpu(), want), shape
        # [.., rows, width] inputs and a view of a wider output at an aligned offset.
        wide = torch.full((native.shape[0], 8 + shape.v4_bytes), 0xAA, dtype=torch.uint8, device=device)
        assert kernels.encode_rows(on.view(1, *on.shape), shape, wide[:, 8:].view(1, *out.shape)) is not None
        assert torch.equal(wide[:, 8:].cpu(), want) and bool((wide[:, :8] == 0xAA).all())
        # An odd offset: declined (the torch path writes those bytes).
        assert kernels.encode_rows(on, shape, wide[:, 1:1 + shape.v4_bytes]) is None


def check_load_blocks(device: str, blocks: int = 3) -> None:
    """`native_blocks_to_v4` of random blocks and of SGLang-realistic ones."""
    from kvstore.codec import sglang_v4_triton as kernels

    native = torch.cat((junk(blocks, MODEL.block_bytes(64), 5), transcode_blocks(blocks * 64, "cpu")[0]))
    want = sglang_v4.native_blocks_to_v4(MODEL, native, 64, fused=False)
    got = kernels.native_blocks_to_v4(native.to(device), MODEL, 64)
    assert got is not None and torch.equal(got.cpu(), want)


def check_save_rows(device: str, engine: int = 120, junk_rows: int = 96) -> None:
    """`recover_rows` (both `alternatives`) of SGLang's rows of every kind, adversarial ones, random bytes."""
    from kvstore.codec import sglang_v4_triton as kernels

    shape = sglang_v4.RowShape()
    rows = torch.cat((engine_rows(engine, 5), adversarial_v4(),
                      sglang_v4.encode_rows(adversarial_native(boosts=(None,))[::3]), junk(junk_rows, 584, 13)))
    tiny = junk(64, TINY.v4_bytes, 6)
    tiny[:32] = sglang_v4.encode_rows(junk(32, TINY.native_bytes, 7), TINY)
    for alternatives in (False, True):
        for r, s in ((rows, shape), (tiny, TINY)):
            want = sglang_v4.recover_rows(r, s, alternatives=alternatives)
            got = kernels.recover_rows(r.to(device), s, alternatives)
            assert got is not None
            native, exact, ambiguous = (x.cpu() for x in got)
            assert torch.equal(exact, want.exact) and torch.equal(ambiguous, want.ambiguous), (s, alternatives)
            assert torch.equal(native, want.native), (s, alternatives)      # every row, inexact ones too
    # The rows reach every branch: exact, inexact and (asked) collisions.
    want = sglang_v4.recover_rows(rows, alternatives=True)
    assert 0 < int(want.exact.sum()) < len(rows) and bool(want.ambiguous.any())


def check_save_blocks(device: str, blocks: int = 2) -> None:
    """`v4_blocks_to_native` of SGLang-realistic blocks, one damaged, and of blocks of random model rows."""
    from kvstore.codec import sglang_v4_triton as kernels

    v4 = torch.cat((transcode_blocks((blocks + 1) * 64, "cpu")[1],
                    sglang_v4.native_blocks_to_v4(MODEL, junk(blocks, MODEL.block_bytes(64), 8), 64, fused=False)))
    v4[0, 100] ^= 1                                                           # a row of block 0 damaged
    want = sglang_v4.v4_blocks_to_native(MODEL, v4, 64, fused=False)
    got = kernels.v4_blocks_to_native(v4.to(device), MODEL, 64)
    assert got is not None
    native, exact, counts = got
    assert torch.equal(native.cpu(), want.native) and torch.equal(exact.cpu(), want.exact)
    assert counts.tolist() == [want.rows, want.exact_rows, want.ambiguous_rows]
    assert not want.exact[0] and bool(want.exact[1])


def check_all(device: str, small: bool = False) -> None:
    """Every check above; `small`: fewer random and realistic rows, one boost (the interpreter's sizes)."""
    if small:
        check_load_rows(device, 32, 32, (None, 0x7F))
        check_load_blocks(device, 1)
        check_save_rows(device, 40, 32)
        check_save_blocks(device, 1)
    else:
        check_load_rows(device)
        check_load_blocks(device)
        check_save_rows(device)
        check_save_blocks(device)
