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
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.bench.report import Figure, Progress, Report
from replay.fidelity_budget import TABLE_FORMAT
from replay.fidelity_stats import FIGURES, interval, intervals, resume_values

#: The format of --write-resumes files (one shard's resumes, merged by `merge_resumes`).
RESUMES_FORMAT = 1

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
    """Measure every case at every span, and the tail prefill; figures, notes and tables into `report`.

    Every model (one per --weights file or --train-seed) sees the same resume points: one stream per
    prompt seed (--seeds), drawn alike for each model. Resumes go round-robin over models, seeds and
    cases, so --fidelity-minutes cuts them evenly. Each case and span gets its figures with intervals
    (replay/fidelity_stats.py) in `notes["fidelity_intervals"]`, and --write-table writes the table
    the planner reads (replay/fidelity_budget.py).
    """
    import torch

    from replay.corpus import corpus
    from replay.fidelity import Summary
    from replay.model import ReferenceModel

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    config, model_name = model_config(args)
    sources = weight_sources(args)
    models: list[tuple[str, Any]] = []
    for label, path in sources:
        model = ReferenceModel(config, device=device, batch_invariant=args.batch_invariant == "on")
        if path is not None:
            model.load_weights(path)
        model.eval()
        models.append((label, model))
    g = config.geometry
    w, layers = g.window, g.num_layers
    b = args.block_tokens or max(w // 2, 2)
    spans = [int(s) for s in args.spans.split(",")]
    seeds = prompt_seeds(args)
    text = np.frombuffer(corpus("eval"), dtype=np.uint8)
    labels = [f"{k}x window ({k * w} tokens)" for k in spans] + [f"exact replay vs full prefill ({layers * w})"]
    cases = chosen_cases(args.cases)
    results = {case.name: {label: Summary(name=f"{case.name}: {label}") for label in labels} for case in cases}
    groups: dict[str, list[tuple[str, int]]] = {case.name: [] for case in cases}
    tail = Summary(name="tail prefill vs full prefill")
    tail_prompts = args.prompts if args.tail_prompts < 0 else args.tail_prompts
    # One generator per (model, prompt seed), each seeded by the prompt seed: every model gets the same prompts.
    rngs = {(label, seed): np.random.default_rng(seed) for label, _ in models for seed in seeds}
    deadline = time.monotonic() + args.fidelity_minutes * 60 if args.fidelity_minutes > 0 else math.inf
    total = len(cases) * args.prompts * len(seeds) * len(models) + tail_prompts
    cut = False
    with torch.no_grad(), progress.bar("fidelity", total, unit="prompt") as bar:
        for _ in range(args.prompts):
            for label, model in models:
                for seed in seeds:
                    for case in cases:
                        if time.monotonic() > deadline:
                            cut = True
                            break
                        tokens, h, p = case.make(rngs[(label, seed)], text, w, b, args.max_windows)
                        _sample(model, tokens, h, p, b, spans, args.steps, results[case.name], labels)
                        groups[case.name].append((label, seed))
                        bar.update(1)
        tail_rng = np.random.default_rng(seeds[0])
        for _ in range(tail_prompts):
            if time.monotonic() > deadline:
                cut = True
                break
            _tail_sample(models[0][1], tail_rng, text, w, b, args.max_windows, args.steps, tail)
            bar.update(1)
    weights = ", ".join(label for label, _ in models)
    tables = _tables(results, labels, tail, f"{model_name}, {weights}", b, w, layers, args.steps)
    found = {c: {label: intervals(s.samples, groups[c]) for label, s in by.items()} for c, by in results.items()}
    tables["intervals"] = interval_table(found, labels, seeds, weights)
    report.notes.update(fidelity_model=model_name, fidelity_weights=weights, fidelity_device=device,
                        fidelity_invariant=args.batch_invariant,
                        fidelity_block_tokens=b,
                        fidelity_prompts_per_case=args.prompts, fidelity_steps=args.steps,
                        fidelity_seeds=seeds, fidelity_cut_by_deadline=cut,
                        fidelity={c: {k: s.to_dict() for k, s in v.items()} for c, v in results.items()},
                        fidelity_intervals=found,
                        fidelity_max_windows=args.max_windows, tail_prefill=tail.to_dict(),
                        cases={c.name: c.description for c in cases})
    report.notes.setdefault("tables", {}).update(tables)  # type: ignore[attr-defined]
    if args.write_table is not None:
        table = span_table(found, spans, labels, model=model_name, window=w, num_layers=layers, block_tokens=b,
                           steps=args.steps, seeds=seeds, weights=[label for label, _ in models], device=device,
                           command=_command_line(args), geometry=g)
        table["training_logs"] = {label: _training_log(path) for label, path in sources}
        args.write_table.parent.mkdir(parents=True, exist_ok=True)
        args.write_table.write_text(json.dumps(table, indent=1) + "\n")
        report.notes["fidelity_table_written"] = str(args.write_table)
    if args.write_resumes is not None:
        resumes = {
            "format": RESUMES_FORMAT, "model": model_name, "geometry": g.name, "geometry_config": g.to_config(),
            "window": w, "num_layers": layers, "block_tokens": b, "continued_tokens": args.steps, "spans": spans,
            "labels": labels, "prompt_seeds": seeds, "device": device, "command": _command_line(args),
            "cut_by_deadline": cut, "training_logs": {label: _training_log(path) for label, path in sources},
            "cases": {c: {"groups": [list(gr) for gr in groups[c]],
                          "values": {label: [resume_values(x) for x in s.samples] for label, s in by.items()}}
                      for c, by in results.items()}}
        args.write_resumes.parent.mkdir(parents=True, exist_ok=True)
        args.write_resumes.write_text(json.dumps(resumes) + "\n")
        report.notes["fidelity_resumes_written"] = str(args.write_resumes)
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


def model_config(args: argparse.Namespace) -> tuple[Any, str]:
    """(ModelConfig, name) of --model: "tiny", "reduced" (reduced_v41 at --speed-dim, seeded random weights)
    or a name of replay.model.config.NAMED_CONFIGS (the configurations scripts/train_tiny.py trains)."""
    from replay.model.config import NAMED_CONFIGS, reduced_v41

    if args.model == "reduced":
        return reduced_v41(dim=args.speed_dim), f"reduced_v41(dim={args.speed_dim})"
    return NAMED_CONFIGS[args.model], args.model


def merge_resumes(paths: list[Path], *, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The span table of several --write-resumes shards of one model (the same spans, cases and
    continuation): every resume of every shard pooled per case and span, each figure's interval
    recomputed over the pool (replay/fidelity_stats.py), the shards' seeds and training logs kept.

    Args:
        paths: the shard files.
        labels: a new name for a weights label (e.g. a device path -> "seed 0"); others are kept.

    Raises:
        ValueError: no shard, a file that is not a shard, or shards of different models or settings.
    """
    if not paths:
        raise ValueError("no shard files to merge")
    rename = dict(labels or {})
    shards = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("format") != RESUMES_FORMAT or "cases" not in data:
            raise ValueError(f"{path}: not a --write-resumes file of format {RESUMES_FORMAT}")
        shards.append(data)
    first = shards[0]
    same = ("model", "geometry_config", "window", "num_layers", "block_tokens", "continued_tokens", "spans", "labels")
    for path, data in zip(paths, shards, strict=True):
        differs = [k for k in same if data.get(k) != first.get(k)]
        if differs:
            raise ValueError(f"{path}: differs from {paths[0]} in {differs}: shards of one table share them")
    values: dict[str, dict[str, list[dict[str, float]]]] = {}
    groups: dict[str, list[tuple[str, int]]] = {}
    logs: dict[str, Any] = {}
    seeds: list[int] = []
    weights: list[str] = []
    for data in shards:  # a weights file with a training log is named by it, not by its path on the device
        for old, log in data.get("training_logs", {}).items():
            if old not in rename and log.get("seed") is not None:
                rename[old] = (f"train_tiny --config {log.get('config')} seed {log['seed']} "
                               f"({log.get('steps_done')} steps)")
    for data in shards:
        for old, log in data.get("training_logs", {}).items():
            logs[rename.get(old, old)] = log
        seeds += [s for s in data["prompt_seeds"] if s not in seeds]
        for case, got in data["cases"].items():
            named = [(rename.get(str(lab), str(lab)), int(seed)) for lab, seed in got["groups"]]
            weights += [lab for lab in dict.fromkeys(lab for lab, _ in named) if lab not in weights]
            groups.setdefault(case, []).extend(named)
            for label, rows in got["values"].items():
                values.setdefault(case, {}).setdefault(label, []).extend(rows)
    found = {case: {label: {name: interval(name, [r[name] for r in rows], groups[case]) for name in FIGURES}
                    for label, rows in by.items()} for case, by in values.items()}
    from kvstore.geometry import from_config as geometry_from_config
    geometry = geometry_from_config(first["geometry_config"], name=first["geometry"]) \
        if first.get("geometry_config") else None
    table = span_table(found, list(first["spans"]), list(first["labels"]), model=first["model"],
                       window=first["window"], num_layers=first["num_layers"], block_tokens=first["block_tokens"],
                       steps=first["continued_tokens"], seeds=seeds, weights=weights, device=first["device"],
                       command=f"{len(shards)} shards of: {first['command']}", geometry=geometry)
    table["training_logs"] = logs
    table["shards"] = len(shards)
    table["cut_by_deadline"] = any(d.get("cut_by_deadline") for d in shards)
    return table


def prompt_seeds(args: argparse.Namespace) -> list[int]:
    """The prompt seeds: --seeds (comma-separated), else --seed.

    Raises:
        SystemExit: a seed that is not an integer, or the same seed twice.
    """
    if not args.seeds:
        return [int(args.seed)]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds must name distinct integers, got {args.seeds!r}")
    return seeds


def weight_sources(args: argparse.Namespace) -> list[tuple[str, Path | None]]:
    """(label, weights file) of each model measured: every --weights file, every --train-seed's training
    (trained here, in parallel, unless already trained with the same arguments), or the seeded random weights.

    Raises:
        SystemExit: a --weights file that does not exist, a bad --train-seed, a training that failed.
    """
    out: list[tuple[str, Path | None]] = []
    for name in (n.strip() for n in str(args.weights or "").split(",")):
        if name:
            path = Path(name)
            if not path.is_file():
                raise SystemExit(f"--weights {name}: no such file")
            out.append((str(path), path))
    if args.train_seed:
        try:
            train_seeds = [int(s) for s in args.train_seed.split(",") if s.strip()]
        except ValueError:
            raise SystemExit(f"--train-seed must be comma-separated integers, got {args.train_seed!r}") from None
        model = getattr(args, "model", "tiny")
        what = "train_tiny" if model == "tiny" else f"train_tiny --config {model}"
        out += [(f"{what} seed {s} ({args.train_steps} steps)", p)
                for s, p in zip(train_seeds, train(args, train_seeds), strict=True)]
    return out or [("seeded random (no --weights given)", None)]


def train(args: argparse.Namespace, seeds: list[int]) -> list[Path]:
    """Weights of scripts/train_tiny.py at each seed, trained in parallel processes (one GPU holds them all:
    the tiny model is small); a file whose log records the same seed, steps and time limit is reused."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny.py"
    model = getattr(args, "model", "tiny")
    if model == "reduced":
        raise SystemExit("--train-seed trains a named config (--model tiny or reduced_v41-d256), not --model reduced")
    prefix = "tiny" if model == "tiny" else model
    paths = [args.train_dir / f"{prefix}-seed{s}-steps{args.train_steps}.pt" for s in seeds]
    running = []
    for seed, path in zip(seeds, paths, strict=True):
        log = path.with_suffix(".json")
        if path.is_file() and log.is_file():
            done = json.loads(log.read_text()).get("args", {})
            if done.get("seed") == seed and done.get("steps") == args.train_steps \
                    and done.get("max_minutes") == args.train_minutes:
                continue
        cmd = [sys.executable, str(script), "--out", str(path), "--seed", str(seed), "--steps",
               str(args.train_steps), "--max-minutes", str(args.train_minutes), "--config", model]
        if args.device not in ("auto", ""):
            cmd += ["--device", args.device]
        running.append((seed, subprocess.Popen(cmd, stdout=subprocess.DEVNULL)))
    for seed, proc in running:
        if proc.wait() != 0:
            raise SystemExit(f"training the tiny model at seed {seed} failed (exit {proc.returncode})")
    return paths


def _training_log(path: Path | None) -> dict[str, Any]:
    """What scripts/train_tiny.py logged beside a weights file (seed, steps done, held-out loss); {} if none."""
    log = path.with_suffix(".json") if path is not None else None
    if log is None or not log.is_file():
        return {}
    data = json.loads(log.read_text())
    return {"config": data.get("args", {}).get("config", "tiny"), "seed": data.get("args", {}).get("seed"),
            "steps_done": data.get("steps_done"),
            "held_out_loss": data.get("held_out_loss"), "device": data.get("device")}


def _command_line(args: argparse.Namespace) -> str:
    """The flags that shaped a table, as a command that regenerates it."""
    parts = ["kvstore bench replay --parts fidelity", f"--model {args.model}", f"--cases {args.cases!r}",
             f"--spans {args.spans}", f"--prompts {args.prompts}", f"--steps {args.steps}",
             f"--max-windows {args.max_windows}", f"--seeds {','.join(map(str, prompt_seeds(args)))}",
             f"--batch-invariant {args.batch_invariant}"]
    if args.train_seed:
        parts.append(f"--train-seed {args.train_seed} --train-steps {args.train_steps} "
                     f"--train-minutes {args.train_minutes:g}")
    if args.weights:
        parts.append(f"--weights {args.weights}")
    if args.fidelity_minutes:
        parts.append(f"--fidelity-minutes {args.fidelity_minutes:g}")
    return " ".join(parts)


#: Figures of the interval table: (key, heading, scale, format).
_SHOWN = (("one_minus_cosine", "1 - cosine (ppm)", 1e6, "{:.3g}"), ("kl_per_token", "KL per continued token (nats)",
          1.0, "{:.2e}"), ("top1_agreement", "continued top-1", 100.0, "{:.1f}%"),
          ("fastllm_pass", "fastllm pass", 100.0, "{:.1f}%"))


def interval_table(found: dict[str, dict[str, dict[str, Any]]], labels: list[str], seeds: list[int],
                   weights: str) -> str:
    """Markdown: each case and span's figures as mean [95% interval] and worst."""
    head = "| case | span | resumes | " + " | ".join(f"{h}: mean [95% CI], worst" for _, h, _, _ in _SHOWN) + " |"
    lines = [f"Fidelity with 95% bootstrap intervals over resumes (prompt seeds {seeds}; weights: {weights}); "
             "worst: the worst resume (pass rate: the worst seed group)", head, "|---|---|---|" + "---|" * len(_SHOWN)]
    for case, by_label in found.items():
        for label in labels:
            figs = by_label[label]
            cells = []
            for key, _, scale, fmt in _SHOWN:
                f = figs[key]
                cells.append(f"{fmt.format(f['mean'] * scale)} [{fmt.format(f['ci_low'] * scale)}, "
                             f"{fmt.format(f['ci_high'] * scale)}], {fmt.format(f['worst'] * scale)}")
            lines.append(f"| {case} | {label} | {figs['kl_per_token']['resumes']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def span_table(found: dict[str, dict[str, dict[str, Any]]], spans: list[int], labels: list[str], *, model: str,
               window: int, num_layers: int, block_tokens: int, steps: int, seeds: list[int], weights: list[str],
               device: str, command: str, geometry: Any = None) -> dict[str, Any]:
    """The planner's table (replay/fidelity_budget.py's format): per span in windows, per case, the figures.

    `geometry` (a ModelGeometry) names the cache geometry measured: a planner of that geometry picks the
    table (replay.fidelity_budget.table_for_geometry)."""
    where = {} if geometry is None else {"geometry": geometry.name, "geometry_config": geometry.to_config()}
    return {
        "format": TABLE_FORMAT, "model": model, **where, "window": window, "num_layers": num_layers,
        "block_tokens": block_tokens, "continued_tokens": steps, "prompt_seeds": seeds, "training": weights,
        "device": device, "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": command,
        "spans": {str(k): {case: by_label[label] for case, by_label in found.items()}
                  for k, label in zip(spans, labels, strict=False)},
    }


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
