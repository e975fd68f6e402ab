"""The fidelity part of `kvstore bench replay`: bounded against exact replay, tail prefill against full.

Tiny configuration (window W = 8, 5 layers: exact replay spans 40 tokens),
blocks of W/2 tokens (V4.1's 64 against a window of 128), prompts cut from
held-out standard-library text (replay/corpus.py). A resume point is a prompt
of P tokens whose first H (a block multiple, H > W) are stored; one sample:

1. a full prefill of [0, H) gives the rows, stored as blocks through the codec
   (replay.model.cache_io) and restored with an empty window, as the worker
   gets them from the store;
2. exact replay (span min(L x W, H)) and bounded replays (span k x W) rebuild
   the window at H from those rows;
3. each is fed [H, P) and the exact state's greedy continuation
   (replay/fidelity.py), and compared with the exact side.
The full prefill itself is compared with exact replay too: the sanity line,
zero error unless the replay is wrong.

Cases: "random" (H and P drawn), and the boundaries DeepSeek calls untested:
the prompt ending one token past a block boundary or inside a block, odd and
even prompt lengths, H just above the window, a short turn after long ones,
and a resume right after a long tool output (hex bytes unlike the text).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.bench.report import Figure, Progress, Report

#: (tokens, H, P) of one resume point, from the random source, the text, the window, the block size and
#: the longest prefix in windows (--max-windows).
Maker = Callable[[np.random.Generator, np.ndarray, int, int, int], tuple[list[int], int, int]]


@dataclass(frozen=True)
class Case:
    """One family of resume points."""

    name: str
    description: str
    make: Maker


def _text(rng: np.random.Generator, text: np.ndarray, n: int) -> list[int]:
    start = int(rng.integers(0, len(text) - n - 1))
    return [int(t) for t in text[start:start + n]]


def _h(rng: np.random.Generator, w: int, b: int, lo_windows: int = 2, hi_windows: int = 24) -> int:
    """A block multiple in (lo x W, hi x W]."""
    return b * int(rng.integers(lo_windows * w // b + 1, hi_windows * w // b + 1))


def _tool_output(rng: np.random.Generator, n: int) -> list[int]:
    """n tokens of a hex dump of random bytes: a run unlike source code."""
    digits = b"0123456789abcdef"
    out = bytearray()
    while len(out) < n:
        out += b" ".join(bytes((digits[x >> 4], digits[x & 15])) for x in rng.integers(0, 256, 16)) + b"\n"
    return list(out[:n])


def _random(rng: np.random.Generator, text: np.ndarray, w: int, b: int, hi: int) -> tuple[list[int], int, int]:
    h = _h(rng, w, b, 2, hi // 2)
    p = h + int(rng.integers(1, 2 * w + 1))
    return _text(rng, text, p), h, p


def _offset(offset: Callable[[int, int], int]) -> Maker:
    def make(rng: np.random.Generator, text: np.ndarray, w: int, b: int, hi: int) -> tuple[list[int], int, int]:
        h = _h(rng, w, b, 2, hi // 2)
        p = h + offset(w, b)
        return _text(rng, text, p), h, p
    return make


def _above_window(rng: np.random.Generator, text: np.ndarray, w: int, b: int,
                  hi: int) -> tuple[list[int], int, int]:
    h = (w // b + 1) * b
    p = h + b // 2 + 1
    return _text(rng, text, p), h, p


def _short_after_long(rng: np.random.Generator, text: np.ndarray, w: int, b: int,
                      hi: int) -> tuple[list[int], int, int]:
    h = _h(rng, w, b, hi - hi // 6, hi)
    p = h + 2
    return _text(rng, text, p), h, p


def _after_tool(rng: np.random.Generator, text: np.ndarray, w: int, b: int, hi: int) -> tuple[list[int], int, int]:
    h = _h(rng, w, b, 5, max(hi // 2, 6))
    p = h + w // 2
    tokens = _text(rng, text, p)
    run = 4 * w
    tokens[h - run:h] = _tool_output(rng, run)
    return tokens, h, p


CASES: tuple[Case, ...] = (
    Case("random", "H a block multiple in (2W, M/2 x W], P - H in [1, 2W]", _random),
    Case("block boundary", "prompt ends one token past a block boundary: P = H + 1", _offset(lambda w, b: 1)),
    Case("inside a block", "prompt ends inside a block: P = H + B/2 + 1", _offset(lambda w, b: b // 2 + 1)),
    Case("even T", "even prompt length: P = H + W/2", _offset(lambda w, b: w // 2)),
    Case("odd T", "odd prompt length (a raw tail at P): P = H + W/2 + 1", _offset(lambda w, b: w // 2 + 1)),
    Case("T just above the window", "H = W + B, the shortest hit adopted; P = H + B/2 + 1", _above_window),
    Case("short turn after long ones", "H in (5M/6 x W, M x W], a 2-token turn", _short_after_long),
    Case("after a long tool output", "H in (5W, M/2 x W], [H - 4W, H) a hex dump, P = H + W/2", _after_tool),
)


def chosen_cases(names: str) -> list[Case]:
    """The cases named (comma-separated; "all" for every one), in CASES order.

    Raises:
        SystemExit: an unknown name (the message lists the known ones).
    """
    if names == "all":
        return list(CASES)
    if names == "none":
        return []
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; choose from: {', '.join(c.name for c in CASES)}")
    return [c for c in CASES if c.name in wanted]


def fidelity(report: Report, args: argparse.Namespace, progress: Progress) -> None:
    """Measure every case at every span, and the tail prefill; figures, notes and tables into `report`."""
    import torch

    from replay.corpus import corpus
    from replay.fidelity import Summary
    from replay.model import TINY_MODEL, ReferenceModel, reduced_v41

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    config = TINY_MODEL if args.model == "tiny" else reduced_v41(dim=args.speed_dim)
    model = ReferenceModel(config, device=device, batch_invariant=args.batch_invariant == "on")
    if args.weights:
        model.load_weights(args.weights)
    model.eval()
    g = config.geometry
    w, layers = g.window, g.num_layers
    b = args.block_tokens or max(w // 2, 2)
    spans = [int(s) for s in args.spans.split(",")]
    text = np.frombuffer(corpus("eval"), dtype=np.uint8)
    rng = np.random.default_rng(args.seed)
    labels = [f"{k}x window ({k * w} tokens)" for k in spans] + [f"exact replay vs full prefill ({layers * w})"]
    cases = chosen_cases(args.cases)
    results = {case.name: {label: Summary(name=f"{case.name}: {label}") for label in labels} for case in cases}
    tail = Summary(name="tail prefill vs full prefill")
    tail_prompts = args.prompts if args.tail_prompts < 0 else args.tail_prompts
    total = len(cases) * args.prompts + tail_prompts
    with torch.no_grad(), progress.bar("fidelity", total, unit="prompt") as bar:
        for case in cases:
            for _ in range(args.prompts):
                tokens, h, p = case.make(rng, text, w, b, args.max_windows)
                _sample(model, tokens, h, p, b, spans, args.steps, results[case.name], labels)
                bar.update(1)
        for _ in range(tail_prompts):
            _tail_sample(model, rng, text, w, b, args.max_windows, args.steps, tail)
            bar.update(1)
    weights = str(args.weights) if args.weights else "seeded random (no --weights given)"
    model_name = "tiny" if args.model == "tiny" else f"reduced_v41(dim={args.speed_dim})"
    tables = _tables(results, labels, tail, f"{model_name}, {weights}", b, w, layers, args.steps)
    report.notes.update(fidelity_model=model_name, fidelity_weights=weights, fidelity_device=device,
                        fidelity_invariant=args.batch_invariant,
                        fidelity_block_tokens=b,
                        fidelity_prompts_per_case=args.prompts, fidelity_steps=args.steps,
                        fidelity={c: {k: s.to_dict() for k, s in v.items()} for c, v in results.items()},
                        fidelity_max_windows=args.max_windows, tail_prefill=tail.to_dict(),
                        cases={c.name: c.description for c in cases})
    report.notes.setdefault("tables", {}).update(tables)  # type: ignore[attr-defined]
    if results:
        main = next(iter(results))
        sanity = _headline(results[main][labels[-1]].to_dict())
        for k, label in zip(spans, labels, strict=False):
            for key, (value, unit) in _headline(results[main][label].to_dict()).items():
                report.add(Figure(name=f"bounded replay {k}x window, {main}: {key}", value=value, unit=unit,
                                  baseline="exact replay vs full prefill", baseline_value=sanity[key][0]))
    if tail.samples:
        for key, (value, unit) in _headline(tail.to_dict()).items():
            report.add(Figure(name=f"tail prefill vs full prefill: {key}", value=value, unit=unit))


def _headline(d: dict[str, Any]) -> dict[str, tuple[float, str]]:
    """The figures of one summary, scaled so a table of 3 decimals shows them: name -> (value, unit)."""
    return {"1 - cosine, mean": ((1.0 - float(d["cosine_mean"])) * 1e6, "ppm"),
            "KL per continued token, mean": (float(d["kl_mean"]) * 1e6, "unat"),  # micro-nats
            "top-1 agreement": (float(d["top1_agreement"]), "share")}


def _sample(model: Any, tokens: list[int], h: int, p: int, b: int, spans: list[int], steps: int,
            summaries: dict[str, Any], labels: list[str]) -> None:
    from replay.fidelity import measure, reference
    from replay.model.cache_io import restore_state, state_blocks

    g = model.config.geometry
    cold = model.new_state()
    model.extend(cold, tokens[:h])
    blocks = state_blocks(g, cold, b)

    def rows() -> Any:
        return restore_state(g, blocks, None, position=h, resume=h, device=cold.window_rows[0].device)

    exact = model.replay(tokens[:h], rows(), span=min(g.num_layers * g.window, h))
    ref = reference(model, copy.deepcopy(exact), tokens[h:p], steps=steps)
    for k, label in zip(spans, labels, strict=False):
        approx = model.replay(tokens[:h], rows(), span=k * g.window)
        summaries[label].add(measure(model, approx, ref, tokens[h:p]))
    summaries[labels[-1]].add(measure(model, cold, ref, tokens[h:p]))


def _tail_sample(model: Any, rng: np.random.Generator, text: np.ndarray, w: int, b: int, hi: int, steps: int,
                 summary: Any) -> None:
    """A prefix (empty half the time), then a new input of 2W to 8W tokens with and without tail prefill."""
    from replay.fidelity import measure, reference

    h = 0 if rng.random() < 0.5 else _h(rng, w, b, 2, hi // 2)
    p = h + int(rng.integers(2 * w, 8 * w + 1))
    tokens = _text(rng, text, p)
    state = model.new_state()
    if h:
        model.extend(state, tokens[:h])
    ref = reference(model, copy.deepcopy(state), tokens[h:p], steps=steps)
    summary.add(measure(model, state, ref, tokens[h:p], tail_prefill=True))


def _tables(results: dict[str, dict[str, Any]], labels: list[str], tail: Any, weights: str, b: int, w: int,
            layers: int, steps: int) -> dict[str, str]:
    """Markdown tables: the main one (random case, every span), the boundary cases, per-layer errors."""
    head = ("| setting | n | window err at H (mean / max) | after prompt | cosine (mean / min) | "
            f"max diff / range (mean / max) | top-1 | KL over {steps} tokens (mean / max) | continued top-1 | "
            "fastllm pass |\n"
            "|---|---|---|---|---|---|---|---|---|---|")

    def row(name: str, d: dict[str, Any]) -> str:
        return (f"| {name} | {d['samples']} | {d['window_error_mean']:.3g} / {d['window_error_max']:.3g} | "
                f"{d['window_error_after_mean']:.3g} | {d['cosine_mean']:.5f} / {d['cosine_min']:.5f} | "
                f"{d['max_diff_of_range_mean']:.4f} / {d['max_diff_of_range_max']:.4f} | "
                f"{d['top1_agreement']:.1%} | {d['kl_mean']:.2e} / {d['kl_max']:.2e} | "
                f"{d['continued_top1_agreement']:.1%} | {d['pass_fastllm']:.0%} |")

    title = f"weights: {weights}; W = {w}, {layers} layers, blocks of {b}"
    first = next(iter(results), None)
    main = [f"Bounded vs exact replay, {first} resume points ({title})", head]
    main += [row(label, results[first][label].to_dict()) for label in labels] if first else []
    main += [row("tail prefill vs full prefill", tail.to_dict())] if tail.samples else []
    cases = [f"Boundary cases ({title})", head]
    for name, by_label in results.items():
        cases += [row(f"{name}: {label}", s.to_dict()) for label, s in by_label.items() if label != labels[-1]]
    per_layer = [f"Window KV error per layer at H, {first} case ({title})",
                 "| span | " + " | ".join(f"layer {i}" for i in range(layers)) + " |",
                 "|---|" + "---|" * layers]
    for label in labels if first is not None else []:
        errs = results[str(first)][label].layer_errors()
        per_layer.append(f"| {label} | " + " | ".join(f"{e:.3g}" for e in errs) + " |")
    return {"fidelity": "\n".join(main), "boundaries": "\n".join(cases), "per_layer": "\n".join(per_layer)}
