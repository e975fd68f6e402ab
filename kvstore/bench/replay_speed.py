"""The speed part of `kvstore bench replay` (CUDA): GPU times, each beside its baseline.

On V4.1's layer pattern and cache geometry at a reduced hidden width
(replay.model.reduced_v41: 40 layers, window 128, head_dim 512, kv sources
2/8/14/20), on the model's own rows:

- bounded replay (128 tokens) against exact replay (40 x 128 = 5,120 tokens)
  at the same H, from the same rows restored out of stored blocks: the step
  captured in CUDA graphs (replay.model.graphs, the CUDA default) and the eager
  fused step (`model.graphs = False`) in the same run, with their GPU kernel
  times, kernel and graph launches, host syncs, and whether the two paths'
  logits are torch.equal;
- full prefill at a few lengths that fit (tokens/s), fitted as
  a + b n + c n^2 (the indexer scores every query against every earlier row,
  so prefill is quadratic in the end) and extrapolated to the resumed length;
  the decoder-side tail prefill at one length against the full prefill;
- the resume of a 1M-token conversation: its blocks (890 MB) fetched from a
  `kvstore serve` process over the shared-memory path into a pinned region
  (or, with --resume-path pinned, from a pinned host buffer), copied to the
  GPU, restored into a cache state and replayed over the last window; against
  the extrapolated full prefill of the same tokens. The rows are the model's
  own rows of a real prefill, tiled to the length (their values are valid;
  only their positions repeat).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.bench.report import Figure, Progress, Report


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gpu_s(fn: Callable[..., object], setup: Callable[[], Any] | None = None, repeat: int = 3) -> float:
    """Best wall seconds of fn (synchronized), `setup` run untimed before each call with its result passed."""
    best = float("inf")
    for _ in range(max(repeat, 1)):
        arg = setup() if setup else None
        _sync()
        start = time.perf_counter()
        fn(arg) if setup else fn()
        _sync()
        best = min(best, time.perf_counter() - start)
    return best


def _kernel_ms(fn: Callable[[Any], object], setup: Callable[[], Any]) -> float:
    """GPU busy time of one call (milliseconds of kernels and copies, from the profiler), setup untimed.

    The wall time of a short call also holds the host launching kernels and waiting on
    host syncs; an engine that captures the replay in a CUDA graph pays only this.
    """
    return _profile(fn, setup)[0]


def _profile(fn: Callable[[Any], object], setup: Callable[[], Any]) -> tuple[float, int, int]:
    """(GPU busy ms, kernels and graphs launched, host syncs) of one call, from the profiler; setup untimed.

    A CUDA graph's launch counts once (the host's cost), however many kernels it holds.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    arg = setup()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(arg)
        _sync()
    events = prof.key_averages()
    # Device events only: a CPU op's own entry repeats the device time of the kernels it launched.
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                          "cudaLaunchKernelExC", "cudaGraphLaunch", "cuGraphLaunch"))
    syncs = sum(e.count for e in events if e.key == "aten::_local_scalar_dense")
    return busy, launches, syncs


def _replay(model: Any, tokens: list[int], span: int, rows: Any) -> Any:
    return model.replay(tokens, rows, span=span)


def compare_paths(h: int = 8192, dim: int = 512, repeat: int = 5, seed: int = 0) -> dict[str, Any]:
    """Bounded (W tokens) against exact (layers x W) replay at H = `h` on reduced_v41, for the step captured
    in CUDA graphs (replay.model.graphs), the fused, sync-free step (replay.model.fast) and the per-layer
    reference step (`model.fused = False`), in one process: wall ms (best of `repeat`), GPU kernel ms,
    launches and host syncs, whether the graphs' logits equal the fused step's, and how far the fused and
    the reference paths' replayed windows are apart. What `scripts/device_replay.sh replay` prints."""
    import torch

    from replay.model import ReferenceModel, reduced_v41
    from replay.model.cache_io import restore_state, state_blocks

    config = reduced_v41(dim=dim)
    g = config.geometry
    model = ReferenceModel(config, device="cuda", batch_invariant=False)
    w, layers = g.window, g.num_layers
    tokens = [int(t) for t in np.random.default_rng(seed).integers(0, config.vocab_size, size=h)]
    out: dict[str, Any] = {"h": h, "dim": dim, "gpu": torch.cuda.get_device_name()}
    states = {}
    with torch.no_grad():
        cold = model.new_state()
        model.extend(cold, tokens)
        blocks = state_blocks(g, cold, 64)
        del cold

        def rows(_: object = None) -> Any:
            return restore_state(g, blocks, None, position=h, resume=h, device="cuda")

        logits = {}
        for path in ("reference", "fused", "graphs"):
            model.fused, model.graphs = path != "reference", path == "graphs"
            # exact replay (5,120 tokens) is never captured: the graphs path shares the fused one's
            spans = ((w, "bounded"),) if path == "graphs" else ((w, "bounded"), (layers * w, "exact"))
            for span, name in spans:
                run = functools.partial(_replay, model, tokens, span)
                for _ in range(2):  # warm-up (kernels built, packs made; graphs captured at the second step)
                    run(rows())
                wall = _gpu_s(run, rows, repeat if name == "bounded" else max(2, repeat // 2)) * 1e3
                busy, launches, syncs = _profile(run, rows)
                out[f"{path} {name}"] = {"tokens": span, "wall_ms": round(wall, 2), "kernel_ms": round(busy, 2),
                                         "launches": launches, "syncs": syncs}
            states[path], logits[path] = model.replay_logits(tokens, rows(), span=w)
            exact, bounded = out[f"{'fused' if path == 'graphs' else path} exact"], out[f"{path} bounded"]
            out[f"{path} ratio"] = {"wall": round(exact["wall_ms"] / bounded["wall_ms"], 2),
                                    "kernel": round(exact["kernel_ms"] / bounded["kernel_ms"], 2)}
        out["graphs vs fused: logits and window rows torch.equal"] = bool(
            torch.equal(logits["graphs"], logits["fused"])
            and all(torch.equal(x, y) for x, y in zip(states["graphs"].window_rows, states["fused"].window_rows,
                                                      strict=True)))
    from replay.model import ops

    a = torch.stack([ops.decode(r, "window") for r in states["fused"].window_rows])
    b = torch.stack([ops.decode(r, "window") for r in states["reference"].window_rows])
    out["fused vs reference window rows"] = {
        "relative error": float((a - b).norm() / b.norm()),
        "identical rows": float(sum(torch.equal(x, y) for f, r in zip(states["fused"].window_rows,
                                                                        states["reference"].window_rows, strict=True)
                                    for x, y in zip(f, r, strict=True)) / (layers * w))}
    return out


def speed(report: Report, args: argparse.Namespace, progress: Progress) -> None:
    """Replay and resume speed on the GPU; figures and notes into `report`."""
    import torch

    from replay.model import ReferenceModel, reduced_v41
    from replay.model.cache_io import restore_state, state_blocks

    device = args.speed_device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the speed part needs CUDA (run it on the GPU machine, or leave it out of --parts)")
    config = reduced_v41(dim=args.speed_dim)
    g = config.geometry
    model = ReferenceModel(config, device=device, batch_invariant=False)
    model.eval()
    w, layers, block_tokens = g.window, g.num_layers, 64
    rng = np.random.default_rng(args.seed)
    report.notes.update(speed_config=f"reduced_v41(dim={args.speed_dim}): {config.dim} hidden, {config.n_heads} "
                                     f"heads, top-k {config.index_topk}, {layers} layers, window {w}",
                        gpu=torch.cuda.get_device_name() if device == "cuda" else device)
    h = args.replay_at - args.replay_at % block_tokens
    tokens = [int(t) for t in rng.integers(0, config.vocab_size, size=h)]
    with torch.no_grad():
        cold = model.new_state()
        model.extend(cold, tokens)
        blocks = state_blocks(g, cold, block_tokens)
        del cold

        def rows(_: object = None) -> Any:
            return restore_state(g, blocks, None, position=h, resume=h, device=device)

        _replay_figures(report, model, tokens, rows, h, args.repeat, progress)
        sizes, fit = _prefill(report, model, args, rng, progress)
        target = args.resume_tokens - args.resume_tokens % block_tokens
        full_s = float(np.polyval(fit, target))
        report.notes.update(prefill_fit_s=f"t(n) = {fit[0]:.3e} n^2 + {fit[1]:.3e} n + {fit[2]:.3e}",
                            prefill_measured_tokens=sizes, prefill_extrapolated_tokens=target)
        _resume(report, model, blocks, target, block_tokens, full_s, sizes, args, rng, progress)


def _replay_figures(report: Report, model: Any, tokens: list[int], rows: Callable[[], Any], h: int, repeat: int,
                    progress: Progress) -> None:
    """Bounded replay through CUDA graphs and through the eager fused step, each against exact replay, in one
    run; kernel times, launches and syncs of each; whether the two bounded paths' logits are torch.equal."""
    import torch

    g = model.config.geometry
    w, layers = g.window, g.num_layers
    cuda = model.device.type == "cuda"
    paths = ("graphs", "eager") if cuda else ("eager",)
    walls: dict[str, float] = {}
    logits: dict[str, Any] = {}
    with progress.bar("replay: bounded (graphs, eager) and exact", len(paths) + 1, unit="path") as bar:
        for path in paths:
            model.graphs = path == "graphs"
            for _ in range(2):  # warm-up: a bucket's graphs are captured at its second step
                model.replay(tokens, rows(), span=w)
            walls[path] = _gpu_s(lambda st: model.replay(tokens, st, span=w), rows, repeat)
            logits[path] = model.replay_logits(tokens, rows(), span=w)[1]
            bar.update(1)
        exact = _gpu_s(lambda st: model.replay(tokens, st, span=layers * w), rows, repeat)  # never captured
        bar.update(1)
    label = f"{w} tokens at H={h:,}"
    exact_label = f"exact replay, {layers * w:,} tokens"
    if cuda:
        report.add(Figure.against(f"bounded replay, CUDA graphs, {label}", walls["graphs"] * 1e3, "ms", exact_label,
                                  exact * 1e3))
    report.add(Figure.against(f"bounded replay, eager fused step, {label}", walls["eager"] * 1e3, "ms", exact_label,
                              exact * 1e3))
    if not cuda:
        return
    report.add(Figure.against(f"bounded replay, CUDA graphs, {label}", walls["graphs"] * 1e3, "ms",
                              "the same, eager fused step", walls["eager"] * 1e3))
    exact_k = _kernel_ms(lambda st: model.replay(tokens, st, span=layers * w), rows)
    for path in paths:
        model.graphs = path == "graphs"
        try:
            busy, launches, syncs = _profile(lambda st: model.replay(tokens, st, span=w), rows)
        except Exception as exc:  # the profiler under graph replays: a failure costs its figures, not the run
            report.notes[f"bounded_replay_{path}_profile_error"] = f"{type(exc).__name__}: {exc}"
            continue
        name = "CUDA graphs" if path == "graphs" else "eager fused step"
        report.add(Figure.against(f"bounded replay GPU kernel time (profiler), {name}, {label}", busy, "ms",
                                  f"exact replay GPU kernel time, {layers * w:,} tokens", exact_k))
        report.notes[f"bounded_replay_{path}_launches"] = launches  # kernels, and each graph once
        report.notes[f"bounded_replay_{path}_host_syncs"] = syncs
    model.graphs = True
    report.notes.update(bounded_replay_graphs_equal_eager=bool(torch.equal(logits["graphs"], logits["eager"])),
                        bounded_replay_graph_buckets=len(model.step_graphs().buckets))


def _prefill(report: Report, model: Any, args: argparse.Namespace, rng: np.random.Generator,
             progress: Progress) -> tuple[list[int], np.ndarray]:
    """Full prefill at each size (tokens/s), the tail prefill at the middle one; the quadratic fit."""
    sizes = [int(s) for s in args.prefill_sizes.split(",")]
    times = []
    vocab = model.config.vocab_size
    with progress.bar("prefill", sum(sizes), unit="tok") as bar:
        for n in sizes:
            tokens = [int(t) for t in rng.integers(0, vocab, size=n)]
            seconds = _gpu_s(lambda tokens=tokens: model.extend(model.new_state(), tokens),
                             repeat=1 if n > 16384 else 2)
            times.append(seconds)
            report.add(Figure(name=f"full prefill, {n:,} tokens", value=n / seconds, unit="tokens/s"))
            bar.update(n)
    n = sizes[len(sizes) // 2]
    tokens = [int(t) for t in rng.integers(0, vocab, size=n)]
    tail = _gpu_s(lambda: model.extend(model.new_state(), tokens, tail_prefill=True), repeat=2)
    full = times[len(sizes) // 2]
    report.add(Figure.against(f"tail prefill, {n:,} tokens (decoder layers: last window only)", n / tail,
                              "tokens/s", "full prefill, same tokens", n / full))
    degree = min(2, len(sizes) - 1)
    fit = np.polyfit(np.array(sizes, dtype=np.float64), np.array(times), degree)
    fit = np.concatenate([np.zeros(3 - len(fit)), fit])
    if fit[0] < 0:  # a noisy fit bending down: extrapolate linearly from the largest size instead
        fit = np.array([0.0, times[-1] / sizes[-1], 0.0])
    return sizes, fit


def _resume(report: Report, model: Any, blocks: Any, target: int, block_tokens: int, full_s: float,
            sizes: list[int], args: argparse.Namespace, rng: np.random.Generator, progress: Progress) -> None:
    """Rows of `target` tokens into GPU memory, restored, then bounded replay; against the full prefill."""
    import torch

    from replay.model.cache_io import restore_state

    g = model.config.geometry
    n = target // block_tokens
    host = blocks.cpu().numpy()
    tiled = np.concatenate([host] * (-(-n // host.shape[0])))[:n]
    tokens = [int(t) for t in rng.integers(0, model.config.vocab_size, size=target)]
    steps: dict[str, float] = {}
    device = model.device
    if args.resume_path == "shm":
        gpu_blocks = _shm_fetch(tiled, tokens, block_tokens, device, steps, progress)
    else:
        host = torch.from_numpy(tiled)
        host = host.pin_memory() if device.type == "cuda" else host
        start = time.perf_counter()
        gpu_blocks = host.to(device, non_blocking=True)
        _sync()
        steps["pinned host -> GPU copy"] = time.perf_counter() - start
    with torch.no_grad():
        start = time.perf_counter()
        state = restore_state(g, gpu_blocks, None, position=target, resume=target, device=device)
        _sync()
        steps["restore (rows out of blocks)"] = time.perf_counter() - start
        start = time.perf_counter()
        model.replay(tokens, state, span=g.window)
        _sync()
        steps[f"bounded replay ({g.window} tokens)"] = time.perf_counter() - start
    total = sum(steps.values())
    how = "shm fetch from kvstore serve" if args.resume_path == "shm" else "pinned host buffer"
    report.add(Figure.against(f"resume {target:,} tokens ({how} + GPU copy + restore + bounded replay)", total,
                              "s", f"full prefill of {target:,} tokens, extrapolated from {sizes[-1]:,}", full_s))
    report.notes.update(resume_steps_s={k: round(v, 4) for k, v in steps.items()},
                        resume_bytes=int(tiled.nbytes), resume_path=how)


def _shm_fetch(tiled: np.ndarray, tokens: list[int], block_tokens: int, device: Any, steps: dict[str, float],
               progress: Progress) -> Any:
    """Store the blocks in a `kvstore serve` child, fetch them over shm into a pinned region, copy to the GPU."""
    from kvstore.bench.harness import scratch, serve_process
    from kvstore.client import Client

    n, block_bytes = tiled.shape
    with scratch() as folder, serve_process(folder / "store", tiled.nbytes, block_tokens) as target, \
            Client(target) as client:
        with progress.bar("put blocks", tiled.nbytes) as bar:
            parent = None
            for lo in range(0, n, 1024):
                hi = min(lo + 1024, n)
                result = client.put(tokens[: hi * block_tokens], [tiled[i].tobytes() for i in range(lo, hi)],
                                    first_block=lo, parent=parent)
                parent = result.block_hashes[-1]
                bar.update((hi - lo) * block_bytes)
        hashes = client.hashes(tokens)
        with client.transfer(path="shm") as session:
            region = session.register(tiled.nbytes)
            region.tensor().fill_(1)  # pre-fault, as a worker's long-lived region is
            pinned = region.pin()
            start = time.perf_counter()
            state = session.fetch(hashes, region, batch_descriptors=512)
            steps["shm fetch (server copies into the region)"] = time.perf_counter() - start
            if state.done_prefix != n:
                raise RuntimeError(f"shm fetch loaded {state.done_prefix} of {n} blocks")
            start = time.perf_counter()
            gpu = region.blocks(block_bytes, n).to(device, non_blocking=pinned)
            _sync()
            steps["region -> GPU copy" + ("" if pinned else " (region not pinned)")] = time.perf_counter() - start
    return gpu


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(compare_paths(*(int(a) for a in sys.argv[1:2])), indent=1))
