"""Transcode benchmark: SGLang `v4` blocks <-> the model's rows (kvstore.codec.sglang_v4) against the load it sits in.

An SGLang v4 backend sharing the model's rows (integrations.sglang_share) re-encodes every block it loads
from the model's rows into SGLang's (`native_blocks_to_v4`) and, on save, recovers the model's rows from
SGLang's and checks them (`v4_blocks_to_native`). Both are timed here on `--tokens` tokens of
DeepSeek-V4.1-Flash blocks (2.5 compressed-KV rows per token), built from realistic latents (the codec
bench's) through the model's fake-quant and SGLang's store, and set beside, in the same run on the same
device:

- a same-size copy: a device copy of the v4 blocks' bytes (what the load writes: 1,630 B/token), and one
  of the model-rows bytes (what it reads: 890 B/token);
- a restore: on CUDA, the host-to-device copy of the model-rows blocks from pinned memory, the least a
  direct GPU restore of them moves (890 B/token); on the CPU, a copy of the model-rows bytes out of a
  bytes object into a tensor (what the backend does with each block a Get returns);
- the restore it sits in: the same blocks stored in a `kvstore serve` child and restored by
  `kvstore.client.restore` with the store's reader (direct-gpu on CUDA: the path a GPU restore takes),
  checked against what was stored (`--no-store` skips it).

On CUDA the transcodes take their default path, the Triton kernels (kvstore/codec/sglang_v4_triton.py, one
launch per direction; `path` says which ran), and the eager gathers are timed beside them, with a check
that both give the same bytes; with KVSTORE_V4_COMPILE=1 the compiled whole-block kernels (torch.compile,
kvstore.codec.sglang_v4 module notes; the first call's compile time is a note) are timed too.

Figures: each step's time (its ratio: the baseline's time over the step's, so 0.05 means the step takes
20x the baseline), and `transcode share of a restore` (load transcode / (restore + load transcode), in %;
issue 27's target on the GPU: under 5% of a 1M-token restore), the same for the save transcode, and the
exact share of blocks and rows on these rows and of blocks on raw-latent rows (vLLM-like: never exact).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvstore.bench.codec import realistic, seconds
from kvstore.bench.report import Figure, Progress, Report
from kvstore.codec import sglang_v4
from kvstore.codec.block_codec import encode_blocks, split_blocks
from kvstore.geometry import ModelGeometry, resolve

#: The target of issue 27 item 4 on the GPU: the load transcode under 5% of a 1M-token restore.
TARGET_SHARE = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore bench transcode`."""
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to run (default: cuda when available)")
    parser.add_argument("--tokens", type=int, default=0,
                        help="tokens of blocks (default: 8,192 on cpu, 1,048,576 on cuda); a multiple of 64")
    parser.add_argument("--repeat", type=int, default=0, help="timed samples per figure (default: 3 cpu, 10 cuda)")
    parser.add_argument("--tune", action="store_true",
                        help="on CUDA, also time the Triton kernels at other program sizes (4-16 rows per program x "
                             "warps; notes), to pick sglang_v4_triton's LOAD_ROWS, SAVE_ROWS, LOAD_WARPS and NUM_WARPS")
    parser.add_argument("--no-store", action="store_true",
                        help="skip the real restore (a `kvstore serve` child holding the model-rows blocks, restored "
                             "by kvstore.client.restore: direct-gpu on CUDA, direct-cpu on the CPU)")


def kvstore_restore(native: torch.Tensor, device: str, repeat: int) -> tuple[float, str]:
    """Seconds of a real restore of `native`'s blocks (the model's rows, 64-token blocks) from a `kvstore serve`
    child on this host into `device` memory, by the fastest path (`kvstore.client.restore` with the store's
    reader), median of `repeat`; and the path it took. The blocks are checked against what was stored."""
    from kvstore.bench.harness import scratch, serve_process
    from kvstore.client import Client
    from kvstore.client.colocated import ColocatedReader
    from kvstore.client.restore import restore

    n, size = native.shape
    host = native.cpu()
    tokens = list(range(n * 64))
    with scratch() as folder, serve_process(folder / "store", n * size, 64) as target, Client(target) as client:
        for lo in range(0, n, 1024):
            hi = min(lo + 1024, n)
            client.put(tokens[:hi * 64], host[lo:hi], first_block=lo)
        dest = torch.empty((n, size), dtype=torch.uint8, device=device)
        with ColocatedReader(folder / "store") as reader:
            times, path = [], ""
            for i in range(repeat + 1):                          # the first: warm-up (maps, kernel build)
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                result = restore(client, tokens, dest, reader=reader)
                if device == "cuda":
                    torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - start)
                path = result.path
                if result.blocks != n:
                    raise RuntimeError(f"the restore found {result.blocks} of {n} blocks")
            if not torch.equal(dest.cpu(), host):
                raise RuntimeError("the restore landed bytes that differ from what was stored")
    return sorted(times)[len(times) // 2], path


def blocks(tokens: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(model-rows blocks, SGLang v4 blocks) of `tokens` tokens, from realistic latents."""
    model = resolve("deepseek-v4.1-flash")
    n = tokens // 64
    gen = torch.Generator().manual_seed(0)
    layers = {s: (realistic(n * model.block_rows(s, 64), model.head_dim, gen).to(device),
                  realistic(n * model.block_rows(s, 64), model.index_head_dim, gen).to(device))
              for s in model.kv_source_layers}
    native = encode_blocks(model, layers, 64)
    return native, sglang_v4.native_blocks_to_v4(model, native, 64, fused=False)   # eager: compiled later, timed


def _timed_once(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call (the first: on CUDA, torch.compile's compile of the fused kernels)."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def tune(model: ModelGeometry, native: torch.Tensor, v4: torch.Tensor, repeat: int) -> dict[str, str]:
    """Milliseconds of the Triton load and save at each (rows per program, warps), as notes; the module's
    settings are restored afterwards."""
    from kvstore.codec import sglang_v4_triton as kernels

    saved = kernels.LOAD_ROWS, kernels.SAVE_ROWS, kernels.NUM_WARPS, kernels.LOAD_WARPS
    notes = {}
    try:
        for warps in (2, 4, 8):
            for rows in (4, 8, 16):
                kernels.LOAD_ROWS = kernels.SAVE_ROWS = rows
                kernels.NUM_WARPS = kernels.LOAD_WARPS = warps
                load = seconds(lambda: kernels.native_blocks_to_v4(native, model, 64), "cuda", repeat, 1)
                save = seconds(lambda: kernels.v4_blocks_to_native(v4, model, 64), "cuda", repeat, 1)
                notes[f"tune_rows{rows}_warps{warps}"] = f"load {load * 1e3:.3f} ms, save {save * 1e3:.3f} ms"
    finally:
        kernels.LOAD_ROWS, kernels.SAVE_ROWS, kernels.NUM_WARPS, kernels.LOAD_WARPS = saved
    return notes


def run(args: argparse.Namespace, progress: Progress) -> Report:
    """Time the two transcodes beside a same-size copy and a restore, and note the exact shares."""
    device = args.device
    tokens = args.tokens or (1 << 20 if device == "cuda" else 8192)
    repeat = args.repeat or (10 if device == "cuda" else 3)
    model = resolve("deepseek-v4.1-flash")
    report = Report(bench="transcode")
    report.notes["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report.notes["tokens"] = tokens
    fused = device == "cuda" and sglang_v4.compile_enabled()    # compiled kernels: KVSTORE_V4_COMPILE=1
    with progress.bar("transcode", total=8, unit="step") as bar:
        native, v4 = blocks(tokens, device)
        bar.update(1)
        compile_s = {}
        if fused:
            compile_s["load"] = _timed_once(lambda: sglang_v4.native_blocks_to_v4(model, native[:8], 64, fused=True),
                                            device)
            compile_s["save"] = _timed_once(lambda: sglang_v4.v4_blocks_to_native(model, v4[:8], 64, fused=True),
                                            device)
            fused = sglang_v4._compiled(model, 64, "load") is not None
        loaded = sglang_v4.native_blocks_to_v4(model, native, 64)           # the default path; also its build
        path = "triton" if device == "cuda" and sglang_v4.kernel_modes()["native_blocks_to_v4"] == "triton" \
            else "eager"
        if path != "eager":
            report.notes["triton_load_equals_eager"] = bool(torch.equal(loaded, v4))   # v4: the eager gathers'
        del loaded
        load_s = seconds(lambda: sglang_v4.native_blocks_to_v4(model, native, 64), device, repeat, 1)
        eager_s = seconds(lambda: sglang_v4.native_blocks_to_v4(model, native, 64, fused=False), device,
                          max(1, repeat // 3), 1) if path != "eager" else load_s
        compiled_s = seconds(lambda: sglang_v4.native_blocks_to_v4(model, native, 64, fused=True), device, repeat,
                             1) if fused else None
        copy_s = seconds(lambda: v4.clone(), device, repeat, 1)
        native_copy_s = seconds(lambda: native.clone(), device, repeat, 1)
        if device == "cuda":
            pinned = native.cpu().pin_memory()
            restore_s = seconds(lambda: pinned.to(device, non_blocking=True), device, repeat, 1)
            restore = "host-to-device copy of the model-rows blocks (pinned)"
        else:
            raw = bytes(native.numpy())
            restore_s = seconds(lambda: torch.frombuffer(bytearray(raw), dtype=torch.uint8), device, repeat, 1)
            restore = "model-rows blocks from bytes into a tensor"
        store_s, store_path = (None, "") if args.no_store else kvstore_restore(native, device, max(3, repeat // 3))
        bar.update(2)
        save = {}

        def recover() -> None:
            save["t"] = sglang_v4.v4_blocks_to_native(model, v4, 64)

        save_s = seconds(recover, device, repeat, 1)
        eager_save_s = seconds(lambda: sglang_v4.v4_blocks_to_native(model, v4, 64, fused=False), device,
                               max(1, repeat // 3), 1) if path != "eager" else save_s
        compiled_save_s = seconds(lambda: sglang_v4.v4_blocks_to_native(model, v4, 64, fused=True), device,
                                  repeat, 1) if fused else None
        bar.update(1)
        got = save["t"]
        if path != "eager":
            slow = sglang_v4.v4_blocks_to_native(model, v4, 64, fused=False)
            report.notes["triton_save_equals_eager"] = bool(
                torch.equal(got.native, slow.native) and torch.equal(got.exact, slow.exact)
                and (got.rows, got.exact_rows, got.ambiguous_rows) == (slow.rows, slow.exact_rows, slow.ambiguous_rows))
            report.notes["save_path"] = sglang_v4.kernel_modes()["v4_blocks_to_native"]
            del slow
        if getattr(args, "tune", False) and path == "triton":
            report.notes.update(tune(model, native, v4, repeat))
        raw_v4 = sglang_v4.native_blocks_to_v4(model, native[:4], 64)
        # vLLM-like rows: the store of the raw latent (no FP4 step) in place of every compressed-KV row.
        gen = torch.Generator().manual_seed(1)
        for kv, _index in split_blocks(sglang_v4.engine_geometry(model), raw_v4, 64).values():   # views: in place
            kv.copy_(sglang_v4.store_rows(realistic(kv.shape[0] * kv.shape[1], 512, gen).to(device)
                                          .to(torch.bfloat16)).reshape(kv.shape))
        raw_found = sglang_v4.v4_blocks_to_native(model, raw_v4, 64)
        bar.update(2)
    mb = v4.numel() / 1e6
    report.add(Figure.against(f"load transcode (model rows -> v4 blocks, {path})", load_s * 1e3, "ms",
                              "same-size copy (v4 bytes, on the device)", copy_s * 1e3))
    report.add(Figure.against(f"load transcode (model rows -> v4 blocks, {path})", load_s * 1e3, "ms",
                              "copy of the model-rows bytes (on the device)", native_copy_s * 1e3))
    report.add(Figure.against("load transcode against the restore", load_s * 1e3, "ms", restore, restore_s * 1e3))
    if store_s is not None:
        report.add(Figure.against("load transcode against the kvstore restore", load_s * 1e3, "ms",
                                  f"kvstore restore of the model-rows blocks ({store_path}, from a serve child)",
                                  store_s * 1e3))
    if path != "eager":
        report.add(Figure.against(f"load transcode, {path}", load_s * 1e3, "ms", "load transcode, eager gathers",
                                  eager_s * 1e3))
    if compiled_s is not None:
        report.add(Figure.against(f"load transcode, {path}", load_s * 1e3, "ms", "load transcode, compiled",
                                  compiled_s * 1e3))
    report.add(Figure.against(f"save transcode (v4 blocks -> model rows, checked, {path})", save_s * 1e3, "ms",
                              "same-size copy (v4 bytes, on the device)", copy_s * 1e3))
    report.add(Figure.against("save transcode against the restore", save_s * 1e3, "ms", restore, restore_s * 1e3))
    if path != "eager":
        report.add(Figure.against(f"save transcode, {path}", save_s * 1e3, "ms", "save transcode, eager gathers",
                                  eager_save_s * 1e3))
    if compiled_save_s is not None:
        report.add(Figure.against(f"save transcode, {path}", save_s * 1e3, "ms", "save transcode, compiled",
                                  compiled_save_s * 1e3))
    share = load_s / (restore_s + load_s)
    report.add(Figure(name="transcode share of a restore", value=round(100 * share, 2), unit="%"))
    if store_s is not None:
        report.add(Figure(name="transcode share of the kvstore restore", unit="%",
                          value=round(100 * load_s / (store_s + load_s), 2)))
    report.add(Figure(name="save transcode share of a restore", value=round(100 * save_s / (restore_s + save_s), 2),
                      unit="%"))
    report.add(Figure(name="exact blocks (SGLang rows of realistic latents)",
                      value=round(100 * int(got.exact.sum()) / max(1, got.exact.numel()), 3), unit="%"))
    report.add(Figure(name="exact rows (SGLang rows of realistic latents)",
                      value=round(100 * got.exact_rows / max(1, got.rows), 4), unit="%"))
    report.add(Figure(name="exact blocks (raw-latent rows, vLLM-like)",
                      value=round(100 * int(raw_found.exact.sum()) / max(1, raw_found.exact.numel()), 3), unit="%"))
    report.notes["path"] = path
    for kind, seconds_taken in compile_s.items():
        report.notes[f"first_{kind}_call_s"] = round(seconds_taken, 2)       # torch.compile's compile, once
    report.notes["v4_megabytes"] = round(mb, 1)
    report.notes["exact_blocks"] = f"{int(got.exact.sum())} of {got.exact.numel()}"
    report.notes["exact_rows"] = f"{got.exact_rows} of {got.rows} ({got.ambiguous_rows} with a collision)"
    report.notes["raw_latent_exact_blocks"] = f"{int(raw_found.exact.sum())} of {raw_found.exact.numel()}"
    report.notes["rows"] = "SGLang's store of the model's fake-quant of realistic latents (no real model run here)"
    report.notes["target"] = (f"load transcode < {TARGET_SHARE:.0%} of a 1M-token restore on the GPU: "
                              f"{'met' if share < TARGET_SHARE else 'not met'} here ({device}, {tokens} tokens)")
    return report
