"""The lanes FP4 encode kernel against rows.py on CUDA, mismatches in detail (issue 25 item 5).

For each row type (compressed KV, indexer key), width and kernel variant (rows_triton module, BF16_KERNEL,
HW_FP8, LANES_PTX) it encodes bf16 rows with rows_triton on the GPU and compares them with rows.py's torch code
on the CPU. Inputs: test_codec_gpu.py's edge rows (zeros, -0.0, below the floors, subnormals, E2M1 and E4M3 ties
and their neighbours, saturation, huge values), bf16 edges (the smallest subnormals, the largest finite, all-equal
rows, -0.0 beside positives), ties built at random scales (every midpoint times the group's scale, amax exactly
6x it) and random mantissas over a few binades a row. For the first mismatching groups it prints the group's
inputs (bf16 bits, hex), its amax, the expected and got scale byte and data bytes; per case a summary (data
bytes and scale bytes wrong, and for wrong scales the group distance at which the expected scales would explain
them, which names a layout mix-up). Exceptions are printed, not raised.

Usage (repository root on PYTHONPATH): python3 scripts/lanes_debug.py [--before PATH] [--quick]
--before loads another copy of rows_triton.py (say HEAD's before a fix) and runs its variants too.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import traceback
from types import ModuleType

import torch

from kvstore.codec import rows, rows_triton
from tests.kvstore.codec.test_codec_gpu import hard_inputs

#: row type -> (rows.py encoder, rows_triton function, group channels, widths)
FORMATS = {
    "compressed_kv": (rows.compressed_kv_rows, "compressed_kv_rows", 16, (512, 128, 48, 16)),
    "indexer_key": (rows.indexer_key_rows, "indexer_key_rows", 32, (128, 64, 96)),
}
E4M3_SCALES = [2.0**e * (1 + m / 8) for e in range(-6, 9) for m in range(8)] + [m * 2.0**-9 for m in range(1, 8)]
MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def bf16_bits(values: torch.Tensor) -> torch.Tensor:
    """int32 bits (0-0xFFFF) of a bf16 tensor."""
    return values.view(torch.int16).to(torch.int32) & 0xFFFF


def from_bits(bits: torch.Tensor) -> torch.Tensor:
    """bf16 tensor of int bits (0-0xFFFF)."""
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def edge_rows(d: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 edge rows `[n, d]` (module docstring)."""
    out = [hard_inputs(d, torch.float32, 61)]
    out[0] = out[0][torch.isfinite(out[0]).all(dim=1)].to(torch.bfloat16)
    lanes = torch.arange(d)
    out.append(from_bits(lanes % 64 + 1)[None])                              # smallest subnormals
    out.append(from_bits((lanes % 64 + 1) | 0x8000)[None])
    out.append(from_bits(torch.where(lanes % 2 == 0, 0x7F7F, 0xFF7F))[None])  # +- the largest finite bf16
    out.append(from_bits(0x7F7F - lanes % 128)[None])
    out.append(from_bits(torch.where(lanes % 3 == 0, 0x8000, 0x3F80))[None])  # -0.0 beside 1.0
    for value in (1.0, 3.0, 2688.0, 2.0**-126, 1e-3, -0.5):
        out.append(torch.full((1, d), value, dtype=torch.bfloat16))         # all equal
    # Ties at random scales: every midpoint (and its bf16 neighbours) times the group's scale, amax 6x the scale.
    n = 256
    picks = torch.randint(0, len(E4M3_SCALES), (n, d // group), generator=gen)
    scale = torch.tensor(E4M3_SCALES)[picks].repeat_interleave(group, dim=1)
    if group == 32:  # a power of two: the indexer's scale is the power at or above amax*(1/6)
        scale = 2.0 ** torch.randint(-120, 100, (n, d // group), generator=gen).repeat_interleave(group, dim=1)
    mid = torch.tensor(MIDPOINTS)[torch.randint(0, len(MIDPOINTS), (n, d), generator=gen)]
    ties = (mid * scale).to(torch.bfloat16)
    step = torch.randint(-1, 2, (n, d), generator=gen)
    ties = from_bits(bf16_bits(ties) + step * (bf16_bits(ties) & 0x7FFF > 0).to(torch.int32))
    sign = torch.randint(0, 2, (n, d), generator=gen) * 0x8000
    ties = from_bits(bf16_bits(ties) | sign)
    ties[:, ::group] = (6.0 * scale[:, ::group]).to(torch.bfloat16)
    ties = ties[torch.isfinite(ties.float()).all(dim=1)]
    out.append(ties)
    # Random mantissas over a few binades around a random exponent a row, random signs.
    base = torch.randint(100, 150, (n, 1), generator=gen)
    exponent = (base + torch.randint(-4, 3, (n, d), generator=gen)).clamp(1, 254)
    bits = (exponent << 7) | torch.randint(0, 128, (n, d), generator=gen) | (torch.randint(0, 2, (n, d),
                                                                                      generator=gen) << 15)
    out.append(from_bits(bits))
    return torch.cat(out)


def show_group(x: torch.Tensor, want: torch.Tensor, got: torch.Tensor, row: int, grp: int, d: int, group: int,
               what: str) -> None:
    """Print one mismatching group: inputs, amax, scale bytes, data bytes (expected / got)."""
    half = group // 2
    data = slice(grp * half, (grp + 1) * half)
    scale_at = d // 2 + grp
    xs = bf16_bits(x[row, grp * group:(grp + 1) * group])
    amax = x[row, grp * group:(grp + 1) * group].float().abs().max().item()
    print(f"    {what} row {row} group {grp}: amax {amax!r} scale byte want {int(want[row, scale_at]):#04x} "
          f"got {int(got[row, scale_at]):#04x}")
    print("      x bits  " + " ".join(f"{int(v):04x}" for v in xs))
    print("      want    " + " ".join(f"{int(v):02x}" for v in want[row, data]))
    print("      got     " + " ".join(f"{int(v):02x}" for v in got[row, data]))


def compare(x: torch.Tensor, want: torch.Tensor, got: torch.Tensor, d: int, group: int, label: str) -> bool:
    """Print a case's summary and its first mismatching groups; True when bit identical."""
    got = got.cpu()
    if got.shape != want.shape:
        print(f"  {label}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return False
    n_rows, groups = want.shape[0], d // group
    data_want = want[:, :d // 2].reshape(n_rows, groups, group // 2)
    data_got = got[:, :d // 2].reshape(n_rows, groups, group // 2)
    scale_want, scale_got = want[:, d // 2:], got[:, d // 2:]
    bad_data = (data_want != data_got).any(dim=2)
    bad_scale = scale_want != scale_got
    bad = bad_data | bad_scale
    if not bool(bad.any()):
        print(f"  {label}: identical ({n_rows} rows)")
        return True
    print(f"  {label}: {int(bad.sum())} of {bad.numel()} groups differ in {int(bad.any(dim=1).sum())} of "
          f"{n_rows} rows: data bytes {int((data_want != data_got).sum())}, scale bytes {int(bad_scale.sum())}, "
          f"groups with a right scale but wrong data {int((bad_data & ~bad_scale).sum())}")
    # Which group's expected scale would the wrong ones be (over the tensor, groups numbered as the kernel does)?
    flat_want, flat_got = scale_want.reshape(-1), scale_got.reshape(-1)
    wrong = bad_scale.reshape(-1).nonzero().flatten()[:2000]
    offsets: collections.Counter[int] = collections.Counter()
    for q in wrong.tolist():
        for o in range(-300, 301):
            if 0 <= q + o < flat_want.numel() and o and flat_want[q + o] == flat_got[q]:
                offsets[o] += 1
    if offsets:
        print(f"    wrong scales equal the expected scale of the group at offset (count of {len(wrong)}): "
              f"{offsets.most_common(6)}")
    # Bits that differ in the data bytes (low nibble: channel 2i, high: 2i+1; bit 3/7 sign).
    diff = (data_want ^ data_got)[bad_data & ~bad_scale]
    if diff.numel():
        per_bit = [int(((diff >> b) & 1).sum()) for b in range(8)]
        print(f"    data bits differing where the scale is right (bit 0..7): {per_bit}")
        position = (data_want != data_got)[bad_data & ~bad_scale].sum(dim=0).tolist()
        print(f"    by byte of the group: {position}")
    shown = 0
    for kind, mask in (("scale", bad_scale), ("data", bad_data & ~bad_scale)):
        for row, grp in mask.nonzero().tolist()[:3]:
            show_group(x, want, got, row, grp, d, group, kind)
            shown += 1
    return False


def variants(before: ModuleType | None) -> list[tuple[str, ModuleType, str, bool | None, bool | None]]:
    """(label, module, BF16_KERNEL, HW_FP8, LANES_PTX) to run."""
    out = [("lanes hw-auto ptx-auto", rows_triton, "lanes", None, None),
           ("lanes hw-off ptx-off", rows_triton, "lanes", False, False),
           ("lanes hw-auto ptx-off", rows_triton, "lanes", None, False),
           ("lanes hw-off ptx-auto", rows_triton, "lanes", False, None),
           ("general hw-auto", rows_triton, "general", None, None)]
    if before is not None:
        out += [("BEFORE lanes hw-auto ptx-auto", before, "lanes", None, None),
                ("BEFORE lanes hw-off ptx-auto", before, "lanes", False, None),
                ("BEFORE lanes hw-off ptx-off", before, "lanes", False, False)]
    return out


def main() -> None:
    """Run every variant on every case; print a final tally."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", help="path of another rows_triton.py to run as well")
    parser.add_argument("--quick", action="store_true", help="one width a row type")
    parser.add_argument("--device", default="cuda", help="cpu: under TRITON_INTERPRET=1 (no inline PTX)")
    args = parser.parse_args()
    before = None
    if args.before:
        spec = importlib.util.spec_from_file_location("rows_triton_before", args.before)
        assert spec and spec.loader
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
    import triton

    device = torch.device(args.device)
    on = (f"{torch.cuda.get_device_name(device)} capability {torch.cuda.get_device_capability(device)}"
          if device.type == "cuda" else "cpu (interpreter)")
    print(f"torch {torch.__version__} triton {triton.__version__} on {on}")
    tally: collections.Counter[str] = collections.Counter()
    for name, (encode, kernel, group, widths) in FORMATS.items():
        for d in widths[:1] if args.quick else widths:
            gen = torch.Generator().manual_seed(d + group)
            x = edge_rows(d, group, gen)
            want = encode(x)
            print(f"{name} d={d}: {x.shape[0]} rows")
            for label, module, which, hw, ptx in variants(before):
                knobs = ("BF16_KERNEL", "HW_FP8", "LANES_PTX")
                defaults = [getattr(module, knob) for knob in knobs]
                for knob, value in zip(knobs, (which, hw, ptx), strict=True):
                    setattr(module, knob, value)
                try:
                    got, flag = getattr(module, kernel)(x.to(device))
                    ok = compare(x, want, got, d, group, label) and bool(torch.isfinite(flag).all())
                    # Offset input (data_ptr % 16 == 4): the kernel takes any 4-byte aligned start.
                    buf = torch.empty(x.numel() + 2, dtype=torch.bfloat16, device=device)
                    shifted = buf[2:].view(x.shape)
                    shifted.copy_(x)
                    got2, _ = getattr(module, kernel)(shifted)
                    ok = compare(x, want, got2, d, group, label + " offset") and ok
                except Exception:  # report and go on: one run should name every failure
                    print(f"  {label}: raised\n" + traceback.format_exc(limit=3))
                    ok = False
                tally[label] += 0 if ok else 1
                for knob, value in zip(knobs, defaults, strict=True):
                    setattr(module, knob, value)
    print("cases failed per variant:", dict(tally))


if __name__ == "__main__":
    main()
